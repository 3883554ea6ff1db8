"""Bag partitioning and range reading, checked message for message against rosbags."""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import logging
import pickle
import re
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import lz4.frame
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rosbags.highlevel import AnyReader
from rosbags.rosbag1 import Reader as Ros1Reader
from rosbags.rosbag1 import Writer as Ros1Writer
from rosbags.typesys import Stores, get_typestore

from adcloud.binpipe import _mcap, bags_io
from adcloud.binpipe._ros1 import decompress_chunk
from adcloud.binpipe.bags import (
    BagFormat,
    BagIndexError,
    BagPartition,
    TimeSource,
    UnindexedBagError,
    detect_format,
    header_stamp,
    plan_partitions,
    read_partition,
    read_partition_timed,
    summarize,
)
from adcloud.binpipe.decode import read_messages
from adcloud.binpipe.errors import BagError, BinpipeError
from adcloud.binpipe.rdd import expand_uris
from adcloud.binpipe.reindex import ReindexReport, reindex_bag

from . import bagfactory as bf

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
EMBAG = (DATA / "01_embag_luminar_ros1" / "embag_test.bag").resolve()
HUSKY = (DATA / "02_husky_gps_imu_odom_ros1" / "robot_localization_test1.bag").resolve()
SHARED = [EMBAG, HUSKY]
PARTITIONINGS = [None, 1, 2, 3, 1000]

Row = tuple[str, int, str, bytes]


# --------------------------------------------------------------------------- helpers


def reference(
    path: Path,
    topics: Sequence[str] | None = None,
    start: int | None = None,
    stop: int | None = None,
) -> list[Row]:
    """rosbags' own reader order and bytes: (topic, record time, type, data)."""
    with AnyReader([path]) as reader:
        conns = [c for c in reader.connections if topics is None or c.topic in topics]
        if not conns:
            return []
        return [
            (c.topic, t, c.msgtype, bytes(d))
            for c, t, d in reader.messages(connections=conns, start=start, stop=stop)
        ]


def merged(parts: Sequence[BagPartition]) -> list[Row]:
    """All partitions of a bag merged by (record time, partition index)."""
    streams = [
        [
            (m.timestamp, p.index, i, (m.topic, m.timestamp, m.msgtype, bytes(m.data)))
            for i, m in enumerate(read_partition(p))
        ]
        for p in parts
    ]
    return [row for *_key, row in heapq.merge(*streams)]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def bags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Generated bags of every format, written once per session."""
    d = tmp_path_factory.mktemp("bags")
    return {
        "ros1-none": bf.write_ros1(d / "none.bag"),
        "ros1-bz2": bf.write_ros1(d / "bz2.bag", compression="bz2"),
        "ros1-lz4": bf.write_ros1(d / "lz4.bag", compression="lz4"),
        "ros2-sqlite3": bf.write_ros2(d / "ros2_sqlite"),
        "ros2-sqlite3-zmsg": bf.write_ros2(d / "ros2_zmsg", compression_mode="message"),
        "ros2-sqlite3-zfile": bf.write_ros2(d / "ros2_zfile", compression_mode="file"),
        "ros2-mcap": bf.write_ros2(d / "ros2_mcap", storage="mcap"),
        "ros2-split": bf.write_ros2_split(d / "ros2_split", parts=3),
        "mcap-zstd": bf.write_mcap(d / "zstd.mcap"),
        "mcap-lz4": bf.write_mcap(d / "lz4.mcap", compression="lz4"),
        "mcap-none": bf.write_mcap(d / "none.mcap", compression="none"),
    }


@pytest.fixture
def memfs() -> Iterator[MemoryFileSystem]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/t"):
        fs.rm("/t", recursive=True)


@pytest.fixture
def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int | None, int | None]]:
    """Record every ranged read of the memory filesystem: (path, start, end)."""
    reads: list[tuple[str, int | None, int | None]] = []
    original = MemoryFileSystem.cat_file

    def cat_file(
        self: Any, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        reads.append((path, start, end))
        return original(self, path, start=start, end=end, **kw)

    monkeypatch.setattr(MemoryFileSystem, "cat_file", cat_file)
    return reads


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADCLOUD_BINPIPE_CACHE_DIR", str(tmp_path / "cache"))


# ------------------------------------------------------------------- reading == rosbags


@pytest.mark.parametrize("path", SHARED, ids=lambda p: p.name)
@pytest.mark.parametrize("k", PARTITIONINGS)
def test_shared_bags_match_rosbags(path: Path, k: int | None) -> None:
    parts = plan_partitions(str(path), partitions_per_bag=k)
    assert [p.index for p in parts] == list(range(len(parts)))
    if k is not None:
        assert len(parts) <= k
    ref = reference(path)
    assert merged(parts) == ref
    assert sum(p.message_count for p in parts) == len(ref)


@pytest.mark.parametrize(
    "name",
    [
        "ros1-none",
        "ros1-bz2",
        "ros1-lz4",
        "ros2-sqlite3",
        "ros2-sqlite3-zmsg",
        "ros2-sqlite3-zfile",
        "ros2-mcap",
        "ros2-split",
        "mcap-zstd",
        "mcap-lz4",
        "mcap-none",
    ],
)
@pytest.mark.parametrize("k", PARTITIONINGS)
def test_generated_bags_match_rosbags(bags: dict[str, Path], name: str, k: int | None) -> None:
    path = bags[name]
    parts = plan_partitions(str(path), partitions_per_bag=k)
    ref = reference(path)
    assert len(ref) == 400
    if k is not None:
        files = 3 if name == "ros2-split" else 1  # a partition never spans storage files
        assert len(parts) <= max(k, files)
    if name.startswith(("ros1", "mcap")) and k in (None, 1000):
        assert len(parts) > 3, "the generated bag should have several chunks"
    got = merged(parts)
    assert got == ref
    assert sum(p.message_count for p in parts) == 400


def test_ranges_tile_the_chunks(bags: dict[str, Path]) -> None:
    """Partition byte ranges are disjoint, ordered, and cover the chunk area exactly."""
    path = bags["ros1-lz4"]
    index_pos, chunk_pos = bf.ros1_layout(path)
    for k in (None, 2, 3):
        parts = plan_partitions(str(path), partitions_per_bag=k)
        assert parts[0].start_offset == chunk_pos[0]
        assert parts[-1].end_offset == index_pos
        for a, b in itertools.pairwise(parts):
            assert a.end_offset == b.start_offset
        assert {p.start_offset for p in parts} <= set(chunk_pos)


def test_equal_byte_grouping(bags: dict[str, Path]) -> None:
    parts = plan_partitions(str(bags["ros1-none"]), partitions_per_bag=3)
    sizes = [p.end_offset - p.start_offset for p in parts]
    assert len(parts) == 3
    assert max(sizes) < 1.5 * min(sizes)


def test_ties_across_connections_follow_rosbags(tmp_path: Path) -> None:
    """Equal record times on different connections come in connection order, like rosbags."""
    path = tmp_path / "ties.bag"
    ts = bf.ROS1
    with Ros1Writer(path) as w:
        a = w.add_connection("/a", "std_msgs/msg/Int32", typestore=ts)
        b = w.add_connection("/b", "std_msgs/msg/Int32", typestore=ts)
        for i in range(20):
            t = bf.T0 + (i // 3) * 1000
            conn = b if i % 2 else a
            w.write(
                conn,
                t,
                ts.serialize_ros1(ts.types["std_msgs/msg/Int32"](data=i), "std_msgs/msg/Int32"),
            )
    ref = reference(path)
    assert [r[0] for r in ref] != sorted(r[0] for r in ref)  # there are ties to order
    assert merged(plan_partitions(str(path))) == ref


#: Record times (s after bf.T0) of a drive whose chunks are out of time order, as in a bag
#: stamped with header times or merged by a script: a later chunk holds earlier times.
_SHUFFLED = [0, 2, 6, 4, 8, 9, 1, 3, 5, 12, 10, 7, 11]


def _shuffled_ros1(path: Path) -> Path:
    ts = bf.ROS1
    with Ros1Writer(path) as w:
        w.chunk_threshold = 100  # two or three messages a chunk
        conn = w.add_connection("/a", "std_msgs/msg/String", typestore=ts)
        for t in _SHUFFLED:
            data = ts.serialize_ros1(ts.types["std_msgs/msg/String"](data=str(t)), conn.msgtype)
            w.write(conn, bf.T0 + t * 10**9, data)
    return path


def _shuffled_mcap(path: Path) -> Path:
    from mcap.writer import CompressionType  # noqa: PLC0415
    from mcap.writer import Writer as McapWriter  # noqa: PLC0415

    msgdef, _ = bf.ROS2.generate_msgdef("std_msgs/msg/String", ros_version=2)
    with path.open("wb") as out:
        writer = McapWriter(out, chunk_size=64, compression=CompressionType.NONE)
        writer.start(profile="ros2", library="adcloud-tests")
        schema = writer.register_schema(
            name="std_msgs/msg/String", encoding="ros2msg", data=msgdef.encode()
        )
        channel = writer.register_channel(topic="/a", message_encoding="cdr", schema_id=schema)
        for seq, t in enumerate(_SHUFFLED):
            data = bf.ROS2.serialize_cdr(
                bf.ROS2.types["std_msgs/msg/String"](data=str(t)), "std_msgs/msg/String"
            )
            stamp = bf.T0 + t * 10**9
            writer.add_message(
                channel_id=channel, log_time=stamp, publish_time=stamp, sequence=seq, data=data
            )
        writer.finish()  # type: ignore[no-untyped-call]
    return path


@pytest.mark.parametrize("write", [_shuffled_ros1, _shuffled_mcap], ids=["ros1", "mcap"])
@pytest.mark.parametrize("k", PARTITIONINGS)
def test_chunks_out_of_time_order_still_read_in_time_order(
    tmp_path: Path, write: Any, k: int | None
) -> None:
    """Every partition yields its messages by record time even when a later chunk holds
    earlier times; the partitions merged are rosbags' order."""
    path = write(tmp_path / ("shuffled.mcap" if write is _shuffled_mcap else "shuffled.bag"))
    parts = plan_partitions(str(path), partitions_per_bag=k)
    if k in (None, 1000):
        assert len(parts) > 3, "the bag should have several chunks"
    for part in parts:
        times = [m.timestamp for m in read_partition(part)]
        assert times == sorted(times), (part.index, times)
    assert merged(parts) == reference(path)
    (whole,) = plan_partitions(str(path), partitions_per_bag=1)
    assert [(t - bf.T0) // 10**9 for _, t, _, _ in merged([whole])] == sorted(_SHUFFLED)


# ------------------------------------------------------------------------- URLs, fsspec


def test_memory_url_reads_only_ranges(
    memfs: MemoryFileSystem, count_reads: list[tuple[str, int | None, int | None]]
) -> None:
    data = HUSKY.read_bytes()
    memfs.pipe("/t/husky.bag", data)
    parts = plan_partitions("memory://t/husky.bag", partitions_per_bag=3)
    plan_reads = list(count_reads)
    assert all(s is not None and e is not None for _p, s, e in plan_reads)
    plan_bytes = sum(e - s for _p, s, e in plan_reads if s is not None and e is not None)
    assert plan_bytes < len(data) // 10, "planning must read the index, not the bag"
    count_reads.clear()
    assert merged(parts) == reference(HUSKY)
    for part in parts:
        count_reads.clear()
        list(read_partition(part))
        for _p, s, e in count_reads:
            assert s is not None and e is not None
            assert part.start_offset <= s < e <= part.end_offset


def test_topic_filter_drops_chunks_before_reading(
    memfs: MemoryFileSystem, count_reads: list[tuple[str, int | None, int | None]]
) -> None:
    data = EMBAG.read_bytes()
    memfs.pipe("/t/embag.bag", data)
    uri = "memory://t/embag.bag"
    every = plan_partitions(uri)
    count_reads.clear()
    parts = plan_partitions(uri, topics=["/base_scan"])
    assert 0 < len(parts) < len(every)
    got = merged(parts)
    assert got == reference(EMBAG, topics=["/base_scan"])
    assert len(got) == 5
    read_bytes = sum(e - s for _p, s, e in count_reads if s is not None and e is not None)
    assert read_bytes < len(data) // 4


@pytest.mark.parametrize("name", ["ros1-lz4", "mcap-zstd", "ros2-sqlite3", "ros2-mcap"])
def test_filters_match_rosbags(bags: dict[str, Path], name: str) -> None:
    path = bags[name]
    msgs = bf.drive()
    times = sorted(m.time for m in msgs)
    start, stop = times[120], times[260]
    for k in (None, 2):
        every = plan_partitions(str(path), partitions_per_bag=k)
        parts = plan_partitions(
            str(path), topics=["/imu", "/status"], start=start, end=stop, partitions_per_bag=k
        )
        assert merged(parts) == reference(path, ["/imu", "/status"], start, stop)
        assert all(p.topics == ("/imu", "/status") for p in parts)
        assert {c.topic for p in parts for c in p.connections} == {"/imu", "/status"}
        if name.startswith(("ros1", "mcap")) and k is None:
            assert len(parts) < len(every), "chunks outside [start, end) must be dropped"
            covered = sum(p.end_offset - p.start_offset for p in parts)
            assert covered < sum(p.end_offset - p.start_offset for p in every)
    assert plan_partitions(str(path), topics=["/nope"]) == []
    with pytest.raises(BagError, match="partitions_per_bag"):
        plan_partitions(str(path), partitions_per_bag=0)
    assert plan_partitions(str(path), start=times[-1] + 1) == []
    # bounds beyond int64 select what they say in every format (SQLite raised OverflowError)
    assert plan_partitions(str(path), start=10**23) == []
    assert merged(plan_partitions(str(path), start=-(10**23), end=10**23)) == merged(every)


def test_sqlite_counts_are_exact_after_filters(bags: dict[str, Path]) -> None:
    path = bags["ros2-sqlite3"]
    times = sorted(m.time for m in bf.drive())
    parts = plan_partitions(
        str(path), topics=["/pose"], start=times[50], end=times[300], partitions_per_bag=3
    )
    assert sum(p.message_count for p in parts) == len(merged(parts)) > 0


def test_file_url_and_storage_options(bags: dict[str, Path]) -> None:
    path = bags["ros1-bz2"]
    parts = plan_partitions(
        path.as_uri(), partitions_per_bag=2, storage_options={"auto_mkdir": False}
    )
    assert parts[0].storage_options == (("auto_mkdir", False),)
    assert merged(parts) == reference(path)


def test_ros2_from_memory_url_uses_local_cache(
    bags: dict[str, Path], memfs: MemoryFileSystem, tmp_path: Path
) -> None:
    src = bags["ros2-sqlite3"]
    for f in src.iterdir():
        memfs.pipe(f"/t/r2/{f.name}", f.read_bytes())
    uri = "memory://t/r2"
    assert detect_format(uri) is BagFormat.ROS2
    parts = plan_partitions(uri, partitions_per_bag=2)
    assert {p.member for p in parts} == {"ros2_sqlite.db3"}
    assert merged(parts) == reference(src)
    assert any((tmp_path / "cache").glob("*ros2_sqlite.db3"))


def test_mcap_from_memory_url(bags: dict[str, Path], memfs: MemoryFileSystem) -> None:
    src = bags["mcap-lz4"]
    memfs.pipe("/t/x.mcap", src.read_bytes())
    assert merged(plan_partitions("memory://t/x.mcap", partitions_per_bag=3)) == reference(src)


def test_format_comes_from_magic_not_extension(bags: dict[str, Path], tmp_path: Path) -> None:
    ros1_named_mcap = tmp_path / "really_ros1.mcap"
    shutil.copy(bags["ros1-none"], ros1_named_mcap)
    mcap_named_bag = tmp_path / "really_mcap.bag"
    shutil.copy(bags["mcap-zstd"], mcap_named_bag)
    assert detect_format(str(ros1_named_mcap)) is BagFormat.ROS1
    assert detect_format(str(mcap_named_bag)) is BagFormat.MCAP
    assert detect_format(str(bags["ros2-sqlite3"])) is BagFormat.ROS2
    assert detect_format(str(next(bags["ros2-sqlite3"].glob("*.db3")))) is BagFormat.ROS2
    parts = plan_partitions(str(mcap_named_bag))
    assert parts[0].format is BagFormat.MCAP
    assert len(merged(parts)) == 400


def test_bare_db3_file(bags: dict[str, Path]) -> None:
    db = next(bags["ros2-sqlite3"].glob("*.db3"))
    parts = plan_partitions(str(db), partitions_per_bag=2)
    assert merged(parts) == reference(bags["ros2-sqlite3"])


# --------------------------------------------------------------------------- time source


def test_header_time_on_husky() -> None:
    store = get_typestore(Stores.ROS1_NOETIC)
    parts = plan_partitions(str(HUSKY), partitions_per_bag=2, time_source=TimeSource.HEADER)
    header = [m for p in parts for m in read_partition(p)]
    record = [
        m for p in plan_partitions(str(HUSKY), partitions_per_bag=2) for m in read_partition(p)
    ]
    assert len(header) == len(record) == 16806
    lags = []
    for h, r in zip(header, record, strict=True):
        assert (h.topic, h.msgtype, bytes(h.data)) == (r.topic, r.msgtype, bytes(r.data))
        decoded: Any = store.deserialize_ros1(bytes(h.data), h.msgtype)
        stamp = decoded.header.stamp
        assert h.timestamp == stamp.sec * 1_000_000_000 + stamp.nanosec
        if h.topic == "/imu/data":
            lags.append(r.timestamp - h.timestamp)
    assert len(lags) == 11865
    timed = [(m.timestamp, t) for p in parts for m, t in read_partition_timed(p)]
    assert timed == [(h.timestamp, r.timestamp) for h, r in zip(header, record, strict=True)]
    assert 0 < max(lags) <= 40_000_000, "IMU header lags record time by up to ~36 ms"
    assert sum(1 for x in lags if x != 0) > len(lags) // 2


@pytest.mark.parametrize("name", ["ros1-lz4", "ros2-sqlite3", "mcap-zstd", "ros2-mcap"])
def test_header_time_on_generated(bags: dict[str, Path], name: str) -> None:
    parts = plan_partitions(str(bags[name]), time_source=TimeSource.HEADER)
    got = sorted((m.topic, m.timestamp) for p in parts for m in read_partition(p))
    want = sorted((m.topic, m.stamp if m.topic in bf.HEADER_TOPICS else m.time) for m in bf.drive())
    assert got == want
    assert any(m.stamp != m.time for m in bf.drive())


# -------------------------------------------------------------------------------- pickle


def test_partition_pickles_cheaply() -> None:
    parts = plan_partitions(str(HUSKY), partitions_per_bag=3, time_source="header")
    for part in parts:
        blob = pickle.dumps(part)
        assert len(blob) < 32 * 1024
        back = pickle.loads(blob)
        assert back == part
        assert back.time_source is TimeSource.HEADER
    first = pickle.loads(pickle.dumps(parts[0]))
    assert [bytes(m.data) for m in read_partition(first)] == [
        bytes(m.data) for m in read_partition(parts[0])
    ]
    assert all(
        isinstance(getattr(parts[0], f), (str, int, tuple, type(None)))
        for f in parts[0].__dataclass_fields__
    )


# ------------------------------------------------------------------------------ summary


def test_summarize_shared_bags() -> None:
    emb = summarize(str(EMBAG))
    assert (emb.format, emb.message_count, emb.chunk_count, emb.compression, emb.indexed) == (
        BagFormat.ROS1,
        15,
        6,
        "lz4",
        True,
    )
    assert emb.size == 3_835_840
    assert {(t.topic, t.msgtype, t.count) for t in emb.topics} == {
        ("/luminar_pointcloud", "sensor_msgs/msg/PointCloud2", 5),
        ("/base_scan", "sensor_msgs/msg/LaserScan", 5),
        ("/base_pose_ground_truth", "nav_msgs/msg/Odometry", 5),
    }
    hus = summarize(str(HUSKY))
    assert (hus.message_count, hus.compression, hus.size) == (16806, "bz2", 1_470_835)
    assert hus.chunk_count == 10
    assert {(t.topic, t.count) for t in hus.topics} == {
        ("/fix", 989),
        ("/husky_velocity_controller/odom", 3952),
        ("/imu/data", 11865),
    }
    assert hus.duration == pytest.approx(395.31e9, abs=0.01e9)
    with Ros1Reader(HUSKY) as r:
        assert (hus.start, hus.end) == (r.start_time, r.end_time)
    imu = next(t for t in hus.topics if t.topic == "/imu/data")
    assert imu.frequency == pytest.approx(30, rel=0.05)


@pytest.mark.parametrize("name", ["ros2-sqlite3", "ros2-mcap", "mcap-zstd", "ros2-sqlite3-zfile"])
def test_summarize_generated(bags: dict[str, Path], name: str) -> None:
    s = summarize(str(bags[name]))
    times = [m.time for m in bf.drive()]
    assert (s.message_count, s.start, s.end) == (400, min(times), max(times) + 1)
    assert {(t.topic, t.msgtype, t.count) for t in s.topics} == {
        (t, typ, 100) for t, typ in bf.TOPICS
    }
    assert s.indexed
    assert json.loads(json.dumps(s.to_dict()))["topics"][0]["count"] == 100


# ------------------------------------------------------------------ corrupt and unindexed


def _copy(src: Path, dst: Path) -> Path:
    shutil.copy(src, dst)
    return dst


def test_bad_magic(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bag"
    bad.write_bytes(b"this is not a bag at all, just text\n" * 10)
    with pytest.raises(BagError, match=r"bad\.bag.*not a bag.*byte offset 0"):
        plan_partitions(str(bad))
    empty = tmp_path / "empty.bag"
    empty.write_bytes(b"")
    with pytest.raises(BagError, match=r"empty\.bag"):
        summarize(str(empty))
    with pytest.raises(BagError, match="no such file"):
        plan_partitions(str(tmp_path / "missing.bag"))


def test_truncated_bag_names_file(tmp_path: Path) -> None:
    cut = _copy(HUSKY, tmp_path / "cut.bag")
    cut.write_bytes(HUSKY.read_bytes()[:700_000])
    with pytest.raises(BagIndexError, match=r"cut\.bag.*index.*reindex") as cut_off:
        plan_partitions(str(cut))
    # a copy still being written: the index is said to lie past the end, not to be damaged
    assert "the file ends at byte 700000, before its index at byte offset" in str(cut_off.value)
    assert "still being copied, or was cut off" in str(cut_off.value)
    assert "damaged" not in str(cut_off.value)
    assert str(cut_off.value).count("indexed copy") == 1  # said once, not twice
    head_only = tmp_path / "head.bag"
    head_only.write_bytes(HUSKY.read_bytes()[:20])
    with pytest.raises(BagError, match=r"head\.bag"):
        plan_partitions(str(head_only))


def test_unindexed_bag(tmp_path: Path, bags: dict[str, Path]) -> None:
    bag = _copy(bags["ros1-lz4"], tmp_path / "unindexed.bag")
    data = bytearray(bag.read_bytes())
    at = data.index(b"index_pos=") + 10
    data[at : at + 8] = b"\0" * 8
    bag.write_bytes(bytes(data))
    with pytest.raises(UnindexedBagError, match=r"unindexed\.bag.*not indexed.*reindex"):
        plan_partitions(str(bag))
    s = summarize(str(bag))
    assert not s.indexed


def test_damaged_index(tmp_path: Path, bags: dict[str, Path]) -> None:
    bag = _copy(bags["ros1-none"], tmp_path / "damaged.bag")
    index_pos, _ = bf.ros1_layout(bag)
    data = bytearray(bag.read_bytes())
    data[index_pos : index_pos + 4] = b"\xff\xff\xff\x7f"
    bag.write_bytes(bytes(data))
    with pytest.raises(BagIndexError, match=rf"damaged\.bag.*byte offset {index_pos}"):
        plan_partitions(str(bag))


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("ros1-lz4", "lz4 decompression"),
        ("ros1-bz2", "bz2 decompression"),
        ("mcap-zstd", "decompression"),
        ("mcap-none", "CRC mismatch"),
    ],
)
def test_garbage_in_a_chunk(tmp_path: Path, bags: dict[str, Path], name: str, pattern: str) -> None:
    src = bags[name]
    bad = _copy(src, tmp_path / f"garbage{src.suffix}")
    parts = plan_partitions(str(bad))
    victim = parts[len(parts) // 2]
    data = bytearray(bad.read_bytes())
    # Keep the record framing, ruin the payload: the middle of the chunk's data.
    lo = victim.start_offset + 80
    hi = victim.start_offset + (victim.end_offset - victim.start_offset) // 2
    for i in range(lo, hi, 3):
        data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    # planned again: a partition planned before the bag changed refuses to read it
    parts = plan_partitions(str(bad))
    victim = parts[victim.index]
    for part in parts:
        if part.index != victim.index:
            assert len(list(read_partition(part))) == part.message_count
    with pytest.raises(BagError) as info:
        list(read_partition(victim))
    text = str(info.value)
    assert str(bad) in text and f"partition {victim.index}" in text
    assert f"byte offset {victim.start_offset}" in text
    assert pattern in text


@pytest.mark.parametrize("name", ["ros1-lz4", "ros2-sqlite3", "mcap-zstd"])
def test_a_bag_replaced_after_planning_is_an_error(
    tmp_path: Path, bags: dict[str, Path], name: str
) -> None:
    """A new upload to the bag's URL between the plan and the read is refused: read at
    the old plan's offsets (or, for sqlite3, rows) it gave another recording's messages
    under the old plan's connections, without a word."""
    src = bags[name]
    dst = tmp_path / src.name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    parts = plan_partitions(str(dst), partitions_per_bag=2)
    other = tmp_path / "other"
    if name.startswith("ros2"):
        (storage,) = dst.glob("*.db3")
        (new,) = bf.write_ros2(other, n=500).glob("*.db3")
    else:
        storage = dst
        new = bf.write_ros1(other.with_suffix(".bag"), compression="lz4", n=500)
        if name.startswith("mcap"):
            new = bf.write_mcap(other.with_suffix(".mcap"), n=500)
    new.replace(storage)
    for part in parts:
        with pytest.raises(BagError, match=r"replaced after its partitions were planned"):
            list(read_partition(part))
    # planned again, the new bag reads whole
    assert sum(1 for p in plan_partitions(str(dst)) for _ in read_partition(p)) == 500


def test_record_length_past_range(tmp_path: Path, bags: dict[str, Path]) -> None:
    bad = _copy(bags["ros1-none"], tmp_path / "long.bag")
    parts = plan_partitions(str(bad))
    part = parts[1]
    data = bytearray(bad.read_bytes())
    hlen = struct.unpack_from("<I", data, part.start_offset)[0]
    at = part.start_offset + 4 + hlen  # the chunk record's data length
    data[at : at + 4] = struct.pack("<I", 0x7FFF_FFFF)
    bad.write_bytes(bytes(data))
    part = plan_partitions(str(bad))[1]  # the damage is past the index: the plan stands
    with pytest.raises(BagError, match=r"long\.bag: partition 1: byte offset \d+: .*runs past"):
        list(read_partition(part))


def test_message_length_inside_chunk(tmp_path: Path, bags: dict[str, Path]) -> None:
    bad = _copy(bags["ros1-none"], tmp_path / "inner.bag")
    part = plan_partitions(str(bad))[2]
    data = bytearray(bad.read_bytes())
    hlen = struct.unpack_from("<I", data, part.start_offset)[0]
    content = part.start_offset + 4 + hlen + 4
    # Inside the chunk: the first record header's length becomes huge.
    data[content : content + 4] = struct.pack("<I", 0x0FFF_FFFF)
    bad.write_bytes(bytes(data))
    part = plan_partitions(str(bad))[2]  # the damage is past the index: the plan stands
    with pytest.raises(
        BagError,
        match=r"inner\.bag: partition 2: chunk at byte offset \d+, "
        r"byte offset \d+: .*runs past",
    ):
        list(read_partition(part))


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("conn", r"no message record where the chunk's index lists one"),
        ("time", r"the message record says connection \d+ at time \d+ ns, the chunk's index"),
    ],
)
def test_a_message_record_its_index_contradicts_is_a_bag_error(
    tmp_path: Path, bags: dict[str, Path], field: str, says: str
) -> None:
    # ROS 1 has no checksums: a damaged conn or time field of a message record is seen
    # only against the chunk's index.  It used to drop the message (an unknown
    # connection) or give it a wrong time without a word.
    bad = _copy(bags["ros1-none"], tmp_path / "contradicted.bag")
    part = plan_partitions(str(bad))[1]
    data = bytearray(bad.read_bytes())
    hlen = struct.unpack_from("<I", data, part.start_offset)[0]
    content = part.start_offset + 4 + hlen + 4
    at = data.index(f"{field}=".encode(), content) + len(field) + 1
    if field == "conn":
        data[at : at + 4] = struct.pack("<I", 77)
    else:
        sec, nsec = struct.unpack_from("<II", data, at)
        data[at : at + 8] = struct.pack("<II", sec + 1000, nsec)
    bad.write_bytes(bytes(data))
    part = plan_partitions(str(bad))[1]  # the damage is past the index: the plan stands
    with pytest.raises(
        BagError,
        match=r"contradicted\.bag: partition 1: chunk at byte offset \d+, byte offset \d+: " + says,
    ):
        list(read_partition(part))
    # the remedy the message names reads every message again
    fixed = tmp_path / "fixed.bag"
    reindex_bag(str(bad), str(fixed))
    assert sum(1 for p in plan_partitions(str(fixed)) for _ in read_partition(p)) >= 399


@pytest.mark.parametrize("name", ["ros1-none", "ros1-lz4", "mcap-none", "mcap-zstd"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.integers(0, 10**9),
)
def test_fuzzed_bags_raise_only_bag_errors(
    tmp_path: Path,
    bags: dict[str, Path],
    name: str,
    flips: list[tuple[int, int]],
    cut: int | None,
) -> None:
    src = bags[name]
    data = bytearray(src.read_bytes())
    for pos, x in flips:
        data[pos % len(data)] ^= x
    if cut is not None:
        del data[cut % len(data) :]
    bad = tmp_path / f"fuzz{src.suffix}"
    bad.write_bytes(bytes(data))
    try:
        for part in plan_partitions(str(bad), partitions_per_bag=3):
            for _ in read_partition(part):
                pass
        summarize(str(bad))
    except BagError as err:
        assert bad.name in str(err)


def test_a_zstd_frame_declaring_a_huge_size_is_a_bag_error(
    tmp_path: Path, bags: dict[str, Path]
) -> None:
    """A damaged zstd frame header that declares terabytes (one bit pattern the fuzzer
    found) is refused before anything is allocated, not a ``MemoryError``."""
    data = bytearray(bags["mcap-zstd"].read_bytes())
    frame = data.index(b"\x28\xb5\x2f\xfd")  # the first chunk's zstd frame
    data[frame + 4] ^= 0xA0  # its content size field now reads 8 bytes of the frame
    bad = tmp_path / "huge.mcap"
    bad.write_bytes(bytes(data))
    with pytest.raises(BagError, match=r"huge\.mcap: .*zstd frame declares \d+ bytes"):
        for part in plan_partitions(str(bad), partitions_per_bag=1):
            list(read_partition(part))


def _lz4_frame_declaring_terabytes(content: bytes) -> bytes:
    """An lz4 frame of ``content`` whose header declares ~1 TB instead, with a header
    checksum that still matches (it is one byte: 1 damaged header in 256 passes it)."""
    frame = bytearray(lz4.frame.compress(content, store_size=True))
    for extra in range(1, 1 << 16):
        frame[6:14] = struct.pack("<Q", (1 << 40) + extra)  # after magic, FLG and BD
        try:
            lz4.frame.get_frame_info(bytes(frame))
        except RuntimeError:
            continue
        return bytes(frame)
    raise AssertionError("no matching header checksum")


def test_an_lz4_frame_declaring_a_huge_size_is_a_format_error() -> None:
    """The same for lz4 chunks of ROS 1 bags and MCAP files: refused before allocating."""
    content = bytes(range(256)) * 20
    frame = memoryview(_lz4_frame_declaring_terabytes(content))
    with pytest.raises(ValueError, match=r"lz4 frame declares 10995116\d+ bytes"):
        decompress_chunk("lz4", frame, len(content))
    with pytest.raises(ValueError, match=r"lz4 frame declares 10995116\d+ bytes"):
        _mcap._decompress("lz4", frame, len(content), 0)
    good = memoryview(lz4.frame.compress(content, store_size=True))
    assert bytes(decompress_chunk("lz4", good, len(content))) == content
    assert bytes(_mcap._decompress("lz4", good, len(content), 0)) == content


def test_small_fetch_blocks(monkeypatch: pytest.MonkeyPatch, bags: dict[str, Path]) -> None:
    """Records larger than a fetch block and blocks ending mid-record read correctly."""
    monkeypatch.setattr(bags_io, "DEFAULT_BLOCK_BYTES", 97)
    for path in (EMBAG, bags["ros1-lz4"], bags["mcap-zstd"], bags["mcap-none"]):
        assert merged(plan_partitions(str(path), partitions_per_bag=2)) == reference(path)


# ------------------------------------------------------------------------------ reindex


def _unindex(bag: Path) -> None:
    data = bytearray(bag.read_bytes())
    at = data.index(b"index_pos=") + 10
    data[at : at + 8] = b"\0" * 8
    bag.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["ros1-lz4", "ros1-none"])
def test_reindex_unindexed(tmp_path: Path, bags: dict[str, Path], name: str) -> None:
    bag = _copy(bags[name], tmp_path / "src.bag")
    _unindex(bag)
    before = sha256(bag)
    report = ReindexReport()
    out = reindex_bag(str(bag), tmp_path / "out" / "fixed.bag", report=report)
    assert sha256(bag) == before
    assert report.messages == 400 and not report.dropped
    assert reference(out) == reference(bags[name])
    assert merged(plan_partitions(str(out), partitions_per_bag=2)) == reference(bags[name])


def test_reindex_truncated_keeps_complete_chunks(tmp_path: Path) -> None:
    bag = _copy(HUSKY, tmp_path / "cut.bag")
    with Ros1Reader(HUSKY) as r:
        chunk_pos = sorted(c.pos for c in r.chunk_infos)
        cut_chunk = chunk_pos[6]
        keep = {
            (c.topic, e.time)
            for c in r.connections
            for e in r.indexes[c.id]
            if e.chunk_pos < cut_chunk
        }
    bag.write_bytes(HUSKY.read_bytes()[: cut_chunk + 5000])  # mid-chunk 6
    before = sha256(bag)
    report = ReindexReport()
    out = reindex_bag(bag.as_uri(), tmp_path / "fixed.bag", report=report)
    assert sha256(bag) == before
    assert report.chunks == 6 and len(report.dropped) == 1
    want = [row for row in reference(HUSKY) if (row[0], row[1]) in keep]
    assert len(want) == report.messages > 9000
    assert reference(out) == want


def test_reindex_recovers_loose_records(tmp_path: Path, bags: dict[str, Path]) -> None:
    """A recorder killed mid-chunk leaves an unfinished chunk header and raw records."""
    src = bags["ros1-none"]
    data = src.read_bytes()
    _index_pos, chunks = bf.ros1_layout(src)
    payloads = bf.ros1_chunk_payloads(src)
    k = 4
    content = bf.ros1_chunk_content(src, chunks[k])
    open_chunk = bf.ros1_record({"op": b"\x05", "compression": b"none", "size": b"\0\0\0\0"}, b"")
    killed = tmp_path / "killed.bag"
    killed.write_bytes(data[: chunks[k]] + open_chunk + content[: len(content) - 7])
    _unindex(killed)
    before = sha256(killed)
    report = ReindexReport()
    out = reindex_bag(str(killed), tmp_path / "fixed.bag", report=report)
    assert sha256(killed) == before
    # Everything of chunks 0..k except chunk k's last record, which was cut.
    keep = {d for chunk in payloads[:k] for d in chunk} | set(payloads[k][:-1])
    want = [row for row in reference(src) if row[3] in keep]
    assert len(want) == len(keep) == report.messages
    assert reference(out) == want


def test_plan_reindexes_into_dir(
    tmp_path: Path, bags: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    bag = _copy(bags["ros1-bz2"], tmp_path / "rec.bag")
    _unindex(bag)
    before = sha256(bag)
    cache = tmp_path / "reindexed"
    with caplog.at_level(logging.WARNING):
        parts = plan_partitions(str(bag), partitions_per_bag=2, reindex_dir=cache)
    assert "no usable index" in caplog.text
    copies = list(cache.glob("rec-*.bag"))
    assert len(copies) == 1 and all(p.uri == str(copies[0]) for p in parts)
    assert merged(parts) == reference(bags["ros1-bz2"])
    stamp = copies[0].stat().st_mtime_ns
    again = plan_partitions(str(bag), partitions_per_bag=2, reindex_dir=cache)
    assert again == parts and copies[0].stat().st_mtime_ns == stamp
    assert sha256(bag) == before


# ------------------------------------------------------------------------- > 2 GiB offsets


def test_chunks_past_2gib(tmp_path: Path, bags: dict[str, Path]) -> None:
    shift = 2**31 + 123_457
    big = bf.sparse_shift(bags["ros1-lz4"], tmp_path / "big.bag", shift)
    st_ = big.stat()
    assert st_.st_size > 2**31
    if st_.st_blocks * 512 > 64 << 20:
        pytest.skip("the filesystem under tmp_path does not support sparse files")
    for k in (None, 2):
        parts = plan_partitions(str(big), partitions_per_bag=k)
        assert all(p.start_offset > 2**31 for p in parts)
        assert merged(parts) == reference(bags["ros1-lz4"])
    assert reference(big) == reference(bags["ros1-lz4"])


# ---------------------------------------------------------------------------- edge cases


def test_empty_bags(tmp_path: Path) -> None:
    for path in (
        bf.write_ros1(tmp_path / "e.bag", n=0),
        bf.write_mcap(tmp_path / "e.mcap", n=0),
        bf.write_ros2(tmp_path / "e_sqlite", n=0),
        bf.write_ros2(tmp_path / "e_mcap", n=0, storage="mcap"),
    ):
        s = summarize(str(path))
        assert (s.message_count, s.start, s.end) == (0, 0, 0)
        assert {t.topic for t in s.topics} == {t for t, _ in bf.TOPICS}
        assert merged(plan_partitions(str(path))) == []


def test_damaged_sqlite(tmp_path: Path, bags: dict[str, Path]) -> None:
    bag = tmp_path / "r2"
    shutil.copytree(bags["ros2-sqlite3"], bag)
    db = next(bag.glob("*.db3"))
    db.write_bytes(db.read_bytes()[:3000])
    with pytest.raises(BagError, match=re.escape(db.name)):
        for part in plan_partitions(str(bag)):
            list(read_partition(part))


def test_damaged_metadata_yaml_is_one_line_naming_the_place(
    tmp_path: Path, bags: dict[str, Path]
) -> None:
    bag = tmp_path / "r2"
    shutil.copytree(bags["ros2-sqlite3"], bag)
    meta = bag / "metadata.yaml"
    lines = meta.read_text().splitlines()
    lines[3] = lines[3].split(":")[0] + ": [1, 2"  # an unclosed flow sequence
    meta.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        BagError, match=r"metadata\.yaml is not valid YAML at line \d+, col"
    ) as info:
        plan_partitions(str(bag))
    assert "\n" not in str(info.value)
    meta.write_text("rosbag2_bagfile_information: {version: 9}\n")
    with pytest.raises(BagError, match=r"metadata\.yaml is not valid rosbag2 metadata"):
        plan_partitions(str(bag))


def test_header_stamp_byte_orders() -> None:
    stamp = struct.pack("<II", 5, 7)
    assert header_stamp(struct.pack("<I", 99) + stamp + b"\0" * 8, "ros1") == 5_000_000_007
    little = b"\x00\x01\x00\x00" + struct.pack("<iI", -2, 9)
    big = b"\x00\x00\x00\x00" + struct.pack(">iI", -2, 9)
    assert header_stamp(little, "cdr") == header_stamp(big, "cdr") == -2_000_000_000 + 9
    with pytest.raises(ValueError, match="too few"):
        header_stamp(b"\x00\x01\x00\x00", "cdr")


def test_reindex_dir_may_be_a_url(
    tmp_path: Path, bags: dict[str, Path], memfs: MemoryFileSystem
) -> None:
    data = bytearray(bags["ros1-lz4"].read_bytes())
    at = data.index(b"index_pos=") + 10
    data[at : at + 8] = b"\0" * 8
    memfs.pipe("/t/src/rec.bag", bytes(data))
    parts = plan_partitions("memory://t/src/rec.bag", reindex_dir="memory://t/re")
    assert parts and all(p.uri.startswith("memory://t/re/rec-") for p in parts)
    assert merged(parts) == reference(bags["ros1-lz4"])
    assert memfs.cat_file("/t/src/rec.bag") == bytes(data)


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("alluxio://user:pw@127.0.0.1:39999/a.bag", r"do not put credentials in alluxio://"),
        ("local://host/drives/a.bag", r"local://host/drives/a\.bag: cannot open the store"),
        ("nope://drives/a.bag", r"nope://drives/a\.bag: cannot open through fsspec"),
    ],
)
def test_uris_fsspec_cannot_open_are_named(uri: str, says: str) -> None:
    with pytest.raises(BagError, match=says):
        expand_uris([uri])
    with pytest.raises(BagError, match=says):
        plan_partitions(uri)


def test_a_directory_expands_to_every_bag_in_it_once(bags: dict[str, Path]) -> None:
    folder = bags["ros1-none"].parent
    # files of every format and the ROS 2 bag directories beside them
    assert expand_uris([str(folder)]) == sorted(str(p) for p in bags.values())
    # named three times (by itself, by its folder, by a glob): read once, under its own name
    first = str(bags["ros1-lz4"])
    again = expand_uris([first, str(folder), f"{folder}/*.bag"])
    assert again[0] == first
    assert sorted(again) == sorted(str(p) for p in bags.values())


def test_a_directory_of_a_ros2_bag_without_its_metadata_says_so(
    bags: dict[str, Path], tmp_path: Path
) -> None:
    """A rosbag2 directory whose recorder died before writing metadata.yaml holds only its
    .db3: expanding it said it "holds no .bag or .mcap file", nothing of the .db3."""
    source = bags["ros2-sqlite3"]
    folder = tmp_path / "cut"
    folder.mkdir()
    for db3 in source.glob("*.db3"):
        shutil.copy(db3, folder / db3.name)
    name = next(folder.glob("*.db3")).name
    with pytest.raises(BinpipeError, match=r"holds no \.bag or \.mcap file") as err:
        expand_uris([str(folder)])
    assert f"its {name} is a ROS 2 bag without its metadata.yaml" in str(err.value)
    assert f"ros2 bag reindex {folder}" in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BinpipeError, match=r"one with a metadata\.yaml\)$"):
        expand_uris([str(empty)])


def test_one_bag_under_two_spellings_is_read_once(bags: dict[str, Path], tmp_path: Path) -> None:
    """A plain path and its file:// URL, or a symlink and its target, are the same bag."""
    bag = bags["ros1-lz4"]
    link = tmp_path / "link.bag"
    link.symlink_to(bag)
    assert expand_uris([str(bag), f"file://{bag}", str(link)]) == [str(bag)]
    assert expand_uris([f"file://{bag}", str(bag)]) == [f"file://{bag}"]
    other = tmp_path / "copy.bag"
    shutil.copy(bag, other)  # the same bytes in another file is another bag
    assert expand_uris([str(bag), str(other)]) == [str(bag), str(other)]


def test_a_bag_named_like_a_glob_is_taken_as_it_is(bags: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "b sp"
    folder.mkdir()
    odd = folder / "my drive [2].bag"
    shutil.copy(bags["ros1-lz4"], odd)
    assert expand_uris([str(odd)]) == [str(odd)]
    assert expand_uris([str(folder / "*.bag")]) == [str(odd)]  # still a glob when it is one
    assert merged(plan_partitions(str(odd))) == reference(bags["ros1-lz4"])


def _foxglove_mcap(path: Path) -> Path:
    """An MCAP file of non-ROS channels, as Foxglove tools write them: a protobuf schema, a
    JSON schema, and a schemaless raw channel."""
    from mcap.writer import Writer as McapWriter  # noqa: PLC0415

    with path.open("wb") as out:
        writer = McapWriter(out, chunk_size=256)
        writer.start(profile="", library="adcloud-tests")
        proto = writer.register_schema(
            name="foxglove.PointCloud", encoding="protobuf", data=b"\x0a\x00"
        )
        json_schema = writer.register_schema(
            name="Detection", encoding="jsonschema", data=b'{"type": "object"}'
        )
        channels = [
            writer.register_channel(topic="/cloud", message_encoding="protobuf", schema_id=proto),
            writer.register_channel(topic="/det", message_encoding="json", schema_id=json_schema),
            writer.register_channel(topic="/raw", message_encoding="raw", schema_id=0),
        ]
        for i in range(12):
            writer.add_message(
                channel_id=channels[i % 3],
                log_time=bf.T0 + i,
                publish_time=bf.T0 + i,
                sequence=i,
                data=json.dumps({"i": i}).encode(),
            )
        writer.finish()  # type: ignore[no-untyped-call]
    return path


def test_mcap_types_of_other_encodings_keep_their_names(tmp_path: Path) -> None:
    """Only ROS type names are normalized: a protobuf or JSON schema's name is the type as
    its writer named it (rosbags would make ``msg/foxglove.PointCloud`` of it), and decoding
    such a message says what it is instead of failing on a missing ROS definition."""
    path = _foxglove_mcap(tmp_path / "foxglove.mcap")
    types = {t.topic: t.msgtype for t in summarize(str(path)).topics}
    assert types == {"/cloud": "foxglove.PointCloud", "/det": "Detection", "/raw": ""}
    msgs = [m for p in plan_partitions(str(path), partitions_per_bag=2) for m in read_partition(p)]
    assert {(m.topic, m.msgtype) for m in msgs} == set(types.items())
    with pytest.raises(BinpipeError, match=r"on /cloud \(type foxglove.PointCloud\).*'protobuf'"):
        next(read_messages(str(path), topics=["/cloud"]))
    with pytest.raises(BinpipeError, match=r"on /raw \(type \?\): their encoding is 'raw'"):
        next(read_messages(str(path), topics=["/raw"]))


@pytest.mark.parametrize("name", ["ros1-lz4", "ros2-sqlite3", "mcap-zstd", "ros2-mcap"])
def test_numpy_and_float_times_select_what_ints_select(bags: dict[str, Path], name: str) -> None:
    """Times taken from NumPy or pandas arrive as ``np.int64``: sqlite3 bound one as a BLOB,
    which no integer timestamp reaches, and a rosbag2 bag gave no message at all."""
    import numpy as np  # noqa: PLC0415

    lo, hi = bf.T0 + 1_000_000_000, bf.T0 + 2_500_000_000
    want = merged(plan_partitions(str(bags[name]), start=lo, end=hi))
    assert want == reference(bags[name], start=lo, stop=hi) and want
    for start, end in [(np.int64(lo), np.int64(hi)), (np.uint64(lo), hi), (float(lo), hi)]:
        parts = plan_partitions(str(bags[name]), start=start, end=end)
        assert merged(parts) == want, (type(start), type(end))
        assert all(type(p.start) is int and type(p.end) is int for p in parts)
    # half a nanosecond: integer record times t >= lo - 0.5 are those t >= lo
    assert merged(plan_partitions(str(bags[name]), start=lo - 0.5, end=hi)) == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": "1700000000"}, "start must be a time in ns (an integer), not '1700000000'"),
        ({"end": float("nan")}, "end must be a time in ns (an integer), not nan"),
        ({"partitions_per_bag": 2.5}, "partitions_per_bag must be a whole number, not 2.5"),
        ({"time_source": "HEADER"}, "time_source 'HEADER' is not one of record, header"),
    ],
)
def test_plan_arguments_of_the_wrong_type_are_named(
    bags: dict[str, Path], kwargs: dict[str, Any], message: str
) -> None:
    for name in ("ros1-lz4", "ros2-sqlite3"):
        with pytest.raises(BagError, match=re.escape(message)):
            plan_partitions(str(bags[name]), **kwargs)
