"""The map build end to end on Spark: accuracy, outputs, idempotence, incremental merges,
the files mode, and bad input."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import yaml
from fsspec.implementations.memory import MemoryFileSystem
from pyspark.sql import SparkSession
from scipy.spatial import cKDTree

import adcloud.hdmap.build as build_module
import adcloud.hdmap.job as job_module
import adcloud.hdmap.mapdir as mapdir_module
from adcloud.cli import main
from adcloud.hdmap import HdmapSettings, MapDir, build_map, evaluate_map
from adcloud.hdmap.diff import diff_versions
from adcloud.hdmap.errors import DriveDataError, MapFormatError
from adcloud.hdmap.exchange import load_items
from adcloud.hdmap.geotiff import read_grid_tile, tile_file_name
from adcloud.hdmap.job import PipelineResult, StageSettings, run_pipeline
from adcloud.hdmap.labels import GridLayers, extract_lane_markings, markings_from_paint
from adcloud.hdmap.lanelet import load_lanelet2, routing_graph
from adcloud.hdmap.loops import DriveTies, LoneDrive, LoopSettings, UnplacedDrive
from adcloud.hdmap.mapdir import BuildPlan, Staging
from adcloud.hdmap.semantic import read_geojson
from adcloud.hdmap.tilelayers import TileLayers
from adcloud.hdmap.trajectory import Trajectory
from adcloud.synth import DriveConfig, DriveResult, generate_drive
from tests.device_order import sums_in_any_order
from tests.hdmap.bagedit import without_fix

pytestmark = pytest.mark.spark

SHORT = DriveConfig(
    seconds=12, seed=5, lidar_beams=16, lidar_columns=512, camera=False, truth_raster=False
)
GPS_SHIFT_M = 1.5


@pytest.fixture(scope="module")
def short_drives(tmp_path_factory: pytest.TempPathFactory) -> tuple[DriveResult, DriveResult]:
    """Two drives of the same world: 12 s, and 22 s from the same start (overlapping) whose
    GPS reads 1.5 m north of the first's all along (a receiver biased on another day)."""
    root = tmp_path_factory.mktemp("short")
    (root / "a").mkdir()
    (root / "b").mkdir()
    first = generate_drive(SHORT, root / "a" / "first.bag")
    lat, lon, alt = SHORT.gps_origin
    biased = (lat + GPS_SHIFT_M / 111_000, lon, alt)
    longer = DriveConfig(**{**SHORT.__dict__, "seconds": 22.0, "gps_origin": biased})
    second = generate_drive(longer, root / "b" / "second.bag")
    return first, second


@pytest.fixture(scope="module")
def first_map(
    spark: SparkSession,
    short_drives: tuple[DriveResult, DriveResult],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """The map of the 12 s drive alone, built once with the default settings (the memory
    mode): a test that builds on it works on a copy (:func:`_copy_map`)."""
    first, _ = short_drives
    root = tmp_path_factory.mktemp("first_map") / "map"
    assert build_map(spark, str(first.bag), str(root)).changed
    return root


def _copy_map(src: Path, dst: Path) -> Path:
    """A copy of the map directory ``src`` with its files' times (what :func:`_tree` reads)."""
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _same_markings_as_one_array(result: PipelineResult, root: Path) -> None:
    """The build's label stage (paint found tile by tile on the executors, tiles read as
    needed) gives exactly the markings of the same tiles as one array."""
    assert result.layers is not None
    grid = StageSettings().grid
    view = TileLayers.from_directory(root / "grid", result.layers.keys, grid)
    n = grid.tile_cells
    (kx, ky), keys = view.first_key, result.layers.keys
    w = (max(k[0] for k in keys) - kx + 1) * n
    h = (max(k[1] for k in keys) - ky + 1) * n
    refl, elev = np.full((2, h, w), np.nan, np.float32)
    count = np.zeros((h, w), np.int32)
    for key in keys:
        tile = read_grid_tile(root / "grid" / tile_file_name(key)).tile
        r, c = (key[1] - ky) * n, (key[0] - kx) * n
        refl[r : r + n, c : c + n] = tile.reflectance_mean
        elev[r : r + n, c : c + n] = tile.elevation_mean
        count[r : r + n, c : c + n] = tile.count
    dense = GridLayers(view.origin, grid.resolution, refl, elev, count)
    driven = list(result.trajectories.values())
    expected = extract_lane_markings(dense, driven)
    got = markings_from_paint(view, result.paint, driven)
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(a.points, b.points) and a.type == b.type
        assert a.coverage == b.coverage or (np.isnan(a.coverage) and np.isnan(b.coverage))
    assert view.reads < len(keys)  # only the tiles the lines touch were read


def test_loop_drive_meets_the_accuracy_targets(
    spark: SparkSession,
    loop_drive: DriveResult,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results: list[PipelineResult] = []

    def keep(*args: Any, **kwargs: Any) -> PipelineResult:
        results.append(run_pipeline(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(build_module, "run_pipeline", keep)
    summary = build_map(spark, str(loop_drive.bag), str(tmp_path / "map"))
    assert summary.changed and summary.counts["loop_closures"] >= 1
    version = summary.result.version
    assert version is not None and version.path is not None
    root = version.path
    _same_markings_as_one_array(results[0], root)
    for name in (
        "lanelet2_map.osm",
        "map_projector_info.yaml",
        "pointcloud_map_metadata.yaml",
        "semantic.geojson",
        "report/summary.html",
        "trajectory/loop.tum",
        "trajectory/loop.kitti.txt",
        "grid_elevation.png",
        "settings.json",
    ):
        assert (root / name).is_file(), name
    meta = yaml.safe_load((root / "pointcloud_map_metadata.yaml").read_text())
    pcds = [k for k in meta if k.endswith(".pcd")]
    assert pcds and all((root / "pointcloud_map" / k).is_file() for k in pcds)
    tiles = sorted((root / "grid").glob("*.tif"))
    assert tiles and read_grid_tile(tiles[0]).origin == pytest.approx(
        json.loads((root / "state" / "origin.json").read_text())["origin"]
    )
    result = evaluate_map(str(tmp_path / "map"), loop_drive.truth)
    failed = {m.name: m.value for m in result.metrics if m.passed is not True}
    assert not failed, failed
    assert result.metric("ate_rmse").value < 0.05  # type: ignore[operator]
    lanelets = load_lanelet2(root / "lanelet2_map.osm", version_origin(root))
    assert len(lanelets.laneletLayer) >= 2
    # the loop can be driven round on the map: each lane leads, through the connectors
    # across the intersections, to every other lane of its direction and back
    graph = routing_graph(lanelets)
    direction = {c.id: c.direction for c in read_geojson(root / "semantic.geojson").centerlines}
    lanes = [ll for ll in lanelets.laneletLayer if ll.attributes["adcloud:id"] in direction]
    assert len(lanes) == len(direction) and summary.counts["lanelet_connectors"] >= 2
    for a in lanes:
        for b in lanes:
            ida, idb = a.attributes["adcloud:id"], b.attributes["adcloud:id"]
            if ida != idb and direction[ida] == direction[idb]:
                assert graph.getRoute(a, b) is not None and graph.getRoute(b, a) is not None

    # a second run with the same bag changes nothing at all, from Python or the CLI
    before = _tree(tmp_path / "map")
    again = build_map(spark, str(loop_drive.bag), str(tmp_path / "map"))
    assert not again.changed
    map_arg = ["--map", str(tmp_path / "map")]
    assert main(["hdmap", "build", "--bags", str(loop_drive.bag), *map_arg]) == 0
    assert "up to date (version 000001, 1 drive(s) in the map)" in " ".join(
        capsys.readouterr().out.split()
    )
    # a nightly run over a folder of new bags only, none of them mappable: the map's drive is
    # counted too (it said "0 drive(s) known")
    junk = tmp_path / "incoming" / "junk.bag"
    junk.parent.mkdir()
    junk.write_bytes(b"not a bag at all")
    assert main(["hdmap", "build", "--bags", str(junk.parent), *map_arg, "--skip-bad-bags"]) == 0
    assert "up to date (version 000001, 1 drive(s) in the map)" in " ".join(
        capsys.readouterr().out.split()
    )
    assert _tree(tmp_path / "map") == before
    report = tmp_path / "eval"
    assert (
        main(["hdmap", "eval", *map_arg, "--truth", str(loop_drive.truth), "--report", str(report)])
        == 0
    )
    assert "ate_rmse" in capsys.readouterr().out and (report / "summary.html").is_file()
    assert main(["hdmap", "info", *map_arg]) == 0
    assert "loop" in capsys.readouterr().out


def version_origin(root: Path) -> tuple[float, float, float]:
    lat, lon, alt = json.loads((root / "state" / "origin.json").read_text())["origin"]
    return float(lat), float(lon), float(alt)


def _labels_for(root: Path, tmp_path: Path) -> tuple[np.ndarray, Path]:
    """A label file for the version at ``root``: a person deletes its first lane marking
    and adds a stop sign; returns the deleted marking's points and the file."""
    auto = read_geojson(root / "semantic.geojson")
    assert auto.markings, "the build found no lane marking to delete"
    target = auto.markings[0].points
    lat, lon, alt = version_origin(root)
    data = {
        "type": "FeatureCollection",
        "adcloud:frame": "map",
        "adcloud:origin": {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt},
        "features": [
            {
                "type": "Feature",
                "geometry": {"type": "LineString", "coordinates": target[:, :2].tolist()},
                "properties": {"kind": "lane_marking", "source": "human", "action": "delete"},
            },
            {
                "type": "Feature",
                "id": "stop-1",
                "geometry": {"type": "Point", "coordinates": [5.0, -6.0, 2.0]},
                "properties": {
                    "kind": "traffic_sign",
                    "type": "stop",
                    "facing_yaw_rad": 3.14,
                    "source": "human",
                },
            },
        ],
    }
    path = tmp_path / "fixes.geojson"
    path.write_text(json.dumps(data))
    return target, path


def _holds_labels(root: Path, deleted: np.ndarray) -> None:
    """The published map has the stop sign and no marking where the deleted one was."""
    semantic = read_geojson(root / "semantic.geojson")
    assert "stop-1" in [s.id for s in semantic.signs]
    tree = cKDTree(deleted[:, :2])
    for marking in semantic.markings:
        assert float(tree.query(marking.points[:, :2])[0].min()) > 0.49, marking.id
    kept = read_geojson(root / "labels" / "imported.json")
    assert {s.id for s in kept.signs} == {"stop-1"} and len(kept.markings) == 1


def _labels_without_new_drives(
    first: DriveResult,
    map_uri: str,
    v1: Any,
    label_file: Path,
    deleted: np.ndarray,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Labels given with no new drive make a version of their own -- without Spark -- and
    the same labels again make none."""
    bad = label_file.with_name("bad.geojson")
    bad.write_text('{"type": "FeatureCollection", "adcloud:frame": "map", "features": 3}')
    with pytest.raises(MapFormatError, match=r"bad\.geojson: \"features\" must be a list"):
        build_map(None, str(first.bag), map_uri, labels=str(bad))
    # a dry run reads the label file as the build would, and says what it would change
    args = ["hdmap", "build", "--bags", str(first.bag), "--map", map_uri]
    missing = label_file.with_name("missing.geojson")
    assert main([*args, "--labels", str(missing), "--dry-run"]) == 2
    assert "missing.geojson: no such label file" in " ".join(capsys.readouterr().err.split())
    assert main([*args, "--labels", str(label_file), "--dry-run"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"dry run, nothing written: a new version with the labels of {label_file}" in said
    assert MapDir(map_uri).current().id == v1.id  # type: ignore[union-attr]
    summary = build_map(None, str(first.bag), map_uri, labels=str(label_file))
    assert summary.changed and summary.counts["drives_new"] == 0
    assert summary.counts["labels_imported"] == 2
    version = summary.result.version
    assert version is not None and version.path is not None and version.id != v1.id
    assert [d.name for d in version.manifest.drives] == ["first"]
    _holds_labels(version.path, deleted)
    before = read_geojson(v1.path / "semantic.geojson")
    after = read_geojson(version.path / "semantic.geojson")
    assert len(after.markings) < len(before.markings) or len(after.signs) > len(before.signs)
    for carried in ("trajectory/first.tum", "grid_elevation.png", "pointcloud_map_metadata.yaml"):
        assert (version.path / carried).read_bytes() == (v1.path / carried).read_bytes()
    # the tiles are the first version's own files (links), the rest copies
    tiles = [p.relative_to(v1.path) for p in (v1.path / "grid").glob("*.tif")]
    tiles += [p.relative_to(v1.path) for p in (v1.path / "state" / "tiles").glob("*.npz")]
    assert tiles and all((version.path / rel).samefile(v1.path / rel) for rel in tiles)
    assert not (version.path / "semantic.geojson").samefile(v1.path / "semantic.geojson")
    # the automatic features are kept apart, untouched by the labels
    assert (version.path / "state" / "auto_semantic.geojson").read_bytes() == (
        v1.path / "state" / "auto_semantic.geojson"
    ).read_bytes()
    assert (version.path / "report" / "summary.html").is_file()
    # the same labels again: nothing to do, from Python or the CLI
    assert not build_map(None, str(first.bag), map_uri, labels=str(label_file)).changed
    assert main([*args, "--labels", str(label_file)]) == 0
    assert "the labels are in it already" in " ".join(capsys.readouterr().out.split())
    assert main([*args, "--labels", str(label_file), "--dry-run"]) == 0
    assert "are in the map already" in " ".join(capsys.readouterr().out.split())
    assert MapDir(map_uri).current().id == version.id  # type: ignore[union-attr]


def test_new_drive_is_merged_into_the_previous_version(
    spark: SparkSession,
    short_drives: tuple[DriveResult, DriveResult],
    first_map: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second drive merged into the map; between the two builds a label file is imported
    with no new drive, and the second build keeps the labels. The first version's tile
    statistics are read by the executors, not by the driver."""
    monkeypatch.setenv("COLUMNS", "400")  # long paths on one line each
    first, second = short_drives
    map_uri = str(_copy_map(first_map, tmp_path / "map"))
    v1 = MapDir(map_uri).current()
    assert v1 is not None and v1.path is not None
    assert [d.name for d in v1.manifest.drives] == ["first"]
    v1_files = _tree(v1.path)
    deleted, label_file = _labels_for(v1.path, tmp_path)
    _labels_without_new_drives(first, map_uri, v1, label_file, deleted, capsys)

    def not_on_the_driver(path: Any) -> None:
        raise AssertionError(f"the driver read {path}: executors read the kept tile files")

    # executors import the job module afresh: only the driver's copy refuses
    monkeypatch.setattr(job_module, "load_items", not_on_the_driver)
    # a bag still being uploaded (no index yet, a garbled header) is left for the next night
    partial = tmp_path / "incoming" / "partial.bag"
    partial.parent.mkdir()
    partial.write_bytes(b"#ROSBAG V2.0\n" + bytes(100))
    bags = [str(first.bag), str(second.bag), str(partial)]
    v2 = build_map(spark, bags, map_uri, skip_bad_bags=True)
    monkeypatch.undo()
    assert list(v2.skipped) == [str(partial)] and "partial.bag" in v2.skipped[str(partial)]
    assert v2.counts["drives_new"] == 1  # the first drive is known by its content hash
    version = v2.result.version
    assert version is not None and version.path is not None and version.id != v1.id
    assert sorted(p.name for p in (version.path / "trajectory").glob("*.tum")) == [
        "first.tum",
        "second.tum",
    ]
    assert [d.name for d in version.manifest.drives] == ["first", "second"]
    # the first drive's trajectory is carried over unchanged
    old = Trajectory.read_tum(v1.path / "trajectory" / "first.tum")
    new = Trajectory.read_tum(version.path / "trajectory" / "first.tum")
    np.testing.assert_array_equal(old.matrices, new.matrices)
    # the new drive is tied to the map by loop closures against the first drive's kept
    # keyframes: where both drove the same path, it lies on the first drive's poses, not
    # 1.5 m north where its GPS alone would put it
    assert v2.counts["loop_closures"] >= 3
    second_traj = Trajectory.read_tum(version.path / "trajectory" / "second.tum")
    t = old.t[(old.t >= second_traj.t[0]) & (old.t <= second_traj.t[-1])]
    offset = np.linalg.norm(second_traj.at(t)[:, :3, 3] - old.at(t)[:, :3, 3], axis=1)
    assert len(t) > 100 and float(np.median(offset)) < 0.05 and float(offset.max()) < 0.25
    # ... and the report says how far its GPS read from there (the 1.5 m north it was
    # given, give or take the drives' own GPS errors): a note a maintainer sees, and JSON
    report = version.path / "report"
    ties = json.loads((report / "drive_ties.json").read_text())
    assert list(ties["gps_offsets_m"]) == ["second"] and ties["untied"] == [], ties
    east, north, _ = ties["gps_offsets_m"]["second"]
    assert abs(east) < 0.5 and abs(north - GPS_SHIFT_M) < 0.5, ties
    assert ties["large_gps_offsets"] == ["second"]
    page = " ".join((report / "summary.html").read_text().split())
    assert "LARGE GPS OFFSET: drive second is tied by loop closures" in page
    assert f"({east:+.2f}, {north:+.2f}," in page and "antenna lever arm" in page
    assert [n for n in v2.notes if "LARGE GPS OFFSET: drive second" in n], v2.notes  # the CLI's
    index = json.loads((version.path / "state" / "keyframes" / "index.json").read_text())
    assert sorted(index["drives"]) == ["first", "second"]
    # where both drives went, the map holds each marking and each lane once
    semantic = read_geojson(version.path / "semantic.geojson")
    for lines in (
        [m.points for m in semantic.markings],
        [c.points for c in semantic.centerlines if c.direction == "along"],
        [c.points for c in semantic.centerlines if c.direction == "against"],
    ):
        for k, line in enumerate(lines):
            others = [o for j, o in enumerate(lines) if j != k]
            if not others:
                continue
            d, _ = cKDTree(np.concatenate(others)[:, :2]).query(line[:, :2])
            assert float(np.mean(d < 0.5)) < 0.2, "a line is drawn twice"
    ids = [m.id for m in semantic.markings] + [c.id for c in semantic.centerlines]
    assert len(ids) == len(set(ids))
    # the merged tile statistics hold both drives' observations (the finished layers may
    # drop a cell once more data shows it is not ground, so compare the statistics)
    grew = 0
    for path in sorted((v1.path / "state" / "tiles").glob("*.npz")):
        (before,) = load_items(path)
        (after,) = load_items(version.path / "state" / "tiles" / path.name)
        assert int(after.count.sum()) >= int(before.count.sum())
        grew += int(after.scans.sum() > before.scans.sum())
    assert grew > 0
    assert len(list((version.path / "grid").glob("*.tif"))) >= len(
        list((v1.path / "grid").glob("*.tif"))
    )
    assert _tree(v1.path) == v1_files  # the old version is untouched
    assert MapDir(map_uri).current().id == version.id  # type: ignore[union-attr]
    _holds_labels(version.path, deleted)  # the rebuild kept the labels
    # what the night changed, as `adcloud hdmap diff` reports it: the longer drive's new
    # ground and roads, nothing lost
    change = diff_versions(map_uri)
    assert change.after == version.id and change.drives_added == ("second",)
    tiles = change.tile_counts()
    assert tiles["added"] > 0 and tiles["changed"] > 0 and tiles["removed"] == 0
    assert change.markings_added_m > 5.0 and change.signs_after >= change.signs_before
    _rolled_back(map_uri, version, [first.bag, second.bag, partial], capsys, monkeypatch)


def _rolled_back(
    map_uri: str,
    bad: Any,
    bags: list[Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``adcloud hdmap rollback`` makes the map before the second drive current again, as a
    new version; the nightly build then skips the second drive's bag, without Spark."""
    monkeypatch.setenv("COLUMNS", "400")  # long paths and table cells on one line each
    parent = MapDir(map_uri).version(bad.manifest.parent)
    assert main(["hdmap", "rollback", "--map", map_uri]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"the map of version {parent.id} (was {bad.id})" in out
    assert "held out of later builds: second" in out
    restored = MapDir(map_uri).current()
    assert restored is not None and restored.path is not None and parent.path is not None
    assert restored.manifest.restores == parent.id
    assert [d.name for d in restored.manifest.held_out] == ["second"]
    assert set(restored.files()) == set(parent.files())
    for rel in restored.files():  # the files are the earlier version's own
        if rel != "manifest.json":
            assert (restored.path / rel).samefile(parent.path / rel), rel
    args = ["hdmap", "build", "--bags", *map(str, bags), "--map", map_uri, "--skip-bad-bags"]
    hashed: list[str] = []
    hashing = mapdir_module._content_hash

    def spy(files: Any, path: str, chunk: int, control: Any = None) -> tuple[str, int]:
        hashed.append(Path(path).name)
        return hashing(files, path, chunk, control)

    monkeypatch.setattr(mapdir_module, "_content_hash", spy)
    assert main([*args, "--trust-mtime"]) == 0  # no new drive, no Spark session
    assert hashed == ["partial.bag"]  # the bags the map knows are not read again
    out = " ".join(capsys.readouterr().out.split())
    assert f"skipped {bags[1]}: a rollback held its drive out" in out
    assert f"skipped (--skip-bad-bags; tried again next build): drive {bags[2]}" in out
    assert f"up to date (version {restored.id}" in out
    assert main([*args, "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "held out by a rollback: skipped" in out and "in the map since" in out
    assert "cannot be mapped, skipped (below)" in out and "partial.bag" in out
    assert "dry run, nothing written: up to date" in out
    assert main(["hdmap", "info", "--map", map_uri]) == 0
    out = capsys.readouterr().out
    assert f"a rollback to {parent.id}" in out and "held out by a rollback" in out
    assert f"rollback to {parent.id}" in out and "+ second" in out  # the versions' history
    assert main(["hdmap", "info", "--map", map_uri, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["current"] == restored.id and info["history"][-1]["restores"] == parent.id
    assert [h["added"] for h in info["history"]][-2] == ["second"]
    assert [d["name"] for d in info["manifest"]["held_out"]] == ["second"]
    # the restored map, copied out for Autoware: its four entries, every listed tile
    out = Path(map_uri).parent / "for-autoware"
    assert main(["hdmap", "export", "--map", map_uri, "--out", str(out), "--autoware"]) == 0
    assert f"Autoware loads it with map_path:={out}" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "lanelet2_map.osm",
        "map_projector_info.yaml",
        "pointcloud_map",
        "pointcloud_map_metadata.yaml",
    ]
    meta = yaml.safe_load((out / "pointcloud_map_metadata.yaml").read_text())
    pcds = [k for k in meta if k.endswith(".pcd")]
    assert pcds and all((out / "pointcloud_map" / k).stat().st_nlink == 1 for k in pcds)


def _upload(local: Path, bucket: str) -> str:
    """A copy of the local map directory ``local`` on fsspec's in-memory store (what an
    object store is to a map); returns its path there."""
    fs = fsspec.filesystem("memory")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"/{bucket}/map/{path.relative_to(local).as_posix()}", path.read_bytes())
    return f"{bucket}/map"


def _same_items(a: Path, b: Path) -> bool:
    """Whether two kept statistics files hold the same arrays (zip members carry times)."""
    (x,), (y,) = load_items(a), load_items(b)
    return all(
        np.array_equal(getattr(x, f), getattr(y, f), equal_nan=True)
        for f in x.__dataclass_fields__
        if isinstance(getattr(x, f), np.ndarray)
    )


def test_a_new_drive_rewrites_only_the_tiles_it_reaches(
    spark: SparkSession,
    short_drives: tuple[DriveResult, DriveResult],
    tmp_path: Path,
) -> None:
    """The 22 s drive's map, then the 12 s drive along its first part: the tiles out of the
    new drive's reach are copied into the new version as they are, and hold what a build
    merging every tile again writes."""
    first, second = short_drives
    uri, full_uri = tmp_path / "map", tmp_path / "full"
    v1 = build_map(spark, str(second.bag), str(uri)).result.version
    assert v1 is not None and v1.path is not None
    shutil.copytree(uri, full_uri)
    remote = _upload(uri, f"hdmap-carry-{os.getpid()}-{time.monotonic_ns()}")
    bags = [str(second.bag), str(first.bag)]
    v2 = build_map(spark, bags, str(uri)).result.version

    # the same build merging every tile again
    full = build_map(spark, bags, str(full_uri), HdmapSettings(carry_tiles=False)).result.version
    assert v2 is not None and v2.path is not None and full is not None and full.path is not None
    old, new, again = _tree(v1.path), _tree(v2.path), _tree(full.path)
    tiles = [k for k in old if k.startswith("grid/") and k.endswith(".tif")]
    carried = [k for k in tiles if new[k] == old[k]]  # copies keep their time stamps
    assert 0 < len(carried) < len(tiles)
    assert not [k for k in tiles if again[k] == old[k]]  # the full build wrote every tile
    for rel in carried:
        name = Path(rel).name
        stem = Path(rel).stem
        for same in (rel, f"grid/preview/{stem}.png"):
            assert (v2.path / same).read_bytes() == (full.path / same).read_bytes(), same
        state = f"state/tiles/{stem}.npz"
        assert new[state] == old[state] and _same_items(v2.path / state, full.path / state)
        # the new version shares the old one's files: it takes no disk for what it carried
        for same in (rel, f"grid/preview/{stem}.png", state):
            assert (v2.path / same).samefile(v1.path / same), same
        assert name in {Path(k).name for k in new}
    # the point-cloud map lists every tile, carried or written, and holds each file
    meta = yaml.safe_load((v2.path / "pointcloud_map_metadata.yaml").read_text())
    assert meta == yaml.safe_load((full.path / "pointcloud_map_metadata.yaml").read_text())
    pcds = [k for k in meta if k.endswith(".pcd")]
    assert all((v2.path / "pointcloud_map" / k).is_file() for k in pcds)
    kept_pcds = [k for k in pcds if new[f"pointcloud_map/{k}"] == old[f"pointcloud_map/{k}"]]
    assert kept_pcds and all(
        (v2.path / "pointcloud_map" / k).read_bytes()
        == (full.path / "pointcloud_map" / k).read_bytes()
        for k in kept_pcds
    )
    # the label stage reused what it made of the tiles far from the new drive (their kept
    # results are the old version's files) and labels the map as the full build does
    labels = sorted(k for k in new if k.startswith("state/labels/"))
    assert labels == sorted(k for k in again if k.startswith("state/labels/"))
    reused = [k for k in labels if k in old and (v2.path / k).samefile(v1.path / k)]
    assert 0 < len(reused) < len(labels)
    for rel in ("semantic.geojson", "lanelet2_map.osm", *labels):
        assert (v2.path / rel).read_bytes() == (full.path / rel).read_bytes(), rel
    # the labels still cover the stretch only the first build's drive saw
    end = Trajectory.read_tum(v2.path / "trajectory" / "second.tum").xyz[-20:, :2]
    markings = read_geojson(v2.path / "semantic.geojson").markings
    near = [m for m in markings if cKDTree(end).query(m.points[:, :2])[0].min() < 10]
    assert near

    # The same build of the map on an object store: the parent is downloaded without its
    # tile folders, the build reads only the tiles it merges or labels, the carried ones are
    # copied on the store, and the new version is the same, byte for byte.
    opened: list[str] = []
    store_open = MemoryFileSystem._open

    def spy(self: MemoryFileSystem, path: str, mode: str = "rb", **kw: Any) -> Any:
        opened.append(f"{mode} {self._strip_protocol(path)}")
        return store_open(self, path, mode, **kw)

    batches: list[list[str]] = []
    store_get = MemoryFileSystem.get

    def get_spy(self: MemoryFileSystem, rpath: Any, lpath: Any, **kw: Any) -> Any:
        batches.append(list(rpath) if isinstance(rpath, list) else [rpath])
        return store_get(self, rpath, lpath, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MemoryFileSystem, "_open", spy)
        patch.setattr(MemoryFileSystem, "get", get_spy)
        on_store = build_map(spark, bags, f"memory://{remote}").result.version
    assert on_store is not None and on_store.id == v2.id
    varying = {"manifest.json", "report/summary.html"}
    assert sorted(on_store.files()) == sorted(new)
    differ = [
        rel
        for rel in new
        if rel not in varying and on_store.read_bytes(rel) != (v2.path / rel).read_bytes()
    ]
    assert differ == [] or sums_in_any_order(), differ
    reads = [line.split(" ", 1)[1] for line in opened if line.startswith("rb ")]
    # no file of a version is downloaded twice (its small manifest aside: read to open the
    # version, then with its files)
    twice = {p for p in reads if "/versions/" in p and reads.count(p) > 1}
    assert not {p for p in twice if not p.endswith("/manifest.json")}
    read = set(reads)
    old_tiles = [f"/{remote}/versions/{v1.id}/{k}" for k in old if k.endswith((".npz", ".pcd"))]
    state_read = [p for p in old_tiles if p in read]
    carried_state = [f"/{remote}/versions/{v1.id}/state/tiles/{Path(k).stem}.npz" for k in carried]
    assert not set(carried_state) & read  # carried tiles' statistics: copied, never downloaded
    assert 0 < len(state_read) < len(old_tiles)  # the tiles it merges are downloaded
    # ... together: one batch of every merged tile's statistics, not a request per tile
    tile_batches = [b for b in batches if any("/state/tiles/" in p for p in b)]
    assert len(tile_batches) == 1
    assert {p for p in state_read if "/state/tiles/" in p} == set(tile_batches[0])

    # labels with no new drive: a version of their own on the store, its tiles copied there
    _, label_file = _labels_for(v2.path, tmp_path)
    opened.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MemoryFileSystem, "_open", spy)
        relabelled = build_map(None, bags, f"memory://{remote}", labels=str(label_file))
    v3 = relabelled.result.version
    assert v3 is not None and relabelled.counts["labels_imported"] == 2
    reads = [line.split(" ", 1)[1] for line in opened if line.startswith("rb ")]
    twice = {p for p in reads if "/versions/" in p and reads.count(p) > 1}
    assert not {p for p in twice if not p.endswith("/manifest.json")}
    read = set(reads)
    for rel in on_store.files():
        if rel.startswith(("state/tiles/", "state/cloud/", "pointcloud_map/")):
            assert f"/{remote}/versions/{on_store.id}/{rel}" not in read, rel
            assert v3.read_bytes(rel) == on_store.read_bytes(rel), rel
    assert v3.read_bytes("semantic.geojson") != on_store.read_bytes("semantic.geojson")


def test_files_mode_in_an_s3_bucket_gives_the_same_map(
    spark: SparkSession,
    short_drives: tuple[DriveResult, DriveResult],
    first_map: Path,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """The drive's map built in an S3 bucket (the S3 test server, through s3fs) with the
    stages handing over through files, against the default build on the local disk."""
    first, _ = short_drives
    in_memory = MapDir(str(first_map)).current()  # the default mode's map of the drive
    assert in_memory is not None and in_memory.path is not None
    assert json.loads((in_memory.path / "settings.json").read_text())["hdmap"]["mode"] == "memory"
    s3_map = f"{s3_bucket}/maps/city"
    summary = build_map(spark, str(first.bag), s3_map, HdmapSettings(mode="files"))
    in_s3 = summary.result.version
    assert in_s3 is not None and in_s3.path is None  # nothing of it on the local disk
    assert MapDir(s3_map).current().id == in_s3.id  # type: ignore[union-attr]
    local = _tree(in_memory.path)
    assert sorted(in_s3.files()) == sorted(local)
    assert json.loads(in_s3.read_bytes("settings.json"))["hdmap"]["mode"] == "files"
    # what differs: when and how fast each build ran, and the mode in the settings
    varying = {"manifest.json", "report/summary.html", "settings.json"}
    files = [rel for rel in local if rel not in varying]
    assert len(files) > 100 and any(rel.endswith(".tif") for rel in files)
    if sums_in_any_order():
        # a GPU's float atomics add voxel centroids in whatever order work-items finish,
        # which moves poses by fractions of a millimetre between any two runs
        ta = Trajectory.read_tum(in_memory.path / "trajectory" / "first.tum")
        copy = tmp_path / "first.tum"
        copy.write_bytes(in_s3.read_bytes("trajectory/first.tum"))
        np.testing.assert_allclose(ta.xyz, Trajectory.read_tum(copy).xyz, atol=1e-2)
        return
    # CPUs and NumPy sum in input order and tiles merge exactly: the same drive gives the
    # same map, byte for byte, whichever way the stages hand over and wherever it is kept
    differ = [rel for rel in files if in_s3.read_bytes(rel) != (in_memory.path / rel).read_bytes()]
    assert differ == []


def test_a_bag_without_lidar_fails_and_leaves_the_map_alone(
    spark: SparkSession, short_drives: tuple[DriveResult, DriveResult], tmp_path: Path
) -> None:
    first, _ = short_drives
    map_uri = str(tmp_path / "map")
    settings = HdmapSettings(lidar_topic="/no/such/points")
    with pytest.raises(DriveDataError, match=r"0 LiDAR sweeps on /no/such/points .*/lidar/points"):
        build_map(spark, str(first.bag), map_uri, settings)
    assert MapDir(map_uri).current() is None
    assert not list((tmp_path / "map" / "versions").glob("*")) or all(
        not p.name[0].isdigit() for p in (tmp_path / "map" / "versions").iterdir()
    )


def test_a_dry_run_plans_and_checks_the_bags_without_spark(
    short_drives: tuple[DriveResult, DriveResult],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import adcloud.hdmap.command as command  # noqa: PLC0415

    def no_spark(args: Any) -> None:
        raise AssertionError("a dry run started Spark")

    monkeypatch.setattr(command, "_session", no_spark)
    monkeypatch.setenv("COLUMNS", "250")  # table cells on one line each
    first, second = short_drives
    args = ["hdmap", "build", "--bags", str(first.bag), str(second.bag), "--map"]
    assert main([*args, str(tmp_path / "map"), "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a build now would add to an empty map" in out
    assert out.count("new: built") == 2 and "2 new drive(s) to build" in out
    assert not (tmp_path / "map").exists()  # nothing written, not even the directory
    monkeypatch.setenv("ADCLOUD_HDMAP_LIDAR_TOPIC", "/velodyne_points")
    assert main([*args, str(tmp_path / "map"), "--dry-run"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("cannot be mapped, fails the build (below)") == 2
    assert "0 LiDAR sweeps on /velodyne_points" in out and "topics: /lidar/points" in out
    assert "the build would fail on 2 bag(s)" in out and "error: " in out
    # bags the build would skip are no error (an operator greps a dry run for "error:")
    assert main([*args, str(tmp_path / "map"), "--dry-run", "--skip-bad-bags"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("skipped (--skip-bad-bags; tried again next build): ") == 2
    assert "error" not in out
    # the build itself fails the same way, before Spark starts and before anything is written
    assert main([*args, str(tmp_path / "map")]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "0 LiDAR sweeps on /velodyne_points" in out and "nothing built" in out
    assert not (tmp_path / "map").exists()


def test_the_copy_of_a_remote_parent_version_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A map off the local filesystem is downloaded to read the current version's state;
    that copy (a whole version) is gone when the build ends, here with a failed pipeline.
    No Spark: the pipeline is a stand-in that only looks at what the build handed it."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    uri = f"memory://hdmap-build-{os.getpid()}-{time.monotonic_ns()}/map"
    bags = []
    for i in range(2):
        bags.append(tmp_path / f"d{i}.bag")
        bags[-1].write_bytes(random.Random(i).randbytes(4096))

    def first_version(plan: BuildPlan, staging: Staging) -> None:
        (staging.path / "trajectory").mkdir()
        Trajectory(np.array([0, 10**9]), np.tile(np.eye(4), (2, 1, 1))).write_tum(
            staging.path / "trajectory" / "d0.tum"
        )
        (staging.path / "state").mkdir()
        (staging.path / "state" / "origin.json").write_text('{"origin": [48.0, 11.0, 500.0]}')

    assert MapDir(uri).update([str(bags[0])], first_version).changed
    seen: dict[str, Any] = {}

    class PipelineStoppedError(Exception):
        pass

    def pipeline(spark: Any, new: Any, settings: Any, out: Any, **kw: Any) -> None:
        seen["origin"] = kw["origin"]
        seen["during"] = sorted(p.name for p in temp.iterdir() if p.is_dir())
        raise PipelineStoppedError

    def check(uri: str, topics: Any, *, origin_known: bool, mounts_known: bool) -> None:
        seen["checked"] = (Path(uri).name, origin_known)

    monkeypatch.setattr(build_module, "run_pipeline", pipeline)
    monkeypatch.setattr(build_module, "check_topics", check)  # the bags are random bytes
    with pytest.raises(PipelineStoppedError):
        no_spark: Any = object()  # the stand-in pipeline never uses it
        build_map(no_spark, [str(b) for b in bags], uri)
    assert seen["origin"] == (48.0, 11.0, 500.0)  # read from the downloaded parent
    assert seen["checked"] == ("d1.bag", True)  # so the new drive's GPS is optional
    assert list(temp.iterdir()) == []
    # the parent's copy and the new version's staging (each with its owner file beside it)
    parent, staged = seen["during"]
    assert parent.startswith("hdmap-parent-") and staged.startswith("hdmap-staging-")


def _text(html_file: Path) -> str:
    import re  # noqa: PLC0415

    return " ".join(re.sub(r"<[^>]+>", " ", html_file.read_text()).split())


def test_the_build_report_describes_the_whole_grid(first_map: Path, tmp_path: Path) -> None:
    """A build's summary.html once described only the coarse copies it draws (the tiles
    along the roads): 17 tiles and 4x the observed area for a grid of 35, where the eval
    report of the same version said 35.
    (Reads the module's first map; its eval report goes to tmp_path.)"""
    version = MapDir(str(first_map)).current()
    assert version is not None and version.path is not None
    keys = [tuple(map(int, p.stem.split("_"))) for p in (version.path / "grid").glob("*.tif")]
    xs, ys = [k[0] * 20 for k in keys], [k[1] * 20 for k in keys]
    extent = f"x {min(xs):.1f}..{max(xs) + 20:.1f} m, y {min(ys):.1f}..{max(ys) + 20:.1f} m"
    built = _text(version.path / "report" / "summary.html")
    assert f"grid {len(keys)} tile(s) of 20 m in grid/, cells of 5 cm, {extent}" in built
    drawn = int(built.split("drawn: ")[1].split()[0])
    assert 0 < drawn <= len(keys)
    from adcloud.hdmap.report import write_map_report  # noqa: PLC0415

    whole = _text(write_map_report(version, tmp_path / "eval-report"))
    assert f"grid {len(keys)} tile(s)," in whole and extent in whole


def test_a_drive_far_from_the_maps_is_named_and_labels_beside_it_are_taken(
    spark: SparkSession,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new drive 2 km from the map's drive (another area, or a GPS far off) came within
    the loop-closure search radius of none of its keyframes -- the map's keyframes were
    not even loaded -- and was built on its own GPS alone, silently. The build names it in
    its notes, its report and drive_ties.json, and ``hdmap info`` shows the note. Labels
    beside the new drive, 2 km from the map's earlier drive, are taken (the map's area is
    that of its drives, the new ones included), and the version names the label file.

    A drive without a GPS fix, built with them 2 km east of the map's, was held with its
    start at the map origin, silently; it is named too (:class:`UnplacedDrive`)."""
    monkeypatch.setenv("COLUMNS", "400")  # long paths on one line each
    config = DriveConfig(
        seconds=6, seed=5, lidar_beams=16, lidar_columns=256, camera=False, truth_raster=False
    )
    lat, lon, alt = config.gps_origin
    elsewhere = DriveConfig(**{**config.__dict__, "gps_origin": (lat + 2000 / 111_000, lon, alt)})
    near = generate_drive(config, tmp_path / "near.bag")
    far = generate_drive(elsewhere, tmp_path / "far.bag")
    map_uri = str(tmp_path / "map")
    assert build_map(spark, str(near.bag), map_uri).notes == []  # one drive: nothing to join
    sign = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [5.0, 1994.0, 2.0]},
        "properties": {"kind": "traffic_sign", "type": "stop", "facing_yaw_rad": 0.0},
    }
    labels = tmp_path / "signs.geojson"
    labels.write_text(
        json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": [sign]})
    )
    east = DriveConfig(
        **{**config.__dict__, "seconds": 3, "seed": 6, "gps_origin": (lat, lon + 0.023, alt)}
    )
    blind = without_fix(generate_drive(east, tmp_path / "east.bag").bag, tmp_path / "blind.bag")
    bags = [str(near.bag), str(far.bag), str(blind)]
    summary = build_map(spark, bags, map_uri, labels=str(labels))
    note = LoneDrive("far", LoopSettings().search_radius_m).note()
    unplaced = UnplacedDrive("blind", 0).note()
    assert summary.notes[0] == unplaced and note in summary.notes
    version = summary.result.version
    assert version is not None and version.path is not None
    assert version.manifest.labels == str(labels)
    assert summary.counts["labels_imported"] == 1
    ties = DriveTies.read(version.path / "report" / "drive_ties.json")
    assert LoneDrive("far", 8.0) in ties.alone
    assert ties.unplaced == (UnplacedDrive("blind", 0),)
    html = _text(version.path / "report" / "summary.html")
    assert "drive far is not joined to the map" in html
    assert "drive blind is not placed on the map: it has no GPS fix" in html
    assert main(["hdmap", "info", "--map", map_uri]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"+ far, blind; labels imported from {labels}" in said
    assert f"note: {note}" in said and f"note: {unplaced}" in said
