"""BinPipeRDD: an RDD whose elements are BinPipe blocks.

Each element is one encoded block (``bytes`` or ``bytearray``): a partition built
from a bag holds a META block describing its connections, then DATA blocks of
:class:`~adcloud.binpipe.codec.Message` records.  A partition, framed with a stream
header and an END block, is exactly one BinPipe stream -- what :meth:`pipe` writes
to a command and what :meth:`save` writes to a file.  Blocks are a few hundred KiB
to a few MiB, so Spark moves big buffers rather than millions of small objects, and
no partition is ever held whole.

Everything that crosses a closure is a description (a :class:`BagPartition`, a URL,
a command line); bags and files are opened on the executors.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import re
import shlex
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from adcloud._commit import JobOutput, interrupted_commit
from adcloud.binpipe.bags import (
    BagPartition,
    TimeSource,
    plan_partitions,
    read_partition,
)
from adcloud.binpipe.bags_io import open_fs, path_url
from adcloud.binpipe.codec import (
    DEFAULT_BLOCK_BYTES,
    Block,
    BlockKind,
    Message,
    Record,
    StreamReader,
    StreamWriter,
    as_message,
    encode_blocks,
    seal_block,
)
from adcloud.binpipe.decode import ConnectionInfo, MessageDecoder, meta_block
from adcloud.binpipe.errors import BinpipeError
from adcloud.binpipe.node import records_from
from adcloud.binpipe.pipe import pipe_blocks

if TYPE_CHECKING:
    from pyspark import RDD
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["BinPipeRDD", "expand_uris"]

log = logging.getLogger(__name__)

_PART_SUFFIX = ".binpipe"
#: What :meth:`BinPipeRDD.save` writes into its directory (``overwrite`` replaces only such).
_SAVED_NAMES = frozenset({"_SUCCESS", "manifest.json"})
_PART_NAME = re.compile(r"part-\d+\.binpipe")
#: Default target size of a bag partition: big enough that reading dominates a task's
#: fixed cost, small enough to spread a bag over many executors (and never fewer partitions
#: than cores).  Spark's own file splits are 128 MiB too; measured on a one-core executor
#: reading a 1.26 GB page-cached bag: 64 MiB 1.2 GB/s, 128 MiB 1.5 GB/s, 256 MiB 1.8 GB/s
#: (one process reads 1.85 GB/s at any size: the rest is ~20 ms of Spark per task).
DEFAULT_PARTITION_BYTES = 128 << 20


def _bag_key(fs: Any, path: str) -> str:
    """One spelling per bag: ``/x.bag``, ``file:///x.bag`` and a symlink to it are one."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    where = fs._strip_protocol(path)
    if protocol in ("file", "local"):
        where = os.path.realpath(where)
    elif protocol == "adcloud-store":
        return str(fs.unstrip_protocol(where))  # alluxio://HOST:PORT included
    return f"{protocol}://{where}"


def expand_uris(
    uris: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Expand globs and directories into a sorted list of bag URLs, each bag once.

    A name that exists is taken literally, even with ``*``, ``?`` or ``[`` in it.

    Local paths come back absolute, as this process resolves them: executors run in other
    working directories (a relative ``drive.bag`` would be looked for there).

    A directory expands to the ``*.bag`` and ``*.mcap`` files in it and to the ROS 2 bag
    directories in it (those holding a ``metadata.yaml``), or, for ROS 2, to itself when
    it holds a ``metadata.yaml``.  A bag named more than once (``a.bag`` and ``.``, two
    overlapping globs, ``file://`` and a plain path, a symlink and its target) is read
    once, under its first name.
    """
    given = [uris] if isinstance(uris, (str, os.PathLike)) else list(uris)
    items = [_absolute_local(os.fspath(u)) for u in given]
    out: list[str] = []
    seen: dict[str, str] = {}
    for item in items:
        fs, path = open_fs(item, tuple((storage_options or {}).items()))

        def url(p: str, fs: Any = fs, item: str = item) -> str:
            return path_url(fs, item, p)

        def add(name: str, where: str, fs: Any = fs) -> None:
            key = _bag_key(fs, where)
            if key in seen:
                log.warning("%s names %s again: it is read once", name, seen[key])
                return
            seen[key] = name
            out.append(name)

        try:
            # a name that exists is taken as it is ("drive [2].bag"); else it may be a glob
            if any(ch in path for ch in "*?[") and not fs.exists(path):
                found = sorted(fs.glob(path))
                if not found:
                    raise BinpipeError(f"no bag matches {item!r}")
                for p in found:
                    add(url(p), p)
            elif fs.isdir(path):
                if fs.exists(posixpath.join(path, "metadata.yaml")):
                    add(item, path)
                    continue
                found = sorted(
                    e["name"]
                    for e in fs.ls(path, detail=True)
                    if (e["type"] != "directory" and e["name"].endswith((".bag", ".mcap")))
                    or (
                        e["type"] == "directory"
                        and fs.exists(posixpath.join(e["name"], "metadata.yaml"))
                    )
                )
                if not found:
                    db3 = sorted(
                        posixpath.basename(e["name"])
                        for e in fs.ls(path, detail=True)
                        if e["type"] != "directory" and e["name"].endswith(".db3")
                    )
                    # a rosbag2 directory whose recorder died before writing metadata.yaml
                    hint = (
                        f"; its {', '.join(db3[:3])}{' ...' if len(db3) > 3 else ''} is a ROS 2 "
                        "bag without its metadata.yaml: write it with `ros2 bag reindex "
                        f"{item}`, or give the .db3 file itself"
                        if db3
                        else ""
                    )
                    raise BinpipeError(
                        f"directory {item!r} holds no .bag or .mcap file and no ROS 2 bag "
                        f"directory (one with a metadata.yaml){hint}"
                    )
                for p in found:
                    add(url(p), p)
            elif fs.exists(path):
                add(item, path)
            else:
                raise BinpipeError(f"bag {item!r} does not exist")
        except OSError as err:  # a store or object store that cannot be reached
            raise BinpipeError(f"{item}: cannot look for bags there: {err}") from err
    return out


def _absolute_local(uri: str) -> str:
    """``uri`` with a local path made absolute (URLs, ``file://`` included, unchanged)."""
    # abspath, not resolve(): ".." is folded, symlinks (a shared mount) are kept
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))  # noqa: PTH100, PTH111


def _connection_infos(part: BagPartition) -> list[ConnectionInfo]:
    return [
        ConnectionInfo(c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization)
        for c in part.connections
    ]


def _bag_blocks(parts: Iterable[BagPartition], block_bytes: int) -> Iterator[bytes]:
    for part in parts:
        yield meta_block(_connection_infos(part))
        yield from encode_blocks(read_partition(part), block_bytes=block_bytes)


def _transform(
    blocks: Iterable[bytes | bytearray],
    fn: Callable[..., Any],
    mode: str,
    decode: bool,
    block_bytes: int,
) -> Iterator[bytes]:
    """Apply a per-record map or filter to a partition's blocks, re-encoding the output.

    Each META block is passed on where it was: after the output of the records before it
    and ahead of the data it describes (a later META record for a topic replaces the
    earlier one for the data after it, docs/binpipe-format.md section 9.2), so output
    blocks never hold records from both sides of one.
    """
    decoder = MessageDecoder()
    source = iter(blocks)
    meta: list[bytes] = []

    def outputs() -> Iterator[Record]:
        """The output of the records up to the next META block, which goes to ``meta``."""
        for raw in source:
            block = Block.parse(memoryview(raw))
            if block.kind == BlockKind.META:
                for rec in block:
                    decoder.add(ConnectionInfo.from_record(rec, "a META block of the stream"))
                meta.append(bytes(raw))
                return
            for rec in block:
                item = as_message(rec)
                args: tuple[Any, ...] = (item,)
                if decode:
                    if not isinstance(item, Message):
                        raise BinpipeError(f"decode=True needs message records, got {item!r}")
                    args = (item, decoder.decode(item))
                if mode == "filter":
                    if fn(*args):
                        yield item
                    continue
                out = fn(*args)
                if isinstance(out, tuple):
                    yield out
                else:
                    yield from records_from(out, fn)

    while True:
        yield from encode_blocks(outputs(), block_bytes=block_bytes)
        if not meta:  # the input is exhausted
            return
        yield meta.pop()


def _pipe_partition(
    blocks: Iterable[bytes | bytearray],
    command: str | Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    timeout: float | None,
) -> Iterator[bytearray]:
    return pipe_blocks(blocks, command, env=env, cwd=cwd, timeout=timeout)


def _save_partition(
    index: int,
    blocks: Iterable[bytes | bytearray],
    url: str,
    storage_options: Mapping[str, Any],
    staging: str,
) -> Iterator[tuple[int, int, int, str]]:
    """Write one partition as a stream into the save's staging directory.

    Each attempt writes a file of its own name; the driver moves the file of the attempt
    Spark reports into place once every partition is written (:class:`adcloud._commit.
    JobOutput`): a retried, speculative or killed attempt never touches the output.
    """
    fs, _ = open_fs(url, tuple(storage_options.items()))
    # No makedirs: the driver made the staging directory; a task still starting after its
    # job failed (and the staging went) must fail, not write a part into one nobody owns.
    tmp = posixpath.join(staging, f"part-{index:05d}-{uuid.uuid4().hex}{_PART_SUFFIX}")
    try:
        with fs.open(tmp, "wb") as out:
            writer = StreamWriter(out)
            count = 0
            for raw in blocks:
                count += _count_records(raw)
                writer.write_block(seal_block(raw))
            writer.close()
            size = writer.bytes_written
    except BaseException:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        except OSError:
            log.warning("could not remove temporary file %s", tmp)
        raise
    yield (index, count, size, tmp)


def _part_name(index: int) -> str:
    return f"part-{index:05d}{_PART_SUFFIX}"


def _save_output(fs: Any, root: str, uri: str, overwrite: bool) -> JobOutput:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "memory" in protocols:
        raise BinpipeError(
            f"{uri}: memory:// is each Python process's own, and Spark's tasks write the parts "
            "in their worker processes, where the driver cannot see them: save to a local "
            "path, file://, hdfs:// or an object store (s3://...)"
        )
    return JobOutput(
        fs,
        root,
        uri,
        overwrite=overwrite,
        ours=lambda name: name in _SAVED_NAMES or bool(_PART_NAME.fullmatch(name)),
        error=BinpipeError,
        what="a BinPipe save",
        hint="pass overwrite=True (adcloud ingest --overwrite) to replace it",
    )


def check_save_target(
    uri: str, *, overwrite: bool = False, storage_options: Mapping[str, Any] | None = None
) -> None:
    """Raise :class:`BinpipeError` now if :meth:`BinPipeRDD.save` to ``uri`` would refuse
    (before any Spark work: ``adcloud ingest`` checks its ``--out`` with it)."""
    fs, root = open_fs(uri, tuple((storage_options or {}).items()))
    _save_output(fs, root, uri, overwrite)


def _load_file(url: str, storage_options: Mapping[str, Any]) -> Iterator[bytearray]:
    fs, path = open_fs(url, tuple(storage_options.items()))
    with fs.open(path, "rb") as src:
        for block in StreamReader(src, name=url):
            raw = block.raw.obj
            assert isinstance(raw, bytearray)
            yield raw


def _records(blocks: Iterable[bytes | bytearray], include_meta: bool = False) -> Iterator[Record]:
    for raw in blocks:
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.DATA:
            for rec in block:
                yield as_message(rec)
        elif include_meta:
            yield from block


def _message_rows(blocks: Iterable[bytes | bytearray]) -> Iterator[tuple[str, int, str, bytes]]:
    for raw in blocks:
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.DATA:
            for msg in block.messages():
                yield (msg.topic, msg.timestamp, msg.msgtype, bytes(msg.data))


def _bag_message_rows(
    index: int, blocks: Iterable[bytes | bytearray], *, bags: Sequence[str]
) -> Iterator[tuple[str, str, int, str, bytes]]:
    bag = bags[index]
    for row in _message_rows(blocks):
        yield (bag, *row)


def _count_records(raw: bytes | bytearray) -> int:
    header = Block.read_header(raw)
    return header.n_records if header.kind == BlockKind.DATA else 0


def _bags_lineage(
    parts: Sequence[BagPartition],
    *,
    bags: Sequence[str] = (),
    request: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What :meth:`BinPipeRDD.save` records of bag input: each bag with its format and
    ``messages``, the index's count of the messages of the selected topics in the chunks
    planned (a time range reads whole chunks; the save adds each bag's ``records``), and
    the filters as planned (the same for every partition of one planning call, so the
    first partition's are the call's).  ``bags`` and ``request`` are what the call was
    given, so that a bag the filters leave nothing of is listed too (with no partitions),
    and the filters are recorded when no bag has a partition left."""
    entries: dict[str, dict[str, Any]] = {
        uri: {"uri": uri, "partitions": 0, "messages": 0} for uri in bags
    }
    for part in parts:
        key = part.reindexed_from if part.reindexed_from in entries else part.uri
        entry = entries.setdefault(key, {"uri": key, "partitions": 0, "messages": 0})
        entry["format"] = part.format.value
        if part.reindexed_from:
            entry["uri"] = part.uri
            entry["reindexed_from"] = part.reindexed_from
        entry["partitions"] += 1
        entry["messages"] += part.message_count
    first = parts[0] if parts else None
    if first is not None:
        topics = None if first.topics is None else list(first.topics)
        start, end, time_source = first.start, first.end, first.time_source.value
    elif request is not None:
        given = request.get("topics")
        topics = None if given is None else list(dict.fromkeys(given))
        start, end = request.get("start"), request.get("end")
        time_source = TimeSource(request.get("time_source", TimeSource.RECORD)).value
    else:
        topics, start, end, time_source = None, None, None, None
    return {
        "origin": "bags",
        "bags": [
            {
                key: e[key]
                for key in ("uri", "format", "reindexed_from", "partitions", "messages")
                if key in e
            }
            for e in entries.values()
        ],
        "topics": sorted({c.topic for p in parts for c in p.connections}),
        "topic_filter": topics,
        "start": start,
        "end": end,
        "time_source": time_source,
        "steps": [],
    }


def _fn_step(op: str, fn: Callable[..., Any]) -> dict[str, str]:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return {"op": op, "fn": f"{getattr(fn, '__module__', None) or '?'}.{name}"}


def _saved_source(fs: Any, root: str) -> Any:
    """The ``source`` of an earlier save's manifest, or None if it has none (older saves)."""
    try:
        with fs.open(posixpath.join(root, "manifest.json"), "r") as src:
            return json.load(src).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def _saved_parts(fs: Any, root: str, uri: str) -> list[str]:
    """The part files of the save at ``root``, as its manifest lists them (checked)."""
    sizes = {
        posixpath.basename(entry["name"]): entry.get("size")
        for entry in fs.ls(root, detail=True)
        if entry.get("type") != "directory"
    }
    found = sorted(n for n in sizes if n.startswith("part-") and n.endswith(_PART_SUFFIX))
    try:
        with fs.open(posixpath.join(root, "manifest.json"), "r") as src:
            listed = json.load(src)["partitions"]
        names = [str(p["file"]) for p in listed]
        want = {str(p["file"]): p.get("bytes") for p in listed}
    except FileNotFoundError:
        return [posixpath.join(root, n) for n in found]  # a save without a manifest
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BinpipeError(f"{uri}/manifest.json is damaged ({err}); save the data again") from err
    for name in names:
        if name not in sizes:
            raise BinpipeError(
                f"{uri}: {name} is missing, though manifest.json lists it; "
                "the save is incomplete: save the data again"
            )
        if want[name] is not None and sizes[name] is not None and sizes[name] != want[name]:
            raise BinpipeError(
                f"{uri}: {name} holds {sizes[name]} bytes, manifest.json says {want[name]}; "
                "the file was changed after the save: save the data again"
            )
    stray = sorted(set(found) - set(names))
    if stray:
        log.warning(
            "%s: left out %s, not listed in manifest.json (not written by this save)",
            uri,
            ", ".join(stray),
        )
    return [posixpath.join(root, n) for n in names]


class BinPipeRDD:
    """An RDD of BinPipe blocks with record-level operations.

    Build one with :meth:`from_bags`, :meth:`from_records` or :meth:`load`; the
    underlying ``pyspark.RDD`` is :attr:`rdd` (elements: encoded blocks).
    """

    def __init__(
        self,
        rdd: RDD[Any],
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        lineage: Mapping[str, Any] | None = None,
        partition_bags: Sequence[str] | None = None,
    ) -> None:
        self.rdd = rdd
        self.block_bytes = block_bytes
        #: Where the records came from and what was done to them on the way (JSON-able);
        #: :meth:`save` writes it into ``manifest.json`` as ``"source"``.
        self.lineage: dict[str, Any] = dict(lineage or {"origin": "unknown", "steps": []})
        #: The bag URI each partition reads as it was given (an unindexed bag's, not its
        #: indexed copy's), by partition index (:meth:`from_bags`,
        #: :meth:`from_partitions` and what derives from them partition by partition);
        #: None where partitions do not map to bags.
        self.partition_bags: tuple[str, ...] | None = (
            None if partition_bags is None else tuple(partition_bags)
        )

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_bags(
        cls,
        spark: SparkSession,
        uris: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        topics: Sequence[str] | None = None,
        start: int | None = None,
        end: int | None = None,
        partitions_per_bag: int | None = None,
        time_source: TimeSource | str = TimeSource.RECORD,
        storage_options: Mapping[str, Any] | None = None,
        reindex_dir: str | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        partition_bytes: int | None = DEFAULT_PARTITION_BYTES,
    ) -> BinPipeRDD:
        """Partition bags (ROS 1, ROS 2 sqlite3, MCAP; any fsspec URL) into an RDD.

        Only indexes are read here, on the driver; each task reads its own byte range.
        ``start``/``end`` are nanoseconds (record time, ``[start, end)``); ``topics``
        selects topics before any chunk is read.  ``time_source`` picks what each
        message's ``timestamp`` holds: the bag's record time or the message's header
        stamp.  With ``partitions_per_bag=None`` consecutive chunks are grouped into
        partitions of about ``partition_bytes`` (at least one per core of the
        cluster, or one per chunk if fewer); ``partition_bytes=None`` gives one
        partition per chunk.
        """
        parts: list[BagPartition] = []
        bags = expand_uris(uris, storage_options)
        for uri in bags:
            parts.extend(
                plan_partitions(
                    uri,
                    topics=topics,
                    start=start,
                    end=end,
                    partitions_per_bag=partitions_per_bag,
                    time_source=time_source,
                    storage_options=storage_options,
                    reindex_dir=reindex_dir,
                    partition_bytes=partition_bytes,
                    min_partitions=spark.sparkContext.defaultParallelism,
                )
            )
        log.info("planned %d partitions from %s", len(parts), uris)
        # every bag asked for, and the filters, even where they leave no partition
        request = {"topics": topics, "start": start, "end": end, "time_source": time_source}
        return cls.from_partitions(
            spark, parts, block_bytes=block_bytes, bags=bags, request=request
        )

    @classmethod
    def from_partitions(
        cls,
        spark: SparkSession,
        parts: Sequence[BagPartition],
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        bags: Sequence[str] = (),
        request: Mapping[str, Any] | None = None,
    ) -> BinPipeRDD:
        """One RDD partition per planned bag partition (see :func:`plan_partitions`).

        ``bags`` (the bags planned) and ``request`` (the ``topics``, ``start``, ``end`` and
        ``time_source`` they were planned with) go into the lineage a save records, so that
        a bag the filters left nothing of is listed too, and the filters are recorded when
        no partition is left."""
        sc = spark.sparkContext
        lineage = _bags_lineage(parts, bags=bags, request=request)
        if not parts:
            return cls(sc.emptyRDD(), block_bytes=block_bytes, lineage=lineage, partition_bags=())
        rdd = sc.parallelize(list(parts), len(parts)).mapPartitions(
            functools.partial(_bag_blocks, block_bytes=block_bytes)
        )
        return cls(
            rdd,
            block_bytes=block_bytes,
            lineage=lineage,
            # the bag as given, not the indexed copy an unindexed one is read through
            partition_bags=[part.reindexed_from or part.uri for part in parts],
        )

    @classmethod
    def from_records(
        cls,
        spark: SparkSession,
        records: Sequence[Iterable[object]],
        num_partitions: int | None = None,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> BinPipeRDD:
        """Distribute records held on the driver (tuples of str/int/float/bytes/None)."""
        sc = spark.sparkContext
        if num_partitions is not None and (
            isinstance(num_partitions, bool)
            or not isinstance(num_partitions, int)
            or num_partitions < 1
        ):  # Spark's own error is a ZeroDivisionError (0) or a slice error, naming nothing
            raise BinpipeError(
                f"from_records: num_partitions must be a whole number >= 1 or None, "
                f"not {num_partitions!r}"
            )
        rows: list[tuple[object, ...]] = []
        for index, record in enumerate(records):
            # a str or bytes is iterable, and would make a record of each character or byte
            if isinstance(record, (str, bytes, bytearray, memoryview, Mapping)) or not isinstance(
                record, Iterable
            ):
                shown = repr(record)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise BinpipeError(
                    f"from_records: record {index} is a {type(record).__name__} ({shown}), not "
                    "a record: give each record as a tuple of fields, e.g. (topic, timestamp, "
                    "msgtype, data)"
                )
            rows.append(tuple(record))
        rdd = sc.parallelize(rows, num_partitions).mapPartitions(
            functools.partial(encode_blocks, block_bytes=block_bytes)
        )
        lineage = {"origin": "records", "records": len(rows), "steps": []}
        return cls(rdd, block_bytes=block_bytes, lineage=lineage)

    @classmethod
    def load(
        cls,
        spark: SparkSession,
        uri: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
    ) -> BinPipeRDD:
        """Read streams written by :meth:`save` (one partition per part file).

        The part files are those ``manifest.json`` lists, in its order: one that is
        missing or not of the size the manifest says is an error naming it, and a part
        file the manifest does not list (a stray copy) is left out with a warning.
        """
        uri = _absolute_local(os.fspath(uri))
        options = dict(storage_options or {})
        fs, root = open_fs(uri, tuple(options.items()))
        if not fs.isdir(root):
            what = "is a file, not" if fs.exists(root) else "does not exist; expected"
            raise BinpipeError(f"{uri} {what} a directory written by BinPipeRDD.save")
        if not fs.exists(posixpath.join(root, "_SUCCESS")):
            record = interrupted_commit(fs, root)
            if record is not None:
                raise BinpipeError(
                    f"{uri} is not a complete BinPipe save: the save that wrote it was killed "
                    f"while moving its files into place ({record}); the next save into it "
                    "(overwrite=True, adcloud ingest --overwrite) on this host finishes that "
                    "first -- do not delete the directory, its _temporary holds the rest"
                )
            raise BinpipeError(
                f"{uri} is not a complete BinPipe save (no _SUCCESS marker); "
                "was the job that wrote it interrupted?"
            )
        urls = [path_url(fs, uri, p) for p in _saved_parts(fs, root, uri)]
        lineage = {"origin": "save", "uri": uri, "saved": _saved_source(fs, root), "steps": []}
        sc = spark.sparkContext
        if not urls:
            return cls(sc.emptyRDD(), lineage=lineage)
        rdd = sc.parallelize(urls, len(urls)).flatMap(
            functools.partial(_load_file, storage_options=options)
        )
        return cls(rdd, lineage=lineage)

    # -- transformations --------------------------------------------------------------

    def _derive(self, rdd: RDD[Any], step: Mapping[str, Any]) -> BinPipeRDD:
        # every step maps partitions one to one, so each still reads the same bag
        lineage = {**self.lineage, "steps": [*self.lineage.get("steps", []), dict(step)]}
        return BinPipeRDD(
            rdd,
            block_bytes=self.block_bytes,
            lineage=lineage,
            partition_bags=self.partition_bags,
        )

    def pipe(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
    ) -> BinPipeRDD:
        """Stream each partition through an external command's stdin/stdout.

        The command reads one BinPipe stream and writes one (see
        :mod:`adcloud.binpipe.node` for the Python side).  A failing command fails
        the task with :class:`~adcloud.binpipe.errors.PipeCommandError` carrying the
        exit code and stderr tail.  ``timeout`` is per partition, in seconds.  The
        command runs in a process group of its own, killed with the task: when a job is
        cancelled or an executor's Python worker dies, the command does not run on.
        """
        fn = functools.partial(
            _pipe_partition,
            command=command,
            env=dict(env) if env else None,
            cwd=cwd,
            timeout=timeout,
        )
        shown = command if isinstance(command, str) else shlex.join(command)
        return self._derive(self.rdd.mapPartitions(fn), {"op": "pipe", "command": shown})

    def map_records(self, fn: Callable[..., Any], *, decode: bool = False) -> BinPipeRDD:
        """Apply ``fn`` to every DATA record on the executors.

        ``fn(record)`` returns a record (tuple), an iterable of records, or None to
        drop it.  Message-shaped records arrive as :class:`Message` with ``data`` a
        zero-copy memoryview valid during the call.  With ``decode=True`` it is called
        as ``fn(message, decoded)`` where ``decoded`` is the rosbags message object,
        typed from the definitions that travel with the partition.
        """
        part = functools.partial(
            _transform, fn=fn, mode="map", decode=decode, block_bytes=self.block_bytes
        )
        return self._derive(self.rdd.mapPartitions(part), _fn_step("map_records", fn))

    def filter(self, pred: Callable[..., Any], *, decode: bool = False) -> BinPipeRDD:
        """Keep the records for which ``pred`` is true (same calling convention as map)."""
        part = functools.partial(
            _transform, fn=pred, mode="filter", decode=decode, block_bytes=self.block_bytes
        )
        return self._derive(self.rdd.mapPartitions(part), _fn_step("filter", pred))

    def cache(self) -> BinPipeRDD:
        """Keep the blocks in executor memory."""
        self.rdd.cache()
        return self

    def getNumPartitions(self) -> int:  # noqa: N802 - the RDD's own spelling
        """Number of partitions."""
        return int(self.rdd.getNumPartitions())

    # -- actions ----------------------------------------------------------------------

    def count(self) -> int:
        """Number of DATA records (from block headers; no record is decoded)."""
        return int(self.rdd.map(_count_records).sum())

    def collect_records(self) -> list[Record]:
        """All DATA records on the driver, in partition order.

        Message-shaped records come back as :class:`Message`; their ``data`` are
        memoryviews into the collected blocks.
        """
        return list(_records(self.rdd.collect()))

    def connections(self) -> list[ConnectionInfo]:
        """The distinct connection descriptions carried in META blocks."""
        metas = self.rdd.filter(lambda raw: Block.read_header(raw).kind == BlockKind.META).collect()
        seen: dict[tuple[str, str], ConnectionInfo] = {}
        for raw in metas:
            for rec in Block.parse(memoryview(raw)):
                info = ConnectionInfo.from_record(rec, "a META block of the RDD")
                seen.setdefault((info.topic, info.msgtype), info)
        return list(seen.values())

    def save(
        self,
        uri: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        storage_options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write each partition as one stream file ``part-NNNNN.binpipe`` under ``uri``.

        Tasks write into ``_temporary/`` inside ``uri``; once every partition is written
        the driver moves the files into place and writes ``manifest.json`` and, last,
        ``_SUCCESS``, so readers never see half a partition or a mix of two saves.  A job
        that fails leaves ``uri`` as it was: nothing half-written, and with
        ``overwrite=True`` the earlier save still whole (which also lets an RDD loaded from
        ``uri`` be saved back over it).  ``overwrite`` replaces only an earlier save's
        files; a directory holding anything else is refused.  Blocks get payload CRCs on the
        way to storage.  Returns the manifest.
        """
        uri = _absolute_local(os.fspath(uri))
        options = dict(storage_options or {})
        fs, root = open_fs(uri, tuple(options.items()))
        output = _save_output(fs, root, uri, overwrite)
        output.start()
        try:
            written = self.rdd.mapPartitionsWithIndex(
                functools.partial(
                    _save_partition, url=uri, storage_options=options, staging=output.staging
                )
            ).collect()
        except BaseException:
            output.abort()  # an earlier save stays whole (this one may have been reading it)
            raise
        manifest = {
            "format": "binpipe",
            "version": 1,
            "partitions": [
                {"file": _part_name(i), "records": n, "bytes": size}
                for i, n, size, _ in sorted(written)
            ],
            "records": sum(n for _, n, _, _ in written),
            "source": self._saved_lineage(written),
        }
        try:  # before the commit: a manifest that cannot be written must not cost the
            # earlier save (overwrite removes it)
            text = json.dumps(manifest, indent=2) + "\n"
        except (TypeError, ValueError) as err:
            output.abort()
            raise BinpipeError(
                f"{uri}: the manifest cannot be written as JSON ({err}); nothing was saved"
            ) from err
        # staged with the parts, so that a commit a killed driver left is finished whole;
        # _SUCCESS goes first and comes back last: load refuses a directory without it
        files = [(tmp, _part_name(i)) for i, *_, tmp in written]
        try:
            for name, data in (("manifest.json", text.encode()), ("_SUCCESS", b"")):
                staged = posixpath.join(output.staging, name)
                fs.pipe_file(staged, data)
                files.append((staged, name))
        except BaseException:
            output.abort()
            raise
        output.commit(files, first=("_SUCCESS",))
        return manifest

    def _saved_lineage(self, written: Sequence[tuple[int, int, int, str]]) -> dict[str, Any]:
        """:attr:`lineage`, with each bag's ``records``: how many of the saved records came
        from it (its ``messages`` count whole chunks by the index, before any time filter
        and derivation step)."""
        lineage = dict(self.lineage)
        if self.partition_bags is None or lineage.get("origin") != "bags":
            return lineage
        per_bag: dict[str, int] = {}
        for index, count, _, _ in written:
            uri = self.partition_bags[index]
            per_bag[uri] = per_bag.get(uri, 0) + count
        lineage["bags"] = [
            {**entry, "records": per_bag.get(entry.get("reindexed_from") or entry["uri"], 0)}
            for entry in lineage["bags"]
        ]
        return lineage

    def to_dataframe(self, spark: SparkSession | None = None, *, bag: bool = False) -> DataFrame:
        """Message records as a DataFrame ``(topic, timestamp, msgtype, data)``; ``spark``
        defaults to the session of this RDD's SparkContext.  With ``bag=True`` a first column
        ``bag`` holds the URI of the bag each message came from as it was given (as the
        ``rosbag`` data source's; an unindexed bag's, not its indexed copy's), for RDDs whose
        partitions map to bags (:attr:`partition_bags`)."""
        from pyspark.sql import SparkSession  # noqa: PLC0415 - pyspark is heavy; import on use
        from pyspark.sql.types import (  # noqa: PLC0415
            BinaryType,
            LongType,
            StringType,
            StructField,
            StructType,
        )

        fields = [
            StructField("topic", StringType(), False),
            StructField("timestamp", LongType(), False),
            StructField("msgtype", StringType(), False),
            StructField("data", BinaryType(), False),
        ]
        if spark is None:
            spark = SparkSession.builder.getOrCreate()
        if not bag:
            return spark.createDataFrame(self.rdd.mapPartitions(_message_rows), StructType(fields))
        if self.partition_bags is None:
            raise BinpipeError(
                "to_dataframe(bag=True): these partitions do not map to bags (they were not "
                "made by from_bags/from_partitions); use the rosbag data source for a bag column"
            )
        rows = self.rdd.mapPartitionsWithIndex(
            functools.partial(_bag_message_rows, bags=self.partition_bags)
        )
        schema = StructType([StructField("bag", StringType(), False), *fields])
        return spark.createDataFrame(rows, schema)
