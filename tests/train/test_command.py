"""``adcloud train run|inspect``: a real run on the test session, then its model inspected."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from pyspark.sql import SparkSession
from rich.console import Console

from adcloud.errors import AdcloudError
from adcloud.synth import DriveConfig, DriveResult, generate_drive
from adcloud.train import command
from adcloud.train.errors import CheckpointError, ExportError, TrainError
from adcloud.train.export import export_model


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adcloud")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _call(argv: list[str]) -> tuple[int, str]:
    args = _parse(argv)
    out = io.StringIO()
    code = args.func(args, Console(file=out, width=200))
    return code, out.getvalue()


def test_run_trains_prints_a_table_and_inspect_reads_the_model(
    spark: SparkSession,
    train_drive: DriveResult,
    heldout_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(command, "_session", lambda args: spark)
    out = tmp_path / "run"
    settings = {
        "task": "lidar_seg",
        "bags": str(train_drive.bag),
        "sync": "single",
        "steps": "3",
        "heldout_bags": str(heldout_drive.bag),
        "eval_every": "2",
        "batch_size": "2",
        "threads": "1",
        "store": "local:///cli-train",
        "store_options": f"root={tmp_path / 'store'}",
        "out": str(out),
    }
    argv = ["train", "run"] + [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    code, text = _call(argv)
    assert code == 0, text
    assert "run lidar_seg-" in text and "single, 1 trainer(s)" in text
    written = json.loads((out / "result.json").read_text())
    assert written["steps"] == 3
    curve = "  ".join(f"{v['step']}: {v['miou']:.3f}" for v in written["validation"])
    assert [v["step"] for v in written["validation"]] == [2, 3]
    assert re.search(r"held-out miou by step\s*│\s*" + re.escape(curve), text), text
    assert "eval.json, confusion.png" in text
    # the same command again resumes the finished run instead of training it anew
    code, text = _call(argv)
    assert code == 0 and "3 (resumed at 3)" in text and "no step left to train" in text
    # held-out bags are scored, never trained on: without them it is the same run, and
    # the directory keeps no scores that are not this run's
    assert (out / "eval.json").is_file()
    unscored = [
        a
        for k, v in settings.items()
        if k not in ("heldout_bags", "eval_every")
        for a in ("--set", f"{k}={v}")
    ]
    code, text = _call(["train", "run", *unscored])
    assert code == 0 and "3 (resumed at 3)" in text, text
    assert not (out / "eval.json").exists() and not (out / "confusion.png").exists()
    # its checkpoints were written by one trainer: two cannot resume them, and the run says
    # so before Spark starts, not from inside each trainer's task
    monkeypatch.setattr(command, "_session", _no_spark)
    run = json.loads((out / "result.json").read_text())["run"]
    two = ["--set", f"run={run}", "--set", "sync=allreduce", "--set", "workers=2"]
    with pytest.raises(CheckpointError, match=r"written by 1 trainer\(s\), this run has 2"):
        _call([*argv, *two])
    # nor can another optimizer take up its optimizer state
    with pytest.raises(CheckpointError, match=r"optimizer adam, this run has sgd: .*train\.run"):
        _call([*argv, "--set", f"run={run}", "--set", "optimizer=sgd"])
    # resumed under its name with another learning rate: it runs, and says (once) what changed
    monkeypatch.setattr(command, "_session", lambda args: spark)
    with caplog.at_level(logging.WARNING, logger="adcloud.train.job"):
        code, text = _call([*argv, "--set", f"run={run}", "--set", "lr=0.01", "--set", "steps=4"])
    assert code == 0 and "4 (resumed at 3)" in text, text
    assert caplog.text.count("trained with other settings (lr 0.001 -> 0.01)") == 1

    code, text = _call(["train", "inspect", str(out / "model")])
    assert code == 0 and "lidar_seg" in text
    code, text = _call(["train", "inspect", "--json", str(out / "model")])
    info = json.loads(text)
    assert info["task"] == "lidar_seg" and info["path"] == str(out / "model")


def _no_spark(args: argparse.Namespace) -> None:
    raise AssertionError("Spark started for a run that cannot train")


@pytest.mark.parametrize("item", ["steps", "=300"])
def test_run_rejects_settings_that_are_not_key_value(
    item: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once said on stdout, without "error:", after the parse; now argparse's usage error."""
    with pytest.raises(SystemExit) as stop:
        _parse(["train", "run", "--set", item])
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert f"argument --set: --set {item!r} is not KEY=VALUE" in err


def test_eval_refuses_an_output_in_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """eval.json and confusion.png went to a memory:// store that ended with the command."""
    with pytest.raises(SystemExit) as stop:
        _parse(["train", "eval", "--model", "m", "--bags", "b.bag", "--out", "memory://e"])
    assert stop.value.code == 2
    assert "argument --out: memory://e: memory:// lives inside one process" in (
        capsys.readouterr().err
    )


def test_run_names_a_bad_setting(tmp_path: Path) -> None:
    with pytest.raises(TrainError, match="sync must be one of single, ps, allreduce"):
        _call(["train", "run", "--set", "sync=gossip", "--set", "bags=x.bag"])


@pytest.mark.parametrize(
    ("momentum", "says"),
    [("-1", r"momentum must be in \[0, 1\), not -1"), ("nan", r"momentum: 'nan' is not a number")],
)
def test_run_names_a_bad_momentum_before_starting_spark(
    momentum: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "_session", _no_spark)
    with pytest.raises(AdcloudError, match=says):
        _call(["train", "run", "--set", "optimizer=sgd", "--set", f"momentum={momentum}"])


def test_run_names_an_unknown_task_before_starting_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_spark(args: argparse.Namespace) -> None:
        raise AssertionError("Spark started for a run that cannot train")

    monkeypatch.setattr(command, "_session", no_spark)
    with pytest.raises(TrainError, match="unknown task 'lidar_sg': choose one of"):
        _call(["train", "run", "--set", "task=lidar_sg", "--set", "bags=x.bag"])


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ([], "no bags to train on: set train.bags"),
        (["bags={here}/nope.bag"], "train.bags: bag '{here}/nope.bag' does not exist"),
        (
            ["bags={bag}", "heldout_bags={here}/typo.bag"],
            "train.heldout_bags: bag '{here}/typo.bag' does not exist",
        ),
    ],
)
def test_run_names_a_missing_bag_before_starting_spark(
    train_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    settings: list[str],
    says: str,
) -> None:
    def no_spark(args: argparse.Namespace) -> None:
        raise AssertionError("Spark started for a run that cannot train")

    monkeypatch.setattr(command, "_session", no_spark)
    fill = {"here": str(tmp_path), "bag": str(train_drive.bag)}
    argv = [a for item in settings for a in ("--set", item.format(**fill))]
    with pytest.raises(TrainError, match=re.escape(says.format(**fill))):
        _call(["train", "run", *argv])


def test_run_names_a_heldout_bag_without_the_task_s_topic_before_starting_spark(
    train_drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found from the bag's index before Spark starts, not once the training is done."""
    odom = generate_drive(
        DriveConfig(seconds=1, seed=1, lidar=False, camera=False, truth_raster=False),
        tmp_path / "odom.bag",
    )
    monkeypatch.setattr(command, "_session", _no_spark)
    settings = [f"bags={train_drive.bag}", f"heldout_bags={odom.bag}", "task=lidar_seg"]
    with pytest.raises(
        TrainError,
        match=rf"train.heldout_bags: {re.escape(str(odom.bag))} has no messages on "
        r"/lidar/points, which task lidar_seg scores \(its topics: .*/odom",
    ):
        _call(["train", "run", *(a for item in settings for a in ("--set", item))])


@pytest.mark.parametrize("bags", [["nope.bag"], ["{bag}", "typo*.bag"]])
def test_eval_names_a_missing_bag_before_starting_spark(
    train_drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bags: list[str]
) -> None:
    """Once found only after Spark had started (seconds; on a cluster, once executors ran)."""
    monkeypatch.setattr(command, "_session", _no_spark)
    monkeypatch.chdir(tmp_path)
    given = [b.format(bag=train_drive.bag) for b in bags]
    with pytest.raises(AdcloudError, match=re.escape(str(tmp_path / given[-1]))):
        _call(["train", "eval", "--model", "m", "--bags", *given])


def test_eval_names_no_bag_before_starting_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--bags ""`` (an unset shell variable) named no bag, was let through, and failed only
    once Spark had started."""
    monkeypatch.setattr(command, "_session", _no_spark)
    with pytest.raises(TrainError, match="--bags names no bag"):
        _call(["train", "eval", "--model", str(tmp_path / "m"), "--bags", " ", ""])


@pytest.mark.parametrize(
    ("field", "value"),
    [("shape", [2, "four"]), ("shape", [2, None]), ("dynamic", {"x": {"batch": {}}})],
)
def test_eval_names_damaged_input_sizes_in_the_metadata_before_starting_spark(
    train_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    field: str,
    value: Any,
) -> None:
    """The input sizes recorded in metadata.json (which no checksum covers) were read as
    they were: a size or a dimension that is no whole number ended the command in a bare
    ValueError or TypeError traceback, once Spark had started."""
    monkeypatch.setattr(command, "_session", _no_spark)
    model = tmp_path / "model"
    meta = {"task": "lidar_seg", "config": {"task_options": {}}}
    export_model(torch.nn.Linear(4, 2), (torch.randn(2, 4),), model, meta, warmup=0, runs=1)
    written = json.loads((model / "metadata.json").read_text())
    if field == "shape":
        written["model"]["inputs"][0]["shape"] = value
    else:
        written["model"]["dynamic"] = value
    (model / "metadata.json").write_text(json.dumps(written))
    with pytest.raises(ExportError) as err:
        _call(["train", "eval", "--model", str(model), "--bags", str(train_drive.bag)])
    said = str(err.value)
    assert said.startswith(f"{model}/metadata.json: model.inputs[0] "), said
    assert "is damaged" in said and "export the model again" in said


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_eval_refuses_a_partition_count_before_starting_spark(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Once found only after Spark had started."""
    with pytest.raises(SystemExit) as stop:
        _parse(["train", "eval", "--model", "m", "--bags", "b.bag", "--partitions-per-bag", value])
    assert stop.value.code == 2 and "--partitions-per-bag" in capsys.readouterr().err


def test_run_on_too_few_task_slots_says_so_in_one_line_at_once(tmp_path: Path) -> None:
    """Two trainers on one task slot (``local[1]``, ``spark.default.parallelism=4``): the
    slots were taken to be ``defaultParallelism`` -- that setting here, and on a standalone
    cluster at least 2 whatever its cores -- so the run went on to Spark's own check of the
    barrier stage, which fails after 40 x 15 s with a Java traceback."""
    odom = generate_drive(
        DriveConfig(seconds=1, seed=1, lidar=False, camera=False, truth_raster=False),
        tmp_path / "odom.bag",
    )
    settings = {
        "task": "lidar_seg",
        "bags": str(odom.bag),
        "sync": "allreduce",
        "workers": "2",
        "store": "local:///cli-slots",
        "store_options": f"root={tmp_path / 'store'}",
        "out": str(tmp_path / "run"),
    }
    argv = ["train", "run", "--master", "local[1]"]
    argv += [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADCLOUD_")}
    env["ADCLOUD_SPARK_CONF"] = "spark.default.parallelism=4,spark.ui.enabled=false"
    done = subprocess.run(
        [sys.executable, "-m", "adcloud.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "BarrierJobSlots" not in done.stderr
    (said,) = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert said.startswith(
        "error: train.workers=2 trainers run as one Spark barrier stage and need 2 task "
        "slots at once, but the application on local[1] has 1"
    )
    assert "lower train.workers to 1" in said


@pytest.mark.parametrize(
    ("setting", "value", "says"),
    [
        ("out", "local:///runs/seg", "reads local:// as a plain path from the file system root"),
        ("etl_dir", "local:///etl", "reads local:// as a plain path from the file system root"),
        ("out", "alluxio://host:39999/runs", "does not know alluxio://"),
        ("etl_dir", "memory://etl", "is private to each Python process"),
    ],
)
def test_run_refuses_a_store_uri_where_files_are_written(
    setting: str, value: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out=local:///runs/seg wrote the model to /runs/seg (fsspec's own local://), not to the
    store, and etl_dir=local:///etl the samples to /etl; out=alluxio://... trained, then
    failed with fsspec's "Protocol not known" traceback; etl_dir=memory://etl trained only
    while the Spark task reading a part ran in the Python worker that had written it."""
    monkeypatch.setattr(command, "_session", _no_spark)
    with pytest.raises(TrainError, match=f"{setting} '?{value}'? is ") as err:
        _call(["train", "run", "--set", "etl=files", "--set", f"{setting}={value}"])
    assert says in str(err.value) and "file://" in str(err.value)


@pytest.mark.parametrize("out", ["local:///eval-nov", "alluxio://host:39999/e", "nosuch://e"])
def test_eval_refuses_an_output_that_fsspec_cannot_write(out: str, tmp_path: Path) -> None:
    """--out local:///eval-nov wrote eval.json to /eval-nov; alluxio:// and unknown schemes
    ended in fsspec's ValueError traceback."""
    with pytest.raises(TrainError, match=r"--out \(out=\)"):
        _call(["train", "eval", "--model", str(tmp_path), "--bags", "b.bag", "--out", out])


def test_the_run_config_files_spark_section_sets_the_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--config`` holds sections: its ``spark`` one was read by no command (silently)."""
    from adcloud.train.command import _spark_settings  # noqa: PLC0415

    for name in ("MASTER", "EXECUTOR_MEMORY", "CONF", "WORKER_IMPORTS"):
        monkeypatch.delenv(f"ADCLOUD_SPARK_{name}", raising=False)
    config = tmp_path / "train.yaml"
    config.write_text("train:\n  steps: 5\nspark:\n  master: local[3]\n  executor_memory: 3g\n")
    settings = _spark_settings(argparse.Namespace(config=str(config), master=None))
    assert (settings.master, settings.executor_memory) == ("local[3]", "3g")
    settings = _spark_settings(argparse.Namespace(config=str(config), master="local[1]"))
    assert settings.master == "local[1]"
    # its workers start with torch imported, after what the file asks for
    assert settings.worker_imports == ("torch",)
    config.write_text("spark:\n  worker_imports: [numpy, torch]\n")
    settings = _spark_settings(argparse.Namespace(config=str(config), master=None))
    assert settings.worker_imports == ("numpy", "torch")
