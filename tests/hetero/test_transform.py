"""Rigid transforms on every OpenCL device against the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.hetero import HeteroError, transform_points
from adcloud.hetero.devices import ComputeDevice

pytestmark = pytest.mark.opencl


def rigid(yaw: float, translation: tuple[float, float, float]) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    matrix = np.eye(4)
    matrix[:3, :3] = [[c, -s, 0], [s, c, 0], [0, 0, 1]]
    matrix[:3, 3] = translation
    return matrix


def test_float32_points_match_the_reference(device: ComputeDevice) -> None:
    points = np.random.default_rng(0).normal(0, 50, (10_001, 4)).astype(np.float32)
    matrix = rigid(0.7, (10.0, -3.0, 1.5))
    moved = transform_points(points, matrix, device=device)
    reference = transform_points(points, matrix, device="numpy")
    assert moved.dtype == np.float32 and moved.shape == (10_001, 3)
    np.testing.assert_allclose(moved, reference, rtol=1e-5, atol=1e-4)


def test_geo_referenced_float64_keeps_millimetres(device: ComputeDevice) -> None:
    rng = np.random.default_rng(1)
    points = rng.normal(0, 30, (5000, 3)) + np.array([4.5e5, 5.4e6, 120.0])  # UTM-like
    matrix = rigid(-0.3, (12.0, 7.0, -0.5))
    moved = transform_points(points, matrix, device=device)
    assert moved.dtype == np.float64
    np.testing.assert_allclose(moved, transform_points(points, matrix, device="numpy"), atol=1e-3)


def test_rows_map_to_rows_and_nan_propagates(device: ComputeDevice) -> None:
    points = np.array([[1, 2, 3], [np.nan, 0, 0], [0, 0, 0]], np.float32)
    moved = transform_points(points, rigid(0.0, (1.0, 1.0, 1.0)), device=device)
    np.testing.assert_allclose(moved[[0, 2]], [[2, 3, 4], [1, 1, 1]])
    assert np.isnan(moved[1, 0])


@pytest.mark.parametrize("count", [0, 1])
def test_empty_and_single_point(device: ComputeDevice, count: int) -> None:
    points = np.ones((count, 3), np.float32)
    moved = transform_points(points, rigid(0.2, (0, 0, 1)), device=device)
    assert moved.shape == (count, 3)
    np.testing.assert_allclose(
        moved, transform_points(points, rigid(0.2, (0, 0, 1)), device="numpy"), atol=1e-6
    )


def test_three_by_four_is_accepted_and_non_rigid_refused() -> None:
    points = np.ones((2, 3))
    assert transform_points(points, rigid(0.1, (1, 2, 3))[:3], device="numpy").shape == (2, 3)
    with pytest.raises(HeteroError, match="not a rotation"):
        transform_points(points, np.diag([2.0, 1.0, 1.0, 1.0]), device="numpy")
    with pytest.raises(HeteroError, match="4x4 or 3x4"):
        transform_points(points, np.eye(3), device="numpy")
    with pytest.raises(HeteroError, match=r"\(N, 3\)"):
        transform_points(np.ones((4, 2)), np.eye(4), device="numpy")


@pytest.mark.parametrize("points", [np.array([["1", "2", "x"]]), [[1.0, 2.0, 3.0], [1.0, 2.0]]])
def test_points_that_are_not_numbers_are_an_error_naming_them(points: object) -> None:
    with pytest.raises(HeteroError, match="points must be an array of numbers"):
        transform_points(points, np.eye(4), device="numpy")  # type: ignore[arg-type]


@pytest.mark.parametrize("transform", ["abc", [[1.0, 0.0], [0.0]], [["1", "0", "0", "x"]] * 4])
def test_a_transform_that_is_not_numbers_is_an_error_naming_it(transform: object) -> None:
    with pytest.raises(HeteroError, match="a rigid transform must be a 4x4 array of numbers"):
        transform_points(np.ones((2, 3)), transform, device="numpy")  # type: ignore[arg-type]
