"""Grid rasterization (both device strategies) against the NumPy reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from adcloud.hetero import GridSpec, HeteroError, Raster, rasterize
from adcloud.hetero.devices import ComputeDevice
from adcloud.hetero.raster import HOST_BELOW

pytestmark = pytest.mark.opencl

STRATEGIES = ("atomic", "binned")


def assert_same(got: Raster, want: Raster) -> None:
    np.testing.assert_array_equal(got.count, want.count)
    for name in ("mean_z", "min_z", "max_z", "mean_intensity"):
        a, b = getattr(got, name), getattr(want, name)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_random_cloud_matches_the_reference(device: ComputeDevice, strategy: str) -> None:
    rng = np.random.default_rng(11)
    points = np.column_stack(
        [
            rng.uniform(-5, 55, 200_000),
            rng.uniform(-5, 45, 200_000),
            rng.normal(2, 3, 200_000),
            rng.uniform(0, 255, 200_000),
        ]
    ).astype(np.float32)
    grid = GridSpec(0.0, 0.0, 0.25, 200, 160)
    got = rasterize(points, grid, strategy=strategy, device=device)
    assert_same(got, rasterize(points, grid, device="numpy"))
    inside = (points[:, 0] >= 0) & (points[:, 0] < 50) & (points[:, 1] >= 0) & (points[:, 1] < 40)
    assert got.count.sum() == inside.sum()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_hand_made_cells(device: ComputeDevice, strategy: str) -> None:
    points = np.array(
        [
            [0.5, 0.5, 1.0, 10],
            [0.6, 0.4, 3.0, 20],
            [0.5, 0.5, -2.0, 30],  # negative heights go through the float min/max trick
            [1.5, 0.5, -0.0, 40],  # minus zero
            [2.5, 1.5, np.nan, 50],  # dropped: z not finite
            [2.5, 1.5, 7.0, np.nan],  # dropped: intensity not finite
            [-0.1, 0.5, 1.0, 1],  # outside
            [3.0, 0.5, 1.0, 1],  # outside (right edge is exclusive)
            [1e30, 1e30, 1.0, 1],  # huge
        ],
        np.float32,
    )
    grid = GridSpec(0.0, 0.0, 1.0, 3, 2)
    r = rasterize(points, grid, strategy=strategy, device=device)
    np.testing.assert_array_equal(r.count, [[3, 1, 0], [0, 0, 0]])
    np.testing.assert_allclose(r.mean_z[0, :2], [2.0 / 3.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(r.min_z[0, :2], [-2.0, 0.0])
    np.testing.assert_allclose(r.max_z[0, :2], [3.0, 0.0])
    np.testing.assert_allclose(r.mean_intensity[0, :2], [20.0, 40.0])
    assert np.isnan(r.mean_z[1]).all() and np.isnan(r.max_z[0, 2])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_empty_one_point_and_all_outside(device: ComputeDevice, strategy: str) -> None:
    grid = GridSpec(10.0, 20.0, 0.5, 4, 4)
    empty = rasterize(np.empty((0, 3), np.float32), grid, strategy=strategy, device=device)
    assert empty.count.shape == (4, 4) and not empty.count.any()
    one = rasterize(
        np.array([[11.2, 20.1, 5.0]], np.float32), grid, strategy=strategy, device=device
    )
    assert one.count[0, 2] == 1 and one.count.sum() == 1
    assert one.max_z[0, 2] == 5.0
    assert np.isnan(one.mean_intensity).all()  # three columns: no intensity
    outside = rasterize(np.full((10, 3), -100, np.float32), grid, strategy=strategy, device=device)
    assert not outside.count.any()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_intensity_array_and_float64_geo_coordinates(device: ComputeDevice, strategy: str) -> None:
    rng = np.random.default_rng(12)
    xyz = rng.uniform(0, 20, (50_000, 3)) + np.array([3.2e5, 5.6e6, 0.0])
    intensity = rng.uniform(0, 1, 50_000)
    grid = GridSpec(3.2e5, 5.6e6, 0.1, 200, 200)
    got = rasterize(xyz, grid, intensity=intensity, strategy=strategy, device=device)
    assert_same(got, rasterize(xyz, grid, intensity=intensity, device="numpy"))
    assert got.count.sum() == 50_000


def test_a_dense_cell(device: ComputeDevice) -> None:
    z = np.random.default_rng(13).normal(0, 1, 100_000).astype(np.float32)
    points = np.column_stack([np.full_like(z, 0.5), np.full_like(z, 0.5), z])
    for strategy in STRATEGIES:
        r = rasterize(points, GridSpec(0, 0, 1, 1, 1), strategy=strategy, device=device)
        assert r.count[0, 0] == 100_000
        assert r.mean_z[0, 0] == pytest.approx(float(z.astype(np.float64).mean()), abs=1e-4)
        assert r.min_z[0, 0] == z.min() and r.max_z[0, 0] == z.max()


def test_auto_gives_a_cpu_device_small_rasters_to_the_host(
    cpu_device: ComputeDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PoCL the kernels would run on the cores NumPy uses, and their launches cost more
    than a sweep's reduction: ``auto`` rasterizes small inputs with the reference."""
    from adcloud.hetero._kernels import raster as kernels  # noqa: PLC0415

    launched: list[tuple[int, str]] = []
    run = kernels.rasterize

    def counted(device: Any, points: Any, *args: Any) -> Any:
        launched.append((len(points), args[-1]))
        return run(device, points, *args)

    monkeypatch.setattr(kernels, "rasterize", counted)
    rng = np.random.default_rng(14)
    sweep = rng.uniform(0, 20, (HOST_BELOW - 1, 4)).astype(np.float32)
    small = GridSpec(0.0, 0.0, 0.2, 100, 100)
    got = rasterize(sweep, small, device=cpu_device)
    assert not launched
    want = rasterize(sweep, small, device="numpy")
    for name in ("count", "mean_z", "min_z", "max_z", "mean_intensity"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    # as many points as that, or cells: the binned kernels
    rasterize(np.vstack([sweep, sweep[:1]]), small, device=cpu_device)
    rasterize(sweep, GridSpec(0.0, 0.0, 0.05, 400, 400), device=cpu_device)
    assert launched == [(HOST_BELOW, "binned"), (HOST_BELOW - 1, "binned")]
    # an explicit strategy is obeyed, however small the raster
    launched.clear()
    rasterize(sweep[:10], small, strategy="binned", device=cpu_device)
    assert launched == [(10, "binned")]
    launched.clear()
    rasterize(sweep, GridSpec(0.0, 0.0, 0.05, 400, 400), strategy="host", device=cpu_device)
    assert not launched


def test_grid_spec_checks_and_covering() -> None:
    with pytest.raises(HeteroError, match="cell_size"):
        GridSpec(0, 0, 0, 1, 1)
    with pytest.raises(HeteroError, match="empty or too large"):
        GridSpec(0, 0, 1, 0, 1)
    with pytest.raises(HeteroError, match="strategy"):
        rasterize(np.zeros((1, 3)), GridSpec(0, 0, 1, 1, 1), strategy="magic")
    points = np.array([[1.05, -2.0, 0], [3.9, 4.0, 0], [np.nan, 100, 0]])
    grid = GridSpec.covering(points, 0.5)
    assert (grid.origin_x, grid.origin_y) == (1.0, -2.0)
    r = rasterize(points, grid, device="numpy")
    assert r.count.sum() == 2


@pytest.mark.parametrize(("width", "height"), [(20 / 0.05, 10), (3, 2.5), (True, 4)])
def test_grid_sizes_must_be_whole_numbers(width: object, height: object) -> None:
    # a width computed as extent / cell is a float; it used to fail later, in NumPy or
    # in the OpenCL launch, with a TypeError that named no grid
    with pytest.raises(HeteroError, match="whole number of cells"):
        GridSpec(0.0, 0.0, 0.05, width, height)  # type: ignore[arg-type]
    assert GridSpec(0.0, 0.0, 0.05, np.int64(400), 10).shape == (10, 400)


@pytest.mark.parametrize(
    ("points", "cell"),
    [
        # 0.3 / 0.1 is 2.99.. in float64 but cell 3 in float32: the last column was missing
        (np.array([[0.0, 0.0, 0.0], [0.3, 0.7, 0.0]]), 0.1),
        # an origin computed in float32 lay above the lowest point, which fell before it
        (np.array([[29.8, -15.02, 36.59], [44.74, 20.92, 27.3]], np.float32), 0.2),
    ],
)
def test_covering_grid_holds_every_point(points: np.ndarray, cell: float) -> None:
    grid = GridSpec.covering(points, cell)
    assert rasterize(points, grid, device="numpy").count.sum() == len(points)
    rng = np.random.default_rng(1)
    for _ in range(300):
        pair = np.round(rng.uniform(-50, 50, (2, 3)), 2)
        for cloud in (pair, pair.astype(np.float32), pair + 4e6):
            grid = GridSpec.covering(cloud, cell)
            assert rasterize(cloud, grid, device="numpy").count.sum() == 2, (cloud, grid)
            # still the smallest grid, give or take the cells the rounding needs
            extent = np.ptp(cloud[:, :2].astype(np.float64), axis=0) / cell
            assert grid.width <= extent[0] + 3 and grid.height <= extent[1] + 3


@pytest.mark.parametrize(
    ("args", "says"),
    [
        # 100000 x 100000 int32 wrapped around to a small product and passed the size check
        ((0.0, 0.0, 1.0, np.int32(100_000), np.int32(100_000)), "empty or too large"),
        (("0", 0.0, 1.0, 10, 10), "origin must be finite numbers"),
        ((0.0, None, 1.0, 10, 10), "origin must be finite numbers"),
        ((0.0, 0.0, "0.5", 10, 10), "cell_size must be a positive number"),
    ],
)
def test_grid_spec_refuses_overflowing_sizes_and_non_numbers(args: tuple, says: str) -> None:
    with pytest.raises(HeteroError, match=says):
        GridSpec(*args)
