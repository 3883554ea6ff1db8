"""Checkpoints in a real local store: layout, pruning, fallback past broken ones, and resuming
a run -- also one whose process was killed with SIGKILL -- to the same parameters."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from adcloud.store import Store, open_store
from adcloud.train.checkpoint import (
    Checkpointer,
    capture_rng,
    latest_checkpoint,
    restore_rng,
)
from adcloud.train.config import TrainConfig
from adcloud.train.errors import CheckpointError, TrainError
from adcloud.train.job import _check_checkpoint_store
from adcloud.train.loop import TrainResult, train
from adcloud.train.tensors import decode_tree

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Point:
    x: np.ndarray
    y: float


class DropoutTask:
    """A small regression MLP with dropout: resuming must restore the global RNG too.

    ``fail_after`` raises after that many loss evaluations (an in-process crash);
    ``pause_s`` slows every step down so a test can kill the process between checkpoints.
    """

    name = "toy_dropout"
    topics = ("/toy",)

    def __init__(self, fail_after: int = 0, pause_s: float = 0.0) -> None:
        self.fail_after = fail_after
        self.pause_s = pause_s
        self.calls = 0

    def samples(self, topic: str, timestamp: int, decoded: Any) -> Iterator[Point]:
        yield from ()

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )

    def batches(
        self, samples: Sequence[Point], batch_size: int, generator: torch.Generator
    ) -> Iterator[dict[str, torch.Tensor]]:
        order = torch.randperm(len(samples), generator=generator).tolist()
        for i in range(0, len(order), batch_size):
            chosen = [samples[j] for j in order[i : i + batch_size]]
            noise = torch.randn(len(chosen), 4, generator=generator) * 0.01  # augmentation
            yield {
                "x": torch.from_numpy(np.stack([s.x for s in chosen])) + noise,
                "y": torch.tensor([[s.y] for s in chosen]),
            }

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        if self.fail_after and self.calls > self.fail_after:
            raise RuntimeError("simulated crash")
        if self.pause_s:
            time.sleep(self.pause_s)
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])

    def evaluate(self, model: torch.nn.Module, samples: Sequence[Point]) -> dict[str, float]:
        return {}

    def example_inputs(self, samples: Sequence[Point]) -> tuple[Any, ...]:
        return ()

    def dynamic_shapes(self) -> Any:
        return None


def make_points(n: int = 40) -> list[Point]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = x @ np.array([0.5, -1.0, 2.0, 1.0], np.float32)
    return [Point(x[i], float(y[i])) for i in range(n)]


def toy_config(run: str, store_root: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "task": "toy_dropout",
        "steps": 14,
        "batch_size": 6,  # 40 samples: epochs of 7 batches, the last one short
        "lr": 0.01,
        "seed": 4,
        "checkpoint_every": 4,
        "keep_checkpoints": 2,
        "store": "local:///ckpt-tests",
        "store_options": (f"root={store_root}",),
        "run": run,
        "threads": 1,
        "progress": False,
    }
    base.update(kw)
    return TrainConfig(**base).validate()


def run_toy(config: TrainConfig, task: DropoutTask | None = None) -> TrainResult:
    """One single-process training of the toy task with checkpoints (also used by the child
    process of the kill test)."""
    store = open_store(config.store, **config.store_kwargs())
    checkpointer = Checkpointer(
        store, config.run_id(), every=config.checkpoint_every, keep=config.keep_checkpoints
    )
    return train(task or DropoutTask(), make_points(), config, None, checkpointer, 0, 1)


def assert_same_parameters(a: TrainResult, b: TrainResult) -> None:
    """Bit-identical final parameters (the files differ in their run names only)."""
    left, right = a.state_dict(), b.state_dict()
    assert list(left) == list(right)
    for name, tensor in left.items():
        assert torch.equal(tensor, right[name]), name


def _store(root: Path) -> Store:
    return open_store("local:///ckpt-tests", root=str(root))


def test_rng_states_round_trip() -> None:
    state = capture_rng()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    restore_rng(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_layout_pointer_and_pruning(tmp_path: Path) -> None:
    config = toy_config("layout", tmp_path, steps=10, checkpoint_every=3)
    result = run_toy(config)
    store = _store(tmp_path)
    # saved at 3, 6, 9 and after the last step (10); the newest two are kept
    steps = sorted(e.name for e in store.list("/layout/checkpoints") if e.is_dir)
    assert steps == ["step-000000009", "step-000000010"]
    assert sorted(e.name for e in store.list("/layout/checkpoints/step-000000010")) == [
        "rank-0",
        "state",
    ]
    pointer = json.loads(store.get("/layout/checkpoints/latest"))
    assert pointer == {
        "run": "layout",
        "step": 10,
        "key": "/layout/checkpoints/step-000000010",
        "world": 1,
    }
    info = latest_checkpoint(store, "layout")
    assert info is not None and (info.step, info.world) == (10, 1)
    state, meta = decode_tree(store.get("/layout/checkpoints/step-000000010/state"))
    assert meta["format"] == "adcloud-checkpoint"
    assert state["losses"].tolist() == list(result.losses)
    assert set(state["optimizer"]["state"]) == {0, 1, 2, 3}
    model = DropoutTask().build_model()
    model.load_state_dict(state["model"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in result.state_dict().items())
    # running the finished run again restores the end and trains nothing
    again = run_toy(config)
    assert again.start_step == 10 and again.losses == result.losses
    assert again.parameters == result.parameters


@pytest.mark.parametrize(
    "schedule",
    [{}, {"schedule": "cosine", "warmup_steps": 3, "final_lr_ratio": 0.1}],
    ids=["constant", "cosine-warmup"],
)
def test_resuming_after_a_crash_gives_the_uninterrupted_parameters(
    tmp_path: Path, schedule: dict[str, Any]
) -> None:
    whole = run_toy(toy_config("whole", tmp_path, **schedule))
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_toy(toy_config("crashy", tmp_path, **schedule), DropoutTask(fail_after=10))
    info = latest_checkpoint(_store(tmp_path), "crashy")
    assert info is not None and info.step == 8
    resumed = run_toy(toy_config("crashy", tmp_path, **schedule))
    assert resumed.start_step == 8
    assert resumed.losses == whole.losses  # the curve before the crash comes from the checkpoint
    assert_same_parameters(resumed, whole)  # bit-identical


def test_a_killed_process_resumes_to_the_same_parameters(tmp_path: Path) -> None:
    """A real SIGKILL between checkpoints; the next run resumes from the last one."""
    config = toy_config("killed", tmp_path, steps=40, checkpoint_every=5, keep_checkpoints=3)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ckpt_child', {str(Path(__file__))!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['ckpt_child'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "from pathlib import Path\n"
        f"config = mod.toy_config('killed', Path({str(tmp_path)!r}), steps=40, "
        "checkpoint_every=5, keep_checkpoints=3)\n"
        "mod.run_toy(config, mod.DropoutTask(pause_s=0.15))\n"
        "print('finished', flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    store = _store(tmp_path)
    deadline = time.monotonic() + 120
    try:
        while True:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no checkpoint appeared within 120 s"
            info = latest_checkpoint(store, "killed") if store.exists("/killed") else None
            if info is not None and info.step >= 10:
                break
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    killed_at = latest_checkpoint(store, "killed")
    assert killed_at is not None and 10 <= killed_at.step < 40

    resumed = run_toy(config)
    assert resumed.start_step == killed_at.step
    whole = run_toy(toy_config("unbroken", tmp_path, steps=40, checkpoint_every=5))
    assert resumed.losses == whole.losses
    assert_same_parameters(resumed, whole)


def _checkpointed(tmp_path: Path, run: str) -> Store:
    run_toy(toy_config(run, tmp_path, steps=8, checkpoint_every=4, keep_checkpoints=3))
    return _store(tmp_path)


def test_a_corrupt_newest_checkpoint_falls_back_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _checkpointed(tmp_path, "corrupt")
    key = "/corrupt/checkpoints/step-000000008/state"
    data = bytearray(store.get(key))
    data[-10] ^= 0xFF
    store.put(key, bytes(data))
    with caplog.at_level(logging.WARNING, logger="adcloud.train.checkpoint"):
        info = latest_checkpoint(store, "corrupt")
    assert info is not None and info.step == 4
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert key in warned and "byte offset" in warned
    resumed = run_toy(toy_config("corrupt", tmp_path, steps=8, checkpoint_every=4))
    assert resumed.start_step == 4


def test_a_run_resumed_before_a_broken_checkpoint_keeps_its_good_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A trainer killed while saving step 8 leaves it incomplete; the run resumes from step
    4 and, saving more often now (checkpoint_every does not name the run), keeps one
    checkpoint.  Pruning counted the incomplete step 8 as the newest and deleted the
    checkpoint just written at step 6: the next resume found nothing and trained afresh."""
    store = _checkpointed(tmp_path, "torn")
    store.delete("/torn/checkpoints/step-000000008/rank-0")  # killed while saving
    config = toy_config("torn", tmp_path, steps=12, checkpoint_every=2, keep_checkpoints=1)
    crashy = DropoutTask(fail_after=3)  # crashes in step 8, after saving step 6
    with (
        caplog.at_level(logging.WARNING, logger="adcloud.train.checkpoint"),
        pytest.raises(RuntimeError, match="simulated crash"),
    ):
        run_toy(config, crashy)
    steps = sorted(e.name for e in store.list("/torn/checkpoints") if e.is_dir)
    assert steps == ["step-000000006"]
    assert "removing unusable checkpoint(s) at step(s) 8, past the step 6" in caplog.text
    resumed = run_toy(config)
    assert resumed.start_step == 6
    whole = run_toy(toy_config("whole", tmp_path, steps=12, checkpoint_every=2))
    assert_same_parameters(resumed, whole)


def test_truncated_and_missing_parts_name_the_key_and_offset(tmp_path: Path) -> None:
    store = _checkpointed(tmp_path, "broken")
    # step 8 loses its rank part (an incomplete checkpoint), step 4 is truncated
    store.delete("/broken/checkpoints/step-000000008/rank-0")
    key = "/broken/checkpoints/step-000000004/state"
    whole = store.get(key)
    store.put(key, whole[: len(whole) // 2])
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(store, "broken")
    text = str(info.value)
    assert "/broken/checkpoints/step-000000008/rank-0 is missing (offset 0)" in text
    assert f"{key} is corrupt at byte offset {len(whole) // 2}" in text
    assert "Delete /broken/checkpoints" in text
    assert latest_checkpoint(store, "never-ran") is None


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path: Path) -> None:
    store = _checkpointed(tmp_path, "world")
    checkpointer = Checkpointer(store, "world", every=4)
    with pytest.raises(CheckpointError, match=r"written by 1 trainer.*workers=1"):
        checkpointer.restore(rank=0, world=2)


class WiderTask(DropoutTask):
    """The toy task with a wider hidden layer: the same tensor names, other shapes."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path: Path) -> None:
    """A named run resumed after the model changed: a clear error naming the checkpoint and
    the tensors whose shapes differ, not torch's size-mismatch RuntimeError."""
    cfg = toy_config("named", tmp_path / "store", steps=8)
    run_toy(cfg)
    with pytest.raises(
        CheckpointError, match=r"run named: checkpoint .*step-000000008.*another model"
    ) as err:
        run_toy(cfg.replace(steps=12), WiderTask())
    assert "0.weight is (16, 4), the model's (32, 4)" in str(err.value)
    assert "train.run" in str(err.value)


def test_rank_zero_publishes_only_when_every_part_is_there(tmp_path: Path) -> None:
    store = _store(tmp_path)
    model = DropoutTask().build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = Checkpointer(store, "parts", every=1, timeout_s=0.2)
    saver.save(1, rank=0, world=2, model=model, optimizer=opt, epoch=0, batch_index=1, losses=[1.0])
    assert not store.exists("/parts/checkpoints/latest")  # rank 1 never wrote its part
    assert latest_checkpoint(store, "parts") is None  # incomplete: a fresh start, not an error


def test_checkpointer_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep=0"):
        Checkpointer(_store(tmp_path), "x", every=1, keep=0)


def test_checkpoints_in_a_local_store_are_refused_across_hosts() -> None:
    """Each machine has its own local:// store: rank 0 would wait for parts it cannot see at
    every checkpoint, and a resumed run would find nothing."""
    config = TrainConfig(task="lidar_seg", bags=("b.bag",)).validate()
    with pytest.raises(TrainError, match=r"2 hosts \(a, b\).*local://.*checkpoint_every=0"):
        _check_checkpoint_store(config, ["a", "b", "a"])
    _check_checkpoint_store(config, ["a", "a"])  # one host: fine
    no_checkpoints = TrainConfig(task="lidar_seg", bags=("b.bag",), checkpoint_every=0)
    _check_checkpoint_store(no_checkpoints.validate(), ["a", "b"])
    shared = TrainConfig(task="lidar_seg", bags=("b.bag",), store="alluxio://h:39999/t")
    _check_checkpoint_store(shared.validate(), ["a", "b"])
