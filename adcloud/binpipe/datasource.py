"""``spark.read.format("rosbag")``: ROS bags as a Spark SQL table.

A Spark 4 Python data source.  Partitions are the same chunk ranges as
:meth:`BinPipeRDD.from_bags`; each task reads its range and yields Arrow record
batches.  The ``topics``, ``start`` and ``end`` options narrow the partition plan, so
chunks without a selected topic or outside the time range are never read.

``DataFrame.filter`` is not pushed into the plan: with Spark 4.3's Python data source
filter pushdown, the narrowed plan of a filtered DataFrame was seen to leak into the
unfiltered DataFrame it came from (it then returned only the filtered rows).  Until
that is fixed upstream, narrowing is explicit, through options, and always correct.

Options: ``topics`` (comma-separated), ``start``/``end`` (ns, record time),
``partitionsPerBag``, ``partitionBytes`` (target partition size when
``partitionsPerBag`` is not set; 0 for one partition per chunk), ``minPartitions``,
``timeSource`` (``record`` or ``header``), ``batchSize`` (rows per Arrow batch),
``reindexDir`` (where an indexed copy of a ROS 1 bag without a usable index is written and
read instead; a path or URL the executors can read).  Any other option is an error.
Paths: ``load(path)`` or ``load([path, ...])``; globs and directories are expanded.

Columns: ``bag`` (its URL), ``topic``, ``timestamp`` (ns; per ``timeSource``),
``record_time`` (ns, the bag's record time), ``msgtype``, ``data`` (the serialized
message bytes as stored), ``partition`` (partition index within the bag).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    InputPartition,
)

from adcloud.binpipe.bags import (
    BagPartition,
    TimeSource,
    plan_partitions,
    read_partition_timed,
)
from adcloud.binpipe.errors import BinpipeError
from adcloud.binpipe.rdd import DEFAULT_PARTITION_BYTES, expand_uris

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["SCHEMA", "RosbagDataSource", "register_rosbag_source"]

SCHEMA = (
    "bag string, topic string, timestamp long, record_time long, msgtype string, "
    "data binary, partition int"
)


def register_rosbag_source(spark: SparkSession) -> None:
    """Make ``spark.read.format("rosbag")`` available in this session."""
    spark.dataSource.register(RosbagDataSource)


class _Partition(InputPartition):
    def __init__(self, part: BagPartition) -> None:
        super().__init__(part)
        self.part = part


class RosbagDataSource(DataSource):
    """The ``rosbag`` format for ``spark.read``."""

    @classmethod
    def name(cls) -> str:
        return "rosbag"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return RosbagReader(dict(self.options))


#: The reader's options (Spark passes them case-insensitively).
_OPTIONS = (
    "topics",
    "start",
    "end",
    "partitionsPerBag",
    "partitionBytes",
    "minPartitions",
    "timeSource",
    "batchSize",
    "reindexDir",
    "path",
    "paths",
)


def _paths(options: dict[str, str]) -> list[str]:
    if "paths" in options:
        raw = options["paths"]
        try:
            paths = json.loads(raw)
        except json.JSONDecodeError:
            paths = [p for p in raw.split(",") if p]
        return [str(p) for p in paths]
    if "path" in options:
        return [options["path"]]
    raise BinpipeError('spark.read.format("rosbag") needs a path: .load("drive.bag")')


@overload
def _int_option(
    options: dict[str, str], name: str, default: int, *, minimum: int | None = None
) -> int: ...
@overload
def _int_option(
    options: dict[str, str], name: str, default: None, *, minimum: int | None = None
) -> int | None: ...
def _int_option(
    options: dict[str, str], name: str, default: int | None, *, minimum: int | None = None
) -> int | None:
    """Integer option ``name`` (looked up lower-cased); a clear error naming it when the
    value is not an integer or is below ``minimum``."""
    raw = options.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise BinpipeError(
            f'spark.read.format("rosbag"): option {name}={raw!r} is not an integer'
        ) from None
    if minimum is not None and value < minimum:
        raise BinpipeError(
            f'spark.read.format("rosbag"): option {name}={value} must be at least {minimum}'
        )
    return value


class RosbagReader(DataSourceReader):
    """Plans chunk partitions on the driver and reads them on executors."""

    def __init__(self, options: dict[str, str]) -> None:
        # Spark hands options over case-insensitively (as lower-case keys once copied).
        options = {key.lower(): value for key, value in options.items()}
        unknown = sorted(set(options) - {name.lower() for name in _OPTIONS})
        if unknown:  # a misspelt option would otherwise read every topic, silently
            raise BinpipeError(
                f'spark.read.format("rosbag"): unknown option(s) {", ".join(unknown)}; the '
                f"options are {', '.join(_OPTIONS)}"
            )
        self.options = options
        topics = options.get("topics")
        self.topics: set[str] | None = (
            None if topics is None else {t.strip() for t in topics.split(",") if t.strip()}
        )
        if self.topics is not None and not self.topics:
            # an empty list joined (",".join([])) would otherwise read every topic
            raise BinpipeError(
                f'spark.read.format("rosbag"): option topics={topics!r} names no topic; name '
                "them separated by commas, or leave the option out to read every topic"
            )
        self.start = _int_option(options, "start", None)
        self.end = _int_option(options, "end", None)
        self.partitions_per_bag = _int_option(options, "partitionsPerBag", None, minimum=1)
        source = options.get("timesource", "record")
        try:
            self.time_source = TimeSource(source)
        except ValueError:
            choices = ", ".join(t.value for t in TimeSource)
            raise BinpipeError(
                f'spark.read.format("rosbag"): option timeSource={source!r} is not one of {choices}'
            ) from None
        self.partition_bytes = _int_option(
            options, "partitionBytes", DEFAULT_PARTITION_BYTES, minimum=0
        )
        self.min_partitions = _int_option(options, "minPartitions", os.cpu_count() or 2, minimum=1)
        self.batch_size = _int_option(options, "batchSize", 1024, minimum=1)
        self.reindex_dir = options.get("reindexdir") or None

    def partitions(self) -> Sequence[InputPartition]:
        parts: list[InputPartition] = []
        for uri in expand_uris(_paths(self.options)):
            for part in plan_partitions(
                uri,
                topics=sorted(self.topics) if self.topics is not None else None,
                start=self.start,
                end=self.end,
                partitions_per_bag=self.partitions_per_bag,
                time_source=self.time_source,
                partition_bytes=self.partition_bytes or None,
                min_partitions=self.min_partitions,
                reindex_dir=self.reindex_dir,
            ):
                parts.append(_Partition(part))
        if not parts:
            # Spark needs at least one partition; an empty one reads nothing.
            return [InputPartition(None)]
        return parts

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa  # noqa: PLC0415 - executors import it on use

        part: BagPartition | None = getattr(partition, "part", None)
        if part is None:
            return
        names = ["bag", "topic", "timestamp", "record_time", "msgtype", "data", "partition"]
        types = [
            pa.string(),
            pa.string(),
            pa.int64(),
            pa.int64(),
            pa.string(),
            pa.binary(),
            pa.int32(),
        ]
        schema = pa.schema(list(zip(names, types, strict=True)))
        cols: list[list[Any]] = [[] for _ in names]
        for msg, record_time in read_partition_timed(part):
            cols[0].append(part.uri)
            cols[1].append(msg.topic)
            cols[2].append(msg.timestamp)
            cols[3].append(record_time)
            cols[4].append(msg.msgtype)
            cols[5].append(bytes(msg.data))
            cols[6].append(part.index)
            if len(cols[0]) >= self.batch_size:
                yield pa.RecordBatch.from_arrays(
                    [pa.array(c, t) for c, t in zip(cols, types, strict=True)], schema=schema
                )
                cols = [[] for _ in names]
        if cols[0]:
            yield pa.RecordBatch.from_arrays(
                [pa.array(c, t) for c, t in zip(cols, types, strict=True)], schema=schema
            )
