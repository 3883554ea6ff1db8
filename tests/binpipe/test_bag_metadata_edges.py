"""Bags whose own description disagrees with their data: rosbag2 ``metadata.yaml`` that is
missing, empty, stale or lists other topics than the storage holds, and MCAP summaries
without message indexes, chunk indexes or statistics.  What the index promises (counts,
times) must be what the reader delivers, or the summary must say it does not know."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from mcap.writer import IndexType
from mcap.writer import Writer as McapWriter
from rosbags.rosbag2 import StoragePlugin
from rosbags.rosbag2 import Writer as Ros2Writer

from adcloud.binpipe.bags import plan_partitions, read_partition, summarize
from adcloud.binpipe.errors import BagError

from . import bagfactory as bf


@pytest.fixture(scope="module")
def sqlite_bag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole rosbag2 sqlite3 bag of the drive (copy it before changing it)."""
    return bf.write_ros2(tmp_path_factory.mktemp("meta_edges") / "bag")


def _edited(src: Path, to: Path, edit: Any) -> Path:
    """A copy of the rosbag2 bag ``src`` at ``to`` whose metadata ``edit(info)`` changed."""
    shutil.copytree(src, to)
    meta = to / "metadata.yaml"
    doc = yaml.safe_load(meta.read_text())
    edit(doc["rosbag2_bagfile_information"])
    meta.write_text(yaml.safe_dump(doc))
    return to


def _read(uri: Path, **kw: Any) -> tuple[int, int]:
    """(messages the plan counts, messages read) of the bag at ``uri``."""
    parts = plan_partitions(str(uri), **kw)
    return sum(p.message_count for p in parts), sum(1 for p in parts for _ in read_partition(p))


# ------------------------------------------------------------------------------ rosbag2


@pytest.mark.parametrize("k", [None, 3])
def test_a_topic_metadata_does_not_list_is_neither_counted_nor_read(
    sqlite_bag: Path, tmp_path: Path, k: int | None
) -> None:
    def drop_imu(info: dict[str, Any]) -> None:
        info["topics_with_message_count"] = [
            t for t in info["topics_with_message_count"] if t["topic_metadata"]["name"] != "/imu"
        ]

    bag = _edited(sqlite_bag, tmp_path / "bag", drop_imu)
    assert _read(bag, partitions_per_bag=k) == (300, 300)
    topics = {m.topic for p in plan_partitions(str(bag)) for m in read_partition(p)}
    assert topics == {"/pose", "/status", "/count"}


def test_a_topic_metadata_lists_with_another_type_is_not_counted(
    sqlite_bag: Path, tmp_path: Path
) -> None:
    def retype(info: dict[str, Any]) -> None:
        for t in info["topics_with_message_count"]:
            if t["topic_metadata"]["name"] == "/count":
                t["topic_metadata"]["type"] = "std_msgs/msg/Int64"

    bag = _edited(sqlite_bag, tmp_path / "bag", retype)
    assert _read(bag) == (300, 300)


def test_metadata_counting_no_message_of_a_bag_that_has_some(
    sqlite_bag: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a recorder killed before it wrote the final metadata.yaml leaves zero counts
    def zero(info: dict[str, Any]) -> None:
        info["message_count"] = 0
        info["duration"]["nanoseconds"] = 0
        for t in info["topics_with_message_count"]:
            t["message_count"] = 0

    bag = _edited(sqlite_bag, tmp_path / "bag", zero)
    with caplog.at_level(logging.WARNING, logger="adcloud.binpipe._ros2"):
        s = summarize(str(bag))
    assert "ros2 bag reindex" in caplog.text
    times = sorted(m.time for m in bf.drive())
    assert s.message_count == 400
    assert (s.start, s.end) == (times[0], times[-1] + 1)
    assert {t.topic: t.count for t in s.topics} == {t: 100 for t, _ in bf.TOPICS}
    assert _read(bag) == (400, 400)


def test_metadata_listing_no_storage_file_is_an_error(sqlite_bag: Path, tmp_path: Path) -> None:
    def no_files(info: dict[str, Any]) -> None:
        info["relative_file_paths"] = []

    bag = _edited(sqlite_bag, tmp_path / "bag", no_files)
    for call in (summarize, plan_partitions):
        with pytest.raises(BagError, match=r"counts 400 messages but lists no storage file"):
            call(str(bag))


@pytest.mark.parametrize("text", ["", "just a string\n", "rosbag2_bagfile_information: 3\n"])
def test_empty_or_foreign_metadata_yaml_says_what_to_do(
    sqlite_bag: Path, tmp_path: Path, text: str
) -> None:
    bag = tmp_path / "bag"
    shutil.copytree(sqlite_bag, bag)
    (bag / "metadata.yaml").write_text(text)
    with pytest.raises(BagError, match=r"no rosbag2_bagfile_information.*ros2 bag reindex"):
        summarize(str(bag))


def test_a_missing_metadata_field_is_named(sqlite_bag: Path, tmp_path: Path) -> None:
    def drop(info: dict[str, Any]) -> None:
        del info["message_count"]

    bag = _edited(sqlite_bag, tmp_path / "bag", drop)
    with pytest.raises(BagError, match=r"it has no field 'message_count'"):
        plan_partitions(str(bag))


def test_a_directory_without_metadata_names_its_storage_and_the_fix(
    sqlite_bag: Path, tmp_path: Path
) -> None:
    bag = tmp_path / "my bag"
    shutil.copytree(sqlite_bag, bag)
    (bag / "metadata.yaml").unlink()
    db = next(bag.glob("*.db3"))
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}.*ros2 bag reindex") as info:
        summarize(str(bag))
    assert str(bag) in str(info.value)
    assert _read(db) == (400, 400)  # the storage file read by its own path, as suggested
    (tmp_path / "nothing").mkdir()
    with pytest.raises(BagError, match=r"without metadata\.yaml is not a rosbag2 bag$"):
        summarize(str(tmp_path / "nothing"))


def test_a_storage_file_metadata_lists_but_is_gone_is_named_when_planning(
    sqlite_bag: Path, tmp_path: Path
) -> None:
    bag = tmp_path / "bag"
    shutil.copytree(sqlite_bag, bag)
    db = next(bag.glob("*.db3"))
    db.unlink()
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: no such file"):
        plan_partitions(str(bag))


# --------------------------------------------------------------------------------- MCAP


def _mcap(path: Path, n: int = 400, **options: Any) -> Path:
    """A bare MCAP file of the drive written with the mcap writer's ``options``."""
    with path.open("wb") as out:
        writer = McapWriter(out, chunk_size=4096, **options)
        writer.start(profile="ros2", library="adcloud-tests")
        channels = {}
        for topic, typ in bf.TOPICS:
            msgdef, _ = bf.ROS2.generate_msgdef(typ, ros_version=2)
            schema = writer.register_schema(name=typ, encoding="ros2msg", data=msgdef.encode())
            channels[topic] = writer.register_channel(
                topic=topic, message_encoding="cdr", schema_id=schema
            )
        for seq, m in enumerate(bf.drive(n)):
            writer.add_message(
                channel_id=channels[m.topic],
                log_time=m.time,
                publish_time=m.time,
                sequence=seq,
                data=bf.serialize_cdr(m),
            )
        writer.finish()  # type: ignore[no-untyped-call]
    return path


def test_mcap_without_message_indexes_counts_topics_from_its_statistics(tmp_path: Path) -> None:
    path = _mcap(tmp_path / "d.mcap", index_types=IndexType.CHUNK)
    s = summarize(str(path))
    assert s.message_count == 400 and s.indexed
    assert {t.topic: t.count for t in s.topics} == {t: 100 for t, _ in bf.TOPICS}
    span = (s.end - s.start) / 1e9
    assert all(t.frequency == pytest.approx(99 / span) for t in s.topics)
    assert _read(path)[1] == 400


def test_mcap_without_chunk_index_or_statistics_is_summarized_as_unindexed(
    tmp_path: Path,
) -> None:
    path = _mcap(tmp_path / "d.mcap", index_types=IndexType.NONE, use_statistics=False)
    s = summarize(str(path))
    assert not s.indexed
    assert (s.start, s.end, s.duration, s.message_count, s.compression) == (0, 0, 0, 0, "")
    assert _read(path)[1] == 400  # the reader still finds every message
    # with statistics, the same file is indexed enough to summarize
    path = _mcap(tmp_path / "s.mcap", index_types=IndexType.NONE)
    s = summarize(str(path))
    assert s.indexed and s.message_count == 400 and s.end > s.start > 0


def test_mcap_storage_of_a_bag_without_messages_plans_no_partition(tmp_path: Path) -> None:
    # rosbags' MCAP writer puts the channels into a chunk without message index records
    bag = tmp_path / "bag"
    with Ros2Writer(bag, version=9, storage_plugin=StoragePlugin.MCAP) as writer:
        for topic, typ in bf.TOPICS:
            writer.add_connection(topic, typ, typestore=bf.ROS2)
    assert plan_partitions(str(bag)) == []
    assert plan_partitions(str(bag), partitions_per_bag=4) == []
    assert summarize(str(bag)).message_count == 0
