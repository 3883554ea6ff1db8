"""Rigid transforms of point clouds: ``p' = R p + t`` on a device, with a NumPy reference.

Frames and units: ``transform`` maps coordinates of the points' frame into the target frame
(metres); it is a 4x4 homogeneous matrix (or its top 3x4) whose 3x3 block is a rotation.
Rows map to rows: the output has one row per input row, in order, and non-finite input
coordinates give non-finite output (nothing is dropped).

Precision: devices compute in float32.  float64 input is shifted by a local origin on the
host (in float64) before it is narrowed, and the translation is added back in float64, so
geo-referenced coordinates (UTM, 10^6 m) keep their precision; the result has the input's
float dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, OpenCLDevice, as_device
from adcloud.hetero.errors import HeteroError

__all__ = ["as_points", "as_rigid", "transform_points"]

FloatArray = NDArray[np.floating[Any]]


def as_rigid(transform: NDArray[Any] | Any) -> NDArray[np.float64]:
    """``transform`` as a float64 4x4 rigid transform; raises :class:`HeteroError` if it is not.

    Accepts a 4x4 or 3x4 array whose 3x3 block is a rotation (orthonormal to 1e-4,
    determinant +1).
    """
    try:
        matrix = np.asarray(transform, dtype=np.float64)
    except (TypeError, ValueError) as err:  # strings, ragged rows, None inside
        raise HeteroError(f"a rigid transform must be a 4x4 array of numbers: {err}") from err
    if matrix.shape == (3, 4):
        matrix = np.vstack([matrix, [0.0, 0.0, 0.0, 1.0]])
    if matrix.shape != (4, 4):
        raise HeteroError(f"a rigid transform is 4x4 or 3x4, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise HeteroError("the transform has non-finite entries")
    rotation = matrix[:3, :3]
    if (
        not np.allclose(matrix[3], [0.0, 0.0, 0.0, 1.0])
        or not np.allclose(rotation @ rotation.T, np.eye(3), atol=1e-4)
        or np.linalg.det(rotation) < 0
    ):
        raise HeteroError(
            "the transform's 3x3 block is not a rotation (or its last row is not 0 0 0 1)"
        )
    return matrix


def as_points(points: NDArray[Any] | Any, *, what: str = "points") -> FloatArray:
    """``points`` as an (N, C>=3) float32/float64 array (other dtypes become float64)."""
    try:
        array = np.asarray(points)
        if array.dtype not in (np.float32, np.float64):
            array = array.astype(np.float64)
    except (TypeError, ValueError) as err:  # strings, ragged rows
        raise HeteroError(f"{what} must be an array of numbers: {err}") from err
    if array.ndim != 2 or array.shape[1] < 3:
        raise HeteroError(f"{what} must be an (N, 3) or (N, C>=3) array, got shape {array.shape}")
    return array


def local_origin(points: FloatArray) -> NDArray[np.float64]:
    """A float64 origin near the points (the mean of the finite ones; zeros when none).

    Subtracting it before narrowing to float32 keeps coordinates small on the device.
    """
    xyz = points[:, :3]
    finite = np.isfinite(xyz).all(axis=1)
    if not finite.any():
        return np.zeros(3)
    origin: NDArray[np.float64] = np.floor(xyz[finite].mean(axis=0, dtype=np.float64))
    return origin


def transform_points(
    points: NDArray[Any],
    transform: NDArray[Any],
    *,
    device: ComputeDevice | str | None = None,
) -> FloatArray:
    """Apply the rigid ``transform`` to the xyz columns of ``points`` (N, C>=3).

    Returns (N, 3) of the input float dtype (float32 stays float32, anything else becomes
    float64).  ``device``: a :class:`ComputeDevice`, an address, or None for
    :func:`~adcloud.hetero.devices.select_device`; ``"numpy"`` runs the reference.
    """
    array = as_points(points)
    matrix = as_rigid(transform)
    dev = as_device(device)
    if not isinstance(dev, OpenCLDevice) or len(array) == 0:
        return _transform_numpy(array, matrix)
    from adcloud.hetero._kernels import transform as kernels  # noqa: PLC0415 - needs pyopencl

    rotation = matrix[:3, :3]
    if array.dtype == np.float32:
        rt = np.concatenate([rotation.ravel(), matrix[:3, 3]]).astype(np.float32)
        return kernels.transform_points(dev, np.ascontiguousarray(array), rt)
    origin = local_origin(array)
    local = (array[:, :3] - origin).astype(np.float32)
    rt = np.concatenate([rotation.ravel(), np.zeros(3)]).astype(np.float32)
    moved = kernels.transform_points(dev, local, rt)
    return moved.astype(np.float64) + (rotation @ origin + matrix[:3, 3])


def _transform_numpy(points: FloatArray, matrix: NDArray[np.float64]) -> FloatArray:
    """The NumPy reference: float64 arithmetic, result in the input's float dtype."""
    xyz = points[:, :3].astype(np.float64, copy=False)
    # Column by column rather than `xyz @ R.T`: BLAS would start threads for a 3x3 product.
    rotation = matrix[:3, :3]
    out = xyz[:, 0:1] * rotation[:, 0] + xyz[:, 1:2] * rotation[:, 1]
    out += xyz[:, 2:3] * rotation[:, 2]
    out += matrix[:3, 3]
    return out.astype(points.dtype, copy=False)
