"""Grid correspondences, normals, normal equations and ICP against references and real data."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.hetero import (
    HeteroError,
    align,
    apply_increment,
    build_grid,
    estimate_normals,
    nearest_neighbors,
    normal_equations,
    voxel_downsample,
)
from adcloud.hetero.devices import ComputeDevice

pytestmark = pytest.mark.opencl


def rigid(yaw: float, translation: tuple[float, float, float]) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    matrix = np.eye(4)
    matrix[:3, :3] = [[c, -s, 0], [s, c, 0], [0, 0, 1]]
    matrix[:3, 3] = translation
    return matrix


def errors(estimate: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(translation error m, rotation error deg) of ``estimate`` against ``reference``."""
    delta = np.linalg.inv(reference) @ estimate
    angle = np.degrees(np.arccos(np.clip((np.trace(delta[:3, :3]) - 1) / 2, -1, 1)))
    return float(np.linalg.norm(delta[:3, 3])), float(angle)


def brute_nearest(
    queries: np.ndarray, target: np.ndarray, radius: float
) -> tuple[np.ndarray, np.ndarray]:
    d2 = ((queries[:, None, :3].astype(np.float64) - target[None, :, :3]) ** 2).sum(-1)
    index = d2.argmin(axis=1)
    best = np.sqrt(d2[np.arange(len(queries)), index])
    return np.where(best <= radius, index, -1), np.where(best <= radius, best, np.inf)


def test_correspondences_are_the_exact_nearest_within_the_radius(device: ComputeDevice) -> None:
    rng = np.random.default_rng(5)
    target = rng.uniform(-10, 10, (3000, 3)).astype(np.float32)
    queries = rng.uniform(-11, 11, (2000, 3)).astype(np.float32)
    got = nearest_neighbors(queries, target, 0.6, device=device)
    index, distance = brute_nearest(queries, target, 0.6)
    np.testing.assert_array_equal(got.index >= 0, index >= 0)
    found = index >= 0
    np.testing.assert_allclose(got.distance[found], distance[found], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.index[found], index[found])
    assert np.isinf(got.distance[~found]).all()


def test_device_and_reference_agree_on_a_real_scan(device: ComputeDevice, scan_pair: tuple) -> None:
    source, target, reference = scan_pair
    grid = build_grid(target, 0.5)
    queries = source[::4]
    got = nearest_neighbors(queries, grid, 0.5, transform=reference, device=device)
    want = nearest_neighbors(queries, grid, 0.5, transform=reference, device="numpy")
    agree = got.index == want.index
    assert agree.mean() > 0.9999  # float32 rounding may flip a tie or the radius edge
    np.testing.assert_allclose(got.distance[agree], want.distance[agree], atol=1e-5)
    assert (got.index >= 0).mean() > 0.9


def test_grid_search_cost_is_not_brute_force() -> None:
    grid = build_grid(np.random.default_rng(6).uniform(0, 100, (50_000, 3)), 1.0)
    assert grid.cell_count.max() < 100  # a query looks at 27 small cells, not 50,000 points
    assert len(grid.order) == 50_000
    np.testing.assert_array_equal(np.sort(grid.order), np.arange(50_000))


def test_edge_cases(device: ComputeDevice) -> None:
    target = np.array([[0, 0, 0], [1, 0, 0], [np.nan, 0, 0]], np.float32)
    queries = np.array(
        [[0.1, 0, 0], [np.nan, 0, 0], [1e30, 0, 0], [0.9, 0, 0], [5, 5, 5]], np.float32
    )
    got = nearest_neighbors(queries, target, 0.5, device=device)
    np.testing.assert_array_equal(got.index, [0, -1, -1, 1, -1])
    empty = nearest_neighbors(np.empty((0, 3), np.float32), target, 0.5, device=device)
    assert empty.index.shape == (0,)
    none = nearest_neighbors(queries, np.empty((0, 3), np.float32), 0.5, device=device)
    assert (none.index == -1).all()
    one = nearest_neighbors(queries[:1], target[:1], 0.5, device=device)
    np.testing.assert_array_equal(one.index, [0])
    with pytest.raises(HeteroError, match="exceeds the grid cell"):
        nearest_neighbors(queries, build_grid(target, 0.5), 0.8, device=device)


def test_huge_coordinates_are_handled_in_a_local_frame(device: ComputeDevice) -> None:
    rng = np.random.default_rng(7)
    target = rng.uniform(0, 20, (2000, 3)) + np.array([5.0e5, 4.1e6, 50.0])
    queries = target[:500] + rng.normal(0, 0.05, (500, 3))
    got = nearest_neighbors(queries, target, 0.5, device=device)
    index, _ = brute_nearest(queries - target[0], target - target[0], 0.5)
    np.testing.assert_array_equal(got.index, index)


def test_float32_geo_referenced_queries_match_as_the_reference_does(device: ComputeDevice) -> None:
    """float32 queries were moved on the device with their full UTM-size translation in
    float32 (decimetres lost), so 21 of 500 rotated queries matched other points than the
    float64 reference found, at distances off by up to the whole radius."""
    rng = np.random.default_rng(0)
    base = np.array([5.0e5, 4.0e6, 10.0])
    target64 = base + rng.uniform(-20, 20, (20_000, 3))
    about_base = rigid(0.0, tuple(base)) @ rigid(0.3, (0, 0, 0)) @ rigid(0.0, tuple(-base))
    moved_back = np.c_[target64[:500], np.ones(500)] @ np.linalg.inv(about_base).T
    queries = (moved_back[:, :3] + rng.normal(0, 0.01, (500, 3))).astype(np.float32)
    target = target64.astype(np.float32)
    got = nearest_neighbors(queries, target, 0.5, transform=about_base, device=device)
    want = nearest_neighbors(queries, target, 0.5, transform=about_base, device="numpy")
    np.testing.assert_array_equal(got.index, want.index)
    np.testing.assert_allclose(got.distance, want.distance, atol=1e-4)
    assert (got.index >= 0).mean() > 0.95


def plane_cloud(rng: np.random.Generator, n: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Points on the tilted plane z = 0.3 x - 0.2 y, and its unit normal."""
    xy = rng.uniform(-5, 5, (n, 2))
    z = 0.3 * xy[:, 0] - 0.2 * xy[:, 1] + rng.normal(0, 0.002, n)
    normal = np.array([-0.3, 0.2, 1.0])
    return np.column_stack([xy, z]).astype(np.float32), normal / np.linalg.norm(normal)


def test_normals_of_a_plane(device: ComputeDevice) -> None:
    points, normal = plane_cloud(np.random.default_rng(8))
    got = estimate_normals(points, 0.5, viewpoint=np.array([0.0, 0.0, 20.0]), device=device)
    finite = np.isfinite(got).all(axis=1)
    assert finite.mean() > 0.99
    np.testing.assert_allclose(np.linalg.norm(got[finite], axis=1), 1.0, atol=1e-4)
    assert (got[finite] @ normal > 0.999).all()  # unit, and oriented towards the viewpoint


def test_normals_match_the_reference_on_a_real_scan(
    device: ComputeDevice, scan_pair: tuple
) -> None:
    _, target, _ = scan_pair
    got = estimate_normals(target[::3], 0.5, device=device)
    want = estimate_normals(target[::3], 0.5, device="numpy")
    both = np.isfinite(got).all(axis=1) & np.isfinite(want).all(axis=1)
    assert (np.isfinite(got).all(axis=1) == np.isfinite(want).all(axis=1)).mean() > 0.999
    cos = np.abs(np.einsum("ij,ij->i", got[both], want[both]))
    assert np.quantile(cos, 0.01) > 0.99  # ill-conditioned (line-like) patches may differ


def test_normals_edge_cases(device: ComputeDevice) -> None:
    assert estimate_normals(np.empty((0, 3), np.float32), 0.5, device=device).shape == (0, 3)
    lonely = estimate_normals(np.array([[0, 0, 0], [np.nan, 0, 0]], np.float32), 0.5, device=device)
    assert np.isnan(lonely).all()


def test_normal_equations_match_the_reference(device: ComputeDevice, scan_pair: tuple) -> None:
    source, target, reference = scan_pair
    source = voxel_downsample(source[:, :3], 0.25, device="numpy").points
    target = voxel_downsample(target[:, :3], 0.25, device="numpy").points
    grid = build_grid(target, 1.0)
    normals = estimate_normals(target, 0.6, device="numpy")
    start = rigid(0.01, (0.4, 0.1, 0.0))
    matches = nearest_neighbors(source, grid, 1.0, transform=start, device="numpy")
    for huber in (0.0, 0.1):
        got = normal_equations(
            source, grid, normals, matches.index, start, huber=huber, device=device
        )
        want = normal_equations(
            source, grid, normals, matches.index, start, huber=huber, device="numpy"
        )
        assert got.count == want.count > 1000
        scale = np.abs(want.jtj).max()
        np.testing.assert_allclose(got.jtj, want.jtj, atol=2e-4 * scale)
        np.testing.assert_allclose(got.jtr, want.jtr, atol=2e-4 * np.abs(want.jtr).max())
        assert got.cost == pytest.approx(want.cost, rel=1e-3)
    # One Gauss-Newton step from `start` moves towards the reference.
    xi = np.linalg.solve(want.jtj, -want.jtr)
    stepped = apply_increment(start, xi, grid.origin)
    assert errors(stepped, reference)[0] < errors(start, reference)[0]


def test_normal_equations_without_matches(device: ComputeDevice) -> None:
    grid = build_grid(np.zeros((3, 3), np.float32), 1.0)
    system = normal_equations(
        np.ones((4, 3), np.float32),
        grid,
        np.full((3, 3), np.nan, np.float32),
        np.array([0, -1, 2, 1]),
        np.eye(4),
        device=device,
    )
    assert system.count == 0 and not system.jtj.any()


@pytest.mark.parametrize("bad", [3, 7, -2])
def test_normal_equations_refuse_an_index_that_is_not_a_target_row(
    device: ComputeDevice, bad: int
) -> None:
    # 3 and 7 raised a raw IndexError; -2 was silently taken as "unmatched"
    grid = build_grid(np.zeros((3, 3), np.float32), 1.0)
    with pytest.raises(HeteroError, match=rf"index\[2\] = {bad} is not a target row \(0\.\.2\)"):
        normal_equations(
            np.ones((4, 3), np.float32),
            grid,
            np.zeros((3, 3), np.float32),
            np.array([0, -1, bad, 1]),
            np.eye(4),
            device=device,
        )


@pytest.mark.parametrize("viewpoint", [[0.0, 0.0], [0.0, 0.0, float("nan")], "abc", [[1, 2, 3]]])
def test_estimate_normals_refuses_a_viewpoint_that_is_not_a_position(
    device: ComputeDevice, viewpoint: object
) -> None:
    plane = np.random.default_rng(4).uniform(-1, 1, (200, 3)).astype(np.float32)
    plane[:, 2] = 0
    with pytest.raises(HeteroError, match="viewpoint must be"):
        estimate_normals(plane, 0.5, viewpoint=viewpoint, device=device)  # type: ignore[arg-type]
    up = estimate_normals(plane, 0.5, viewpoint=(0.0, 0.0, 5.0), device=device)
    assert np.nanmin(up[:, 2]) > 0.99


def test_align_recovers_the_reference_of_the_real_scan_pair(
    device: ComputeDevice, scan_pair: tuple
) -> None:
    source, target, reference = scan_pair
    result = align(source, target, device=device)
    translation, rotation = errors(result.transform, reference)
    assert translation < 0.03, translation
    assert rotation < 0.3, rotation
    assert result.converged
    assert result.device == device.info.address
    assert result.fitness > 0.7


def test_reference_align_recovers_it_too(scan_pair: tuple) -> None:
    source, target, reference = scan_pair
    result = align(source, target, device="numpy")
    translation, rotation = errors(result.transform, reference)
    assert translation < 0.03 and rotation < 0.3


def test_one_grid_for_normals_and_matches_gives_the_alignment_of_two(
    device: ComputeDevice, scan_pair: tuple
) -> None:
    # With the normal radius equal to the match distance, align estimates the normals on
    # its matching grid; a radius a hair larger takes the separate grid of estimate_normals.
    source, target, _ = scan_pair
    guess = rigid(0.01, (0.2, -0.1, 0.0))
    one = align(source, target, guess, max_distance=1.0, normal_radius=1.0, device=device)
    two = align(source, target, guess, max_distance=1.0, normal_radius=1.0 + 1e-9, device=device)
    np.testing.assert_allclose(one.transform, two.transform, atol=1e-6)
    assert (one.iterations, one.inliers) == (two.iterations, two.inliers)


def test_align_a_synthetic_scene_with_a_known_motion(device: ComputeDevice) -> None:
    rng = np.random.default_rng(9)
    floor = np.column_stack([rng.uniform(-10, 10, (3000, 2)), rng.normal(0, 0.003, 3000)])
    wall_x = np.column_stack(
        [np.full(1500, 8.0), rng.uniform(-10, 10, 1500), rng.uniform(0, 3, 1500)]
    )
    wall_y = np.column_stack(
        [rng.uniform(-10, 10, 1500), np.full(1500, -7.0), rng.uniform(0, 3, 1500)]
    )
    box = np.column_stack([rng.uniform(1, 2, 800), rng.uniform(1, 2, 800), rng.uniform(0, 1, 800)])
    target = np.concatenate([floor, wall_x, wall_y, box])
    truth = rigid(0.05, (0.3, -0.2, 0.05))
    source = (np.linalg.inv(truth)[:3, :3] @ target.T).T + np.linalg.inv(truth)[:3, 3]
    result = align(source, target, voxel_size=0.1, max_distance=0.8, device=device)
    translation, rotation = errors(result.transform, truth)
    assert translation < 0.02 and rotation < 0.1


def test_align_needs_overlap(device: ComputeDevice) -> None:
    cloud = np.random.default_rng(10).uniform(0, 5, (500, 3))
    with pytest.raises(HeteroError, match="correspondences"):
        align(cloud, cloud + 100.0, device=device)
    with pytest.raises(HeteroError, match="too few points"):
        align(cloud[:3], cloud, device=device)


@pytest.mark.parametrize("voxel_size", [-0.25, float("nan"), "0.25"])
def test_align_refuses_a_bad_voxel_size(voxel_size: float) -> None:
    # a negative size used to skip the downsampling silently (as 0 does)
    cloud = np.random.default_rng(11).uniform(0, 5, (500, 3))
    with pytest.raises(HeteroError, match="voxel_size must be 0"):
        align(cloud, cloud, voxel_size=voxel_size, device="numpy")


def _scene(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    floor = np.column_stack([rng.uniform(-10, 10, (3000, 2)), np.zeros(3000)])
    wall = np.column_stack(
        [np.full(1000, 5.0), rng.uniform(-10, 10, 1000), rng.uniform(0, 3, 1000)]
    )
    return np.concatenate([floor, wall])


def test_align_with_no_iterations_evaluates_the_initial_guess(device: ComputeDevice) -> None:
    # it reported rmse 0 over 0 inliers, a perfect fit, whatever the guess
    target = _scene(12)
    source = target - [0.3, 0.0, 0.05]  # off by 5 cm along the floor's normal
    guess = rigid(0.0, (0.3, 0.0, 0.0))
    result = align(source, target, guess, iterations=0, huber=0.0, device=device)
    np.testing.assert_array_equal(result.transform, guess)
    assert (result.iterations, result.converged) == (0, False)
    assert result.inliers > 0.9 * len(voxel_downsample(source, 0.25, device="numpy").points)
    assert result.fitness > 0.9
    assert 0.03 < result.rmse < 0.06
    reference = align(source, target, guess, iterations=0, huber=0.0, device="numpy")
    assert result.inliers == reference.inliers
    assert result.rmse == pytest.approx(reference.rmse, rel=1e-4)


@pytest.mark.parametrize("iterations", [-1, 2.5, True])
def test_align_refuses_bad_iterations(iterations: object) -> None:
    cloud = _scene(13)
    with pytest.raises(HeteroError, match="iterations must be a whole number >= 0"):
        align(cloud, cloud, iterations=iterations, device="numpy")  # type: ignore[arg-type]


def test_align_with_a_target_too_sparse_for_normals_says_so(device: ComputeDevice) -> None:
    # every match was dropped for its NaN normal, and the error blamed the initial guess
    target = _scene(14)[::100]  # 40 points metres apart: none has 5 neighbours in 0.3 m
    with pytest.raises(HeteroError, match=r"no target point has a normal.*normal_radius 0\.3 m"):
        align(_scene(14), target, voxel_size=0, device=device)
