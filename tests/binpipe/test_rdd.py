"""BinPipeRDD and the rosbag data source on a real SparkSession, checked against rosbags."""

from __future__ import annotations

import heapq
import json
import os
import re
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from rosbags.highlevel import AnyReader
from rosbags.typesys import Stores, get_types_from_msg, get_typestore

from adcloud.binpipe import BinpipeError, BinPipeRDD, Block, BlockKind, ConnectionInfo, Message
from adcloud.binpipe.codec import encode_block
from adcloud.binpipe.datasource import register_rosbag_source
from adcloud.binpipe.decode import decoded_messages, meta_block
from adcloud.binpipe.rdd import check_save_target
from tests.processes import alive

pytestmark = pytest.mark.spark

LUMINAR = "01_embag_luminar_ros1/embag_test.bag"
HUSKY = "02_husky_gps_imu_odom_ros1/robot_localization_test1.bag"


def reference(path: Path, topics: list[str] | None = None) -> list[tuple[str, int, bytes]]:
    """Every message as rosbags' own reader yields it: (topic, record time, raw bytes)."""
    with AnyReader([path], default_typestore=get_typestore(Stores.ROS1_NOETIC)) as reader:
        conns = [c for c in reader.connections if topics is None or c.topic in topics]
        return [(c.topic, t, bytes(raw)) for c, t, raw in reader.messages(connections=conns)]


def per_partition(rdd: BinPipeRDD) -> list[list[tuple[str, int, bytes]]]:
    parts = rdd.rdd.glom().collect()
    out = []
    for blocks in parts:
        msgs = []
        for raw in blocks:
            block = Block.parse(memoryview(raw))
            if block.kind == BlockKind.DATA:
                msgs.extend((m.topic, m.timestamp, bytes(m.data)) for m in block.messages())
        out.append(msgs)
    return out


def merged(parts: list[list[tuple[str, int, bytes]]]) -> list[tuple[str, int, bytes]]:
    """Merge partitions by (record time, partition index): rosbags' global order."""
    keyed = [[(m[1], i, k, m) for k, m in enumerate(p)] for i, p in enumerate(parts)]
    return [item[3] for item in heapq.merge(*keyed)]


@pytest.mark.parametrize("bag", [LUMINAR, HUSKY])
@pytest.mark.parametrize("partitions_per_bag", [None, 2])
def test_from_bags_matches_rosbags(
    spark: Any, shared_data: Path, bag: str, partitions_per_bag: int | None
) -> None:
    path = shared_data / bag
    rdd = BinPipeRDD.from_bags(spark, str(path), partitions_per_bag=partitions_per_bag)
    if partitions_per_bag:
        assert rdd.getNumPartitions() == partitions_per_bag
    parts = per_partition(rdd)
    assert merged(parts) == reference(path)
    assert rdd.count() == len(reference(path))


def test_from_bags_in_s3_matches_rosbags(
    spark: Any, shared_data: Path, s3_server: str, s3_bucket: str
) -> None:
    """Bags in an S3 bucket (the S3 test server): the driver reads their indexes and each
    Spark task its own byte range, through s3fs with the ``storage_options`` that travel
    with the partitions (the executors do not see the test's environment)."""
    import fsspec  # noqa: PLC0415

    options = {"endpoint_url": s3_server, "key": "adcloud-test", "secret": "adcloud-test"}
    local = [shared_data / LUMINAR, shared_data / HUSKY]
    uris = [f"{s3_bucket}/drives/{path.name}" for path in local]
    fsspec.filesystem("s3", **options).put([str(path) for path in local], uris)
    for uri, path in zip(uris, local, strict=True):
        rdd = BinPipeRDD.from_bags(spark, uri, partitions_per_bag=3, storage_options=options)
        assert rdd.getNumPartitions() == 3
        assert merged(per_partition(rdd)) == reference(path)
    both = BinPipeRDD.from_bags(spark, f"{s3_bucket}/drives/*.bag", storage_options=options)
    assert both.count() == sum(len(reference(path)) for path in local)
    # saved into the bucket, then saved again over it: the commit moves objects there too
    out = f"{s3_bucket}/ingest"
    manifest = both.save(out, storage_options=options)
    fixes = BinPipeRDD.load(spark, out, storage_options=options).filter(lambda m: m.topic == "/fix")
    assert fixes.save(out, overwrite=True, storage_options=options)["records"] == 989
    names = {p.rsplit("/", 1)[-1] for p in fsspec.filesystem("s3", **options).find(out)}
    assert names == {"_SUCCESS", "manifest.json"} | {
        f"part-{i:05d}.binpipe" for i in range(len(manifest["partitions"]))
    }


def test_topic_and_time_filters(spark: Any, shared_data: Path) -> None:
    path = shared_data / HUSKY
    ref = reference(path, ["/fix"])
    start, end = ref[100][1], ref[300][1]
    rdd = BinPipeRDD.from_bags(spark, str(path), topics=["/fix"], start=start, end=end)
    got = merged(per_partition(rdd))
    assert got == [m for m in ref if start <= m[1] < end]
    assert len(got) == 200


def test_pipe_through_cat_and_a_python_node(spark: Any, shared_data: Path, tmp_path: Path) -> None:
    path = shared_data / LUMINAR
    rdd = BinPipeRDD.from_bags(spark, str(path)).cache()
    original = per_partition(rdd)
    assert per_partition(rdd.pipe("cat")) == original

    node = tmp_path / "reverse_node.py"
    node.write_text(
        textwrap.dedent(
            """
            from adcloud.binpipe.node import run_node
            run_node(lambda m: (m.topic, m.timestamp, m.msgtype, bytes(m.data)[::-1]))
            """
        )
    )
    out = per_partition(rdd.pipe([sys.executable, str(node)]))
    assert out == [[(t, s, d[::-1]) for t, s, d in p] for p in original]


def test_pipe_failure_reaches_the_driver(spark: Any, shared_data: Path) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / LUMINAR), partitions_per_bag=1)
    with pytest.raises(Exception, match="exit code 7") as info:
        rdd.pipe(
            ["sh", "-c", "cat >/dev/null; echo 'node: lidar driver failed' >&2; exit 7"]
        ).count()
    assert "lidar driver failed" in str(info.value)


def test_a_cancelled_job_kills_its_hanging_pipe_commands(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    """A job whose pipe command hangs is cancelled (Ctrl-C in a notebook, a scheduler's
    timeout): Spark kills the tasks' Python workers, and their commands go with them
    instead of running on in the executors."""
    import threading  # noqa: PLC0415

    pids = tmp_path / "pids"
    pids.mkdir()
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / LUMINAR), partitions_per_bag=2)
    command = ["sh", "-c", f"echo $$ > {pids}/$$; exec sleep 120"]
    sc = spark.sparkContext
    failure: list[BaseException] = []

    def run() -> None:
        sc.setJobGroup("hanging-pipe", "a pipe that never ends", interruptOnCancel=True)
        try:
            rdd.pipe(command).count()
        except BaseException as err:  # the cancellation, checked below
            failure.append(err)

    job = threading.Thread(target=run, daemon=True)
    job.start()
    deadline = time.monotonic() + 60
    while len(list(pids.iterdir())) < 2:
        assert time.monotonic() < deadline, "the pipe commands never started"
        time.sleep(0.1)
    commands = [int(p.name) for p in pids.iterdir()]
    sc.cancelJobGroup("hanging-pipe")
    job.join(timeout=60)
    assert not job.is_alive() and failure, "the job was not cancelled"
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in commands) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in commands if alive(pid)], "commands outlived their job"


def test_map_filter_and_decode(spark: Any, shared_data: Path) -> None:
    path = shared_data / HUSKY
    rdd = BinPipeRDD.from_bags(spark, str(path), topics=["/fix"])

    def latitude(msg: Message, decoded: Any) -> tuple[str, int, float]:
        return (msg.topic, msg.timestamp, float(decoded.latitude))

    got = rdd.map_records(latitude, decode=True).collect_records()
    store = get_typestore(Stores.ROS1_NOETIC)
    with AnyReader([path], default_typestore=store) as reader:
        conns = [c for c in reader.connections if c.topic == "/fix"]
        expected = [
            ("/fix", t, float(reader.deserialize(raw, c.msgtype).latitude))
            for c, t, raw in reader.messages(connections=conns)
        ]
    assert sorted(got) == sorted(expected)

    late = expected[len(expected) // 2][1]
    kept = rdd.filter(lambda m: m.timestamp >= late).count()
    assert kept == sum(1 for e in expected if e[1] >= late)


def test_save_and_load_round_trip(spark: Any, shared_data: Path, tmp_path: Path) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / LUMINAR))
    out = tmp_path / "ingest"
    manifest = rdd.save(str(out))
    files = sorted(p.name for p in out.iterdir())
    assert "_SUCCESS" in files and "manifest.json" in files and "_temporary" not in files
    assert len([f for f in files if f.startswith("part-")]) == rdd.getNumPartitions()
    assert manifest["records"] == rdd.count()
    loaded = BinPipeRDD.load(spark, str(out))
    assert per_partition(loaded) == per_partition(rdd)
    with pytest.raises(Exception, match="already exists"):
        rdd.save(str(out))
    again = rdd.save(str(out), overwrite=True)  # replaces an earlier save
    assert again == manifest and per_partition(BinPipeRDD.load(spark, str(out))) == per_partition(
        rdd
    )
    # ... but never a directory holding anything else (a mistyped --out)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(BinpipeError, match=r"notes\.txt\); refusing to replace it"):
        rdd.save(str(out), overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me" and (out / "_SUCCESS").exists()


def test_load_reads_what_the_manifest_lists_and_names_what_is_wrong(
    spark: Any, shared_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), partitions_per_bag=3)
    out = tmp_path / "saved"
    manifest = rdd.save(out)
    part = out / "part-00001.binpipe"
    # a stray part file (a copy from another save) is not read
    shutil.copy(out / "part-00000.binpipe", out / "part-00007.binpipe")
    with caplog.at_level("WARNING", logger="adcloud.binpipe.rdd"):
        assert BinPipeRDD.load(spark, out).count() == manifest["records"]
    assert "part-00007.binpipe" in caplog.text
    # a listed part that changed or went missing is an error naming it, not a short read
    data = part.read_bytes()
    part.write_bytes(data[:-100])
    with pytest.raises(BinpipeError, match=r"part-00001\.binpipe holds \d+ bytes"):
        BinPipeRDD.load(spark, out)
    part.unlink()
    with pytest.raises(BinpipeError, match=r"part-00001\.binpipe is missing"):
        BinPipeRDD.load(spark, out)
    part.write_bytes(data)
    assert BinPipeRDD.load(spark, out).count() == manifest["records"]
    with pytest.raises(BinpipeError, match="does not exist"):
        BinPipeRDD.load(spark, tmp_path / "nowhere")
    with pytest.raises(BinpipeError, match="is a file, not a directory"):
        BinPipeRDD.load(spark, shared_data / HUSKY)


def test_map_records_returning_a_string_is_an_error_not_a_record_per_character(
    spark: Any, shared_data: Path
) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), topics=["/fix"])
    with pytest.raises(Exception, match=r"returned str '/fix'; return a record"):
        rdd.map_records(lambda m: m.topic).count()
    assert rdd.map_records(lambda m: [m, m]).count() == 2 * rdd.count()


def keep_fix(msg: Message) -> bool:
    return msg.topic == "/fix"


def test_save_manifest_records_where_the_records_came_from(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    bag = str(shared_data / HUSKY)
    rdd = BinPipeRDD.from_bags(
        spark, bag, topics=["/fix", "/imu/data"], start=1, time_source="header"
    )
    derived = rdd.filter(keep_fix).pipe(["cat", "-"])
    manifest = derived.save(str(tmp_path / "a"))
    source = manifest["source"]
    assert source["origin"] == "bags" and source["time_source"] == "header"
    assert source["topic_filter"] == ["/fix", "/imu/data"] and source["start"] == 1
    assert source["end"] is None and source["topics"] == ["/fix", "/imu/data"]
    [entry] = source["bags"]
    assert entry["uri"] == bag and entry["format"] == "ros1"
    assert entry["partitions"] == rdd.getNumPartitions()
    assert entry["messages"] == len(reference(Path(bag), ["/fix", "/imu/data"]))
    assert entry["records"] == manifest["records"] == 989  # what the save holds from it
    assert source["steps"] == [
        {"op": "filter", "fn": f"{__name__}.keep_fix"},
        {"op": "pipe", "command": "cat -"},
    ]
    assert rdd.lineage["steps"] == []  # deriving never changes the parent's lineage
    # The manifest on disk says the same, and a load of the save carries it on.
    on_disk = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert on_disk["source"] == source
    again = BinPipeRDD.load(spark, str(tmp_path / "a")).map_records(lambda m: m)
    second = again.save(str(tmp_path / "b"))["source"]
    assert second["origin"] == "save" and second["saved"] == source
    assert second["uri"] == str(tmp_path / "a")
    assert second["steps"][0]["op"] == "map_records" and "<lambda>" in second["steps"][0]["fn"]
    records = BinPipeRDD.from_records(spark, [("x", 1)]).save(str(tmp_path / "c"))
    assert records["source"] == {"origin": "records", "records": 1, "steps": []}
    # filters that leave nothing of a bag: it and the filters are still on record
    other = str(shared_data / LUMINAR)
    none = BinPipeRDD.from_bags(spark, [bag, other], topics=["/fix"], end=5).save(tmp_path / "d")
    assert none["records"] == 0
    assert none["source"]["bags"] == [
        {"uri": bag, "partitions": 0, "messages": 0, "records": 0},
        {"uri": other, "partitions": 0, "messages": 0, "records": 0},
    ]
    assert none["source"]["topic_filter"] == ["/fix"] and none["source"]["end"] == 5
    assert none["source"]["time_source"] == "record"
    some = BinPipeRDD.from_bags(spark, [bag, other], topics=["/fix"]).save(tmp_path / "e")
    assert [(b["uri"], b["records"]) for b in some["source"]["bags"]] == [(bag, 989), (other, 0)]


def test_each_partition_knows_the_bag_it_reads(spark: Any, shared_data: Path) -> None:
    bags = [str(shared_data / HUSKY), str(shared_data / LUMINAR)]
    rdd = BinPipeRDD.from_bags(spark, bags, partitions_per_bag=2)
    assert rdd.partition_bags is not None and len(rdd.partition_bags) == rdd.getNumPartitions()
    assert sorted(set(rdd.partition_bags)) == sorted(bags)

    def topics_of(index: int, blocks: Any) -> Any:
        seen: set[str] = set()
        for raw in blocks:
            block = Block.parse(memoryview(raw))
            if block.kind == BlockKind.DATA:
                seen.update(m.topic for m in block.messages())
        yield index, seen

    # each partition's messages come from the bag named for its index (the bags share no topic)
    topics = {bag: {t for t, _, _ in reference(Path(bag))} for bag in bags}
    assert not topics[bags[0]] & topics[bags[1]]
    for index, seen in rdd.rdd.mapPartitionsWithIndex(topics_of).collect():
        assert seen and seen <= topics[rdd.partition_bags[index]], index
    derived = rdd.filter(keep_fix).pipe(["cat", "-"])
    assert derived.partition_bags == rdd.partition_bags  # steps keep partitions one to one
    assert BinPipeRDD.from_records(spark, [("x", 1)]).partition_bags is None


def test_failed_save_leaves_no_partial_output(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), partitions_per_bag=3)

    def explode(msg: Message) -> Message:
        if msg.topic == "/imu/data" and msg.timestamp % 97 == 0:
            raise RuntimeError("executor blew up")
        return msg

    out = tmp_path / "broken"
    with pytest.raises(Exception, match="executor blew up"):
        rdd.map_records(explode).save(str(out))
    assert not (out / "_SUCCESS").exists()
    # nothing at all is left of the failed save, not even whole partitions
    assert not out.exists()
    with pytest.raises(BinpipeError, match="does not exist"):
        BinPipeRDD.load(spark, str(out))
    out.mkdir()  # a directory without the marker: a save that never finished
    with pytest.raises(BinpipeError, match="no _SUCCESS marker"):
        BinPipeRDD.load(spark, str(out))
    # one whose commit was killed: said so, with what finishes it (not "delete it")
    (out / "_temporary").mkdir()
    (out / "_temporary" / "0123.commit").write_text("{}")
    with pytest.raises(BinpipeError, match=r"killed while moving .*0123\.commit.*--overwrite"):
        BinPipeRDD.load(spark, str(out))


def test_a_save_to_a_process_s_own_memory_is_refused_before_spark(spark: Any) -> None:
    """``memory://`` outputs: the parts were written in the workers' memory, and the commit
    failed with a FileNotFoundError traceback after the whole job."""
    rdd = BinPipeRDD.from_records(spark, [("/a", 1)])
    for uri in ("memory:///binpipe/out", "memory://binpipe/out2"):
        with pytest.raises(BinpipeError, match=r"memory:// is each Python process's own"):
            rdd.save(uri)
        with pytest.raises(BinpipeError, match=r"memory:// is each Python process's own"):
            check_save_target(uri)


def test_from_records_refuses_a_partition_count_below_one(spark: Any) -> None:
    """``num_partitions=0`` failed inside Spark with a bare ZeroDivisionError."""
    for bad in (0, -2, 1.5, True):
        with pytest.raises(BinpipeError, match=r"num_partitions must be a whole number >= 1"):
            BinPipeRDD.from_records(spark, [("/a", 1)], bad)  # type: ignore[arg-type]
    assert BinPipeRDD.from_records(spark, [("/a", 1), ("/b", 2)], 2).count() == 2


def test_from_records_refuses_a_record_that_is_a_string(spark: Any) -> None:
    """A list of strings (or bytes) was distributed as one record per string, of one field
    per character (``"/a"`` became ``("/", "a")``), with no error."""
    for bad, kind in (("/chatter", "str"), (b"\x01\x02", "bytes"), (7, "int")):
        with pytest.raises(BinpipeError, match=rf"record 1 is a {kind} .*tuple of fields"):
            BinPipeRDD.from_records(spark, [("/a", 1), bad])  # type: ignore[list-item]
    assert BinPipeRDD.from_records(spark, [["/a", 1], ("/b", 2)]).collect_records() == [
        ("/a", 1),
        ("/b", 2),
    ]


def test_the_memory_refusal_suggests_targets_a_save_takes(spark: Any) -> None:
    """The ``memory://`` refusal names places every worker process can reach."""
    rdd = BinPipeRDD.from_records(spark, [("/a", 1)])
    with pytest.raises(BinpipeError, match=r"memory:// is each Python process's own") as refused:
        rdd.save("memory:///binpipe/out3")
    assert "file://" in str(refused.value)


def test_a_failed_overwrite_keeps_the_earlier_save(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    rdd = BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), partitions_per_bag=3)
    out = tmp_path / "kept"
    manifest = rdd.save(str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def explode(msg: Message) -> Message:
        if msg.topic == "/imu/data" and msg.timestamp % 97 == 0:
            raise RuntimeError("executor blew up")
        return msg

    with pytest.raises(Exception, match="executor blew up"):
        rdd.map_records(explode).save(str(out), overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # byte for byte
    assert BinPipeRDD.load(spark, str(out)).count() == manifest["records"]


def test_a_manifest_that_cannot_be_written_keeps_the_earlier_save(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    """The manifest was serialized after the commit had replaced the earlier save: a value
    JSON cannot hold (an ``np.int64`` start used to reach it) left parts without
    ``_SUCCESS``, and neither save readable."""
    import numpy as np  # noqa: PLC0415

    path = str(shared_data / HUSKY)
    out = tmp_path / "kept"
    manifest = BinPipeRDD.from_bags(spark, path, partitions_per_bag=2).save(str(out))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    ref = reference(shared_data / HUSKY, ["/fix"])
    late = ref[len(ref) // 2][1]
    tail = BinPipeRDD.from_bags(spark, path, topics=["/fix"], start=np.int64(late))
    bad = BinPipeRDD(tail.rdd, lineage={**tail.lineage, "note": {1, 2}})  # a set: no JSON
    with pytest.raises(BinpipeError, match=r"manifest cannot be written as JSON"):
        bad.save(str(out), overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # byte for byte
    assert BinPipeRDD.load(spark, str(out)).count() == manifest["records"]
    saved = tail.save(str(out), overwrite=True)  # the NumPy start itself is JSON now
    assert saved["records"] == sum(1 for m in ref if m[1] >= late)
    assert saved["source"]["start"] == late


def test_a_save_may_replace_the_save_it_reads(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "filtered"
    BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), partitions_per_bag=3).save(str(out))
    fixes = BinPipeRDD.load(spark, str(out)).filter(lambda m: m.topic == "/fix")
    manifest = fixes.save(str(out), overwrite=True)
    assert manifest["records"] == 989
    again = BinPipeRDD.load(spark, str(out)).collect_records()
    assert len(again) == 989 and {m.topic for m in again} == {"/fix"}
    assert sorted(p.name for p in out.iterdir()) == [
        "_SUCCESS",
        "manifest.json",
        "part-00000.binpipe",
        "part-00001.binpipe",
        "part-00002.binpipe",
    ]


def test_to_dataframe(spark: Any, shared_data: Path) -> None:
    path = shared_data / HUSKY
    pipe = BinPipeRDD.from_bags(spark, str(path))
    df = pipe.to_dataframe(spark)
    counts = {r["topic"]: r["count"] for r in df.groupBy("topic").count().collect()}
    assert counts == {"/fix": 989, "/husky_velocity_controller/odom": 3952, "/imu/data": 11865}
    # without a session argument: the session of the RDD's context
    assert pipe.to_dataframe().filter("topic = '/fix'").count() == 989
    # with the bag each message came from, over two bags
    both = BinPipeRDD.from_bags(spark, [str(path), str(shared_data / LUMINAR)], topics=None)
    per_bag = {
        r["bag"]: r["count"] for r in both.to_dataframe(bag=True).groupBy("bag").count().collect()
    }
    assert per_bag == {
        str(path): sum(counts.values()),
        str(shared_data / LUMINAR): len(reference(shared_data / LUMINAR)),
    }
    assert both.to_dataframe(bag=True).columns[0] == "bag"
    with pytest.raises(BinpipeError, match=r"bag=True.*do not map to bags"):
        BinPipeRDD.from_records(spark, [("x", 1)]).to_dataframe(bag=True)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("batchSize", "many", "option batchSize='many' is not an integer"),
        ("minPartitions", "0", "option minPartitions=0 must be at least 1"),
        ("start", "1.5e9", "option start='1.5e9' is not an integer"),
        ("timeSource", "gps", "option timeSource='gps' is not one of record, header"),
        ("topic", "/fix", "unknown option(s) topic; the options are topics, start, end"),
        ("topics", "", "option topics='' names no topic"),
        ("topics", " , ", "option topics=' , ' names no topic"),
        ("storageOptions", "anon=true", "option storageOptions is not JSON"),
        ("storageOptions", "[1]", "option storageOptions must be a JSON object"),
    ],
)
def test_rosbag_datasource_option_errors_name_the_option(
    spark: Any, shared_data: Path, option: str, value: str, message: str
) -> None:
    register_rosbag_source(spark)
    reader = spark.read.format("rosbag").option(option, value)
    with pytest.raises(Exception, match=re.escape(message)):
        reader.load(str(shared_data / HUSKY)).count()


def test_rosbag_datasource_reads_an_unindexed_bag_through_a_reindexed_copy(
    spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    register_rosbag_source(spark)
    data = bytearray((shared_data / LUMINAR).read_bytes())
    pos = data.index(b"index_pos=") + len(b"index_pos=")
    data[pos : pos + 8] = bytes(8)  # as a killed recorder leaves it
    bag = tmp_path / "killed.bag"
    bag.write_bytes(bytes(data))
    with pytest.raises(Exception, match="reindex"):
        spark.read.format("rosbag").load(str(bag)).count()
    df = spark.read.format("rosbag").option("reindexDir", str(tmp_path / "re")).load(str(bag))
    rows = df.select("topic", "record_time", "data").orderBy("record_time", "topic").collect()
    got = sorted((r["topic"], r["record_time"], bytes(r["data"])) for r in rows)
    assert got == sorted(reference(shared_data / LUMINAR))
    # the bag column names the bag loaded, not the copy (a filter on it matched nothing)
    assert [r["bag"] for r in df.select("bag").distinct().collect()] == [str(bag)]
    rdd = BinPipeRDD.from_bags(spark, [str(bag)], reindex_dir=str(tmp_path / "re"))
    assert [r["bag"] for r in rdd.to_dataframe(bag=True).select("bag").distinct().collect()] == [
        str(bag)
    ]
    manifest = rdd.save(str(tmp_path / "saved"))
    (entry,) = manifest["source"]["bags"]
    assert entry["reindexed_from"] == str(bag) and entry["records"] == len(rows)


def test_rosbag_datasource(spark: Any, shared_data: Path) -> None:
    register_rosbag_source(spark)
    paths = [str(shared_data / LUMINAR), str(shared_data / HUSKY)]
    df = spark.read.format("rosbag").load(paths)
    assert df.count() == 15 + 16806
    fix = df.filter(df.topic == "/fix")
    rows = fix.select("record_time", "data").orderBy("record_time").collect()
    ref = reference(shared_data / HUSKY, ["/fix"])
    assert [(r["record_time"], bytes(r["data"])) for r in rows] == [(m[1], m[2]) for m in ref]
    # a filtered DataFrame must not change the one it came from (see datasource.py)
    assert df.count() == 15 + 16806


def test_rosbag_datasource_options_narrow_the_plan(spark: Any, shared_data: Path) -> None:
    register_rosbag_source(spark)
    lum_path = str(shared_data / LUMINAR)

    def per_chunk() -> Any:
        # partitionBytes=0: one partition per chunk, so the narrowing shows in the count
        # (a fresh reader each time: DataFrameReader.option mutates the reader)
        return spark.read.format("rosbag").option("partitionBytes", "0")

    lum = per_chunk().load(lum_path)
    scans = per_chunk().option("topics", "/base_scan").load(lum_path)
    assert scans.count() == 5
    assert scans.rdd.getNumPartitions() < lum.rdd.getNumPartitions()
    ref = reference(shared_data / HUSKY, ["/fix"])
    late = ref[len(ref) // 2][1]
    husky = per_chunk().load(str(shared_data / HUSKY))
    tail = per_chunk().option("start", str(late)).load(str(shared_data / HUSKY))
    assert tail.rdd.getNumPartitions() < husky.rdd.getNumPartitions()
    assert tail.filter(tail.topic == "/fix").count() == sum(1 for m in ref if m[1] >= late)


def test_rosbag_datasource_single_path_and_options(spark: Any, shared_data: Path) -> None:
    register_rosbag_source(spark)
    df = (
        spark.read.format("rosbag")
        .option("topics", "/luminar_pointcloud")
        .load(str(shared_data / LUMINAR))
    )
    rows = df.collect()
    assert len(rows) == 5
    assert {r["msgtype"] for r in rows} == {"sensor_msgs/msg/PointCloud2"}


def test_rosbag_datasource_topics_no_bag_has_are_an_error_not_an_empty_table(
    spark: Any, shared_data: Path
) -> None:
    """``adcloud ingest --topics`` refuses a topic no bag has; the data source read an
    empty table for it.  A topic outside the time range is still an empty table."""
    register_rosbag_source(spark)
    paths = [str(shared_data / LUMINAR), str(shared_data / HUSKY)]
    with pytest.raises(Exception, match=r"option topics names /gps/fix, which no bag has; they"):
        spark.read.format("rosbag").option("topics", "/gps/fix").load(paths).count()
    # one of two misspelt: the other is read (and the misspelt one logged)
    some = spark.read.format("rosbag").option("topics", "/gps/fix,/fix").load(paths)
    assert some.count() == 989
    ref = reference(shared_data / HUSKY, ["/fix"])
    late = spark.read.format("rosbag").option("topics", "/fix").option("start", ref[-1][1] + 1)
    assert late.load(paths).count() == 0


def test_rosbag_datasource_reads_the_columns_of_a_given_schema(
    spark: Any, shared_data: Path
) -> None:
    """``.schema(...)`` picks columns (as a file source's does); a column the source does
    not have, or of another type, is an error naming it before any task runs."""
    register_rosbag_source(spark)
    path = str(shared_data / LUMINAR)
    df = spark.read.format("rosbag").schema("Data binary not null, topic string").load(path)
    assert df.columns == ["Data", "topic"]
    rows = df.filter(df.topic == "/base_scan").collect()
    ref = reference(shared_data / LUMINAR, ["/base_scan"])
    assert sorted(bytes(r["Data"]) for r in rows) == sorted(m[2] for m in ref)
    for schema, message in [
        ("topic string, stamp long", "schema column 'stamp' is not one of bag, topic"),
        ("timestamp int", "schema column 'timestamp' has type int; it is bigint"),
    ]:
        with pytest.raises(Exception, match=re.escape(message)):
            spark.read.format("rosbag").schema(schema).load(path).count()


@pytest.mark.cluster
def test_binpipe_on_standalone_cluster(cluster_spark: Any, shared_data: Path) -> None:
    path = shared_data / HUSKY
    rdd = BinPipeRDD.from_bags(cluster_spark, str(path), partitions_per_bag=4)
    assert merged(per_partition(rdd.pipe("cat"))) == reference(path)
    pids = set(rdd.rdd.mapPartitions(lambda _: [os.getpid()]).collect())
    assert len(pids) >= 2, "tasks should run in more than one executor process"


@pytest.mark.cluster
def test_a_killed_executor_costs_a_task_retry_not_the_job(
    cluster_spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    """One task SIGKILLs its own executor JVM halfway through a save: Spark loses that
    executor, runs the task again elsewhere, the standalone worker starts a new executor,
    and the saved streams hold every message once, as rosbags reads them."""
    from adcloud.spark import wait_for_executors  # noqa: PLC0415

    path = shared_data / HUSKY
    want = reference(path)
    victim = want[len(want) // 2][1]  # a record time in the middle of the bag
    marker = tmp_path / "killed"

    def kill_the_executor_once(msg: Message) -> Message:
        if msg.timestamp == victim and not marker.exists():
            marker.write_text(str(os.getpid()))
            pid = os.getpid()
            while pid > 1:  # up from the Python worker to its executor JVM
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"CoarseGrainedExecutorBackend" in argv:
                    os.kill(pid, signal.SIGKILL)
                    break
                stat = Path(f"/proc/{pid}/stat").read_text()
                pid = int(stat[stat.rindex(")") + 2 :].split()[1])
            os._exit(1)
        return msg

    tracker = cluster_spark.sparkContext.statusTracker()
    before = {(e.host, e.port) for e in tracker.getExecutorInfos()}
    rdd = BinPipeRDD.from_bags(cluster_spark, str(path), partitions_per_bag=4)
    out = tmp_path / "saved"
    manifest = rdd.map_records(kill_the_executor_once).save(str(out))
    assert marker.exists(), "no task killed its executor"
    assert manifest["records"] == len(want)
    got = per_partition(BinPipeRDD.load(cluster_spark, str(out)))
    assert sorted(m for part in got for m in part) == sorted(want)
    assert not list(out.glob("_temporary/**/*.binpipe"))  # the killed attempt left nothing
    wait_for_executors(cluster_spark, 2)  # the worker replaced it: later tests see two again
    after = {(e.host, e.port) for e in tracker.getExecutorInfos()}
    assert len(after - before) == 1, (before, after)  # one executor is new


@pytest.mark.cluster
def test_decode_save_and_datasource_on_standalone_cluster(
    cluster_spark: Any, shared_data: Path, tmp_path: Path
) -> None:
    path = shared_data / HUSKY
    rdd = BinPipeRDD.from_bags(cluster_spark, str(path), topics=["/fix"], partitions_per_bag=3)
    lat = rdd.map_records(lambda m, fix: (m.topic, m.timestamp, float(fix.latitude)), decode=True)
    got = sorted(lat.collect_records())
    assert len(got) == 989 and all(42.3 < r[2] < 42.4 for r in got)  # type: ignore[operator]
    out = tmp_path / "fix"
    assert rdd.save(str(out))["records"] == 989
    assert BinPipeRDD.load(cluster_spark, str(out)).count() == 989
    register_rosbag_source(cluster_spark)
    df = cluster_spark.read.format("rosbag").option("topics", "/fix").load(str(path))
    assert df.count() == 989


def test_relative_paths_and_path_objects_mean_what_they_mean_here(
    spark: Any, shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The executors run in another working directory: a relative bag path, or one given
    as a Path, is the file this process means."""
    here = tmp_path / "here"
    here.mkdir()
    shutil.copy(shared_data / HUSKY, here / "drive.bag")
    monkeypatch.chdir(here)
    rdd = BinPipeRDD.from_bags(spark, "drive.bag", topics=["/fix"])
    assert rdd.partition_bags and rdd.partition_bags[0] == str(here / "drive.bag")
    assert rdd.count() == 989
    assert BinPipeRDD.from_bags(spark, [Path("drive.bag")], topics=["/fix"]).count() == 989
    rdd.save(Path("saved"))
    assert (here / "saved" / "_SUCCESS").is_file()
    assert BinPipeRDD.load(spark, Path("saved")).count() == 989


def test_map_and_filter_keep_meta_blocks_between_the_data_they_divide(spark: Any) -> None:
    """A partition holding two bags' records (a coalesce, a node's output) whose custom
    type changed between them: map_records and filter merged the records on both sides of
    the second META block into one output block, after both META blocks, so the first
    bag's messages were decoded downstream with the second bag's definition."""
    name = "survey_msgs/msg/Position"
    versions = ("float64 x\nfloat64 y\n", "float64 x\nfloat64 y\nstring label\n")
    blocks: list[bytes] = []
    for stamp, definition in enumerate(versions):
        store = get_typestore(Stores.EMPTY)
        store.register(get_types_from_msg(definition, name))
        fields = {"x": 1.0 + stamp, "y": 2.0} | ({"label": "moved"} if stamp else {})
        data = bytes(store.serialize_ros1(store.types[name](**fields), name))
        blocks.append(meta_block([ConnectionInfo("/pos", name, "ros1msg", definition, "", "ros1")]))
        blocks.append(encode_block([("/pos", stamp, name, data)]))
    rdd = BinPipeRDD(spark.sparkContext.parallelize(blocks, 1))
    kept = rdd.filter(lambda m: True).map_records(lambda m: m)
    decoded = [(d.x, getattr(d, "label", None)) for _, d in decoded_messages(kept.rdd.collect())]
    assert decoded == [(1.0, None), (2.0, "moved")]
    got = kept.map_records(lambda m, d: (m.topic, m.timestamp, d.x), decode=True)
    assert got.collect_records() == [("/pos", 0, 1.0), ("/pos", 1, 2.0)]
