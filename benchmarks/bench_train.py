"""adcloud.train: the in-memory Spark training job against its baselines, in one run.

Baselines, measured in the same run on the same synthetic drives (20 s, seed 6, 16 beams x
512 columns, no camera, for training; 10 s, seed 5, held out -- the drives of the task tests):

1. **ETL -> training in memory vs through files.**  ``TrainConfig(etl="memory")`` (samples
   cached in executor memory between the ETL and the barrier stage) against
   ``etl="files"`` (the ETL stage writes its samples to a ``file://`` directory on disk and
   the training stage reads them back), ``lidar_seg`` small, allreduce, 2 trainers on
   ``local[2]``, same steps.  Target: >= 1.5x end-to-end job time (``run_training`` wall
   time, driver side).  The part before training (end-to-end minus rank 0's training
   seconds: ETL, exchange, sharding, stage start) is printed beside it.
2. **Parameter-server exchange: the local store's MEM tier vs ``file://`` with fsync.**  The
   data path of one :class:`~adcloud.train.sync.ParameterStoreSync` step -- the trainer
   pushes its gradient, the server reads it, publishes the new version (and trims old ones
   and the consumed gradient), the trainer reads that version -- run in sequence in one
   process with 1 torch thread on the ``lidar_seg`` small (0.46 MB) and full (6.6 MB)
   parameter sets.  The MEM tier is a private :class:`~adcloud.store.LocalStore` (MEM tier
   in ``/dev/shm``, catalog on disk, as in production); the baseline is
   :class:`~adcloud.store.FsspecStore` on a ``file://`` directory on disk, which always
   writes a temporary file, ``fsync``\\ s it, renames it and ``fsync``\\ s the directory (it
   has no fsync switch: that is how it writes).  Target: >= 5x on that time per step.
   Printed beside it: the store calls alone (put/get/delete/list, without the encoding and
   checksums), the real ``step()`` of two trainer processes (polling included; the server
   applies plain SGD) and one ps-mode Spark job per store with its ``TrainResult.sync``
   seconds (these include waiting for the slower trainer's compute).
3. **Spark-hosted allreduce vs torchrun.**  The same training function, 2 trainers, gloo, 1
   torch thread each: in a Spark barrier stage on ``local[2]`` (the memory runs of 1) and
   under ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
   adcloud.train.job --config ...``.  Target: >= 0.9x samples/s (training steps only, rank
   0's figure in both).
4. **1 vs 2 executors** of a real standalone cluster (one worker of 2 cores; applications
   with ``spark.cores.max`` 1 and 2, one core per executor): allreduce with 1 trainer vs 2
   trainers, same global batch.  The ratio of samples/s is reported (no target).
5. **Quality:** ``lidar_seg`` small trained single-process through the job (300 steps of 2
   sweeps, AdamW, lr 1e-2 with 20 warm-up steps and cosine decay to 5%) and scored on the
   held-out drive: mIoU (the issue asks >= 0.80 within a CI-affordable budget).  ``--full``
   adds the ``full`` preset with the same budget (slow on a CPU).
6. **Held-out scoring on the executors vs on the driver:** the ``lidar_seg`` small model scored
   on both drives by :func:`~adcloud.train.evaluate.score_parameters` (each Spark task returns
   a confusion matrix) against the samples collected to the driver and scored there, the way
   runs scored held-out bags before.  Printed: both times, their ratio, the bytes of samples
   the driver held, and both mIoUs (no target); then the cost of the validation curve: the
   allreduce run of 1 with ``eval_every`` a quarter of the steps against without (training
   seconds of rank 0).

Runs alternate between the compared configurations round by round so that load from other
processes hits both alike; the figure compared is the best run of each (the least disturbed
on a shared machine), medians and the load average are printed beside it.  Every Spark
application gets a short warm-up run first (Python workers start, torch loads).

    .venv/bin/python benchmarks/bench_train.py            # everything (~8-10 min on 2 cores)
    .venv/bin/python benchmarks/bench_train.py --quick    # a smoke run (few steps, 1 round)
    .venv/bin/python benchmarks/bench_train.py --skip-cluster --skip-torchrun
    .venv/bin/python benchmarks/bench_train.py --full     # also the full preset's mIoU
    .venv/bin/python benchmarks/bench_train.py --quality-only --full --quality-threads 2
    .venv/bin/python benchmarks/bench_train.py --ps-only  # the parameter exchange alone
    .venv/bin/python benchmarks/bench_train.py --scoring-only  # the held-out scoring alone
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import yaml

from adcloud.synth import DriveConfig, generate_drive
from adcloud.train import job
from adcloud.train.config import TrainConfig
from adcloud.train.job import run_training

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

    from pyspark.sql import SparkSession

    from adcloud.train.loop import TrainResult

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_DRIVE = DriveConfig(seconds=20, seed=6, lidar_beams=16, lidar_columns=512, camera=False)
HELDOUT_DRIVE = DriveConfig(seconds=10, seed=5, lidar_beams=16, lidar_columns=512, camera=False)
TARGETS = {"etl": 1.5, "ps": 5.0, "torchrun": 0.9, "miou": 0.80}
LIGHT_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.driver.extraJavaOptions": LIGHT_JVM,
    "spark.executor.extraJavaOptions": LIGHT_JVM,
}


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def verdict(ratio: float, target: float) -> str:
    """``met`` or ``NOT met`` for ``ratio >= target``."""
    return "met" if ratio >= target else "NOT met"


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    real = str(path.resolve())
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fstype, *_ = line.split()
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


@dataclass
class Plan:
    """Sizes of one benchmark run (``--quick`` shrinks them)."""

    steps: int = 40
    batch_size: int = 4
    rounds: int = 3
    ps_steps: dict[str, int] = field(default_factory=lambda: {"small": 40, "full": 20})
    ps_rounds: int = 2
    miou_steps: int = 300
    cluster_rounds: int = 2
    cluster_repeat: int = 2

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            steps=6,
            rounds=1,
            ps_steps={"small": 12, "full": 6},
            ps_rounds=1,
            miou_steps=20,
            cluster_rounds=1,
            cluster_repeat=1,
        )


@dataclass
class Work:
    """The drives and directories of one run."""

    root: Path
    shm: Path
    train_bag: str
    heldout_bag: str
    disk: Path = field(init=False)

    def __post_init__(self) -> None:
        self.disk = self.root / "disk"
        self.disk.mkdir(parents=True, exist_ok=True)

    def base_config(self, plan: Plan, **changes: Any) -> TrainConfig:
        """The benchmark's training settings; every run gets its own run name (no resume)."""
        settings: dict[str, Any] = {
            "task": "lidar_seg",
            "task_options": {"preset": "small"},
            "bags": (self.train_bag,),
            "sync": "allreduce",
            "workers": 2,
            "steps": plan.steps,
            "batch_size": plan.batch_size,
            "optimizer": "adamw",
            "lr": 6e-3,
            "weight_decay": 1e-4,
            "seed": 0,
            "checkpoint_every": 0,
            "store": "local:///bench-train",
            "store_options": (f"root={self.root / 'store'}", f"mem_dir={self.shm / 'mem'}"),
            "threads": 1,
            "device": "cpu",
            "partitions_per_bag": 4,
            "log_every": 1000,
            "progress": False,
            "sync_timeout_s": 300.0,
            "out": str(self.root / "out" / "{run}"),
        }
        settings.update(changes)
        settings.setdefault("run", f"bench-{uuid.uuid4().hex[:10]}")
        return TrainConfig(**settings).validate()


def timed_job(spark: SparkSession, config: TrainConfig) -> tuple[float, TrainResult]:
    """Wall time of ``run_training`` and its result.  The outputs every finished run writes
    (the exported model, its latency measurement, the loss plot) cost the same in every mode
    compared here, so their time is left out."""
    writing: list[float] = []
    write = job._write_outputs

    def timed_write(*args: Any, **kwargs: Any) -> TrainResult:
        began = time.perf_counter()
        try:
            return write(*args, **kwargs)
        finally:
            writing.append(time.perf_counter() - began)

    started = time.perf_counter()
    with mock.patch.object(job, "_write_outputs", timed_write):
        result = run_training(spark, config)
    return time.perf_counter() - started - sum(writing), result


def local_session(name: str) -> SparkSession:
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    return get_session(
        SparkSettings(master="local[2]", app_name=name, driver_memory="2g", log_level="ERROR"),
        **SPARK_CONF,
    )


# -- 1 and 3: memory vs files, Spark vs torchrun ------------------------------------------------


def torchrun_job(work: Work, config: TrainConfig) -> float:
    """samples/s of the same training under torchrun (2 processes, rank 0's figure)."""
    out = work.root / f"torchrun-{config.run}"
    settings = work.root / f"{config.run}.yaml"
    train = config.replace(out=str(out)).to_dict()
    settings.write_text(yaml.safe_dump({"train": train}, sort_keys=True))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "adcloud.train.job", "--config", str(settings),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads((out / "result.json").read_text())
    return float(report["samples_per_second"])


@dataclass
class Rounds:
    """Figures of the memory / files / torchrun rounds."""

    memory_s: list[float] = field(default_factory=list)
    files_s: list[float] = field(default_factory=list)
    memory_pre_s: list[float] = field(default_factory=list)
    files_pre_s: list[float] = field(default_factory=list)
    spark_rate: list[float] = field(default_factory=list)
    torchrun_rate: list[float] = field(default_factory=list)


def bench_etl_and_torchrun(
    spark: SparkSession, work: Work, plan: Plan, with_torchrun: bool
) -> Rounds:
    """Targets 1 and 3: alternate memory, files (and torchrun) runs ``plan.rounds`` times."""
    print(
        f"\n== 1. ETL -> training, in memory vs through file:// files "
        f"({work.disk} on {fs_type(work.disk)}); 3. Spark allreduce vs torchrun ==\n"
        f"lidar_seg small, allreduce, 2 trainers x 1 thread, {plan.steps} steps of "
        f"{plan.batch_size} sweeps, local[2], 4 partitions per bag",
        flush=True,
    )
    timed_job(spark, work.base_config(plan, steps=2))  # warm-up: workers start, torch loads
    out = Rounds()
    for index in range(plan.rounds):
        line = [f"round {index + 1}:"]
        for etl in ("memory", "files"):
            config = work.base_config(plan, etl=etl, etl_dir=str(work.disk / f"etl-{index}"))
            seconds, result = timed_job(spark, config)
            (out.memory_s if etl == "memory" else out.files_s).append(seconds)
            (out.memory_pre_s if etl == "memory" else out.files_pre_s).append(
                seconds - result.seconds
            )
            if etl == "memory":
                out.spark_rate.append(result.samples_per_second)
            shutil.rmtree(work.disk / f"etl-{index}", ignore_errors=True)
            line.append(
                f"{etl} {seconds:5.1f} s (before training {seconds - result.seconds:4.1f} s, "
                f"{result.samples_per_second:5.1f} samples/s);"
            )
        if with_torchrun:
            rate = torchrun_job(work, work.base_config(plan))
            out.torchrun_rate.append(rate)
            line.append(f"torchrun {rate:5.1f} samples/s;")
        print(" ".join(line), f"load average {_load()}", flush=True)
    return out


def report_etl(out: Rounds) -> float:
    best_m, best_f = min(out.memory_s), min(out.files_s)
    ratio = best_f / best_m
    med = statistics.median(out.files_s) / statistics.median(out.memory_s)
    pre = min(out.files_pre_s) / min(out.memory_pre_s)
    print(
        f"1. end-to-end job: memory {best_m:.1f} s, files {best_f:.1f} s (best runs) -> "
        f"{ratio:.2f}x (target >= {TARGETS['etl']}x: {verdict(ratio, TARGETS['etl'])}); "
        f"medians -> {med:.2f}x\n"
        f"   before training (ETL + exchange + sharding + stage start): memory "
        f"{min(out.memory_pre_s):.1f} s, files {min(out.files_pre_s):.1f} s -> {pre:.2f}x"
    )
    return ratio


def report_torchrun(out: Rounds) -> float:
    spark, torch_ = max(out.spark_rate), max(out.torchrun_rate)
    ratio = spark / torch_
    med = statistics.median(out.spark_rate) / statistics.median(out.torchrun_rate)
    print(
        f"3. training throughput: Spark barrier stage {spark:.1f}, torchrun {torch_:.1f} "
        f"samples/s (best runs) -> {ratio:.2f}x (target >= {TARGETS['torchrun']}x: "
        f"{verdict(ratio, TARGETS['torchrun'])}); medians -> {med:.2f}x"
    )
    return ratio


# -- 2: parameter exchange --------------------------------------------------------------------


def _lidar_state(preset: str, rank: int) -> tuple[Any, Any, dict[str, Any]]:
    """A ``lidar_seg`` model of ``preset``, an SGD optimizer over it and fixed gradients
    (random, seeded by ``rank``) by parameter name."""
    import torch  # noqa: PLC0415

    from adcloud.train.task import get_task  # noqa: PLC0415

    torch.manual_seed(0)
    model = get_task("lidar_seg", {"preset": preset}).build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    grads = {
        name: torch.randn(p.shape, generator=generator) * 1e-3
        for name, p in model.named_parameters()
    }
    return model, optimizer, grads


class _TimedStore:
    """A store that adds the wall time of its ``put``/``get``/``delete``/``list`` calls to
    :attr:`seconds` (everything else passes through)."""

    _TIMED = frozenset({"put", "get", "delete", "list"})

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in self._TIMED:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


@dataclass(frozen=True)
class DataPath:
    """Medians per step of one data-path run: all of it, the store calls alone, and the size
    of one parameter version."""

    seconds: float
    store_seconds: float
    version_bytes: int


def data_path(store_uri: str, store_options: dict[str, str], preset: str, steps: int) -> DataPath:
    """One step's parameter-server data path, sequentially in this process, with no waiting.

    One step as :meth:`ParameterStoreSync.step` moves its data: the trainer (rank 1) encodes
    and puts its gradient; the server (rank 0) gets, checks and decodes it, publishes the new
    version (encode, put, pointer, trimming old versions) and deletes the consumed gradient;
    the trainer gets, checks and decodes that version into its model.  The averaging and the
    optimizer step are left out (they do not touch the store).
    """
    import torch  # noqa: PLC0415

    from adcloud.store import Store, open_store  # noqa: PLC0415
    from adcloud.train.sync import ParameterStoreSync  # noqa: PLC0415
    from adcloud.train.tensors import encode_tensors  # noqa: PLC0415

    torch.set_num_threads(1)  # as every trainer runs (TrainConfig.threads)
    server_model, server_opt, _ = _lidar_state(preset, 0)
    trainer_model, trainer_opt, grads = _lidar_state(preset, 1)
    timed = _TimedStore(open_store(store_uri, **store_options))
    store = cast("Store", timed)
    run, session = f"path-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    server = ParameterStoreSync(store, run, 0, 2, session=session)
    trainer = ParameterStoreSync(store, run, 1, 2, session=session)
    server.start(server_model, server_opt, 0)
    trainer.start(trainer_model, trainer_opt, 0)
    times, in_store = [], []
    try:
        for step in range(steps):
            started, before = time.perf_counter(), timed.seconds
            meta = trainer._meta("grad", step, loss=1.0, none=[])
            store.put(
                trainer.grad_key(step, 1), encode_tensors(grads, meta), write_type="MUST_CACHE"
            )
            tensors, got = server._read(server.grad_key(step, 1), "grad", step)
            if got is None or len(tensors) != len(grads):
                raise RuntimeError(f"{store_uri}: gradient of step {step} not read back")
            server._publish(server_model, step + 1, 1.0)
            server._delete(f"/{run}/v{step}")
            trainer._load(trainer_model, step + 1)
            times.append(time.perf_counter() - started)
            in_store.append(timed.seconds - before)
    finally:
        server.close()
        close = getattr(timed.inner, "close", None)
        if callable(close):
            close()
    skip = min(2, steps - 1)  # the first steps create directories and fault in pages
    return DataPath(
        statistics.median(times[skip:]),
        statistics.median(in_store[skip:]),
        int(server.stats()["bytes_sent"]) // (steps + 1),
    )


def _ps_trainer(
    rank: int,
    store_uri: str,
    store_options: dict[str, str],
    run: str,
    session: str,
    preset: str,
    steps: int,
    results: Queue[tuple[int, list[float]]],
) -> None:
    """One trainer process of the protocol benchmark: the real ``step``, fixed gradients."""
    import torch  # noqa: PLC0415

    from adcloud.store import open_store  # noqa: PLC0415
    from adcloud.train.sync import ParameterStoreSync  # noqa: PLC0415

    torch.set_num_threads(1)
    model, optimizer, grads = _lidar_state(preset, rank)
    store = open_store(store_uri, **store_options)
    sync = ParameterStoreSync(store, run, rank, 2, session=session, timeout_s=120.0)
    times = []
    try:
        sync.start(model, optimizer, 0)
        for step in range(steps):
            # The server averages the received gradients into its own: reset them every step.
            for name, param in model.named_parameters():
                param.grad = grads[name].clone()
            started = time.perf_counter()
            sync.step(model, optimizer, step, 1.0)
            times.append(time.perf_counter() - started)
    finally:
        sync.close()
        close = getattr(store, "close", None)
        if callable(close):
            close()
    results.put((rank, times))


def protocol(store_uri: str, store_options: dict[str, str], preset: str, steps: int) -> float:
    """Median seconds per ``step`` seen by the trainer (rank 1: push, wait for the server,
    read the version) with the two trainers in two processes, as in the Spark job."""
    context = multiprocessing.get_context("spawn")
    results: Queue[tuple[int, list[float]]] = context.Queue()
    run, session = f"ps-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    procs = [
        context.Process(
            target=_ps_trainer,
            args=(rank, store_uri, store_options, run, session, preset, steps, results),
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in procs:
            rank, times = results.get(timeout=600)
            got[rank] = times
    finally:
        for proc in procs:
            proc.join(timeout=60)
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"a parameter-server trainer failed: {[p.exitcode for p in procs]}")
    return statistics.median(got[1][min(2, steps - 1) :])


def bench_ps(work: Work, plan: Plan) -> dict[str, float]:
    """Target 2 on both parameter sets, MEM tier and file:// alternating."""
    file_root = work.disk / "ps-file-store"
    mem_options = {
        "root": str(work.root / "ps-local"),
        "mem_dir": str(work.shm / "ps-mem"),
        "mem_capacity": "2GiB",
    }
    stores: dict[str, tuple[str, dict[str, str]]] = {
        "MEM tier": ("local:///bench-ps", mem_options),
        "file+fsync": (f"file://{file_root}", {}),
    }
    print(
        f"\n== 2. parameter-server exchange: local store MEM tier ({work.shm}, "
        f"{fs_type(work.shm)}) vs file:// with fsync ({file_root.parent}, "
        f"{fs_type(file_root.parent)}) ==\n"
        "MEM tier vs file+fsync, medians per step (best of rounds).  data path: one step's "
        "push, read, publish, read of ParameterStoreSync in sequence, one process, 1 thread; "
        "store calls alone: the put/get/delete/list part of it; protocol: the real step() "
        "of 2 trainer processes (polling, encoding, SGD on the server), no model compute",
        flush=True,
    )
    if fs_type(file_root.parent) in ("tmpfs", "ramfs"):
        print("WARNING: the file:// baseline directory is in memory; set TMPDIR to a disk")
    ratios = {}
    for preset, steps in plan.ps_steps.items():
        path: dict[str, list[DataPath]] = {name: [] for name in stores}
        for _ in range(plan.ps_rounds):
            for name, (uri, options) in stores.items():
                path[name].append(data_path(uri, options, preset, 3 * steps))
        best = {name: min(r.seconds for r in runs) for name, runs in path.items()}
        calls = {name: min(r.store_seconds for r in runs) for name, runs in path.items()}
        size = path["MEM tier"][0].version_bytes
        ratio = best["file+fsync"] / best["MEM tier"]
        ratios[preset] = ratio
        trip = {
            name: protocol(uri, options, preset, steps) for name, (uri, options) in stores.items()
        }
        mem, fil = "MEM tier", "file+fsync"
        print(
            f"lidar_seg {preset} ({size / 1e6:.2f} MB per parameter version), ms per step:\n"
            f"  data path (target)    {best[mem] * 1e3:7.2f} vs {best[fil] * 1e3:7.2f} -> "
            f"{ratio:4.1f}x (target >= {TARGETS['ps']:.0f}x: {verdict(ratio, TARGETS['ps'])})\n"
            f"  its store calls alone {calls[mem] * 1e3:7.2f} vs {calls[fil] * 1e3:7.2f} -> "
            f"{calls[fil] / calls[mem]:4.1f}x\n"
            f"  protocol, 2 processes {trip[mem] * 1e3:7.2f} vs {trip[fil] * 1e3:7.2f} -> "
            f"{trip[fil] / trip[mem]:4.1f}x   (load average {_load()})",
            flush=True,
        )
    shutil.rmtree(file_root, ignore_errors=True)
    return ratios


def bench_ps_job(spark: SparkSession, work: Work, plan: Plan) -> None:
    """ps mode in the Spark job on both stores: sync seconds as TrainResult reports them."""
    print("ps-mode Spark job (lidar_seg small, 2 trainers), TrainResult.sync per store:")
    for name, store, options in (
        ("MEM tier", "local:///bench-train", None),
        ("file+fsync", f"file://{work.disk / 'ps-job-store'}", ()),
    ):
        changes: dict[str, Any] = {"sync": "ps", "store": store}
        if options is not None:
            changes["store_options"] = options
        seconds, result = timed_job(spark, work.base_config(plan, **changes))
        sync = result.sync
        print(
            f"  {name:<10} sync {sync['sync_seconds']:5.2f} s on rank 0 (max over trainers "
            f"{sync['max_sync_seconds']:5.2f} s) of {result.seconds:5.1f} s training, "
            f"{result.samples_per_second:5.1f} samples/s, job {seconds:5.1f} s",
            flush=True,
        )
    shutil.rmtree(work.disk / "ps-job-store", ignore_errors=True)


# -- 4: 1 vs 2 executors ----------------------------------------------------------------------


def bench_cluster(work: Work, plan: Plan) -> float:
    """samples/s with 1 and 2 executors of a standalone cluster, alternating applications."""
    from adcloud.spark import SparkSettings, StandaloneCluster, get_session  # noqa: PLC0415

    print(
        "\n== 4. standalone cluster: 1 vs 2 executors (1 core each), allreduce with 1 vs 2 "
        f"trainers, {plan.steps} steps of {plan.batch_size} sweeps ==",
        flush=True,
    )
    rates: dict[int, list[float]] = {1: [], 2: []}
    with StandaloneCluster(1, cores=2, memory="3g", log_dir=work.root / "cluster") as cluster:
        for index in range(plan.cluster_rounds):
            for executors in (1, 2):
                session = get_session(
                    SparkSettings(
                        master=cluster.master_url,
                        app_name=f"bench-train-{executors}",
                        driver_memory="2g",
                        executor_memory="1g",
                        log_level="ERROR",
                    ),
                    **{
                        **cluster.session_conf(),
                        **SPARK_CONF,
                        "spark.cores.max": str(executors),
                        "spark.executor.cores": "1",
                    },
                )
                try:
                    timed_job(session, work.base_config(plan, workers=executors, steps=2))
                    this_round = []
                    for _ in range(plan.cluster_repeat):
                        _, result = timed_job(session, work.base_config(plan, workers=executors))
                        this_round.append(result.samples_per_second)
                finally:
                    session.stop()
                rates[executors] += this_round
                print(
                    f"round {index + 1}: {executors} executor(s) "
                    f"{' '.join(f'{r:6.1f}' for r in this_round)} samples/s "
                    f"(load average {_load()})",
                    flush=True,
                )
    best = {k: max(v) for k, v in rates.items()}
    medians = {k: statistics.median(v) for k, v in rates.items()}
    ratio = best[2] / best[1]
    print(
        f"4. best run: 1 executor {best[1]:.1f}, 2 executors {best[2]:.1f} samples/s -> "
        f"{ratio:.2f}x; medians {medians[1]:.1f} / {medians[2]:.1f} -> "
        f"{medians[2] / medians[1]:.2f}x"
    )
    return ratio


# -- 5: quality -------------------------------------------------------------------------------


def bench_miou(spark: SparkSession, work: Work, plan: Plan, preset: str, threads: int = 1) -> float:
    """Held-out mIoU of ``preset`` after ``plan.miou_steps`` single-process steps of 2 sweeps
    on ``threads`` torch threads."""
    config = work.base_config(
        plan,
        task_options={"preset": preset},
        sync="single",
        workers=1,
        steps=plan.miou_steps,
        batch_size=2,
        heldout_bags=(work.heldout_bag,),
        threads=threads,
        lr=1e-2,
        schedule="cosine",
        warmup_steps=20,
        final_lr_ratio=0.05,
    )
    seconds, result = timed_job(spark, config)
    miou = result.metrics["miou"]
    print(
        f"5. lidar_seg {preset}: held-out mIoU {miou:.3f} (accuracy "
        f"{result.metrics['accuracy']:.3f}) after {result.steps} steps of 2 sweeps (AdamW, lr "
        f"{config.lr:g} {config.schedule}, {threads} thread(s)): training "
        f"{result.seconds:.1f} s, job {seconds:.1f} s "
        f"(target >= {TARGETS['miou']}: {verdict(miou, TARGETS['miou'])}); "
        f"load average {_load()}",
        flush=True,
    )
    return miou


# -- 6: held-out scoring ------------------------------------------------------------------------


def bench_scoring(spark: SparkSession, work: Work, plan: Plan) -> float:
    """Scoring the ``lidar_seg`` small model on both drives: on the executors (what a run and
    ``adcloud train eval`` do: each task returns a confusion matrix) vs the samples gathered
    on the driver and scored there (what a run did before), rounds alternating."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    from adcloud.train.evaluate import score_parameters  # noqa: PLC0415
    from adcloud.train.job import etl_samples, load_task  # noqa: PLC0415
    from adcloud.train.tensors import encode_tensors  # noqa: PLC0415

    config = work.base_config(plan)
    task = load_task(config)
    torch.manual_seed(0)
    model = task.build_model()
    parameters = encode_tensors(model.state_dict())
    bags = [work.heldout_bag, work.train_bag]
    times: dict[str, list[float]] = {"executors": [], "driver": []}
    scores: dict[str, float] = {}
    held = 0
    for _ in range(plan.rounds):
        began = time.perf_counter()
        result = score_parameters(
            spark, task, parameters, bags, partitions_per_bag=config.partitions_per_bag
        )
        times["executors"].append(time.perf_counter() - began)
        scores["executors"] = result.scores["miou"]
        began = time.perf_counter()
        gathered = etl_samples(spark, config, task, bags).collect()
        samples = [sample for _, sample in sorted(gathered, key=lambda pair: pair[0])]
        scores["driver"] = task.evaluate(model, samples)["miou"]
        times["driver"].append(time.perf_counter() - began)
        held = sum(s.points.nbytes + s.labels.nbytes for s in samples)
        del gathered, samples
    best = {k: min(v) for k, v in times.items()}
    ratio = best["driver"] / best["executors"]
    # the validation curve's cost: the same allreduce run with the held-out drive scored
    # every quarter of the steps by the trainers, and without
    every = max(1, plan.steps // 4)
    runs: dict[int, list[float]] = {0: [], every: []}
    for _ in range(plan.rounds):
        for eval_every, seconds in runs.items():
            cfg = work.base_config(plan, heldout_bags=(work.heldout_bag,), eval_every=eval_every)
            seconds.append(timed_job(spark, cfg)[1].seconds)
    curve = min(runs[every]) - min(runs[0])
    print(
        f"6. scoring {result.total_samples} sweeps of 2 drives: on the executors "
        f"{best['executors']:.2f} s (median {statistics.median(times['executors']):.2f}), "
        f"gathered on the driver ({torch.get_num_threads()} torch threads) "
        f"{best['driver']:.2f} s (median {statistics.median(times['driver']):.2f}): "
        f"{ratio:.2f}x; the driver held {held / 1e6:.0f} MB of samples against "
        f"{np.asarray(result.counts).nbytes} bytes of counts; mIoU {scores['executors']:.4f} "
        f"vs {scores['driver']:.4f}; load average {_load()}",
        flush=True,
    )
    print(
        f"6. validation curve (allreduce, 2 trainers, {plan.steps} steps): training "
        f"{min(runs[0]):.2f} s without, {min(runs[every]):.2f} s scoring the held-out drive "
        f"every {every} steps ({plan.steps // every - 1} times in the loop): "
        f"{curve / max(1, plan.steps // every - 1):.2f} s per scoring (best of "
        f"{plan.rounds}); load average {_load()}",
        flush=True,
    )
    return ratio


# -- main -------------------------------------------------------------------------------------


def make_work(root: Path, shm: Path) -> Work:
    started = time.perf_counter()
    train = generate_drive(TRAIN_DRIVE, root / "train.bag").bag
    heldout = generate_drive(HELDOUT_DRIVE, root / "heldout.bag").bag
    print(
        f"drives: train {TRAIN_DRIVE.seconds:.0f} s seed {TRAIN_DRIVE.seed} "
        f"({Path(train).stat().st_size / 1e6:.0f} MB), held-out {HELDOUT_DRIVE.seconds:.0f} s "
        f"seed {HELDOUT_DRIVE.seed} ({Path(heldout).stat().st_size / 1e6:.0f} MB), generated "
        f"in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return Work(root, shm, str(train), str(heldout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few steps, one round (smoke run)")
    parser.add_argument("--skip-cluster", action="store_true", help="skip the 1 vs 2 executors")
    parser.add_argument("--skip-torchrun", action="store_true", help="skip the torchrun baseline")
    parser.add_argument("--full", action="store_true", help="also the full preset's mIoU")
    parser.add_argument(
        "--quality-only", action="store_true", help="only section 5, the held-out mIoU"
    )
    parser.add_argument(
        "--quality-threads", type=int, default=1, help="torch threads of the mIoU runs (1)"
    )
    parser.add_argument(
        "--ps-only", action="store_true", help="only section 2, the parameter exchange"
    )
    parser.add_argument(
        "--scoring-only", action="store_true", help="only section 6, the held-out scoring"
    )
    parser.add_argument("--rounds", type=int, help="memory/files/torchrun rounds (3)")
    parser.add_argument("--steps", type=int, help="training steps per timed run (40)")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    plan.rounds = args.rounds or plan.rounds
    plan.steps = args.steps or plan.steps
    logging.basicConfig(level=logging.WARNING)
    began = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-train-"))
    shm_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    shm = Path(tempfile.mkdtemp(prefix="bench-train-", dir=shm_base))
    summary: list[str] = []

    def note(name: str, figure: str, value: float, target: float | None) -> None:
        goal = f"  (target >= {target:g}: {verdict(value, target)})" if target else ""
        summary.append(f"{name:<44} {figure}{goal}")

    def quality(spark: SparkSession, work: Work, plan: Plan) -> None:
        print("\n== 5. held-out quality ==", flush=True)
        for preset in ("small", "full") if args.full else ("small",):
            miou = bench_miou(spark, work, plan, preset, args.quality_threads)
            target = TARGETS["miou"] if preset == "small" else None
            note(f"5. lidar_seg {preset} held-out mIoU", f"{miou:.3f}", miou, target)

    def exchange(work: Work) -> None:
        for preset, ratio in bench_ps(work, plan).items():
            note(
                f"2. ps exchange, MEM tier vs file ({preset})",
                f"{ratio:.1f}x",
                ratio,
                TARGETS["ps"],
            )

    try:
        work = make_work(root, shm)
        if args.ps_only:
            exchange(work)
            print("\n== summary ==\n" + "\n".join(summary))
            return 0
        spark = local_session("bench-train")
        if args.quality_only:
            quality(spark, work, plan)
            spark.stop()
            return 0
        if args.scoring_only:
            bench_scoring(spark, work, plan)
            spark.stop()
            return 0
        rounds = bench_etl_and_torchrun(spark, work, plan, not args.skip_torchrun)
        print()
        etl = report_etl(rounds)
        note("1. in-memory ETL vs files (end to end)", f"{etl:.2f}x", etl, TARGETS["etl"])
        if not args.skip_torchrun:
            tr = report_torchrun(rounds)
            note(
                "3. Spark allreduce vs torchrun (samples/s)", f"{tr:.2f}x", tr, TARGETS["torchrun"]
            )
        exchange(work)
        bench_ps_job(spark, work, plan)
        quality(spark, work, plan)
        scoring = bench_scoring(spark, work, plan)
        note("6. held-out scoring, executors vs driver", f"{scoring:.2f}x", scoring, None)
        spark.stop()
        if not args.skip_cluster:
            scale = bench_cluster(work, plan)
            note("4. 2 vs 1 executors (samples/s)", f"{scale:.2f}x", scale, None)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    print("\n== summary ==")
    print("\n".join(sorted(summary)))
    print(f"wall time {time.perf_counter() - began:.0f} s{' (--quick)' if args.quick else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
