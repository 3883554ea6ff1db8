"""A minimal PNG writer for previews (8-bit greyscale), so no imaging library is needed."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

__all__ = ["preview", "write_png"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)


def write_png(path: str | os.PathLike[str], image: NDArray[np.uint8]) -> Path:
    """Write a (H, W) uint8 image as a greyscale PNG, top row first."""
    pixels = np.ascontiguousarray(image, np.uint8)
    height, width = pixels.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
        + _chunk(b"IEND", b"")
    )
    out = Path(path)
    out.write_bytes(data)
    return out


def preview(layer: NDArray[np.floating], *, flip_rows: bool = True) -> NDArray[np.uint8]:
    """A float layer stretched to 1..255 between its 2nd and 98th percentiles; NaN -> 0.

    ``flip_rows`` puts the grid's highest row on top (north up for a map raster).
    """
    values = np.asarray(layer, np.float64)
    finite = np.isfinite(values)
    out = np.zeros(values.shape, np.uint8)
    if finite.any():
        low, high = np.percentile(values[finite], [2, 98])
        scale = 254.0 / (high - low) if high > low else 0.0
        out[finite] = (1 + np.clip((values[finite] - low) * scale, 0, 254)).astype(np.uint8)
    return out[::-1] if flip_rows else out
