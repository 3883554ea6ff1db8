"""The stored format of a set of named tensors (parameter versions and checkpoints).

No pickle: a file is a fixed prefix, a JSON header and the raw little-endian bytes of every
tensor, so any language can read it and nothing in it can run code when loaded.

Layout (format ``adcloud-tensors``, version 1; all integers little-endian)::

    offset  size  field
    0       8     magic  b"ADTENSR\\x00"
    8       4     u32    format version (1)
    12      4     u32    header length H (bytes of UTF-8 JSON)
    16      4     u32    CRC-32 of the header bytes
    20      4     u32    reserved (0)
    24      H     header (JSON object, see below)
    ...           zero padding up to the data start, a multiple of 64
    D       N     data: the tensors' bytes back to back, each at a multiple of 64 from D

The header holds ``format`` (``"adcloud-tensors"``), ``version``, ``data_offset`` (D),
``data_size`` (N), ``metadata`` (any JSON object the writer adds: a parameter version, a
step, a run id) and ``tensors``, a list of ``{"name", "dtype", "shape", "offset", "nbytes",
"crc32"}`` with ``offset`` relative to D and ``crc32`` that of the tensor's bytes.
``dtype`` is one of :data:`DTYPES`.  A reader checks the magic, version, header checksum,
total length (truncation) and every tensor's checksum, and reports the first problem with
its byte offset in :class:`TensorFormatError`.

Nested state (a model's ``state_dict``, an optimizer's, RNG states) is stored with
:func:`encode_tree`: tensors and NumPy arrays become entries of the file and the structure
around them becomes ``metadata["tree"]``, a JSON skeleton that keeps dict key types (int
keys of optimizer states), tuples and non-finite floats.

History: version 1 is the first.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adcloud._crc import crc32
from adcloud.train.errors import TrainError

__all__ = [
    "DTYPES",
    "FORMAT",
    "FORMAT_VERSION",
    "MAGIC",
    "TensorFile",
    "TensorFormatError",
    "decode_tensors",
    "decode_tree",
    "encode_tensors",
    "encode_tree",
]

FORMAT = "adcloud-tensors"
FORMAT_VERSION = 1
MAGIC = b"ADTENSR\x00"
_PREFIX = struct.Struct("<8sIIII")
_ALIGN = 64
_OFFSET_STANDIN = 10**15  # 16 digits: any data offset fits in its place

#: Stored dtype names and their torch types (bytes little-endian; ``bool`` one byte each).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint64": torch.uint64,
    "uint32": torch.uint32,
    "uint16": torch.uint16,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {dtype: dtype.itemsize for dtype in DTYPES.values()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("adcloud.train.tensors stores little-endian bytes; this host is big-endian")


class TensorFormatError(TrainError):
    """Bytes that are not a complete, intact ``adcloud-tensors`` file.

    ``source`` names where the bytes came from (a store key), ``offset`` the byte where the
    problem is (``-1`` when it is not about one place).
    """

    def __init__(self, message: str, *, source: str, offset: int = -1) -> None:
        super().__init__(message)
        self.source = source
        self.offset = offset


@dataclass(frozen=True)
class TensorFile:
    """A decoded file: ``tensors`` by name (CPU, in file order) and the writer's ``metadata``."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        if value.dtype.byteorder == ">":
            value = value.astype(value.dtype.newbyteorder("<"))
        try:
            return torch.from_numpy(np.ascontiguousarray(value))
        except TypeError as err:  # text, objects, datetimes: no tensor dtype holds them
            raise TrainError(
                f"array {name!r}: NumPy dtype {value.dtype} cannot be stored; supported "
                f"dtypes: {', '.join(k for k in DTYPES if k != 'bfloat16')}"
            ) from err
    if isinstance(value, torch.Tensor):
        # a lazily conjugated or negated view (x.conj()) shares x's bytes: its own values
        # exist only once resolved
        return value.detach().to("cpu").resolve_conj().resolve_neg()
    raise TrainError(f"tensor {name!r}: expected a torch.Tensor or numpy array, got {type(value)}")


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy where it is contiguous (the final join copies)."""
    flat = tensor.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.dtype is torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().data


def encode_tensors(
    tensors: Mapping[str, torch.Tensor | np.ndarray[Any, Any]],
    metadata: Mapping[str, Any] | None = None,
) -> bytes:
    """The stored bytes of ``tensors`` (name -> tensor or array) and JSON ``metadata``.

    Tensors are copied to the CPU; sparse, quantized and other dtypes outside :data:`DTYPES`
    raise :class:`TrainError` naming the tensor.
    """
    entries: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    cursor = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TrainError(f"tensor names must be non-empty strings, got {name!r}")
        tensor = _as_tensor(name, value)
        if tensor.layout is not torch.strided or tensor.dtype not in _NAME_OF:
            raise TrainError(
                f"tensor {name!r}: {tensor.dtype} ({tensor.layout}) cannot be stored; "
                f"supported dtypes: {', '.join(DTYPES)} (dense tensors only)"
            )
        raw = _tensor_bytes(tensor)
        pad = (-cursor) % _ALIGN
        if pad:
            chunks.append(b"\x00" * pad)
            cursor += pad
        entries.append(
            {
                "name": name,
                "dtype": _NAME_OF[tensor.dtype],
                "shape": list(tensor.shape),
                "offset": cursor,
                "nbytes": len(raw),
                "crc32": crc32(raw),
            }
        )
        chunks.append(raw)
        cursor += len(raw)
    header: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "data_offset": 0,
        "data_size": cursor,
        "metadata": dict(metadata or {}),
        "tensors": entries,
    }
    # The data offset depends on the header's length: write the header once with a 16-digit
    # stand-in, then put the offset in its place, padded with spaces (JSON whitespace) to the
    # same length.  "data_offset" precedes "metadata", so the first match is the header's own.
    header["data_offset"] = _OFFSET_STANDIN
    try:
        text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        raise TrainError(f"metadata cannot be stored as JSON: {err}") from err
    data_offset = _PREFIX.size + len(text)
    data_offset += (-data_offset) % _ALIGN
    standin = b'"data_offset":%d' % _OFFSET_STANDIN
    text = text.replace(standin, b'"data_offset":%-16d' % data_offset, 1)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(text), crc32(text), 0)
    padding = b"\x00" * (data_offset - _PREFIX.size - len(text))
    return b"".join([prefix, text, padding, *chunks])


def _header(data: memoryview, source: str) -> dict[str, Any]:
    if len(data) < _PREFIX.size:
        raise TensorFormatError(
            f"{source}: truncated at byte {len(data)}: an {FORMAT} file starts with a "
            f"{_PREFIX.size}-byte prefix",
            source=source,
            offset=len(data),
        )
    magic, version, length, crc, _ = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise TensorFormatError(
            f"{source}: not an {FORMAT} file (bad magic {bytes(magic)!r} at offset 0)",
            source=source,
            offset=0,
        )
    if version != FORMAT_VERSION:
        raise TensorFormatError(
            f"{source}: {FORMAT} version {version} at offset 8 is not supported (this reader "
            f"knows version {FORMAT_VERSION}); upgrade adcloud to read it",
            source=source,
            offset=8,
        )
    end = _PREFIX.size + length
    if len(data) < end:
        raise TensorFormatError(
            f"{source}: truncated at byte {len(data)} inside the header (bytes "
            f"{_PREFIX.size}..{end})",
            source=source,
            offset=len(data),
        )
    text = bytes(data[_PREFIX.size : end])
    if crc32(text) != crc:
        raise TensorFormatError(
            f"{source}: header checksum mismatch (header at offset {_PREFIX.size}, "
            f"{length} bytes): the file is corrupt",
            source=source,
            offset=_PREFIX.size,
        )
    try:
        header: Any = json.loads(text)
    except json.JSONDecodeError as err:
        raise TensorFormatError(
            f"{source}: header at offset {_PREFIX.size} is not JSON: {err}",
            source=source,
            offset=_PREFIX.size + err.pos,
        ) from err
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TensorFormatError(
            f"{source}: header at offset {_PREFIX.size} does not describe an {FORMAT} file",
            source=source,
            offset=_PREFIX.size,
        )
    return header


def decode_tensors(data: bytes | bytearray | memoryview, *, source: str = "<bytes>") -> TensorFile:
    """Read a file written by :func:`encode_tensors`, checking every checksum.

    ``source`` names the bytes in error messages (pass the store key).  Raises
    :class:`TensorFormatError` with the offset of the first problem: bad magic, unknown
    version, truncation, a corrupt header or tensor.
    """
    view = memoryview(data).cast("B")
    header = _header(view, source)
    try:
        data_offset = int(header["data_offset"])
        data_size = int(header["data_size"])
        entries = list(header["tensors"])
        metadata = dict(header.get("metadata") or {})
    except (KeyError, TypeError, ValueError) as err:
        raise TensorFormatError(
            f"{source}: header at offset {_PREFIX.size} lacks a field: {err}",
            source=source,
            offset=_PREFIX.size,
        ) from err
    total = data_offset + data_size
    if len(view) < total:
        raise TensorFormatError(
            f"{source}: truncated at byte {len(view)} of {total} (data starts at "
            f"{data_offset}); the writer did not finish: use an older version",
            source=source,
            offset=len(view),
        )
    if len(view) > total:
        raise TensorFormatError(
            f"{source}: {len(view) - total} unexpected bytes after the end of the data at "
            f"offset {total}",
            source=source,
            offset=total,
        )
    # One writable copy of the data region for all tensors (torch.frombuffer wants a writable
    # buffer, and a copy per tensor costs an allocation each); every tensor views it.
    region = bytearray(view[data_offset:total])
    tensors: dict[str, torch.Tensor] = {}
    for entry in entries:
        name = str(entry.get("name"))
        start = data_offset + int(entry["offset"])
        nbytes = int(entry["nbytes"])
        dtype = DTYPES.get(str(entry.get("dtype")))
        shape = [int(s) for s in entry["shape"]]
        if dtype is None:
            raise TensorFormatError(
                f"{source}: tensor {name!r} has unknown dtype {entry.get('dtype')!r}",
                source=source,
                offset=start,
            )
        if start < data_offset or start + nbytes > total:
            raise TensorFormatError(
                f"{source}: tensor {name!r} bytes {start}..{start + nbytes} lie outside the "
                f"data ({data_offset}..{total})",
                source=source,
                offset=start,
            )
        raw = view[start : start + nbytes]
        if crc32(raw) != int(entry["crc32"]):
            raise TensorFormatError(
                f"{source}: tensor {name!r} is corrupt (checksum mismatch in bytes "
                f"{start}..{start + nbytes})",
                source=source,
                offset=start,
            )
        count = math.prod(shape)
        itemsize = _ITEMSIZE[dtype]
        if count * itemsize != nbytes:
            raise TensorFormatError(
                f"{source}: tensor {name!r} has {nbytes} bytes, not {count * itemsize} for "
                f"shape {shape} {entry['dtype']}",
                source=source,
                offset=start,
            )
        if nbytes == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        at = start - data_offset
        buffer = region
        if at % _ALIGN:  # off the format's 64-byte grid: a private (aligned) copy
            buffer, at = bytearray(raw), 0
        if dtype is torch.bool:
            tensor = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=at)
            tensor = tensor.to(torch.bool)
        else:
            tensor = torch.frombuffer(buffer, dtype=dtype, count=count, offset=at)
        tensors[name] = tensor.reshape(shape)
    return TensorFile(tensors, metadata)


# -- nested state -------------------------------------------------------------------------

_TREE_KEY = "tree"


def _entry_name(path: str, out: Mapping[str, Any]) -> str:
    """A name for the tensor at ``path`` that no other tensor of ``out`` has: two paths can
    spell the same (key ``"a/b"`` and key ``"b"`` under ``"a"``; int key 1 and text key
    ``"1"``), and one file entry for both would give both the last one's values."""
    name = path or "/"
    if name not in out:
        return name
    n = 1
    while f"{name}#{n}" in out:
        n += 1
    return f"{name}#{n}"


def _pack(value: Any, path: str, out: dict[str, torch.Tensor | np.ndarray[Any, Any]]) -> Any:
    """The JSON skeleton of ``value``; its tensors and arrays go to ``out``."""
    if isinstance(value, torch.Tensor):
        name = _entry_name(path, out)
        out[name] = value
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        name = _entry_name(path, out)
        out[name] = value
        return {"__ndarray__": name}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        return number if math.isfinite(number) else {"__float__": repr(number)}
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TrainError(f"{path or '<root>'}: cannot store a mapping key {key!r}")
            items.append([key, _pack(item, f"{path}/{key}", out)])
        return {"__dict__": items}
    if isinstance(value, tuple):
        return {"__tuple__": [_pack(v, f"{path}/{i}", out) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_pack(v, f"{path}/{i}", out) for i, v in enumerate(value)]
    raise TrainError(
        f"{path or '<root>'}: cannot store a {type(value).__name__} (only tensors, arrays, "
        "numbers, strings, None and dicts/lists/tuples of them)"
    )


def _unpack(skeleton: Any, tensors: Mapping[str, torch.Tensor], source: str) -> Any:
    if isinstance(skeleton, list):
        return [_unpack(v, tensors, source) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if "__tensor__" in skeleton or "__ndarray__" in skeleton:
        name = str(skeleton.get("__tensor__", skeleton.get("__ndarray__")))
        if name not in tensors:
            raise TensorFormatError(
                f"{source}: the state refers to tensor {name!r}, which is not in the file",
                source=source,
            )
        tensor = tensors[name]
        return tensor if "__tensor__" in skeleton else tensor.numpy()
    if "__float__" in skeleton:
        return float(skeleton["__float__"])
    if "__tuple__" in skeleton:
        return tuple(_unpack(v, tensors, source) for v in skeleton["__tuple__"])
    if "__dict__" in skeleton:
        return {key: _unpack(v, tensors, source) for key, v in skeleton["__dict__"]}
    raise TensorFormatError(f"{source}: unknown state node {skeleton!r}", source=source)


def encode_tree(tree: Any, metadata: Mapping[str, Any] | None = None) -> bytes:
    """Store nested state (dicts, lists, tuples, numbers, strings, tensors, arrays).

    Tensors and arrays are named by their path in the tree (``/model/fc.weight``);
    ``metadata`` is stored beside the skeleton and comes back from :func:`decode_tree`.
    """
    out: dict[str, torch.Tensor | np.ndarray[Any, Any]] = {}
    skeleton = _pack(tree, "", out)
    meta = dict(metadata or {})
    if _TREE_KEY in meta:
        raise TrainError(f"metadata key {_TREE_KEY!r} is reserved for the state skeleton")
    meta[_TREE_KEY] = skeleton
    return encode_tensors(out, meta)


def decode_tree(
    data: bytes | bytearray | memoryview, *, source: str = "<bytes>"
) -> tuple[Any, dict[str, Any]]:
    """The state and metadata stored by :func:`encode_tree` (tensors on the CPU)."""
    stored = decode_tensors(data, source=source)
    meta = dict(stored.metadata)
    if _TREE_KEY not in meta:
        raise TensorFormatError(
            f"{source}: the file holds tensors but no state skeleton (metadata.{_TREE_KEY}); "
            "it was not written by encode_tree",
            source=source,
        )
    skeleton = meta.pop(_TREE_KEY)
    return _unpack(skeleton, stored.tensors, source), meta
