"""The map job's wiring, without a whole build: stage settings derived from ``hdmap``, the
sign candidates the job ships to the sign stage, tiles written by executors that do not see
the output directory, and the error of a drive without sweeps (the label stage's part of
the grid stage: ``test_tilelayers.py``)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from pyspark.sql import SparkSession

import adcloud.hdmap.job as job_module
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import DriveData
from adcloud.hdmap.errors import DriveDataError, HdmapError
from adcloud.hdmap.exchange import dump_items
from adcloud.hdmap.grid import GridSettings, merge_many_partials, scan_partials
from adcloud.hdmap.job import (
    _MARKER,
    AlignedScan,
    KeptTiles,
    StageSettings,
    _aligned_extras,
    _check_carried,
    _cloud_sink,
    _grid_stage,
    _label_plan,
    _leave_marker,
    _on_one_host,
    _poses,
    _run_sink,
    _sensors,
    _sign_points,
    _with_previous,
    _write_or_ship,
)
from adcloud.hdmap.labels import LabelSettings
from adcloud.hdmap.model import Extrinsics, GpsFixes, ImuSamples, OdomSamples
from adcloud.hdmap.pcmap import (
    PointCloudMapSettings,
    merge_many_cloud_partials,
    scan_cloud_partials,
)
from adcloud.hdmap.signs import SignSettings


def test_point_cloud_tiles_follow_the_grid_tile_size(tmp_path: Path) -> None:
    """Point-cloud and grid tiles of one size: the job drops moving objects from the
    point-cloud map only then. ``hdmap.tile_m`` sets both unless the cloud's is given."""
    settings = HdmapSettings(tile_m=30.0)
    derived = StageSettings.from_settings(settings)
    assert derived.grid.tile_size == pytest.approx(30.0)
    assert derived.cloud.tile_size == derived.grid.tile_size
    assert StageSettings.load(settings, environ={}).cloud.tile_size == pytest.approx(30.0)
    config = tmp_path / "build.yaml"
    config.write_text("hdmap_cloud:\n  voxel_size: 0.2\n")
    loaded = StageSettings.load(settings, file=config, environ={}).cloud
    assert loaded.tile_size == pytest.approx(30.0) and loaded.voxel_size == 0.2
    # what the user gives explicitly is kept, even the default value
    config.write_text("hdmap_cloud:\n  tile_size: 20\n")
    assert StageSettings.load(settings, file=config, environ={}).cloud.tile_size == 20.0
    env = {"ADCLOUD_HDMAP_CLOUD_TILE_SIZE": "25"}
    assert StageSettings.load(settings, environ=env).cloud.tile_size == 25.0


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.spark
@pytest.mark.parametrize("elsewhere", [False, True])
def test_tiles_of_executors_that_do_not_see_the_output_reach_it(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, elsewhere: bool
) -> None:
    """An executor on another host (no shared filesystem) ships its tiles' files to the
    driver, which writes them: the same files as executors writing them in place. With
    executors registered on other hosts the driver fetches them a partition at a time."""
    if elsewhere:
        monkeypatch.setattr(job_module, "_on_one_host", lambda sc: False)
    rng = np.random.default_rng(3)
    xy = rng.uniform(-15.0, 15.0, (20_000, 2))  # ground around the sensor, over 4 tiles
    xyz = np.column_stack([xy, 0.02 * rng.standard_normal(len(xy))])
    intensity = rng.uniform(0.0, 255.0, len(xy)).astype(np.float32)
    sensor = np.array([0.0, 0.0, 1.9])
    grid, cloud = GridSettings(), PointCloudMapSettings(tile_size=20.0)
    sc = spark.sparkContext
    tiles = sc.parallelize(scan_partials(xyz, intensity, grid, sensor_xyz=sensor), 2)
    tiles = tiles.groupByKey().mapValues(lambda parts: merge_many_partials(list(parts)))
    clouds = sc.parallelize(scan_cloud_partials(xyz, intensity, cloud, sensor_xyz=sensor), 2)
    clouds = clouds.groupByKey().mapValues(lambda ps: merge_many_cloud_partials(list(ps)))
    origin = (49.0, 8.4, 110.0)
    outputs = {}
    for where in ("in place", "shipped"):
        out = tmp_path / where.replace(" ", "_")
        token = _leave_marker(out)
        # executors that do not find the driver's token in the output directory
        seen = token if where == "in place" else "another host's view"
        # every tile along the roads: their paint tests and coarse copies run too
        plan = _label_plan({}, frozenset(tiles.keys().collect()), grid, LabelSettings())
        stage = _grid_stage(tiles, out_dir=out, token=seen, origin=origin, plan=plan, grid=grid)
        assert len(stage.patches) == len(stage.overview) == tiles.count() >= 4
        no_patches = sc.broadcast({})
        sink = functools.partial(
            _cloud_sink, out=str(out), token=seen, settings=cloud, grid=grid, patches=no_patches
        )
        entries = _run_sink(clouds, sink, out)
        assert all(e is not None for _, e in entries) and len(entries) == clouds.count()
        assert sorted(k for k, _ in entries) == sorted(clouds.keys().collect())
        files = _files(out)
        assert files.pop(_MARKER) == token.encode()  # the driver removes it after the build
        outputs[where] = files
    in_place, shipped = outputs["in place"], outputs["shipped"]
    assert sorted(shipped) == sorted(in_place)
    assert {name.split("/")[0] for name in in_place} >= {"grid", "pointcloud_map", "state"}
    assert shipped == in_place  # byte for byte


KILLED_TILE_TASK = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from adcloud.hdmap.job import _write_or_ship

    def write(root):
        (root / "tile.pcd").write_bytes(b"x" * 1000)
        Path(sys.argv[2] + ".tmp").write_text(str(root))
        Path(sys.argv[2] + ".tmp").rename(sys.argv[2])
        time.sleep(60)

    _write_or_ship(sys.argv[1], "the driver's token", write)
    """
)


def test_the_tile_directory_of_a_killed_task_is_removed_by_the_next_tile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spark ends the Python worker of an interrupted task (a cancelled job, a speculative
    copy that lost) with SIGKILL: the directory it wrote a tile to, to ship it to the
    driver, is removed by the next tile written on that host."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out, marker = tmp_path / "elsewhere", tmp_path / "writing"  # no driver's marker there
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_TILE_TASK, str(out), str(marker)],
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    left = Path(marker.read_text())
    assert left.parent == temp and (left / "tile.pcd").is_file()

    def write(root: Path) -> str:
        (root / "tile.pcd").write_bytes(b"y")
        return "written"

    assert _write_or_ship(str(out), "the driver's token", write) == (
        "written",
        [("tile.pcd", b"y")],
    )
    assert list(temp.iterdir()) == []


def _aligned(intensity: list[float], z: float = 3.0) -> AlignedScan:
    n = len(intensity)
    xyz = np.column_stack([np.arange(n, dtype=np.float64), np.zeros(n), np.full(n, z)])
    return AlignedScan("d", 0, xyz, np.array(intensity, np.float32), np.array([0.0, 0.0, 1.9]))


def _extras(scans: list[AlignedScan], signs: SignSettings) -> list[tuple[str, object]]:
    return [extra for scan in scans for extra in _aligned_extras(scan, signs=signs)]


def test_sign_candidates_follow_the_sign_stage_threshold() -> None:
    scans = [_aligned([90.0, 115.0, 145.0, 200.0]), _aligned([255.0], z=0.2)]
    extras = _extras(scans, SignSettings(min_intensity=120.0))
    xyz, intensity = _sign_points(extras)
    # down to 10 below the threshold, and never on the road (0.2 m: 1.7 m below the sensor)
    assert sorted(intensity.tolist()) == [115.0, 145.0, 200.0]
    assert xyz.shape == (3, 3) and xyz.dtype == np.float64 and intensity.dtype == np.float32
    _, default = _sign_points(_extras(scans, SignSettings()))
    assert default.tolist() == [200.0]  # from 150 at the default 160
    xyz, intensity = _sign_points(_extras([_aligned([10.0])], SignSettings()))
    assert xyz.shape == (0, 3) and intensity.shape == (0,)
    # every scan's sensor position comes along, for the reach of an incremental build
    np.testing.assert_array_equal(_sensors(extras), [[0.0, 0.0], [0.0, 0.0]])
    assert _sensors([]).shape == (0, 2)


@pytest.mark.spark
def test_a_drive_without_sweeps_names_the_lidar_topic(spark: SparkSession) -> None:
    t = np.array([0, 10**9], np.int64)
    drive = DriveData(
        name="d",
        uri="file:///bags/d.bag",
        extrinsics=Extrinsics(),
        imu=ImuSamples("imu", t, np.zeros((2, 3)), np.zeros((2, 3))),
        odom=OdomSamples(t, np.zeros(2), np.zeros(2)),
        gps=GpsFixes("gps", t, np.zeros((2, 3)), np.ones((2, 3))),
        origin=(48.0, 11.0, 500.0),
    )
    no_scans = spark.sparkContext.parallelize([], 1)
    with pytest.raises(DriveDataError, match=r"d\.bag: no LiDAR sweeps on topic '/velo/points'"):
        _poses(
            no_scans,
            {"d": drive},
            {},
            StageSettings(),
            "",
            lambda _: None,
            lidar_topic="/velo/points",
        )


@pytest.mark.spark
@pytest.mark.parametrize("one_host", [True, False])
def test_kept_tile_files_reach_the_merge(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_host: bool
) -> None:
    """An earlier version's tile statistics, one file per tile, join the new partials: read
    by the executors on the driver's host, by the driver when executors are elsewhere."""
    rng = np.random.default_rng(8)
    xy = rng.uniform(-15.0, 15.0, (5_000, 2))
    xyz = np.column_stack([xy, 0.02 * rng.standard_normal(len(xy))])
    pairs = scan_partials(xyz, None, GridSettings(), sensor_xyz=np.array([0.0, 0.0, 1.9]))
    paths = []
    for key, partial in pairs:
        paths.append(str(tmp_path / f"{key[0]}_{key[1]}.npz"))
        dump_items([partial], paths[-1])
    monkeypatch.setattr(job_module, "_on_one_host", lambda sc: one_host)
    new = spark.sparkContext.parallelize([("new", 1)], 1)
    merged = dict(_with_previous(new, KeptTiles(tuple(paths))).collect())
    assert merged.pop("new") == 1
    assert sorted(merged) == sorted(k for k, _ in pairs)
    for key, partial in pairs:
        assert np.array_equal(merged[key].count, partial.count)
    assert _with_previous(new, KeptTiles()).collect() == [("new", 1)]


def test_executors_count_as_the_drivers_host_only_when_they_are(spark: SparkSession) -> None:
    """Kept tile files are read by executors only on the driver's machine: its own host
    name, or a loopback address; any other host gets them from the driver."""
    assert _on_one_host(spark.sparkContext)  # local mode: the driver alone

    def context(*hosts: str) -> Any:
        infos = [SimpleNamespace(host=h) for h in ("192.0.2.2", *hosts)]
        return SimpleNamespace(
            getConf=lambda: {"spark.driver.host": "192.0.2.2"},
            statusTracker=lambda: SimpleNamespace(getExecutorInfos=lambda: infos),
        )

    assert _on_one_host(context("127.0.0.1", "127.0.0.1"))  # a cluster on this machine
    assert not _on_one_host(context("127.0.0.1", "203.0.113.7"))  # one executor elsewhere


def test_a_tile_both_carried_and_written_fails_the_build() -> None:
    """New points in a tile the build carried unchanged would lose its earlier data: never
    expected (the reach is a superset), and an error naming the tiles if it happens."""
    _check_carried([(0, 0), (1, 0)], frozenset({(5, 5)}), "grid")  # disjoint: fine
    with pytest.raises(HdmapError, match=r"point-cloud tiles \[\(1, 0\)\] got new points"):
        _check_carried([(0, 0), (1, 0)], frozenset({(1, 0), (7, 7)}), "point-cloud")
