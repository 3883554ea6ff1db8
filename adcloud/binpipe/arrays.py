"""NumPy views of decoded sensor messages: ``sensor_msgs/PointCloud2`` and ``sensor_msgs/Image``.

Services decode bags on executors with :class:`~adcloud.binpipe.MessageDecoder` and then
need the payload as arrays.  The point layout is read from the message's own ``fields``
(names, offsets, datatypes), never assumed, so clouds from any driver decode; a field a
caller needs and the cloud lacks is an error that names the topic and the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.binpipe.errors import BinpipeError

__all__ = ["image_array", "pointcloud_array"]

# sensor_msgs/PointField datatypes
_POINT_TYPES = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 8: "f8"}
# sensor_msgs/Image encodings: (dtype, channels)
_IMAGE_TYPES = {
    "rgb8": ("u1", 3),
    "bgr8": ("u1", 3),
    "rgba8": ("u1", 4),
    "bgra8": ("u1", 4),
    "mono8": ("u1", 1),
    "8uc1": ("u1", 1),
    "mono16": ("u2", 1),
    "16uc1": ("u2", 1),
    "32fc1": ("f4", 1),
}


def _msgtype(msg: Any) -> str:
    return str(getattr(msg, "__msgtype__", type(msg).__name__))


def pointcloud_array(msg: Any, *, topic: str = "?", require: Iterable[str] = ()) -> NDArray[Any]:
    """The points of a ``sensor_msgs/PointCloud2`` as a structured array (one row per point).

    The dtype comes from the message's ``fields`` (names, offsets, datatypes, counts),
    ``point_step`` and ``is_bigendian``; organized clouds (``height > 1``) are flattened row
    by row, skipping row padding. ``require`` names fields that must be present. Raises
    :class:`BinpipeError` naming ``topic`` and the field when one is missing, a datatype is
    unknown or the data is shorter than the header says. The array is a view of the
    message's bytes where the layout allows (no copy).
    """
    if not hasattr(msg, "fields") or not hasattr(msg, "point_step"):
        raise BinpipeError(
            f"{topic}: expected sensor_msgs/PointCloud2, got {_msgtype(msg)}; "
            "check the topic name in the job's settings"
        )
    order = ">" if msg.is_bigendian else "<"
    names: list[str] = []
    formats: list[Any] = []
    offsets: list[int] = []
    for field in msg.fields:
        base = _POINT_TYPES.get(int(field.datatype))
        if base is None:
            raise BinpipeError(
                f"{topic}: PointCloud2 field {field.name!r} has unknown datatype "
                f"{field.datatype} (sensor_msgs/PointField defines 1..8)"
            )
        if field.name in names:
            raise BinpipeError(f"{topic}: PointCloud2 field {field.name!r} appears twice")
        count = max(int(field.count), 1)
        names.append(str(field.name))
        formats.append(order + base if count == 1 else (order + base, (count,)))
        offsets.append(int(field.offset))
    missing = [name for name in require if name not in names]
    if missing:
        raise BinpipeError(
            f"{topic}: PointCloud2 has no field {missing[0]!r} (fields: {', '.join(names) or '-'})"
        )
    step = int(msg.point_step)
    try:
        dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": step})
    except (ValueError, TypeError) as err:
        raise BinpipeError(
            f"{topic}: PointCloud2 fields {names} do not fit in point_step {step}: {err}"
        ) from err
    width, height, row_step = int(msg.width), int(msg.height), int(msg.row_step)
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if height * width == 0:
        return np.zeros(0, dtype=dtype)
    if step < 1:
        raise BinpipeError(
            f"{topic}: PointCloud2 field 'point_step' is {step} for {height} x {width} points; "
            "the message is damaged (each point takes point_step bytes of 'data')"
        )
    row_bytes = width * step
    row_step = row_step or row_bytes
    if row_step < row_bytes:
        raise BinpipeError(
            f"{topic}: PointCloud2 field 'row_step' ({row_step}) is less than width {width} x "
            f"point_step {step} bytes; the message is damaged"
        )
    if data.size < (height - 1) * row_step + row_bytes:
        raise BinpipeError(
            f"{topic}: PointCloud2 field 'data' holds {data.size} bytes, fewer than "
            f"{height} rows x {width} points x {step} bytes (row_step {row_step})"
        )
    if height == 1 or row_step == row_bytes:
        return data[: height * row_bytes].view(dtype)
    rows = np.lib.stride_tricks.as_strided(data, (height, row_bytes), (row_step, 1))
    return np.ascontiguousarray(rows).reshape(-1).view(dtype)


def image_array(msg: Any, *, topic: str = "?") -> NDArray[Any]:
    """The pixels of a ``sensor_msgs/Image`` as ``(height, width[, channels])``."""
    if not hasattr(msg, "encoding") or not hasattr(msg, "step"):
        raise BinpipeError(f"{topic}: expected sensor_msgs/Image, got {_msgtype(msg)}")
    kind = _IMAGE_TYPES.get(str(msg.encoding).lower())
    if kind is None:
        known = ", ".join(sorted(_IMAGE_TYPES))
        raise BinpipeError(f"{topic}: image encoding {msg.encoding!r} is not one of {known}")
    base, channels = kind
    dtype = np.dtype((">" if msg.is_bigendian else "<") + base)
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if step < w * channels * dtype.itemsize:
        raise BinpipeError(
            f"{topic}: Image field 'step' ({step}) is less than width x {channels * dtype.itemsize}"
            " bytes"
        )
    if data.size < h * step:
        raise BinpipeError(
            f"{topic}: Image field 'data' holds {data.size} bytes, fewer than height {h} x "
            f"step {step}"
        )
    rows = data[: h * step].reshape(h, step)[:, : w * channels * dtype.itemsize]
    pixels = np.ascontiguousarray(rows).view(dtype).reshape(h, w, channels)
    return pixels[:, :, 0] if channels == 1 else pixels
