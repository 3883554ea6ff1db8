"""Split ROS 1, ROS 2 and MCAP bags into partitions without reading them whole.

The driver reads only a bag's index (:func:`plan_partitions`, :func:`summarize`);
each Spark task reads only its byte range (:func:`read_partition`) through fsspec, so
any URL works: local paths, ``file://``, ``memory://``, ``s3://``, HDFS, Alluxio.

- ROS 1 (v2.0): one partition per chunk from the chunk index, or ``k`` groups of
  consecutive chunks of about equal size (:mod:`adcloud.binpipe._ros1`).
- MCAP: the same over the summary's chunk indexes (:mod:`adcloud.binpipe._mcap`).
- rosbag2: sqlite3 files by ``messages.id`` ranges, MCAP files by chunk
  (:mod:`adcloud.binpipe._ros2`).

Ordering contract: within a partition messages come by record time, then (ROS 1)
connection rank, then position in the file; partition indexes follow file order.
Merging all partitions of a bag by ``(record time, partition index)`` therefore
gives rosbags' own reader order (``rosbags.highlevel.AnyReader``), except where two
messages of *different connections* share one record time and sit in different
partitions of a ROS 1 bag (rosbags orders such ties by connection first).

Unindexed or damaged ROS 1 bags raise :class:`BagIndexError`;
:func:`adcloud.binpipe.reindex.reindex_bag` writes an indexed copy, and
``plan_partitions(..., reindex_dir=D)`` does that automatically, once per source.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import struct
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from functools import lru_cache
from pathlib import Path, PurePosixPath

from rosbags.interfaces import Nodetype
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

from adcloud.binpipe._mcap import MAGIC as MCAP_MAGIC
from adcloud.binpipe._mcap import McapBackend
from adcloud.binpipe._ros1 import Ros1Backend
from adcloud.binpipe._ros2 import SQLITE_MAGIC, Ros2Backend
from adcloud.binpipe.bags_io import (
    file_size,
    file_version,
    fingerprint,
    is_local,
    join_member,
    open_fs,
    options_tuple,
    read_range,
)
from adcloud.binpipe.bags_model import (
    BagBackend,
    BagFormat,
    BagIndexError,
    BagPartition,
    BagSummary,
    Connection,
    PlanRequest,
    TimeSource,
    TopicSummary,
    UnindexedBagError,
)
from adcloud.binpipe.codec import Message
from adcloud.binpipe.decode import types_from_idl
from adcloud.binpipe.errors import BagError
from adcloud.binpipe.reindex import reindex_bag

__all__ = [
    "BagFormat",
    "BagIndexError",
    "BagPartition",
    "BagSummary",
    "Connection",
    "TimeSource",
    "TopicSummary",
    "UnindexedBagError",
    "detect_format",
    "header_stamp",
    "plan_partitions",
    "read_partition",
    "read_partition_timed",
    "reindex_bag",
    "summarize",
]

_log = logging.getLogger(__name__)

_ROS1 = Ros1Backend()
#: The backend of each format.
_BACKENDS: dict[BagFormat, BagBackend] = {
    BagFormat.ROS1: _ROS1,
    BagFormat.MCAP: McapBackend(),
    BagFormat.ROS2: Ros2Backend(),
}

_HEADER_TYPE = "std_msgs/msg/Header"
_STAMP_LE = struct.Struct("<iI")
_STAMP_BE = struct.Struct(">iI")
_STAMP_ROS1 = struct.Struct("<II")


def detect_format(uri: str, *, storage_options: Mapping[str, object] | None = None) -> BagFormat:
    """The format of the bag at ``uri``, from its magic bytes or directory layout.

    A directory with ``metadata.yaml`` (or a bare sqlite ``.db3``) is ROS 2; files
    starting with ``#ROSBAG V`` are ROS 1 and with ``\\x89MCAP0\\r\\n`` MCAP,
    whatever their extension.
    """
    fs, path = open_fs(uri, options_tuple(storage_options))
    try:
        if fs.isdir(path):
            if fs.isfile(path.rstrip("/") + "/metadata.yaml"):
                return BagFormat.ROS2
            storage = sorted(
                PurePosixPath(p).name
                for p in fs.ls(path, detail=False)
                if str(p).endswith((".db3", ".mcap"))
            )
            hint = (
                f"; it holds {', '.join(storage)}: a recorder that was killed leaves no "
                f"metadata.yaml. Recreate it with `ros2 bag reindex {uri}`, or read a "
                "storage file by its own path"
                if storage
                else ""
            )
            raise BagError(f"{uri}: a directory without metadata.yaml is not a rosbag2 bag{hint}")
    except OSError as err:
        raise BagError(f"{uri}: cannot inspect: {err}") from err
    size = file_size(fs, path, uri)
    magic = read_range(fs, path, 0, min(size, 16), uri=uri, where="magic")
    if magic.startswith(b"#ROSBAG V"):
        return BagFormat.ROS1
    if magic.startswith(MCAP_MAGIC):
        return BagFormat.MCAP
    if magic.startswith(SQLITE_MAGIC):
        return BagFormat.ROS2
    raise BagError(f"{uri}: not a bag: unknown magic {magic!r} at byte offset 0")


def summarize(uri: str, *, storage_options: Mapping[str, object] | None = None) -> BagSummary:
    """Summary of a bag (for ``adcloud bag info``), read from its index only."""
    fmt = detect_format(uri, storage_options=storage_options)
    return _BACKENDS[fmt].summarize(uri, options_tuple(storage_options))


def _reindexed(
    uri: str, options: tuple[tuple[str, object], ...], reindex_dir: str
) -> tuple[str, tuple[tuple[str, object], ...]]:
    """URL (and fsspec options) of the indexed copy of ``uri`` in ``reindex_dir``.

    The copy is named by the source's stem and :func:`fingerprint` (URL, size,
    mtime), written if missing and reused otherwise.  A non-local ``reindex_dir``
    (``s3://...``) gets the copy uploaded and is opened with the source's options.
    """
    fs, path = open_fs(uri, options)
    name = f"{PurePosixPath(path).stem or 'bag'}-{fingerprint(fs, path, uri)}.bag"
    target = reindex_dir.rstrip("/") + "/" + name
    tfs, tpath = open_fs(target, options)
    local = is_local(tfs)
    if tfs.exists(tpath):
        _log.warning("%s has no usable index; using the reindexed copy %s", uri, target)
    else:
        _log.warning("%s has no usable index; writing a reindexed copy to %s", uri, target)
        if local:
            reindex_bag(uri, tpath, storage_options=dict(options))
        else:
            with tempfile.TemporaryDirectory(prefix="adcloud-reindex-") as tmp:
                copy = reindex_bag(uri, Path(tmp) / name, storage_options=dict(options))
                try:
                    tfs.put_file(str(copy), tpath)
                except OSError as err:
                    raise BagError(f"{uri}: cannot upload the reindexed copy to {target}") from err
    return (tpath, ()) if local else (target, options)


def plan_partitions(
    uri: str,
    *,
    topics: Iterable[str] | None = None,
    start: int | None = None,
    end: int | None = None,
    partitions_per_bag: int | None = None,
    time_source: TimeSource | str = TimeSource.RECORD,
    storage_options: Mapping[str, object] | None = None,
    reindex_dir: str | Path | None = None,
    partition_bytes: int | None = None,
    min_partitions: int = 1,
) -> list[BagPartition]:
    """Split the bag at ``uri`` into partitions, reading only its index.

    ``topics`` selects topics (all if ``None``); ``[start, end)`` selects record times
    in ns.  ``partitions_per_bag=None`` makes one partition per chunk (ROS 1, MCAP) or
    per ~64 MiB of rows (rosbag2 sqlite3); an int ``k`` groups consecutive chunks into
    at most ``k`` partitions of about equal byte size (rosbag2: at least one per
    storage file).  Chunks without a selected topic or outside ``[start, end)`` (by
    the index's chunk times) are dropped before any message byte is read.  An empty
    list means nothing matched.

    ``reindex_dir`` (a path or fsspec URL that the executors can read too): for a ROS 1
    bag without a usable index, write (once; reused while the source's URL, size and
    mtime stay the same) an indexed copy there with :func:`reindex_bag` and plan on
    that copy, logging a warning; the partitions then name the copy.  Without it such
    a bag raises :class:`BagIndexError`.

    ``partition_bytes`` (ROS 1 and MCAP, with ``partitions_per_bag=None``): group
    consecutive chunks so a partition holds about that many bytes, but keep at least
    ``min_partitions`` partitions (or one per chunk, if fewer) so a small bag still
    spreads over the executors.  A Spark task costs tens of milliseconds, so one task
    per 1 MB chunk would spend more time scheduling than reading.
    """
    if isinstance(topics, str):
        topics = (topics,)
    start, end = _time_bound("start", start), _time_bound("end", end)
    partitions_per_bag = _count("partitions_per_bag", partitions_per_bag)
    partition_bytes = _count("partition_bytes", partition_bytes)
    min_partitions = _count("min_partitions", min_partitions) or 1
    try:
        time_source = TimeSource(time_source)
    except ValueError:
        choices = ", ".join(t.value for t in TimeSource)
        raise BagError(f"time_source {time_source!r} is not one of {choices}") from None
    if partitions_per_bag is not None and partitions_per_bag < 1:
        raise BagError(f"partitions_per_bag must be >= 1 or None, not {partitions_per_bag}")
    if start is not None and end is not None and end < start:
        raise BagError(f"end ({end}) is before start ({start})")
    options = options_tuple(storage_options)
    request = PlanRequest(
        topics=None if topics is None else tuple(dict.fromkeys(topics)),
        start=start,
        end=end,
        partitions_per_bag=partitions_per_bag,
        time_source=time_source,
        storage_options=options,
    )
    fmt = detect_format(uri, storage_options=storage_options)
    try:
        parts = _BACKENDS[fmt].plan(uri, request)
    except BagIndexError:
        if reindex_dir is None or fmt is not BagFormat.ROS1:
            raise
        copy, copy_options = _reindexed(uri, options, str(reindex_dir))
        source, uri, request = uri, copy, replace(request, storage_options=copy_options)
        parts = [replace(p, reindexed_from=source) for p in _BACKENDS[fmt].plan(uri, request)]
    if partitions_per_bag is None and partition_bytes and fmt is not BagFormat.ROS2 and parts:
        total = sum(p.end_offset - p.start_offset for p in parts)
        wanted = max(-(-total // partition_bytes), min(len(parts), min_partitions))
        if wanted < len(parts):
            source = parts[0].reindexed_from
            grouped = _BACKENDS[fmt].plan(uri, replace(request, partitions_per_bag=wanted))
            parts = [replace(p, reindexed_from=source) for p in grouped]
    parts = _versioned(parts)
    _log.info(
        "%s: %d partitions (%s), %d messages by the index",
        uri,
        len(parts),
        fmt,
        sum(p.message_count for p in parts),
    )
    return parts


def _versioned(parts: list[BagPartition]) -> list[BagPartition]:
    """``parts`` with the version of the file each reads (see :class:`BagPartition`)."""
    versions: dict[str, str] = {}
    out = []
    for part in parts:
        url = join_member(part.uri, part.member)
        if url not in versions:
            fs, path = open_fs(url, part.storage_options)
            versions[url] = file_version(fs, path, url)
        out.append(replace(part, version=versions[url]))
    return out


def _check_version(part: BagPartition) -> None:
    """:class:`BagError` when the file ``part`` reads is no longer the one planned."""
    if not part.version:
        return
    url = join_member(part.uri, part.member)
    fs, path = open_fs(url, part.storage_options)
    now = file_version(fs, path, url)
    if now != part.version:
        raise BagError(
            f"{url}: partition {part.index}: the bag was replaced after its partitions were "
            f"planned (planned on {part.version}; now {now}); plan it again (a new from_bags, "
            "ingest or read) to read the new version"
        )


def _time_bound(name: str, value: object) -> int | None:
    """``start``/``end`` as a Python int of ns: a NumPy integer (which sqlite3 would bind
    as a BLOB, matching no row) made an int, a float rounded up (``t >= 1.5`` and
    ``t < 1.5`` hold for integer ``t`` as ``t >= 2`` and ``t < 2`` do), else BagError."""
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return math.ceil(float(value))
    raise BagError(f"{name} must be a time in ns (an integer), not {value!r}")


def _count(name: str, value: int | None) -> int | None:
    """An optional whole-number argument as a Python int, else BagError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise BagError(f"{name} must be a whole number, not {value!r}")
    return operator.index(value)


@lru_cache(maxsize=1024)
def _has_header(conn: Connection) -> bool:
    """Whether the first field of ``conn``'s type is a ``std_msgs/Header``.

    Decided from the connection's message definition; from rosbags' typestore (ROS 1
    Noetic or ROS 2 Humble) when the bag stores none; ``False`` if neither knows it.
    """
    if conn.serialization not in ("ros1", "cdr"):
        return False
    fields = None
    try:
        if conn.msgdef and conn.msgdef_format in ("ros1msg", "ros2msg"):
            fields = get_types_from_msg(conn.msgdef, conn.msgtype)[conn.msgtype][1]
        elif conn.msgdef and conn.msgdef_format == "ros2idl":
            fields = types_from_idl(conn.msgdef)[conn.msgtype][1]
    except Exception as err:  # rosbags' parsers raise many kinds on odd definitions
        _log.debug("cannot parse the definition of %s (%s): %s", conn.topic, conn.msgtype, err)
    if fields is None:
        store = _typestore(
            Stores.ROS1_NOETIC if conn.serialization == "ros1" else Stores.ROS2_HUMBLE
        )
        if conn.msgtype not in store.fielddefs:
            return False
        fields = store.fielddefs[conn.msgtype][1]
    if not fields:
        return False
    kind, desc = fields[0][1]
    return bool(kind == Nodetype.NAME and desc == _HEADER_TYPE)


@lru_cache(maxsize=4)
def _typestore(store: Stores) -> Typestore:
    return get_typestore(store)


def header_stamp(data: bytes | bytearray | memoryview, serialization: str) -> int:
    """The ``std_msgs/Header`` stamp (ns) at the start of a serialized message.

    ROS 1: bytes 4..12 after the ``uint32 seq`` (u32 sec, u32 nsec, little-endian).
    CDR: bytes 4..12 after the 4-byte encapsulation header (i32 sec, u32 nanosec, in
    the byte order the encapsulation names).  Raises ``ValueError`` if too short.
    """
    if len(data) < 12:
        raise ValueError(f"{len(data)} bytes are too few for a header stamp")
    if serialization == "ros1":
        sec, nsec = _STAMP_ROS1.unpack_from(data, 4)
    else:
        little = bool(data[1] & 1)
        sec, nsec = (_STAMP_LE if little else _STAMP_BE).unpack_from(data, 4)
    return int(sec) * 1_000_000_000 + int(nsec)


def read_partition_timed(part: BagPartition) -> Iterator[tuple[Message, int]]:
    """Like :func:`read_partition`, with each message's record time (ns) beside it.

    With ``TimeSource.HEADER`` the message carries the header stamp; the record time
    is what merging partitions of one bag in rosbags' order needs.
    """
    if part.time_source != TimeSource.HEADER and part.format == BagFormat.ROS1:
        return ((msg, msg.timestamp) for msg in _ros1_messages(part))
    return _read_timed(part)


def _ros1_messages(part: BagPartition) -> Iterator[Message]:
    _check_version(part)
    yield from _ROS1.read_messages(part)


def _read_timed(part: BagPartition) -> Iterator[tuple[Message, int]]:
    _check_version(part)
    backend = _BACKENDS[part.format]
    use_header = part.time_source == TimeSource.HEADER
    for raw in backend.read(part):
        conn = raw.connection
        stamp = raw.time
        if use_header and _has_header(conn):
            try:
                stamp = header_stamp(raw.data, conn.serialization)
            except ValueError as err:
                raise BagError(
                    f"{part.uri}: partition {part.index}: message on {conn.topic} at record "
                    f"time {raw.time}: {err}"
                ) from err
        yield Message(conn.topic, stamp, conn.msgtype, raw.data), raw.time


def read_partition(part: BagPartition) -> Iterator[Message]:
    """Yield the messages of one partition as ``Message(topic, timestamp, msgtype, data)``.

    ``data`` is the serialized message exactly as stored (ROS 1 or CDR; decompressed
    for rosbag2 message-compressed bags), often a ``memoryview`` into a decompressed
    chunk.  Messages come ordered by (record time, connection rank for ROS 1, position
    in the file) and filtered by topic and ``[start, end)`` on *record* time.

    ``timestamp`` is record time in ns unless ``part.time_source`` is
    :attr:`TimeSource.HEADER`: then, for types whose first field is a
    ``std_msgs/Header`` (decided from the message definition), it is the header stamp
    (see :func:`header_stamp`), and record time for other types.  Corrupt input
    raises :class:`BagError` naming the file, the partition and the byte offset, and so
    does a bag replaced since it was planned (see ``BagPartition.version``).  Nothing is
    read before the first message is asked for.
    """
    if part.time_source != TimeSource.HEADER and part.format == BagFormat.ROS1:
        # ROS 1 builds the Message records itself, skipping RawMessage.
        return _ros1_messages(part)
    return (msg for msg, _record_time in _read_timed(part))
