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

    ``require`` names fields that must be present (``BinpipeError`` naming ``topic`` and the
    missing field otherwise).  The array is a view of the message's bytes when the layout
    allows (no copy).
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
                f"{topic}: field {field.name!r} has unknown PointField datatype {field.datatype}"
            )
        count = int(field.count) or 1
        names.append(str(field.name))
        formats.append(order + base if count == 1 else (order + base, (count,)))
        offsets.append(int(field.offset))
    missing = [name for name in require if name not in names]
    if missing:
        raise BinpipeError(
            f"{topic}: PointCloud2 has no field {missing[0]!r} (fields: {', '.join(names)})"
        )
    step = int(msg.point_step)
    dtype = np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": step})
    n = int(msg.width) * int(msg.height)
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size < n * step:
        raise BinpipeError(
            f"{topic}: PointCloud2 data holds {data.size} bytes, {n} points of {step} bytes "
            f"need {n * step}"
        )
    row = int(msg.row_step) or step * int(msg.width)
    if int(msg.height) > 1 and row != step * int(msg.width):
        rows = [data[r * row : r * row + step * int(msg.width)] for r in range(int(msg.height))]
        data = np.concatenate(rows)
    return data[: n * step].view(dtype)


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
    if data.size < h * step or step < w * channels * dtype.itemsize:
        raise BinpipeError(
            f"{topic}: image {w}x{h} {msg.encoding} with step {step} needs {h * step} bytes, "
            f"the message holds {data.size}"
        )
    rows = data[: h * step].reshape(h, step)[:, : w * channels * dtype.itemsize]
    pixels = np.ascontiguousarray(rows).view(dtype).reshape(h, w, channels)
    return pixels[:, :, 0] if channels == 1 else pixels
