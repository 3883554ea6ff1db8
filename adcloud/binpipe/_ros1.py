"""ROS 1 bag (format 2.0) backend: index reading on the driver, chunk-range reading on executors.

Layout (http://wiki.ros.org/Bags/Format/2.0): the magic ``#ROSBAG V2.0\\n``, the bag
header record at byte 13 (``index_pos``, ``conn_count``, ``chunk_count``; padded to
4096 bytes), then CHUNK records each followed by its INDEX_DATA records, and at
``index_pos`` the CONNECTION and CHUNK_INFO records.  A record is ``u32 header_len,
header, u32 data_len, data``; a header is a run of ``u32 len, name=value`` fields.

The driver reads the first few KiB and ``[index_pos, EOF)``: two ranged reads.  Chunk
``i`` spans ``[chunk_pos_i, chunk_pos_{i+1})`` (the last up to ``index_pos``).  An
executor reads only its range, through one reused window (:class:`WindowReader`),
learns each chunk's connections and times from the INDEX_DATA after it (so chunks
without selected messages are never decompressed), and decompresses (none / bz2 /
lz4 frame) the others.  The INDEX_DATA also gives every message's offset: when it
describes the chunk exactly (checked with NumPy over all record headers at once),
the messages are sliced out without parsing one header in Python; otherwise the
chunk is parsed record by record, with the same result.  Offsets are 64-bit
throughout.

Message order inside a partition is rosbags' (``rosbag1.Reader.messages``): by record
time, then connection rank in the bag's connection list, then file position.
"""

from __future__ import annotations

import bz2
import functools
import logging
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from itertools import repeat, zip_longest
from operator import itemgetter
from typing import Any, TypeVar

import lz4.frame
import numpy as np
import numpy.typing as npt
from rosbags.typesys.msg import normalize_msgtype

from adcloud.binpipe.bags_io import (
    WindowReader,
    file_size,
    join_member,
    open_fs,
    read_range,
)
from adcloud.binpipe.bags_model import (
    BagFormat,
    BagIndexError,
    BagPartition,
    BagSummary,
    ChunkRef,
    Connection,
    PlanRequest,
    RawMessage,
    UnindexedBagError,
)
from adcloud.binpipe.bags_plan import (
    SortedRun,
    SortKey,
    chunk_partitions,
    merge_sorted_runs,
    summary_from_chunks,
)
from adcloud.binpipe.codec import Message
from adcloud.binpipe.errors import BagError

__all__ = [
    "MAGIC",
    "FormatError",
    "Op",
    "Ros1Backend",
    "Ros1Index",
    "bag_header",
    "chunk_messages",
    "chunk_records",
    "decompress_chunk",
    "encode_header",
    "encode_record",
    "encode_time",
    "op_of",
    "parse_header",
    "read_connection",
    "read_index",
    "read_messages",
    "read_partition",
    "topic_name",
]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

MAGIC = b"#ROSBAG V2.0\n"
_HEAD_BYTES = 8192
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_TIME = struct.Struct("<II")
_U32LE = np.dtype("<u4")
_NS = 1_000_000_000
_NO_ENTRIES: npt.NDArray[np.uint32] = np.empty((0, 4), _U32LE)
_NO_TIMES: npt.NDArray[np.int64] = np.empty(0, np.int64)
_REINDEX_HINT = (
    "; read an indexed copy instead: adcloud bag reindex BAG COPY.bag, or adcloud ingest "
    "--reindex-dir DIR (Python: reindex_dir=DIR of BinPipeRDD.from_bags or plan_partitions)"
)


class Op(IntEnum):
    """ROS 1 record opcodes (the ``op`` header field)."""

    MSGDATA = 2
    BAGHEADER = 3
    IDXDATA = 4
    CHUNK = 5
    CHUNK_INFO = 6
    CONNECTION = 7


class FormatError(ValueError):
    """A malformed structure at ``offset`` (relative to whatever buffer was parsed)."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(what)
        self.offset = offset
        self.what = what


def parse_header(buf: bytes | memoryview, base: int = 0) -> dict[str, bytes]:
    """Fields of a record header (the bytes after its length prefix).

    ``base`` is added to offsets in :class:`FormatError`.
    """
    fields: dict[str, bytes] = {}
    pos = 0
    n = len(buf)
    while pos < n:
        if pos + 4 > n:
            raise FormatError(base + pos, "a header field length is cut off")
        (size,) = _U32.unpack_from(buf, pos)
        pos += 4
        if pos + size > n:
            raise FormatError(base + pos, f"a header field of {size} bytes runs past its header")
        field = bytes(buf[pos : pos + size])
        eq = field.find(b"=")
        if eq < 0:
            raise FormatError(base + pos, "a header field has no '='")
        fields[field[:eq].decode("latin-1")] = field[eq + 1 :]
        pos += size
    return fields


def _u8(fields: Mapping[str, bytes], name: str, base: int) -> int:
    value = fields.get(name)
    if value is None or len(value) != 1:
        raise FormatError(base, f"header field {name!r} is missing or not a uint8")
    return value[0]


def _u32(fields: Mapping[str, bytes], name: str, base: int) -> int:
    value = fields.get(name)
    if value is None or len(value) != 4:
        raise FormatError(base, f"header field {name!r} is missing or not a uint32")
    return int(_U32.unpack(value)[0])


def _u64(fields: Mapping[str, bytes], name: str, base: int) -> int:
    value = fields.get(name)
    if value is None or len(value) != 8:
        raise FormatError(base, f"header field {name!r} is missing or not a uint64")
    return int(_U64.unpack(value)[0])


def _time(fields: Mapping[str, bytes], name: str, base: int) -> int:
    value = fields.get(name)
    if value is None or len(value) != 8:
        raise FormatError(base, f"header field {name!r} is missing or not a time")
    sec, nsec = _TIME.unpack(value)
    return int(sec) * 1_000_000_000 + int(nsec)


def _str(fields: Mapping[str, bytes], name: str, base: int) -> str:
    value = fields.get(name)
    if value is None:
        raise FormatError(base, f"header field {name!r} is missing")
    try:
        return value.decode()
    except UnicodeDecodeError as err:
        raise FormatError(base, f"header field {name!r} is not UTF-8") from err


def op_of(fields: Mapping[str, bytes], base: int) -> int:
    """The record opcode of a parsed header."""
    return _u8(fields, "op", base)


def encode_time(ns: int) -> bytes:
    """A ROS 1 ``time`` (u32 sec, u32 nsec) from nanoseconds."""
    return _TIME.pack(ns // 1_000_000_000, ns % 1_000_000_000)


def encode_header(fields: Mapping[str, bytes]) -> bytes:
    """A record header with its length prefix."""
    body = b"".join(
        _U32.pack(len(name) + 1 + len(value)) + name.encode() + b"=" + value
        for name, value in fields.items()
    )
    return _U32.pack(len(body)) + body


def encode_record(fields: Mapping[str, bytes], data: bytes | memoryview) -> bytes:
    """A complete record: header and data, each with its length prefix."""
    return encode_header(fields) + _U32.pack(len(data)) + bytes(data)


def topic_name(name: str) -> str:
    """A topic normalized the way rosbags does (no empty path segments)."""
    lead = "/" if name.startswith("/") else ""
    return lead + "/".join(x for x in name.split("/") if x)


def decompress_chunk(compression: str, data: memoryview, size: int) -> bytes | memoryview:
    """The uncompressed content of a chunk; FormatError if it fails or has the wrong size."""
    try:
        if compression == "none":
            out: bytes | memoryview = data
        elif compression == "bz2":
            out = bz2.decompress(data)
        elif compression == "lz4":
            # a frame that declares its size gets a buffer of that size: a damaged header
            # (its checksum is one byte) must not choose the allocation
            declared = lz4.frame.get_frame_info(data)["content_size"]  # 0: not given
            if declared not in (0, size):
                raise FormatError(
                    0, f"its lz4 frame declares {declared} bytes uncompressed, the chunk {size}"
                )
            out = lz4.frame.decompress(data)
        else:
            raise FormatError(0, f"chunk compression {compression!r} is not supported")
    except (OSError, ValueError, RuntimeError, EOFError) as err:
        if isinstance(err, FormatError):
            raise
        raise FormatError(0, f"{compression} decompression of the chunk failed: {err}") from err
    if len(out) != size:
        raise FormatError(
            0, f"chunk holds {len(out)} bytes after decompression, its header says {size}"
        )
    return out


def read_connection(fields: Mapping[str, bytes], data: memoryview, base: int) -> Connection:
    """A :class:`Connection` from a CONNECTION record's header fields and data."""
    conn = _u32(fields, "conn", base)
    topic = topic_name(_str(fields, "topic", base))
    info = parse_header(data, base)
    msgtype = _str(info, "type", base)
    try:
        normalized = normalize_msgtype(msgtype)
    except Exception as err:  # rosbags raises its own and ValueError on odd names
        raise FormatError(base, f"message type {msgtype!r} is not valid: {err}") from err
    return Connection(
        topic=topic,
        msgtype=normalized,
        msgdef=_str(info, "message_definition", base) if "message_definition" in info else "",
        msgdef_format="ros1msg",
        md5sum=_str(info, "md5sum", base) if "md5sum" in info else "",
        serialization="ros1",
        id=conn,
    )


class _Buf:
    """Bounds-checked cursor over an in-memory buffer (index region, chunk content)."""

    def __init__(self, buf: bytes | memoryview, base: int) -> None:
        self.buf = memoryview(buf)
        self.base = base
        self.pos = 0

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise FormatError(
                self.base + self.pos,
                f"{what} of {n} bytes runs past the end of its region "
                f"({self.remaining} bytes left)",
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.take(4, what))[0])

    def record(self) -> tuple[int, dict[str, bytes], memoryview]:
        """(absolute record offset, header fields, data) of the next record."""
        start = self.base + self.pos
        try:
            hlen = self.u32("a record header length")
            fields = parse_header(self.take(hlen, "a record header"), self.base + self.pos - hlen)
            dlen = self.u32("a record data length")
            data = self.take(dlen, "a record's data")
        except FormatError as err:
            # Name the record, not the byte inside it where parsing gave up.
            raise FormatError(start, f"record: {err.what}") from err
        return start, fields, data


@dataclass(frozen=True)
class Ros1Index:
    """What the driver knows about a ROS 1 bag after reading its header and index."""

    size: int
    index_pos: int
    data_start: int
    connections: tuple[Connection, ...]
    chunks: tuple[ChunkRef, ...]


def bag_header(head: bytes, uri: str) -> tuple[dict[str, bytes], int]:
    """Fields of the bag header record and the offset just past it."""
    if not head.startswith(b"#ROSBAG V"):
        raise BagError(f"{uri}: not a ROS 1 bag: bad magic {head[:13]!r} at byte offset 0")
    if not head.startswith(MAGIC):
        raise BagError(f"{uri}: ROS bag version {head[:13]!r} is not supported (only V2.0)")
    cursor = _Buf(head, 0)
    cursor.take(len(MAGIC), "magic")
    try:
        _, fields, _ = cursor.record()
        if op_of(fields, len(MAGIC)) != Op.BAGHEADER:
            raise FormatError(len(MAGIC), "the first record is not a bag header")
    except FormatError as err:
        raise BagError(
            f"{uri}: byte offset {err.offset}: bag header record is unreadable "
            f"({err.what}); the file is truncated or not a bag"
        ) from err
    return fields, cursor.pos


def read_index(fs: Any, path: str, uri: str) -> Ros1Index:
    """Read the bag header and the index region of a ROS 1 bag (two ranged reads).

    Raises :class:`BagIndexError` for unindexed bags and damaged indexes,
    :class:`BagError` for files that are not bags or are truncated.
    """
    size = file_size(fs, path, uri)
    head = read_range(fs, path, 0, min(size, _HEAD_BYTES), uri=uri, where="bag header")
    fields, data_start = bag_header(head, uri)
    try:
        index_pos = _u64(fields, "index_pos", len(MAGIC))
        conn_count = _u32(fields, "conn_count", len(MAGIC))
        chunk_count = _u32(fields, "chunk_count", len(MAGIC))
    except FormatError as err:
        raise BagIndexError(f"{uri}: bag header: {err.what}{_REINDEX_HINT}") from err
    if fields.get("encryptor"):
        raise BagError(f"{uri}: encrypted bags are not supported")
    if index_pos == 0:
        raise UnindexedBagError(
            f"{uri}: bag is not indexed (index_pos is 0, as a killed recorder leaves it)"
            + _REINDEX_HINT
        )
    if index_pos > size:
        # the header was written whole, the rest not (yet): a copy in progress, a cut-off
        # download; reindexing such a copy would drop what the copy has still to bring
        raise BagIndexError(
            f"{uri}: the file ends at byte {size}, before its index at byte offset "
            f"{index_pos}: it is still being copied, or was cut off. Wait for the copy to "
            "finish; a bag that was cut off for good can be read up to its end through an "
            "indexed copy: adcloud bag reindex BAG COPY.bag, or adcloud ingest --reindex-dir "
            "DIR (Python: reindex_dir=DIR of BinPipeRDD.from_bags or plan_partitions)"
        )
    if index_pos < data_start:
        raise BagIndexError(
            f"{uri}: bag index is damaged: index_pos {index_pos} lies outside the file's "
            f"data [{data_start}, {size})" + _REINDEX_HINT
        )
    region = read_range(fs, path, index_pos, size, uri=uri, where="bag index")
    cursor = _Buf(region, index_pos)
    connections: list[Connection] = []
    infos: list[tuple[int, int, int, dict[int, int]]] = []
    try:
        for _ in range(conn_count):
            offset, rfields, data = cursor.record()
            if op_of(rfields, offset) != Op.CONNECTION:
                raise FormatError(offset, "expected a connection record")
            connections.append(read_connection(rfields, data, offset))
        for _ in range(chunk_count):
            offset, rfields, data = cursor.record()
            if op_of(rfields, offset) != Op.CHUNK_INFO:
                raise FormatError(offset, "expected a chunk info record")
            if (ver := _u32(rfields, "ver", offset)) != 1:
                raise FormatError(offset, f"chunk info version {ver} is not supported")
            pos = _u64(rfields, "chunk_pos", offset)
            count = _u32(rfields, "count", offset)
            start = _time(rfields, "start_time", offset) if count else 2**63 - 1
            end = _time(rfields, "end_time", offset) + 1 if count else 0
            if len(data) != 8 * count:
                raise FormatError(offset, f"chunk info holds {len(data)} bytes for {count} pairs")
            counts = {int(c): int(n) for c, n in struct.iter_unpack("<II", data)}
            infos.append((pos, start, end, counts))
    except FormatError as err:
        raise BagIndexError(
            f"{uri}: bag index is damaged at byte offset {err.offset}: {err.what}" + _REINDEX_HINT
        ) from err
    infos.sort(key=lambda x: x[0])
    chunks: list[ChunkRef] = []
    for i, (pos, start, end, counts) in enumerate(infos):
        nxt = infos[i + 1][0] if i + 1 < len(infos) else index_pos
        if pos < data_start or nxt <= pos:
            raise BagIndexError(
                f"{uri}: bag index is damaged: chunk {i} at byte offset {pos} lies outside "
                f"[{data_start}, {index_pos}) or overlaps the next chunk" + _REINDEX_HINT
            )
        chunks.append(ChunkRef(pos, nxt, start, end, counts, ""))
    return Ros1Index(size, index_pos, data_start, tuple(connections), tuple(chunks))


class _Chunk:
    """A chunk met while scanning a partition's range, with what its INDEX_DATA says."""

    __slots__ = (
        "_counts",
        "_entries",
        "compression",
        "conns",
        "data_len",
        "data_pos",
        "has_index",
        "max_time",
        "min_time",
        "offset",
        "size",
        "table",
        "times",
    )

    def __init__(
        self, offset: int, compression: str, size: int, data_pos: int, data_len: int
    ) -> None:
        self.offset = offset
        self.compression = compression
        self.size = size
        self.data_pos = data_pos
        self.data_len = data_len
        self.conns: set[int] = set()
        self.has_index = False
        self.min_time: int | None = None
        self.max_time: int | None = None
        #: Every index entry, (n, 4) little-endian u32: sec, nsec, offset in the
        #: uncompressed chunk, conn; and their record times (ns).  Set by finish().
        self.table: npt.NDArray[np.uint32] = _NO_ENTRIES
        self.times: npt.NDArray[np.int64] = _NO_TIMES
        self._counts: list[tuple[int, int]] = []  # (conn, entries) per INDEX_DATA
        self._entries: list[bytes | bytearray] = []  # their data

    def add_index(self, conn: int, count: int, data: bytes | bytearray) -> None:
        self.has_index = True
        self.conns.add(conn)
        self._counts.append((conn, count))
        self._entries.append(data)

    def finish(self) -> None:
        """Tabulate the index entries and the chunk's time span (once all are in)."""
        counts = self._counts
        n = sum(count for _conn, count in counts)
        if n == 0:
            return
        table = np.empty((n, 4), _U32LE)
        table[:, :3] = np.frombuffer(b"".join(self._entries), _U32LE).reshape(n, 3)
        at = 0
        for conn, count in counts:
            table[at : at + count, 3] = conn
            at += count
        times = table[:, 0].astype(np.int64)
        times *= _NS
        times += table[:, 1]
        self.table, self.times = table, times
        self.min_time, self.max_time = int(times.min()), int(times.max())
        self._entries = []


def scan_chunks(reader: WindowReader) -> Iterator[_Chunk]:
    """The chunks of a range with what their INDEX_DATA records say.

    A chunk is yielded once the record after its index (or the range's end) is
    reached, with its data still in the reader's window, so that decoding it right
    away re-reads nothing.  Connection records between chunks are skipped.
    """
    current: _Chunk | None = None
    pos = reader.start
    end = reader.end
    while pos < end:
        keep = None if current is None else current.data_pos
        offset = pos
        rel = reader.window(pos, 4, keep)
        (hlen,) = _U32.unpack_from(reader.buf, rel)
        rel = reader.window(pos + 4, hlen, keep)
        try:
            fields = parse_header(memoryview(reader.buf)[rel : rel + hlen], pos + 4)
        except FormatError as err:
            raise reader.error(err.offset, f"record header is corrupt: {err.what}") from err
        rel = reader.window(pos + 4 + hlen, 4, keep)
        (dlen,) = _U32.unpack_from(reader.buf, rel)
        data_pos = pos + 8 + hlen
        if data_pos + dlen > end:
            raise reader.error(
                data_pos, f"a length of {dlen} bytes runs past the end of the range at {end}"
            )
        pos = data_pos + dlen
        try:
            op = op_of(fields, offset)
            if op == Op.CHUNK:
                if current is not None:
                    current.finish()
                    yield current
                current = _Chunk(
                    offset,
                    _str(fields, "compression", offset),
                    _u32(fields, "size", offset),
                    data_pos,
                    dlen,
                )
            elif op == Op.IDXDATA:
                if current is None:
                    raise FormatError(offset, "index data before any chunk")
                if (ver := _u32(fields, "ver", offset)) != 1:
                    raise FormatError(offset, f"index data version {ver} is not supported")
                conn = _u32(fields, "conn", offset)
                count = _u32(fields, "count", offset)
                if dlen != 12 * count:
                    raise FormatError(offset, f"index data of {dlen} bytes for {count} entries")
                rel = reader.window(data_pos, dlen, current.data_pos)
                current.add_index(conn, count, reader.buf[rel : rel + dlen])
            elif op != Op.CONNECTION:
                raise FormatError(offset, f"unexpected record op {op} between chunks")
        except FormatError as err:
            raise reader.error(err.offset, err.what) from err
    if current is not None:
        current.finish()
        yield current


def chunk_records(
    content: bytes | memoryview, base: int = 0
) -> Iterator[tuple[int, int, dict[str, bytes], memoryview, int]]:
    """(offset, op, header fields, data, end offset) of each record inside a chunk.

    Offsets are relative to ``content``; ``base`` only labels errors.
    """
    cursor = _Buf(content, base)
    while cursor.remaining > 0:
        rel = cursor.pos
        offset, fields, data = cursor.record()
        yield rel, op_of(fields, offset), fields, data, cursor.pos


def chunk_messages(
    content: bytes | memoryview, base: int = 0
) -> Iterator[tuple[int, int, int, memoryview]]:
    """(offset in content, conn id, record time, data) of each message of a chunk.

    Connection records inside the chunk are skipped.  ``base`` only labels errors.
    """
    for rel, op, fields, data, _end in chunk_records(content, base):
        if op == Op.MSGDATA:
            yield rel, _u32(fields, "conn", base + rel), _time(fields, "time", base + rel), data
        elif op != Op.CONNECTION:
            raise FormatError(base + rel, f"unexpected record op {op} inside a chunk")


#: A record header longer than this is never taken by the indexed fast path.
_FAST_MAX_HEADER = 1024
_ARANGE = np.arange(_FAST_MAX_HEADER + 8, dtype=np.int64)
_new_raw: Callable[[tuple[int, Connection, memoryview]], RawMessage] = functools.partial(
    tuple.__new__, RawMessage
)
_new_message: Callable[[tuple[str, int, str, memoryview]], Message] = functools.partial(
    tuple.__new__, Message
)
#: Builds the items of a chunk from parallel lists: record times, connection
#: ranks, message data.
_Make = Callable[[list[int], list[int], list[memoryview]], list[_T]]


def _message_layout(content: bytes | memoryview, first: int) -> tuple[int, int, int] | None:
    """(header length, conn value offset, time value offset) of the MSGDATA record at ``first``.

    Offsets count from the record's start.  ``None`` unless the record is a
    well-formed message record whose ``op``, ``conn`` and ``time`` fields have their
    proper sizes (the last of repeated fields counting, as in :func:`parse_header`).
    """
    size = len(content)
    if first + 4 > size:
        return None
    (hlen,) = _U32.unpack_from(content, first)
    if hlen > _FAST_MAX_HEADER or first + 8 + hlen > size:
        return None
    pos = first + 4
    stop = pos + hlen
    found: dict[bytes, tuple[int, int]] = {}
    while pos < stop:
        if pos + 4 > stop:
            return None
        (flen,) = _U32.unpack_from(content, pos)
        pos += 4
        if pos + flen > stop:
            return None
        field = bytes(content[pos : pos + flen])
        eq = field.find(b"=")
        if eq < 0:
            return None
        found[field[:eq]] = (pos + eq + 1 - first, flen - eq - 1)
        pos += flen
    op, conn, time = found.get(b"op"), found.get(b"conn"), found.get(b"time")
    if op is None or conn is None or time is None:
        return None
    if op[1] != 1 or content[first + op[0]] != Op.MSGDATA or conn[1] != 4 or time[1] != 8:
        return None
    return hlen, conn[0], time[0]


def _only_connections(content: bytes | memoryview, lo: int, hi: int) -> bool:
    """Whether ``content[lo:hi]`` is exactly a run of well-formed CONNECTION records."""
    cursor = _Buf(memoryview(content)[lo:hi], lo)
    try:
        while cursor.remaining > 0:
            offset, fields, _data = cursor.record()
            if op_of(fields, offset) != Op.CONNECTION:
                return False
    except FormatError:
        return False
    return True


def _indexed_messages(
    content: bytes | memoryview,
    chunk: _Chunk,
    ranks: Mapping[int, int],
    start: int | None,
    end: int | None,
) -> tuple[list[int], list[int], list[int], list[int], list[int]] | None:
    """The selected messages of a chunk located through its INDEX_DATA, sorted.

    Returns (record times, connection ranks, record offsets, data starts, data ends)
    in sort-key order, or ``None`` when the index does not describe the chunk
    exactly -- every record either a message record the index names, with that
    connection and time, all with one header layout, or a connection record -- in
    which case the chunk must be parsed record by record.  Both ways give the same
    messages.
    """
    table, times = chunk.table, chunk.times
    n = len(table)
    if n == 0:
        return None
    if n > 1:
        order = table[:, 2].argsort(kind="stable")
        table, times = table[order], times[order]
    offsets = table[:, 2].astype(np.int64)
    first = int(offsets[0])
    layout = _message_layout(content, first)
    if layout is None:
        return None
    hlen, conn_at, time_at = layout
    head = hlen + 8  # length prefix, header, data length
    size = len(content)
    if n * head > size or int(offsets[-1]) + head > size:
        return None
    heads = np.frombuffer(content, np.uint8)[offsets[:, None] + _ARANGE[:head]]
    # Every header must be the first one's bytes with the index's conn and time in:
    # XOR those in, and all headers must come out equal, with zeros there.
    entry = table.view(np.uint8)  # per row: sec, nsec, offset, conn
    heads[:, conn_at : conn_at + 4] ^= entry[:, 12:16]
    heads[:, time_at : time_at + 8] ^= entry[:, 0:8]
    zeros = heads[0, conn_at : conn_at + 4].tobytes() + heads[0, time_at : time_at + 8].tobytes()
    if zeros != bytes(12):
        return None
    body = heads[:, : head - 4]
    if not (body == body[0]).all():
        return None
    lengths = np.ascontiguousarray(heads[:, head - 4 :]).view(_U32LE)[:, 0]
    # Rows: record time, connection rank, record offset, data start, data end.
    rows = np.empty((5, n), np.int64)
    rows[0] = times
    rows[2] = offsets
    data_at, data_end = rows[3], rows[4]
    np.add(offsets, head, out=data_at)
    np.add(data_at, lengths, out=data_end)
    # The records must tile the chunk; what lies between them must be connections.
    holes = [(0, first)] if first else []
    if n > 1:
        gaps = offsets[1:] - data_end[:-1]
        if gaps.any():
            if gaps.min() < 0:
                return None
            holes.extend((int(data_end[i]), int(offsets[i + 1])) for i in np.flatnonzero(gaps))
    last = int(data_end[-1])
    if last > size:
        return None
    if last < size:
        holes.append((last, size))
    for lo, hi in holes:
        if not _only_connections(content, lo, hi):
            return None
    conns = chunk.conns
    ranked = rows[1]
    if len(conns) == 1:
        ranked[:] = ranks.get(next(iter(conns)), -1)
    else:
        column = table[:, 3]
        for cid in conns:
            ranked[column == cid] = ranks.get(cid, -1)
    keep = None
    if not conns <= ranks.keys():
        keep = ranked >= 0
    if start is not None and chunk.min_time is not None and chunk.min_time < start:
        keep = times >= start if keep is None else keep & (times >= start)
    if end is not None and chunk.max_time is not None and chunk.max_time >= end:
        keep = times < end if keep is None else keep & (times < end)
    if keep is not None:
        rows = rows[:, keep]
    if rows.shape[1] > 1:
        rows = rows[:, np.lexsort(rows[2::-1])]  # by time, then rank, then offset
    out_times, out_ranks, out_offsets, out_at, out_end = rows.tolist()
    return out_times, out_ranks, out_offsets, out_at, out_end


def _parsed_messages(
    content: bytes | memoryview,
    ranks: Mapping[int, int],
    start: int | None,
    end: int | None,
    chunk: _Chunk | None = None,
) -> tuple[list[int], list[int], list[int], list[memoryview]]:
    """The selected messages of a chunk parsed record by record, sorted:
    (record times, connection ranks, record offsets, data).

    With ``chunk`` (whose INDEX_DATA lists entries), the message records of the selected
    connections must be those the index lists for them, at their offsets with their
    times: a record damaged in its ``conn`` or ``time`` field would otherwise be dropped
    or misplaced without a word (ROS 1 has no checksums; the index is the only second
    copy of those fields).  Records of other connections are not compared (a reindexed
    copy keeps the records of a connection it has no definition of, unindexed).
    """
    found: list[tuple[tuple[int, int, int], memoryview]] = []
    seen: list[tuple[int, int, int]] = []
    for rel, conn, time, data in chunk_messages(content, 0):
        rank = ranks.get(conn)
        if rank is None:
            continue
        seen.append((rel, conn, time))
        if (start is not None and time < start) or (end is not None and time >= end):
            continue
        found.append(((time, rank, rel), data))
    if chunk is not None and len(chunk.table):
        _check_index(chunk, ranks, seen)
    found.sort(key=itemgetter(0))
    return (
        [k[0] for k, _ in found],
        [k[1] for k, _ in found],
        [k[2] for k, _ in found],
        [d for _, d in found],
    )


def _check_index(chunk: _Chunk, ranks: Mapping[int, int], seen: list[tuple[int, int, int]]) -> None:
    """Raise :class:`FormatError` unless ``seen`` (offset, conn, record time of each message
    record of the connections in ``ranks``, in content order) is exactly what ``chunk``'s
    index lists for those connections."""
    table = chunk.table
    entries = zip(table[:, 2].tolist(), table[:, 3].tolist(), chunk.times.tolist(), strict=True)
    listed = sorted(e for e in entries if e[1] in ranks)
    if listed == seen:
        return
    got, want = next((g, w) for g, w in zip_longest(seen, listed) if g != w)
    if got is not None and want is not None and got[0] == want[0]:
        at = got[0]
        what = (
            f"the message record says connection {got[1]} at time {got[2]} ns, the chunk's "
            f"index says connection {want[1]} at time {want[2]} ns"
        )
    elif got is not None and (want is None or got[0] < want[0]):
        at, what = got[0], "a message record the chunk's index does not list"
    else:
        assert want is not None
        at, what = want[0], "no message record where the chunk's index lists one"
    raise FormatError(
        at,
        f"{what} ({len(seen)} message records, {len(listed)} index entries of the topics "
        "read); the chunk is damaged: adcloud bag reindex BAG COPY.bag writes a copy "
        "indexed from its records",
    )


def _read_runs(part: BagPartition, make: _Make[_T]) -> Iterator[_T]:
    """The messages of a ROS 1 partition, in rosbags' order, filtered by topic and time.

    Scans the range through one reusable window; decodes each relevant chunk as a
    sorted run (through its index when that describes it exactly, else record by
    record) and merges the runs.
    """
    uri = join_member(part.uri, part.member)
    where = f"partition {part.index}"
    ranks = {c.id: rank for rank, c in enumerate(part.connections)}
    start, end = part.start, part.end

    def relevant(chunk: _Chunk) -> bool:
        if not chunk.has_index:
            return True
        if not chunk.conns & ranks.keys():
            return False
        if chunk.min_time is None or chunk.max_time is None:
            return True  # index records without entries: decode and see
        if start is not None and chunk.max_time < start:
            return False
        return not (end is not None and chunk.min_time >= end)

    def loader(reader: WindowReader, chunk: _Chunk, seq: int) -> Callable[[], SortedRun[_T]]:
        def load() -> SortedRun[_T]:
            rel = reader.window(chunk.data_pos, chunk.data_len)
            raw = memoryview(reader.buf)[rel : rel + chunk.data_len]
            if chunk.compression == "none":
                # Messages must outlive the window, which is refilled in place: copy
                # the chunk out (cheaper than fresh windows, which fault in new pages).
                raw = memoryview(bytes(raw))
            try:
                content = decompress_chunk(chunk.compression, raw, chunk.size)
                del raw
                fast = _indexed_messages(content, chunk, ranks, start, end)
                if fast is not None:
                    times, conn_ranks, offsets, lo, hi = fast
                    view = memoryview(content)
                    data = list(map(view.__getitem__, map(slice, lo, hi)))
                else:
                    times, conn_ranks, offsets, data = _parsed_messages(
                        content, ranks, start, end, chunk
                    )
            except FormatError as err:
                where_in = (
                    f"byte offset {chunk.data_pos + err.offset}"
                    if chunk.compression == "none"
                    else f"uncompressed offset {err.offset}"
                )
                raise BagError(
                    f"{uri}: {where}: chunk at byte offset {chunk.offset}, {where_in}: {err.what}"
                ) from err

            def keys() -> list[SortKey]:
                return list(zip(times, conn_ranks, repeat(seq), offsets, strict=False))

            return SortedRun(times, make(times, conn_ranks, data), keys)

        return load

    def chunks() -> Iterator[tuple[int | None, Callable[[], SortedRun[_T]]]]:
        # Opened on the first next(), not on the call: nothing happens before that.
        fs, path = open_fs(uri, part.storage_options)
        reader = WindowReader(fs, path, part.start_offset, part.end_offset, uri=uri, where=where)
        floors = dict(part.time_floors)
        for seq, chunk in enumerate(scan_chunks(reader)):
            if relevant(chunk):
                # chunks out of time order: hold messages until no later chunk can
                # hold an earlier one (a chunk the plan does not know: until the end)
                floor = floors.get(chunk.offset) if floors else chunk.min_time
                yield floor, loader(reader, chunk, seq)

    return merge_sorted_runs(chunks())


def read_partition(part: BagPartition) -> Iterator[RawMessage]:
    """The messages of a ROS 1 partition, in rosbags' order, filtered by topic and time."""
    conns = part.connections

    def make(times: list[int], ranks: list[int], data: list[memoryview]) -> list[RawMessage]:
        return list(map(_new_raw, zip(times, map(conns.__getitem__, ranks), data, strict=True)))

    return _read_runs(part, make)


def read_messages(part: BagPartition) -> Iterator[Message]:
    """:func:`read_partition` as :class:`Message` records stamped with record time."""
    topics = [c.topic for c in part.connections]
    types = [c.msgtype for c in part.connections]

    def make(times: list[int], ranks: list[int], data: list[memoryview]) -> list[Message]:
        return list(
            map(
                _new_message,
                zip(
                    map(topics.__getitem__, ranks),
                    times,
                    map(types.__getitem__, ranks),
                    data,
                    strict=True,
                ),
            )
        )

    return _read_runs(part, make)


def _compression(fs: Any, path: str, uri: str, chunk: ChunkRef) -> str:
    """Compression of a chunk, from its record header (one small ranged read)."""
    head = read_range(
        fs,
        path,
        chunk.start_offset,
        min(chunk.end_offset, chunk.start_offset + 4096),
        uri=uri,
        where="chunk header",
    )
    try:
        cursor = _Buf(head, chunk.start_offset)
        hlen = cursor.u32("a record header length")
        fields = parse_header(cursor.take(hlen, "a record header"), chunk.start_offset + 4)
        return _str(fields, "compression", chunk.start_offset)
    except FormatError as err:
        raise BagError(f"{uri}: byte offset {err.offset}: chunk header: {err.what}") from err


class Ros1Backend:
    """The ROS 1 entry in the backend registry."""

    def summarize(self, uri: str, storage_options: tuple[tuple[str, object], ...]) -> BagSummary:
        """Counts, topics and time span from the index; compression from the first chunk."""
        fs, path = open_fs(uri, storage_options)
        try:
            index = read_index(fs, path, uri)
        except UnindexedBagError:
            size = file_size(fs, path, uri)
            return BagSummary(uri, BagFormat.ROS1, size, 0, 0, 0, (), 0, "", False)
        compression = _compression(fs, path, uri, index.chunks[0]) if index.chunks else "none"
        return summary_from_chunks(
            uri, BagFormat.ROS1, index.size, index.connections, index.chunks, compression
        )

    def plan(self, uri: str, request: PlanRequest) -> list[BagPartition]:
        """Partitions from the chunk index; see :func:`adcloud.binpipe.bags.plan_partitions`."""
        fs, path = open_fs(uri, request.storage_options)
        index = read_index(fs, path, uri)
        return chunk_partitions(uri, BagFormat.ROS1, index.chunks, index.connections, request)

    def read(self, part: BagPartition) -> Iterator[RawMessage]:
        """See :func:`read_partition`."""
        return read_partition(part)

    def read_messages(self, part: BagPartition) -> Iterator[Message]:
        """See :func:`read_messages`."""
        return read_messages(part)
