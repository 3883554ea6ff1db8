"""``adcloud hetero``: its options are checked before Spark starts or anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from adcloud.cli import build_parser, main
from adcloud.hetero import HeteroError


def _no_spark(*args: object, **kwargs: object) -> None:
    raise AssertionError("Spark started for a feature job that cannot run")


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--cell", "0", "argument --cell: 0: give 1 or more pixels"),
        ("--bins", "-1", "argument --bins: -1: give 1 or more bins"),
        ("--bins", "33", "argument --bins: 33: give at most 32 bins"),
        ("--batch", "0", "argument --batch: 0: give 1 or more images"),
        ("--partitions-per-bag", "0", "argument --partitions-per-bag: 0: give 1 or more"),
        ("--cell", "8.5", "argument --cell: '8.5' is not a whole number"),
        ("--out", "memory://f", "argument --out: memory://f: memory:// lives inside one process"),
    ],
)
def test_features_options_are_checked_as_they_are_parsed(
    option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was found only by the job, after a Spark session had started (5 to 13 s), and
    named the keyword (``cell must be >= 1``), not the option."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["hetero", "features", "d.bag", "--out", "o", option, value])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_features_refuses_a_device_that_is_not_there_before_spark_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import adcloud.spark  # noqa: PLC0415

    monkeypatch.setattr(adcloud.spark, "get_session", _no_spark)
    args = build_parser().parse_args(
        ["hetero", "features", "d.bag", "--out", str(tmp_path / "f"), "--device", "9:9"]
    )
    with pytest.raises(HeteroError, match="device 9:9: there is no OpenCL platform 9") as caught:
        args.func(args, None)
    assert not (tmp_path / "f").exists()
    # it names the option it came from (not ADCLOUD_HETERO_DEVICE) and what is there
    assert str(caught.value).startswith("--device '9:9': ")
    assert "Devices here: " in str(caught.value) and "numpy (NumPy reference)" in str(caught.value)


def test_devices_split_is_a_whole_number(capsys: pytest.CaptureFixture[str]) -> None:
    """``--split -2`` listed the devices and then failed (exit 2 after the table)."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["hetero", "devices", "--split", "-2"])
    assert stop.value.code == 2 and "--split: -2: give 0 or more" in capsys.readouterr().err


def test_kernels_are_written_to_a_local_path_or_file_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out s3://b/k`` wrote the sources below ./s3:/b/k of the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["hetero", "kernels", "--out", "s3://b/k"])
    assert stop.value.code == 2
    assert "--out: s3://b/k: the kernel sources can only be written to the local disk" in (
        capsys.readouterr().err
    )
    assert list(tmp_path.iterdir()) == []
    assert main(["hetero", "kernels", "--out", f"file://{tmp_path}/k"]) == 0
    assert (tmp_path / "k" / "icp.cl").is_file()


def test_features_takes_the_documented_defaults_and_limits() -> None:
    args = build_parser().parse_args(["hetero", "features", "d.bag", "--out", "o", "--bins", "32"])
    assert (args.cell, args.bins, args.batch, args.partitions_per_bag) == (8, 32, 64, None)
