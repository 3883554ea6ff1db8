"""``adcloud hdmap``: what the commands print, where, and with which exit status.

The map here holds only a trajectory (the truth's own poses), so no Spark is needed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from adcloud.cli import main
from adcloud.hdmap.loops import DriveTies, LoneDrive
from adcloud.hdmap.mapdir import DriveRecord, Manifest, MapDir
from adcloud.synth import DriveConfig
from tests.drives import shared_drive


@pytest.fixture(scope="module")
def traj_map(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a map whose one version holds the drive's true trajectory, the drive's truth)."""
    root = tmp_path_factory.mktemp("traj_map")
    config = DriveConfig(seconds=5, seed=11, lidar=False, camera=False)
    drive = shared_drive(config, root / "t.bag", tmp_path_factory)
    mapdir = MapDir(root / "map")
    with mapdir.begin(None) as staged:
        (staged.path / "trajectory").mkdir()
        shutil.copy(Path(drive.truth) / "poses.txt", staged.path / "trajectory" / "t.tum")
        staged.commit(Manifest())
    return root / "map", Path(drive.truth)


def test_eval_json_with_a_report_keeps_stdout_json(
    traj_map: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json --report DIR`` printed "report: DIR/summary.html" after the JSON on stdout,
    so ``json.load`` of the output failed."""
    map_dir, truth = traj_map
    argv = ["hdmap", "eval", "--map", str(map_dir), "--truth", str(truth), "--json"]
    code = main([*argv, "--report", str(tmp_path / "rep")])
    out, err = capsys.readouterr()
    assert code == 1  # no grid, no semantic layer: targets not evaluated
    assert json.loads(out)["drive"] == "t"
    assert f"report: {tmp_path / 'rep' / 'summary.html'}" in err
    assert (tmp_path / "rep" / "summary.html").is_file()


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_info_of_a_map_that_is_not_there_is_an_error(
    tmp_path: Path, json_flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed its message on stdout (in place of the JSON with --json), wrapped over two
    lines, and exited 1 as for a verdict; now it is one error line on stderr, exit 2."""
    code = main(["hdmap", "info", "--map", str(tmp_path / "typo"), *json_flag])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("error: ") and "typo: no map there (nothing at that path)" in err


def test_info_json_of_a_map(
    traj_map: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["hdmap", "info", "--map", str(traj_map[0]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["current"] == "000001"


def test_info_json_has_the_same_fields_on_every_map(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``info --json`` gave the manifest as its file has it: ``held_out``, ``restores`` and
    ``labels`` were there only once a rollback or a label import had happened, so a nightly
    script reading ``info["manifest"]["held_out"]`` failed with a KeyError on every map
    built by builds alone."""
    drive = DriveRecord(name="d1", uri="/bags/d1.bag", sha256="ab" * 32, size=1)
    other = DriveRecord(name="d2", uri="/bags/d2.bag", sha256="cd" * 32, size=1)
    mapdir = MapDir(tmp_path / "map")
    keys = []
    for manifest in (
        Manifest(drives=(drive,)),
        Manifest(drives=(drive, other)),
        None,  # a rollback: d2 held out
        Manifest(drives=(drive,), labels="/labels/fixes.geojson"),
    ):
        if manifest is None:
            mapdir.roll_back()
        else:
            with mapdir.begin(mapdir.current()) as staged:
                staged.commit(manifest)
        assert main(["hdmap", "info", "--map", str(tmp_path / "map"), "--json"]) == 0
        keys.append(json.loads(capsys.readouterr().out)["manifest"])
    assert [sorted(k) for k in keys] == [sorted(keys[-1])] * 4
    assert keys[0]["held_out"] == [] and keys[0]["restores"] is None and keys[0]["labels"] is None
    assert [d["name"] for d in keys[2]["held_out"]] == ["d2"] and keys[2]["restores"] == "000001"


def test_info_marks_label_imports_and_drives_joined_to_no_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``info`` showed every version without a new drive as "labels" -- not which file --
    and a build of drives and labels as its drives alone; and it said nothing of a drive
    that no loop closure could tie to the others. It names the label file of each import
    and lists the current version's drive-tie concerns (with --json too)."""
    monkeypatch.setenv("COLUMNS", "300")  # one line per row
    drive = DriveRecord(name="far", uri="/bags/far.bag", sha256="ab" * 32, size=1)
    known = dataclasses.replace(drive, added_in="000001")
    mapdir = MapDir(tmp_path / "map")
    manifests = [
        Manifest(drives=(drive,), labels="/labels/first.geojson"),
        Manifest(drives=(known,), labels="/labels/fixes.geojson"),
        Manifest(drives=(known,)),  # by a build that did not record its file
    ]
    for manifest in manifests:
        with mapdir.begin(mapdir.current()) as staged:
            (staged.path / "report").mkdir()
            ties = DriveTies(alone=(LoneDrive("far", 8.0),), gps_offsets={"b": (0.1, 0, 0)})
            (staged.path / "report" / "drive_ties.json").write_text(ties.to_json())
            staged.commit(manifest)
    assert main(["hdmap", "info", "--map", str(tmp_path / "map")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "│" in line]
    by_version = {row.split("│")[1].strip(" *"): row.split("│")[5].strip() for row in rows}
    assert by_version["000001"] == "+ far; labels imported from /labels/first.geojson"
    assert by_version["000002"] == "labels imported from /labels/fixes.geojson"
    assert by_version["000003"] == "labels imported (file not recorded)"
    assert main(["hdmap", "info", "--map", str(tmp_path / "map"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [row["labels"] for row in info["history"]] == [
        "/labels/first.geojson",
        "/labels/fixes.geojson",
        None,
    ]
    # the concerns only: not the GPS offset of a tied drive that reads as expected
    assert info["notes"] == [LoneDrive("far", 8.0).note()]
    main(["hdmap", "info", "--map", str(tmp_path / "map")])
    said = " ".join(capsys.readouterr().out.split())
    assert "note: drive far is not joined to the map's other drives" in said
    assert "drive b is tied" not in said
