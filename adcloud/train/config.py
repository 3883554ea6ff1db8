"""Settings of one training run (:class:`TrainConfig`, settings section ``train``).

Build it directly, or with :meth:`TrainConfig.load` (``adcloud.config.load_settings``) so that
a settings file's ``train:`` section and ``ADCLOUD_TRAIN_<FIELD>`` environment variables
override the defaults (``ADCLOUD_TRAIN_SYNC=ps``, ``ADCLOUD_TRAIN_BAGS=a.bag,b.bag``,
``ADCLOUD_TRAIN_TASK_OPTIONS='{"preset": "full"}'``).  :meth:`TrainConfig.validate` raises
:class:`~adcloud.train.errors.TrainError` naming every bad field.

Units: ``lr`` per optimizer step, ``sync_timeout_s`` in seconds.  ``batch_size`` is the
*global* batch: with ``workers`` trainers each takes ``batch_size // workers`` samples per
step from its own shard, and the averaged gradient is that of one batch of ``batch_size``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from adcloud.config import STORE_SCHEMES, load_settings, names, settings_dict
from adcloud.train.errors import TrainError

__all__ = ["DEVICES", "ETL_MODES", "OPTIMIZERS", "SCHEDULES", "SYNC_MODES", "TrainConfig"]

#: ``single``: one process; ``ps``: parameter server on the store; ``allreduce``:
#: torch.distributed all-reduce inside a Spark barrier stage (or under torchrun).
SYNC_MODES = ("single", "ps", "allreduce")
#: ``memory``: ETL output stays cached in executor memory; ``files``: ETL writes its samples
#: to ``etl_dir`` and training reads them back (the comparison baseline of the benchmark).
ETL_MODES = ("memory", "files")
OPTIMIZERS = ("adam", "adamw", "sgd")
#: Learning rate over the run (after ``warmup_steps`` of linear warm-up): ``constant`` keeps
#: ``lr``; ``cosine`` and ``linear`` decay it from ``lr`` to ``lr * final_lr_ratio`` at the
#: last step.
SCHEDULES = ("constant", "cosine", "linear")
DEVICES = ("auto", "cpu", "cuda")

# What a checkpoint records (TrainConfig.pinned_settings): a run resumed with another task or
# other task options is refused (they decide the samples, see adcloud.train.job), one resumed
# with other values of the rest is warned about.
_PINNED_BY_CHECKPOINT = (
    "task",
    "task_options",
    "bags",
    "sync",
    "workers",
    "batch_size",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "schedule",
    "warmup_steps",
    "final_lr_ratio",
    "seed",
)

# Fields that decide neither the trained parameters nor the data trained on: they are left
# out of the default run id, so that re-running the same training resumes it wherever its
# checkpoints and outputs go, on whatever device and however often it saves.  What stays in
# decides the parameters: the task and its options, the training bags (and how finely they are
# split: a camera image and its labels split over two partitions make no sample), the
# trainers, batch, optimizer, schedule, steps and seed.
_NOT_IN_RUN_ID = frozenset(
    {
        "run",
        "out",
        "heldout_bags",  # scored, never trained on
        "progress",
        "log_every",
        "eval_every",  # scoring restores the RNG states: training draws what it would have
        "sync_timeout_s",
        "checkpoint_every",  # a resumed run computes what the uninterrupted one does
        "keep_checkpoints",
        "store",  # where the run's checkpoints are kept; the name is within the store
        "store_options",
        "keep_versions",
        "device",  # the same run on another device (its floats may round differently)
        "threads",
        "etl",  # memory or files: the same samples in the same order
        "etl_dir",
        "keep_etl_files",
        "resume_changed_data",  # whether a resume may go on; not what it computes
    }
)

#: What a run name may hold: it names a directory in the store and ``{run}`` in ``out``.
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
#: Stores each Python process has for itself (fsspec's ``memory://``): trainers in other
#: processes (Spark executors, torchrun ranks) cannot see each other's files there.
_PROCESS_STORES = ("memory://",)


def fsspec_place_problem(name: str, value: str) -> str | None:
    """What is wrong with ``value`` as ``name``, a place written through fsspec (a path or
    a ``file://``, ``hdfs://``, ``s3://`` URL), when it is an adcloud store URI; else None."""
    if not value.strip().lower().startswith(STORE_SCHEMES):
        return None
    scheme = value.strip().split("://", 1)[0]
    reading = (
        f"reads {scheme}:// as a plain path from the file system root"
        if scheme.lower() == "local"
        else f"does not know {scheme}://"
    )
    return (
        f"{name} {value!r} is an adcloud store URI, but {name} is written as files through "
        f"fsspec, which {reading}: give a path or a file://, hdfs:// or s3:// URL "
        "(train.store is the setting that takes store URIs)"
    )


def _of_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type a :class:`TrainConfig` field declares (``hint``)."""
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_of_type(v, args[0]) for v in value)
    if type(None) in args:  # X | None
        return value is None or any(_of_type(value, a) for a in args if a is not type(None))
    return True  # task_options: a mapping, checked when the config is made


_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}


def _plain(value: Any) -> Any:
    """``value`` as Python's own number or bool where it is a NumPy scalar (a notebook's
    ``steps=np.int64(100)``, ``lr=np.float32(0.01)``), which a run's ``settings.json``
    could not hold; anything else as it is (:func:`_wrong_types` judges it).  NumPy is
    recognised by its module, not imported: this module is read for ``--help``."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


def _wrong_types(config: TrainConfig) -> list[str]:
    """One line per field of ``config`` whose value is not of the field's type: text is
    read into numbers and booleans by :meth:`TrainConfig.load`, not by the constructor."""
    hints = typing.get_type_hints(TrainConfig)
    out = []
    for item in dataclasses.fields(config):
        value, hint = getattr(config, item.name), hints[item.name]
        if not _of_type(value, hint):
            wanted = _TYPE_NAMES.get(hint) or (
                "a list of text" if typing.get_origin(hint) is tuple else str(hint)
            )
            out.append(f"{item.name} must be {wanted}, not {type(value).__name__} {value!r}")
    return out


def _sources(
    file: str | Path | None, environ: Mapping[str, str], overrides: Mapping[str, Any]
) -> dict[str, str]:
    """Setting name -> the file or ``ADCLOUD_TRAIN_*`` variable that gave its value (as
    :func:`~adcloud.config.load_settings` layers them; the caller's overrides name none)."""
    sources: dict[str, str] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            loaded = None  # load_settings has said what is wrong with it
        part = loaded.get("train") if isinstance(loaded, dict) else None
        if isinstance(part, dict):
            sources.update({key: str(file) for key in part if isinstance(key, str)})
    for item in dataclasses.fields(TrainConfig):
        variable = f"ADCLOUD_TRAIN_{item.name.upper()}"
        if variable in environ:
            sources[item.name] = variable
    for name, value in overrides.items():
        if value is not None:
            sources.pop(name, None)
    return sources


#: The setting a problem of :meth:`TrainConfig.validate` is about: its first word (``lr
#: must be ...``), or ``train.<name>:`` (the constructor's).
_PROBLEM_FIELD = re.compile(r"(?:train\.)?([a-z_]+)\b")


def _name_sources(err: TrainError, sources: Mapping[str, str]) -> None:
    """Make ``err`` (``invalid train settings: P; P...`` or one problem) say, after each
    problem, where the value of the setting it is about came from (the file or the
    variable): "lr must be > 0" alone leaves the user to find which of a settings file,
    the environment or a service's ``EnvironmentFile`` gave it."""
    text = str(err)
    head = "invalid train settings: "
    many = text.startswith(head)
    named = []
    for problem in text.removeprefix(head).split("; ") if many else [text]:
        match = _PROBLEM_FIELD.match(problem)
        source = sources.get(match.group(1)) if match else None
        named.append(f"{problem} (from {source})" if source and source not in problem else problem)
    result = (head if many else "") + "; ".join(named)
    if result != text:
        err.args = (result, *err.args[1:])


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides one training run (see the module docstring for the units).

    The same config and data give the same parameters: trainer ``r`` of ``workers`` draws its
    batches from a ``torch.Generator`` seeded by ``(seed, r, epoch)`` and the model is
    initialised from ``seed``.  ``run`` names the run's directory in ``store``
    (checkpoints, parameter versions); empty means :meth:`run_id`, a digest of the settings
    that decide the result and of the training bags' identity, so running the same config
    on the same bags again resumes it.
    """

    #: Task name for :func:`adcloud.train.task.get_task` (``lidar_seg``, ``camera_seg``, ...).
    task: str = "lidar_seg"
    #: Training bags and held-out bags (files, directories, globs or fsspec URLs).
    bags: tuple[str, ...] = ()
    heldout_bags: tuple[str, ...] = ()
    #: Task options passed to ``get_task`` (a mapping; from the environment, a JSON object).
    task_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``single`` | ``ps`` | ``allreduce`` (see :data:`SYNC_MODES`).
    sync: str = "single"
    #: Number of trainers (shards) for ``ps`` and ``allreduce``; ``single`` uses 1.
    workers: int = 2
    #: Optimizer steps; ``epochs > 0`` replaces it by ``epochs`` passes over the smallest shard.
    steps: int = 200
    epochs: int = 0
    #: Global batch size (samples per step over all trainers); a multiple of ``workers``.
    batch_size: int = 8
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.0
    #: Learning-rate schedule (see :data:`SCHEDULES`), a function of the step alone, so a
    #: resumed run continues it exactly.
    schedule: str = "constant"
    #: Steps of linear warm-up from ``lr / warmup_steps`` to ``lr`` (0: none).
    warmup_steps: int = 0
    #: ``cosine``/``linear``: the last step's learning rate as a fraction of ``lr``.
    final_lr_ratio: float = 0.0
    seed: int = 0
    #: Save a checkpoint every this many steps (0: never) and keep the last this many.
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    #: Store URI for checkpoints and parameter versions, with ``key=value`` store options
    #: (``root=/tmp/x`` for a private local store, ``token=...`` for alluxio://).
    store: str = "local:///adcloud-train"
    store_options: tuple[str, ...] = ()
    #: Run name in the store (empty: :meth:`run_id`): letters, digits, ``.``, ``_`` and
    #: ``-``, not starting with ``.``.
    run: str = ""
    #: Resume the run's checkpoint even when the data it was trained on changed since (a
    #: training bag regenerated, edited, added or removed; another task or other task
    #: options): the steps before it keep what they learnt from the old data.  Without it
    #: such a resume is refused, naming what changed.
    resume_changed_data: bool = False
    #: Where every finished run writes its deployable model (``model/``), final parameters,
    #: loss curve and effective settings: a directory or fsspec URL in which ``{run}`` stands
    #: for the run's name.  A relative path is below the driver's working directory; on a
    #: cluster in ``--deploy-mode cluster`` give a shared URL.
    out: str = "adcloud-runs/{run}"
    #: ``auto`` (CUDA when present), ``cpu`` or ``cuda``.
    device: str = "auto"
    #: Seconds a trainer waits for the others once they have all started: for a parameter
    #: version or the other trainers' updates (``ps``: then
    #: :class:`~adcloud.train.errors.StaleParametersError`), in a collective (``allreduce``:
    #: the process group's timeout) and for the held-out counts of ``eval_every``.  A trainer
    #: that hangs or dies fails the others' wait with an error naming its rank, host and the
    #: step it last reached, which fails the barrier stage (Spark then retries it from the
    #: last checkpoint), instead of leaving them waiting for ``spark.barrier.sync.timeout``
    #: (a year by default).  That Spark setting alone still bounds the start of the stage,
    #: where the trainers wait for each other to load their shards (a retried stage may
    #: rebuild a lost shard from the bags).
    sync_timeout_s: float = 120.0
    #: Parameter versions kept behind the newest (at least 2: one may still be being read).
    keep_versions: int = 2
    #: Torch intra-op threads per trainer (0: torch's default).
    threads: int = 0
    #: ETL: ``memory`` | ``files`` (see :data:`ETL_MODES`); ``etl_dir`` is the files mode's
    #: exchange directory (a ``file://`` URL or path; empty: a temporary directory on the
    #: driver, so on a multi-host cluster give a directory every host mounts).
    etl: str = "memory"
    etl_dir: str = ""
    #: Keep the run's sample files (``part-JOB-*.tensors``) in ``etl_dir`` after the run.
    #: By default they go when the run ends, finished or failed (no later run reads them:
    #: each run writes its own), with ``etl_dir`` itself if the run made it and it is left
    #: empty; whatever else is in ``etl_dir`` stays.  A driver killed outright leaves them.
    keep_etl_files: bool = False
    #: How finely Spark splits each bag (None: about 128 MiB per partition, at least one
    #: per core).
    partitions_per_bag: int | None = None
    #: Log every this many steps; show a progress bar in single-process interactive runs.
    log_every: int = 10
    #: Score the held-out bags every this many steps as well as after the last (0: only
    #: after the last): the validation curve beside the loss curve. The trainers score their
    #: shares of the held-out samples, held in executor memory beside the training shards.
    eval_every: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if (plain := _plain(value)) is not value:
                object.__setattr__(self, item.name, plain)
            elif item.type == "str" and isinstance(value, os.PathLike):
                # a notebook's out=run_dir / "seg", as bags=Path(...) is taken: a path is
                # its text (settings.json holds it, run ids digest it)
                object.__setattr__(self, item.name, os.fspath(value))
        # store_options="root=/tmp/x" is one option, as bags="drive.bag" is one bag
        object.__setattr__(self, "store_options", names(self.store_options))
        for name in ("bags", "heldout_bags"):  # bags="drive.bag" is one bag
            # a blank entry (bags= or heldout_bags= on the command line, "a.bag," in the
            # environment) names no bag: kept, it would stand for the working directory and
            # every bag in it would be read
            given = names(getattr(self, name))
            object.__setattr__(self, name, tuple(b for b in given if str(b).strip()))
        # From the environment or a flat file, task_options arrives as JSON text.
        options: Any = self.task_options
        if isinstance(options, str):
            try:
                options = json.loads(options) if options.strip() else {}
            except json.JSONDecodeError as err:
                msg = f"train.task_options: not a JSON object: {options!r} ({err})"
                raise TrainError(msg) from err
        if not isinstance(options, Mapping):
            msg = f"train.task_options must be a mapping, not {type(options).__name__}"
            raise TrainError(msg)
        object.__setattr__(self, "task_options", dict(options))

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> TrainConfig:
        """Defaults, then the ``train`` section of ``file``, ``ADCLOUD_TRAIN_*``, ``overrides``.

        A value that :meth:`validate` (or the constructor) refuses is named with where it
        came from: the file or the environment variable."""
        env = os.environ if environ is None else environ
        try:
            return load_settings(cls, "train", file=file, environ=env, **overrides).validate()
        except TrainError as err:
            _name_sources(err, _sources(file, env, overrides))
            raise

    def validate(self) -> TrainConfig:
        """Return ``self`` if every setting is usable, else raise :class:`TrainError`."""
        # values of another type (a notebook's steps="100" or resume_changed_data="false",
        # which is true) are named before the checks below compare them
        problems: list[str] = _wrong_types(self)
        if problems:
            raise TrainError("invalid train settings: " + "; ".join(problems))

        def need(ok: bool, text: str) -> None:
            if not ok:
                problems.append(text)

        need(bool(self.task), "task must name a task (e.g. lidar_seg)")
        need(self.sync in SYNC_MODES, f"sync must be one of {', '.join(SYNC_MODES)}")
        need(self.workers >= 1, f"workers must be >= 1, not {self.workers}")
        need(self.steps >= 1 or self.epochs >= 1, "steps or epochs must be >= 1")
        need(self.steps >= 0 and self.epochs >= 0, "steps and epochs must be >= 0")
        need(self.batch_size >= 1, f"batch_size must be >= 1, not {self.batch_size}")
        world = self.world
        need(
            world < 1 or self.batch_size % world == 0,  # workers < 1: said above
            f"batch_size {self.batch_size} must be a multiple of workers ({world}) so every "
            "trainer takes the same share of the global batch",
        )
        need(self.optimizer in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}")
        need(math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0 and finite, not {self.lr}")
        need(
            math.isfinite(self.momentum) and 0 <= self.momentum < 1,
            f"momentum must be in [0, 1), not {self.momentum}",
        )
        need(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be >= 0 and finite, not {self.weight_decay}",
        )
        need(self.schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, not {self.warmup_steps}")
        need(
            0 <= self.final_lr_ratio <= 1,
            f"final_lr_ratio must be in [0, 1], not {self.final_lr_ratio}",
        )
        need(
            -(2**63) <= self.seed < 2**64,  # what torch.manual_seed takes
            f"seed must be in [-2**63, 2**64), not {self.seed}",
        )
        need(self.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: no checkpoints)")
        need(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")
        need("://" in self.store, f"store must be a store URI (local://...), not {self.store!r}")
        need(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}")
        need(
            math.isfinite(self.sync_timeout_s) and self.sync_timeout_s > 0,
            f"sync_timeout_s must be > 0 and finite (seconds), not {self.sync_timeout_s}",
        )
        need(self.keep_versions >= 2, "keep_versions must be >= 2")
        need(self.threads >= 0, "threads must be >= 0")
        need(self.etl in ETL_MODES, f"etl must be one of {', '.join(ETL_MODES)}")
        need(
            self.partitions_per_bag is None or self.partitions_per_bag >= 1,
            "partitions_per_bag must be >= 1 or empty",
        )
        need(self.log_every >= 1, "log_every must be >= 1")
        need(self.eval_every >= 0, f"eval_every must be >= 0, not {self.eval_every}")
        need(
            bool(self.out.strip()),
            "out must name where the run's model goes (a directory or URL; {run} is the "
            "run's name)",
        )
        need(
            not self.run or bool(_RUN_NAME.fullmatch(self.run)),
            f"run must be a plain name (letters, digits, '.', '_', '-'; not starting with "
            f"'.'), not {self.run!r}: it names the run's directory in the store",
        )
        for name in ("out", "etl_dir"):
            if (problem := fsspec_place_problem(name, getattr(self, name))) is not None:
                problems.append(problem)
        need(
            not self.etl_dir.strip().startswith(_PROCESS_STORES),
            f"etl_dir {self.etl_dir} is private to each Python process, but the ETL's Spark "
            "tasks write the samples there and other tasks read them back: give a path or a "
            "file://, hdfs:// or s3:// URL every executor reaches",
        )
        for entry in self.store_options:
            need("=" in entry, f"store_options entry {entry!r} is not key=value")
        # every float setting, the ones without a range of their own too: inf passes "> 0"
        # and then breaks what writes the settings as JSON once the training is done
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            said = any(p.startswith(f"{item.name} ") for p in problems)
            if isinstance(value, float) and not math.isfinite(value) and not said:
                problems.append(f"{item.name} must be a finite number, not {value}")
        private = self.store.startswith(_PROCESS_STORES)
        need(
            not (private and self.sync == "ps"),
            f"store {self.store} is private to each Python process, but sync=ps trainers run "
            "in Spark executors and exchange parameters through the store: give train.store "
            "a store they share (local:///NAME on one machine, file:///DIR on a shared "
            "mount, alluxio://HOST:39999/...)",
        )
        need(
            not (private and self.sync == "allreduce" and self.checkpoint_every > 0),
            f"store {self.store} is private to each Python process, but sync=allreduce "
            "trainers run in separate processes (Spark executors, torchrun ranks) and write "
            "their parts of every checkpoint there: give train.store a store they share "
            "(local:///NAME on one machine, file:///DIR on a shared mount, "
            "alluxio://HOST:39999/...), or set checkpoint_every=0",
        )
        if problems:
            raise TrainError("invalid train settings: " + "; ".join(problems))
        return self

    @property
    def world(self) -> int:
        """The number of trainers: ``workers``, or 1 for ``single``."""
        return 1 if self.sync == "single" else self.workers

    def store_kwargs(self) -> dict[str, str]:
        """``store_options`` as keyword arguments for :func:`adcloud.store.open_store`."""
        out: dict[str, str] = {}
        for entry in self.store_options:
            key, sep, value = entry.partition("=")
            if not sep or not key.strip():
                raise TrainError(f"train.store_options: entry {entry!r} is not key=value")
            out[key.strip()] = value.strip()
        return out

    def run_id(self, data: str = "") -> str:
        """The run's name: ``run``, or ``<task>-<digest of the settings that decide it>``.

        ``data``, the identity of the training bags (:func:`adcloud.train.job.data_identity`),
        joins the digest: bags regenerated or replaced at the same paths start a new run
        instead of resuming checkpoints trained on the old ones.
        """
        if self.run:
            return self.run
        decisive = {k: v for k, v in self.to_dict().items() if k not in _NOT_IN_RUN_ID}
        if data:
            decisive["data"] = data
        text = json.dumps(decisive, sort_keys=True, default=str)
        return f"{self.task}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    def pinned_settings(self) -> dict[str, Any]:
        """The settings a checkpoint records: what decides the parameters trained so far
        (data, model, optimizer, seed), so that a run resumed with other values is told
        (``steps`` and ``epochs`` may grow; the rest does not change the math)."""
        data = self.to_dict()
        return {name: data[name] for name in _PINNED_BY_CHECKPOINT}

    def output_dir(self, run: str) -> str:
        """:attr:`out` for the run named ``run`` (``{run}`` replaced)."""
        return self.out.replace("{run}", run)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what is written next to every output)."""
        return settings_dict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes).validate()
