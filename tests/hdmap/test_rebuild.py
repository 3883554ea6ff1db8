"""A rebuild of unchanged drives gives the same map, byte for byte, however Spark happened
to split and deliver the work: users diff nightly versions (``adcloud hdmap diff``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

import adcloud.hdmap.job as job_module
from adcloud.hdmap import build_map
from adcloud.synth import DriveConfig, DriveResult, generate_drive
from tests.device_order import sums_in_any_order

pytestmark = pytest.mark.spark

BRIEF = DriveConfig(
    seconds=6, seed=5, lidar_beams=16, lidar_columns=512, camera=False, truth_raster=False
)


@pytest.fixture(scope="module")
def brief_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """A 6 s drive: enough sweeps for a few dozen point-cloud tiles, built in seconds."""
    return generate_drive(BRIEF, tmp_path_factory.mktemp("brief") / "brief.bag")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_rebuild_split_otherwise_writes_the_same_tiles(
    spark: SparkSession,
    brief_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same drive built from one bag split into 1 MiB and into 64 MiB partitions: each
    tile's partials meet the merge in other groups and another order (as on a cluster,
    where the shuffle delivers map outputs in a new order every run), and the tiles, their
    kept statistics and what derives from them are the same bytes.

    Merging a key's buffered partials after every row (as a long drive's tiles are, once
    they pass ``_COMPACT_ROWS``) makes the grouping follow the partitions: float64 sums
    grouped otherwise differed in their last bits in most point-cloud tiles."""
    if sums_in_any_order():
        pytest.skip("a GPU's float atomics sum each scan's voxels in another order every run")
    monkeypatch.setattr(job_module, "_COMPACT_ROWS", 1)
    maps: dict[int, dict[str, bytes]] = {}
    for split in (64 << 20, 1 << 20):
        monkeypatch.setattr(job_module, "_PARTITION_BYTES", split)
        version = build_map(spark, str(brief_drive.bag), str(tmp_path / str(split))).result.version
        assert version is not None and version.path is not None
        maps[split] = _files(version.path)
    one, many = maps.values()
    assert one.keys() == many.keys()
    clouds = [rel for rel in one if rel.startswith(("pointcloud_map/", "state/cloud/"))]
    assert len(clouds) > 10
    # what differs: when each build ran (the manifest and the report's date)
    varying = {"manifest.json", "report/summary.html"}
    differ = [rel for rel in one if rel not in varying and one[rel] != many[rel]]
    assert differ == []
