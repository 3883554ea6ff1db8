"""The Spark training job on a real local[2] session: ETL from a real synthetic bag, the
parameter-server and all-reduce barrier stages against single-process training, the files
baseline, a trainer killed mid-training that Spark's stage retry resumes, and torchrun."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from pyspark import BarrierTaskContext, StorageLevel, TaskContext
from pyspark.sql import SparkSession

from adcloud.store import StoreServer, open_store
from adcloud.synth import DriveConfig, generate_drive
from adcloud.train import job as job_module
from adcloud.train.checkpoint import Checkpointer, latest_checkpoint
from adcloud.train.config import TrainConfig
from adcloud.train.errors import CheckpointError, DataError, ExportError, TrainError
from adcloud.train.export import inspect_model
from adcloud.train.job import (
    data_fingerprint,
    data_identity,
    etl_samples,
    local_samples,
    run_training,
    shard_samples,
)
from adcloud.train.loop import TrainResult, train
from adcloud.train.tensors import decode_tree

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Point:
    x: np.ndarray
    y: float


class LinearTask:
    """A small MLP regression over ``Point`` samples; full-batch friendly (no dropout)."""

    name = "toy_linear"
    topics = ("/odom",)

    def samples(self, topic: str, timestamp: int, decoded: Any) -> Iterator[Point]:
        if getattr(decoded, "__msgtype__", "") not in (
            "nav_msgs/msg/Odometry",
            "nav_msgs/Odometry",
        ):
            raise DataError(f"{topic}: expected nav_msgs/msg/Odometry")
        twist = decoded.twist.twist
        pos = decoded.pose.pose.position
        x = np.array([twist.linear.x / 10, twist.angular.z, pos.x / 100, pos.y / 100], np.float32)
        yield Point(x, float(0.5 * x[0] - 2.0 * x[1] + 0.1))

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def batches(
        self, samples: Sequence[Point], batch_size: int, generator: torch.Generator
    ) -> Iterator[dict[str, torch.Tensor]]:
        order = torch.randperm(len(samples), generator=generator).tolist()
        for i in range(0, len(order), batch_size):
            chosen = [samples[j] for j in order[i : i + batch_size]]
            yield {
                "x": torch.from_numpy(np.stack([s.x for s in chosen])),
                "y": torch.tensor([[s.y] for s in chosen]),
            }

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    def evaluate(self, model: torch.nn.Module, samples: Sequence[Point]) -> dict[str, float]:
        x = torch.from_numpy(np.stack([s.x for s in samples]))
        y = torch.tensor([[s.y] for s in samples])
        return {"mse": float(torch.nn.functional.mse_loss(model(x), y))}

    def example_inputs(self, samples: Sequence[Point]) -> tuple[Any, ...]:
        return (torch.from_numpy(np.stack([s.x for s in samples[:1]])),)

    def dynamic_shapes(self) -> Any:
        return None


class KillingTask(LinearTask):
    """Kills its own Spark Python worker (SIGKILL) at rank 1's 7th step, once per marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.calls = 0

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        context = TaskContext.get()
        rank = context.partitionId() if context is not None else 0
        if rank == 1 and self.calls == 7 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)


def make_points(n: int, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.05 * rng.normal(size=n)
    return [Point(x[i], float(y[i])) for i in range(n)]


def keyed_points(spark: SparkSession, points: Sequence[Point], partitions: int = 2) -> Any:
    """``((partition, ordinal), sample)`` pairs in key order, as the ETL makes them."""
    per = -(-len(points) // partitions)
    pairs = [((i // per, i % per), p) for i, p in enumerate(points)]
    return spark.sparkContext.parallelize(pairs, partitions)


def config(tmp_path: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "task": "toy_linear",
        "workers": 2,
        "steps": 8,
        "batch_size": 32,
        "lr": 0.05,
        "seed": 3,
        "checkpoint_every": 4,
        "store": "local:///train-job-tests",
        "store_options": (f"root={tmp_path / 'store'}",),
        "threads": 1,
        "sync_timeout_s": 60.0,
        "progress": False,
        "out": str(tmp_path / "out" / "{run}"),
    }
    base.update(kw)
    return TrainConfig(**base).validate()


def assert_close_parameters(a: TrainResult, b: TrainResult, atol: float) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert list(left) == list(right)
    for name in left:
        assert torch.allclose(left[name], right[name], atol=atol), name


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4 s drive without LiDAR and camera, in small chunks (several partitions)."""
    out = tmp_path_factory.mktemp("drive") / "odom.bag"
    cfg = DriveConfig(
        seconds=4, seed=3, lidar=False, camera=False, truth_raster=False, chunk_bytes=16384
    )
    return str(generate_drive(cfg, out).bag)


def test_etl_keys_bag_samples_in_record_order(spark: SparkSession, drive: str) -> None:
    task = LinearTask()
    cfg = TrainConfig(task="toy_linear", partitions_per_bag=3)
    keyed = etl_samples(spark, cfg, task, [drive])
    assert keyed.getNumPartitions() == 3
    pairs = keyed.collect()
    keys = [k for k, _ in pairs]
    assert keys == sorted(keys)
    assert {k[0] for k in keys} == {0, 1, 2}
    assert len(pairs) == 200  # /odom at 50 Hz for 4 s
    local = local_samples(task, [drive])
    assert len(local) == len(pairs)
    for (_, a), b in zip(pairs, local, strict=True):
        assert np.array_equal(a.x, b.x) and a.y == b.y
    with pytest.raises(TrainError, match="no bags"):
        etl_samples(spark, cfg, task, [])


def test_shards_deal_samples_round_robin_and_cache_them_once(
    spark: SparkSession, drive: str
) -> None:
    cfg = TrainConfig(task="toy_linear", partitions_per_bag=3)
    keyed = etl_samples(spark, cfg, LinearTask(), [drive])
    expected = [s for _, s in keyed.collect()]
    shards, sizes = shard_samples(keyed, 2)
    assert sizes == [100, 100]
    assert shards.getNumPartitions() == 2
    parts = shards.glom().collect()
    for rank, part in enumerate(parts):
        assert [i for i, _ in part] == list(range(rank, len(expected), 2))
        for i, sample in part:
            assert np.array_equal(sample.x, expected[i].x) and sample.y == expected[i].y
    # the samples are held once while training runs: the shards, not their source as well
    assert shards.is_cached and not keyed.is_cached
    cached = {int(k) for k in spark.sparkContext._jsc.getPersistentRDDs().keySet().toArray()}
    assert shards.id() in cached and keyed.id() not in cached
    shards.unpersist()


def test_single_mode_trains_in_the_driver_and_writes_outputs(
    spark: SparkSession, drive: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    cfg = config(
        tmp_path,
        sync="single",
        bags=(str(Path(drive).parent / "*.bag"),),  # a glob, as train.bags allows
        heldout_bags=(drive,),
        steps=0,
        epochs=3,
        batch_size=50,
        lr=0.02,
        out=str(out),
    )
    result = run_training(spark, cfg, task=LinearTask())
    assert result.mode == "single" and result.world == 1
    assert result.steps == 12 and len(result.losses) == 12  # 3 epochs x 200 / 50
    assert result.losses[-1] < result.losses[0]
    assert set(result.metrics) == {"mse"}
    assert json.loads((out / "result.json").read_text())["steps"] == 12
    assert json.loads((out / "settings.json").read_text())["train"]["epochs"] == 3
    stored = (out / "parameters.tensors").read_bytes()
    assert stored == result.parameters
    assert (out / "loss.png").stat().st_size > 1000
    meta = json.loads((out / "model" / "metadata.json").read_text())
    assert meta["task"] == "toy_linear" and meta["metrics"] == result.metrics
    digest = hashlib.sha256(Path(drive).read_bytes()).hexdigest()
    assert [(b["uri"], b["sha256"]) for b in meta["data"]["bags"]] == [(drive, digest)]
    program = torch.export.load(str(out / "model" / "model.pt2")).module()
    x = torch.randn(1, 4)  # exported with the example batch of one
    model = LinearTask().build_model()
    model.load_state_dict(result.state_dict())
    torch.testing.assert_close(program(x), model(x))
    store = open_store(cfg.store, **cfg.store_kwargs())
    info = latest_checkpoint(store, result.run)
    assert info is not None and info.step == 12


def test_a_run_given_no_output_place_still_writes_its_model(
    spark: SparkSession, drive: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every finished run leaves a deployable model: by default under
    ``adcloud-runs/<run>`` in the driver's working directory."""
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, sync="single", bags=(drive,), steps=2, batch_size=50)
    cfg = cfg.replace(out=TrainConfig().out)
    result = run_training(spark, cfg, task=LinearTask())
    assert result.output == str(tmp_path / "adcloud-runs" / result.run)
    info = inspect_model(Path(result.output) / "model")
    assert info["task"] == "toy_linear" and info["training"]["run"] == result.run
    written = json.loads((Path(result.output) / "result.json").read_text())
    assert written["output"] == result.output and written["steps"] == 2
    with pytest.raises(TrainError, match="out must name where the run's model goes"):
        cfg.replace(out=" ").validate()


def test_same_bags_resume_and_changed_bags_start_a_new_run(
    spark: SparkSession, drive: str, tmp_path: Path
) -> None:
    """The default run id covers the bags' identity: re-running the same config on the same
    bag resumes its finished run, while a bag regenerated at the same path (other data)
    trains from step 0 instead of resuming checkpoints of the old data."""
    bag = tmp_path / "drive.bag"
    shutil.copyfile(drive, bag)
    cfg = config(tmp_path, sync="single", bags=(str(bag),), steps=6, batch_size=50)
    first = run_training(spark, cfg, task=LinearTask())
    again = run_training(spark, cfg, task=LinearTask())
    assert again.run == first.run and again.start_step == 6  # nothing left to train
    other = DriveConfig(
        seconds=4, seed=11, lidar=False, camera=False, truth_raster=False, chunk_bytes=16384
    )
    generate_drive(other, bag, overwrite=True)
    fresh = run_training(spark, cfg, task=LinearTask())
    assert fresh.run != first.run and fresh.run.startswith("toy_linear-")
    assert fresh.start_step == 0 and fresh.losses != first.losses
    assert cfg.replace(run="named").run_id(data_identity([str(bag)])) == "named"


def _odom_drive(path: Path, seed: int) -> str:
    """A 4 s odometry-only drive like ``drive``'s, written (or rewritten) at ``path``."""
    cfg = DriveConfig(
        seconds=4, seed=seed, lidar=False, camera=False, truth_raster=False, chunk_bytes=16384
    )
    return str(generate_drive(cfg, path, overwrite=True).bag)


def test_a_named_run_resumed_on_changed_bags_is_refused_naming_them(
    spark: SparkSession, drive: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A named run's checkpoints record what its bags were: resumed on a bag regenerated at
    the same path, or with a bag added or removed, it is refused before any Spark work,
    naming each bag and how to go on, instead of training one model on two datasets; on
    the same bags it resumes as before, and with resume_changed_data it resumes on the new
    data (whose fingerprint its next checkpoints record)."""
    bag = tmp_path / "drive.bag"
    shutil.copyfile(drive, bag)
    extra = tmp_path / "extra.bag"
    shutil.copyfile(drive, extra)
    cfg = config(
        tmp_path, sync="single", bags=(str(bag),), run="named", steps=2, checkpoint_every=2
    )
    assert run_training(spark, cfg, task=LinearTask()).start_step == 0
    same = run_training(spark, cfg.replace(steps=4), task=LinearTask())
    assert same.run == "named" and same.start_step == 2  # unchanged bags: resumed

    _odom_drive(bag, seed=11)  # regenerated in place: other data at the same path
    with pytest.raises(CheckpointError) as refused:
        run_training(spark, cfg.replace(steps=6), task=LinearTask())
    said = str(refused.value)
    assert re.search(
        rf"run named: the training data changed since its checkpoint \S+step-000000004 "
        rf"\(step 4\) was written: {re.escape(str(bag))} changed \((\d+ -> \d+ bytes, )?"
        r"written \S+ -> \S+\)\. ",
        said,
    ), said
    assert "a new name (train.run" in said and "train.resume_changed_data=true" in said
    # nothing was trained: the newest checkpoint is still the one of the old data
    store = open_store(cfg.store, **cfg.store_kwargs())
    assert latest_checkpoint(store, "named").step == 4  # type: ignore[union-attr]

    with pytest.raises(CheckpointError, match=rf"{re.escape(str(extra))} added to the bags"):
        job_module.preflight(cfg.replace(bags=(str(bag), str(extra)), steps=6), LinearTask())

    with caplog.at_level(logging.WARNING, logger="adcloud.train.job"):
        moved = run_training(
            spark, cfg.replace(steps=6, resume_changed_data=True), task=LinearTask()
        )
    assert moved.run == "named" and moved.start_step == 4 and moved.steps == 6
    assert "resumes at step 4 on other training data" in caplog.text
    assert f"{bag} changed" in caplog.text
    # the checkpoints written since record the new data: resumed on it, no override needed
    assert run_training(spark, cfg.replace(steps=8), task=LinearTask()).start_step == 6
    # and the bag the run started on is now the one it was not trained on last
    shutil.copyfile(drive, bag)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bag))} changed"):
        job_module.preflight(cfg.replace(steps=10), LinearTask())
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bag))} removed from the bags"):
        job_module.preflight(cfg.replace(bags=(str(extra),), steps=10), LinearTask())


def test_two_trainer_checkpoints_record_the_bags_they_were_trained_on(
    spark: SparkSession, drive: str, tmp_path: Path
) -> None:
    """The trainers in the executors write the checkpoints of a ps or allreduce run: they
    record the fingerprint the driver took, so a resume on other data is refused too."""
    bag = tmp_path / "drive.bag"
    shutil.copyfile(drive, bag)
    cfg = config(tmp_path, sync="allreduce", bags=(str(bag),), run="pair-data", steps=2)
    run_training(spark, cfg, task=LinearTask())
    store = open_store(cfg.store, **cfg.store_kwargs())
    info = latest_checkpoint(store, "pair-data")
    assert info is not None and info.data == data_fingerprint([str(bag)])
    _odom_drive(bag, seed=11)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bag))} changed"):
        job_module.preflight(cfg.replace(steps=4), LinearTask())


def test_a_run_resumed_with_other_task_options_is_refused(drive: str, tmp_path: Path) -> None:
    """Task options decide the samples the bags give (a topic, a voxel size): resumed with
    others, the run would also mix two datasets."""
    cfg = config(tmp_path, sync="single", bags=(drive,), run="opts", steps=2)
    store = open_store(cfg.store, **cfg.store_kwargs())
    saver = Checkpointer(
        store,
        "opts",
        every=2,
        settings=cfg.pinned_settings(),
        data=data_fingerprint([drive]),
    )
    train(LinearTask(), make_points(32), cfg, None, saver)
    assert job_module.preflight(cfg, LinearTask()) == "opts"
    other = cfg.replace(task_options={"topic": "/odom/other"})
    with pytest.raises(CheckpointError, match=r"task_options \{\} -> \{'topic': '/odom/other'\}"):
        job_module.preflight(other, LinearTask())
    assert job_module.preflight(other.replace(resume_changed_data=True), LinearTask()) == "opts"
    # the override as the command line and the environment give it
    loaded = TrainConfig.load(environ={"ADCLOUD_TRAIN_RESUME_CHANGED_DATA": "true"})
    assert loaded.resume_changed_data is True
    assert TrainConfig.load(environ={}, resume_changed_data="false").resume_changed_data is False


def test_a_torchrun_rank_resumed_on_changed_bags_is_refused_before_it_joins(
    drive: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun every process checks the checkpoint against the bags itself, before
    it decodes them and waits for the process group."""
    bag = tmp_path / "drive.bag"
    shutil.copyfile(drive, bag)
    cfg = config(tmp_path, sync="allreduce", workers=1, bags=(str(bag),), run="tr-data")
    store = open_store(cfg.store, **cfg.store_kwargs())
    saver = Checkpointer(
        store, "tr-data", every=2, settings=cfg.pinned_settings(), data=data_fingerprint([str(bag)])
    )
    train(LinearTask(), make_points(32), cfg.replace(steps=2), None, saver)
    _odom_drive(bag, seed=11)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # no process group is ever opened
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(bag))} changed"):
        job_module.run_torchrun(cfg, task=LinearTask())


def test_checkpoints_without_a_data_fingerprint_still_resume(
    drive: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints an older adcloud wrote record no fingerprint: they resume, with a
    warning that the bags cannot be checked."""
    cfg = config(tmp_path, sync="single", bags=(drive,), run="older", steps=2)
    store = open_store(cfg.store, **cfg.store_kwargs())
    saver = Checkpointer(store, "older", every=2, settings=cfg.pinned_settings())
    train(LinearTask(), make_points(32), cfg, None, saver)
    assert latest_checkpoint(store, "older").data is None  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="adcloud.train.job"):
        assert job_module.preflight(cfg.replace(steps=4), LinearTask()) == "older"
    assert "records no fingerprint of the bags it was trained on" in caplog.text


def test_the_data_fingerprint_follows_writes_not_reads_or_modes(tmp_path: Path) -> None:
    """Rewritten, edited in place (even to the same size) or grown by a file (a rosbag2
    directory): another fingerprint; read, chmod-ed: the same one."""
    bag = tmp_path / "a.bag"
    bag.write_bytes(b"x" * 100)
    first = data_fingerprint([str(bag)])[str(bag)]
    assert first["bytes"] == 100 and first["files"] == 1 and first["modified"]
    bag.read_bytes()
    bag.chmod(0o600)
    assert data_fingerprint([str(bag)])[str(bag)] == first
    stat = bag.stat()
    with bag.open("r+b") as f:  # same size, other bytes
        f.write(b"y")
    os.utime(bag, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    edited = data_fingerprint([str(bag)])[str(bag)]
    assert edited["stamp"] != first["stamp"] and edited["bytes"] == 100
    (changed,) = job_module.data_changes({str(bag): first}, {str(bag): edited})
    assert changed.startswith(f"{bag} changed (")  # written within the same ms, perhaps

    # the same bag named by a file:// URL or by its path
    assert data_fingerprint([f"file://{bag}"]) == data_fingerprint([str(bag)])

    folder = tmp_path / "ros2"
    folder.mkdir()
    (folder / "metadata.yaml").write_text("rosbag2_bagfile_information: {}\n")
    before = data_fingerprint([str(folder)])
    (folder / "ros2_0.mcap").write_bytes(b"m" * 10)
    after = data_fingerprint([str(folder)])
    (changed,) = job_module.data_changes(before, after)
    assert "1 -> 2 files" in changed


def test_ps_and_allreduce_follow_the_single_process_curve(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Full-batch steps: the two shards' averaged gradient is the whole batch's gradient, so
    the three modes must agree up to float32 summation order -- with a learning-rate
    schedule, which every mode must apply at the same steps."""
    points = make_points(32)
    schedule = {"lr": 0.15, "schedule": "cosine", "warmup_steps": 2, "final_lr_ratio": 0.1}
    results = {
        mode: run_training(
            spark,
            config(tmp_path, sync=mode, run=f"curve-{mode}", **schedule),
            task=LinearTask(),
            keyed=keyed_points(spark, points),
        )
        for mode in ("single", "ps", "allreduce")
    }
    single = results["single"]
    assert single.losses[-1] < 0.5 * single.losses[0]
    for mode in ("ps", "allreduce"):
        result = results[mode]
        assert (result.mode, result.world, result.shard_size) == (mode, 2, 16)
        assert result.losses == pytest.approx(single.losses, rel=1e-5)
        assert_close_parameters(result, single, atol=1e-5)
        assert result.sync["bytes_sent"] > 0
    store = open_store("local:///train-job-tests", root=str(tmp_path / "store"))
    # the parameter server left its last versions and nothing else behind
    assert sorted(e.name for e in store.list("/curve-ps")) == ["checkpoints", "params"]
    assert json.loads(store.get("/curve-ps/params/latest"))["version"] == 8
    for mode in ("ps", "allreduce"):
        info = latest_checkpoint(store, f"curve-{mode}")
        assert info is not None and (info.step, info.world) == (8, 2)


def test_ps_runs_on_an_alluxio_store_as_on_the_local_one(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``sync=ps`` through ``alluxio://``: the executors' trainers exchange gradients and
    parameter versions with a store served over the Alluxio REST proxy API (``adcloud store
    serve``, the stand-in for an Alluxio proxy) and follow the local store's curve."""
    points = make_points(32)
    keyed = keyed_points(spark, points).persist(StorageLevel.MEMORY_AND_DISK)
    local = run_training(
        spark, config(tmp_path, sync="ps", run="ps-local", lr=0.1), task=LinearTask(), keyed=keyed
    )
    # the caller's samples: not unpersisted under it (nor persisted at another level: Spark
    # refused that)
    assert keyed.is_cached and keyed.getStorageLevel() == StorageLevel.MEMORY_AND_DISK
    keyed.unpersist()
    backing = open_store("local:///served", root=str(tmp_path / "served"))
    server = StoreServer(backing, port=0, token="train-token").start()
    try:
        remote = run_training(
            spark,
            config(
                tmp_path,
                sync="ps",
                run="ps-remote",
                lr=0.1,
                store=server.uri,
                store_options=("token=train-token",),
            ),
            task=LinearTask(),
            keyed=keyed_points(spark, points),
        )
        assert json.loads(backing.get("/ps-remote/params/latest"))["version"] == 8
        info = latest_checkpoint(backing, "ps-remote")
        assert info is not None and (info.step, info.world) == (8, 2)
    finally:
        server.shutdown()
        backing.close()
    assert remote.losses == pytest.approx(local.losses, rel=1e-6)
    assert_close_parameters(remote, local, atol=1e-6)
    assert remote.sync["bytes_sent"] > 0 and remote.sync["bytes_received"] > 0


def test_minibatch_ps_and_allreduce_agree_with_each_other(
    spark: SparkSession, tmp_path: Path
) -> None:
    """With minibatches the shards' batches are not the single process's, but both
    distributed modes see the same ones and the curves stay close to the single one."""
    points = make_points(64, seed=1)
    kw = {"steps": 24, "batch_size": 8, "checkpoint_every": 0, "lr": 0.03}
    runs = {
        mode: run_training(
            spark,
            config(tmp_path, sync=mode, run=f"mini-{mode}", **kw),
            task=LinearTask(),
            keyed=keyed_points(spark, points),
        )
        for mode in ("single", "ps", "allreduce")
    }
    assert runs["ps"].losses == pytest.approx(runs["allreduce"].losses, rel=1e-5)
    single = np.array(runs["single"].losses)
    ps = np.array(runs["ps"].losses)
    assert ps[-8:].mean() < 0.5 * ps[:4].mean()
    assert abs(ps[-8:].mean() - single[-8:].mean()) < 0.25 * single[:4].mean()


def test_files_baseline_trains_the_same(spark: SparkSession, drive: str, tmp_path: Path) -> None:
    kw = {"sync": "single", "bags": (drive,), "steps": 6, "batch_size": 40}
    memory = run_training(spark, config(tmp_path, run="mem", **kw), task=LinearTask())
    files_dir = tmp_path / "etl"
    files = run_training(
        spark,
        config(
            tmp_path, run="files", etl="files", etl_dir=str(files_dir), keep_etl_files=True, **kw
        ),
        task=LinearTask(),
    )
    assert files.losses == memory.losses
    parts = sorted(files_dir.glob("part-*.tensors"))  # kept, as asked
    assert parts
    tree, meta = decode_tree(parts[0].read_bytes())  # pickle-free, versioned
    assert meta == {"format": "adcloud-samples", "version": 1}
    assert set(tree["samples"][0]) == {"x", "y"}


class FailingTask(LinearTask):
    """Fails at its first step."""

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        raise TrainError("the task failed on purpose")


def test_a_files_run_removes_its_own_samples_from_the_etl_dir_and_nothing_else(
    spark: SparkSession, drive: str, tmp_path: Path
) -> None:
    """The files baseline's samples are intermediates no later run reads: a run left its
    part files in train.etl_dir for good.  Now they go when it ends, finished or failed;
    the user's files and another run's stay, and a directory the run made goes too."""
    kw = {"sync": "single", "bags": (drive,), "steps": 2, "batch_size": 40, "etl": "files"}
    shared = tmp_path / "etl"
    shared.mkdir()
    (shared / "README").write_text("team scratch space\n")
    another = shared / "part-0123456789ab-00000.tensors"  # a concurrent run's
    another.write_bytes(b"samples")
    run_training(spark, config(tmp_path, run="tidy", etl_dir=str(shared), **kw), task=LinearTask())
    assert sorted(p.name for p in shared.iterdir()) == ["README", another.name]
    with pytest.raises(Exception, match="the task failed on purpose"):
        run_training(
            spark, config(tmp_path, run="failed", etl_dir=str(shared), **kw), task=FailingTask()
        )
    assert sorted(p.name for p in shared.iterdir()) == ["README", another.name]
    made = tmp_path / "new" / "etl"
    run_training(spark, config(tmp_path, run="made", etl_dir=str(made), **kw), task=LinearTask())
    assert not made.exists() and (tmp_path / "new").is_dir()
    kept = config(tmp_path, run="kept", etl_dir=str(made), keep_etl_files=True, **kw)
    run_training(spark, kept, task=LinearTask())
    assert sorted(made.glob("part-*.tensors"))  # kept, as asked


def test_runs_sharing_an_etl_dir_read_their_own_samples(
    spark: SparkSession, tmp_path: Path
) -> None:
    # train.etl_dir set once for a team (a directory every host mounts): a second run's ETL
    # must not replace the first run's files, which Spark reads again whenever it recomputes
    shared = str(tmp_path / "etl")
    first, second = make_points(6, seed=1), make_points(6, seed=2)
    read_first = job_module.etl_to_files(spark, keyed_points(spark, first), shared)
    read_second = job_module.etl_to_files(spark, keyed_points(spark, second), shared)
    for read, points in ((read_first, first), (read_second, second)):
        got = [p.y for _, p in sorted(read.collect(), key=lambda kv: kv[0])]
        assert got == [p.y for p in points]


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_a_killed_trainer_is_retried_by_spark_and_resumes(
    spark: SparkSession, tmp_path: Path, mode: str
) -> None:
    """Rank 1's Python worker is SIGKILLed at step 7; Spark reruns the barrier stage and both
    trainers resume from the checkpoint at step 4 to the uninterrupted result.  In ps mode
    the versions the dead attempt published are in the store under the same keys: the new
    attempt's session must never take them for its own."""
    points = make_points(32)
    marker = tmp_path / "killed.pid"
    # a dead peer breaks gloo at once; a parameter server notices through Spark killing the
    # stage, the timeout is only the backstop
    cfg = config(tmp_path, sync=mode, steps=10, run=f"killed-{mode}", sync_timeout_s=20.0)
    killed = run_training(
        spark, cfg, task=KillingTask(str(marker)), keyed=keyed_points(spark, points)
    )
    assert marker.exists()  # the first attempt really died
    assert killed.start_step == 4  # the retry resumed from the checkpoint
    whole = run_training(
        spark,
        cfg.replace(run=f"whole-{mode}"),
        task=LinearTask(),
        keyed=keyed_points(spark, points),
    )
    assert whole.start_step == 0
    assert killed.losses == whole.losses
    assert_close_parameters(killed, whole, atol=0.0)
    # the second attempt of the stage trained the result, and result.json says so
    assert (killed.sync["attempt"], whole.sync["attempt"]) == (1, 0)
    written = json.loads((Path(str(killed.output)) / "result.json").read_text())
    assert written["sync"]["attempt"] == 1


def test_torchrun_runs_the_same_training_function(spark: SparkSession, tmp_path: Path) -> None:
    points = make_points(32)
    cfg = config(tmp_path, sync="allreduce", run="torchrun", out=str(tmp_path / "tr"))
    script = tmp_path / "torchrun_main.py"
    script.write_text(
        "import importlib.util, sys\n"
        "from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('job_tests', {str(Path(__file__))!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['job_tests'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "from adcloud.train.job import run_torchrun\n"
        f"cfg = mod.config(Path({str(tmp_path)!r}), sync='allreduce', run='torchrun', "
        f"out={str(tmp_path / 'tr')!r})\n"
        "run_torchrun(cfg, task=mod.LinearTask(), samples=mod.make_points(32))\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "tr" / "result.json").read_text())
    assert (result["mode"], result["world"], result["steps"]) == ("allreduce", 2, 8)
    single = train(LinearTask(), points, cfg.replace(sync="single", run="torchrun-ref"))
    assert result["losses"] == pytest.approx(list(single.losses), rel=1e-5)
    meta = json.loads((tmp_path / "tr" / "model" / "metadata.json").read_text())
    assert meta["training"]["mode"] == "allreduce" and meta["training"]["trainers"] == 2
    assert (tmp_path / "tr" / "model" / "model.pt2").stat().st_size > 0


class OtherTopicTask(LinearTask):
    topics = ("/no/such/topic",)


def test_a_blank_bag_entry_names_no_bag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `--set heldout_bags=` (clearing them) or "a.bag," in ADCLOUD_TRAIN_BAGS: a blank entry
    # kept would stand for the working directory, and every bag in it would be read
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stray.bag").write_bytes(b"")
    cleared = TrainConfig.load(environ={}, bags="", heldout_bags="")
    assert (cleared.bags, cleared.heldout_bags) == ((), ())
    with pytest.raises(TrainError, match="no bags to train on"):
        job_module.check_bags(cleared)
    env = {"ADCLOUD_TRAIN_BAGS": "a.bag, ,b.bag,"}
    assert TrainConfig.load(environ=env).bags == ("a.bag", "b.bag")
    assert TrainConfig(heldout_bags=("", " ")).heldout_bags == ()


def test_a_bag_both_trained_on_and_held_out_is_pointed_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The held-out scores of a bag also trained on say nothing of how the model generalises."""
    bags = [tmp_path / f"{name}.bag" for name in ("a", "b")]
    for bag in bags:
        bag.write_bytes(b"")
    with caplog.at_level("WARNING", logger="adcloud.train.job"):
        job_module.check_bags(TrainConfig(bags=(str(bags[0]),), heldout_bags=(str(bags[1]),)))
        assert not caplog.records
        job_module.check_bags(TrainConfig(bags=(str(tmp_path),), heldout_bags=(str(bags[1]),)))
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"{bags[1]} also in train.bags: the held-out scores include data" in said


def test_job_errors_are_clear(spark: SparkSession, drive: str, tmp_path: Path) -> None:
    keyed = keyed_points(spark, make_points(8))
    with pytest.raises(
        TrainError,
        match=r"train.workers=3 trainers run as one Spark barrier stage and need 3 task slots "
        r"at once, but the application on local\[2\] has 2 .*lower train.workers to 2",
    ):
        run_training(
            spark,
            config(tmp_path, sync="ps", workers=3, batch_size=3),
            task=LinearTask(),
            keyed=keyed,
        )
    with pytest.raises(TrainError, match="unknown task 'nope'"):
        run_training(spark, config(tmp_path, task="nope", sync="single", bags=("x.bag",)))
    with pytest.raises(TrainError, match="gave no samples for task toy_linear"):
        run_training(
            spark,
            config(tmp_path, sync="single", bags=(drive,)),
            task=OtherTopicTask(),
        )
    with pytest.raises(TrainError, match="cannot fill 2 shards"):
        run_training(
            spark,
            config(tmp_path, sync="ps"),
            task=LinearTask(),
            keyed=keyed_points(spark, make_points(1), partitions=1),
        )


def _slots(items: Iterable[int]) -> Iterator[tuple[int, int, int, int]]:
    context = BarrierTaskContext.get()
    rank = context.partitionId()
    index, count = job_module._local_slot(context, rank)
    yield rank, index, count, job_module._cuda_index(context, rank)


def test_trainers_take_the_gpu_of_their_place_on_their_host(spark: SparkSession) -> None:
    """On one host the trainers' CUDA devices are 0, 1, ...: their places there (with no
    GPUs scheduled by Spark), which on a second host start again at 0 -- not the global
    rank, which would put two trainers of that host on one GPU."""
    rdd = spark.sparkContext.parallelize(range(2), 2)
    found = sorted(rdd.barrier().mapPartitions(_slots).collect())
    assert found == [(0, 0, 2, 0), (1, 1, 2, 1)]


class _JoinedError(Exception):
    """Raised in place of joining a process group: the test has what it wanted to see."""


@pytest.mark.parametrize(("gpus", "backend"), [(1, "gloo"), (2, "nccl")])
def test_torchrun_ranks_sharing_a_gpu_reduce_through_gloo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gpus: int, backend: str
) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): torchrun's trainers on
    a host with fewer GPUs than trainers join a gloo group (which reduces CUDA tensors)."""
    from adcloud.train import job  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(job, "resolve_device", lambda name, index: torch.device("cuda", 0))
    chosen: list[str] = []

    def joined(**kw: Any) -> None:
        chosen.append(kw["backend"])
        raise _JoinedError

    monkeypatch.setattr(job.AllReduceSync, "from_env", staticmethod(joined))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    cfg = config(tmp_path, sync="allreduce", device="cuda", run="gpu-share")
    with pytest.raises(_JoinedError):
        job.run_torchrun(cfg, task=LinearTask(), samples=make_points(8))
    assert chosen == [backend]


#: What every run writes beside its model/ (no held-out bags: no eval.json).
_RUN_FILES = {"loss.png", "parameters.tensors", "result.json", "settings.json"}


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by its relative path, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_held_out_scores_of_no_labelled_data_do_not_fail_the_export(tmp_path: Path) -> None:
    # held-out bags without one labelled point score NaN (no class to average): the trained
    # run must still be written, its metadata holding null as eval.json does
    points = make_points(32)
    out = tmp_path / "out"
    cfg = config(tmp_path, sync="single", run="nan-scores", checkpoint_every=0, out=str(out))
    result = train(LinearTask(), points, cfg.replace(steps=2))
    result = dataclasses.replace(result, metrics={"miou": float("nan"), "accuracy": 0.5})
    job_module.write_outputs(result, cfg, str(out), task=LinearTask(), examples=points[:1])
    assert inspect_model(out / "model")["metrics"] == {"miou": None, "accuracy": 0.5}


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ExportError])
def test_an_interrupted_or_failed_export_leaves_the_earlier_outputs_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: type[BaseException]
) -> None:
    """The outputs are replaced as a whole: Ctrl-C or a failure while the model is exported
    leaves the earlier run's files -- not a new result.json beside an old model/ that
    ``adcloud train inspect`` calls valid -- and no staging directory; a later write then
    replaces them all, the stale eval.json too, and keeps what a run does not write."""
    points = make_points(32)
    out = tmp_path / "out"
    cfg = config(tmp_path, sync="single", run="outputs", checkpoint_every=0, out=str(out))
    first = train(LinearTask(), points, cfg.replace(steps=3))
    job_module.write_outputs(first, cfg, str(out), task=LinearTask(), examples=points[:1])
    (out / "eval.json").write_text('{"scores": {}}')  # an earlier run's scores
    (out / "nov").mkdir()  # adcloud train eval --out OUT/nov
    (out / "nov" / "eval.json").write_text("{}")
    before = _tree(out)

    second = train(LinearTask(), points, cfg.replace(steps=5))

    def export_fails(*args: Any, **kwargs: Any) -> None:
        raise stop("stopped while exporting")

    with monkeypatch.context() as patch:
        patch.setattr(job_module, "export_model", export_fails)
        with pytest.raises(stop):
            job_module.write_outputs(second, cfg, str(out), task=LinearTask(), examples=points)
    assert _tree(out) == before
    assert {p.name for p in out.iterdir()} == {*_RUN_FILES, "eval.json", "model", "nov"}

    job_module.write_outputs(second, cfg, str(out), task=LinearTask(), examples=points[:1])
    assert json.loads((out / "result.json").read_text())["steps"] == 5
    assert inspect_model(out / "model")["training"]["steps"] == 5
    assert (out / "parameters.tensors").read_bytes() == second.parameters
    assert not (out / "eval.json").exists() and not (out / "_temporary").exists()
    assert (out / "nov" / "eval.json").read_text() == "{}"


def test_outputs_go_to_an_fsspec_url_as_a_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``file://`` or ``memory://`` out: staged there and moved into place the same way."""
    points = make_points(32)
    cfg = config(tmp_path, sync="single", run="urls", checkpoint_every=0)
    first = train(LinearTask(), points, cfg.replace(steps=3))
    second = train(LinearTask(), points, cfg.replace(steps=4))
    url = f"memory://outputs-{os.getpid()}/{tmp_path.name}/run"
    for out in (f"file://{tmp_path / 'file-url'}", url):
        fs, root = fsspec.core.url_to_fs(out)
        job_module.write_outputs(first, cfg, out, task=LinearTask(), examples=points[:1])
        with monkeypatch.context() as patch:
            patch.setattr(job_module, "export_model", lambda *a, **k: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                job_module.write_outputs(second, cfg, out, task=LinearTask(), examples=points)
        assert json.loads(fs.cat_file(f"{root}/result.json"))["steps"] == 3
        assert not fs.exists(f"{root}/_temporary")
        job_module.write_outputs(second, cfg, out, task=LinearTask(), examples=points[:1])
        assert json.loads(fs.cat_file(f"{root}/result.json"))["steps"] == 4
        assert inspect_model(f"{out}/model")["training"]["steps"] == 4
        names = {posixpath.basename(p) for p in fs.find(root)}
        assert names == {*_RUN_FILES, "metadata.json", "model.pt2"}


def test_a_run_resumed_with_fewer_steps_than_its_checkpoint_is_refused_before_spark(
    drive: str, tmp_path: Path
) -> None:
    cfg = config(tmp_path, sync="single", bags=(drive,), run="past", steps=6, checkpoint_every=3)
    store = open_store(cfg.store, **cfg.store_kwargs())
    train(LinearTask(), make_points(32), cfg, None, Checkpointer(store, "past", every=3))
    assert job_module.preflight(cfg, LinearTask()) == "past"  # as many steps: fine
    with pytest.raises(
        CheckpointError, match=r"step-000000006 is at step 6, past this run's 3 steps"
    ):
        job_module.preflight(cfg.replace(steps=3), LinearTask())


def test_a_heldout_bag_without_the_task_s_topic_is_refused_before_spark(
    drive: str, tmp_path: Path
) -> None:
    """Found from the bag's index before training, not once the training is done (when the
    held-out scores come up empty and nothing is written)."""
    cfg = config(tmp_path, sync="single", bags=(drive,), heldout_bags=(drive,))
    assert job_module.preflight(cfg, LinearTask()).startswith("toy_linear-")
    with pytest.raises(
        TrainError,
        match=rf"train.heldout_bags: {re.escape(drive)} has no messages on /no/such/topic, "
        r"which task toy_linear scores \(its topics: .*/odom.*\)",
    ):
        job_module.preflight(cfg, OtherTopicTask())


def test_an_output_place_that_is_a_file_is_refused_before_spark(drive: str, tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("not a directory")
    cfg = config(tmp_path, sync="single", bags=(drive,), out=str(tmp_path / "taken"))
    with pytest.raises(TrainError, match=r"train.out: .*taken is a file"):
        job_module.preflight(cfg, LinearTask())


def test_a_two_trainer_checkpoint_resumed_by_a_single_run_says_how_to_resume(
    drive: str, tmp_path: Path
) -> None:
    """``workers=2`` alone does nothing under sync=single: the advice names the sync too."""
    cfg = config(tmp_path, sync="single", bags=(drive,), run="pair")
    store = open_store(cfg.store, **cfg.store_kwargs())
    model = LinearTask().build_model()
    saver = Checkpointer(store, "pair", every=1)
    for rank in (1, 0):  # rank 0 publishes once every part is there
        saver.save(
            1, rank=rank, world=2, model=model, optimizer=None, epoch=0, batch_index=1, losses=[1.0]
        )
    with pytest.raises(CheckpointError, match=r"run with sync=allreduce \(or ps\) and workers=2"):
        job_module.preflight(cfg, LinearTask())
    with pytest.raises(CheckpointError, match=r"run with sync=allreduce \(or ps\) and workers=2"):
        saver.restore(rank=0, world=1)


def test_the_torchrun_entry_point_says_errors_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        job_module.main(["--help"])
    shown = capsys.readouterr().out
    keys = re.findall(r"--set\s+([a-z_.]+)=", shown)
    assert keys == ["steps"]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(keys) <= fields
    assert job_module.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "missing.yaml" in err[0]
    assert job_module.main(["--set", "sync_timeout_s=inf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: invalid train settings: sync_timeout_s must be > 0 and finite (seconds), not inf"
    ]


def test_the_torchrun_entry_point_runs_where_pyspark_is_not_installed(tmp_path: Path) -> None:
    """A GPU node running ``torchrun -m adcloud.train.job`` needs torch, not Spark: the entry
    point (and everything it imports) loads with pyspark made unimportable."""
    blocked = "import sys; sys.modules['pyspark'] = None; import runpy; "
    code = (
        blocked
        + "sys.argv = ['job', '--help']; runpy.run_module('adcloud.train.job', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "torchrun" in done.stdout


class PausingTask(LinearTask):
    """Rank 1, at its 3rd step of the first attempt: writes ``ready`` in ``where``, waits
    for ``go`` there, then SIGKILLs its own Spark Python worker."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls = 0

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        context = TaskContext.get()
        ready, go = Path(self.where, "ready"), Path(self.where, "go")
        rank = context.partitionId() if context is not None else 0
        if rank == 1 and self.calls == 3 and not ready.exists():
            ready.write_text(str(os.getpid()))
            deadline = time.monotonic() + 60
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)


def _hold_until(release: str) -> Iterator[int]:
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield 0


def test_a_retry_that_cannot_get_its_task_slots_is_cancelled_with_a_clear_error(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A trainer dies, and before Spark reruns the barrier stage another job of the
    application (a notebook's) takes the freed slot -- as a lost worker takes its slots for
    good.  The retry needs both slots at once and waited for them silently for ever; now it
    is cancelled after sync_timeout_s and a margin, with an error that says what to do, and
    the run resumes from its checkpoint when started again."""
    sc = spark.sparkContext
    release = tmp_path / "release"
    held: list[Any] = []

    def notebook() -> None:  # another job of the application, in a thread of its own
        sc.setJobGroup("notebook", "holds a task slot")
        held.extend(
            sc.parallelize([0], 1).mapPartitions(lambda _: _hold_until(str(release))).collect()
        )

    def kill_once_the_job_waits() -> None:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        threads.append(threading.Thread(target=notebook, daemon=True))
        threads[-1].start()
        while not sc.statusTracker().getJobIdsForGroup("notebook"):
            time.sleep(0.02)
        (tmp_path / "go").write_text("")

    threads = [threading.Thread(target=kill_once_the_job_waits, daemon=True)]
    threads[0].start()
    cfg = config(
        tmp_path, sync="allreduce", steps=8, checkpoint_every=2, run="stalled", sync_timeout_s=8.0
    )
    started = time.monotonic()
    try:
        with pytest.raises(TrainError) as failed:
            run_training(
                spark,
                cfg,
                task=PausingTask(str(tmp_path)),
                keyed=keyed_points(spark, make_points(32)),
            )
        waited = time.monotonic() - started
    finally:
        release.write_text("")
        for thread in threads:
            thread.join(timeout=120)
    said = str(failed.value)
    assert said.startswith("run stalled: no task of its barrier stage has run for ")
    assert "(train.sync_timeout_s=8 plus 5 s): its 2 trainers need 2 task slots at once" in said
    assert "the application has 2 task slot(s) now" in said
    assert "Run it again (run stalled) once the cluster has the slots: it resumes" in said
    assert waited < 120  # cancelled, not left waiting
    assert held == [0]  # the other job was left alone
    store = open_store(cfg.store, **cfg.store_kwargs())
    try:  # what the run, started again, resumes from
        checkpoint = latest_checkpoint(store, "stalled")
    finally:
        store.close()
    assert checkpoint is not None and checkpoint.step == 2


_KILLED_DRIVER = """
import os, signal, sys
from adcloud._scratch import make_scratch
path = make_scratch("adcloud-etl-", sys.argv[1])
(path / "part-00000.tensors").write_bytes(b"x" * 1000)
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


class ScratchSeeingTask(LinearTask):
    """Notes, at its first step (in the driver: ``sync=single``), what ``where`` holds."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.seen: list[str] = []

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.seen:
            self.seen = sorted(p.name for p in self.where.iterdir())
        return super().loss(model, batch)


def test_the_files_baseline_s_scratch_samples_go_even_after_a_killed_driver(
    spark: SparkSession, drive: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without train.etl_dir the samples go to a scratch directory of the driver: a driver
    killed with ``kill -9`` left it (gigabytes) in /tmp until a reboot; the next run removes
    it, and its own goes when it ends."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_DRIVER, str(scratch)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL
    left = Path(killed.stdout.strip())
    assert (left / "part-00000.tensors").exists()
    task = ScratchSeeingTask(scratch)
    cfg = config(tmp_path, run="scratch", sync="single", etl="files", bags=(drive,), steps=2)
    run_training(spark, cfg, task=task)
    etl = [name for name in task.seen if name.startswith("adcloud-etl-")]
    made = etl[0]
    assert made != left.name
    assert etl == [made, f"{made}.owner"]  # the killed driver's went before the ETL
    assert not [p for p in scratch.iterdir() if p.name.startswith("adcloud-etl-")]
    # a run in the default mode (etl=memory, no scratch of its own) removes one too: it
    # stayed until the next files-mode run
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_DRIVER, str(scratch)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert Path(killed.stdout.strip()).is_dir()
    task = ScratchSeeingTask(scratch)
    run_training(spark, cfg.replace(etl="memory", run="scratch-memory"), task=task)
    assert not [name for name in task.seen if name.startswith("adcloud-etl-")]


class SlowTask(LinearTask):
    """Writes ``started`` in ``where`` at its first step, and takes 0.3 s a step."""

    def __init__(self, where: str) -> None:
        self.where = where

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        Path(self.where, "started").touch()
        time.sleep(0.3)
        return super().loss(model, batch)


def test_a_notebook_cancelling_its_job_group_stops_the_trainers(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Notebooks (Zeppelin, Livy, Databricks) run a cell's jobs in a job group and stop the
    cell by cancelling it: the barrier stage ran in a job group of the watch's own, so the
    trainers went on to the last step."""
    sc = spark.sparkContext
    cfg = config(tmp_path, sync="allreduce", steps=60, checkpoint_every=0, run="cancelled")
    outcome: list[BaseException | TrainResult] = []

    def cell() -> None:
        sc.setJobGroup("cell-7", "a notebook cell", interruptOnCancel=True)
        try:
            outcome.append(
                run_training(
                    spark,
                    cfg,
                    task=SlowTask(str(tmp_path)),
                    keyed=keyed_points(spark, make_points(32)),
                )
            )
        except Exception as err:
            outcome.append(err)
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]

    thread = threading.Thread(target=cell, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (tmp_path / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    sc.cancelJobGroup("cell-7")
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert outcome and isinstance(outcome[0], Exception), outcome  # stopped, not trained on
    assert "cell-7" in str(outcome[0])  # cancelled as part of the cell's group


def test_a_run_does_not_replace_what_it_did_not_write_in_its_output(
    drive: str, tmp_path: Path
) -> None:
    """``out`` set to a project directory: its ``model/`` package and its ``settings.json``
    were deleted and replaced by the run's without a word. They are refused, before Spark
    starts (preflight) and when the outputs are written; what a run wrote is replaced."""
    points = make_points(32)
    out = tmp_path / "project"
    (out / "model").mkdir(parents=True)
    (out / "model" / "weights.pt").write_text("mine")
    cfg = config(tmp_path, sync="single", run="project", checkpoint_every=0, out=str(out))
    result = train(LinearTask(), points, cfg.replace(steps=2))
    with pytest.raises(TrainError, match=r"holds model, which no run wrote there"):
        job_module.preflight(cfg.replace(bags=(drive,)), LinearTask())
    with pytest.raises(TrainError, match=r"holds model, which no run wrote there"):
        job_module.write_outputs(result, cfg, str(out), task=LinearTask(), examples=points[:1])
    assert (out / "model" / "weights.pt").read_text() == "mine"
    (out / "model" / "weights.pt").unlink()
    (out / "settings.json").write_text('{"mine": 1}')
    with pytest.raises(TrainError, match=r"holds settings.json, which no run wrote there"):
        job_module.write_outputs(result, cfg, str(out), task=LinearTask(), examples=points[:1])
    assert json.loads((out / "settings.json").read_text()) == {"mine": 1}
    (out / "settings.json").unlink()
    job_module.write_outputs(result, cfg, str(out), task=LinearTask(), examples=points[:1])
    job_module.write_outputs(result, cfg, str(out), task=LinearTask(), examples=points[:1])
    assert inspect_model(out / "model")["training"]["steps"] == 2


class HangingScorer(LinearTask):
    """A counting task (squared error and count) whose rank 1, scoring the held-out samples
    of the first attempt in the barrier stage, hangs (sleeps) for ten minutes."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def eval_counts(self, model: torch.nn.Module, samples: Sequence[Point]) -> np.ndarray:
        context = TaskContext.get()
        if (
            isinstance(context, BarrierTaskContext)
            and context.partitionId() == 1
            and not os.path.exists(self.marker)
        ):
            Path(self.marker).write_text(str(os.getpid()))
            time.sleep(600)
        if not samples:
            return np.zeros(2)
        x = torch.from_numpy(np.stack([s.x for s in samples]))
        y = torch.tensor([[s.y] for s in samples])
        with torch.no_grad():
            return np.array([float(((model(x) - y) ** 2).sum()), float(len(samples))])

    def scores(self, counts: np.ndarray) -> dict[str, float]:
        return {"mse": float(counts[0] / max(counts[1], 1.0))}


@pytest.mark.parametrize("mode", ["allreduce", "ps"])
def test_a_trainer_hung_in_the_held_out_scores_fails_the_stage_in_bounded_time(
    spark: SparkSession, drive: str, tmp_path: Path, mode: str
) -> None:
    """Rank 1 hangs while the trainers add up their held-out counts (eval_every): rank 0
    waited in BarrierTaskContext.allGather until spark.barrier.sync.timeout, a year.  Now
    its wait ends after train.sync_timeout_s, the stage fails and Spark's retry resumes
    from the checkpoint and finishes the run."""
    sc = spark.sparkContext
    marker = tmp_path / "hung.pid"
    cfg = config(
        tmp_path,
        sync=mode,
        run=f"hung-{mode}",
        bags=(drive,),
        heldout_bags=(drive,),
        steps=4,
        eval_every=2,
        checkpoint_every=2,
        # the stage's retry waits for the hung attempt's slot to be freed: on a loaded
        # machine that took longer than 5 s plus the watch's margin, which cancelled the run
        sync_timeout_s=10.0,
    )
    outcome: list[Any] = []

    def run() -> None:
        sc.setJobGroup(f"hung-{mode}", "a run whose trainer hangs", interruptOnCancel=True)
        try:
            outcome.append(run_training(spark, cfg, task=HangingScorer(str(marker))))
        except Exception as err:
            outcome.append(err)
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=240)  # a bound on a wait that had none, not a speed check
    if thread.is_alive():
        sc.cancelJobGroup(f"hung-{mode}")
        thread.join(timeout=60)
        pytest.fail("the trainers still wait for their hung peer")
    assert marker.exists()  # the first attempt's rank 1 really hung
    (result,) = outcome
    assert isinstance(result, TrainResult), result
    # a retry trained the result (on a loaded machine a 5 s wait may fail one more)
    assert result.sync["attempt"] >= 1
    assert result.steps == 4
    assert [step for step, _ in result.validation] == [2, 4]
