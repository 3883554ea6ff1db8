"""The data model of bag partitioning: formats, connections, partitions, summaries.

Everything here is a frozen, cheap-to-pickle *description*: no open file, no
filesystem object.  :class:`BagPartition` crosses Spark closures; executors open the
bag through fsspec from its URI and options.  The format backends
(:mod:`adcloud.binpipe._ros1`, :mod:`adcloud.binpipe._mcap`,
:mod:`adcloud.binpipe._ros2`) share these types; the public entry points live in
:mod:`adcloud.binpipe.bags`.

Times are integer nanoseconds since the Unix epoch throughout.  Time ranges are
half-open, ``[start, end)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

from adcloud.binpipe.errors import BagError

__all__ = [
    "BagBackend",
    "BagFormat",
    "BagIndexError",
    "BagPartition",
    "BagSummary",
    "ChunkRef",
    "Connection",
    "PlanRequest",
    "RawMessage",
    "TimeSource",
    "TopicSummary",
    "UnindexedBagError",
]


class BagFormat(StrEnum):
    """On-disk format of a bag, detected from its magic bytes or directory layout."""

    ROS1 = "ros1"
    ROS2 = "ros2"
    MCAP = "mcap"


class TimeSource(StrEnum):
    """Which clock a yielded :class:`~adcloud.binpipe.codec.Message` carries.

    ``RECORD`` is the time the recorder stored (ROS 1 record time, MCAP ``log_time``,
    rosbag2 ``timestamp``).  ``HEADER`` is the ``std_msgs/Header`` stamp inside the
    message for types whose first field is a header, record time otherwise.
    Ordering and ``[start, end)`` filters always use record time.
    """

    RECORD = "record"
    HEADER = "header"


class BagIndexError(BagError):
    """A bag has no usable index (unindexed, or the index is damaged).

    ``adcloud.binpipe.reindex.reindex_bag`` writes an indexed copy;
    ``plan_partitions(..., reindex_dir=...)`` does so automatically.
    """


class UnindexedBagError(BagIndexError):
    """A ROS 1 bag has no index at all (``index_pos`` is 0, as a killed recorder leaves it)."""


@dataclass(frozen=True)
class Connection:
    """One topic/type pairing of a bag, with everything an executor needs to decode it.

    ``msgtype`` is normalized the rosbags way (``sensor_msgs/msg/PointCloud2``) for
    every format.  ``msgdef`` is the full definition text as stored in the bag (ROS 1
    connection header, MCAP schema, rosbag2 ``message_definitions``) or, where the
    bag stores none, generated from rosbags' typestore of the ROS 2 distro.
    ``msgdef_format`` is ``"ros1msg"``, ``"ros2msg"``, ``"ros2idl"`` or ``""`` (no
    definition known).  ``serialization`` is ``"ros1"`` or ``"cdr"``.  ``id`` is the
    bag-local id (ROS 1 ``conn``, MCAP channel id, rosbag2 topic number); ``-1``
    when not known.
    """

    topic: str
    msgtype: str
    msgdef: str
    msgdef_format: str
    md5sum: str
    serialization: str
    id: int = -1


@dataclass(frozen=True)
class BagPartition:
    """A description of one slice of one bag: what an executor reads, and how.

    ``index`` numbers the partitions of one bag from 0 in file order, so that merging
    the partitions of a bag by ``(record time, index)`` reproduces rosbags' reader
    order.  ``[start_offset, end_offset)`` is a byte range of the file for ROS 1 and
    MCAP (whole chunk records plus their index records); for rosbag2 sqlite3 storage
    it is a range of ``messages.id`` values.  ``member`` names the storage file inside
    a rosbag2 directory (``""`` for single-file bags).  ``connections`` are those of
    the selected topics, in the bag's connection order.  ``topics``/``start``/``end``
    are the filters (record time, ns, ``[start, end)``).  ``message_count`` comes from
    the index: ROS 1 and MCAP count the selected topics in the partition's chunks
    before the time filter; rosbag2 sqlite3 counts exactly.  ``storage_options`` are
    fsspec options as sorted key/value pairs.  ``reindexed_from`` is the bag ``uri`` is an
    indexed copy of (``plan_partitions(reindex_dir=...)``), or ``""``.  ``time_floors``
    pairs each chunk's byte offset with the least start time of that chunk and every later
    one of the partition, when the chunks are not in record-time order (a bag stamped
    with header times, or merged by a script); it is empty when they are, and then each
    chunk's own start time is that bound.  The reader yields a message only once no
    chunk still to come can hold an earlier one.  ``version`` is the size and modification
    stamps of the file the partition reads, as planned (:func:`adcloud.binpipe.bags_io.
    file_version`): a bag replaced since (a new upload to the same URL) is an error when
    the partition is read, not another recording's bytes read at this plan's offsets or
    rows; ``""`` reads without that check.
    """

    uri: str
    format: BagFormat
    index: int
    start_offset: int
    end_offset: int
    connections: tuple[Connection, ...]
    topics: tuple[str, ...] | None
    start: int | None
    end: int | None
    time_source: TimeSource
    message_count: int
    storage_options: tuple[tuple[str, object], ...] = ()
    member: str = ""
    reindexed_from: str = ""
    time_floors: tuple[tuple[int, int], ...] = ()
    version: str = ""


@dataclass(frozen=True)
class TopicSummary:
    """Per-topic facts for ``adcloud bag info``.

    ``frequency`` is in Hz: ``(count - 1)`` over the time spanned by the chunks holding
    the topic (ROS 1, bare MCAP), or over the whole bag's span (rosbag2, whose
    ``metadata.yaml`` has no per-topic times: reading them would mean reading the data; MCAP
    whose chunks have no message index records, counted from its statistics), so
    an approximation, low for a topic recorded over part of the bag only; ``None`` when the
    topic has fewer than two messages.
    """

    topic: str
    msgtype: str
    count: int
    frequency: float | None


@dataclass(frozen=True)
class BagSummary:
    """What ``adcloud bag info`` shows, read from the index only.

    ``size`` is in bytes (all storage files for a rosbag2 directory).  ``start`` is
    the first record time and ``end`` the last record time plus 1 ns (both 0 for an
    empty bag).  ``compression`` is ``"none"``, one codec name, or several joined by
    ``","``.  An unindexed ROS 1 bag has ``indexed=False``, no counts and
    ``compression=""`` (unknown): reading it needs ``reindex_bag`` first.
    """

    uri: str
    format: BagFormat
    size: int
    start: int
    end: int
    message_count: int
    topics: tuple[TopicSummary, ...]
    chunk_count: int
    compression: str
    indexed: bool

    @property
    def duration(self) -> int:
        """Span in nanoseconds from the first to just after the last message."""
        return max(self.end - self.start, 0)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready form (format as its string, topics as a list of dicts)."""
        return {
            "uri": self.uri,
            "format": str(self.format),
            "size": self.size,
            "start": self.start,
            "end": self.end,
            "duration": self.duration,
            "message_count": self.message_count,
            "topics": [
                {"topic": t.topic, "msgtype": t.msgtype, "count": t.count, "frequency": t.frequency}
                for t in self.topics
            ],
            "chunk_count": self.chunk_count,
            "compression": self.compression,
            "indexed": self.indexed,
        }


class RawMessage(NamedTuple):
    """A message as a backend yields it: record time (ns), connection and raw bytes."""

    time: int
    connection: Connection
    data: bytes | bytearray | memoryview


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a chunked bag (ROS 1, MCAP) as its index describes it.

    ``[start_offset, end_offset)`` is the chunk record and the index records after it,
    up to the next chunk.  ``[start_time, end_time)`` bounds its record times.
    ``counts`` maps connection ids to message counts; ``None`` when the index does
    not say (the chunk is then never dropped by a topic filter).
    """

    start_offset: int
    end_offset: int
    start_time: int
    end_time: int
    counts: Mapping[int, int] | None
    compression: str

    @property
    def size(self) -> int:
        """Bytes of the range."""
        return self.end_offset - self.start_offset


@dataclass(frozen=True)
class PlanRequest:
    """The normalized arguments of :func:`adcloud.binpipe.bags.plan_partitions`."""

    topics: tuple[str, ...] | None
    start: int | None
    end: int | None
    partitions_per_bag: int | None
    time_source: TimeSource
    storage_options: tuple[tuple[str, object], ...]


class BagBackend(Protocol):
    """What each bag format implements; listed in ``bags._BACKENDS``."""

    def summarize(self, uri: str, storage_options: tuple[tuple[str, object], ...]) -> BagSummary:
        """Summarize the bag at ``uri`` from its index."""
        ...

    def plan(self, uri: str, request: PlanRequest) -> list[BagPartition]:
        """Split the bag at ``uri`` into partitions, reading only its index."""
        ...

    def read(self, part: BagPartition) -> Iterator[RawMessage]:
        """Yield the partition's messages in (record time, file position) order."""
        ...
