"""``adcloud synth`` through its argparse parser."""

from __future__ import annotations

import argparse
import io
import re
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from adcloud.synth import DriveConfig, SynthError
from adcloud.synth.command import add_parser, run_demo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adcloud")
    add_parser(parser.add_subparsers(dest="command"))
    return parser


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["synth", "--help"])
    out = capsys.readouterr().out
    assert "adcloud synth --seconds 60 --seed 7 --format ros1 --out drive.bag" in out
    assert "--no-camera" in out


def test_synth_writes_a_drive_and_says_where(tmp_path: Path) -> None:
    bag = tmp_path / "cli.bag"
    args = _parser().parse_args(
        [
            "synth",
            "--seconds",
            "1",
            "--beams",
            "16",
            "--columns",
            "256",
            "--no-camera",
            "--no-raster",
            "--out",
            str(bag),
            "-q",
        ]
    )
    console, buf = _console()
    assert args.func(args, console) == 0
    text = " ".join(buf.getvalue().split())
    assert bag.exists()
    assert str(bag) in text
    assert "cli.bag.truth" in text
    # the files the truth holds: no raster.npz with --no-raster
    written = sorted(p.name for p in (tmp_path / "cli.bag.truth").iterdir())
    assert "raster.npz" not in written and f"({', '.join(written)})" in text
    assert "/lidar/points" in text
    assert "/camera/image_raw" not in text


def test_bad_settings_raise_for_the_cli_to_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = _parser().parse_args(["synth", "--beams", "200", "--out", str(tmp_path / "x.bag"), "-q"])
    with pytest.raises(SynthError, match="lidar_beams must be between 16 and 128"):
        args.func(args, _console()[0])
    monkeypatch.setenv("ADCLOUD_SYNTH_GPS_HZ", "50")
    args = _parser().parse_args(["synth", "--seconds", "1", "--out", str(tmp_path / "y.bag"), "-q"])
    with pytest.raises(SynthError, match="gps_hz must be between 1 and 10"):
        args.func(args, _console()[0])


def test_demo_part_writes_a_sample_drive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADCLOUD_SYNTH_LIDAR_BEAMS", "16")
    console, buf = _console()
    result = run_demo(tmp_path, console, seconds=1.0, quiet=True)
    assert result.bag == tmp_path / "synth" / "drive.bag"
    assert result.truth.is_dir()
    assert str(result.bag) in buf.getvalue()
    again = run_demo(tmp_path, console, seconds=1.0, quiet=True)  # replaces the earlier one
    assert again.bag.read_bytes() == result.bag.read_bytes()


def test_out_is_a_local_path_or_file_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out s3://bucket/x.bag`` failed with "the output directory s3:/bucket does not
    exist" (the URL taken as a path), and a file:// URL the same way."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        _parser().parse_args(["synth", "--out", "s3://bucket/x.bag"])
    assert stop.value.code == 2
    assert "--out: s3://bucket/x.bag: the drive can only be written to the local disk" in (
        capsys.readouterr().err
    )
    argv = ["synth", "--seconds", "1", "--no-lidar", "--no-camera", "--no-raster", "-q"]
    args = _parser().parse_args([*argv, "--out", f"file://{tmp_path}/u.bag"])
    assert args.func(args, _console()[0]) == 0
    assert (tmp_path / "u.bag").is_file() and (tmp_path / "u.bag.truth").is_dir()


@pytest.mark.parametrize(
    ("fmt", "out", "expected"),
    [
        ("mcap", "m.mcap", "out='m' writes 'm/m.mcap'"),
        ("mcap", "m.bag", "choose --format ros1"),
        ("ros2", "r.db3", "out='r' writes 'r/r.db3'"),
        ("ros1", "d.mcap", "name it 'd.bag' or choose --format mcap"),
        ("ros1", "folder/", "'folder/' names a directory"),
    ],
)
def test_an_out_whose_name_promises_another_layout_is_refused(
    fmt: str, out: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--format mcap --out m.mcap`` wrote a rosbag2 *directory* ``m.mcap`` holding
    ``m.mcap.mcap``; ``--format ros1 --out d.mcap`` a ROS 1 bag named like an MCAP file and
    ``--out folder/`` a file ``folder``.  Each is refused before any work, saying where the
    bag would go, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    argv = ["synth", "--seconds", "0.2", "--beams", "16", "--no-camera", "--format", fmt]
    args = _parser().parse_args([*argv, "--out", out, "-q"])
    with pytest.raises(SynthError, match=re.escape(expected)):
        args.func(args, _console()[0])
    assert list(tmp_path.iterdir()) == []


def test_demo_part_names_a_rosbag2_drive_as_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ADCLOUD_SYNTH_FORMAT=mcap adcloud demo`` writes its drive as ``drive/``, not as a
    directory named ``drive.bag``."""
    monkeypatch.setenv("ADCLOUD_SYNTH_FORMAT", "mcap")
    monkeypatch.setenv("ADCLOUD_SYNTH_LIDAR_BEAMS", "16")
    monkeypatch.setenv("ADCLOUD_SYNTH_CAMERA", "false")
    result = run_demo(tmp_path, _console()[0], seconds=0.3, quiet=True)
    assert result.bag == tmp_path / "synth" / "drive"
    assert (result.bag / "drive.mcap").is_file() and (result.bag / "metadata.yaml").is_file()


def test_help_offers_only_gps_rates_the_drive_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    """``--gps-hz`` said "1..10 Hz", but 3, 6, 7 and 9 Hz are refused (no whole-nanosecond
    period): the help lists the rates that work."""
    with pytest.raises(SystemExit):
        _parser().parse_args(["synth", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"--gps-hz HZ GPS rate in Hz: ([\d., or]+) \(", out)
    assert listed is not None, out
    rates = [float(v) for v in re.findall(r"[\d.]+", listed.group(1))]
    assert rates == [1, 2, 2.5, 4, 5, 8, 10]
    for hz in rates:
        DriveConfig(gps_hz=hz).validate()
    for hz in (3.0, 6.0, 7.0, 9.0):
        with pytest.raises(SynthError, match="whole-nanosecond"):
            DriveConfig(gps_hz=hz).validate()


@pytest.mark.parametrize("seconds", ["0.1234", "0.3"])
def test_the_progress_bar_ends_at_the_drive_length(
    seconds: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0.1234 s drive ran its bar (total rounded to 0.123 s) past the end: tqdm warned
    "clamping frac to range [0, 1]" and showed a negative time left.  The bar ends at
    exactly 100 % without a warning."""
    argv = ["synth", "--seconds", seconds, "--no-lidar", "--no-camera", "--no-raster"]
    args = _parser().parse_args([*argv, "--out", str(tmp_path / "p.bag")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert args.func(args, _console()[0]) == 0
    frames = capsys.readouterr().err.replace("\r", "\n").splitlines()
    last = [f for f in frames if f.startswith("simulated")][-1]
    assert "100%" in last and "<-" not in last, last
    assert f"{float(seconds):.1f}/{float(seconds):.1f} s" in last, last
