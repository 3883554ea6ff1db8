"""``adcloud bag info`` on rosbag2 directories: a storage file that is missing, empty,
truncated or not a rosbag2 database is a :class:`BagError` naming it, as it is to the
reader, while a whole bag summarizes from ``metadata.yaml`` as before."""

from __future__ import annotations

import re
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from adcloud.binpipe.bags import plan_partitions, read_partition, summarize
from adcloud.binpipe.bags_model import BagFormat
from adcloud.binpipe.errors import BagError

from . import bagfactory as bf


@pytest.fixture(scope="session")
def ros2_bags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Whole rosbag2 directories, written once per session (copy before damaging them)."""
    d = tmp_path_factory.mktemp("ros2_health")
    return {
        "sqlite3": bf.write_ros2(d / "sqlite"),
        "sqlite3-zmsg": bf.write_ros2(d / "zmsg", compression_mode="message"),
        "sqlite3-zfile": bf.write_ros2(d / "zfile", compression_mode="file"),
        "split": bf.write_ros2_split(d / "split", parts=3),
        "mcap": bf.write_ros2(d / "mcap", storage="mcap"),
    }


@pytest.fixture
def memfs() -> Iterator[MemoryFileSystem]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/h"):
        fs.rm("/h", recursive=True)


def _copy(ros2_bags: dict[str, Path], name: str, to: Path) -> tuple[Path, Path]:
    """A copy of bag ``name`` at ``to``, and its (first) storage file."""
    shutil.copytree(ros2_bags[name], to)
    return to, sorted(p for p in to.iterdir() if p.name != "metadata.yaml")[0]


def _read_all(bag: Path) -> int:
    return sum(1 for part in plan_partitions(str(bag)) for _ in read_partition(part))


@pytest.mark.parametrize("name", ["sqlite3", "sqlite3-zmsg", "sqlite3-zfile", "split", "mcap"])
def test_a_whole_bag_summarizes_from_its_metadata(ros2_bags: dict[str, Path], name: str) -> None:
    bag = ros2_bags[name]
    s = summarize(str(bag))
    storage = [p for p in bag.iterdir() if p.name != "metadata.yaml"]
    assert s.format is BagFormat.ROS2 and s.indexed
    assert s.message_count == 400 == sum(t.count for t in s.topics)
    assert {t.topic for t in s.topics} == {t for t, _ in bf.TOPICS}
    assert s.size == sum(p.stat().st_size for p in storage) > 0
    assert s.end > s.start > 0


def test_an_empty_db3_is_not_a_healthy_bag(ros2_bags: dict[str, Path], tmp_path: Path) -> None:
    bag, db = _copy(ros2_bags, "sqlite3", tmp_path / "bag")
    db.write_bytes(b"")
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: .*the file is empty"):
        summarize(str(bag))
    with pytest.raises(BagError, match=re.escape(db.name)):
        _read_all(bag)


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.99])
def test_a_truncated_db3_is_not_a_healthy_bag(
    ros2_bags: dict[str, Path], tmp_path: Path, keep: float
) -> None:
    bag, db = _copy(ros2_bags, "sqlite3", tmp_path / "bag")
    data = db.read_bytes()
    db.write_bytes(data[: int(len(data) * keep)])
    # the last pages may hold no rows, so the reader need not notice; the header does
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: .*truncated"):
        summarize(str(bag))


def test_one_truncated_file_of_a_split_bag_is_named(
    ros2_bags: dict[str, Path], tmp_path: Path
) -> None:
    bag, _first = _copy(ros2_bags, "split", tmp_path / "bag")
    last = sorted(bag.glob("*.db3"))[-1]
    last.write_bytes(last.read_bytes()[:-4096])
    with pytest.raises(BagError, match=rf"{re.escape(last.name)}: .*truncated"):
        summarize(str(bag))


def test_a_missing_db3_is_named(ros2_bags: dict[str, Path], tmp_path: Path) -> None:
    bag, db = _copy(ros2_bags, "sqlite3", tmp_path / "bag")
    db.unlink()
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: no such file"):
        summarize(str(bag))


def test_a_db3_without_messages_is_not_a_rosbag2_database(
    ros2_bags: dict[str, Path], tmp_path: Path
) -> None:
    bag, db = _copy(ros2_bags, "sqlite3", tmp_path / "bag")
    db.unlink()
    with sqlite3.connect(db) as other:
        other.execute("CREATE TABLE unrelated (x INTEGER)")
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: .*no such table: messages"):
        summarize(str(bag))
    db.write_bytes(b"not sqlite at all " * 20)
    with pytest.raises(BagError, match=rf"{re.escape(db.name)}: .*no SQLite header"):
        summarize(str(bag))


def test_a_truncated_non_local_db3_is_found_from_its_header(
    ros2_bags: dict[str, Path], memfs: MemoryFileSystem
) -> None:
    src = ros2_bags["sqlite3"]
    for path in src.iterdir():
        data = path.read_bytes()
        memfs.pipe(f"/h/bag/{path.name}", data[: len(data) // 2] if path.suffix == ".db3" else data)
    with pytest.raises(BagError, match=r"\.db3: .*truncated"):
        summarize("memory://h/bag")


def test_a_truncated_mcap_file_is_named(ros2_bags: dict[str, Path], tmp_path: Path) -> None:
    bag, mcap = _copy(ros2_bags, "mcap", tmp_path / "bag")
    mcap.write_bytes(mcap.read_bytes()[:-100])
    with pytest.raises(BagError, match=re.escape(mcap.name)):
        summarize(str(bag))
