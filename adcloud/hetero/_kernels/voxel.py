"""Launch code of ``voxel.cl``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero._kernels import Bands, filled, from_device, launch, scratch, to_device
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.lattice import EMPTY_KEY, table_bits

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice


def voxel_sums(
    device: OpenCLDevice,
    points: NDArray[np.float32],
    origin: NDArray[np.float32],
    voxel: float,
    strategy: str = "atomic",
) -> tuple[NDArray[np.uint64], NDArray[np.int32], NDArray[np.float32]]:
    """Voxel keys (unsorted), point counts and channel sums (xyz as corner offsets).

    ``points`` is (N, C>=3) float32, C-contiguous; ``origin`` (3,) float32 lies on the
    voxel lattice.  ``strategy``: ``atomic`` (float atomics; sums vary in their last bits
    from run to run) or ``binned`` (every voxel summed in input order; deterministic).
    Raises :class:`HeteroError` when a cell does not fit a packed key.
    """
    n, channels = points.shape
    bits = table_bits(n)
    size = 1 << bits
    src = to_device(device, points, f"{n:,} points")
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
    if strategy == "binned":
        counts, sums = _binned_sums(device, src, n, channels, o, inv, voxel, slots, out_index, m)
    else:
        counts = filled(device, np.int32(0), max(m, 1))
        sums = filled(device, np.float32(0), max(m * channels, 1))
        launch(
            device, "voxel", "voxel_accumulate", n, None,
            src, np.int32(channels), np.int32(n), np.int32(channels), *o, inv,
            np.float32(voxel), slots, out_index, counts, sums,
        )  # fmt: skip
    return (
        from_device(device, out_keys, (m,), np.uint64),
        from_device(device, counts, (m,), np.int32),
        from_device(device, sums, (m, channels), np.float32),
    )


def _binned_sums(
    device: OpenCLDevice,
    src: Any,
    n: int,
    channels: int,
    origin: list[np.float32],
    inv: np.float32,
    voxel: float,
    slots: Any,
    out_index: Any,
    m: int,
) -> tuple[Any, Any]:
    """Counts and sums of the ``m`` voxels, each voxel's points added in input order: a
    counting sort of the points by band of output voxels (the raster program's binning
    passes), then one work-item per band (see ``voxel.cl``)."""
    if m == 0:
        return filled(device, np.int32(0), 1), filled(device, np.float32(0), 1)
    # bands of at most 4096 voxels: their sums stay in cache
    chunks, chunk, band_voxels, band_shift, bands = Bands.plan(device, n, m, 4096)
    out = device.scratch("voxel.point_out", n * 4)
    hist = device.scratch("voxel.hist", chunks * bands * 4)
    band_start = device.scratch("voxel.band_start", (bands + 1) * 4)
    rec_point = device.scratch("voxel.rec_point", n * 4)
    counts = scratch(device, m * 4)
    sums = scratch(device, m * channels * 4)
    bins = [np.int32(n), np.int32(chunk), np.int32(band_shift), np.int32(bands)]
    launch(device, "voxel", "voxel_point_out", n, None, np.int32(n), slots, out_index, out)
    launch(device, "raster", "raster_bin_count", chunks, 1, *bins, out, hist)
    launch(
        device, "raster", "raster_bin_offsets", 1, 1, np.int32(chunks), np.int32(bands), hist,
        band_start,
    )  # fmt: skip
    launch(device, "voxel", "voxel_bin_scatter", chunks, 1, *bins, out, hist, rec_point)
    launch(
        device, "voxel", "voxel_bin_accumulate", bands, 1,
        src, np.int32(channels), np.int32(channels), *origin, inv, np.float32(voxel),
        np.int32(band_voxels), np.int32(m), band_start, rec_point, out, counts, sums,
    )  # fmt: skip
    return counts, sums
