"""rosbag2 backend: sqlite3 storage split by ``messages.id`` ranges, MCAP storage by chunks.

A rosbag2 bag is a directory with ``metadata.yaml`` and one or more storage files
(``.db3`` for sqlite3, ``.mcap`` for MCAP); a bare ``.db3`` file is accepted too.
Partitions name their storage file in ``BagPartition.member``.

sqlite3: the driver reads ``COUNT``/``MIN(id)``/``MAX(id)`` of the selected rows of
each file and cuts ``[min_id, max_id + 1)`` into id ranges; ``start_offset`` /
``end_offset`` of a partition are such a half-open id range and ``message_count`` is
exact (after topic and time filters).  An executor runs ``SELECT topic_id,
timestamp, data FROM messages WHERE id >= ? AND id < ? [AND topic_id IN (...)]
[AND timestamp >= ? AND timestamp < ?] ORDER BY timestamp, id``.  SQLite needs a local
file: non-local storage files are downloaded once per machine into the cache of
:func:`adcloud.binpipe.bags_io.cache_dir` (so every task on a non-local sqlite3 bag
reads the whole file once per machine); zstd ``file`` compression is undone there too.

MCAP storage: each ``.mcap`` file is planned and read by :mod:`adcloud.binpipe._mcap`.

Message definitions come from the storage (``message_definitions`` table, MCAP
schemas) or, when the bag has none, from rosbags' typestore of the bag's ROS 2
distro (Humble when the distro is unknown).  With zstd ``message`` compression the
yielded data is the decompressed CDR, as rosbags yields it.  For a bag of several
storage files, rosbags reads the files one after the other; the ``(time, partition
index)`` merge equals that order when the files do not overlap in time, which is how
rosbag2 splits them.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path, PurePath
from typing import Any

import yaml
import zstandard
from rosbags.typesys import Stores, get_typestore
from rosbags.typesys.store import Typestore

from adcloud.binpipe import _mcap
from adcloud.binpipe.bags_io import (
    cache_dir,
    file_size,
    fingerprint,
    is_local,
    join_member,
    local_copy,
    open_fs,
    read_range,
)
from adcloud.binpipe.bags_model import (
    BagFormat,
    BagPartition,
    BagSummary,
    Connection,
    PlanRequest,
    RawMessage,
    TopicSummary,
)
from adcloud.binpipe.bags_plan import chunk_partitions, select_connections
from adcloud.binpipe.errors import BagError

__all__ = [
    "ROS2_PARTITION_BYTES",
    "Ros2Backend",
    "Ros2Layout",
    "looks_like_sqlite",
    "read_layout",
    "read_partition",
]

_log = logging.getLogger(__name__)

#: With ``partitions_per_bag=None`` a sqlite3 file is cut into partitions of about
#: this many bytes (estimated from the file size and the share of selected rows).
ROS2_PARTITION_BYTES = 64 << 20

SQLITE_MAGIC = b"SQLite format 3\x00"

#: Bytes of the SQLite database header (https://sqlite.org/fileformat.html).
_SQLITE_HEADER_BYTES = 100

#: What a damaged database raises through :mod:`sqlite3` (text columns that are not
#: UTF-8 surface as ``UnicodeDecodeError``; odd column values as Type/ValueError).
_DB_ERRORS = (sqlite3.Error, UnicodeDecodeError, TypeError, ValueError)


@dataclass(frozen=True)
class Ros2Layout:
    """What ``metadata.yaml`` (or a bare ``.db3``) says about a rosbag2 bag.

    ``members`` are storage file names relative to the bag directory (``("",)`` for
    a bare file).  ``topics`` are ``(name, type, serialization, count)`` in metadata
    order.  Times are ns; ``end`` is exclusive.
    """

    storage: str
    members: tuple[str, ...]
    topics: tuple[tuple[str, str, str, int], ...]
    start: int
    end: int
    message_count: int
    compression_mode: str
    compression_format: str
    distro: str


def _typestore(distro: str) -> Typestore:
    name = f"ROS2_{distro.upper()}"
    store = Stores[name] if name in Stores.__members__ else Stores.ROS2_HUMBLE
    return _cached_typestore(store)


@lru_cache(maxsize=4)
def _cached_typestore(store: Stores) -> Typestore:
    return get_typestore(store)


def read_layout(fs: Any, path: str, uri: str) -> Ros2Layout | None:
    """The layout from ``metadata.yaml`` of the directory ``uri``; ``None`` if it has none."""
    meta_path = path.rstrip("/") + "/metadata.yaml"
    try:
        if not fs.isfile(meta_path):
            return None
        text = fs.cat_file(meta_path)
    except OSError as err:
        raise BagError(f"{uri}: cannot read metadata.yaml: {err}") from err
    try:
        doc = yaml.safe_load(text)
        if not isinstance(doc, dict) or not isinstance(
            doc.get("rosbag2_bagfile_information"), dict
        ):
            raise BagError(
                f"{uri}: metadata.yaml holds no rosbag2_bagfile_information mapping (it is "
                "empty or not rosbag2 metadata); recreate it with `ros2 bag reindex "
                f"{uri}`, or read a .db3 storage file directly"
            )
        info = doc["rosbag2_bagfile_information"]
        members = tuple(PurePath(x).name for x in info["relative_file_paths"])
        topics = tuple(
            (
                t["topic_metadata"]["name"],
                t["topic_metadata"]["type"],
                t["topic_metadata"].get("serialization_format", "cdr"),
                int(t["message_count"]),
            )
            for t in info["topics_with_message_count"]
        )
        count = int(info["message_count"])
        start = int(info["starting_time"]["nanoseconds_since_epoch"])
        duration = int(info["duration"]["nanoseconds"])
        if count and not members:
            raise BagError(
                f"{uri}: metadata.yaml counts {count} messages but lists no storage file "
                "(relative_file_paths is empty); recreate it with `ros2 bag reindex "
                f"{uri}`"
            )
        return Ros2Layout(
            storage=str(info["storage_identifier"]),
            members=members,
            topics=topics,
            start=start if count else 0,
            end=start + duration + 1 if count else 0,
            message_count=count,
            compression_mode=str(info.get("compression_mode") or "").lower(),
            compression_format=str(info.get("compression_format") or ""),
            distro=str(info.get("ros_distro") or ""),
        )
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise BagError(
            f"{uri}: metadata.yaml is not valid YAML{where}: {err.problem or err.context}"
        ) from err
    except KeyError as err:
        raise BagError(
            f"{uri}: metadata.yaml is not valid rosbag2 metadata: it has no field {err}"
        ) from err
    except (yaml.YAMLError, TypeError, ValueError) as err:
        raise BagError(f"{uri}: metadata.yaml is not valid rosbag2 metadata: {err}") from err


def _local_db(uri: str, storage_options: tuple[tuple[str, object], ...], compressed: bool) -> Path:
    """A local sqlite file for the storage file at ``uri`` (downloaded / decompressed)."""
    fs, path = open_fs(uri, storage_options)
    if not compressed:
        return local_copy(fs, path, uri)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{fingerprint(fs, path, uri)}-{PurePath(path).name.removesuffix('.zstd')}"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".unzstd-")
    os.close(fd)
    try:
        with (
            fs.open(path, "rb") as src,
            Path(tmp).open("wb") as dst,
            zstandard.ZstdDecompressor().stream_reader(src) as unz,
        ):
            shutil.copyfileobj(unz, dst, 8 << 20)
        Path(tmp).replace(target)
    except (OSError, zstandard.ZstdError) as err:
        Path(tmp).unlink(missing_ok=True)
        raise BagError(f"{uri}: zstd decompression into {directory} failed: {err}") from err
    return target


def _connect(local: Path, uri: str) -> sqlite3.Connection:
    if not local.is_file():
        # sqlite3 says only "unable to open database file"
        raise BagError(f"{uri}: no such file")
    try:
        db = sqlite3.connect(f"{local.resolve().as_uri()}?immutable=1&mode=ro", uri=True)
        db.execute("SELECT id, topic_id, timestamp, data FROM messages LIMIT 0")
    except _DB_ERRORS as err:
        raise BagError(f"{uri}: not a readable rosbag2 sqlite3 database: {err}") from err
    return db


def _check_sqlite(fs: Any, path: str, uri: str, size: int) -> bool | None:
    """Raise the reader's :class:`BagError` when the ``size``-byte storage file ``uri`` is
    not a whole rosbag2 sqlite3 database, without reading all its rows; else whether it
    holds a message (``None``: not known, for a file that is not local).

    On any filesystem: the header's magic, and a file at least as long as the page count
    times the page size that the header declares (a truncated copy is shorter).  A local
    file is opened too, for the ``messages`` table and its first and last rows: the two
    ends of the id b-tree, a few pages each whatever the file's size.
    """
    what = f"{uri}: not a readable rosbag2 sqlite3 database"
    if size < _SQLITE_HEADER_BYTES:
        raise BagError(
            f"{what}: the file is empty" if size == 0 else f"{what}: {size} bytes, no header"
        )
    header = read_range(fs, path, 0, _SQLITE_HEADER_BYTES, uri=uri, where="sqlite3 header")
    if not header.startswith(SQLITE_MAGIC):
        raise BagError(f"{what}: no SQLite header")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # the page count is valid only when its version stamp matches the change counter
    # (SQLite before 3.7.0 did not keep it)
    if pages and header[24:28] == header[92:96] and size < pages * page_size:
        raise BagError(
            f"{what}: truncated: {size} bytes where its header declares {pages} pages of "
            f"{page_size} bytes"
        )
    if not is_local(fs):
        return None  # opening it would download the whole file
    with closing(_connect(Path(path), uri)) as db:
        try:
            rows = [
                db.execute(
                    f"SELECT id, topic_id, timestamp FROM messages ORDER BY id {order} LIMIT 1"
                ).fetchall()
                for order in ("ASC", "DESC")
            ]
        except _DB_ERRORS as err:
            raise BagError(f"{what}: {err}") from err
    return bool(rows[0])


def _counted_layout(
    uri: str, layout: Ros2Layout, storage_options: tuple[tuple[str, object], ...]
) -> Ros2Layout:
    """``layout`` with the counts and times of the listed topics queried from its sqlite3
    storage files (all their rows are read), for ``metadata.yaml`` that counts no message
    of a bag that has some (a recorder killed before it wrote the final metadata)."""
    listed = {(name, typ) for name, typ, _s, _n in layout.topics}
    counts: dict[tuple[str, str], int] = {}
    starts: list[int] = []
    ends: list[int] = []
    for member in layout.members:
        murl = join_member(uri, member)
        with closing(_connect(_local_db(murl, storage_options, False), murl)) as db:
            keys = {tid: (name, typ) for tid, name, typ, _s in _topics(db, murl)}
            try:
                rows = db.execute(
                    "SELECT topic_id, COUNT(*), MIN(timestamp), MAX(timestamp) FROM messages "
                    "GROUP BY topic_id"
                ).fetchall()
            except _DB_ERRORS as err:
                raise BagError(f"{murl}: cannot read the messages table: {err}") from err
        for tid, n, lo, hi in rows:
            key = keys.get(tid)
            if key in listed:
                counts[key] = counts.get(key, 0) + int(n)
                starts.append(int(lo))
                ends.append(int(hi) + 1)
    return replace(
        layout,
        topics=tuple(
            (name, typ, ser, counts.get((name, typ), 0)) for name, typ, ser, _n in layout.topics
        ),
        start=min(starts, default=0),
        end=max(ends, default=0),
        message_count=sum(counts.values()),
    )


def _topics(db: sqlite3.Connection, uri: str) -> list[tuple[int, str, str, str]]:
    """``(id, name, type, serialization_format)`` of the topics table, by id."""
    try:
        rows = db.execute(
            "SELECT id, name, type, serialization_format FROM topics ORDER BY id"
        ).fetchall()
        return [(int(a), str(b), str(c), str(d)) for a, b, c, d in rows]
    except _DB_ERRORS as err:
        raise BagError(f"{uri}: cannot read the topics table: {err}") from err


def _msgdefs(db: sqlite3.Connection) -> dict[str, tuple[str, str]]:
    """Type name -> (definition, encoding) from ``message_definitions``, if the table exists."""
    try:
        rows = db.execute(
            "SELECT topic_type, encoding, encoded_message_definition FROM message_definitions"
        ).fetchall()
        return {str(t): (str(d), str(e)) for t, e, d in rows if d}
    except _DB_ERRORS:
        return {}


def _connections(
    topics: Sequence[tuple[str, str, str, int]],
    defs: dict[str, tuple[str, str]],
    distro: str,
) -> tuple[Connection, ...]:
    out = []
    for i, (name, msgtype, ser, _count) in enumerate(topics):
        if msgtype in defs:
            msgdef, fmt = defs[msgtype]
        else:
            msgdef, fmt = "", ""
            store = _typestore(distro)
            if msgtype in store.fielddefs:
                msgdef, _ = store.generate_msgdef(msgtype, ros_version=2)
                fmt = "ros2msg"
        out.append(Connection(name, msgtype, msgdef, fmt, "", ser, id=i + 1))
    return tuple(out)


def _where(ids: Sequence[int] | None, start: int | None, end: int | None) -> tuple[str, list[int]]:
    clauses, args = [], []
    if ids is not None:
        clauses.append(f"topic_id IN ({','.join('?' * len(ids))})")
        args += list(ids)
    # SQLite integers are int64, as the stamps are: a bound beyond them is clamped to them
    # (it selects what it would: everything, or nothing), not an OverflowError
    if start is not None:
        clauses.append("timestamp >= ?")
        args.append(min(max(start, _INT64_MIN), _INT64_MAX))
    if end is not None:
        clauses.append("timestamp < ?")
        args.append(min(max(end, _INT64_MIN), _INT64_MAX))
    return " AND ".join(clauses), args


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _bare_layout(db: sqlite3.Connection, uri: str) -> Ros2Layout:
    """The layout of a bare ``.db3`` file, from queries (it has no metadata.yaml)."""
    topics = _topics(db, uri)
    try:
        counts = dict(db.execute("SELECT topic_id, COUNT(*) FROM messages GROUP BY topic_id"))
        lo, hi, n = db.execute(
            "SELECT MIN(timestamp), MAX(timestamp), COUNT(*) FROM messages"
        ).fetchone()
        row = db.execute("SELECT ros_distro FROM schema").fetchone()
        return Ros2Layout(
            storage="sqlite3",
            members=("",),
            topics=tuple(
                (name, typ, ser, int(counts.get(tid, 0))) for tid, name, typ, ser in topics
            ),
            start=int(lo) if n else 0,
            end=int(hi) + 1 if n else 0,
            message_count=int(n),
            compression_mode="",
            compression_format="",
            distro=str(row[0]) if row else "",
        )
    except _DB_ERRORS as err:
        raise BagError(f"{uri}: cannot read the messages table: {err}") from err


def _open_bag(
    uri: str, storage_options: tuple[tuple[str, object], ...]
) -> tuple[Ros2Layout, tuple[Connection, ...]]:
    """Layout and connections (with message definitions) of a rosbag2 bag."""
    fs, path = open_fs(uri, storage_options)
    layout = read_layout(fs, path, uri)
    if layout is None:
        with closing(_connect(_local_db(uri, storage_options, False), uri)) as db:
            bare = _bare_layout(db, uri)
            return bare, _connections(bare.topics, _msgdefs(db), bare.distro)
    if layout.storage not in ("sqlite3", "mcap"):
        raise BagError(f"{uri}: rosbag2 storage {layout.storage!r} is not supported")
    if layout.compression_mode and layout.compression_format != "zstd":
        raise BagError(f"{uri}: rosbag2 compression {layout.compression_format!r} is not supported")
    if layout.storage == "mcap":
        if layout.compression_mode == "file":
            raise BagError(f"{uri}: file-compressed MCAP storage is not supported")
        defs: dict[str, tuple[str, str]] = {}
        for member in layout.members:
            murl = join_member(uri, member)
            mfs, mpath = open_fs(murl, storage_options)
            for conn in _mcap.read_index(mfs, mpath, murl).connections:
                defs.setdefault(conn.msgtype, (conn.msgdef, conn.msgdef_format))
        return layout, _connections(layout.topics, defs, layout.distro)
    first = join_member(uri, layout.members[0]) if layout.members else ""
    defs = {}
    if first:
        local = _local_db(first, storage_options, layout.compression_mode == "file")
        with closing(_connect(local, first)) as db:
            defs = _msgdefs(db)
    return layout, _connections(layout.topics, defs, layout.distro)


def _allot(weights: Sequence[float], k: int) -> list[int]:
    """At least one partition per non-zero weight, the rest of ``k`` by weight."""
    live = [i for i, w in enumerate(weights) if w > 0]
    out = [0] * len(weights)
    if not live:
        return out
    extra = max(0, k - len(live))
    total = sum(weights[i] for i in live)
    wants = {i: extra * weights[i] / total for i in live}
    for i in live:
        out[i] = 1 + int(wants[i])
    left = extra - sum(int(w) for w in wants.values())
    for i in sorted(live, key=lambda i: (-(wants[i] - int(wants[i])), i))[:left]:
        out[i] += 1
    return out


def _plan_sqlite(
    uri: str, layout: Ros2Layout, conns: tuple[Connection, ...], request: PlanRequest
) -> list[BagPartition]:
    selected = select_connections(conns, request.topics)
    if not selected:
        return []
    # the reader takes rows of the topics metadata.yaml lists, by name and type: a topic
    # of the database that it does not list (or lists with another type) is not read, so
    # it must not be counted either
    wanted = {(c.topic, c.msgtype) for c in selected}
    per_file: list[tuple[str, int, int, int, float, sqlite3.Connection, list[int] | None]] = []
    compressed = layout.compression_mode == "file"
    opened: list[sqlite3.Connection] = []
    try:
        for member in layout.members:
            murl = join_member(uri, member)
            db = _connect(_local_db(murl, request.storage_options, compressed), murl)
            opened.append(db)
            db_topics = _topics(db, murl)
            ids: list[int] | None = [
                tid for tid, name, typ, _s in db_topics if (name, typ) in wanted
            ]
            if not ids:
                continue
            if len(ids) == len(db_topics):
                ids = None  # every row is selected: no topic clause
            where, args = _where(ids, request.start, request.end)
            sql = "SELECT COUNT(*), MIN(id), MAX(id) FROM messages"
            count, lo, hi = db.execute(sql + (f" WHERE {where}" if where else ""), args).fetchone()
            if not count:
                continue
            (total,) = db.execute("SELECT COUNT(*) FROM messages").fetchone()
            mfs, mpath = open_fs(murl, request.storage_options)
            est = file_size(mfs, mpath, murl) * count / max(total, 1)
            per_file.append((member, int(count), int(lo), int(hi), est, db, ids))
        if request.partitions_per_bag is None:
            shares = [
                max(1, math.ceil(est / ROS2_PARTITION_BYTES)) for *_x, est, _d, _i in per_file
            ]
        else:
            shares = _allot([f[4] for f in per_file], request.partitions_per_bag)
        parts: list[BagPartition] = []
        for (member, _count, lo, hi, _est, db, ids), n in zip(per_file, shares, strict=True):
            span = hi + 1 - lo
            bounds = sorted({lo + span * i // n for i in range(n)} | {hi + 1})
            where, args = _where(ids, request.start, request.end)
            for a, b in itertools.pairwise(bounds):
                sql = "SELECT COUNT(*) FROM messages WHERE id >= ? AND id < ?"
                (exact,) = db.execute(
                    sql + (f" AND {where}" if where else ""), [a, b, *args]
                ).fetchone()
                if not exact:
                    continue
                parts.append(
                    BagPartition(
                        uri=uri,
                        format=BagFormat.ROS2,
                        index=len(parts),
                        start_offset=a,
                        end_offset=b,
                        connections=selected,
                        topics=request.topics,
                        start=request.start,
                        end=request.end,
                        time_source=request.time_source,
                        message_count=int(exact),
                        storage_options=request.storage_options,
                        member=member,
                    )
                )
    except _DB_ERRORS as err:
        raise BagError(f"{uri}: sqlite3 query failed while planning: {err}") from err
    finally:
        for db in opened:
            db.close()
    return parts


def _plan_mcap(
    uri: str, layout: Ros2Layout, conns: tuple[Connection, ...], request: PlanRequest
) -> list[BagPartition]:
    indexes = []
    for member in layout.members:
        murl = join_member(uri, member)
        mfs, mpath = open_fs(murl, request.storage_options)
        indexes.append((member, _mcap.read_index(mfs, mpath, murl)))
    k = request.partitions_per_bag
    shares: list[int | None] = [None] * len(indexes)
    if k is not None:
        shares = list(_allot([float(ix.size) for _m, ix in indexes], k))
    parts: list[BagPartition] = []
    for (member, index), share in zip(indexes, shares, strict=True):
        by_name = {c.topic: c for c in conns}
        # Storage channels carry the storage-local ids; definitions come from the bag.
        local = tuple(
            replace(by_name[c.topic], id=c.id) if c.topic in by_name else c
            for c in index.connections
        )
        sub = replace(request, partitions_per_bag=None if share is None else max(1, share))
        parts += chunk_partitions(
            uri, BagFormat.ROS2, index.chunks, local, sub, member=member, first_index=len(parts)
        )
    return parts


def _sqlite_rows(part: BagPartition) -> Iterator[RawMessage]:
    murl = join_member(part.uri, part.member)
    fs, path = open_fs(part.uri, part.storage_options)
    layout = read_layout(fs, path, part.uri) if part.member else None
    mode = layout.compression_mode if layout else ""
    local = _local_db(murl, part.storage_options, mode == "file")
    where_label = f"partition {part.index}"
    with closing(_connect(local, murl)) as db:
        by_key = {(c.topic, c.msgtype): c for c in part.connections}
        ids = {
            tid: by_key[(name, typ)]
            for tid, name, typ, _s in _topics(db, murl)
            if (name, typ) in by_key
        }
        if not ids:
            return
        where, args = _where(sorted(ids), part.start, part.end)
        sql = (
            "SELECT topic_id, timestamp, data FROM messages WHERE id >= ? AND id < ? AND "
            f"{where} ORDER BY timestamp, id"
        )
        unz = zstandard.ZstdDecompressor() if mode == "message" else None
        try:
            for tid, timestamp, blob in db.execute(
                sql, [part.start_offset, part.end_offset, *args]
            ):
                if tid not in ids or not isinstance(blob, bytes):
                    raise TypeError(f"row of topic {tid!r} holds a {type(blob).__name__}")
                data = blob if unz is None else unz.decompressobj().decompress(blob)
                yield RawMessage(int(timestamp), ids[tid], data)
        except (*_DB_ERRORS, zstandard.ZstdError) as err:
            raise BagError(
                f"{murl}: {where_label}: rows [{part.start_offset}, {part.end_offset}): {err}"
            ) from err


def read_partition(part: BagPartition) -> Iterator[RawMessage]:
    """The messages of a rosbag2 partition: sqlite3 rows, or MCAP chunks of one member."""
    if part.member.endswith(".mcap"):
        yield from _mcap.read_partition(part)
    else:
        yield from _sqlite_rows(part)


class Ros2Backend:
    """The rosbag2 entry in the backend registry."""

    def summarize(self, uri: str, storage_options: tuple[tuple[str, object], ...]) -> BagSummary:
        """Counts, topics and time span from ``metadata.yaml`` (queries for a bare ``.db3``).

        Each storage file is checked to be there and whole (the MCAP index, the sqlite3
        header and message table ends; see :func:`_check_sqlite`), so a bag whose metadata
        outlived its data is a :class:`BagError` here, as it is to the reader.  Local sqlite3
        storage with rows under a ``metadata.yaml`` that counts none (a killed recorder's) is
        counted from the rows instead, with a warning.
        """
        fs, path = open_fs(uri, storage_options)
        layout = read_layout(fs, path, uri)
        if layout is None:
            layout, _conns = _open_bag(uri, storage_options)
        size = 0
        chunk_count = 0
        codecs = set()
        stale = False
        for member in layout.members:
            murl = join_member(uri, member)
            mfs, mpath = open_fs(murl, storage_options)
            member_size = file_size(mfs, mpath, murl)
            size += member_size
            if layout.storage == "mcap":
                index = _mcap.read_index(mfs, mpath, murl)
                chunk_count += len(index.chunks)
                codecs.update(index.compression.split(","))
            elif layout.compression_mode != "file":  # a .zstd file is checked as it is read
                has_rows = _check_sqlite(mfs, mpath, murl, member_size)
                stale = stale or bool(has_rows and not layout.message_count)
        if stale:
            _log.warning(
                "%s: metadata.yaml counts no message, but its storage holds some (a recorder "
                "killed before it wrote the final metadata?); counting them from the storage. "
                "`ros2 bag reindex %s` rewrites metadata.yaml",
                uri,
                uri,
            )
            layout = _counted_layout(uri, layout, storage_options)
        if layout.compression_mode:
            codecs.add(f"{layout.compression_format} ({layout.compression_mode})")
        codecs.discard("none")
        span = (layout.end - layout.start) / 1e9
        topics = tuple(
            sorted(
                (
                    TopicSummary(
                        name, typ, count, (count - 1) / span if count > 1 and span > 0 else None
                    )
                    for name, typ, _ser, count in layout.topics
                ),
                key=lambda t: t.topic,
            )
        )
        return BagSummary(
            uri=uri,
            format=BagFormat.ROS2,
            size=size,
            start=layout.start,
            end=layout.end,
            message_count=layout.message_count,
            topics=topics,
            chunk_count=chunk_count,
            compression=",".join(sorted(codecs)) or "none",
            indexed=True,
        )

    def plan(self, uri: str, request: PlanRequest) -> list[BagPartition]:
        """Partitions by id range (sqlite3) or chunk (MCAP storage)."""
        layout, conns = _open_bag(uri, request.storage_options)
        if layout.storage == "mcap":
            return _plan_mcap(uri, layout, conns, request)
        return _plan_sqlite(uri, layout, conns, request)

    def read(self, part: BagPartition) -> Iterator[RawMessage]:
        """See :func:`read_partition`."""
        return read_partition(part)


def looks_like_sqlite(fs: Any, path: str, uri: str) -> bool:
    """Whether the file starts with the SQLite magic."""
    size = file_size(fs, path, uri)
    if size < len(SQLITE_MAGIC):
        return False
    return read_range(fs, path, 0, len(SQLITE_MAGIC), uri=uri, where="magic") == SQLITE_MAGIC
