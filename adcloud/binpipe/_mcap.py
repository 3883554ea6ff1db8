"""MCAP backend: summary reading on the driver, chunk-range reading on executors.

The driver reads the 8-byte magic, the footer (last 37 bytes) and the summary section
``[summary_start, EOF)`` with ranged reads, and parses the summary with the ``mcap``
package (schemas, channels, chunk indexes, statistics).  Chunk ``i`` spans
``[chunk_start_offset_i, chunk_start_offset_{i+1})``: the chunk record, its message
index records and whatever else the writer put between chunks.  Per-channel counts
per chunk come from the sizes of the message index records (each is
``15 + 16 * count`` bytes), so the topic filter drops chunks without reading them.

Executors parse their range with a small record parser of their own rather than the
``mcap`` package's ``breakup_chunk``: it reports byte offsets in errors, checks every
length against the range, and hands out ``memoryview`` slices instead of copies.
Chunk compression is ``zstd``, ``lz4`` (frame) or none; a non-zero CRC is checked.

Message order inside a partition is rosbags' (``rosbag2`` MCAP storage): by
``log_time``, then chunk position in the file, then position in the chunk.
"""

from __future__ import annotations

import io
import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import lz4.frame
import zstandard
from mcap.exceptions import McapError
from mcap.records import Channel, ChunkIndex, Footer, Schema, Statistics
from mcap.stream_reader import StreamReader
from rosbags.typesys.msg import normalize_msgtype

from adcloud._crc import crc32
from adcloud.binpipe.bags_io import RangeReader, file_size, join_member, open_fs, read_range
from adcloud.binpipe.bags_model import (
    BagFormat,
    BagIndexError,
    BagPartition,
    BagSummary,
    ChunkRef,
    Connection,
    PlanRequest,
    RawMessage,
    TopicSummary,
)
from adcloud.binpipe.bags_plan import (
    SortKey,
    chunk_partitions,
    merge_chunk_messages,
    summary_from_chunks,
)
from adcloud.binpipe.errors import BagError

__all__ = ["MAGIC", "McapBackend", "McapIndex", "read_index", "read_partition"]

_log = logging.getLogger(__name__)

MAGIC = b"\x89MCAP0\r\n"
_FOOTER_BYTES = 1 + 8 + 8 + 8 + 4
_OP_MESSAGE = 0x05
_OP_CHUNK = 0x06
_OP_MESSAGE_INDEX = 0x07
_RECORD = struct.Struct("<BQ")
_CHUNK_HEAD = struct.Struct("<QQQII")
_MESSAGE_HEAD = struct.Struct("<HIQQ")
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")
#: Schema encodings that hold ROS message definitions (whose names are ROS type names).
_ROS_SCHEMA_ENCODINGS = frozenset({"ros1msg", "ros2msg", "ros2idl"})
_HINT = "; rewrite it with `mcap recover` (MCAP CLI) to get an indexed file"


@dataclass(frozen=True)
class McapIndex:
    """What the driver knows about an MCAP file after reading its summary.

    ``channel_counts`` are the messages per channel id of the Statistics record, ``None``
    when the summary has none.  ``indexed`` is ``False`` when the summary has neither
    chunk indexes nor statistics: it then tells nothing of the messages (their count,
    times, compression), and ``chunks`` is one pseudo-chunk over the data section.
    """

    size: int
    connections: tuple[Connection, ...]
    chunks: tuple[ChunkRef, ...]
    compression: str
    message_count: int
    channel_counts: dict[int, int] | None = None
    indexed: bool = True


def _connection(channel: Channel, schema: Schema | None) -> Connection:
    if schema is None:
        msgtype, msgdef, fmt = "", "", ""
    else:
        msgtype = schema.name
        # only ROS type names are normalized ("pkg/Type" -> "pkg/msg/Type"): rosbags would
        # make "msg/foxglove.PointCloud" of a protobuf name, "msg/Foo" of a JSON schema's
        if schema.encoding in _ROS_SCHEMA_ENCODINGS:
            try:
                msgtype = normalize_msgtype(schema.name)
            except Exception:  # rosbags rejects names it cannot parse
                msgtype = schema.name
        msgdef = bytes(schema.data).decode("utf-8", errors="replace")
        fmt = schema.encoding
    return Connection(
        topic=channel.topic,
        msgtype=msgtype,
        msgdef=msgdef,
        msgdef_format=fmt,
        md5sum=channel.metadata.get("md5sum", ""),
        serialization=channel.message_encoding,
        id=channel.id,
    )


def _chunk_counts(index: ChunkIndex) -> dict[int, int] | None:
    """Messages per channel in a chunk, from the sizes of its message index records."""
    offsets = sorted((off, cid) for cid, off in index.message_index_offsets.items())
    if not offsets:
        return None
    stop = index.chunk_start_offset + index.chunk_length + index.message_index_length
    counts: dict[int, int] = {}
    for i, (off, cid) in enumerate(offsets):
        nxt = offsets[i + 1][0] if i + 1 < len(offsets) else stop
        n, rest = divmod(nxt - off - 15, 16)
        if rest or n < 0:
            return None
        counts[cid] = n
    return counts


def read_index(fs: Any, path: str, uri: str) -> McapIndex:
    """Read magic, footer and summary section of an MCAP file (three ranged reads)."""
    size = file_size(fs, path, uri)
    if size < 2 * len(MAGIC) + _FOOTER_BYTES:
        raise BagError(f"{uri}: MCAP file of {size} bytes is truncated")
    head = read_range(fs, path, 0, len(MAGIC), uri=uri, where="magic")
    if head != MAGIC:
        raise BagError(f"{uri}: not an MCAP file: bad magic {head!r} at byte offset 0")
    tail_at = size - len(MAGIC) - _FOOTER_BYTES
    tail = read_range(fs, path, tail_at, size, uri=uri, where="footer")
    if tail[-len(MAGIC) :] != MAGIC or tail[0] != 0x02:
        raise BagIndexError(
            f"{uri}: MCAP footer missing at byte offset {tail_at} (file truncated or "
            "its writer did not finish)" + _HINT
        )
    (summary_start,) = _U64.unpack_from(tail, 9)
    if summary_start == 0:
        raise BagIndexError(f"{uri}: MCAP file has no summary section" + _HINT)
    if not len(MAGIC) <= summary_start <= tail_at:
        raise BagIndexError(
            f"{uri}: MCAP footer points to a summary at byte offset {summary_start}, "
            f"outside the file" + _HINT
        )
    region = read_range(fs, path, summary_start, size, uri=uri, where="summary")
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    chunk_indexes: list[ChunkIndex] = []
    stats: Statistics | None = None
    try:
        for record in StreamReader(io.BytesIO(region), skip_magic=True).records:
            if isinstance(record, Schema):
                schemas[record.id] = record
            elif isinstance(record, Channel):
                channels[record.id] = record
            elif isinstance(record, ChunkIndex):
                chunk_indexes.append(record)
            elif isinstance(record, Statistics):
                stats = record
            elif isinstance(record, Footer):
                break
    except (McapError, ValueError, struct.error, UnicodeDecodeError) as err:
        raise BagIndexError(
            f"{uri}: MCAP summary at byte offset {summary_start} is damaged: {err}" + _HINT
        ) from err
    connections = tuple(
        _connection(channels[cid], schemas.get(channels[cid].schema_id)) for cid in sorted(channels)
    )
    chunk_indexes.sort(key=lambda c: c.chunk_start_offset)
    channel_counts = None if stats is None else dict(stats.channel_message_counts)
    chunks: list[ChunkRef] = []
    for i, ci in enumerate(chunk_indexes):
        if i + 1 < len(chunk_indexes):
            end = chunk_indexes[i + 1].chunk_start_offset
        else:
            end = ci.chunk_start_offset + ci.chunk_length + ci.message_index_length
        if ci.chunk_start_offset < len(MAGIC) or end <= ci.chunk_start_offset or end > tail_at:
            raise BagIndexError(
                f"{uri}: MCAP chunk index {i} points to bytes [{ci.chunk_start_offset}, {end}) "
                "outside the data section" + _HINT
            )
        counts = _chunk_counts(ci)
        if counts is None and stats is not None and stats.message_count == 0:
            counts = {}  # no message index records, but the statistics count no message
        elif counts is None and len(chunk_indexes) == 1 and channel_counts is not None:
            counts = channel_counts  # one chunk holds every message the statistics count
        chunks.append(
            ChunkRef(
                ci.chunk_start_offset,
                end,
                ci.message_start_time,
                ci.message_end_time + 1,
                counts,
                ci.compression or "none",
            )
        )
    indexed = bool(chunks) or stats is not None
    if not chunks and connections:
        # An unchunked file: one pseudo-chunk over the whole data section.
        start, stop = (
            (stats.message_start_time, stats.message_end_time + 1) if stats else (0, 2**63 - 1)
        )
        counts = dict(stats.channel_message_counts) if stats else None
        chunks.append(ChunkRef(len(MAGIC), summary_start, start, stop, counts, "none"))
    codecs = sorted({c.compression for c in chunks})
    total = (
        stats.message_count
        if stats
        else sum(n for c in chunks if c.counts for n in c.counts.values())
    )
    return McapIndex(
        size,
        connections,
        tuple(chunks),
        ",".join(codecs) or "none",
        total,
        channel_counts,
        indexed,
    )


#: Chunks claiming more uncompressed bytes than this are treated as corrupt, so a
#: damaged size field cannot make a reader allocate without bound.
MAX_CHUNK_BYTES = 4 << 30


def _decompress(compression: str, data: memoryview, size: int, crc: int) -> bytes | memoryview:
    if size > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk claims {size} uncompressed bytes, more than {MAX_CHUNK_BYTES}")
    try:
        if compression == "":
            out: bytes | memoryview = data
        elif compression == "zstd":
            # A frame that declares its size gets a buffer of that size, whatever
            # max_output_size says: a damaged header must not choose the allocation.
            declared = zstandard.frame_content_size(data)
            if declared not in (-1, size):
                raise ValueError(
                    f"its zstd frame declares {declared} bytes uncompressed, the chunk {size}"
                )
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size)
        elif compression == "lz4":
            declared = lz4.frame.get_frame_info(data)["content_size"]  # 0: not given
            if declared not in (0, size):
                raise ValueError(
                    f"its lz4 frame declares {declared} bytes uncompressed, the chunk {size}"
                )
            out = lz4.frame.decompress(bytes(data))
        else:
            raise ValueError(f"chunk compression {compression!r} is not supported")
    except (zstandard.ZstdError, RuntimeError, ValueError, OSError, EOFError) as err:
        raise ValueError(f"{compression or 'none'} decompression failed: {err}") from err
    if len(out) != size:
        raise ValueError(f"chunk holds {len(out)} bytes uncompressed, its header says {size}")
    if crc and crc32(out) != crc:
        raise ValueError("chunk CRC mismatch")
    return out


@dataclass
class _Chunk:
    offset: int
    start_time: int
    end_time: int
    size: int
    crc: int
    compression: str
    data_pos: int
    data_len: int
    channels: set[int]
    indexed: bool = False


def _messages(content: bytes | memoryview) -> Iterator[tuple[int, int, int, memoryview]]:
    """(offset, channel id, log_time, data) of each message record in ``content``."""
    view = memoryview(content)
    pos = 0
    n = len(view)
    while pos < n:
        if pos + 9 > n:
            raise ValueError(f"record header cut off at uncompressed offset {pos}")
        op, length = _RECORD.unpack_from(view, pos)
        body = pos + 9
        if body + length > n:
            raise ValueError(
                f"record of {length} bytes at uncompressed offset {pos} runs past the chunk"
            )
        if op == _OP_MESSAGE:
            if length < _MESSAGE_HEAD.size:
                raise ValueError(f"message record at uncompressed offset {pos} is too short")
            channel, _seq, log_time, _pub = _MESSAGE_HEAD.unpack_from(view, body)
            yield pos, channel, log_time, view[body + _MESSAGE_HEAD.size : body + length]
        pos = body + length


def _loaded(
    items: list[tuple[SortKey, RawMessage]],
) -> Callable[[], list[tuple[SortKey, RawMessage]]]:
    return lambda: items


def read_partition(part: BagPartition) -> Iterator[RawMessage]:
    """The messages of an MCAP partition in rosbags' order, filtered by topic and time."""
    uri = join_member(part.uri, part.member)
    fs, path = open_fs(uri, part.storage_options)
    where = f"partition {part.index}"
    reader = RangeReader(fs, path, part.start_offset, part.end_offset, uri=uri, where=where)
    ranks = {c.id: c for c in part.connections}
    start, end = part.start, part.end

    def keep(channel: int, time: int) -> Connection | None:
        conn = ranks.get(channel)
        if conn is None:
            return None
        if (start is not None and time < start) or (end is not None and time >= end):
            return None
        return conn

    def scan() -> Iterator[_Chunk | tuple[int, int, memoryview]]:
        current: _Chunk | None = None
        while reader.remaining > 0:
            offset = reader.pos
            op, length = _RECORD.unpack(reader.read(9))
            if op == _OP_CHUNK:
                if current is not None:
                    yield current
                head_len = _CHUNK_HEAD.size
                if length < head_len + 8:
                    raise reader.error(offset, f"chunk record of {length} bytes is too short")
                t0, t1, size, crc, clen = _CHUNK_HEAD.unpack(reader.read(head_len))
                if head_len + clen + 8 > length:
                    raise reader.error(offset, "chunk compression name runs past the record")
                try:
                    compression = bytes(reader.read(clen)).decode()
                except UnicodeDecodeError as err:
                    raise reader.error(offset, "chunk compression name is not UTF-8") from err
                (dlen,) = _U64.unpack(reader.read(8))
                rest = length - head_len - clen - 8
                if dlen > rest:
                    raise reader.error(offset, f"chunk data of {dlen} bytes runs past its record")
                current = _Chunk(offset, t0, t1, size, crc, compression, reader.pos, dlen, set())
                reader.skip(rest)
            elif op == _OP_MESSAGE_INDEX and current is not None:
                if length < 2:
                    raise reader.error(offset, "message index record is too short")
                (channel,) = _U16.unpack(reader.read(2))
                current.channels.add(channel)
                current.indexed = True
                reader.skip(length - 2)
            elif op == _OP_MESSAGE:
                if length < _MESSAGE_HEAD.size:
                    raise reader.error(offset, "message record is too short")
                channel, _seq, log_time, _pub = _MESSAGE_HEAD.unpack(
                    reader.read(_MESSAGE_HEAD.size)
                )
                yield log_time, channel, reader.read(length - _MESSAGE_HEAD.size)
            else:
                reader.skip(length)
        if current is not None:
            yield current

    def chunk_loader(chunk: _Chunk, seq: int) -> Callable[[], list[tuple[SortKey, RawMessage]]]:
        def load() -> list[tuple[SortKey, RawMessage]]:
            raw = reader.read_at(chunk.data_pos, chunk.data_len)
            try:
                content = _decompress(chunk.compression, raw, chunk.size, chunk.crc)
                items = []
                for rel, channel, time, data in _messages(content):
                    conn = keep(channel, time)
                    if conn is not None:
                        items.append(((time, 0, seq, rel), RawMessage(time, conn, data)))
            except ValueError as err:
                raise BagError(
                    f"{uri}: {where}: chunk at byte offset {chunk.offset}: {err}"
                ) from err
            return items

        return load

    floors = dict(part.time_floors)

    def chunks() -> Iterator[tuple[int | None, Callable[[], list[tuple[SortKey, RawMessage]]]]]:
        for seq, item in enumerate(scan()):
            if isinstance(item, _Chunk):
                if item.indexed and not item.channels & ranks.keys():
                    continue
                if (start is not None and item.end_time < start) or (
                    end is not None and item.start_time >= end
                ):
                    continue
                # chunks out of time order: hold messages until no later chunk can
                # hold an earlier one (a chunk the plan does not know: until the end)
                floor = floors.get(item.offset) if floors else item.start_time
                yield floor, chunk_loader(item, seq)
            else:
                time, channel, data = item
                conn = keep(channel, time)
                if conn is not None:
                    yield (
                        None if floors else time,
                        _loaded([((time, 0, seq, 0), RawMessage(time, conn, data))]),
                    )

    yield from merge_chunk_messages(chunks())


def _stats_topics(index: McapIndex, summary: BagSummary) -> tuple[TopicSummary, ...]:
    """Per-topic counts from the Statistics record, for a bag whose chunks do not all count
    their messages; rates over the bag's span (the chunks holding a topic are unknown)."""
    counts = index.channel_counts or {}
    by_topic: dict[str, int] = {}
    for conn in index.connections:
        by_topic[conn.topic] = by_topic.get(conn.topic, 0) + counts.get(conn.id, 0)
    span = (summary.end - summary.start) / 1e9
    return tuple(
        replace(t, count=n, frequency=(n - 1) / span if n > 1 and span > 0 else None)
        for t in summary.topics
        for n in (by_topic.get(t.topic, 0),)
    )


class McapBackend:
    """The MCAP entry in the backend registry."""

    def summarize(self, uri: str, storage_options: tuple[tuple[str, object], ...]) -> BagSummary:
        """Counts, topics, time span and compression from the summary section.

        Per-topic counts come from the chunks' message index records, or, where a chunk
        has none, from the Statistics record (the rate then over the whole bag's span).
        A summary with neither chunk indexes nor statistics gives ``indexed=False``, no
        counts, no times and ``compression=""`` (unknown), as an unindexed ROS 1 bag does.
        """
        fs, path = open_fs(uri, storage_options)
        index = read_index(fs, path, uri)
        summary = summary_from_chunks(
            uri, BagFormat.MCAP, index.size, index.connections, index.chunks, index.compression
        )
        summary = replace(summary, message_count=index.message_count)
        if not index.indexed:
            return replace(summary, start=0, end=0, compression="", indexed=False)
        if index.channel_counts is not None and any(c.counts is None for c in index.chunks):
            summary = replace(summary, topics=_stats_topics(index, summary))
        return summary

    def plan(self, uri: str, request: PlanRequest) -> list[BagPartition]:
        """Partitions from the chunk indexes; see :func:`adcloud.binpipe.bags.plan_partitions`."""
        fs, path = open_fs(uri, request.storage_options)
        index = read_index(fs, path, uri)
        return chunk_partitions(uri, BagFormat.MCAP, index.chunks, index.connections, request)

    def read(self, part: BagPartition) -> Iterator[RawMessage]:
        """See :func:`read_partition`."""
        return read_partition(part)
