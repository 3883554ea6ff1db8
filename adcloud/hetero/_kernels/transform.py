"""Launch code of ``transform.cl``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero._kernels import from_device, launch, scratch, to_device

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice


def transform_points(
    device: OpenCLDevice, points: NDArray[np.float32], rt: NDArray[np.float32]
) -> NDArray[np.float32]:
    """``R @ p + t`` for the first three columns of ``points`` (N, C>=3, float32, C-order).

    ``rt`` holds R row-major then t (12 float32).  Returns (N, 3) float32.
    """
    n, stride = points.shape
    if n == 0:
        return np.empty((0, 3), np.float32)
    src = to_device(device, points, f"{n:,} points")
    matrix = to_device(device, np.ascontiguousarray(rt, np.float32))
    out = scratch(device, n * 3 * 4)
    args: list[Any] = [src, np.int32(stride), np.int32(n), matrix, out]
    launch(device, "transform", "transform_points", n, None, *args)
    return from_device(device, out, (n, 3), np.float32)
