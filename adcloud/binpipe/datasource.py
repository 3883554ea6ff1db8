"""``spark.read.format("rosbag")``: ROS bags as a Spark SQL table.

A Spark 4 Python data source.  Partitions are the same chunk ranges as
:meth:`BinPipeRDD.from_bags`; each task reads its range and yields Arrow record
batches.  Filters on ``topic`` (``=``, ``IN``) and ``record_time`` (ranges) are pushed
down to the partition planner, so unselected chunks are never read.

Options: ``topics`` (comma-separated), ``start``/``end`` (ns, record time),
``partitionsPerBag``, ``timeSource`` (``record`` or ``header``), ``batchSize``
(rows per Arrow batch).  Paths: ``load(path)`` or ``load([path, ...])``; globs and
directories are expanded.

Columns: ``bag`` (its URL), ``topic``, ``timestamp`` (ns; per ``timeSource``),
``record_time`` (ns, the bag's record time), ``msgtype``, ``data`` (the serialized
message bytes as stored), ``partition`` (partition index within the bag).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)

from adcloud.binpipe.bags import (
    BagPartition,
    TimeSource,
    plan_partitions,
    read_partition_timed,
)
from adcloud.binpipe.errors import BinpipeError

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


class RosbagReader(DataSourceReader):
    """Plans chunk partitions on the driver and reads them on executors."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        topics = options.get("topics")
        self.topics: set[str] | None = (
            {t.strip() for t in topics.split(",") if t.strip()} if topics else None
        )
        self.start = int(options["start"]) if "start" in options else None
        self.end = int(options["end"]) if "end" in options else None
        self.partitions_per_bag = (
            int(options["partitionsPerBag"]) if "partitionsPerBag" in options else None
        )
        self.time_source = TimeSource(options.get("timeSource", "record"))
        self.batch_size = int(options.get("batchSize", "1024"))

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:  # noqa: N802 - Spark's name
        """Take topic and record-time filters; hand back every filter Spark must still apply.

        Pushed filters only narrow what is read: Spark re-checks them all, so a filter
        pushed here can never change a result, only how much is read.
        """
        for flt in filters:
            attribute: tuple[str, ...] = getattr(flt, "attribute", ())
            column = attribute[0] if len(attribute) == 1 else None
            if column == "topic" and isinstance(flt, EqualTo) and isinstance(flt.value, str):
                self._narrow_topics({flt.value})
            elif column == "topic" and isinstance(flt, In):
                self._narrow_topics({v for v in flt.value if isinstance(v, str)})
            elif column == "record_time" and isinstance(getattr(flt, "value", None), int):
                value = int(getattr(flt, "value"))  # noqa: B009 - Filter subclasses differ
                if isinstance(flt, GreaterThanOrEqual | GreaterThan):
                    low = value + (1 if isinstance(flt, GreaterThan) else 0)
                    self.start = low if self.start is None else max(self.start, low)
                elif isinstance(flt, LessThan | LessThanOrEqual):
                    high = value + (1 if isinstance(flt, LessThanOrEqual) else 0)
                    self.end = high if self.end is None else min(self.end, high)
            yield flt

    def _narrow_topics(self, topics: set[str]) -> None:
        self.topics = topics if self.topics is None else self.topics & topics

    def partitions(self) -> Sequence[InputPartition]:
        from adcloud.binpipe.rdd import expand_uris  # noqa: PLC0415 - avoid an import cycle

        parts: list[InputPartition] = []
        for uri in expand_uris(_paths(self.options)):
            for part in plan_partitions(
                uri,
                topics=sorted(self.topics) if self.topics is not None else None,
                start=self.start,
                end=self.end,
                partitions_per_bag=self.partitions_per_bag,
                time_source=self.time_source,
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
