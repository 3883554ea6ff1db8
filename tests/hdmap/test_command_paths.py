"""``adcloud hdmap`` with the paths people type: ``~`` left in by the shell (quoted, or
``--out=~/x``), a mistyped map path, a storage that cannot be opened here."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from adcloud.cli import main
from adcloud.hdmap.diff import diff_versions
from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.mapdir import Manifest, MapDir
from adcloud.synth import DriveConfig
from tests.drives import shared_drive


@pytest.fixture(scope="module")
def traj_map(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a map whose one version holds a drive's true trajectory, the drive's truth)."""
    root = tmp_path_factory.mktemp("traj_map")
    config = DriveConfig(seconds=5, seed=11, lidar=False, camera=False)
    drive = shared_drive(config, root / "t.bag", tmp_path_factory)
    with MapDir(root / "map") as mapdir, mapdir.begin(None) as staged:
        (staged.path / "trajectory").mkdir()
        shutil.copy(Path(drive.truth) / "poses.txt", staged.path / "trajectory" / "t.tum")
        staged.commit(Manifest())
    return root / "map", Path(drive.truth)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of its own, and a working directory apart from it."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return home


def test_export_to_a_path_in_the_home_directory_says_where_it_went(
    traj_map: tuple[Path, Path], home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The export was written to ~/exp, and the command then failed (exit 2, "~/exp/
    manifest.json: No such file or directory") counting the files under ./~/exp: run
    again, it refused the directory it had filled."""
    map_dir, _ = traj_map
    assert main(["hdmap", "export", "--map", str(map_dir), "--out=~/exp"]) == 0
    out = "".join(capsys.readouterr().out.split())  # the console folds a long path anywhere
    assert (home / "exp" / "trajectory" / "t.tum").is_file()
    assert f"copiedto{home / 'exp'}" in out
    assert not (Path.cwd() / "~").exists()


def test_eval_writes_its_metrics_to_a_path_in_the_home_directory(
    traj_map: tuple[Path, Path], home: Path
) -> None:
    """``--out ~/m.json`` was refused ("no directory <cwd>/~ to write the metrics in"),
    though ``--report ~/rep`` of the same command was written to the home directory."""
    map_dir, truth = traj_map
    argv = ["hdmap", "eval", "--map", str(map_dir), "--truth", str(truth)]
    assert main([*argv, "--out=~/m.json", "--report=~/rep"]) == 1  # no grid: not passed
    assert json.loads((home / "m.json").read_text())["drive"] == "t"
    assert (home / "rep" / "summary.html").is_file()
    assert not (Path.cwd() / "~").exists()


def test_a_mistyped_map_is_not_taken_for_a_map_to_build(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``diff`` and ``eval`` said "the map has no version yet; build it first" of a path
    where there is nothing: a build there makes a second map beside the one meant."""
    typo = str(tmp_path / "maps" / "ctiy")
    assert main(["hdmap", "diff", "--map", typo]) == 2
    assert "no map there (nothing at that path); check the path" in capsys.readouterr().err
    assert main(["hdmap", "eval", "--map", f"file://{typo}", "--truth", str(tmp_path)]) == 2
    assert "no map there (nothing at that path); check the path" in capsys.readouterr().err
    with MapDir(tmp_path / "empty") as md, md.lock():  # a map directory, no version yet
        pass
    with pytest.raises(HdmapError, match="no version yet"):
        diff_versions(str(tmp_path / "empty"))


def test_a_storage_that_cannot_be_opened_is_an_error_naming_the_map(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError from opening the map's filesystem (HDFS without a JVM: "Unable to load
    libjvm") came out as a traceback."""
    import fsspec  # noqa: PLC0415

    def unreachable(url: str, **kwargs: object) -> None:
        raise OSError("Unable to load libjvm")

    monkeypatch.setattr(fsspec.core, "url_to_fs", unreachable)
    assert main(["hdmap", "info", "--map", "hdfs://namenode:8020/maps/city"]) == 2
    err = capsys.readouterr().err
    assert "cannot open 'hdfs://namenode:8020/maps/city': Unable to load libjvm" in err


def test_the_build_config_files_spark_section_sets_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config`` holds sections: its ``spark`` one was read by no command (silently), so
    a master or executor memory written there never reached the session."""
    from adcloud.hdmap.command import _spark_settings  # noqa: PLC0415

    for name in ("ADCLOUD_SPARK_MASTER", "ADCLOUD_SPARK_EXECUTOR_MEMORY", "ADCLOUD_SPARK_CONF"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "nightly.yaml"
    config.write_text("hdmap:\n  mode: memory\nspark:\n  master: local[3]\n  executor_memory: 3g\n")
    args = argparse.Namespace(config=str(config), master=None)
    settings = _spark_settings(args)
    assert (settings.master, settings.executor_memory) == ("local[3]", "3g")
    monkeypatch.setenv("ADCLOUD_SPARK_EXECUTOR_MEMORY", "5g")  # the environment, then --master
    settings = _spark_settings(argparse.Namespace(config=str(config), master="local[1]"))
    assert (settings.master, settings.executor_memory) == ("local[1]", "5g")
