"""What ``adcloud hdmap build`` checks before Spark starts, without Spark: label files in
another map frame, and new drives for tiles of another layout than the map's (the whole
build on Spark: ``test_build.py``)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import adcloud.hdmap.command as command
from adcloud.cli import main
from adcloud.hdmap import HdmapSettings, MapDir, build_map
from adcloud.hdmap.build import STATE_KEYFRAMES, labels_would_change, plan_build
from adcloud.hdmap.errors import BuildError, HdmapError, MapFormatError
from adcloud.hdmap.job import StageSettings
from adcloud.hdmap.kept import TILE_SETTINGS, tile_settings
from adcloud.hdmap.loops import Keyframe, KeyframeArchive
from adcloud.hdmap.mapdir import BuildPlan, Staging
from adcloud.synth import DriveConfig, DriveResult, generate_drive

#: The map frame's origin of the maps made here.
ORIGIN = (37.3875, -122.0575, 12.0)


@pytest.fixture(scope="module")
def new_bag(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """A real 2 s drive (the build reads its topics before it starts Spark)."""
    config = DriveConfig(
        seconds=2, seed=3, lidar_beams=16, lidar_columns=128, camera=False, truth_raster=False
    )
    return generate_drive(config, tmp_path_factory.mktemp("drive") / "new.bag")


def _map(tmp_path: Path) -> tuple[str, Path]:
    """A map with one version, as a build with the default settings leaves what these
    checks read (its origin, its tiles' settings and its drive's keyframes, from x 0 to
    80 m and y -5 to 40 m), built from a stand-in bag."""
    old = tmp_path / "old.bag"
    old.write_bytes(random.Random(1).randbytes(4096))
    stages = StageSettings.from_settings(HdmapSettings())

    def first_version(plan: BuildPlan, staging: Staging) -> None:
        (staging.path / "state").mkdir()
        (staging.path / "state" / "origin.json").write_text(json.dumps({"origin": ORIGIN}))
        (staging.path / TILE_SETTINGS).write_text(
            json.dumps(tile_settings(stages.grid, stages.cloud))
        )
        keyframes = []
        for k, (x, y) in enumerate([(0.0, -5.0), (40.0, 0.0), (80.0, 40.0)]):
            pose = np.eye(4)
            pose[:2, 3] = x, y
            keyframes.append(Keyframe("old", k, pose, 10.0 * k, np.zeros((0, 3), np.float32)))
        KeyframeArchive.write(staging.path / STATE_KEYFRAMES, keyframes)

    uri = str(tmp_path / "map")
    MapDir(uri).update([old], first_version)
    return uri, old


def _labels(
    tmp_path: Path, origin: tuple[float, float, float], *more: dict[str, Any], name: str = ""
) -> Path:
    """A label file of a stop sign at (5, -6, 2) and the features ``more``."""
    path = tmp_path / (name or f"labels-{origin[0]}.geojson")
    lat, lon, alt = origin
    sign: dict[str, Any] = {
        "type": "Feature",
        "id": "stop-1",
        "geometry": {"type": "Point", "coordinates": [5.0, -6.0, 2.0]},
        "properties": {"kind": "traffic_sign", "type": "stop", "facing_yaw_rad": 3.14},
    }
    data = {
        "type": "FeatureCollection",
        "adcloud:frame": "map",
        "adcloud:origin": {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt},
        "features": [sign, *more],
    }
    path.write_text(json.dumps(data))
    return path


def _line(*xy: tuple[float, float]) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": {"type": "LineString", "coordinates": [[x, y, 0.0] for x, y in xy]},
        "properties": {"kind": "lane_marking", "type": "solid"},
    }


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("far", "said"),
    [
        (
            _line((10.0, 0.0), (5_080.0, 10.0)),  # another map's frame: 5 km east
            "feature 1 (lane_marking): coordinates[1] (5080.0, 10.0) lies 5.0 km outside the "
            "drives of version 000001 (x 0..80 m, y -5..40 m); labels must lie within 1000 m",
        ),
        (
            _line((10.0, 0.0), (1e12, 0.0)),
            "feature 1 (lane_marking): coordinates[1] is [1e+12, 0, 0], beyond any map frame",
        ),
    ],
)
def test_labels_far_off_the_map_are_refused_and_nothing_is_written(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_spark: None,
    far: dict[str, Any],
    said: str,
) -> None:
    """A label file with a line 5 km off the map's drives (or 1e12 m out) was merged into a
    new version, published as a road; the dry run, the build and build_map refuse it,
    naming the file, the feature and the position, and the map stays as it was."""
    uri, old = _map(tmp_path)
    before = _files(Path(uri))
    labels = _labels(tmp_path, ORIGIN, far, name="far.geojson")
    with pytest.raises(HdmapError) as info:
        labels_would_change(plan_build(str(old), uri), str(labels))
    assert str(info.value).startswith(f"{labels}: {said}")
    args = ["hdmap", "build", "--bags", str(old), "--map", uri, "--labels", str(labels)]
    for extra in (["--dry-run"], []):
        assert main([*args, *extra]) == 2
        assert f"error: {labels}: {said}" in " ".join(capsys.readouterr().err.split())
    with pytest.raises(HdmapError) as info:
        build_map(None, str(old), uri, labels=str(labels))
    assert str(info.value).startswith(f"{labels}: {said}")
    assert _files(Path(uri)) == before
    # a road next to the driven ones, 900 m out, is a label the map takes
    beside = _labels(tmp_path, ORIGIN, _line((10.0, 0.0), (-900.0, 0.0)), name="beside.geojson")
    assert labels_would_change(plan_build(str(old), uri), str(beside))


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    def session(args: Any) -> None:
        raise AssertionError("the build started Spark")

    monkeypatch.setattr(command, "_session", session)


def test_labels_of_another_map_frame_are_refused_by_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spark: None
) -> None:
    """The dry run approved them (the map kept no labels yet), and the build then failed
    merging them; both refuse them now, naming the file and the two origins."""
    uri, old = _map(tmp_path)
    elsewhere = _labels(tmp_path, (48.1, 11.5, 520.0))
    differs = r"labels-48\.1\.geojson: the labels' map origin \(48\.1, 11\.5, 520\.0\) .* differs"
    plan = plan_build(str(old), uri)
    with pytest.raises(HdmapError, match=differs + r" from the map's \(37\.3875, -122\.0575"):
        labels_would_change(plan, str(elsewhere))
    args = ["hdmap", "build", "--bags", str(old), "--map", uri, "--labels", str(elsewhere)]
    assert main([*args, "--dry-run"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "differs from the map's" in said and "version 000001's" in said
    assert main(args) == 2
    with pytest.raises(HdmapError, match=differs):
        build_map(None, str(old), uri, labels=str(elsewhere))
    assert MapDir(uri).versions() == ["000001"]
    # labels in the map's frame: the dry run says what the build would do
    here = _labels(tmp_path, ORIGIN)
    assert labels_would_change(plan, str(here))
    assert (
        main(
            ["hdmap", "build", "--bags", str(old), "--map", uri, "--labels", str(here), "--dry-run"]
        )
        == 0
    )
    assert "a new version with the labels of" in " ".join(capsys.readouterr().out.split())


def test_a_map_keeps_its_tile_layout(
    tmp_path: Path,
    new_bag: DriveResult,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_spark: None,
) -> None:
    """``ADCLOUD_HDMAP_TILE_M=40`` on a map of 20 m tiles ran ETL, poses and alignment,
    then failed in every Spark grid task on tiles it cannot merge. Refused before Spark
    starts -- by a dry run too -- naming the map's layout and the build's."""
    uri, old = _map(tmp_path)
    bags = [str(old), str(new_bag.bag)]
    args = ["hdmap", "build", "--bags", *bags, "--map", uri]
    monkeypatch.setenv("ADCLOUD_HDMAP_TILE_M", "40")
    for extra in (["--dry-run"], []):
        assert main([*args, *extra]) == 2
        said = " ".join(capsys.readouterr().err.split())
        assert "hdmap_grid.tile_cells 400 (this build: 800)" in said
        assert "hdmap.tile_m 20 m" in said and "build a new map" in said
    settings = HdmapSettings(tile_m=40.0)
    plan = plan_build(bags, uri, settings=settings)
    with pytest.raises(BuildError, match=r"hdmap_cloud\.tile_size 20\.0 \(this build: 40\.0\)"):
        build_map(None, bags, uri, settings, plan=plan)
    assert MapDir(uri).versions() == ["000001"]
    # the map's own layout: the dry run has a drive to build
    monkeypatch.delenv("ADCLOUD_HDMAP_TILE_M")
    assert main([*args, "--dry-run"]) == 0
    assert "1 new drive(s) to build" in " ".join(capsys.readouterr().out.split())


def test_a_parent_drive_ties_record_it_cannot_read_fails_before_spark(
    tmp_path: Path, new_bag: DriveResult
) -> None:
    """The parent version's ``report/drive_ties.json`` (here of a later format) was read
    after the whole pipeline had run, and the build failed then; it is read first."""
    old = tmp_path / "old.bag"
    old.write_bytes(random.Random(1).randbytes(4096))
    stages = StageSettings.from_settings(HdmapSettings())

    def first_version(plan: BuildPlan, staging: Staging) -> None:
        for folder in ("state", "trajectory", "report"):
            (staging.path / folder).mkdir()
        (staging.path / "state" / "origin.json").write_text(json.dumps({"origin": ORIGIN}))
        (staging.path / TILE_SETTINGS).write_text(
            json.dumps(tile_settings(stages.grid, stages.cloud))
        )
        (staging.path / "report" / "drive_ties.json").write_text('{"format": 3}')

    uri = str(tmp_path / "map")
    MapDir(uri).update([old], first_version)
    # no Spark session: a build that got as far as the pipeline would say it needs one
    with pytest.raises(MapFormatError, match=r"drive_ties\.json: not a record of drive ties"):
        build_map(None, [str(old), str(new_bag.bag)], uri)
    assert MapDir(uri).versions() == ["000001"]


def test_a_build_of_a_map_another_build_holds_fails_before_spark(
    tmp_path: Path, new_bag: DriveResult, no_spark: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second build of one map started Spark (seconds) before its lock refused it."""
    uri, old = _map(tmp_path)
    with MapDir(uri).lock():
        code = main(["hdmap", "build", "--bags", str(old), str(new_bag.bag), "--map", uri])
    assert code == 2
    said = " ".join(capsys.readouterr().err.split())
    assert f"another build of this map is running (pid {os.getpid()}" in said
    assert MapDir(uri).versions() == ["000001"]


def test_a_bag_that_changed_since_it_was_hashed_is_not_built(
    tmp_path: Path, new_bag: DriveResult
) -> None:
    """A nightly build hashed a bag whose copy was still being written, and the copy was
    done by the time the build read it: the map recorded the hash of the partial bytes, and
    the next build took the finished bag for a new drive and built the drive a second time
    (``d3`` and ``d3-ac6a33f4``). A bag that changed since it was hashed is left out now, as
    a bag still being copied is, and the next build takes it whole."""
    uri, old = _map(tmp_path)
    whole = new_bag.bag.read_bytes()
    bag = tmp_path / "incoming" / "new.bag"
    bag.parent.mkdir()
    bag.write_bytes(whole[: len(whole) // 2])
    bags = [str(old), str(bag)]
    plan = plan_build(bags, uri)
    assert [d.size for d in plan.new_drives] == [len(whole) // 2]
    bag.write_bytes(whole)  # the copy finishes
    summary = build_map(None, bags, uri, plan=plan, skip_bad_bags=True)
    assert not summary.changed
    said = summary.skipped[str(bag)]
    assert said.startswith(f"drive {bag}: changed since it was hashed (")
    assert MapDir(uri).versions() == ["000001"]
    # planned again, the bag is the whole one
    assert [d.size for d in plan_build(bags, uri).new_drives] == [len(whole)]


def test_labels_with_no_drive_to_map_on_an_empty_map_say_nothing_was_written(
    tmp_path: Path, new_bag: DriveResult, no_spark: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a map without a version, a label file with only bags the build leaves out: the
    dry run promised "a new version with the labels (no new drive: no Spark)", and the
    build wrote nothing and said "the labels are in it already" -- in a map that does not
    exist. Labels go into a version of the map's drives; both now say there is none."""
    cut = tmp_path / "cut.bag"
    cut.write_bytes(new_bag.bag.read_bytes()[:100_000])  # a copy still being written
    labels = tmp_path / "labels.geojson"
    sign = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [5.0, -6.0, 2.0]},
        "properties": {"kind": "traffic_sign", "type": "stop", "facing_yaw_rad": 3.14},
    }
    labels.write_text(
        json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": [sign]})
    )
    uri = str(tmp_path / "map")
    args = ["hdmap", "build", "--bags", str(cut), "--map", uri, "--labels", str(labels)]
    for extra in (["--dry-run"], []):
        assert main([*args, "--skip-bad-bags", *extra]) == 0
        out = capsys.readouterr().out
        said = " ".join(out.split())
        assert "the map has no version yet and no new drive" in said
        # the console may break the long path anywhere: compare without any white space
        expected = f"the labels of {labels} go into its first version, with its drives"
        assert "".join(expected.split()) in "".join(out.split())
        assert "in it already" not in said and "a new version with the labels" not in said
    assert not Path(uri).exists()
