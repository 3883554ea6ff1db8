"""Voxel-grid downsampling on every OpenCL device (both strategies) against the NumPy
reference."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.hetero import HeteroError, voxel_downsample
from adcloud.hetero.devices import ComputeDevice

pytestmark = pytest.mark.opencl

STRATEGIES = ("atomic", "binned")


def brute_force(points: np.ndarray, size: float) -> dict[tuple[int, int, int], np.ndarray]:
    """Voxel -> mean of its points, by a Python dict (a second, independent reference)."""
    groups: dict[tuple[int, int, int], list[np.ndarray]] = {}
    for row in points.astype(np.float64):
        if not np.isfinite(row[:3]).all():
            continue
        key = tuple(int(v) for v in np.floor(row[:3] / size))
        groups.setdefault(key, []).append(row)  # type: ignore[arg-type]
    return {k: np.mean(v, axis=0) for k, v in groups.items()}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_matches_the_reference_on_a_cloud_with_intensity(
    device: ComputeDevice, strategy: str
) -> None:
    rng = np.random.default_rng(2)
    points = np.concatenate(
        [rng.normal(0, 5, (20_000, 4)), rng.uniform(-40, 40, (20_000, 4))]
    ).astype(np.float32)
    got = voxel_downsample(points, 0.5, device=device, strategy=strategy)
    want = voxel_downsample(points, 0.5, device="numpy")
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_allclose(got.points, want.points, atol=2e-5)
    assert got.counts.sum() == len(points)


def test_binned_sums_give_the_same_bits_every_run(device: ComputeDevice) -> None:
    # Every voxel's points are added in input order: a cloud gives the same centroids, to
    # the bit, however the work-items were scheduled (ICP and the maps built on it are
    # reproducible).  Dense voxels (~40 points each) give the float32 sums many chances to
    # differ.
    rng = np.random.default_rng(7)
    points = np.column_stack(
        [rng.uniform(-20, 20, (60_000, 2)), rng.normal(0, 0.3, 60_000), rng.random(60_000)]
    )
    runs = [voxel_downsample(points, 1.0, device=device, strategy="binned") for _ in range(4)]
    for run in runs[1:]:
        np.testing.assert_array_equal(run.counts, runs[0].counts)
        np.testing.assert_array_equal(run.points, runs[0].points)
    # the same points in another order regroup identically (the sums may differ in bits)
    order = rng.permutation(len(points))
    shuffled = voxel_downsample(points[order], 1.0, device=device, strategy="binned")
    np.testing.assert_array_equal(shuffled.counts, runs[0].counts)
    np.testing.assert_allclose(shuffled.points, runs[0].points, atol=1e-5)


def test_an_unknown_strategy_is_an_error() -> None:
    with pytest.raises(HeteroError, match="strategy must be one of auto, atomic, binned"):
        voxel_downsample(np.zeros((3, 3)), 1.0, strategy="fast", device="numpy")


@pytest.mark.parametrize("size", ["fine", None, -0.5, float("nan")])
def test_a_bad_voxel_size_is_an_error_naming_it(size: object) -> None:
    with pytest.raises(HeteroError, match="voxel_size must be a positive number of metres"):
        voxel_downsample(np.zeros((3, 3)), size, device="numpy")  # type: ignore[arg-type]


def test_a_voxel_larger_than_the_kernels_keep_exact_is_an_error() -> None:
    # 1e9 m cells gave 2 voxels at y = z = 0 for 8 octants of a 20 m cloud
    points = np.random.default_rng(5).uniform(-10, 10, (200, 3))
    with pytest.raises(HeteroError, match=r"voxel_size must be at most 10000 m, got 1000000000\.0"):
        voxel_downsample(points, 1e9, device="numpy")
    assert len(voxel_downsample(points, 1e4, device="numpy").points) >= 1


def test_reference_agrees_with_a_dictionary_of_voxels() -> None:
    points = np.random.default_rng(3).uniform(-3, 3, (2000, 3)) + 0.013  # off the lattice
    result = voxel_downsample(points, 1.0, device="numpy")
    expected = brute_force(points, 1.0)
    assert len(result.points) == len(expected)
    for centroid in result.points:
        key = tuple(int(v) for v in np.floor(centroid / 1.0))
        np.testing.assert_allclose(centroid, expected[key], atol=1e-6)  # float32 on the way


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nan_rows_are_dropped_and_output_sorted_by_cell(
    device: ComputeDevice, strategy: str
) -> None:
    points = np.array(
        [[0.1, 0.1, 0.1], [np.nan, 1, 1], [0.3, 0.2, 0.1], [5.5, 0.5, 0.5], [0.5, 5.5, 0.5]],
        np.float32,
    )
    result = voxel_downsample(points, 1.0, device=device, strategy=strategy)
    np.testing.assert_array_equal(result.counts, [2, 1, 1])
    np.testing.assert_allclose(
        result.points, [[0.2, 0.15, 0.1], [5.5, 0.5, 0.5], [0.5, 5.5, 0.5]], atol=1e-6
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("count", [0, 1])
def test_empty_and_single_point(device: ComputeDevice, count: int, strategy: str) -> None:
    points = np.full((count, 4), 2.5, np.float32)
    result = voxel_downsample(points, 0.25, device=device, strategy=strategy)
    assert result.points.shape == (count, 4)
    np.testing.assert_allclose(result.points, points, atol=1e-6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_nan_gives_nothing(device: ComputeDevice, strategy: str) -> None:
    result = voxel_downsample(
        np.full((10, 3), np.nan, np.float32), 1.0, device=device, strategy=strategy
    )
    assert result.points.shape == (0, 3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_geo_referenced_float64(device: ComputeDevice, strategy: str) -> None:
    points = np.random.default_rng(4).uniform(0, 50, (5000, 3)) + np.array([6.1e5, 4.2e6, 30.0])
    got = voxel_downsample(points, 1.0, device=device, strategy=strategy)
    want = voxel_downsample(points, 1.0, device="numpy")
    assert got.points.dtype == np.float64
    np.testing.assert_array_equal(got.counts, want.counts)
    np.testing.assert_allclose(got.points, want.points, atol=1e-4)


def test_too_large_an_extent_is_an_error(device: ComputeDevice) -> None:
    points = np.array([[0, 0, 0], [3e6, 0, 0]], np.float32)
    with pytest.raises(HeteroError, match="2\\^21"):
        voxel_downsample(points, 1.0, device=device)
    with pytest.raises(HeteroError, match="voxel_size"):
        voxel_downsample(points, 0.0, device=device)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_cloud_longer_than_half_the_key_range_from_its_first_point(
    device: ComputeDevice, strategy: str
) -> None:
    # 1.5e6 voxels from the first point to the last: it raised "spans more than 2^21
    # voxels", although it fits the keys about its middle
    points = np.array([[0.25, 0.5, 0.5], [1.5e6 + 0.5, 0.5, 0.5], [0.75, 0.5, 0.5]])
    got = voxel_downsample(points, 1.0, device=device, strategy=strategy)
    np.testing.assert_array_equal(got.counts, [2, 1])
    np.testing.assert_allclose(got.points, [[0.5, 0.5, 0.5], [1.5e6 + 0.5, 0.5, 0.5]])
    want = voxel_downsample(points, 1.0, device="numpy")
    np.testing.assert_array_equal(want.counts, got.counts)
    np.testing.assert_allclose(want.points, got.points)
