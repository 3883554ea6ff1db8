"""Recover an indexed copy of a ROS 1 bag whose index is missing or damaged.

A recorder that is killed leaves ``index_pos = 0`` and often a truncated last chunk;
a bag cut by a failed copy loses its index region.  :func:`reindex_bag` scans the
records from the start, keeps every chunk that is complete and decodes, collects the
connection records (from inside chunks and between them), picks up loose message
records that an interrupted recorder wrote after an unfinished chunk header, and
writes a new bag: the recovered chunk records are copied byte for byte (same
compression), loose messages go into one extra uncompressed chunk, and fresh
INDEX_DATA, CONNECTION and CHUNK_INFO records are written.  The source is only read.

What is dropped (a truncated tail, a chunk that does not decompress, messages of a
connection without a connection record) is logged as a warning.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from adcloud._commit import process_umask
from adcloud.binpipe._ros1 import (
    MAGIC,
    FormatError,
    Op,
    bag_header,
    chunk_records,
    decompress_chunk,
    encode_header,
    encode_record,
    encode_time,
    op_of,
    parse_header,
    read_connection,
)
from adcloud.binpipe.bags_io import RangeReader, file_size, open_fs, options_tuple, read_range
from adcloud.binpipe.errors import BagError

__all__ = ["ReindexReport", "reindex_bag"]

_log = logging.getLogger(__name__)

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER_RECORD_BYTES = 4096


@dataclass
class _Chunk:
    """A recovered chunk: its record, and per connection ``(time, offset)`` entries."""

    record: bytes
    entries: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass
class ReindexReport:
    """What :func:`reindex_bag` recovered and dropped (also logged)."""

    chunks: int = 0
    messages: int = 0
    connections: int = 0
    dropped: list[str] = field(default_factory=list)


def _index_chunk(
    content: bytes | memoryview, conns: dict[int, bytes]
) -> dict[int, list[tuple[int, int]]]:
    """Per-connection index entries of a chunk's content; connection records go to ``conns``."""
    entries: dict[int, list[tuple[int, int]]] = {}
    for rel, op, fields, data, end in chunk_records(content):
        if op == Op.CONNECTION:
            conn = read_connection(fields, data, rel)
            conns.setdefault(conn.id, bytes(memoryview(content)[rel:end]))
        elif op == Op.MSGDATA:
            conn_id = (
                _U32.unpack(fields.get("conn", b""))[0]
                if len(fields.get("conn", b"")) == 4
                else None
            )
            time = fields.get("time", b"")
            if conn_id is None or len(time) != 8:
                raise FormatError(rel, "message record without conn/time fields")
            sec, nsec = struct.unpack("<II", time)
            entries.setdefault(conn_id, []).append((sec * 1_000_000_000 + nsec, rel))
        else:
            raise FormatError(rel, f"unexpected record op {op} inside a chunk")
    return entries


def _write_bag(
    dst: Path, chunks: list[_Chunk], conns: dict[int, bytes], report: ReindexReport
) -> None:
    """Write header, chunks with INDEX_DATA, and the index region to ``dst``."""
    with dst.open("wb") as out:
        out.write(MAGIC)
        out.write(b"\0" * _HEADER_RECORD_BYTES)
        infos = []
        for chunk in chunks:
            pos = out.tell()
            out.write(chunk.record)
            for conn_id, items in chunk.entries.items():
                out.write(
                    encode_record(
                        {
                            "op": bytes([Op.IDXDATA]),
                            "ver": _U32.pack(1),
                            "conn": _U32.pack(conn_id),
                            "count": _U32.pack(len(items)),
                        },
                        b"".join(encode_time(t) + _U32.pack(off) for t, off in items),
                    )
                )
            times = [t for items in chunk.entries.values() for t, _ in items]
            infos.append((pos, min(times, default=0), max(times, default=0), chunk.entries))
        index_pos = out.tell()
        for conn_id in sorted(conns):
            out.write(conns[conn_id])
        for pos, start, end, entries in infos:
            out.write(
                encode_record(
                    {
                        "op": bytes([Op.CHUNK_INFO]),
                        "ver": _U32.pack(1),
                        "chunk_pos": _U64.pack(pos),
                        "start_time": encode_time(start),
                        "end_time": encode_time(end),
                        "count": _U32.pack(len(entries)),
                    },
                    b"".join(_U32.pack(c) + _U32.pack(len(v)) for c, v in entries.items()),
                )
            )
        header = encode_header(
            {
                "op": bytes([Op.BAGHEADER]),
                "index_pos": _U64.pack(index_pos),
                "conn_count": _U32.pack(len(conns)),
                "chunk_count": _U32.pack(len(chunks)),
            }
        )
        pad = _HEADER_RECORD_BYTES - len(header) - 4
        out.seek(len(MAGIC))
        out.write(header + _U32.pack(pad) + b" " * pad)
    report.chunks = len(chunks)
    report.connections = len(conns)


def reindex_bag(
    src_uri: str,
    dst_path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, object] | None = None,
    report: ReindexReport | None = None,
) -> Path:
    """Write an indexed, readable copy of the ROS 1 bag at ``src_uri`` to ``dst_path``.

    ``src_uri`` is any fsspec URL (read sequentially, never modified); ``dst_path`` is
    a local path, written through a temporary file and renamed, so it never holds a
    partial bag.  Every complete chunk is kept byte for byte; a truncated or
    undecodable chunk is dropped.  Raises :class:`BagError` if the file is not a ROS 1
    bag or its header is unreadable.  Pass a :class:`ReindexReport` to learn what was
    recovered.
    """
    report = report if report is not None else ReindexReport()
    dst = Path(dst_path)
    fs, path = open_fs(src_uri, options_tuple(storage_options))
    if (src_local := Path(path)).exists() and src_local.resolve() == dst.resolve():
        raise BagError(f"{src_uri}: reindex would overwrite its source; choose another path")
    size = file_size(fs, path, src_uri)
    head = read_range(fs, path, 0, min(size, 8192), uri=src_uri, where="bag header")
    _, data_start = bag_header(head, src_uri)
    reader = RangeReader(fs, path, data_start, size, uri=src_uri, where="reindex scan")

    conns: dict[int, bytes] = {}
    chunks: list[_Chunk] = []
    loose: list[bytes] = []
    loose_entries: dict[int, list[tuple[int, int]]] = {}
    loose_size = 0

    def drop(offset: int, what: str) -> None:
        msg = f"{src_uri}: byte offset {offset}: {what}"
        report.dropped.append(msg)
        _log.warning("reindex: %s", msg)

    while reader.remaining > 0:
        offset = reader.pos
        try:
            (hlen,) = _U32.unpack(reader.read(4))
            fields = parse_header(reader.read(hlen), offset + 4)
            (dlen,) = _U32.unpack(reader.read(4))
            data = reader.read(dlen)
            op = op_of(fields, offset)
        except (BagError, FormatError) as err:
            drop(offset, f"truncated or unreadable record; {size - offset} bytes dropped ({err})")
            break
        if op == Op.CHUNK:
            try:
                compression = fields.get("compression", b"").decode()
                raw_size = _U32.unpack(fields.get("size", b"\0\0\0\0"))[0]
                content = decompress_chunk(compression, data, raw_size)
                entries = _index_chunk(content, conns)
            except (FormatError, UnicodeDecodeError, struct.error) as err:
                drop(offset, f"chunk dropped: {err}")
                continue
            if entries:
                chunks.append(_Chunk(encode_record(fields, data), entries))
        elif op == Op.CONNECTION:
            try:
                conn = read_connection(fields, data, offset)
            except FormatError as err:
                drop(offset, f"connection record dropped: {err}")
                continue
            record = encode_record(fields, data)
            conns.setdefault(conn.id, record)
            loose.append(record)
            loose_size += len(record)
        elif op == Op.MSGDATA:
            conn_raw, time_raw = fields.get("conn", b""), fields.get("time", b"")
            if len(conn_raw) != 4 or len(time_raw) != 8:
                drop(offset, "message record without conn/time fields dropped")
                continue
            sec, nsec = struct.unpack("<II", time_raw)
            loose_entries.setdefault(_U32.unpack(conn_raw)[0], []).append(
                (sec * 1_000_000_000 + nsec, loose_size)
            )
            record = encode_record(fields, data)
            loose.append(record)
            loose_size += len(record)
        elif op in (Op.IDXDATA, Op.CHUNK_INFO):
            continue
        else:
            drop(offset, f"unexpected record op {op}; the rest of the file is dropped")
            break

    if loose_entries:
        content = b"".join(loose)
        record = encode_record(
            {
                "op": bytes([Op.CHUNK]),
                "compression": b"none",
                "size": _U32.pack(len(content)),
            },
            content,
        )
        chunks.append(_Chunk(record, loose_entries))
    for chunk in chunks:
        unknown = [c for c in chunk.entries if c not in conns]
        for conn_id in unknown:
            drop(
                0,
                f"{len(chunk.entries[conn_id])} messages of connection {conn_id} "
                "have no connection record and are left out of the index",
            )
            del chunk.entries[conn_id]
    chunks = [c for c in chunks if c.entries]
    report.messages = sum(len(v) for c in chunks for v in c.entries.values())

    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        _write_bag(Path(tmp), chunks, conns, report)
        # mkstemp makes the file private (0600); a copy is a bag like any other, readable
        # as the umask allows (executors of another user read reindex_dir copies too)
        Path(tmp).chmod(0o666 & ~process_umask())
        Path(tmp).replace(dst)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise BagError(f"{src_uri}: cannot write the reindexed copy {dst}: {err}") from err
    _log.info(
        "reindexed %s -> %s: %d chunks, %d messages, %d connections, %d problems",
        src_uri,
        dst,
        report.chunks,
        report.messages,
        report.connections,
        len(report.dropped),
    )
    return dst
