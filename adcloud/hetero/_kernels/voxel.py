"""Launch code of ``voxel.cl``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero._kernels import filled, from_device, launch, to_device
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.lattice import EMPTY_KEY, table_bits

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice


def voxel_sums(
    device: OpenCLDevice,
    points: NDArray[np.float32],
    origin: NDArray[np.float32],
    voxel: float,
) -> tuple[NDArray[np.uint64], NDArray[np.int32], NDArray[np.float32]]:
    """Voxel keys (unsorted), point counts and channel sums (xyz as corner offsets).

    ``points`` is (N, C>=3) float32, C-contiguous; ``origin`` (3,) float32 lies on the
    voxel lattice.  Raises :class:`HeteroError` when a cell does not fit a packed key.
    """
    n, channels = points.shape
    bits = table_bits(n)
    size = 1 << bits
    src = to_device(device, points)
    keys = filled(device, EMPTY_KEY, size)
    slots = device.scratch("voxel.slots", n * 4)
    overflow = filled(device, np.int32(0), 1)
    n_out = filled(device, np.int32(0), 1)
    inv = np.float32(1.0) / np.float32(voxel)
    o = [np.float32(v) for v in origin]
    launch(
        device, "voxel", "voxel_insert", n, None,
        src, np.int32(channels), np.int32(n), *o, inv,
        keys, np.uint32(size - 1), np.uint32(64 - bits), slots, overflow,
    )  # fmt: skip
    if int(from_device(device, overflow, (1,), np.int32)[0]):
        raise HeteroError(
            f"the cloud spans more than 2^21 voxels of {voxel} m along an axis; "
            "use a larger voxel size or split the cloud"
        )
    out_index = device.scratch("voxel.out_index", size * 4)
    out_keys = device.scratch("voxel.out_keys", n * 8)
    launch(
        device, "voxel", "voxel_compact", size, None,
        keys, np.uint32(size), out_index, out_keys, n_out,
    )  # fmt: skip
    m = int(from_device(device, n_out, (1,), np.int32)[0])
    counts = filled(device, np.int32(0), max(m, 1))
    sums = filled(device, np.float32(0), max(m * channels, 1))
    launch(
        device, "voxel", "voxel_accumulate", n, None,
        src, np.int32(channels), np.int32(n), np.int32(channels), *o, inv, np.float32(voxel),
        slots, out_index, counts, sums,
    )  # fmt: skip
    return (
        from_device(device, out_keys, (m,), np.uint64),
        from_device(device, counts, (m,), np.int32),
        from_device(device, sums, (m, channels), np.float32),
    )
