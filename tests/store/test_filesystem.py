"""The fsspec view of the stores (:mod:`adcloud.store.filesystem`), and BinPipe reading bags
from and saving streams into ``local://`` and ``alluxio://`` through it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from adcloud.binpipe import BinPipeRDD
from adcloud.binpipe.bags import plan_partitions, read_partition, summarize
from adcloud.binpipe.errors import BinpipeError
from adcloud.binpipe.rdd import check_save_target, expand_uris
from adcloud.store import LocalStore, ServerLimits, StoreServer, open_store
from adcloud.store.filesystem import StoreFileSystem, store_filesystem

HUSKY = "02_husky_gps_imu_odom_ros1/robot_localization_test1.bag"
DATA = bytes(range(256)) * 4096  # 1 MiB


def _local_fs(store_root: Path) -> StoreFileSystem:
    fs, path = store_filesystem("local:///", root=str(store_root))
    assert path == "/"
    return fs


def test_files_and_directories_through_fsspec(store_root: Path, tmp_path: Path) -> None:
    fs = _local_fs(store_root)
    fs.pipe_file("/d/a.bin", DATA)
    assert fs.cat_file("/d/a.bin") == DATA
    assert fs.cat_file("/d/a.bin", start=10, end=300_000) == DATA[10:300_000]
    assert fs.cat_file("/d/a.bin", start=-100) == DATA[-100:]
    assert fs.cat_file("/d/a.bin", start=len(DATA) - 5, end=len(DATA) + 99) == DATA[-5:]
    assert fs.cat_file("/d/a.bin", start=50, end=50) == b""
    assert fs.exists("/d/a.bin") and fs.isfile("/d/a.bin") and fs.isdir("/d")
    assert not fs.exists("/d/nope")
    assert fs.info("/d/a.bin")["size"] == len(DATA)
    assert fs.ls("/d", detail=False) == ["/d/a.bin"]
    assert fs.unstrip_protocol("/d/a.bin") == "local:///d/a.bin"
    # the same store, reached through LocalStore itself
    assert LocalStore("local://", root=str(store_root)).get("/d/a.bin") == DATA

    with pytest.raises(FileNotFoundError, match=r"/d/nope"):
        fs.cat_file("/d/nope")
    with pytest.raises(FileNotFoundError, match=r"/d/nope"):
        fs.info("/d/nope")

    fs.pipe_file("/d/b.bin", b"b")
    with pytest.raises(FileExistsError):  # a rename never replaces
        fs.mv("/d/a.bin", "/d/b.bin")
    fs.mv(["/d/a.bin", "/d/b.bin"], ["/e/a.bin", "/e/b.bin"])
    assert fs.ls("/e", detail=False) == ["/e/a.bin", "/e/b.bin"] and not fs.exists("/d/a.bin")

    local = tmp_path / "copy.bin"
    fs.get_file("/e/a.bin", str(local))
    assert local.read_bytes() == DATA
    fs.put_file(str(local), "/f/again.bin")
    assert fs.cat_file("/f/again.bin") == DATA

    fs.makedirs("/g/h", exist_ok=True)
    with pytest.raises(FileExistsError):
        fs.makedirs("/g/h")
    fs.rm("/e", recursive=True)
    assert not fs.exists("/e")


def test_a_write_left_by_an_exception_keeps_the_earlier_version(store_root: Path) -> None:
    fs = _local_fs(store_root)
    fs.pipe_file("/x.bin", b"old")
    with pytest.raises(RuntimeError), fs.open("/x.bin", "wb") as out:
        out.write(b"half of the new")
        raise RuntimeError("the writer died")
    assert fs.cat_file("/x.bin") == b"old"


def test_a_range_after_the_proxy_dropped_the_kept_stream_is_read_anew(store_root: Path) -> None:
    """A proxy cuts a read stream left idle past its socket timeout (a Spark task working
    through its previous block): the next range comes from a new stream, not an error."""
    backing = LocalStore("local://")
    server = StoreServer(
        backing, port=0, token="t0k3n-0123456789", limits=ServerLimits(socket_timeout=1.0)
    ).start()
    try:
        big = DATA * 24  # more than the socket buffers hold
        backing.put("/r/big.bin", big)
        fs, path = store_filesystem(server.uri + "r/big.bin", token="t0k3n-0123456789")
        assert fs.cat_file(path, start=0, end=10) == big[:10]
        time.sleep(3)
        assert fs.cat_file(path, start=20_000_000, end=20_000_010) == big[20_000_000:20_000_010]
        fs.close()
    finally:
        server.shutdown()
        backing.close()


def test_ranges_over_alluxio_read_forward_and_back(store_root: Path) -> None:
    """The proxy has no positioned reads: ranges come from one stream while they move
    forward, and a range behind it, or a replaced file, opens a new one."""
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0, token="t0k3n-0123456789").start()
    try:
        fs, path = store_filesystem(server.uri + "r/x.bin", token="t0k3n-0123456789")
        assert path == "/r/x.bin"
        assert fs.unstrip_protocol(path) == server.uri + "r/x.bin"
        fs.pipe_file(path, DATA)
        step = 100_000
        got = [fs.cat_file(path, start=lo, end=lo + step) for lo in range(0, len(DATA), step)]
        assert b"".join(got) == DATA
        assert fs.cat_file(path, start=7, end=9) == DATA[7:9]  # behind the stream
        assert fs.cat_file(path, start=500_000, end=500_010) == DATA[500_000:500_010]
        fs.pipe_file(path, DATA[::-1])
        assert fs.cat_file(path, start=600_000, end=600_010) == DATA[::-1][600_000:600_010]
        fs.close()
    finally:
        server.shutdown()
        backing.close()


def test_a_replacement_with_the_same_size_and_mtime_is_not_read_from_a_kept_stream(
    store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mtimes are coarse (Alluxio's in ms, S3's in s): a file replaced by one of the same
    size within that time is told apart by its checksum."""
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0).start()
    client = open_store(server.uri)
    stat = client.stat
    monkeypatch.setattr(client, "stat", lambda p: dataclasses.replace(stat(p), mtime=1.0))
    fs = StoreFileSystem.over(client)
    try:
        backing.put("/r/x.bin", DATA)
        assert fs.cat_file("/r/x.bin", start=0, end=10) == DATA[:10]
        backing.put("/r/x.bin", DATA[::-1])
        assert fs.cat_file("/r/x.bin", start=100, end=110) == DATA[::-1][100:110]
    finally:
        fs.close()
        server.shutdown()
        backing.close()


def test_the_kept_stream_of_a_deleted_file_is_closed(store_root: Path) -> None:
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0).start()
    fs, path = store_filesystem(server.uri + "r/x.bin")
    try:
        backing.put("/r/x.bin", DATA)
        assert fs.cat_file(path, start=0, end=10) == DATA[:10]
        assert len(server._streams) == 1  # kept for the next range
        backing.delete("/r/x.bin")
        with pytest.raises(FileNotFoundError, match=r"/r/x\.bin"):
            fs.cat_file(path, start=10, end=20)
        deadline = time.monotonic() + 10
        while server._streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server._streams
    finally:
        fs.close()
        server.shutdown()
        backing.close()


def test_kept_streams_are_closed_when_the_process_ends(store_root: Path) -> None:
    """fsspec keeps a filesystem for the life of the process: its kept streams are closed
    as the process exits, not left on the proxy until they idle out."""
    backing = LocalStore("local://")
    server = StoreServer(backing, port=0).start()
    try:
        backing.put("/r/x.bin", DATA)
        code = (
            "from adcloud.store.filesystem import store_filesystem\n"
            f"fs, path = store_filesystem({server.uri + 'r/x.bin'!r})\n"
            "assert len(fs.cat_file(path, start=0, end=10)) == 10\n"
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
        deadline = time.monotonic() + 10
        while server._streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not server._streams
    finally:
        server.shutdown()
        backing.close()


def test_an_unreachable_proxy_is_an_error_not_a_missing_file() -> None:
    fs, path = store_filesystem("alluxio://127.0.0.1:9/drives/a.bag", timeout=2.0)
    with pytest.raises(OSError, match=r"cannot reach the Alluxio REST proxy at 127\.0\.0\.1:9"):
        fs.exists(path)
    with pytest.raises(BinpipeError, match=r"alluxio://127\.0\.0\.1:9/drives/a\.bag: cannot look"):
        BinPipeRDD.from_bags(None, "alluxio://127.0.0.1:9/drives/a.bag")  # type: ignore[arg-type]


def test_a_store_url_that_cannot_be_opened_is_an_error_naming_it(store_root: Path) -> None:
    """A malformed URL, an option the store does not take, a bad store setting: an error
    that names the URL, not a ValueError or TypeError traceback."""
    with pytest.raises(BinpipeError, match=r"alluxio://127\.0\.0\.1:abc/d/a\.bag: cannot open"):
        summarize("alluxio://127.0.0.1:abc/d/a.bag")
    with pytest.raises(BinpipeError, match=r"alluxio://127\.0\.0\.1:9/d/: cannot open .*root"):
        expand_uris("alluxio://127.0.0.1:9/d/", {"root": str(store_root)})
    with pytest.raises(BinpipeError, match=r"local:///out: cannot open the store: .*tokn"):
        check_save_target("local:///out", storage_options={"tokn": "t0k3n-0123456789"})


def test_a_bag_replaced_in_the_store_after_planning_is_an_error(
    shared_data: Path, store_root: Path
) -> None:
    store = LocalStore("local://")
    store.put("/drives/a.bag", (shared_data / HUSKY).read_bytes())
    parts = plan_partitions("local:///drives/a.bag", partitions_per_bag=2)
    store.put("/drives/a.bag", (shared_data / HUSKY).read_bytes()[:-1000])  # a new upload
    with pytest.raises(BinpipeError, match=r"local:///drives/a\.bag: partition 0: the bag was"):
        list(read_partition(parts[0]))
    store.close()


def _same_messages(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        (x.topic, x.timestamp, x.msgtype, bytes(x.data))
        == (y.topic, y.timestamp, y.msgtype, bytes(y.data))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.spark
def test_binpipe_reads_bags_from_and_saves_into_the_local_store(
    spark: Any, shared_data: Path, store_root: Path
) -> None:
    # Spark's Python workers started before this test's ADCLOUD_STORE_ROOT: name the root
    options = {"root": str(store_root)}
    bag = shared_data / HUSKY
    store = open_store("local://", **options)
    with bag.open("rb") as src, store.open("/drives/husky.bag", "wb") as out:
        out.write(src.read())
    reference = BinPipeRDD.from_bags(spark, str(bag), partitions_per_bag=3).collect_records()

    stored = BinPipeRDD.from_bags(
        spark, "local:///drives/", partitions_per_bag=3, storage_options=options
    )
    assert stored.rdd.getNumPartitions() == 3
    assert _same_messages(stored.collect_records(), reference)

    manifest = stored.save("local:///binpipe/husky", storage_options=options)
    assert manifest["records"] == len(reference)
    assert manifest["source"]["bags"][0]["uri"] == "local:///drives/husky.bag"
    names = [s.name for s in store.list("/binpipe/husky")]
    assert names == [
        "_SUCCESS",
        "manifest.json",
        "part-00000.binpipe",
        "part-00001.binpipe",
        "part-00002.binpipe",
    ]
    assert json.loads(store.get("/binpipe/husky/manifest.json"))["records"] == len(reference)
    loaded = BinPipeRDD.load(spark, "local:///binpipe/husky", storage_options=options)
    assert _same_messages(loaded.collect_records(), reference)

    with pytest.raises(BinpipeError, match=r"local:///binpipe/husky already exists"):
        stored.save("local:///binpipe/husky", storage_options=options)
    stored.filter(lambda m: m.topic == "/imu/data").save(
        "local:///binpipe/husky", overwrite=True, storage_options=options
    )
    again = BinPipeRDD.load(spark, "local:///binpipe/husky", storage_options=options)
    assert {m.topic for m in again.collect_records()} == {"/imu/data"}
    assert not store.exists("/binpipe/husky/_temporary")


@pytest.mark.spark
def test_binpipe_reads_bags_through_an_alluxio_proxy(
    spark: Any, shared_data: Path, store_root: Path
) -> None:
    backing = LocalStore("local://")
    token = "t0k3n-0123456789"
    server = StoreServer(backing, port=0, token=token).start()
    try:
        bag = shared_data / HUSKY
        backing.put("/drives/husky.bag", bag.read_bytes())
        url = server.uri + "drives/husky.bag"
        options = {"token": token}
        reference = BinPipeRDD.from_bags(spark, str(bag), partitions_per_bag=3)
        stored = BinPipeRDD.from_bags(spark, url, partitions_per_bag=3, storage_options=options)
        assert _same_messages(stored.collect_records(), reference.collect_records())
        stored.save(server.uri + "out/husky", storage_options=options)
        assert backing.exists("/out/husky/_SUCCESS")
    finally:
        server.shutdown()
        backing.close()


@pytest.mark.spark
def test_ingest_and_bag_info_take_store_urls(shared_data: Path, store_root: Path) -> None:
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    env = dict(os.environ)  # with this test's ADCLOUD_STORE_ROOT
    subprocess.run(
        [adcloud, "store", "put", str(shared_data / HUSKY), "local:///drives/husky.bag"],
        env=env,
        check=True,
    )
    info = subprocess.run(
        [adcloud, "bag", "info", "local:///drives/husky.bag"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert "/imu/data" in info.stdout
    subprocess.run(
        [
            adcloud,
            "ingest",
            "local:///drives/husky.bag",
            "--out",
            "local:///ingested/husky",
            "--master",
            "local[2]",
            "-q",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    store = LocalStore("local://")
    manifest = json.loads(store.get("/ingested/husky/manifest.json"))
    assert manifest["records"] == 16806


@pytest.mark.spark
def test_the_rosbag_data_source_reads_from_the_store_with_its_options(
    spark: Any, shared_data: Path, store_root: Path
) -> None:
    """``storageOptions`` reach the plan and the tasks: here the store's root, which the
    Python workers (started before this test's ADCLOUD_STORE_ROOT) know no other way."""
    from adcloud.binpipe.datasource import register_rosbag_source  # noqa: PLC0415

    options = {"root": str(store_root)}
    store = open_store("local://", **options)
    store.put("/drives/husky.bag", (shared_data / HUSKY).read_bytes())
    register_rosbag_source(spark)
    df = (
        spark.read.format("rosbag")
        .option("storageOptions", json.dumps(options))
        .option("topics", "/imu/data")
        .load("local:///drives/")
    )
    rows = df.select("bag", "topic").collect()
    reference = BinPipeRDD.from_bags(spark, str(shared_data / HUSKY), topics=["/imu/data"])
    assert len(rows) == reference.count() > 0
    assert {(r.bag, r.topic) for r in rows} == {("local:///drives/husky.bag", "/imu/data")}
