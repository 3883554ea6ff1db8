"""``adcloud hdmap``: what the commands print, where, and with which exit status.

The map here holds only a trajectory (the truth's own poses), so no Spark is needed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adcloud.cli import main
from adcloud.hdmap.mapdir import Manifest, MapDir
from adcloud.synth import DriveConfig, generate_drive


@pytest.fixture(scope="module")
def traj_map(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a map whose one version holds the drive's true trajectory, the drive's truth)."""
    root = tmp_path_factory.mktemp("traj_map")
    drive = generate_drive(
        DriveConfig(seconds=5, seed=11, lidar=False, camera=False), root / "t.bag"
    )
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
