"""The training function on a tiny task of its own: determinism, sharding, epochs, errors."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from adcloud.store import open_store
from adcloud.train.checkpoint import Checkpointer
from adcloud.train.config import TrainConfig
from adcloud.train.errors import CheckpointError, TrainError
from adcloud.train.loop import batch_generator, learning_rate, resolve_steps, train
from adcloud.train.sync import SingleProcess
from adcloud.train.task import get_task


@dataclass(frozen=True)
class Point:
    x: np.ndarray
    y: float


class RegressionTask:
    """y = x . w + noise, learnt by a small MLP with dropout (so the global RNG matters)."""

    name = "toy_regression"
    topics = ("/toy",)

    def __init__(self, dropout: float = 0.1) -> None:
        self.dropout = dropout

    def samples(self, topic: str, timestamp: int, decoded: Any) -> Iterator[Point]:
        yield Point(np.asarray(decoded, np.float32), 0.0)

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(4, 16),
            torch.nn.Tanh(),
            torch.nn.Dropout(self.dropout),
            torch.nn.Linear(16, 1),
        )

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
        return {"mse": float(torch.nn.functional.mse_loss(model(x), y).detach())}

    def example_inputs(self, samples: Sequence[Point]) -> tuple[Any, ...]:
        return (torch.from_numpy(np.stack([s.x for s in samples[:1]])),)

    def dynamic_shapes(self) -> Any:
        return None


def make_points(n: int, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32) + 0.05 * rng.normal(size=n)
    return [Point(x[i], float(y[i])) for i in range(n)]


def _config(**kw: Any) -> TrainConfig:
    base = {
        "task": "toy_regression",
        "sync": "single",
        "steps": 30,
        "batch_size": 8,
        "lr": 0.02,
        "seed": 1,
        "checkpoint_every": 0,
        "progress": False,
    }
    base.update(kw)
    return TrainConfig(**base).validate()


def test_training_learns_and_records_the_loss_curve() -> None:
    task = RegressionTask()
    points = make_points(64)
    result = train(task, points, _config(), eval_samples=points[:16])
    assert result.steps == 30 and len(result.losses) == 30
    assert np.mean(result.losses[-5:]) < 0.5 * np.mean(result.losses[:5])
    assert result.start_step == 0 and result.mode == "single" and result.world == 1
    assert result.shard_size == 64
    assert set(result.metrics) == {"mse"}
    assert result.samples_per_second > 0
    model = task.build_model()
    model.load_state_dict(result.state_dict())
    model.eval()
    assert task.evaluate(model, points[:16])["mse"] == pytest.approx(result.metrics["mse"])
    summary = json.loads(result.to_json())
    assert summary["losses"] == pytest.approx(list(result.losses))
    assert summary["parameter_bytes"] == len(result.parameters)


def test_the_same_seed_gives_the_same_parameters_and_another_seed_does_not() -> None:
    points = make_points(48)
    first = train(RegressionTask(), points, _config(steps=12))
    second = train(RegressionTask(), points, _config(steps=12))
    other = train(RegressionTask(), points, _config(steps=12, seed=2))
    assert first.losses == second.losses
    assert first.parameters == second.parameters
    assert other.losses != first.losses


def test_batches_come_from_a_generator_seeded_by_seed_rank_and_epoch() -> None:
    def draw(seed: int, rank: int, epoch: int) -> list[int]:
        return torch.randperm(10, generator=batch_generator(seed, rank, epoch)).tolist()

    assert draw(1, 0, 0) == draw(1, 0, 0)
    assert len({tuple(draw(1, r, e)) for r in range(2) for e in range(2)}) == 4


def test_epochs_resolve_to_steps_over_the_smallest_shard() -> None:
    config = _config(steps=0, epochs=3, batch_size=4)
    assert resolve_steps(config, [10]) == 9  # ceil(10 / 4) = 3 batches per epoch
    two = _config(steps=0, epochs=2, batch_size=4, sync="ps", workers=2)
    assert resolve_steps(two, [7, 6]) == 6  # 2 per trainer: ceil(6 / 2) = 3 per epoch
    result = train(RegressionTask(), make_points(10), config)
    assert result.steps == 9 and len(result.losses) == 9
    with pytest.raises(TrainError, match="empty"):
        resolve_steps(two, [5, 0])
    # one of several trainers cannot count epochs over shards it does not see (uneven
    # shards stopped at different steps, and the others hung in their collectives)
    with pytest.raises(TrainError, match=r"epochs=2 with 2 trainers: .*resolve_steps"):
        train(RegressionTask(), make_points(7), two, None, None, 0, 2)


def test_progress_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="adcloud.train.loop"):
        train(RegressionTask(), make_points(16), _config(steps=10, log_every=5))
    steps = [r.getMessage() for r in caplog.records if "step" in r.getMessage()]
    assert any("step 5/10" in m for m in steps) and any("step 10/10" in m for m in steps)


class _Diverging(RegressionTask):
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().loss(model, batch) * float("nan")


def test_bad_inputs_get_clear_errors() -> None:
    points = make_points(16)
    with pytest.raises(TrainError, match="shard is empty"):
        train(RegressionTask(), [], _config())
    with pytest.raises(TrainError, match="multiple of the 3 trainers"):
        train(RegressionTask(), points, _config(), SingleProcess(), None, 0, 3)
    with pytest.raises(TrainError, match="synchronizer is rank 0 of 1"):
        train(RegressionTask(), points, _config(batch_size=8), SingleProcess(), None, 1, 2)
    with pytest.raises(TrainError, match="loss is nan at step 1"):
        train(_Diverging(), points, _config())

    class _NoBatches(RegressionTask):
        def batches(self, samples: Sequence[Point], batch_size: int, generator: torch.Generator):
            return iter(())

    with pytest.raises(TrainError, match="made no batch"):
        train(_NoBatches(), points, _config())


def test_learning_rate_schedules() -> None:
    def rates(steps: int = 11, **kw: Any) -> list[float]:
        config = _config(lr=0.1, **kw)
        return [learning_rate(config, s, steps) for s in range(steps)]

    assert rates() == [0.1] * 11
    cosine = rates(schedule="cosine", final_lr_ratio=0.1)
    assert cosine[0] == pytest.approx(0.1) and cosine[-1] == pytest.approx(0.01)
    assert cosine[5] == pytest.approx(0.055)  # half way: the mean of the ends
    assert all(a > b for a, b in itertools.pairwise(cosine))
    linear = rates(schedule="linear")
    assert linear == pytest.approx([0.1 - 0.01 * s for s in range(11)])
    warm = rates(schedule="cosine", warmup_steps=4)
    assert warm[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    assert warm[4] == pytest.approx(0.1) and warm[-1] == pytest.approx(0.0)
    assert rates(warmup_steps=2)[:3] == pytest.approx([0.05, 0.1, 0.1])
    assert rates(1, schedule="cosine") == [0.1]  # a one-step run keeps lr


def test_a_warmup_as_long_as_the_run_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """warmup_steps >= steps was accepted without a word: the run ended still warming up,
    never reaching lr nor starting its schedule."""
    with caplog.at_level(logging.WARNING, logger="adcloud.train.loop"):
        assert resolve_steps(_config(steps=10, lr=0.1, warmup_steps=9), [16]) == 10
        assert caplog.records == []
        assert resolve_steps(_config(steps=8, lr=0.1, warmup_steps=10), [16]) == 8
        (record,) = caplog.records
        said = record.getMessage()
        assert "warmup_steps 10 covers the whole run of 8 step(s)" in said
        assert "to 0.08 of lr 0.1" in said and "lower warmup_steps" in said
        caplog.clear()
        # epochs resolve first: 2 epochs of ceil(10 / 4) = 3 batches are 6 steps
        resolve_steps(_config(steps=0, epochs=2, batch_size=4, warmup_steps=6), [10])
        assert "whole run of 6 step(s)" in caplog.records[0].getMessage()


class _Slope:
    """loss = w (a single scalar parameter), so plain SGD moves w by exactly -lr per step."""

    name = "toy_slope"
    topics = ("/toy",)

    def build_model(self) -> torch.nn.Module:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(()))
        return model

    def batches(self, samples: Sequence[Any], batch_size: int, generator: Any) -> Iterator[int]:
        yield from range(0, len(samples), batch_size)

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return model.w * 1.0


def test_the_loop_steps_with_the_scheduled_learning_rate() -> None:
    config = _config(
        task="toy_slope",
        optimizer="sgd",
        momentum=0.0,
        lr=0.5,
        steps=9,
        schedule="cosine",
        warmup_steps=2,
        final_lr_ratio=0.2,
    )
    result = train(_Slope(), list(range(16)), config)  # type: ignore[arg-type]
    expected = -sum(learning_rate(config, s, 9) for s in range(9))
    assert float(result.state_dict()["w"]) == pytest.approx(expected, rel=1e-6)
    constant = train(_Slope(), list(range(16)), config.replace(schedule="constant", warmup_steps=0))  # type: ignore[arg-type]
    assert float(constant.state_dict()["w"]) == pytest.approx(-0.5 * 9, rel=1e-6)


def _slope_run(tmp_path: Path, **kw: Any) -> TrainConfig:
    """:class:`_Slope` under plain SGD (lr 0.5), checkpointed every 2 steps in ``tmp_path``."""
    settings: dict[str, Any] = {
        "task": "toy_slope",
        "optimizer": "sgd",
        "momentum": 0.0,
        "lr": 0.5,
        "steps": 4,
        "checkpoint_every": 2,
        "store": "local:///loop-tests",
        "store_options": (f"root={tmp_path}",),
        "run": "slope",
    }
    settings.update(kw)
    return _config(**settings)


def _train_slope(config: TrainConfig) -> float:
    """Train (or resume) ``config``'s slope run as the job does; the final ``w``."""
    checkpointer = Checkpointer(
        open_store(config.store, **config.store_kwargs()),
        config.run_id(),
        every=config.checkpoint_every,
        settings=config.pinned_settings(),
    )
    result = train(_Slope(), list(range(16)), config, None, checkpointer, 0, 1)  # type: ignore[arg-type]
    return float(result.state_dict()["w"])


def test_a_resumed_run_steps_with_its_own_optimizer_settings(tmp_path: Path) -> None:
    """Resumed with other momentum and weight decay, the steps after the checkpoint use them
    (the checkpoint's optimizer state keeps the ones it was trained with)."""
    assert _train_slope(_slope_run(tmp_path)) == pytest.approx(-2.0)
    resumed = _train_slope(_slope_run(tmp_path, steps=6, momentum=0.5, weight_decay=0.25))
    # from w = -2: gradient g = 1 + 0.25 w, momentum buffer b = 0.5 b + g (new: b = g),
    # w -= 0.5 b.  Step 5: g = 0.5, b = 0.5, w = -2.25; step 6: g = 0.4375, b = 0.6875.
    assert resumed == pytest.approx(-2.25 - 0.5 * 0.6875, rel=1e-6)

    # Adam: the moments carry on, the weight decay is the new one
    first = _slope_run(tmp_path, optimizer="adam", run="adam")
    _train_slope(first)
    resumed = _train_slope(first.replace(steps=6, weight_decay=0.25))
    w = torch.nn.Parameter(torch.zeros(()))
    reference = torch.optim.Adam([w], lr=0.5)
    for step in range(6):
        if step == 4:
            reference.param_groups[0]["weight_decay"] = 0.25
        reference.zero_grad()
        (w * 1.0).backward()  # type: ignore[no-untyped-call]
        reference.step()
    assert resumed == pytest.approx(float(w.detach()), rel=1e-6)


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path: Path) -> None:
    _train_slope(_slope_run(tmp_path))
    with pytest.raises(
        CheckpointError,
        match=r"run slope: checkpoint .*step-000000004.* trained with optimizer sgd, this run "
        r"has adam: .* optimizer=sgd to resume it, or give the run a new name \(train.run\)",
    ):
        _train_slope(_slope_run(tmp_path, steps=6, optimizer="adam"))


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ({"momentum": -1.0}, "momentum must be in [0, 1), not -1.0"),
        ({"momentum": 1.0}, "momentum must be in [0, 1), not 1.0"),
        ({"momentum": float("nan")}, "momentum must be in [0, 1), not nan"),
        ({"weight_decay": float("inf")}, "weight_decay must be >= 0 and finite, not inf"),
        ({"weight_decay": float("nan")}, "weight_decay must be >= 0 and finite, not nan"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0 and finite, not -0.1"),
        ({"lr": float("inf")}, "lr must be > 0 and finite, not inf"),
        ({"lr": float("nan")}, "lr must be > 0 and finite, not nan"),
    ],
)
def test_config_validation_checks_the_optimizer_settings(
    setting: dict[str, float], says: str
) -> None:
    with pytest.raises(TrainError, match=re.escape(says)):
        TrainConfig(optimizer="sgd", **setting).validate()  # type: ignore[arg-type]


def test_config_validation_names_the_fields() -> None:
    with pytest.raises(TrainError) as info:
        TrainConfig(
            sync="gossip", batch_size=7, workers=2, lr=-1, schedule="step", final_lr_ratio=2
        ).validate()
    text = str(info.value)
    assert "sync must be one of" in text and "lr must be > 0" in text
    assert "schedule must be one of constant, cosine, linear" in text
    assert "final_lr_ratio must be in [0, 1], not 2" in text
    with pytest.raises(TrainError, match="warmup_steps must be >= 0, not -1"):
        TrainConfig(warmup_steps=-1).validate()
    with pytest.raises(TrainError, match="multiple of workers"):
        TrainConfig(sync="ps", workers=2, batch_size=7).validate()


def test_values_of_another_type_are_named() -> None:
    # from a notebook: steps="100" ended in a TypeError traceback, and
    # resume_changed_data="false" (a non-empty string, so true) let a run resume on changed
    # data; one store option given as a string was refused character by character
    text: Any = {"steps": "100", "lr": "1e-3", "resume_changed_data": "false"}
    with pytest.raises(TrainError) as info:
        TrainConfig(**text).validate()
    said = str(info.value)
    assert "steps must be a whole number, not str '100'" in said
    assert "lr must be a number, not str '1e-3'" in said
    assert "resume_changed_data must be true or false, not str 'false'" in said
    with pytest.raises(TrainError, match=r"workers must be a whole number, not float 2\.5"):
        TrainConfig(sync="allreduce", workers=2.5).validate()  # type: ignore[arg-type]
    one: Any = "root=/tmp/x"
    config = TrainConfig(store_options=one, lr=1, partitions_per_bag=None).validate()
    assert config.store_options == ("root=/tmp/x",)
    assert config.store_kwargs() == {"root": "/tmp/x"}
    # NumPy's scalars are numbers: taken as Python's, which settings.json can hold
    numpy_made: Any = {"steps": np.int64(7), "lr": np.float32(0.5), "progress": np.bool_(False)}
    config = TrainConfig(**numpy_made).validate()
    assert (config.steps, config.lr, config.progress) == (7, 0.5, False)
    assert type(config.steps) is int and type(config.lr) is float
    json.dumps(dataclasses.asdict(config))
    with pytest.raises(TrainError, match=r"steps must be a whole number, not float 7\.5"):
        TrainConfig(steps=np.float64(7.5)).validate()  # type: ignore[arg-type]


def test_paths_are_taken_where_a_setting_is_a_place(tmp_path: Path) -> None:
    """A notebook's out=run_dir / "seg" was refused as "out must be text, not PosixPath",
    while bags=Path(...) is taken: a path is its text, in the run id and settings.json."""
    given: Any = {"out": tmp_path / "{run}", "etl_dir": tmp_path / "etl"}
    config = TrainConfig(bags=tmp_path / "a.bag", **given).validate()
    assert (config.out, config.etl_dir) == (f"{tmp_path}/{{run}}", f"{tmp_path}/etl")
    assert config == TrainConfig(bags=f"{tmp_path}/a.bag", **{k: str(v) for k, v in given.items()})
    assert config.output_dir("r") == f"{tmp_path}/r"
    json.dumps(config.to_dict())


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_named(seed: int) -> None:
    # --set seed=18446744073709551616 failed once the bags were decoded, in torch.manual_seed,
    # with "ValueError: Overflow when unpacking long long"
    with pytest.raises(TrainError, match=rf"seed must be in \[-2\*\*63, 2\*\*64\), not {seed}$"):
        TrainConfig(seed=seed).validate()
    for fine in (2**64 - 1, -(2**63), -1):
        assert TrainConfig(seed=fine).validate().seed == fine


def test_zero_workers_are_named_not_divided_by() -> None:
    # workers=0 (--set workers=0) ended in a ZeroDivisionError traceback from the batch check
    with pytest.raises(TrainError, match=r"invalid train settings: workers must be >= 1, not 0$"):
        TrainConfig(sync="allreduce", workers=0).validate()


def test_config_loads_from_file_and_environment(tmp_path: Any) -> None:
    path = tmp_path / "settings.yaml"
    path.write_text("train:\n  sync: ps\n  workers: 2\n  task_options: {voxel: 0.2}\n")
    env = {"ADCLOUD_TRAIN_BATCH_SIZE": "16", "ADCLOUD_TRAIN_BAGS": "a.bag,b.bag"}
    config = TrainConfig.load(file=path, environ=env, lr=0.5)
    assert (config.sync, config.workers, config.batch_size, config.lr) == ("ps", 2, 16, 0.5)
    assert config.bags == ("a.bag", "b.bag")
    assert config.task_options == {"voxel": 0.2}
    assert config.world == 2
    from_env = TrainConfig.load(environ={"ADCLOUD_TRAIN_TASK_OPTIONS": '{"preset": "small"}'})
    assert from_env.task_options == {"preset": "small"}
    with pytest.raises(TrainError, match="task_options"):
        TrainConfig.load(environ={"ADCLOUD_TRAIN_TASK_OPTIONS": "{oops"})
    # the run id follows what decides the result, not where it is written
    assert config.run_id() == config.replace(out="/elsewhere").run_id()
    assert config.run_id() != config.replace(seed=9).run_id()
    assert config.replace(run="mine").run_id() == "mine"
    assert TrainConfig(store_options=("root=/tmp/x",)).store_kwargs() == {"root": "/tmp/x"}


@pytest.mark.parametrize(
    "name", [f.name for f in dataclasses.fields(TrainConfig) if f.type == "float"]
)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_every_float_setting_must_be_finite(name: str, value: float) -> None:
    """A value that passes a "> 0" check (sync_timeout_s=inf) must not reach the run: the
    settings are written as JSON beside the model once the training is done."""
    with pytest.raises(TrainError, match=rf"{name} must be .*(finite|in \[0, 1\)|in \[0, 1\])"):
        TrainConfig(**{name: value}).validate()


def test_sync_timeout_must_be_a_finite_number_of_seconds() -> None:
    for value in (float("inf"), float("nan"), 0.0):
        with pytest.raises(TrainError, match=rf"sync_timeout_s must be > 0 and finite .*{value}"):
            TrainConfig(sync_timeout_s=value).validate()


@pytest.mark.parametrize(
    ("task", "options", "says"),
    [
        ("lidar_seg", {"r_max_m": float("inf")}, "lidar_seg option r_max_m must be finite"),
        ("lidar_seg", {"r_min_m": float("nan")}, "lidar_seg option r_min_m must be finite"),
        (
            "camera_seg",
            {"class_weights": [1.0] * 10 + [float("inf")]},
            "camera_seg option class_weights must be finite",
        ),
    ],
)
def test_task_options_must_be_finite(task: str, options: dict[str, Any], says: str) -> None:
    with pytest.raises(TrainError, match=re.escape(says)):
        get_task(task, options)


def test_a_process_private_store_is_refused_where_trainers_run_apart() -> None:
    """memory:// is each Python process's own: ps trainers (Spark executors) would wait
    sync_timeout_s for parameters they cannot see, allreduce trainers for checkpoint parts;
    a single-process run in the driver keeps its checkpoints there."""
    with pytest.raises(TrainError, match=r"store memory://x is private.*sync=ps.*local:///"):
        TrainConfig(store="memory://x", sync="ps").validate()
    with pytest.raises(TrainError, match=r"sync=allreduce.*checkpoint_every=0"):
        TrainConfig(store="memory://x", sync="allreduce").validate()
    TrainConfig(store="memory://x", sync="allreduce", checkpoint_every=0).validate()
    TrainConfig(store="memory://x", sync="single").validate()


def test_a_single_run_in_this_process_resumes_from_a_memory_store() -> None:
    config = _config(store="memory://single-run", run="in-memory", steps=4, checkpoint_every=2)
    store = open_store(config.store)
    first = train(
        RegressionTask(), make_points(16), config, None, Checkpointer(store, "in-memory", every=2)
    )
    again = train(
        RegressionTask(),
        make_points(16),
        config.replace(steps=6),
        None,
        Checkpointer(store, "in-memory", every=2),
    )
    assert (first.start_step, again.start_step) == (0, 4)


@pytest.mark.parametrize("name", [".", "..", "a/b", "../up", ".hidden", "a b", "a\\b", "x\n"])
def test_run_names_are_plain_names(name: str) -> None:
    with pytest.raises(TrainError, match=r"run must be a plain name .*not"):
        TrainConfig(run=name).validate()
    for good in ("seg", "seg-2026.11_a", "lidar_seg-0123abcd"):
        assert TrainConfig(run=good).validate().run_id() == good


# Every setting, as deciding the trained parameters (in the default run id) or not.
_DECISIVE = {
    "task": "camera_seg",
    "task_options": {"preset": "full"},
    "bags": ("other.bag",),
    "sync": "ps",
    "workers": 4,
    "steps": 300,
    "epochs": 2,
    "batch_size": 16,
    "optimizer": "sgd",
    "lr": 0.5,
    "momentum": 0.5,
    "weight_decay": 0.1,
    "schedule": "cosine",
    "warmup_steps": 5,
    "final_lr_ratio": 0.1,
    "seed": 7,
    "partitions_per_bag": 3,  # a camera image and its labels split apart make no sample
}
_NOT_DECISIVE = {
    "heldout_bags": ("test.bag",),
    "checkpoint_every": 7,
    "keep_checkpoints": 9,
    "store": "alluxio://h:39999/x",
    "store_options": ("root=/tmp/elsewhere",),
    "out": "/elsewhere/{run}",
    "device": "cpu",
    "sync_timeout_s": 5.0,
    "keep_versions": 5,
    "threads": 3,
    "etl": "files",
    "etl_dir": "/tmp/etl",
    "keep_etl_files": True,
    "log_every": 3,
    "eval_every": 4,
    "progress": False,
    "resume_changed_data": True,
}


def test_the_default_run_id_covers_what_decides_the_parameters_and_nothing_else() -> None:
    """The README: a run is named by a digest of the settings that decide its parameters;
    the same training on another device, with other threads, checkpoints elsewhere or
    more often, resumes the same run."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"run"}
    assert set(_DECISIVE) | set(_NOT_DECISIVE) == fields  # a new setting needs a decision
    base = TrainConfig(task="lidar_seg", bags=("drive.bag",), workers=2, batch_size=8)
    for name, value in _NOT_DECISIVE.items():
        changed = dataclasses.replace(base, **{name: value})
        assert changed.run_id("data") == base.run_id("data"), name
    for name, value in _DECISIVE.items():
        changed = dataclasses.replace(base, **{name: value})
        assert changed.run_id("data") != base.run_id("data"), name
    assert base.run_id("other data") != base.run_id("data")


def test_a_checkpoint_past_the_steps_is_refused(tmp_path: Path) -> None:
    """Resumed with fewer steps than its checkpoint has done, a run would train nothing and
    export the checkpoint's model as one of fewer steps (and a negative throughput)."""
    config = _config(
        store="local:///past", store_options=(f"root={tmp_path}",), run="past", steps=6
    )
    store = open_store(config.store, **config.store_kwargs())

    def run(steps: int) -> Any:
        checkpointer = Checkpointer(store, "past", every=3)
        return train(
            RegressionTask(), make_points(16), config.replace(steps=steps), None, checkpointer
        )

    assert run(6).steps == 6
    with pytest.raises(
        CheckpointError,
        match=r"run past: checkpoint .*step-000000006 is at step 6, past this run's 3 steps: "
        r"raise train.steps to 6 or more .* new name \(train.run\)",
    ):
        run(3)
    again = run(6)  # as many steps: nothing left to train, the same model
    assert (again.start_step, again.steps, len(again.losses)) == (6, 6, 6)
