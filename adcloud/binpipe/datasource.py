"""``spark.read.format("rosbag")``: ROS bags as a Spark SQL table.

A Spark 4 Python data source.  Partitions are the same chunk ranges as
:meth:`BinPipeRDD.from_bags`; each task reads its range and yields Arrow record
batches.  The ``topics``, ``start`` and ``end`` options narrow the partition plan, so
chunks without a selected topic or outside the time range are never read.

``DataFrame.filter`` is not pushed into the plan: with Spark 4.3's Python data source
filter pushdown, the narrowed plan of a filtered DataFrame was seen to leak into the
unfiltered DataFrame it came from (it then returned only the filtered rows).  Until
that is fixed upstream, narrowing is explicit, through options, and always correct.

Options: ``topics`` (comma-separated; naming only topics no bag has is an error, as a typo
would read an empty table), ``start``/``end`` (ns, record time),
``partitionsPerBag``, ``partitionBytes`` (target partition size when
``partitionsPerBag`` is not set; 0 for one partition per chunk), ``minPartitions``,
``timeSource`` (``record`` or ``header``), ``batchSize`` (rows per Arrow batch),
``reindexDir`` (where an indexed copy of a ROS 1 bag without a usable index is written and
read instead; a path or URL the executors can read), ``storageOptions`` (a JSON object of
fsspec or store options, the ``storage_options`` of :meth:`BinPipeRDD.from_bags`: S3
credentials, an ``alluxio://`` ``token``, a ``local://`` store's ``root``; the tasks read
with them too).  Any other option is an error.
Paths: ``load(path)`` or ``load([path, ...])``; globs and directories are expanded.

Columns: ``bag`` (its URL as loaded; for an unindexed bag read through ``reindexDir``, that
bag's, not its indexed copy's), ``topic``, ``timestamp`` (ns; per ``timeSource``),
``record_time`` (ns, the bag's record time), ``msgtype``, ``data`` (the serialized
message bytes as stored), ``partition`` (partition index within the bag).  A schema
given with ``.schema(...)`` picks some of these columns, in its order (names matched
case-insensitively, types as above); any other column is an error.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
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
    summarize,
)
from adcloud.binpipe.codec import Message
from adcloud.binpipe.errors import BagError, BinpipeError
from adcloud.binpipe.rdd import DEFAULT_PARTITION_BYTES, expand_uris

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["SCHEMA", "RosbagDataSource", "register_rosbag_source"]

_log = logging.getLogger(__name__)

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
        return RosbagReader(dict(self.options), _columns(schema))


#: Every column: its name, Spark SQL type and Arrow type.
_COLUMNS: dict[str, tuple[str, str]] = {
    "bag": ("string", "string"),
    "topic": ("string", "string"),
    "timestamp": ("bigint", "int64"),
    "record_time": ("bigint", "int64"),
    "msgtype": ("string", "string"),
    "data": ("binary", "binary"),
    "partition": ("int", "int32"),
}


def _columns(schema: Any) -> list[tuple[str, str, bool]]:
    """``(column, name, nullable)`` of each field of the schema Spark asks for: ours, or
    one the user gave with ``.schema(...)`` (a subset of ours, in any order).  Checked
    here, on the driver: otherwise every task fails on a column count that names nothing."""
    fields = getattr(schema, "fields", None)
    if fields is None:  # a DDL string (the default schema)
        return [(name, name, True) for name in _COLUMNS]
    out = []
    for field in fields:
        column = field.name.lower()
        if column not in _COLUMNS:
            raise BinpipeError(
                f'spark.read.format("rosbag"): schema column {field.name!r} is not one of '
                f"{', '.join(_COLUMNS)}"
            )
        sql_type = _COLUMNS[column][0]
        if field.dataType.simpleString() != sql_type:
            raise BinpipeError(
                f'spark.read.format("rosbag"): schema column {field.name!r} has type '
                f"{field.dataType.simpleString()}; it is {sql_type}"
            )
        out.append((column, str(field.name), bool(field.nullable)))
    return out


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
    "storageOptions",
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


def _json_object(options: dict[str, str], name: str) -> dict[str, Any] | None:
    """Option ``name`` (looked up lower-cased) as a JSON object; None when not given."""
    raw = options.get(name.lower())
    if raw is None or not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise BinpipeError(
            f'spark.read.format("rosbag"): option {name} is not JSON ({err}); give an '
            'object, e.g. .option("storageOptions", json.dumps({"anon": True}))'
        ) from err
    if not isinstance(value, dict):
        raise BinpipeError(
            f'spark.read.format("rosbag"): option {name} must be a JSON object of option '
            f"names and values, not {type(value).__name__}"
        )
    return value


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

    def __init__(
        self, options: dict[str, str], columns: list[tuple[str, str, bool]] | None = None
    ) -> None:
        #: ``(column, name, nullable)`` of each column to yield (see :func:`_columns`).
        self.columns = columns if columns is not None else _columns(SCHEMA)
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
        self.storage_options = _json_object(options, "storageOptions")

    def partitions(self) -> Sequence[InputPartition]:
        parts: list[_Partition] = []
        uris = expand_uris(_paths(self.options), self.storage_options)
        for uri in uris:
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
                storage_options=self.storage_options,
            ):
                parts.append(_Partition(part))
        if self.topics is not None:
            self._check_topics(uris, {c.topic for p in parts for c in p.part.connections})
        if not parts:
            # Spark needs at least one partition; an empty one reads nothing.
            return [InputPartition(None)]
        return list(parts)

    def _check_topics(self, uris: Sequence[str], found: set[str]) -> None:
        """An error when no bag has any of the ``topics`` (a typo would read an empty
        table), a warning for those no bag has; the bags' indexes are read again only
        when a topic was not found in the plan."""
        assert self.topics is not None
        if self.topics <= found:
            return
        have = set(found)
        for uri in uris:
            try:
                summary = summarize(uri, storage_options=self.storage_options)
                have.update(t.topic for t in summary.topics)
            except BagError:  # unreadable without reindexDir's copy; its plan said all
                continue
        missing = sorted(self.topics - have)
        if not missing:
            return  # there, outside the time range
        text = (
            f'spark.read.format("rosbag"): option topics names {", ".join(missing)}, which '
            f"no bag has; they have {', '.join(sorted(have)) or 'no topic'}"
        )
        if len(missing) == len(self.topics):
            raise BinpipeError(text)
        _log.warning("%s", text)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa  # noqa: PLC0415 - executors import it on use

        part: BagPartition | None = getattr(partition, "part", None)
        if part is None:
            return
        types = [getattr(pa, _COLUMNS[column][1])() for column, _, _ in self.columns]
        schema = pa.schema(
            [
                pa.field(name, typ, nullable=nullable)
                for (_, name, nullable), typ in zip(self.columns, types, strict=True)
            ]
        )
        getters = [_GETTERS[column] for column, _, _ in self.columns]
        cols: list[list[Any]] = [[] for _ in getters]
        rows = 0
        for msg, record_time in read_partition_timed(part):
            for col, get in zip(cols, getters, strict=True):
                col.append(get(part, msg, record_time))
            rows += 1
            if rows >= self.batch_size:
                yield pa.RecordBatch.from_arrays(
                    [pa.array(c, t) for c, t in zip(cols, types, strict=True)], schema=schema
                )
                cols = [[] for _ in getters]
                rows = 0
        if rows:
            yield pa.RecordBatch.from_arrays(
                [pa.array(c, t) for c, t in zip(cols, types, strict=True)], schema=schema
            )


#: How each column's value comes from a partition, a message and its record time.
_GETTERS: dict[str, Callable[[BagPartition, Message, int], Any]] = {
    "bag": lambda part, msg, record_time: part.reindexed_from or part.uri,
    "topic": lambda part, msg, record_time: msg.topic,
    "timestamp": lambda part, msg, record_time: msg.timestamp,
    "record_time": lambda part, msg, record_time: record_time,
    "msgtype": lambda part, msg, record_time: msg.msgtype,
    "data": lambda part, msg, record_time: bytes(msg.data),
    "partition": lambda part, msg, record_time: part.index,
}
