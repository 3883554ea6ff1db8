"""Voxel-grid downsampling: one centroid per occupied voxel, on a device or in NumPy.

Voxels are the cells of a lattice of edge ``voxel_size`` metres aligned to multiples of
``voxel_size`` in the points' frame (see :mod:`adcloud.hetero.lattice` for how a point's
cell is computed, identically on host and device).  Every voxel with at least one point
gives one output row: the mean of its points' columns (x y z and any further channels such
as intensity), in the input's float dtype, with its point count.  Rows come out sorted by
cell (z, then y, then x).

Points whose x, y or z is not finite are dropped.  Non-finite values in further channels
are averaged as they are (and make that voxel's channel NaN).  A cloud spanning more than
2^21 voxels along an axis raises :class:`~adcloud.hetero.errors.HeteroError`.

Devices sum each voxel's points in float32, the reference in float64: centroids agree to
about 1e-6 relative.  Two device strategies (see ``_kernels/voxel.cl``): ``atomic`` (float
atomics, for GPUs; the last bits of a centroid vary from run to run with the order the
work-items ran in) and ``binned`` (CPUs: every voxel's points added in input order, no
atomics, so the same cloud gives the same bits every time, and ICP and the maps built on
it are reproducible); ``auto`` picks by device kind.

Devices without 64-bit atomics (``cl_khr_int64_base_atomics``) run the NumPy reference,
with a warning in the log.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, DeviceKind, OpenCLDevice, as_device
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.lattice import (
    cell_indices,
    lattice_origin,
    local_float32,
    pack_keys,
    unpack_keys,
)
from adcloud.hetero.transform import as_points

__all__ = ["Voxels", "voxel_downsample"]

log = logging.getLogger(__name__)

_STRATEGIES = ("auto", "atomic", "binned")


class Voxels(NamedTuple):
    """The result of :func:`voxel_downsample`.

    ``points``: (M, C) centroids (x y z in metres, then the mean of each further channel);
    ``counts``: (M,) int32 points per voxel.
    """

    points: NDArray[np.floating[Any]]
    counts: NDArray[np.int32]


#: The largest voxel edge, m (float32 offsets keep ~0.6 mm at this size).
MAX_VOXEL_M = 1e4


def _check_size(voxel_size: float) -> float:
    try:
        size = float(voxel_size)
    except (TypeError, ValueError):
        size = float("nan")
    if not (np.isfinite(size) and size > 0):
        raise HeteroError(f"voxel_size must be a positive number of metres, got {voxel_size!r}")
    if size > MAX_VOXEL_M:
        # the kernels keep offsets within the lattice in float32: cells this large would
        # lose the points' positions (1e9 m cells merged points metres apart)
        raise HeteroError(f"voxel_size must be at most {MAX_VOXEL_M:g} m, got {voxel_size!r}")
    return size


def voxel_downsample(
    points: NDArray[Any],
    voxel_size: float,
    *,
    strategy: str = "auto",
    device: ComputeDevice | str | None = None,
) -> Voxels:
    """Average the points of every occupied voxel of edge ``voxel_size`` metres.

    ``points`` is (N, C>=3); see the module docstring for what is dropped and the order.
    ``strategy``: ``auto``, ``atomic`` or ``binned`` (devices only; see the module doc).
    ``device``: a :class:`ComputeDevice`, an address, or None for
    :func:`~adcloud.hetero.devices.select_device`; ``"numpy"`` runs the reference.
    """
    array = as_points(points)
    size = _check_size(voxel_size)
    if strategy not in _STRATEGIES:
        raise HeteroError(f"strategy must be one of {', '.join(_STRATEGIES)}, got {strategy!r}")
    dtype = array.dtype
    if len(array) == 0:
        return Voxels(np.empty((0, array.shape[1]), dtype), np.empty(0, np.int32))
    dev = as_device(device)
    origin = lattice_origin(array, size)
    if isinstance(dev, OpenCLDevice) and not dev.info.int64_atomics:
        log.warning(
            "%s has no 64-bit atomics (cl_khr_int64_base_atomics); voxel downsampling runs "
            "the NumPy reference",
            dev.info.describe(),
        )
    if not isinstance(dev, OpenCLDevice) or not dev.info.int64_atomics:
        return _voxel_numpy(array, size, origin)
    from adcloud.hetero._kernels import voxel as kernels  # noqa: PLC0415 - needs pyopencl

    if dtype == np.float32:
        device_points = np.ascontiguousarray(array)
        device_origin = origin.astype(np.float32)
    else:
        device_points = np.ascontiguousarray(
            np.concatenate([local_float32(array, origin)[:, :3], array[:, 3:]], axis=1),
            dtype=np.float32,
        )
        device_origin = np.zeros(3, np.float32)
    if strategy == "auto":
        strategy = "binned" if dev.info.kind == DeviceKind.CPU else "atomic"
    keys, counts, sums = kernels.voxel_sums(dev, device_points, device_origin, size, strategy)
    order = np.argsort(keys, kind="stable")
    keys, counts, sums = keys[order], counts[order], sums[order].astype(np.float64)
    return Voxels(_centroids(keys, counts, sums, origin, size, dtype), counts)


def _centroids(
    keys: NDArray[np.uint64],
    counts: NDArray[np.int32],
    sums: NDArray[np.floating[Any]],
    origin: NDArray[np.float64],
    size: float,
    dtype: np.dtype[Any],
) -> NDArray[np.floating[Any]]:
    """Centroids from sorted keys, counts and channel sums (xyz sums are corner offsets)."""
    out = sums / np.maximum(counts, 1)[:, None]
    corner = unpack_keys(keys).astype(np.float64) * np.float64(np.float32(size))
    out[:, :3] += origin + corner
    return out.astype(dtype, copy=False)


def _voxel_numpy(array: NDArray[Any], size: float, origin: NDArray[np.float64]) -> Voxels:
    """The NumPy reference: sort-based grouping (``np.unique``) and ``np.bincount`` sums."""
    local = local_float32(array, origin)
    cells, usable = cell_indices(local, size)
    keys = pack_keys(cells[usable])
    if not len(keys):
        return Voxels(np.empty((0, array.shape[1]), array.dtype), np.empty(0, np.int32))
    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    corner = cells[usable].astype(np.float32) * np.float32(size)
    offsets = local[usable] - corner
    channels = [offsets[:, 0], offsets[:, 1], offsets[:, 2]]
    channels += [array[usable, c] for c in range(3, array.shape[1])]
    sums: NDArray[np.float64] = np.stack(
        [np.bincount(inverse, weights=channel, minlength=len(unique)) for channel in channels],
        axis=1,
    ).astype(np.float64)
    counts32 = counts.astype(np.int32)
    return Voxels(_centroids(unique, counts32, sums, origin, size, array.dtype), counts32)
