"""Scoring models on drives with Spark: the samples stay on the executors, only counts travel.

:func:`evaluate_model` scores an exported model (a run's ``model/`` directory, see
:mod:`adcloud.train.export`) on any bags; ``adcloud train eval`` runs it from the command
line. :func:`score_parameters` scores a run's final parameters the same way; the training
job uses it for its held-out bags.

How: the bags are split into partitions as for training (:class:`~adcloud.binpipe.BinPipeRDD`);
each Spark task decodes its partition, makes the task's samples, runs the model on them a few
at a time and returns the task's summable statistics (:class:`~adcloud.train.task.CountingTask`:
for segmentation, a confusion matrix) keyed by bag; the driver adds them up and turns the sums
into scores, per bag and over all bags. The model reaches each executor as one broadcast and
is loaded once per Python worker. Held-out drives are as large as training drives: gathered
on the driver, their samples would fill its memory and run the model on one core.

An :class:`Evaluation` writes ``eval.json`` and, for segmentation tasks, ``confusion.png``
(the confusion matrix normalised per true class).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import operator
import os
import posixpath
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
import torch
from numpy.typing import NDArray
from rich.table import Table

from adcloud._scratch import scratch_dir
from adcloud.config import names
from adcloud.train.config import fsspec_place_problem
from adcloud.train.errors import ExportError, TrainError
from adcloud.train.task import CountingTask, Task, get_task

if TYPE_CHECKING:
    from pyspark import RDD, Broadcast
    from pyspark.sql import SparkSession

__all__ = [
    "EVAL_FILE",
    "PLOT_FILE",
    "Evaluation",
    "check_eval_target",
    "evaluate_model",
    "input_mismatch",
    "input_shapes",
    "model_inputs",
    "model_task",
    "score_bag_samples",
    "score_parameters",
    "score_samples",
]

log = logging.getLogger(__name__)

#: What :meth:`Evaluation.write` names its files.
EVAL_FILE = "eval.json"
PLOT_FILE = "confusion.png"

#: Samples run through the model at a time on an executor (bounds a task's memory: a
#: partition's samples are never all held at once).
_CHUNK = 32


#: One input of an exported program as its metadata records it: its name and its size per
#: sample (the dimensions after the first, which counts samples), ``None`` where dynamic.
_InputShape = tuple[str, tuple[int | None, ...]]


@dataclass(frozen=True)
class _Weights:
    """What executors build the model from: ``exported`` (``model.pt2`` bytes) or ``state``
    (a :mod:`adcloud.train.tensors` state dict for ``task.build_model()``), broadcast once.

    ``inputs``: the input sizes an exported program was traced for (its program refuses any
    other with a guard failure deep in torch), checked on every sample before it is scored;
    ``name`` is where the model lives, for messages."""

    kind: str
    digest: str
    payload: Broadcast[bytes]
    inputs: tuple[_InputShape, ...] = ()
    name: str = ""


def _input_shapes(meta: Mapping[str, Any], where: str = "the model") -> tuple[_InputShape, ...]:
    """The per-sample input sizes an export's ``metadata.json`` records (``model.inputs``
    less the dimensions ``model.dynamic`` declares); empty when it records none.  Raises
    :class:`ExportError` naming the file of the model at ``where`` when they are not what
    an export writes (a size or a dimension that is no whole number): read as they are,
    they would fail the scoring with a bare ValueError."""
    model = meta.get("model")
    inputs = model.get("inputs") if isinstance(model, Mapping) else None
    if not isinstance(inputs, list):
        return ()
    dynamic = model.get("dynamic") if isinstance(model, Mapping) else None
    if isinstance(dynamic, Mapping) and len(dynamic) == len(inputs):
        names, specs = [str(k) for k in dynamic], list(dynamic.values())
    elif isinstance(dynamic, list) and len(dynamic) == len(inputs):
        names, specs = [f"input {i}" for i in range(len(inputs))], dynamic
    else:
        names, specs = [f"input {i}" for i in range(len(inputs))], [None] * len(inputs)
    out = []
    for index, (name, entry, spec) in enumerate(zip(names, inputs, specs, strict=True)):
        shape = entry.get("shape") if isinstance(entry, Mapping) else None
        if not isinstance(shape, list) or not shape:
            return ()  # not a tensor input: nothing this can check
        try:
            if isinstance(spec, Mapping):
                free = {_whole(k) for k in spec}
            elif isinstance(spec, list):
                free = {i for i, d in enumerate(spec) if d is not None}
            else:
                free = set()
            sizes = tuple(None if i in free else _whole(d) for i, d in enumerate(shape))
        except (TypeError, ValueError) as err:
            raise ExportError(
                f"{where}/metadata.json: model.inputs[{index}] ({name}) is damaged: shape "
                f"{shape!r}, dynamic dimensions {spec!r} ({err}); the scoring checks every "
                "sample against the sizes recorded there: export the model again"
            ) from err
        out.append((name, sizes[1:]))
    return tuple(out)


def _whole(value: Any) -> int:
    """``value`` (a size or a dimension index as ``metadata.json`` holds it: a number, a
    dict key) as an int; ValueError or TypeError where it is no whole number."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{value!r} is not a whole number")
    number = int(value)
    if number < 0:
        raise ValueError(f"{value!r} is negative")
    return number


def model_inputs(meta: Mapping[str, Any], where: str) -> tuple[_InputShape, ...]:
    """The per-sample input sizes that an export's ``metadata.json`` (``meta``, of the model
    at ``where``) records: what every sample is checked against before it is scored.
    Raises :class:`ExportError` naming the file and the input when they are damaged."""
    return _input_shapes(meta, where)


def _size(sizes: Sequence[int | None]) -> str:
    return "x".join("*" if d is None else str(d) for d in sizes) or "a scalar"


def input_shapes(task: Task, sample: Any) -> tuple[_InputShape, ...]:
    """The per-sample sizes of the model inputs ``task`` makes of ``sample``
    (:meth:`Task.example_inputs`), ``None`` where :meth:`Task.dynamic_shapes` lets a
    dimension vary: what an export of a model trained on such samples records
    (:func:`_input_shapes`).  Empty when an input is no tensor."""
    found = task.example_inputs([sample])
    spec = task.dynamic_shapes()
    if isinstance(spec, Mapping) and len(spec) == len(found):
        names, specs = [str(k) for k in spec], list(spec.values())
    elif isinstance(spec, (list, tuple)) and len(spec) == len(found):
        names, specs = [f"input {i}" for i in range(len(found))], list(spec)
    else:
        names, specs = [f"input {i}" for i in range(len(found))], [None] * len(found)
    out = []
    for name, value, dims in zip(names, found, specs, strict=True):
        shape = tuple(int(d) for d in getattr(value, "shape", ()))
        if not shape:
            return ()
        if isinstance(dims, Mapping):
            free = {int(k) for k in dims}
        elif isinstance(dims, (list, tuple)):
            free = {i for i, d in enumerate(dims) if d is not None}
        else:
            free = set()
        out.append((name, tuple(None if i in free else d for i, d in enumerate(shape))[1:]))
    return tuple(out)


def input_mismatch(
    task: Task, inputs: Sequence[_InputShape], sample: Any
) -> tuple[str, str, str] | None:
    """``(input name, its size, the expected size)`` where ``sample``'s model inputs
    (:func:`input_shapes`) differ from ``inputs``; None where they agree."""
    for (name, expected), (_, found) in zip(inputs, input_shapes(task, sample), strict=False):
        if len(found) == len(expected) and all(
            e is None or f is None or e == f for e, f in zip(expected, found, strict=True)
        ):
            continue
        return name, _size(found), _size(expected)
    return None


def _input_mismatch(task: Task, weights: _Weights, sample: Any, bag: str) -> str:
    """What is wrong with ``sample`` as an input of the model (``""``: nothing): its inputs
    as the task makes them against the sizes the exported program was exported for, or
    (parameters) the model was trained on."""
    found = input_mismatch(task, weights.inputs, sample)
    if found is None:
        return ""
    name, size, expected = found
    given = (
        f"{bag}: topic {task.topics[0]} gives the model's input {name} of size {size} per "
        "sample, but"
    )
    if weights.kind == "exported":
        return (
            f"{given} {weights.name} was exported for {expected} (model.inputs in its "
            "metadata.json): score it on bags recorded like the ones it was trained on, or "
            "train and export a model on these"
        )
    return (
        f"{given} {weights.name} is trained on {expected}, and its export takes that size "
        "only (adcloud train eval refuses such a bag): score it on bags recorded like its "
        "training bags"
    )


#: The model of the last :class:`_Weights` this Python worker loaded (Spark reuses workers
#: across tasks, so a model is loaded once per worker, not once per partition).
_LOADED: dict[str, torch.nn.Module] = {}


def _model(task: Task, weights: _Weights) -> torch.nn.Module:
    model = _LOADED.get(weights.digest)
    if model is None:
        data = weights.payload.value
        if weights.kind == "exported":
            model = torch.export.load(io.BytesIO(data)).module()
        else:
            from adcloud.train.tensors import decode_tensors  # noqa: PLC0415

            model = task.build_model()
            model.load_state_dict(decode_tensors(data, source="broadcast parameters").tensors)
        _LOADED.clear()
        _LOADED[weights.digest] = model
    return model


def _counts_of(
    task: CountingTask, weights: _Weights, samples: Iterable[Any]
) -> tuple[NDArray[Any], int]:
    """The summed counts of ``samples`` and their number, the model (loaded once per
    worker) run ``_CHUNK`` samples at a time on the task's share of the cores."""
    from pyspark import TaskContext  # noqa: PLC0415

    context = TaskContext.get()
    torch.set_num_threads(max(1, context.cpus() if context is not None else 1))
    model = _model(task, weights)
    counts = task.eval_counts(model, [])
    n = 0
    chunk: list[Any] = []
    for sample in samples:
        chunk.append(sample)
        if len(chunk) == _CHUNK:
            counts = counts + task.eval_counts(model, chunk)
            n += len(chunk)
            chunk = []
    if chunk:
        counts = counts + task.eval_counts(model, chunk)
        n += len(chunk)
    return counts, n


def _count_samples(
    samples: Iterable[Any], *, task: CountingTask, weights: _Weights
) -> Iterator[tuple[NDArray[Any], int, tuple[str, ...]]]:
    """``(counts, samples, problems)`` of one partition of ready samples (a sample the
    model cannot take ends it, as in :func:`_count_bag_samples`)."""
    if weights.inputs:
        samples = _checked(task, weights, samples, "a held-out bag")
    try:
        counts, n = _counts_of(task, weights, samples)
    except _UnscorableError as err:
        yield task.eval_counts(_model(task, weights), []), 0, (str(err),)
        return
    yield counts, n, ()


def score_samples(
    spark: SparkSession,
    task: Task,
    parameters: bytes,
    samples: RDD[Any],
    *,
    inputs: Sequence[_InputShape] = (),
    name: str = "the model",
) -> dict[str, float]:
    """Scores of ``task.build_model()`` with ``parameters`` on an RDD of ready samples (the
    held-out samples a run keeps cached to score every ``eval_every`` steps).  With
    ``inputs`` (:func:`input_shapes` of a training sample), a sample of other sizes is
    refused with a :class:`TrainError` rather than scored; ``name`` names the model."""
    counting = _counting(task)
    weights = _broadcast(spark, "state", parameters, inputs=inputs, name=name)
    try:
        counts, n, problems = samples.mapPartitions(
            functools.partial(_count_samples, task=counting, weights=weights)
        ).reduce(_add_bag)
    finally:
        weights.payload.unpersist()
    if problems:
        raise TrainError(problems[0])
    if n == 0:
        raise TrainError(f"no held-out samples to score task {task.name} on")
    return counting.scores(counts)


#: Per bag: the summed counts, the number of samples and what made samples unscorable.
_BagCounts = tuple[NDArray[Any], int, tuple[str, ...]]


class _UnscorableError(Exception):
    """A sample the exported program cannot take (raised and caught on the executor)."""


def _checked(task: Task, weights: _Weights, samples: Iterable[Any], bag: str) -> Iterator[Any]:
    for sample in samples:
        problem = _input_mismatch(task, weights, sample, bag)
        if problem:
            raise _UnscorableError(problem)
        yield sample


def _count_bag_samples(
    pairs: Iterable[tuple[str, Any]], *, task: CountingTask, weights: _Weights
) -> Iterator[tuple[str, _BagCounts]]:
    """``(bag, (counts, samples, problems))`` of each run of one bag's samples in a
    partition of ``(bag, sample)`` pairs, streamed (a bag's partition is one run; the caller
    sums runs).  A sample the exported program cannot take ends the partition with the
    problem, returned rather than raised: Spark would retry the task, then bury the message
    in a traceback."""
    for bag, run in itertools.groupby(pairs, key=operator.itemgetter(0)):
        samples: Iterable[Any] = (sample for _, sample in run)
        if weights.inputs:
            samples = _checked(task, weights, samples, bag)
        try:
            counts, n = _counts_of(task, weights, samples)
        except _UnscorableError as err:
            yield bag, (task.eval_counts(_model(task, weights), []), 0, (str(err),))
            return
        yield bag, (counts, n, ())


def score_bag_samples(
    spark: SparkSession,
    task: Task,
    parameters: bytes,
    samples: RDD[tuple[str, Any]],
    bags: Sequence[str],
    *,
    name: str = "parameters",
    inputs: Sequence[_InputShape] = (),
) -> Evaluation:
    """What :func:`score_parameters` gives for ``bags``, from ready ``(bag URI, sample)``
    pairs instead of the bags: the held-out samples a run already keeps on its executors
    (``train.eval_every``), scored there without decoding the bags again."""
    started = time.perf_counter()
    counting = _counting(task)
    weights = _broadcast(spark, "state", parameters, inputs=inputs, name=name)
    try:
        counts, numbers = _score_pairs(counting, weights, samples, bags)
    finally:
        weights.payload.unpersist()
    return _evaluation(counting, name, counts, numbers, started)


def _per_bag(
    summed: Mapping[str, tuple[NDArray[Any], int]], uris: Sequence[str]
) -> tuple[dict[str, NDArray[Any]], dict[str, int]]:
    """Per bag URI: the summed counts and the number of samples (0 for a bag that gave none)."""
    if not summed:
        return {}, dict.fromkeys(uris, 0)
    empty = np.zeros_like(next(iter(summed.values()))[0])
    counts = {uri: summed[uri][0] if uri in summed else empty for uri in uris}
    samples = {uri: summed[uri][1] if uri in summed else 0 for uri in uris}
    return counts, samples


def _add(a: tuple[NDArray[Any], int], b: tuple[NDArray[Any], int]) -> tuple[NDArray[Any], int]:
    return a[0] + b[0], a[1] + b[1]


def _counting(task: Task) -> CountingTask:
    if not isinstance(task, CountingTask):
        raise TrainError(
            f"task {task.name} cannot be scored on executors: it has no eval_counts/scores "
            "(see adcloud.train.task.CountingTask)"
        )
    return task


def _score(
    spark: SparkSession,
    task: CountingTask,
    weights: _Weights,
    bags: Sequence[str],
    partitions_per_bag: int | None,
) -> tuple[dict[str, NDArray[Any]], dict[str, int]]:
    """Per bag URI: the summed counts and the number of samples (0 for a bag that gave none)."""
    from adcloud.train.job import bag_samples, bag_uris  # noqa: PLC0415

    pairs = bag_samples(spark, task, bags, partitions_per_bag)
    return _score_pairs(task, weights, pairs, bag_uris(bags))


def _score_pairs(
    task: CountingTask, weights: _Weights, pairs: RDD[tuple[str, Any]], uris: Sequence[str]
) -> tuple[dict[str, NDArray[Any]], dict[str, int]]:
    """:func:`_score` of ready ``(bag, sample)`` pairs; raises :class:`TrainError` naming the
    bag, the topic and the sizes when the exported program cannot take a bag's samples."""
    fn = functools.partial(_count_bag_samples, task=task, weights=weights)
    summed = dict(pairs.mapPartitions(fn).reduceByKey(_add_bag).collect())
    problems = [p for _, (_, _, found) in sorted(summed.items()) for p in found]
    if problems:
        raise TrainError(problems[0])
    return _per_bag({bag: (c, n) for bag, (c, n, _) in summed.items()}, uris)


def _add_bag(a: _BagCounts, b: _BagCounts) -> _BagCounts:
    return a[0] + b[0], a[1] + b[1], (a[2] + b[2])[:1]


def _broadcast(
    spark: SparkSession,
    kind: str,
    data: bytes,
    *,
    inputs: Sequence[_InputShape] = (),
    name: str = "",
) -> _Weights:
    digest = hashlib.sha256(data).hexdigest()
    payload = spark.sparkContext.broadcast(data)
    return _Weights(kind, f"{kind}:{digest}", payload, tuple(inputs), name)


def _class_names(task: Task, size: int) -> list[str]:
    names = getattr(task, "class_names", None)
    if isinstance(names, Sequence) and len(names) == size:
        return [str(n) for n in names]
    return [str(i) for i in range(size)]


@dataclass(frozen=True)
class Evaluation:
    """Scores of one model on some bags: over all of them (``scores``) and per bag
    (``per_bag``, ``samples``), with the summed counts (``counts``: for segmentation, the
    confusion matrix, truth x prediction) and the class names that index them."""

    task: str
    model: str
    scores: dict[str, float]
    per_bag: dict[str, dict[str, float]]
    samples: dict[str, int]
    counts: NDArray[Any]
    class_names: tuple[str, ...]
    seconds: float

    @property
    def total_samples(self) -> int:
        """Samples scored over all bags."""
        return sum(self.samples.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: everything, the counts as nested lists."""

        def clean(values: Mapping[str, float]) -> dict[str, float | None]:
            return {k: (v if math.isfinite(v) else None) for k, v in values.items()}

        return {
            "task": self.task,
            "model": self.model,
            "scores": clean(self.scores),
            "bags": [
                {"uri": uri, "samples": self.samples[uri], "scores": clean(self.per_bag[uri])}
                for uri in self.samples
            ],
            "class_names": list(self.class_names),
            "counts": self.counts.tolist(),
            "seconds": self.seconds,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def table(self) -> Table:
        """The scores as a table: one row per score, one column per bag and one for all."""
        many = len(self.samples) > 1
        table = Table(
            title=f"{self.task}: {self.model}", title_justify="left", caption_justify="left"
        )
        table.add_column("score")
        if many:
            for i in range(len(self.samples)):
                table.add_column(f"bag {i + 1}", justify="right")
        table.add_column("all bags", justify="right")
        names = list(self.scores)
        for uri in self.samples:
            names += [k for k in self.per_bag[uri] if k not in names]

        def cell(values: Mapping[str, float], key: str) -> str:
            value = values.get(key)
            return "" if value is None or not math.isfinite(value) else f"{value:.3f}"

        table.add_row(
            "samples",
            *([str(n) for n in self.samples.values()] if many else []),
            str(self.total_samples),
        )
        for key in names:
            per = [cell(self.per_bag[uri], key) for uri in self.samples] if many else []
            table.add_row(key, *per, cell(self.scores, key))
        if many:
            table.caption = "\n".join(f"bag {i + 1}: {uri}" for i, uri in enumerate(self.samples))
        return table

    @property
    def plottable(self) -> bool:
        """Whether the counts are a confusion matrix (square) that :meth:`plot` draws."""
        counts = np.asarray(self.counts)
        return counts.ndim == 2 and counts.shape[0] == counts.shape[1]

    def plot(self, path: str | os.PathLike[str]) -> bool:
        """Draw the confusion matrix normalised per true class to ``path`` (PNG); False, and
        nothing drawn, when the counts are not a square matrix."""
        if not self.plottable:
            return False
        counts = np.asarray(self.counts, dtype=np.float64)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415

        present = counts.sum(axis=1) > 0
        rows = np.divide(
            counts,
            counts.sum(axis=1, keepdims=True),
            out=np.full_like(counts, np.nan),
            where=present[:, None],
        )
        size = len(self.class_names)
        fig = Figure(figsize=(1.2 + 0.55 * size, 1.0 + 0.5 * size), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        image = ax.imshow(rows, cmap="Blues", vmin=0.0, vmax=1.0)
        for i in range(size):
            for j in range(size):
                if present[i] and rows[i, j] >= 0.005:
                    shade = "white" if rows[i, j] > 0.6 else "black"
                    ax.text(
                        j, i, f"{rows[i, j]:.2f}", ha="center", va="center", fontsize=6, color=shade
                    )
        ax.set_xticks(range(size), self.class_names, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(size), self.class_names, fontsize=7)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true (rows sum to 1)")
        miou = self.scores.get("miou", float("nan"))
        ax.set_title(f"{self.task}: mIoU {miou:.3f}, {self.total_samples} samples", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
        fig.tight_layout()
        fig.savefig(os.fspath(path))
        return True

    def write(self, out: str) -> list[str]:
        """Write ``eval.json`` (and ``confusion.png``) under directory or fsspec URL ``out``;
        the paths written."""
        fs, root = fsspec.core.url_to_fs(out)
        fs.makedirs(root, exist_ok=True)
        written = []
        with scratch_dir("adcloud-eval-") as local:
            (local / EVAL_FILE).write_text(self.to_json())
            names = [EVAL_FILE]
            if self.plot(local / PLOT_FILE):
                names.append(PLOT_FILE)
            for name in names:
                # beside, then renamed: a reader never sees half a file
                target = posixpath.join(root, name)
                try:
                    fs.put_file(str(local / name), target + ".partial")
                    fs.mv(target + ".partial", target)
                except Exception as err:  # the backend's own: OSError, botocore's, aiohttp's
                    with contextlib.suppress(Exception):  # no half file left behind
                        if fs.exists(target + ".partial"):
                            fs.rm_file(target + ".partial")
                    raise TrainError(
                        f"{out}: cannot write {name} ({type(err).__name__}: {err}); check "
                        "that the place is writable and has room, or give --out (out=) "
                        "another directory"
                    ) from err
                written.append(target)
        return written


def _evaluation(
    task: CountingTask,
    model: str,
    counts: Mapping[str, NDArray[Any]],
    samples: Mapping[str, int],
    started: float,
) -> Evaluation:
    total = sum(samples.values())
    if total == 0:
        raise TrainError(
            f"the bags {', '.join(samples)} gave no samples for task {task.name} (topics "
            f"{', '.join(task.topics)}): check the task's topic names against the bags "
            "(adcloud bag info BAG)"
        )
    for uri, n in samples.items():
        if n == 0:  # its topic absent, or no message in it
            log.warning("%s gave no samples for task %s: it is left out", uri, task.name)
    summed = sum(counts.values(), start=np.zeros_like(next(iter(counts.values()))))
    size = summed.shape[0] if summed.ndim else 0
    return Evaluation(
        task=task.name,
        model=model,
        scores=task.scores(summed),
        per_bag={uri: task.scores(c) if samples[uri] else {} for uri, c in counts.items()},
        samples=dict(samples),
        counts=summed,
        class_names=tuple(_class_names(task, size)),
        seconds=time.perf_counter() - started,
    )


def check_eval_target(out: str | os.PathLike[str]) -> None:
    """Raise :class:`TrainError` when ``out`` (where :meth:`Evaluation.write` would write) is
    a file: before any scoring, not once it is done."""
    text = os.fspath(out)
    if (problem := fsspec_place_problem("--out (out=)", text)) is not None:
        raise TrainError(problem)
    try:
        fs, root = fsspec.core.url_to_fs(text)
    except (ImportError, ValueError) as err:  # an unknown protocol, a missing fsspec backend
        raise TrainError(f"--out (out=) {text}: cannot open it through fsspec: {err}") from err
    if fs.isfile(root):
        raise TrainError(
            f"{text} is a file, not a directory for {EVAL_FILE} and {PLOT_FILE}: remove it "
            "or give --out (out=) another directory"
        )


def model_task(meta: Mapping[str, Any], where: str) -> Task:
    """The task, with its options, that an export's ``metadata.json`` (``meta``, of the model
    at ``where``) was trained for: its ``task`` and ``config.task_options``.  Raises
    :class:`ExportError` naming the file when they are missing or not what a run writes."""
    name = meta.get("task")
    if not isinstance(name, str):
        raise ExportError(
            f"{where}/metadata.json: no 'task' to evaluate with (models written by "
            "adcloud train run name theirs)"
        )
    config = meta.get("config")
    options = config.get("task_options", {}) if isinstance(config, Mapping) else {}
    if not isinstance(options, Mapping):
        raise ExportError(
            f"{where}/metadata.json: config.task_options is {type(options).__name__} "
            f"{options!r}, not an object of the task's options"
        )
    try:
        return get_task(name, options)
    except TrainError as err:  # a task or option this adcloud does not know: say whose
        raise ExportError(f"{where}/metadata.json: {err}") from err


def evaluate_model(
    spark: SparkSession,
    model: str | os.PathLike[str],
    bags: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    partitions_per_bag: int | None = None,
    out: str | None = None,
) -> Evaluation:
    """Score the exported model in directory ``model`` (local or an fsspec URL) on ``bags``
    (files, directories, globs or fsspec URLs) in one Spark job; with ``out``, write
    ``eval.json`` and ``confusion.png`` there.

    The task and its options come from the model's ``metadata.json``; the program is checked
    against its SHA-256 and loaded on the driver first, so a missing or corrupt model fails
    here, naming the file, before any executor starts; so is an ``out`` that is a file.
    Raises :class:`TrainError` when the bags give no samples (naming the topics the task
    reads), or give samples of another size than the model was exported for (naming the
    bag, the topic and both sizes).
    """
    from adcloud.train.export import (  # noqa: PLC0415
        PROGRAM_FILE,
        load_exported,
        local_model,
        model_location,
    )

    started = time.perf_counter()
    # one bag given as a string or path is one bag; a blank one is none (not the working
    # directory, which would score every bag in it)
    bags = tuple(b for b in names(bags) if str(b).strip())
    if not bags:
        raise TrainError("no bags to evaluate on: give at least one bag, directory or glob")
    if out is not None:
        check_eval_target(out)
    with local_model(model) as directory:
        _, meta = load_exported(directory)
        program = (directory / PROGRAM_FILE).read_bytes()
    shown = model_location(model)
    task = _counting(model_task(meta, shown))
    inputs = _input_shapes(meta, shown)  # before the broadcast: a damaged file leaves none
    weights = dataclasses.replace(_broadcast(spark, "exported", program), inputs=inputs, name=shown)
    try:
        counts, samples = _score(spark, task, weights, bags, partitions_per_bag)
    finally:
        weights.payload.unpersist()
    evaluation = _evaluation(task, shown, counts, samples, started)
    log.info(
        "%s on %d bag(s): %d samples in %.1f s",
        evaluation.model,
        len(samples),
        evaluation.total_samples,
        evaluation.seconds,
    )
    if out is not None:
        evaluation.write(out)
    return evaluation


def score_parameters(
    spark: SparkSession,
    task: Task,
    parameters: bytes,
    bags: Sequence[str],
    *,
    partitions_per_bag: int | None = None,
    name: str = "parameters",
    inputs: Sequence[_InputShape] = (),
) -> Evaluation:
    """Score ``task.build_model()`` with ``parameters`` (a :mod:`adcloud.train.tensors`
    state dict, as :class:`~adcloud.train.loop.TrainResult` carries) on ``bags``, on the
    executors; ``name`` labels the model in the result.  With ``inputs`` (the
    :func:`input_shapes` of a training sample), a bag whose samples are of other sizes is
    refused with a :class:`TrainError` naming it and both sizes, rather than scored."""
    started = time.perf_counter()
    counting = _counting(task)
    weights = _broadcast(spark, "state", parameters, inputs=inputs, name=name)
    try:
        counts, samples = _score(spark, counting, weights, bags, partitions_per_bag)
    finally:
        weights.payload.unpersist()
    return _evaluation(counting, name, counts, samples, started)
