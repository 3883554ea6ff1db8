"""The learning problems the training service runs: the :class:`Task` protocol and its registry.

A task is one learning problem with its data pipeline. The Spark job calls
:meth:`Task.samples` on every decoded bag message of :attr:`Task.topics` (ETL on the executors),
caches the samples in executor memory, and trains with :meth:`Task.batches` and
:meth:`Task.loss`; :meth:`Task.evaluate` scores held-out samples and
:meth:`Task.example_inputs` / :meth:`Task.dynamic_shapes` feed :func:`torch.export.export`.

Samples are small frozen records of NumPy arrays (they pickle cheaply and cache in Spark);
a :data:`Batch` is a dict of tensors, so moving it to a device is
``{k: v.to(device) for k, v in batch.items()}``.

Tasks (``get_task(name, options)``):

- ``lidar_seg`` -- per-point semantic segmentation of ``/lidar/points``
  (:class:`adcloud.train.lidar.LidarSegTask`);
- ``camera_seg`` -- per-pixel semantic segmentation of ``/camera/image_raw`` against
  ``/camera/labels`` (:class:`adcloud.train.camera.CameraSegTask`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch
from numpy.typing import NDArray

from adcloud.train.errors import DataError, TrainError

__all__ = [
    "TASKS",
    "Batch",
    "CountingTask",
    "ImageSample",
    "PointCloudSample",
    "Sample",
    "Task",
    "evaluating",
    "expect_msgtype",
    "get_task",
]


@dataclass(frozen=True)
class PointCloudSample:
    """One labelled LiDAR sweep.

    ``points`` is ``float32 (N, 4)``: ``x, y, z`` in metres in the sensor frame of the message
    (``lidar`` for the synthetic drives) and ``intensity`` (0--255); ``labels`` is
    ``uint8 (N,)`` of label ids (``docs/synth-truth-format.md`` section 6; 0 = unlabelled,
    ignored by the loss). ``stamp_ns`` is the header stamp, ns since the Unix epoch.
    """

    stamp_ns: int
    points: NDArray[np.float32]
    labels: NDArray[np.uint8]


@dataclass(frozen=True)
class ImageSample:
    """One camera image with its per-pixel labels.

    ``image`` is ``uint8 (H, W, 3)`` RGB, rows top to bottom; ``labels`` is ``uint8 (H, W)``
    of label ids (0 = sky). ``stamp_ns`` is the common header stamp of both images.
    """

    stamp_ns: int
    image: NDArray[np.uint8]
    labels: NDArray[np.uint8]


#: What :meth:`Task.samples` makes.
Sample: TypeAlias = PointCloudSample | ImageSample
#: What :meth:`Task.loss` takes: named tensors (all on one device).
Batch: TypeAlias = dict[str, torch.Tensor]


@runtime_checkable
class Task(Protocol):
    """One learning problem with its data pipeline (ETL, batching, model, loss, evaluation).

    A task object is cheap to pickle (its options and at most one buffered message), so it
    crosses Spark closures; each executor gets its own copy.
    """

    @property
    def name(self) -> str:
        """Registry name (``lidar_seg``, ``camera_seg``)."""
        ...

    @property
    def topics(self) -> tuple[str, ...]:
        """Bag topics whose decoded messages :meth:`samples` needs; the first is the one the
        model's inputs come from (messages name it)."""
        ...

    def samples(self, topic: str, timestamp: int, decoded: Any) -> Iterable[Sample]:
        """Samples made from one decoded rosbags message of ``topic`` (record time ns).

        May be empty (another topic, or a message buffered until its partner arrives); raises
        :class:`~adcloud.train.errors.DataError` naming the topic and field on bad input.
        """
        ...

    def build_model(self) -> torch.nn.Module:
        """A fresh model; its initialisation is seeded by the caller (``torch.manual_seed``)."""
        ...

    def batches(
        self, samples: Sequence[Sample], batch_size: int, generator: torch.Generator
    ) -> Iterator[Batch]:
        """One epoch of batches over ``samples``, shuffled (and augmented) by ``generator``.

        The same samples and generator state give the same batches. The last batch may be
        smaller than ``batch_size``.
        """
        ...

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar training loss: the mean over the batch's samples of a per-sample loss, so
        equal-size shards average to the loss (and gradient) of the whole batch."""
        ...

    def evaluate(self, model: torch.nn.Module, samples: Sequence[Sample]) -> dict[str, float]:
        """Scores of ``model`` on ``samples`` (``miou``, ``accuracy``, ``iou_<class>``...)."""
        ...

    def example_inputs(self, samples: Sequence[Sample]) -> tuple[Any, ...]:
        """Model inputs made from ``samples`` (at least one), for :func:`torch.export.export`."""
        ...

    def dynamic_shapes(self) -> Any:
        """The ``dynamic_shapes`` argument of :func:`torch.export.export` for
        :meth:`example_inputs` (which input dimensions vary at inference)."""
        ...


@runtime_checkable
class CountingTask(Task, Protocol):
    """A task whose scores are a function of counts summed over samples (a confusion matrix,
    a sum of squared errors and a count), so samples can be scored where they are -- on
    Spark's executors, a partition at a time -- and only the counts travel
    (:mod:`adcloud.train.evaluate`). ``scores(eval_counts(model, a) + eval_counts(model, b))``
    equals ``evaluate(model, a + b)``.
    """

    def eval_counts(self, model: torch.nn.Module, samples: Sequence[Sample]) -> NDArray[Any]:
        """The summable statistics of ``model`` on ``samples`` (always the same shape, zeros
        for no samples)."""
        ...

    def scores(self, counts: NDArray[Any]) -> dict[str, float]:
        """The scores (as :meth:`Task.evaluate` returns them) that ``counts`` give."""
        ...


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` in evaluation mode without gradients, then restore its mode.

    A program loaded with :func:`torch.export.load` keeps the mode it was exported in (its
    ``eval()`` raises ``NotImplementedError``); adcloud exports models in evaluation mode,
    so such a module is run as it is.
    """
    was_training = model.training
    try:
        model.eval()
        switched = True
    except NotImplementedError:
        switched = False
    try:
        with torch.no_grad():
            yield
    finally:
        if switched:
            model.train(was_training)


def expect_msgtype(decoded: Any, topic: str, expected: str) -> None:
    """Raise :class:`DataError` unless ``decoded`` is a rosbags message of type ``expected``.

    ``expected`` is spelled ``pkg/msg/Name``; ROS 1 spellings (``pkg/Name``) of the decoded
    type are accepted too.
    """
    got = getattr(decoded, "__msgtype__", None)
    if not isinstance(got, str):
        raise DataError(
            f"{topic}: expected a decoded {expected} message, got a {type(decoded).__name__} "
            "(pass the message decoded by rosbags / adcloud.binpipe.MessageDecoder)"
        )
    pkg, _, name = expected.partition("/msg/")
    if got not in (expected, f"{pkg}/{name}"):
        raise DataError(
            f"{topic}: expected {expected} messages on this topic, got {got} "
            "(check the topic names of the task against the bag)"
        )


def _lidar(options: Mapping[str, Any]) -> Task:
    from adcloud.train.lidar import LidarSegTask  # noqa: PLC0415 - import the chosen task only

    return LidarSegTask.from_options(options)


def _camera(options: Mapping[str, Any]) -> Task:
    from adcloud.train.camera import CameraSegTask  # noqa: PLC0415 - import the chosen task only

    return CameraSegTask.from_options(options)


#: Task names and their factories (options mapping -> task).
TASKS: Mapping[str, Callable[[Mapping[str, Any]], Task]] = {
    "lidar_seg": _lidar,
    "camera_seg": _camera,
}


def get_task(name: str, config: Mapping[str, Any] | None = None) -> Task:
    """The task registered as ``name``, configured by the task options ``config``.

    ``config`` keys are the fields of the task's settings (:class:`~adcloud.train.lidar.LidarConfig`
    or :class:`~adcloud.train.camera.CameraConfig`), plus ``preset`` (``small`` or ``full``).
    Raises :class:`TrainError` for an unknown name or option.
    """
    factory = TASKS.get(name)
    if factory is None:
        raise TrainError(
            f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))} "
            "(the `task` setting of the training config)"
        )
    return factory(dict(config or {}))


def _option_value(task: str, key: str, value: Any, default: Any, kind: type | None) -> Any:
    """``value`` of option ``key`` as the type of its ``default`` (``kind`` the element type of
    a tuple option); raises :class:`TrainError` naming the option when it is not one (from a
    settings file, ``topic: 5`` or ``bev_channels: 16`` would fail deep in the job)."""
    try:
        if kind is not None:
            if isinstance(value, str | bytes) or not isinstance(value, Iterable):
                raise TypeError("not a list")
            items = list(value)
            if any(isinstance(c, bool) or not isinstance(c, int | float | str) for c in items):
                raise TypeError("not numbers")
            return tuple(kind(c) for c in items)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError("not true or false")
            return value
        if isinstance(default, int | float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError("not a number")
            if isinstance(default, int) and value != int(value):
                raise TypeError("not a whole number")
            return type(default)(value)
        if isinstance(default, str) and not isinstance(value, str):
            raise TypeError("not text")
    except (TypeError, ValueError, OverflowError) as err:
        what = (
            f"a list of {kind.__name__} values"
            if kind is not None
            else type(default).__name__.replace("str", "text")
        )
        raise TrainError(f"{task} option {key} must be {what}, not {value!r} ({err})") from err
    return value


def config_from_options(
    task: str,
    options: Mapping[str, Any],
    small: Any,
    full: Any,
    tuple_fields: Mapping[str, type],
) -> Any:
    """A task's config from its options: ``preset`` (``small``/``full``) picks the base config
    (a frozen dataclass with ``validate()``), the other options replace its fields
    (``tuple_fields`` are converted element-wise); an unknown option or preset raises
    :class:`TrainError` naming it."""
    opts = dict(options)
    preset = opts.pop("preset", "small")
    if preset not in ("small", "full"):
        raise TrainError(f"{task} option preset must be 'small' or 'full', not {preset!r}")
    base = full if preset == "full" else small
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise TrainError(
            f"unknown {task} option {unknown[0]!r}: choose from preset, " + ", ".join(sorted(known))
        )
    for key, value in opts.items():
        opts[key] = _option_value(task, key, value, getattr(base, key), tuple_fields.get(key))
    config = dataclasses.replace(base, **opts)
    for item in dataclasses.fields(config):  # inf and nan pass range checks such as "< max"
        value = getattr(config, item.name)
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise TrainError(f"{task} option {item.name} must be finite, not {value}")
    return config.validate()
