"""Reading binary little-endian PLY point clouds (the sample scans beside the checkout).

Only what the sample data needs: ``format binary_little_endian 1.0``, one ``vertex``
element first, scalar properties (float, double, uchar, ushort, int, ...).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.errors import HeteroError

__all__ = ["read_ply"]

_TYPES = {
    "char": "i1", "int8": "i1", "uchar": "u1", "uint8": "u1",
    "short": "<i2", "int16": "<i2", "ushort": "<u2", "uint16": "<u2",
    "int": "<i4", "int32": "<i4", "uint": "<u4", "uint32": "<u4",
    "float": "<f4", "float32": "<f4", "double": "<f8", "float64": "<f8",
}  # fmt: skip


def read_ply(path: str | os.PathLike[str]) -> tuple[NDArray[np.float32], list[str]]:
    """The vertices of a binary little-endian PLY file as (N, P) float32, and the
    property names (e.g. ``x y z intensity``)."""
    data = Path(path).read_bytes()
    end = data.find(b"end_header\n")
    if not data.startswith(b"ply") or end < 0:
        raise HeteroError(f"{path}: not a PLY file")
    header = data[:end].decode("ascii", errors="replace").splitlines()
    if "format binary_little_endian 1.0" not in header:
        raise HeteroError(f"{path}: only binary_little_endian PLY is supported")
    count = 0
    names: list[str] = []
    fields: list[tuple[str, str]] = []
    in_vertex = False
    for line in header:
        words = line.split()
        if words[:1] == ["element"]:
            in_vertex = words[1] == "vertex"
            if in_vertex:
                if len(words) != 3 or not words[2].isdigit():
                    raise HeteroError(f"{path}: bad vertex element line {line!r}")
                count = int(words[2])
            elif not names:
                raise HeteroError(f"{path}: the vertex element must come first")
        elif words[:1] == ["property"] and in_vertex:
            if words[1] == "list" or words[1] not in _TYPES:
                raise HeteroError(f"{path}: unsupported vertex property {line!r}")
            names.append(words[2])
            fields.append((words[2], _TYPES[words[1]]))
    if not names:
        raise HeteroError(f"{path}: no vertex properties")
    dtype = np.dtype(fields)
    body = end + len(b"end_header\n")
    if len(data) - body < count * dtype.itemsize:
        raise HeteroError(
            f"{path}: truncated: {count} vertices of {dtype.itemsize} bytes need "
            f"{count * dtype.itemsize} bytes after the header, the file has {len(data) - body}"
        )
    rows = np.frombuffer(data, dtype=dtype, count=count, offset=body)
    out = np.stack([rows[name].astype(np.float32) for name in names], axis=1)
    return np.ascontiguousarray(out), names
