"""Scoring models on the executors (``adcloud.train.evaluate``, ``adcloud train eval``) on the
real local[2] session: the counts the executors return against the same model run in this
process, per bag and overall; the held-out scores of a run; bad models and bags."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from numpy.typing import NDArray
from pyspark import cloudpickle
from pyspark.sql import SparkSession
from rich.console import Console

from adcloud.store import open_store
from adcloud.synth import DriveConfig, DriveResult, generate_drive
from adcloud.train import command
from adcloud.train import evaluate as evaluate_module
from adcloud.train import job as job_module
from adcloud.train.checkpoint import Checkpointer
from adcloud.train.errors import ExportError, TrainError
from adcloud.train.evaluate import EVAL_FILE, PLOT_FILE, evaluate_model, score_parameters
from adcloud.train.export import export_model, inspect_model, inspection_table
from adcloud.train.job import run_training
from adcloud.train.lidar import NUM_CLASSES
from adcloud.train.task import CountingTask, PointCloudSample, Sample, get_task
from adcloud.train.tensors import encode_tensors

from . import test_job
from .conftest import task_samples
from .test_job import LinearTask, Point, config

# SummingLinearTask below crosses to the executors; its base class lives in test_job, which the
# session's conftest registers for pickling by value only when its own tests use Spark
cloudpickle.register_pickle_by_value(test_job)  # type: ignore[no-untyped-call]


def _export(
    task_name: str, model: torch.nn.Module, samples: Sequence[Sample], out: Path, **options: Any
) -> Path:
    task = get_task(task_name, options)
    meta = {"task": task_name, "config": {"task_options": options}}
    export_model(
        model,
        task.example_inputs(samples[:2]),
        out,
        meta,
        dynamic_shapes=task.dynamic_shapes(),
        warmup=1,
        runs=2,
    )
    return out


def _close(a: NDArray[Any], b: NDArray[Any]) -> None:
    """Two confusion matrices of the same points: the same total, and predictions that differ
    on at most 0.1 % of the points (batches of other sizes round the logits differently)."""
    assert a.sum() == b.sum() > 0
    assert np.abs(a - b).sum() <= 0.002 * a.sum()


@pytest.fixture(scope="module")
def lidar_model(
    tmp_path_factory: pytest.TempPathFactory, lidar_train: list[Sample], fit_model: Any
) -> tuple[Path, torch.nn.Module]:
    """A small LiDAR model trained for 30 steps, exported."""
    task = get_task("lidar_seg")
    model, _ = fit_model(task, lidar_train, steps=30, batch_size=2, lr=1e-2)
    out = _export("lidar_seg", model, lidar_train, tmp_path_factory.mktemp("eval") / "lidar")
    return out, model


def test_executors_score_an_exported_model_per_bag_as_this_process_does(
    spark: SparkSession,
    lidar_model: tuple[Path, torch.nn.Module],
    train_drive: DriveResult,
    heldout_drive: DriveResult,
    lidar_train: list[Sample],
    lidar_heldout: list[Sample],
    tmp_path: Path,
) -> None:
    path, model = lidar_model
    task = get_task("lidar_seg")
    assert isinstance(task, CountingTask)
    bags = [str(heldout_drive.bag), str(train_drive.bag)]
    result = evaluate_model(spark, path, bags, partitions_per_bag=3, out=str(tmp_path / "ev"))

    assert result.task == "lidar_seg" and result.model == str(path)
    assert result.samples == {bags[0]: len(lidar_heldout), bags[1]: len(lidar_train)}
    program = torch.export.load(str(path / "model.pt2")).module()
    here = {
        bags[0]: task.eval_counts(program, lidar_heldout),
        bags[1]: task.eval_counts(program, lidar_train),
    }
    for bag in bags:
        executor = result.per_bag[bag]
        expected = task.scores(here[bag])
        assert executor["miou"] == pytest.approx(expected["miou"], abs=2e-3)
        assert executor["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-3)
    _close(result.counts, here[bags[0]] + here[bags[1]])
    assert result.counts.shape == (NUM_CLASSES, NUM_CLASSES)
    # the exported program scores as the module it was exported from
    _close(here[bags[0]], task.eval_counts(model, lidar_heldout))
    assert 0.2 < result.scores["miou"] < 1.0
    assert result.class_names[1] == "road" and "iou_road" in result.scores

    written = json.loads((tmp_path / "ev" / EVAL_FILE).read_text())
    assert written["scores"]["miou"] == pytest.approx(result.scores["miou"])
    assert [b["uri"] for b in written["bags"]] == bags
    assert [b["samples"] for b in written["bags"]] == [len(lidar_heldout), len(lidar_train)]
    assert np.array_equal(np.array(written["counts"]), result.counts)
    assert (tmp_path / "ev" / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "ev").glob("*.partial"))


def test_camera_images_are_paired_with_their_labels_across_partitions(
    spark: SparkSession,
    heldout_drive: DriveResult,
    camera_heldout: list[Sample],
    tmp_path: Path,
) -> None:
    task = get_task("camera_seg")
    torch.manual_seed(0)
    model = task.build_model()
    path = _export("camera_seg", model, camera_heldout, tmp_path / "camera")
    result = evaluate_model(spark, path, [str(heldout_drive.bag)], partitions_per_bag=4)
    assert result.total_samples == len(camera_heldout)
    _close(result.counts, task.eval_counts(model, camera_heldout))
    assert result.class_names[0] == "sky"


def test_a_bag_without_the_task_s_topic_is_named_and_left_out(
    spark: SparkSession,
    lidar_model: tuple[Path, torch.nn.Module],
    heldout_drive: DriveResult,
    lidar_heldout: list[Sample],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bare = generate_drive(
        DriveConfig(seconds=2, seed=1, lidar=False, camera=False, truth_raster=False),
        tmp_path / "odom.bag",
    )
    path, _ = lidar_model
    result = evaluate_model(spark, path, [str(heldout_drive.bag), str(bare.bag)])
    assert result.samples == {str(heldout_drive.bag): len(lidar_heldout), str(bare.bag): 0}
    assert result.per_bag[str(bare.bag)] == {}
    assert f"{bare.bag} gave no samples for task lidar_seg" in caplog.text
    with pytest.raises(TrainError, match=r"gave no samples for task lidar_seg \(topics /lidar"):
        evaluate_model(spark, path, [str(bare.bag)])


def test_a_bad_message_names_its_bag_in_scoring_and_in_training(
    spark: SparkSession,
    heldout_drive: DriveResult,
    lidar_heldout: list[Sample],
    tmp_path: Path,
) -> None:
    # a model whose task reads the IMU topic as if it held point clouds: the error names the
    # topic, and -- a job over many bags ('drives/2026-11-*.bag') -- the bag and the message
    torch.manual_seed(0)
    model = get_task("lidar_seg").build_model()
    path = _export("lidar_seg", model, lidar_heldout, tmp_path / "imu", topic="/imu/data")
    bag = str(heldout_drive.bag)
    expected = r": /imu/data: expected sensor_msgs/msg/PointCloud2.*recorded at \d+ ns"
    named = re.escape(bag) + expected
    with pytest.raises(Exception, match=named):
        evaluate_model(spark, path, [bag])
    settings = config(
        tmp_path,
        task="lidar_seg",
        task_options={"topic": "/imu/data"},
        bags=(bag,),
        sync="single",
        steps=1,
        batch_size=1,
        checkpoint_every=0,
    )
    with pytest.raises(Exception, match=named):
        run_training(spark, settings)


def test_missing_or_corrupt_models_are_refused_naming_the_file(
    spark: SparkSession, lidar_model: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    path, _ = lidar_model
    with pytest.raises(ExportError, match=r"metadata\.json: not found"):
        evaluate_model(spark, tmp_path / "nothing", ["x.bag"])
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    with (broken / "model.pt2").open("r+b") as handle:
        handle.seek(100)
        handle.write(b"\0" * 8)
    with pytest.raises(ExportError, match=r"model.pt2.*SHA-256|SHA-256.*model.pt2"):
        evaluate_model(spark, broken, ["x.bag"])
    with pytest.raises(TrainError, match="no bags to evaluate on"):
        evaluate_model(spark, path, [])
    # a blank bag (`--bags ''`) is none, not the working directory and every bag in it
    for blank in ("", [" "]):
        with pytest.raises(TrainError, match="no bags to evaluate on"):
            evaluate_model(spark, path, blank)


class SummingLinearTask(LinearTask):
    """:class:`LinearTask` whose mean squared error is a sum and a count."""

    def eval_counts(self, model: torch.nn.Module, samples: Sequence[Point]) -> NDArray[Any]:
        if not samples:
            return np.zeros(2)
        x = torch.from_numpy(np.stack([s.x for s in samples]))
        y = torch.tensor([[s.y] for s in samples])
        with torch.no_grad():
            sse = float(((model(x) - y) ** 2).sum())
        return np.array([sse, len(samples)])

    def scores(self, counts: NDArray[Any]) -> dict[str, float]:
        return {"mse": float(counts[0] / counts[1])}


def test_a_run_scores_its_heldout_bags_on_the_executors(
    spark: SparkSession, tmp_path: Path
) -> None:
    drive = generate_drive(
        DriveConfig(
            seconds=3, seed=2, lidar=False, camera=False, truth_raster=False, chunk_bytes=8192
        ),
        tmp_path / "odom.bag",
    )
    out = tmp_path / "out"
    cfg = config(
        tmp_path,
        sync="single",
        bags=(str(drive.bag),),
        heldout_bags=(str(drive.bag),),
        steps=5,
        batch_size=50,
        partitions_per_bag=3,
        out=str(out),
    )
    task = SummingLinearTask()
    result = run_training(spark, cfg, task=task)
    model = task.build_model()
    model.load_state_dict(result.state_dict())
    samples = task_samples(task, drive.bag)
    with torch.no_grad():
        expected = task.evaluate(model, samples)["mse"]
    assert result.metrics["mse"] == pytest.approx(expected, rel=1e-5)
    written = json.loads((out / EVAL_FILE).read_text())
    assert written["bags"] == [
        {"uri": str(drive.bag), "samples": len(samples), "scores": result.metrics}
    ]
    assert not (out / PLOT_FILE).exists()  # no matrix to draw
    # the same scores from the parameters alone
    again = score_parameters(spark, task, encode_tensors(model.state_dict()), [str(drive.bag)])
    assert again.scores["mse"] == pytest.approx(result.metrics["mse"], rel=1e-6)
    with pytest.raises(TrainError, match="cannot be scored on executors"):
        score_parameters(spark, LinearTask(), result.parameters, [str(drive.bag)])


def _call(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="adcloud")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    out = io.StringIO()
    code = args.func(args, Console(file=out, width=200))
    return code, out.getvalue()


def test_cli_prints_scores_writes_files_and_refuses_a_bad_model_before_spark(
    spark: SparkSession,
    lidar_model: tuple[Path, torch.nn.Module],
    heldout_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = lidar_model
    monkeypatch.setattr(command, "_session", lambda args: spark)
    code, text = _call(
        [
            "train",
            "eval",
            "--model",
            str(path),
            "--bags",
            str(heldout_drive.bag),
            "--out",
            str(tmp_path / "ev"),
        ]
    )
    assert code == 0, text
    assert "miou" in text and "iou_road" in text and "all bags" in text
    assert f"wrote {tmp_path / 'ev'}/eval.json and confusion.png" in text
    code, text = _call(
        ["train", "eval", "--json", "--model", str(path), "--bags", str(heldout_drive.bag)]
    )
    info = json.loads(text)
    saved = json.loads((tmp_path / "ev" / EVAL_FILE).read_text())
    assert info["scores"] == saved["scores"] and info["task"] == "lidar_seg"

    def no_spark(args: argparse.Namespace) -> None:
        raise AssertionError("Spark started for a model that cannot be scored")

    monkeypatch.setattr(command, "_session", no_spark)
    with pytest.raises(ExportError, match=r"metadata\.json: not found"):
        _call(
            ["train", "eval", "--model", str(tmp_path / "none"), "--bags", str(heldout_drive.bag)]
        )
    odd = tmp_path / "odd"
    shutil.copytree(path, odd)
    meta = json.loads((odd / "metadata.json").read_text())
    meta["task"] = "lidar_sg"
    (odd / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(TrainError, match="unknown task 'lidar_sg'"):
        _call(["train", "eval", "--model", str(odd), "--bags", str(heldout_drive.bag)])


def _odom_drive(
    factory: pytest.TempPathFactory, name: str, seconds: float, seed: int
) -> DriveResult:
    """A drive of odometry only, in small chunks (several partitions)."""
    config = DriveConfig(
        seconds=seconds, seed=seed, lidar=False, camera=False, truth_raster=False, chunk_bytes=8192
    )
    return generate_drive(config, factory.mktemp(name) / f"{name}.bag")


@pytest.fixture(scope="module")
def odom_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """A 3 s odometry drive."""
    return _odom_drive(tmp_path_factory, "odom", 3, 2)


@pytest.fixture(scope="module")
def other_odom_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """A second, shorter odometry drive (another seed): a second held-out bag."""
    return _odom_drive(tmp_path_factory, "other", 2, 3)


@pytest.mark.parametrize("sync", ["single", "ps", "allreduce"])
def test_every_mode_scores_the_heldout_bags_during_training(
    spark: SparkSession,
    odom_drive: DriveResult,
    other_odom_drive: DriveResult,
    tmp_path: Path,
    sync: str,
) -> None:
    """With eval_every the run records a validation curve -- the trainers score their
    shares of the held-out samples in ps and allreduce, the executors in single -- that
    ends with the finished model's scores and survives in checkpoints.  The finished model
    is scored on the held-out samples the run kept, per bag exactly as decoding the bags
    again scores it."""
    bag = str(odom_drive.bag)
    task = SummingLinearTask()
    settings: dict[str, Any] = {
        "sync": sync,
        "bags": (bag,),
        "heldout_bags": (bag, str(other_odom_drive.bag)),
        "steps": 8,
        "batch_size": 20,
        "partitions_per_bag": 3,
        "checkpoint_every": 4,
        "eval_every": 3,
    }
    out = tmp_path / "out"

    def decode_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the held-out bags were decoded again for the final scores")

    with pytest.MonkeyPatch.context() as patch:  # the kept samples must serve
        patch.setattr(job_module, "score_parameters", decode_again)
        result = run_training(spark, config(tmp_path, out=str(out), **settings), task=task)
    assert [step for step, _ in result.validation] == [3, 6, 8]
    assert result.validation[-1][1] == result.metrics
    mse = [scores["mse"] for _, scores in result.validation]
    assert mse[-1] < mse[0]  # it learns
    # scoring while training changes nothing the training computes
    plain = run_training(
        spark, config(tmp_path / "plain", **{**settings, "eval_every": 0}), task=task
    )
    assert plain.losses == result.losses
    for name, value in plain.state_dict().items():
        assert torch.equal(value, result.state_dict()[name]), name
    # kept samples (eval_every) and decoded bags (plain) give the same scores, bag by bag
    kept = json.loads((out / EVAL_FILE).read_text())
    decoded = json.loads((Path(plain.output) / EVAL_FILE).read_text())
    assert [b["uri"] for b in kept["bags"]] == [b["uri"] for b in decoded["bags"]]
    assert [b["samples"] for b in kept["bags"]] == [b["samples"] for b in decoded["bags"]]
    assert all(b["samples"] > 0 for b in kept["bags"]) and len(kept["bags"]) == 2
    for k, d in zip(kept["bags"], decoded["bags"], strict=True):
        assert k["scores"] == pytest.approx(d["scores"], rel=1e-6)
    assert kept["counts"] == pytest.approx(decoded["counts"], rel=1e-6)
    assert result.metrics == pytest.approx(plain.metrics, rel=1e-6)
    # step 3's scores are those of a run stopped after 3 steps (the same first steps)
    short = run_training(
        spark, config(tmp_path / "short", **{**settings, "steps": 3, "eval_every": 0}), task=task
    )
    assert short.validation == () and mse[0] == pytest.approx(short.metrics["mse"], rel=1e-5)
    written = json.loads((out / "result.json").read_text())
    assert [v["step"] for v in written["validation"]] == [3, 6, 8]
    assert (out / "loss.png").stat().st_size > 1000
    # the exported model carries the curve, and `adcloud train inspect` shows it
    info = inspect_model(out / "model")
    assert [v["step"] for v in info["training"]["validation"]] == [3, 6, 8]
    shown = io.StringIO()
    Console(file=shown, width=200).print(inspection_table(info))
    assert "held-out mse by step" in shown.getvalue()
    # the last checkpoint (step 8) carries the curve so far, for a resumed run
    cfg = config(tmp_path, **settings)
    store = open_store(cfg.store, **cfg.store_kwargs())
    restored = Checkpointer(store, result.run, every=4).restore(rank=0, world=cfg.world)
    assert restored is not None and [s for s, _ in restored.validation] == [3, 6]
    assert restored.validation[0][1]["mse"] == pytest.approx(mse[0])


def test_eval_every_needs_a_task_whose_scores_are_sums(
    spark: SparkSession, odom_drive: DriveResult, tmp_path: Path
) -> None:
    bag = str(odom_drive.bag)
    cfg = config(tmp_path, sync="single", bags=(bag,), heldout_bags=(bag,), eval_every=2)
    with pytest.raises(TrainError, match=r"eval_every .* toy_linear has none: set eval_every=0"):
        run_training(spark, cfg, task=LinearTask())


def test_a_model_at_a_url_is_scored_and_named_there(
    spark: SparkSession,
    lidar_model: tuple[Path, torch.nn.Module],
    heldout_drive: DriveResult,
    lidar_heldout: list[Sample],
) -> None:
    path, _ = lidar_model
    fs = fsspec.filesystem("memory")
    url = f"memory://models-{os.getpid()}-{time.monotonic_ns()}/seg/model"
    for name in ("metadata.json", "model.pt2"):
        fs.pipe_file(f"{url}/{name}", (path / name).read_bytes())
    result = evaluate_model(spark, url, [str(heldout_drive.bag)])
    local = evaluate_model(spark, path, [str(heldout_drive.bag)])
    assert result.model == url and result.total_samples == len(lidar_heldout)
    assert np.array_equal(result.counts, local.counts)
    assert inspect_model(f"{url}/model.pt2")["path"] == url
    # a corrupt or missing file is named where it lives
    fs.pipe_file(f"{url}/model.pt2", b"garbage")
    with pytest.raises(ExportError, match=rf"{re.escape(url)}/model\.pt2: corrupt"):
        evaluate_model(spark, url, [str(heldout_drive.bag)])
    fs.rm(f"{url}/metadata.json")
    with pytest.raises(ExportError, match=rf"{re.escape(url)}/metadata\.json: not found"):
        inspect_model(url)


def test_bags_of_another_image_size_than_the_model_s_are_named(
    spark: SparkSession,
    heldout_drive: DriveResult,
    camera_heldout: list[Sample],
    lidar_model: tuple[Path, torch.nn.Module],
    tmp_path: Path,
) -> None:
    """An exported program takes the image size it was traced with: a bag of another camera
    is a TrainError naming the bag, the topic and both sizes -- not four task attempts and
    torch's "Guard failed" deep in a Spark traceback."""
    small = [
        dataclasses.replace(s, image=s.image[:60, :80].copy(), labels=s.labels[:60, :80].copy())
        for s in camera_heldout[:2]
    ]
    torch.manual_seed(0)
    path = _export("camera_seg", get_task("camera_seg").build_model(), small, tmp_path / "cam")
    bag = str(heldout_drive.bag)
    with pytest.raises(TrainError) as err:
        evaluate_model(spark, path, [bag], partitions_per_bag=2)
    assert str(err.value) == (
        f"{bag}: topic /camera/image_raw gives the model's input images of size 3x120x160 per "
        f"sample, but {path} was exported for 3x60x80 (model.inputs in its metadata.json): "
        "score it on bags recorded like the ones it was trained on, or train and export a "
        "model on these"
    )
    # a LiDAR model takes any number of points per sweep: only the 4 values of a point are fixed
    meta = json.loads((lidar_model[0] / "metadata.json").read_text())
    assert evaluate_module._input_shapes(meta) == (("points", (None, 4)), ("valid", (None,)))


def test_an_eval_output_that_is_a_file_is_refused_before_scoring(
    spark: SparkSession,
    lidar_model: tuple[Path, torch.nn.Module],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, _ = lidar_model
    taken = tmp_path / "taken.json"
    taken.write_text("{}")

    def no_scoring(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("scored for an output it cannot write")

    monkeypatch.setattr(evaluate_module, "_score", no_scoring)
    says = rf"{re.escape(str(taken))} is a file, not a directory for eval.json and confusion.png"
    with pytest.raises(TrainError, match=says):
        evaluate_model(spark, path, ["x.bag"], out=str(taken))

    def no_spark(args: argparse.Namespace) -> None:
        raise AssertionError("Spark started for an output it cannot write")

    monkeypatch.setattr(command, "_session", no_spark)
    with pytest.raises(TrainError, match=says):
        _call(["train", "eval", "--model", str(path), "--bags", "x.bag", "--out", str(taken)])
    assert taken.read_text() == "{}"


class _SparkStartedError(Exception):
    """Raised where ``adcloud train eval`` would start Spark: its checks passed."""


def test_eval_names_task_options_in_a_damaged_metadata_file_before_spark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model's metadata.json whose config or task_options are not what a run writes
    (edited by hand, or by another tool): ``adcloud train eval`` failed with an
    AttributeError or ValueError traceback; now the file and the field are named, before
    Spark starts, and a config that holds no task options scores with the task's own."""
    rng = np.random.default_rng(0)
    sweeps: list[Sample] = [
        PointCloudSample(
            0,
            rng.normal(0, 10, (n, 4)).astype(np.float32),
            rng.integers(1, NUM_CLASSES, n).astype(np.uint8),
        )
        for n in (300, 200)
    ]
    torch.manual_seed(0)
    path = _export("lidar_seg", get_task("lidar_seg").build_model(), sweeps, tmp_path / "m")
    bag = tmp_path / "a.bag"
    bag.write_bytes(b"")

    def spark_starts(args: argparse.Namespace) -> None:
        raise _SparkStartedError

    monkeypatch.setattr(command, "_session", spark_starts)
    meta = json.loads((path / "metadata.json").read_text())
    argv = ["train", "eval", "--model", str(path), "--bags", str(bag)]
    for options in ("voxel=0.2", ["voxel"]):
        (path / "metadata.json").write_text(
            json.dumps({**meta, "config": {"task_options": options}})
        )
        with pytest.raises(
            ExportError,
            match=re.escape(f"{path}/metadata.json: config.task_options is ")
            + f"{type(options).__name__} .*not an object of the task's options",
        ):
            _call(argv)
    (path / "metadata.json").write_text(json.dumps({**meta, "config": {"task_options": {"x": 1}}}))
    with pytest.raises(
        ExportError, match=re.escape(f"{path}/metadata.json: unknown lidar_seg option 'x'")
    ):
        _call(argv)
    (path / "metadata.json").write_text(json.dumps({**meta, "config": ["steps"]}))
    with pytest.raises(_SparkStartedError):
        _call(argv)


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_eval_every_without_heldout_bags_makes_no_validation_curve(
    spark: SparkSession,
    odom_drive: DriveResult,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """train.eval_every with no held-out bags: the trainers of a barrier stage scored their
    empty held-out shares at every eval_every-th step, and the run reported (table,
    result.json, loss.png, the model's metadata) a validation curve of NaN scores.  Now
    there is no curve, as in a single-process run, and the run says why."""
    out = tmp_path / "out"
    cfg = config(
        tmp_path,
        sync=mode,
        bags=(str(odom_drive.bag),),
        steps=4,
        eval_every=2,
        checkpoint_every=0,
        out=str(out),
    )
    with caplog.at_level(logging.WARNING, logger="adcloud.train.job"):
        result = run_training(spark, cfg, task=SummingLinearTask())
    assert result.steps == 4 and result.validation == ()
    assert json.loads((out / "result.json").read_text())["validation"] == []
    meta = json.loads((out / "model" / "metadata.json").read_text())
    assert meta["training"]["validation"] == []
    assert "train.eval_every=2 scores the held-out bags" in caplog.text
    assert "train.heldout_bags is empty" in caplog.text


def test_a_failed_write_of_the_scores_names_the_place_and_leaves_no_half_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
    counts[1, 1] = 5
    evaluation = evaluate_module.Evaluation(
        task="lidar_seg",
        model="m",
        scores={"miou": 1.0, "accuracy": float("nan")},
        per_bag={"a.bag": {"miou": 1.0}},
        samples={"a.bag": 1},
        counts=counts,
        class_names=tuple(str(i) for i in range(NUM_CLASSES)),
        seconds=0.1,
    )
    out = tmp_path / "scores dir"

    def full(self: Any, path1: str, path2: str, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalFileSystem, "mv", full)
    with pytest.raises(TrainError, match=rf"{re.escape(str(out))}: cannot write {EVAL_FILE}"):
        evaluation.write(str(out))
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    written = evaluation.write(str(out))
    assert sorted(Path(p).name for p in written) == [PLOT_FILE, EVAL_FILE]
    assert json.loads((out / EVAL_FILE).read_text())["scores"]["accuracy"] is None


def test_only_a_square_confusion_matrix_is_drawn(tmp_path: Path) -> None:
    """``adcloud train eval --out`` said it wrote confusion.png for a task whose counts are
    no confusion matrix (nothing drawn): it asks :attr:`Evaluation.plottable` now."""
    kwargs: dict[str, Any] = {
        "task": "custom",
        "model": "m",
        "scores": {"mse": 0.5},
        "per_bag": {"a.bag": {"mse": 0.5}},
        "samples": {"a.bag": 1},
        "class_names": (),
        "seconds": 0.1,
    }
    flat = evaluate_module.Evaluation(counts=np.zeros(3, dtype=np.int64), **kwargs)
    assert not flat.plottable
    assert [Path(p).name for p in flat.write(str(tmp_path / "flat"))] == [EVAL_FILE]
    square = evaluate_module.Evaluation(
        counts=np.eye(2, dtype=np.int64), **{**kwargs, "class_names": ("a", "b")}
    )
    assert square.plottable
    names = sorted(Path(p).name for p in square.write(str(tmp_path / "sq")))
    assert names == [PLOT_FILE, EVAL_FILE]
