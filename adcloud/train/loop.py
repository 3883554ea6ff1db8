"""The training function: one trainer's loop over its shard, the same everywhere it runs.

:func:`train` runs unchanged in one process (``sync="single"``), in every task of a Spark
barrier stage (:mod:`adcloud.train.job`) and under ``torchrun``; only the
:class:`~adcloud.train.sync.Synchronizer` differs.  It is deterministic given the seed:

- the model is initialised after ``torch.manual_seed(seed)``, the same on every trainer (and
  the synchronizer's ``start`` makes every trainer take rank 0's parameters anyway);
- trainer ``r`` draws epoch ``e``'s batches of its shard from a ``torch.Generator`` seeded by
  ``(seed, r, e)``; its global RNGs (dropout, augmentation outside the generator) are seeded
  by ``(seed, r)``;
- a checkpoint records the model, the optimizer, the loss curve, and per trainer the data
  position (epoch, batch index) and RNG states, so a resumed run replays the epoch's
  generator to the same batch and computes exactly what the uninterrupted run would have.

Each trainer takes ``batch_size // world`` samples per step, so the averaged gradient is
that of one global batch of ``batch_size``; the recorded loss per step is the mean over the
trainers.  Progress is logged every ``log_every`` steps; a tqdm bar is shown only for one
trainer on an interactive terminal.  With a ``validate`` function and ``eval_every > 0``,
every trainer calls it after every ``eval_every``-th step but the last (the caller scores
the last); the scores form the validation curve, kept in checkpoints like the losses.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from adcloud.train.checkpoint import Checkpointer, Restored, capture_rng, restore_rng
from adcloud.train.config import TrainConfig
from adcloud.train.errors import CheckpointError, TrainError
from adcloud.train.sync import SingleProcess, Synchronizer
from adcloud.train.tensors import decode_tensors, encode_tensors

if TYPE_CHECKING:
    from adcloud.train.task import Task

__all__ = [
    "TrainResult",
    "batch_generator",
    "learning_rate",
    "make_optimizer",
    "past_steps",
    "resolve_device",
    "resolve_steps",
    "train",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """What one training run produced (as seen by rank 0 unless said otherwise).

    ``losses[i]`` is the mean loss over the trainers at step ``i + 1`` (the whole curve,
    also the part before a resume, taken from the checkpoint); ``start_step`` is the
    checkpoint step the run resumed from (0: a fresh start); ``parameters`` is the final
    ``state_dict`` in the :mod:`adcloud.train.tensors` format (empty on ranks other than
    0); ``seconds`` is this trainer's wall time for its steps and ``samples_per_second``
    the global training throughput over those steps; ``sync`` holds the synchronizer's
    seconds and bytes; ``metrics`` the held-out evaluation, when one was made; ``output``
    where the job wrote the run's model and results (empty until it has).
    """

    task: str
    run: str
    mode: str
    world: int
    steps: int
    start_step: int
    losses: tuple[float, ...]
    parameters: bytes
    seconds: float
    samples_per_second: float
    shard_size: int
    metrics: dict[str, float] = field(default_factory=dict)
    sync: dict[str, float] = field(default_factory=dict)
    output: str = ""
    validation: tuple[tuple[int, dict[str, float]], ...] = ()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final parameters and buffers (for ``model.load_state_dict``)."""
        if not self.parameters:
            raise TrainError(f"run {self.run}: this result carries no parameters (not rank 0)")
        return decode_tensors(self.parameters, source=f"run {self.run} result").tensors

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (everything but the parameter bytes)."""
        return {
            "task": self.task,
            "run": self.run,
            "mode": self.mode,
            "world": self.world,
            "steps": self.steps,
            "start_step": self.start_step,
            "losses": [_json_float(v) for v in self.losses],
            "seconds": self.seconds,
            "samples_per_second": self.samples_per_second,
            "shard_size": self.shard_size,
            "metrics": {k: _json_float(v) for k, v in self.metrics.items()},
            "validation": [
                {"step": step, **{k: _json_float(v) for k, v in scores.items()}}
                for step, scores in self.validation
            ],
            "sync": dict(self.sync),
            "parameter_bytes": len(self.parameters),
            "output": self.output,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def _json_float(value: float) -> float | str:
    return value if math.isfinite(value) else repr(value)


def _seed(*parts: int) -> int:
    """A 32-bit seed derived from ``parts`` (NumPy's SeedSequence hashing)."""
    return int(np.random.SeedSequence([p & 0xFFFFFFFF for p in parts]).generate_state(1)[0])


_RNG_SALT = 0x5EED
_BATCH_SALT = 0xBA7C


def batch_generator(seed: int, rank: int, epoch: int) -> torch.Generator:
    """The generator trainer ``rank`` draws epoch ``epoch``'s batches from."""
    generator = torch.Generator()
    generator.manual_seed(_seed(seed, rank, epoch, _BATCH_SALT))
    return generator


def _seed_globals(seed: int, rank: int) -> None:
    value = _seed(seed, rank, _RNG_SALT)
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """``auto`` -> CUDA (device ``rank`` modulo the count) when present, else the CPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainError(
            "train.device is cuda but torch sees no CUDA device: install a CUDA build of "
            "torch on a GPU machine, or set device to auto or cpu"
        )
    return torch.device("cuda", rank % torch.cuda.device_count())


def resolve_steps(config: TrainConfig, shard_sizes: Sequence[int]) -> int:
    """Optimizer steps of the run: ``steps``, or ``epochs`` passes over the smallest shard.

    An epoch counts ``ceil(n / (batch_size // world))`` batches of the smallest shard ``n``.
    A warm-up as long as the run is logged as a warning (the schedule never starts).
    """
    if config.epochs <= 0:
        steps = config.steps
    else:
        per_rank = config.batch_size // max(1, len(shard_sizes))
        smallest = min(shard_sizes) if shard_sizes else 0
        if smallest == 0:
            raise TrainError("cannot count epochs: a trainer's shard is empty")
        steps = config.epochs * math.ceil(smallest / per_rank)
    if config.warmup_steps >= steps > 0:
        # not an error: a short trial run of a long run's config is common, and it trains
        log.warning(
            "train.warmup_steps %d covers the whole run of %d step(s): the learning rate "
            "only ramps up, to %.3g of lr %.3g at the last step, and the %s schedule never "
            "starts; lower warmup_steps below the steps",
            config.warmup_steps,
            steps,
            config.lr * steps / config.warmup_steps,
            config.lr,
            config.schedule,
        )
    return steps


def make_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` over the trainable parameters of ``model``."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise TrainError(f"task {config.task}: the model has no trainable parameters")
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    raise TrainError(f"train.optimizer {config.optimizer!r} is not one of adam, adamw, sgd")


def learning_rate(config: TrainConfig, step: int, steps: int) -> float:
    """The learning rate of 0-based ``step`` of a ``steps``-step run (``config.schedule``).

    Warm-up takes step ``s < warmup_steps`` to ``lr * (s + 1) / warmup_steps``; after it,
    ``cosine`` and ``linear`` go from ``lr`` at the first step after warm-up to
    ``lr * final_lr_ratio`` at the last step.  A pure function of the step, so every trainer
    and every resumed run computes the same value without scheduler state to checkpoint.
    """
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    span = steps - 1 - config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / span) if span > 0 else 0.0
    floor = config.lr * config.final_lr_ratio
    if config.schedule == "cosine":
        return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if config.schedule == "linear":
        return config.lr + (floor - config.lr) * progress
    raise TrainError(f"train.schedule {config.schedule!r} is not one of constant, cosine, linear")


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class _Batches:
    """Trainer ``rank``'s endless stream of batches with its position (epoch, index)."""

    def __init__(
        self,
        task: Task,
        samples: Sequence[Any],
        batch_size: int,
        seed: int,
        rank: int,
        epoch: int = 0,
        index: int = 0,
    ) -> None:
        self.task = task
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.epoch = epoch
        self.index = 0
        self._it = self._open()
        # Replay the epoch's generator up to the saved position: batches are a function of
        # the generator only, so this reproduces the stream exactly.
        for _ in range(index):
            self.next()

    def _open(self) -> Iterator[Any]:
        generator = batch_generator(self.seed, self.rank, self.epoch)
        return iter(self.task.batches(self.samples, self.batch_size, generator))

    def next(self) -> Any:
        """The next batch, starting a new epoch when this one is exhausted."""
        for _ in range(2):
            try:
                batch = next(self._it)
            except StopIteration:
                if self.index == 0:
                    break
                self.epoch += 1
                self.index = 0
                self._it = self._open()
                continue
            self.index += 1
            return batch
        raise TrainError(
            f"trainer {self.rank}: task {self.task.name} made no batch from a shard of "
            f"{len(self.samples)} sample(s) with batch size {self.batch_size}; give the run "
            "more data or a smaller batch_size"
        )


def _check_restorable(
    run: str, restored: Restored, model: torch.nn.Module, config: TrainConfig
) -> None:
    """Raise :class:`CheckpointError` naming the tensors when ``restored`` was written for
    another model (a named run resumed after the task or its options changed), or naming the
    optimizers when it was trained with another optimizer (whose state, Adam's moments or
    SGD's momentum buffers, this one cannot take up)."""
    saved_optimizer = (restored.info.settings or {}).get("optimizer")
    if saved_optimizer is not None and saved_optimizer != config.optimizer:
        raise CheckpointError(
            f"run {run}: checkpoint {restored.info.key} (step {restored.step}) was trained "
            f"with optimizer {saved_optimizer}, this run has {config.optimizer}: its optimizer "
            f"state cannot resume another optimizer; run with optimizer={saved_optimizer} to "
            "resume it, or give the run a new name (train.run)"
        )
    state = model.state_dict()
    saved = restored.model
    problems = [f"{name} is missing" for name in sorted(set(state) - set(saved))]
    problems += [f"{name} is not in this model" for name in sorted(set(saved) - set(state))]
    problems += [
        f"{name} is {tuple(saved[name].shape)}, the model's {tuple(tensor.shape)}"
        for name, tensor in state.items()
        if name in saved and tuple(saved[name].shape) != tuple(tensor.shape)
    ]
    if problems:
        shown = "; ".join(problems[:4]) + (
            f"; {len(problems) - 4} more" if len(problems) > 4 else ""
        )
        raise CheckpointError(
            f"run {run}: checkpoint {restored.info.key} (step {restored.step}) was written "
            f"for another model: {shown}. Give this training a new name (train.run), or "
            "leave train.run empty so that the run id follows the task options"
        )


def past_steps(run: str, key: str, step: int, steps: int) -> str:
    """What to say of a run resumed with fewer ``steps`` than its checkpoint ``key`` has
    done: it would train nothing, yet call the step-``step`` model a ``steps``-step one."""
    return (
        f"run {run}: checkpoint {key} is at step {step}, past this run's {steps} steps: raise "
        f"train.steps to {step} or more to resume it ({step} exports it as it is), or give "
        "the run a new name (train.run) to train afresh"
    )


def train(
    task: Task,
    samples: Sequence[Any],
    config: TrainConfig,
    sync: Synchronizer | None = None,
    checkpointer: Checkpointer | None = None,
    rank: int = 0,
    world: int = 1,
    *,
    eval_samples: Sequence[Any] | None = None,
    validate: Callable[[torch.nn.Module, int], dict[str, float]] | None = None,
    device_index: int | None = None,
) -> TrainResult:
    """Train ``task``'s model on this trainer's shard ``samples``; see the module docstring.

    ``sync`` defaults to :class:`~adcloud.train.sync.SingleProcess`; its rank and world must
    be ``rank`` and ``world``; the caller closes it.  With a ``checkpointer`` the run resumes
    from the newest good checkpoint and saves every ``checkpoint_every`` steps and after the
    last.  Rank 0 evaluates on ``eval_samples`` when given.  ``validate(model, step)``
    returns held-out scores; it is called on every trainer at the same steps (every
    ``eval_every``-th but the last), so it may synchronise them.  ``device_index`` is the
    CUDA device to take (the trainer's place on its host, or the GPU its scheduler gave it;
    default ``rank``), modulo the devices torch sees.  With several trainers ``config`` gives
    ``steps``, not ``epochs`` (see :func:`resolve_steps`).
    """
    sync = SingleProcess() if sync is None else sync
    if config.epochs > 0 and world > 1:
        # each trainer would count the epochs of its own shard: with shards of other sizes
        # they would stop at different steps, and the ones still stepping wait forever
        raise TrainError(
            f"epochs={config.epochs} with {world} trainers: an epoch is counted over the "
            "smallest shard, which one trainer cannot see; resolve it to steps first, with "
            "every shard's size (config.replace(steps=resolve_steps(config, sizes), "
            "epochs=0)), as run_training does"
        )
    if config.batch_size % world:
        raise TrainError(
            f"batch_size {config.batch_size} is not a multiple of the {world} trainers"
        )
    if (sync.rank, sync.world) != (rank, world):
        raise TrainError(
            f"the synchronizer is rank {sync.rank} of {sync.world}, the trainer rank {rank} of "
            f"{world}: pass the same rank and world to both"
        )
    if not samples:
        raise TrainError(f"trainer {rank} of {world} got no samples: its shard is empty")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    run = config.run_id()
    steps = resolve_steps(config, [len(samples)] * world)
    per_rank = config.batch_size // world
    device = resolve_device(config.device, rank if device_index is None else device_index)

    torch.manual_seed(config.seed)
    model = task.build_model().to(device)
    optimizer = make_optimizer(config, model)
    _seed_globals(config.seed, rank)

    start, epoch, index = 0, 0, 0
    losses: list[float] = []
    validation: list[tuple[int, dict[str, float]]] = []
    restored = checkpointer.restore(rank=rank, world=world) if checkpointer else None
    if restored is not None:
        _check_restorable(run, restored, model, config)
        if restored.step > steps:
            raise CheckpointError(past_steps(run, restored.info.key, restored.step, steps))
        model.load_state_dict(restored.model)
        if restored.optimizer is not None:
            # The saved param groups hold the hyperparameters the checkpoint was trained
            # with; this run's (weight_decay, momentum, betas, ...) apply from here on, as
            # its lr does, so what settings.json records is what the steps after it used.
            settings = [
                {k: v for k, v in group.items() if k != "params"}
                for group in optimizer.param_groups
            ]
            optimizer.load_state_dict(restored.optimizer)
            for group, setting in zip(optimizer.param_groups, settings, strict=True):
                group.update(setting)
        restore_rng(restored.rng)
        start, epoch, index = restored.step, restored.epoch, restored.batch_index
        losses = list(restored.losses[:start])
        validation = [(k, v) for k, v in restored.validation if k <= start]
        log.info("run %s: trainer %d resumes at step %d (epoch %d)", run, rank, start, epoch)
    stream = _Batches(task, samples, per_rank, config.seed, rank, epoch, index)

    sync.start(model, optimizer, start)
    bar = None
    if world == 1 and config.progress and sys.stderr.isatty():
        from tqdm import tqdm  # noqa: PLC0415 - only interactive runs draw a bar

        bar = tqdm(total=steps, initial=start, desc=f"train {task.name}", unit="step")
    began = time.perf_counter()
    try:
        for step in range(start, steps):
            batch = _to_device(stream.next(), device)
            model.train()
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            lr = learning_rate(config, step, steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            mean_loss = sync.step(model, optimizer, step, float(loss.detach()))
            if not math.isfinite(mean_loss):
                raise TrainError(
                    f"run {run}: the loss is {mean_loss} at step {step + 1}; lower train.lr "
                    "or check the data"
                )
            losses.append(mean_loss)
            done = step + 1
            # every eval_every-th step but the last: the caller scores the finished model
            due = bool(config.eval_every) and done % config.eval_every == 0 and done < steps
            if validate is not None and due:
                rng = capture_rng()  # scoring never changes what training draws next
                scores = validate(model, done)
                restore_rng(rng)
                validation.append((done, scores))
                shown = ", ".join(f"{k} {v:.4f}" for k, v in list(scores.items())[:3])
                log.info("run %s trainer %d: held-out at step %d: %s", run, rank, done, shown)
            if checkpointer is not None and checkpointer.due(done, last=done == steps):
                checkpointer.save(
                    done,
                    rank=rank,
                    world=world,
                    model=model,
                    optimizer=optimizer if sync.owns_optimizer else None,
                    epoch=stream.epoch,
                    batch_index=stream.index,
                    losses=losses,
                    rng=capture_rng(),
                    validation=validation,
                )
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{mean_loss:.4f}")
            if done % config.log_every == 0 or done == steps:
                elapsed = time.perf_counter() - began
                rate = (done - start) * config.batch_size / elapsed if elapsed > 0 else 0.0
                log.info(
                    "run %s trainer %d/%d: step %d/%d loss %.5f lr %.3g (%.1f samples/s)",
                    run,
                    rank,
                    world,
                    done,
                    steps,
                    mean_loss,
                    lr,
                    rate,
                )
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - began
    metrics: dict[str, float] = {}
    if rank == 0 and eval_samples:
        model.eval()
        with torch.no_grad():
            metrics = dict(task.evaluate(model, eval_samples))
    parameters = encode_tensors(dict(model.state_dict()), {"run": run, "step": steps})
    return TrainResult(
        task=task.name,
        run=run,
        mode=sync.mode,
        world=world,
        steps=steps,
        start_step=start,
        losses=tuple(losses),
        parameters=parameters if rank == 0 else b"",
        seconds=seconds,
        samples_per_second=(steps - start) * config.batch_size / seconds if seconds > 0 else 0.0,
        shard_size=len(samples),
        metrics=metrics,
        sync=sync.stats(),
        validation=tuple(validation),
    )
