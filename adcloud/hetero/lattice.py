"""Uniform 3-D cell lattices shared by voxel downsampling and the ICP grid.

A lattice has a float64 ``origin`` on multiples of its cell size and a float32 ``1/cell``.
A point's cell is ``floor(float32(p - origin) * inv)``, computed in float32 exactly as the
OpenCL kernels do, so NumPy references and devices put every point in the same cell.  Cells
are packed into uint64 keys, 21 bits per axis (offset by 2^20, z most significant), so
sorting keys sorts cells by (z, y, x); cells must lie within +-2^20 of the origin.

Hash tables are open-addressing with linear probing over ``2^bits`` slots and Fibonacci
hashing, identical on host and device (``common.cl``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.errors import HeteroError

__all__ = [
    "EMPTY_KEY",
    "KEY_OFFSET",
    "build_table",
    "cell_indices",
    "lattice_origin",
    "pack_keys",
    "table_find",
    "unpack_keys",
]

KEY_BITS = 21
KEY_OFFSET = 1 << (KEY_BITS - 1)
EMPTY_KEY = np.uint64(0xFFFFFFFFFFFFFFFF)
_KEY_MASK = np.uint64((1 << KEY_BITS) - 1)
_HASH_MULT = np.uint64(0x9E3779B97F4A7C15)
# Cells from an origin that float32 offsets keep safely inside the packable range.
_REACH = KEY_OFFSET - 2


def lattice_origin(points: NDArray[Any], cell: float) -> NDArray[np.float64]:
    """A lattice point near the cloud: the first finite point, floored to the lattice.

    When some finite point lies further than the packed keys reach (about 2^20 cells) from
    that origin, while all of them would fit around the middle of their bounding box, that
    middle floored to the lattice instead: a cloud spanning up to 2^21 cells along an axis
    then fits whatever its first point.  Zeros when no point is finite.
    """
    xyz = points[:, :3]
    finite = np.isfinite(xyz).all(axis=1)
    if not finite.any():
        return np.zeros(3)
    usable = xyz if finite.all() else xyz[finite]
    first = usable[0].astype(np.float64)
    origin: NDArray[np.float64] = np.floor(first / cell) * cell
    low = usable.min(axis=0).astype(np.float64)
    high = usable.max(axis=0).astype(np.float64)
    # a first point at one end of a long cloud left the far end out of reach: the error
    # said the cloud spans more than 2^21 cells when it spanned barely more than half that
    reach = np.maximum(high - origin, origin - low) / cell
    if (reach < _REACH).all() or ((high - low) / cell >= 2 * _REACH).any():
        return origin  # it fits as it is, or fits nowhere (far outliers stay unusable)
    middle: NDArray[np.float64] = np.floor((low + high) / 2 / cell) * cell
    return middle


def local_float32(points: NDArray[Any], origin: NDArray[np.float64]) -> NDArray[np.float32]:
    """xyz relative to ``origin`` in float32, as the device sees them.

    float32 input is shifted in float32 (as the kernels do), anything else in float64 and
    then rounded.
    """
    xyz = points[:, :3]
    if xyz.dtype == np.float32:
        return xyz - origin.astype(np.float32)
    return (xyz.astype(np.float64) - origin).astype(np.float32)


def cell_indices(
    local: NDArray[np.float32], cell: float
) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """(N, 3) int64 cells of float32 local coordinates, and which rows are usable.

    Rows with a non-finite coordinate are unusable (their cell is 0); rows outside the
    packable range raise :class:`HeteroError`.
    """
    inv = np.float32(1.0) / np.float32(cell)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = local * inv
    finite = np.isfinite(scaled).all(axis=1)
    limit = np.float32(KEY_OFFSET)
    inside = finite & (np.abs(np.where(finite[:, None], scaled, 0)) < limit).all(axis=1)
    if not np.array_equal(inside, finite):
        msg = (
            f"the cloud spans more than 2^{KEY_BITS} cells of {cell} m along an axis; use "
            "a larger cell size or split the cloud"
        )
        raise HeteroError(msg)
    cells = np.zeros(scaled.shape, np.int64)
    cells[finite] = np.floor(scaled[finite]).astype(np.int64)
    return cells, finite


def pack_keys(cells: NDArray[np.int64]) -> NDArray[np.uint64]:
    """Packed uint64 keys of (N, 3) cell indices within +-2^20."""
    shifted = (cells + KEY_OFFSET).astype(np.uint64) & _KEY_MASK
    keys: NDArray[np.uint64] = (
        shifted[:, 0]
        | (shifted[:, 1] << np.uint64(KEY_BITS))
        | (shifted[:, 2] << np.uint64(2 * KEY_BITS))
    )
    return keys


def unpack_keys(keys: NDArray[np.uint64]) -> NDArray[np.int64]:
    """(N, 3) cell indices of packed keys (the inverse of :func:`pack_keys`)."""
    keys = keys.astype(np.uint64, copy=False)
    parts = [(keys >> np.uint64(KEY_BITS * axis)) & _KEY_MASK for axis in range(3)]
    return np.stack(parts, axis=1).astype(np.int64) - KEY_OFFSET


def _hash(keys: NDArray[np.uint64], bits: int) -> NDArray[np.int64]:
    with np.errstate(over="ignore"):
        product = keys * _HASH_MULT  # wraps modulo 2^64, as on the device
    return (product >> np.uint64(64 - bits)).astype(np.int64)


def table_bits(n: int) -> int:
    """log2 of a power-of-two table with at least ``2 n`` slots (load factor <= 0.5)."""
    return max(4, int(2 * n - 1).bit_length())


def build_table(keys: NDArray[np.uint64]) -> tuple[NDArray[np.uint64], NDArray[np.int32], int]:
    """A linear-probing table mapping each of the distinct ``keys`` to its index.

    Returns (slot keys, slot values, bits); empty slots hold :data:`EMPTY_KEY` and -1.
    Built with vectorized insertion rounds: in each round every pending key tries its
    current slot, one key wins each free slot, and the others move one slot on.
    """
    bits = table_bits(len(keys))
    mask = (1 << bits) - 1
    table_keys = np.full(1 << bits, EMPTY_KEY, np.uint64)
    table_values = np.full(1 << bits, -1, np.int32)
    pending = np.arange(len(keys))
    slots = _hash(keys, bits)
    while len(pending):
        want = slots[pending]
        free = table_keys[want] == EMPTY_KEY
        free_slots, first = np.unique(want[free], return_index=True)
        winners = pending[free][first]
        table_keys[free_slots] = keys[winners]
        table_values[free_slots] = winners.astype(np.int32)
        placed = np.zeros(len(keys), bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        slots[pending] = (slots[pending] + 1) & mask
    return table_keys, table_values, bits


def table_find(
    table_keys: NDArray[np.uint64],
    table_values: NDArray[np.int32],
    bits: int,
    keys: NDArray[np.uint64],
) -> NDArray[np.int32]:
    """The value stored for each of ``keys`` (-1 when absent), probing like the device."""
    mask = (1 << bits) - 1
    out = np.full(len(keys), -1, np.int32)
    slots = _hash(keys, bits)
    pending = np.arange(len(keys))
    while len(pending):
        seen = table_keys[slots[pending]]
        hit = seen == keys[pending]
        out[pending[hit]] = table_values[slots[pending[hit]]]
        pending = pending[~hit & (seen != EMPTY_KEY)]
        slots[pending] = (slots[pending] + 1) & mask
    return out
