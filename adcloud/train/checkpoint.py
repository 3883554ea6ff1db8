"""Checkpoints of a training run in the store, and resuming from the newest good one.

Layout in the store (every file an :mod:`adcloud.train.tensors` file, written with
:func:`~adcloud.train.tensors.encode_tree`; no pickle)::

    /<run>/checkpoints/step-<N:09d>/state       model state_dict, optimizer state_dict, the
                                                loss curve and the validation curve (JSON
                                                text; absent in older checkpoints) so far,
                                                step N, world size, the pinned settings and
                                                the training data's fingerprint (JSON text;
                                                absent in older checkpoints) (rank 0)
    /<run>/checkpoints/step-<N:09d>/rank-<r>    trainer r's data position (epoch, batch index
                                                within the epoch) and RNG states: torch (and
                                                CUDA), NumPy, Python ``random``
    /<run>/checkpoints/latest                   JSON pointer {"step", "key", "world"},
                                                written last, by rank 0

A checkpoint is *complete* when ``state`` and one ``rank-<r>`` per trainer are present and
intact; every file is published atomically by the store, so a trainer killed while saving
leaves an incomplete checkpoint that restoring skips.  The pointer is a hint: restoring
tries the pointer's step and then every ``step-*`` directory newest first, and falls back
past a corrupt or truncated checkpoint with a warning naming the key and byte offset (a
:class:`~adcloud.train.errors.CheckpointError`).  Every trainer checks every file of the
candidate, so all trainers of a run resume from the same step.  Rank 0 keeps the newest
``keep`` checkpoints up to the one it just wrote and deletes older ones, and any past it (an
unusable one the run resumed before).

Restoring gives the model and optimizer state, the data position and the RNG states, so a
resumed run computes exactly what the uninterrupted run would have (see
:func:`adcloud.train.loop.train`).
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adcloud.store import Store, StoreError, StoreNotFoundError, WriteType
from adcloud.train.errors import CheckpointError
from adcloud.train.tensors import TensorFormatError, decode_tree, encode_tree

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "Restored",
    "capture_rng",
    "latest_checkpoint",
    "restore_rng",
    "resume_with",
]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{9})$")
_FORMAT = "adcloud-checkpoint"
_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: run, ``step`` (optimizer steps done), store ``key`` of its
    directory, ``world`` (trainers that wrote it)."""

    run: str
    step: int
    key: str
    world: int
    #: The settings the run had when it wrote the checkpoint (``TrainConfig.pinned_settings``;
    #: None for checkpoints written without them).
    settings: dict[str, Any] | None = None
    #: What the run was trained on when it wrote the checkpoint: the fingerprint of each
    #: training bag (:func:`adcloud.train.job.data_fingerprint`; None for checkpoints written
    #: without one, or by a run given its samples rather than bags).
    data: dict[str, Any] | None = None


@dataclass(frozen=True)
class Restored:
    """What one trainer resumes from (tensors on the CPU)."""

    info: CheckpointInfo
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    epoch: int
    batch_index: int
    rng: dict[str, Any]
    losses: list[float]
    #: The validation curve so far: ``(step, scores)`` (empty in checkpoints without one).
    validation: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def step(self) -> int:
        """Optimizer steps done at the checkpoint."""
        return self.info.step


def resume_with(world: int) -> str:
    """The settings that give a run ``world`` trainers, as advice (``workers`` alone has no
    effect with ``sync=single``, which always has one)."""
    if world == 1:
        return "run with sync=single (or workers=1)"
    return f"run with sync=allreduce (or ps) and workers={world}"


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch CPU (and every CUDA device), NumPy, Python."""
    np_state: Any = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(np_state[0]),
            "keys": np.asarray(np_state[1], dtype=np.uint32),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {
            "version": int(py_version),
            "internal": np.asarray(py_internal, dtype=np.int64),
            "gauss": py_gauss,
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set this process's RNGs to ``state`` (from :func:`capture_rng`)."""
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state(
        (
            str(n["name"]),
            np.asarray(n["keys"], dtype=np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        )
    )
    p = state["python"]
    random.setstate((int(p["version"]), tuple(int(v) for v in p["internal"]), p["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.as_tensor(t, dtype=torch.uint8) for t in cuda])


class _IncompleteError(CheckpointError):
    """A part of the checkpoint was never written (its writer died while saving)."""


def _dir_key(run: str, step: int) -> str:
    return f"/{run}/checkpoints/step-{step:09d}"


def _pointer_key(run: str) -> str:
    return f"/{run}/checkpoints/latest"


class Checkpointer:
    """Saves a run's checkpoints to ``store`` every ``every`` steps and restores them.

    ``run`` names the run's directory; ``keep`` is how many checkpoints rank 0 keeps;
    ``timeout_s`` how long rank 0 waits for the other trainers' parts before it gives up on
    publishing the pointer (the checkpoint then simply stays incomplete).  ``write_type``
    defaults to the store's own (the local store's ``ASYNC_THROUGH`` persists through a
    journal, so an acknowledged checkpoint survives a killed process).  ``settings`` and
    ``data`` are recorded in every checkpoint (:attr:`CheckpointInfo.settings`,
    :attr:`CheckpointInfo.data`), so that a resumed run can be checked against them.
    """

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        every: int,
        keep: int = 3,
        timeout_s: float = 120.0,
        write_type: WriteType | str | None = None,
        settings: Mapping[str, Any] | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        if every < 0 or keep < 1:
            raise CheckpointError(f"checkpoint every={every} must be >= 0 and keep={keep} >= 1")
        self.store = store
        self.run = run.strip("/")
        self.every = every
        self.keep = keep
        self.timeout_s = timeout_s
        self.write_type = write_type
        self.settings = None if settings is None else dict(settings)
        self.data = None if data is None else dict(data)
        self.saved_seconds = 0.0

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether a checkpoint is due after ``step`` optimizer steps (always after the last)."""
        return self.every > 0 and step > 0 and (step % self.every == 0 or last)

    def _put(self, key: str, data: bytes) -> None:
        try:
            self.store.put(key, data, write_type=self.write_type)
        except StoreError as err:
            raise CheckpointError(
                f"cannot write checkpoint file {self.store.uri}{key}: {err}; check the store "
                "(capacity, permissions) or lower train.keep_checkpoints"
            ) from err

    def save(
        self,
        step: int,
        *,
        rank: int,
        world: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        epoch: int,
        batch_index: int,
        losses: Sequence[float],
        rng: Mapping[str, Any] | None = None,
        validation: Sequence[tuple[int, Mapping[str, float]]] = (),
    ) -> None:
        """Write this trainer's part of the checkpoint after ``step`` optimizer steps.

        Every trainer writes its data position and RNG states; rank 0 also writes the model,
        ``optimizer`` (its state is the run's: pass the optimizer that steps) and the loss
        curve, waits for the other parts, publishes the pointer and prunes old checkpoints.
        """
        tick = time.perf_counter()
        base = _dir_key(self.run, step)
        part = {
            "step": step,
            "rank": rank,
            "world": world,
            "epoch": epoch,
            "batch_index": batch_index,
            "rng": dict(rng if rng is not None else capture_rng()),
        }
        meta = {"format": _FORMAT, "version": _VERSION, "kind": "rank", "run": self.run}
        self._put(f"{base}/rank-{rank}", encode_tree(part, meta))
        if rank == 0:
            state = {
                "step": step,
                "world": world,
                "model": dict(model.state_dict()),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "losses": np.asarray(losses, dtype=np.float64),
                # JSON text (the scores' names vary by task): [[step, {name: value}], ...]
                "validation": json.dumps([[k, dict(v)] for k, v in validation]),
                "settings": json.dumps(self.settings, sort_keys=True, default=str),
                "data": json.dumps(self.data, sort_keys=True, default=str),
            }
            meta = {"format": _FORMAT, "version": _VERSION, "kind": "state", "run": self.run}
            self._put(f"{base}/state", encode_tree(state, meta))
            if self._wait_for_parts(base, world):
                pointer = {"run": self.run, "step": step, "key": base, "world": world}
                self._put(_pointer_key(self.run), json.dumps(pointer).encode())
                self._prune(step)
                log.info(
                    "run %s: checkpoint at step %d in %s%s", self.run, step, self.store.uri, base
                )
        self.saved_seconds += time.perf_counter() - tick

    def _wait_for_parts(self, base: str, world: int) -> bool:
        deadline = time.monotonic() + self.timeout_s
        missing = list(range(world))
        pause = 0.001
        while True:
            missing = [r for r in missing if not self.store.exists(f"{base}/rank-{r}")]
            if not missing:
                return True
            if time.monotonic() > deadline:
                log.warning(
                    "run %s: checkpoint %s stays incomplete: rank(s) %s did not write their "
                    "part within %.0f s; resuming will use an older checkpoint",
                    self.run,
                    base,
                    missing,
                    self.timeout_s,
                )
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep`` checkpoints up to ``step``, the one just published.

        One past it is one the run resumed before (restoring skipped it: incomplete or
        corrupt, left by a killed attempt): counted among the newest, it would take the
        place of good ones (with ``keep=1``, of the one just written) and be all a later
        resume finds; it goes instead."""
        steps = _listed_steps(self.store, self.run)
        newer = [s for s in steps if s > step]
        if newer:
            log.warning(
                "run %s: removing unusable checkpoint(s) at step(s) %s, past the step %d the "
                "run resumed before",
                self.run,
                ", ".join(map(str, newer)),
                step,
            )
        for old in newer + [s for s in steps if s <= step][self.keep :]:
            try:
                self.store.delete(_dir_key(self.run, old), recursive=True)
            except StoreNotFoundError:
                continue
            except StoreError as err:
                log.warning("run %s: cannot delete old checkpoint step %d: %s", self.run, old, err)

    def restore(self, *, rank: int, world: int) -> Restored | None:
        """This trainer's state from the newest complete, intact checkpoint (None: none).

        Falls back past broken checkpoints with a warning; raises :class:`CheckpointError`
        when checkpoints exist but none is usable, or the newest usable one was written by a
        different number of trainers.
        """
        found = _newest_good(self.store, self.run, load_rank=rank)
        if found is None:
            return None
        info, state, part = found
        if info.world != world:
            raise CheckpointError(
                f"run {self.run}: checkpoint {self.store.uri}{info.key} was written by "
                f"{info.world} trainer(s), this run has {world}; {resume_with(info.world)} "
                "to resume it, or give the run a new name (train.run)"
            )
        losses = [float(v) for v in np.asarray(state["losses"]).reshape(-1)]
        validation = [(int(k), dict(v)) for k, v in json.loads(state.get("validation") or "[]")]
        optimizer = state.get("optimizer")
        return Restored(
            info=info,
            model=dict(state["model"]),
            optimizer=dict(optimizer) if optimizer is not None else None,
            epoch=int(part["epoch"]),
            batch_index=int(part["batch_index"]),
            rng=dict(part["rng"]),
            losses=losses,
            validation=validation,
        )


def _listed_steps(store: Store, run: str) -> list[int]:
    """Steps of the ``step-*`` directories of ``run``, newest first."""
    try:
        entries = store.list(f"/{run}/checkpoints")
    except StoreNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if entry.is_dir and match:
            steps.append(int(match.group(1)))
    return sorted(steps, reverse=True)


def _load(store: Store, key: str, kind: str, run: str) -> tuple[Any, dict[str, Any]]:
    where = f"{store.uri}{key}"
    try:
        data = store.get(key)
    except StoreNotFoundError as err:
        raise _IncompleteError(
            f"checkpoint file {where} is missing (offset 0): the checkpoint is incomplete"
        ) from err
    except StoreError as err:
        raise CheckpointError(f"checkpoint file {where} cannot be read: {err}") from err
    try:
        tree, meta = decode_tree(data, source=where)
    except TensorFormatError as err:
        raise CheckpointError(
            f"checkpoint file {where} is corrupt at byte offset {err.offset}: {err}"
        ) from err
    if meta.get("format") != _FORMAT or meta.get("kind") != kind or meta.get("run") != run:
        raise CheckpointError(
            f"checkpoint file {where} (offset 0) is not a {kind} part of run {run} "
            f"({meta.get('format')} {meta.get('kind')} of run {meta.get('run')})"
        )
    if meta.get("version") != _VERSION:
        raise CheckpointError(
            f"checkpoint file {where} has checkpoint version {meta.get('version')}; this "
            f"adcloud reads version {_VERSION}: upgrade adcloud or start a new run"
        )
    return tree, meta


def _check(store: Store, run: str, step: int, load_rank: int | None) -> tuple[Any, Any, int]:
    base = _dir_key(run, step)
    state, _ = _load(store, f"{base}/state", "state", run)
    world = int(state["world"])
    if int(state["step"]) != step:
        raise CheckpointError(
            f"checkpoint file {store.uri}{base}/state holds step {state['step']}, not {step}"
        )
    mine = None
    # Every trainer checks every part, so they all reach the same verdict on this step.
    for r in range(world):
        part, _ = _load(store, f"{base}/rank-{r}", "rank", run)
        if int(part["step"]) != step or int(part["rank"]) != r:
            raise CheckpointError(
                f"checkpoint file {store.uri}{base}/rank-{r} holds rank {part['rank']} step "
                f"{part['step']}, not rank {r} step {step}"
            )
        if r == load_rank:
            mine = part
    if load_rank is not None and mine is None:
        # The world differs: the caller reports it; hand back rank 0's part for the message.
        mine = {"epoch": 0, "batch_index": 0, "rng": {}}
    return state, mine, world


def _candidates(store: Store, run: str) -> list[int]:
    steps = _listed_steps(store, run)
    try:
        pointer: Any = json.loads(store.get(_pointer_key(run)))
        hinted = int(pointer["step"])
    except (StoreError, ValueError, KeyError, TypeError):
        return steps
    return [hinted, *[s for s in steps if s != hinted]] if hinted in steps else steps


def _newest_good(
    store: Store, run: str, *, load_rank: int | None
) -> tuple[CheckpointInfo, Any, Any] | None:
    steps = _candidates(store, run)
    problems: list[str] = []
    incomplete: list[str] = []
    for step in steps:
        try:
            state, part, world = _check(store, run, step, load_rank)
        except _IncompleteError as err:
            # Not damage: a trainer died while saving.  Older checkpoints are still good.
            incomplete.append(str(err))
            log.warning("run %s: skipping incomplete checkpoint step %d: %s", run, step, err)
            continue
        except CheckpointError as err:
            problems.append(str(err))
            log.warning("run %s: skipping checkpoint step %d: %s", run, step, err)
            continue
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"step {step}: malformed state ({err})")
            log.warning("run %s: skipping checkpoint step %d: malformed state %s", run, step, err)
            continue
        if problems or incomplete:
            log.warning(
                "run %s: resuming from the older checkpoint at step %d (%d newer one(s) unusable)",
                run,
                step,
                len(problems) + len(incomplete),
            )
        settings = json.loads(state.get("settings") or "null")
        data = json.loads(state.get("data") or "null")
        info = CheckpointInfo(run, step, _dir_key(run, step), world, settings, data)
        return info, state, part
    if problems:
        raise CheckpointError(
            f"run {run}: none of its {len(steps)} checkpoint(s) in {store.uri} is usable: "
            + "; ".join(problems + incomplete)
            + f". Delete /{run}/checkpoints to start the run afresh, or name a new run"
        )
    return None


def latest_checkpoint(store: Store, run: str) -> CheckpointInfo | None:
    """The newest complete, intact checkpoint of ``run`` in ``store`` (None: there is none).

    Broken and incomplete newer checkpoints are skipped with a warning; raises
    :class:`CheckpointError` when a checkpoint is broken (corrupt, truncated) and none is
    usable.  Only incomplete ones (a trainer died while saving the first) mean "none".
    """
    found = _newest_good(store, run.strip("/"), load_rank=None)
    return None if found is None else found[0]
