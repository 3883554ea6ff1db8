"""Intermediates handed between build stages: in memory, or through fsync'ed files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import SparkSession

from adcloud.hdmap.errors import MapFormatError
from adcloud.hdmap.exchange import Exchange, dump_items, load_items
from adcloud.hdmap.model import Scan


def _scan(i: int) -> Scan:
    rng = np.random.default_rng(i)
    return Scan(
        drive="d",
        stamp=i,
        frame="lidar",
        xyz=rng.normal(size=(10, 3)).astype(np.float32),
        intensity=np.arange(10, dtype=np.float32),
        dt=np.zeros(10, np.float32),
        label=None,
    )


def test_items_round_trip_without_pickle(tmp_path: Path) -> None:
    items = [(("d", 3), _scan(3)), {"k": [1, 2.5, None, "s"]}, np.arange(4)]
    assert dump_items(items, tmp_path / "x.npz") == 3
    back = load_items(tmp_path / "x.npz")
    assert back[0][0] == ("d", 3) and isinstance(back[0][1], Scan)
    np.testing.assert_array_equal(back[0][1].xyz, items[0][1].xyz)  # type: ignore[index]
    assert back[1] == {"k": [1, 2.5, None, "s"]}
    np.testing.assert_array_equal(back[2], np.arange(4))
    with np.load(tmp_path / "x.npz", allow_pickle=False) as z:  # nothing needs pickle
        assert "header" in z.files


def test_foreign_classes_and_garbage_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot store a object"):
        dump_items([object()], tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(MapFormatError, match=r"junk\.npz"):
        load_items(tmp_path / "junk.npz")
    # a real exchange file cut short (a copy interrupted): the zip directory is gone
    dump_items([np.arange(1000)], tmp_path / "cut.npz")
    data = (tmp_path / "cut.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(MapFormatError, match=r"cut\.npz: cannot read"):
        load_items(tmp_path / "cut.npz")


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["memory", "files"])
def test_both_modes_hand_over_the_same_items(
    spark: SparkSession, tmp_path: Path, mode: str
) -> None:
    exchange = Exchange(mode, tmp_path / "x")
    rdd = spark.sparkContext.parallelize(range(6), 3).map(_scan)
    out = exchange.hand_over(rdd, "scans").map(lambda s: (s.stamp, float(s.xyz.sum()))).collect()
    want = [(i, float(_scan(i).xyz.sum())) for i in range(6)]
    assert sorted(out) == sorted(want)
    files = sorted((tmp_path / "x" / "scans").glob("*.npz")) if mode == "files" else []
    assert len(files) == (3 if mode == "files" else 0)
    exchange.release()


def _odd_stamps(scan: Scan) -> list[int]:
    return [scan.stamp] if scan.stamp % 2 == 1 else []


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["memory", "files"])
def test_what_is_gathered_comes_with_the_stage_in_one_pass(
    spark: SparkSession, tmp_path: Path, mode: str
) -> None:
    """``hand_over_gathering`` collects small products of a stage's items on the driver in
    the job that materialises the stage: its items are computed once, and the next stage
    reads them from memory or the files without computing them again."""
    sc = spark.sparkContext
    computed = sc.accumulator(0)

    def make(i: int) -> Scan:
        computed.add(1)
        return _scan(i)

    exchange = Exchange(mode, tmp_path / "x")
    group = f"gathering-{mode}"
    sc.setJobGroup(group, "hand_over_gathering")
    try:
        rdd = sc.parallelize(range(8), 4).map(make)
        stage, gathered = exchange.hand_over_gathering(rdd, "s", _odd_stamps)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert len(sc.statusTracker().getJobIdsForGroup(group)) == 1  # one Spark job for both
    assert sorted(gathered) == [1, 3, 5, 7]
    assert computed.value == 8
    assert sorted(s.stamp for s in stage.collect()) == list(range(8))
    assert computed.value == 8  # read back, not computed again
    exchange.release()


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["memory", "files"])
def test_a_stage_no_later_stage_reads_is_dropped_and_the_rest_stays(
    spark: SparkSession, tmp_path: Path, mode: str
) -> None:
    """``drop`` frees a memory-mode stage once the next one is materialised (the heap a
    small executor needs for the following shuffle); the next stage stays cached, and in
    files mode both stages' files stay where they are."""
    exchange = Exchange(mode, tmp_path / "x")
    first = exchange.hand_over(spark.sparkContext.parallelize(range(6), 3).map(_scan), "scans")
    second = exchange.hand_over(first.map(lambda s: s.stamp * 2), "stamps")
    exchange.drop(first)
    assert sorted(second.collect()) == [0, 2, 4, 6, 8, 10]
    if mode == "memory":
        assert not first.is_cached and second.is_cached
        assert exchange.cached == [second]
    else:
        assert len(list((tmp_path / "x" / "scans").glob("*.npz"))) == 3
        assert len(list((tmp_path / "x" / "stamps").glob("*.npz"))) == 3
    exchange.release()
    assert not second.is_cached


@pytest.mark.spark
def test_release_deletes_the_stage_folders_but_not_the_users_directory(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A user's ``exchange_dir`` keeps only what was there before: the stage folders the
    exchange made go, and in a stage folder it found only the files it wrote go."""
    root = tmp_path / "exchange"
    (root / "stamps").mkdir(parents=True)
    (root / "notes.txt").write_text("mine")
    (root / "stamps" / "keep.npz").write_text("mine too")
    exchange = Exchange("files", root)
    scans = exchange.hand_over(spark.sparkContext.parallelize(range(4), 2).map(_scan), "scans")
    stamps = exchange.hand_over(scans.map(lambda s: s.stamp), "stamps")
    assert sorted(stamps.collect()) == [0, 1, 2, 3]
    assert len(list((root / "stamps").glob("part-*.npz"))) == 2
    exchange.release()
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "notes.txt",
        "stamps",
        "stamps/keep.npz",
    ]
