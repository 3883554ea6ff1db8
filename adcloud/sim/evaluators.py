"""Evaluators: what makes a scenario pass, computed from its inputs, outputs and truth.

An evaluator is built on the executor from an :class:`EvaluatorSpec` (a name and
parameters, cheap to pickle) through the registry :data:`EVALUATORS`.  Add your own with
:func:`register_evaluator` (:func:`~adcloud.sim.replay.run_replay` carries the driver's
registrations into its Spark tasks, so the factory must pickle: a class or a module-level
function), or name it by import path, ``package.module:attr``, which is imported where the
evaluator is built (the module must be installed on the executors).  Each returns an
:class:`Evaluation`: pass/fail, metrics (floats, named ``<evaluator>.<metric>``) and a
reason when it fails.  Only outputs and truth inside the scenario's evaluated range
``[start, end)`` count (not the warm-up).  An evaluator that cannot judge a scenario (a
message of another type than it reads, one that does not decode) raises
:class:`SimError`, naming the topic and the types; :func:`~adcloud.sim.replay.run_scenario`
fails that evaluation with the reason (and with the exception's text for anything else an
evaluator raises), never the job.

Built-in evaluators:

- ``rate`` (``topic``, ``min_hz``): the output topic is published at ``>= min_hz``,
  counting its outputs in the range per second of input fed in it: from the first input
  in the range to one period (that topic's median interval) after the last, as ``N``
  inputs at 10 Hz are 10 Hz (``rostopic hz``), not ``N`` over the ``N - 1`` periods
  between the first and last -- a whole bag's range ends at its last message (a range
  without inputs counts over its own length; one shorter than one period at ``min_hz``
  tells no rate and fails);
- ``latency`` (``max_ms``, ``stat`` = ``max``/``p95``/``p50``, ``topic`` optional): no
  output later than ``max_ms`` after its input;
- ``detections`` (``topic``, ``cloud_topic``, ``match_m``, ``min_precision``,
  ``min_recall``, ``classes`` as ``7+8+10``, ...): obstacle detections
  (``geometry_msgs/PoseArray``, cloud frame) against the obstacles in the labelled cloud
  (:mod:`adcloud.sim.obstacles`), matched
  frame by frame within ``match_m``; a scenario without a cloud has no truth and fails;
- ``pose_error`` (``topic``, ``truth_topic``, ``max_m``): positions of output poses
  (``nav_msgs/Odometry``, ``geometry_msgs/PoseStamped`` or ``PoseWithCovarianceStamped``)
  against the truth odometry recorded in the bag, interpolated to each output's time
  (outputs outside the truth's span are left out, counted as ``outside_truth``);
- ``frames`` (``inputs``, ``output``, ``max_loss``, ``min_fps``): perception replay --
  frame-loss rate, throughput and latency of a detector fed camera streams.
"""

from __future__ import annotations

import bisect
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from adcloud.binpipe.codec import Message
from adcloud.binpipe.decode import MessageDecoder
from adcloud.binpipe.errors import BinpipeError
from adcloud.sim._plugins import IMPORT_PATH, import_object
from adcloud.sim.errors import SimError
from adcloud.sim.obstacles import DEFAULT_CLASSES, cloud_points, cluster_obstacles
from adcloud.sim.scenario import Scenario

__all__ = [
    "EVALUATORS",
    "Evaluation",
    "Evaluator",
    "EvaluatorSpec",
    "ScenarioData",
    "build_evaluator",
    "parse_evaluator",
    "register_evaluator",
]


@dataclass(frozen=True)
class EvaluatorSpec:
    """An evaluator by registry name (or ``package.module:attr``) with its parameters
    (strings, numbers)."""

    name: str
    params: tuple[tuple[str, str | float | int], ...] = ()

    @classmethod
    def of(cls, name: str, **params: str | float | int) -> EvaluatorSpec:
        """``EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8)``."""
        return cls(name, tuple(sorted(params.items())))


@dataclass(frozen=True)
class Evaluation:
    """One evaluator's verdict on one scenario."""

    name: str
    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""


@dataclass
class ScenarioData:
    """Everything evaluators see of one scenario run.

    ``messages`` are the bag's messages in ``[feed_start, end)`` on the input and truth
    topics; ``outputs`` what the node wrote (owned bytes), with ``latencies_ms`` beside
    them (NaN where no input preceded the output, and for the first output, whose
    latency includes the node's start-up).  ``decoder`` knows the input and output
    message definitions.
    """

    scenario: Scenario
    messages: list[Message]
    outputs: list[Message]
    latencies_ms: list[float]
    decoder: MessageDecoder
    #: Seconds from the first input written to the last output read (NaN: no output).
    replay_wall_s: float = math.nan
    #: The topics of ``messages`` fed to the node (the others are truth); empty: all.
    input_topics: tuple[str, ...] = ()

    def in_range(self, msgs: Sequence[Message], topic: str | None = None) -> list[Message]:
        """The messages (optionally of one topic) stamped inside ``[start, end)``."""
        s = self.scenario
        return [
            m
            for m in msgs
            if s.start <= m.timestamp < s.end and (topic is None or m.topic == topic)
        ]

    def input_seconds(self) -> float:
        """Seconds of input the node was fed in ``[start, end)``: from the first input
        there to one period after the last (per input topic, its median interval over
        everything fed), the latest of the topics; the range's own length when no input
        lies in it or no input topic has a period.

        ``N`` inputs at 10 Hz span ``N - 1`` periods: over that span alone a node that
        answered each measures ``10 N / (N - 1)`` Hz, and one that dropped a frame of a
        short bag (a whole bag's range ends at its last message) still measures 10 Hz.
        """
        s = self.scenario
        fed: dict[str, list[int]] = {}
        for m in self.messages:
            if not self.input_topics or m.topic in self.input_topics:
                fed.setdefault(m.topic, []).append(m.timestamp)
        first = last = None
        for stamps in fed.values():
            inside = [t for t in stamps if s.start <= t < s.end]
            if not inside:
                continue
            distinct = sorted(set(stamps))
            period = float(np.median(np.diff(distinct))) if len(distinct) > 1 else 0.0
            lo, hi = min(inside), max(inside) + period
            first = lo if first is None else min(first, lo)
            last = hi if last is None else max(last, hi)
        if first is None or last is None or last <= first:
            return s.seconds
        return (last - first) / 1e9

    def decode(self, msg: Message) -> Any:
        """The rosbags message object of ``msg``; raises :class:`SimError` if undecodable."""
        try:
            return self.decoder.decode(msg)
        except BinpipeError as err:
            raise SimError(str(err)) from err


class Evaluator(Protocol):
    """Judges one scenario; ``truth_topics`` are the bag topics it needs beyond the inputs."""

    name: str
    truth_topics: tuple[str, ...]

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """The verdict on ``data``."""
        ...


_DEFAULT_CLASSES_TEXT = "+".join(str(c) for c in DEFAULT_CLASSES)


def _percentile(values: Sequence[float], q: float) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.percentile(finite, q)) if finite else math.nan


def _classes(text: object) -> tuple[int, ...]:
    """The label classes of ``detections``' ``classes`` (``7+8+10``); none at all would
    leave no obstacle to find in any cloud (every scenario's truth empty)."""
    parts = [c.strip() for c in re.split(r"[,+ ]", str(text)) if c.strip()]
    try:
        classes = tuple(int(c) for c in parts)
    except ValueError:
        classes = ()
    if not classes or any(c < 0 for c in classes):
        raise SimError(
            f"evaluator detections: classes must be label numbers joined by '+' (e.g. "
            f"{_DEFAULT_CLASSES_TEXT}), not {text!r}"
        )
    return classes


def _limit(
    evaluator: str,
    name: str,
    value: object,
    *,
    above: float | None = None,
    least: float | None = None,
    most: float | None = None,
) -> float:
    """``value`` as a finite float within the bounds (``above``: exclusive lower bound;
    ``least``/``most``: inclusive), else :class:`SimError` naming evaluator and parameter.

    A NaN limit would pass (``loss > nan`` is never true) or fail everything, silently.
    """
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    wants = [
        f"> {above:g}" if above is not None else "",
        f">= {least:g}" if least is not None else "",
        f"<= {most:g}" if most is not None else "",
    ]
    ok = (
        math.isfinite(number)
        and (above is None or number > above)
        and (least is None or number >= least)
        and (most is None or number <= most)
    )
    if not ok:
        bounds = " and ".join(w for w in wants if w)
        raise SimError(
            f"evaluator {evaluator}: {name} must be a finite number {bounds}, not {value!r}"
        )
    return number


class RateEvaluator:
    """``rate``: an output topic is published at ``>= min_hz`` over the evaluated range:
    its outputs there per second of input fed there (:meth:`ScenarioData.input_seconds`)."""

    def __init__(self, topic: str, min_hz: float) -> None:
        self.name = "rate"
        self.topic = topic
        self.min_hz = _limit("rate", "min_hz", min_hz, least=0)
        self.truth_topics: tuple[str, ...] = ()

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """Pass when the output rate reaches ``min_hz``."""
        seconds = data.input_seconds()
        if self.min_hz > 0 and seconds * self.min_hz < 1:
            # one output over a range of one message (a bag of one cloud: 1 ns) would be
            # a rate of 1e9 Hz: shorter than one period, a range tells no rate
            return Evaluation(
                self.name,
                False,
                {},
                f"the evaluated range ({seconds:.3g} s) is shorter than one period at "
                f"{self.min_hz:g} Hz: too short to measure a rate on {self.topic}",
            )
        count = len(data.in_range(data.outputs, self.topic))
        hz = count / seconds
        ok = hz >= self.min_hz
        reason = "" if ok else f"{self.topic} at {hz:.2f} Hz < {self.min_hz:g} Hz"
        return Evaluation(self.name, ok, {f"rate_hz[{self.topic}]": hz}, reason)


class LatencyEvaluator:
    """``latency``: output latency (``stat``: max, p95 or p50) is at most ``max_ms``."""

    def __init__(self, max_ms: float, stat: str = "max", topic: str = "") -> None:
        if stat not in ("max", "p95", "p50"):
            raise SimError(f"latency stat must be max, p95 or p50, not {stat!r}")
        self.name = "latency"
        self.max_ms = _limit("latency", "max_ms", max_ms, above=0)
        self.stat = stat
        self.topic = topic
        self.truth_topics: tuple[str, ...] = ()

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """Pass when the chosen latency statistic is within ``max_ms``."""
        s = data.scenario
        lat = [
            v
            for m, v in zip(data.outputs, data.latencies_ms, strict=True)
            if s.start <= m.timestamp < s.end and (not self.topic or m.topic == self.topic)
        ]
        q = {"max": 100.0, "p95": 95.0, "p50": 50.0}[self.stat]
        value = _percentile(lat, q)
        if math.isnan(value) and lat:
            # one frame: its only output is the first, whose latency is the start-up
            return Evaluation(
                self.name,
                False,
                {},
                f"no latency to measure on the {len(lat)} output(s): the first output's "
                "latency is the node's start-up (startup_ms), and one that came before any "
                "input has none",
            )
        if math.isnan(value):
            return Evaluation(self.name, False, {}, "no output to measure latency on")
        ok = value <= self.max_ms
        reason = "" if ok else f"{self.stat} latency {value:.1f} ms > {self.max_ms:g} ms"
        return Evaluation(self.name, ok, {f"latency_{self.stat}_ms": value}, reason)


#: Message types the pose-reading evaluators decode (ROS 2 names; ROS 1 ones match too).
_POSE_ARRAY = ("geometry_msgs/msg/PoseArray",)
_POSES = (
    "nav_msgs/msg/Odometry",
    "geometry_msgs/msg/PoseStamped",
    "geometry_msgs/msg/PoseWithCovarianceStamped",
)
_CLOUD = ("sensor_msgs/msg/PointCloud2",)


def _require_type(msgs: Sequence[Message], accepted: Sequence[str]) -> None:
    """Raise :class:`SimError` naming the topic and the types when a message of ``msgs`` is
    not of an ``accepted`` type (before decoding it: a field another type lacks would
    raise ``AttributeError`` deep in the evaluator)."""
    for msg in msgs:
        pkg, _, name = msg.msgtype.rpartition("/")
        if f"{pkg.removesuffix('/msg')}/msg/{name}" not in accepted:
            raise SimError(f"{msg.topic} carries {msg.msgtype}, not {' or '.join(accepted)}")


def _pose_positions(msg: Any) -> list[tuple[float, float, float]]:
    poses = getattr(msg, "poses", None)
    if poses is not None:
        return [(p.position.x, p.position.y, p.position.z) for p in poses]
    pose = msg.pose
    pose = getattr(pose, "pose", pose)
    return [(pose.position.x, pose.position.y, pose.position.z)]


class DetectionEvaluator:
    """``detections``: precision and recall of obstacle detections against cloud labels."""

    def __init__(
        self,
        topic: str = "/obstacles",
        cloud_topic: str = "/lidar/points",
        match_m: float = 1.0,
        min_precision: float = 0.8,
        min_recall: float = 0.8,
        classes: str = _DEFAULT_CLASSES_TEXT,
        cell_m: float = 1.0,
        min_points: int = 5,
        max_range_m: float = 40.0,
    ) -> None:
        self.name = "detections"
        self.topic = topic
        self.cloud_topic = cloud_topic
        self.match_m = _limit("detections", "match_m", match_m, above=0)
        self.min_precision = _limit("detections", "min_precision", min_precision, least=0, most=1)
        self.min_recall = _limit("detections", "min_recall", min_recall, least=0, most=1)
        self.classes = _classes(classes)
        self.cell_m = _limit("detections", "cell_m", cell_m, above=0)
        points = _limit("detections", "min_points", min_points, least=1)
        if not points.is_integer():  # 2.5 points was taken as 2, silently
            raise SimError(
                f"evaluator detections: min_points must be a whole number, not {min_points!r}"
            )
        self.min_points = int(points)
        self.max_range_m = _limit("detections", "max_range_m", max_range_m, above=0)
        self.truth_topics: tuple[str, ...] = (cloud_topic,)

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """Match detections to truth per cloud timestamp, greedily by distance."""
        outputs = data.in_range(data.outputs, self.topic)
        clouds = data.in_range(data.messages, self.cloud_topic)
        _require_type(outputs, _POSE_ARRAY)
        _require_type(clouds, _CLOUD)
        detections: dict[int, list[tuple[float, float, float]]] = {}
        for out in outputs:
            detections.setdefault(out.timestamp, []).extend(_pose_positions(data.decode(out)))
        tp = n_truth = n_det = 0
        for cloud_msg in clouds:
            xyz, labels = cloud_points(data.decode(cloud_msg))
            truth = cluster_obstacles(
                xyz,
                labels,
                classes=self.classes,
                cell_m=self.cell_m,
                min_points=self.min_points,
                max_range_m=self.max_range_m,
            )
            found = np.array(detections.pop(cloud_msg.timestamp, []), dtype=np.float64)
            n_truth += len(truth)
            n_det += len(found)
            if len(truth) and len(found):
                dist = np.linalg.norm(truth[:, None, :2] - found[None, :, :2], axis=2)
                # a NaN detection matches nothing (and must not hide the others from min)
                dist[~np.isfinite(dist)] = np.inf
                while dist.size and dist.min() <= self.match_m:
                    i, j = np.unravel_index(int(dist.argmin()), dist.shape)
                    tp += 1
                    dist[i, :] = np.inf
                    dist[:, j] = np.inf
        n_det += sum(len(v) for v in detections.values())  # stamped like no cloud
        if not clouds:
            # without truth every frame is "nothing to find": a node that found nothing
            # would pass (a misspelt cloud_topic, a bag without the labelled cloud)
            return Evaluation(
                self.name,
                False,
                {"truth_objects": 0.0, "detected_objects": float(n_det)},
                f"no clouds on {self.cloud_topic} in the scenario: no truth to judge the "
                f"detections on {self.topic} against (`adcloud bag info` lists the topics)",
            )
        precision = tp / n_det if n_det else (1.0 if not n_truth else 0.0)
        recall = tp / n_truth if n_truth else 1.0
        metrics = {
            "precision": precision,
            "recall": recall,
            "truth_objects": float(n_truth),
            "detected_objects": float(n_det),
        }
        problems = []
        if precision < self.min_precision:
            problems.append(f"precision {precision:.3f} < {self.min_precision:g}")
        if recall < self.min_recall:
            problems.append(f"recall {recall:.3f} < {self.min_recall:g}")
        return Evaluation(self.name, not problems, metrics, "; ".join(problems))


class PoseErrorEvaluator:
    """``pose_error``: output positions against the recorded truth odometry (metres)."""

    def __init__(
        self, topic: str, truth_topic: str = "/ground_truth/odom", max_m: float = 1.0
    ) -> None:
        self.name = "pose_error"
        self.topic = topic
        self.truth_topic = truth_topic
        self.max_m = _limit("pose_error", "max_m", max_m, above=0)
        self.truth_topics: tuple[str, ...] = (truth_topic,)

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """Pass when the largest position error is within ``max_m``."""
        truth = [m for m in data.messages if m.topic == self.truth_topic]
        if len(truth) < 2:
            return Evaluation(
                self.name, False, {}, f"fewer than 2 truth poses on {self.truth_topic}"
            )
        outputs = data.in_range(data.outputs, self.topic)
        _require_type(outputs, _POSES)
        _require_type(truth, _POSES)
        times = [m.timestamp for m in truth]
        pos = np.array([_pose_positions(data.decode(m))[0] for m in truth])
        errors = []
        # an output outside the truth's span has no truth to compare with: the nearest
        # pose (the first or last) would stand for it, off by however far it has moved
        outside = [m for m in outputs if not times[0] <= m.timestamp <= times[-1]]
        for out in outputs:
            t = out.timestamp
            if not times[0] <= t <= times[-1]:
                continue
            k = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            t0, t1 = times[k - 1], times[k]
            w = min(max((t - t0) / (t1 - t0), 0.0), 1.0) if t1 > t0 else 0.0
            ref = pos[k - 1] * (1 - w) + pos[k] * w
            est = np.array(_pose_positions(data.decode(out))[0])
            errors.append(float(np.linalg.norm(est - ref)))
        if not errors:
            reason = (
                f"none of the {len(outside)} poses on {self.topic} lies within the truth's "
                f"span on {self.truth_topic}: nothing to compare them with"
                if outside
                else f"no pose on {self.topic}"
            )
            return Evaluation(self.name, False, {}, reason)
        # a NaN error (a diverged estimate) is the worst of all, wherever it falls: max()
        # keeps whichever of a NaN and a number comes first
        worst = float(np.max(errors))
        metrics = {"mean_m": float(np.mean(errors)), "max_m": worst}
        if outside:
            metrics["outside_truth"] = float(len(outside))
        ok = worst <= self.max_m
        if ok:
            return Evaluation(self.name, ok, metrics)
        bad = sum(not math.isfinite(e) for e in errors)
        reason = (
            f"{bad} of {len(errors)} poses on {self.topic} have no finite error "
            "(a NaN or infinite position)"
            if bad
            else f"max error {worst:.3f} m > {self.max_m:g} m"
        )
        return Evaluation(self.name, ok, metrics, reason)


class FrameEvaluator:
    """``frames``: perception replay -- frame loss, throughput and latency of a detector.

    A frame (a message on one of ``inputs``, topics joined by ``+``) counts as answered
    when an output on ``output`` carries its timestamp.  Metrics: ``frames``,
    ``answered``, ``loss_rate`` (unanswered / frames), ``throughput_fps`` (answered frames
    per second of replay wall time) and ``latency_p50_ms``/``latency_p95_ms``.  An input
    topic without a frame in the scenario (not in the bag) fails it: that camera was not
    replayed.
    """

    def __init__(
        self,
        inputs: str,
        output: str = "/detections",
        max_loss: float = 0.05,
        min_fps: float = 0.0,
    ) -> None:
        self.name = "frames"
        self.inputs = tuple(t for t in re.split(r"[+ ]", str(inputs)) if t)
        self.output = output
        self.max_loss = _limit("frames", "max_loss", max_loss, least=0, most=1)
        self.min_fps = _limit("frames", "min_fps", min_fps, least=0)
        self.truth_topics: tuple[str, ...] = ()

    def evaluate(self, data: ScenarioData) -> Evaluation:
        """Pass when the loss rate is at most ``max_loss`` and throughput reaches ``min_fps``."""
        frames: dict[int, int] = {}
        streams: set[str] = set()
        for m in data.in_range(data.messages):
            if m.topic in self.inputs:
                frames[m.timestamp] = frames.get(m.timestamp, 0) + 1
                streams.add(m.topic)
        answers: dict[int, int] = {}
        latencies = []
        for m, lat in zip(data.outputs, data.latencies_ms, strict=True):
            if m.topic == self.output and m.timestamp in frames:
                answers[m.timestamp] = answers.get(m.timestamp, 0) + 1
                latencies.append(lat)
        total = sum(frames.values())
        answered = sum(min(n, answers.get(ts, 0)) for ts, n in frames.items())
        if not total:
            return Evaluation(self.name, False, {}, f"no frames on {'+'.join(self.inputs)}")
        loss = 1.0 - answered / total
        wall = data.replay_wall_s
        fps = answered / wall if wall and math.isfinite(wall) and wall > 0 else 0.0
        metrics = {
            "frames": float(total),
            "answered": float(answered),
            "loss_rate": loss,
            "throughput_fps": fps,
            "latency_p50_ms": _percentile(latencies, 50),
            "latency_p95_ms": _percentile(latencies, 95),
        }
        problems = []
        # a camera without frames (a misspelt topic) was never replayed: the detector did
        # not sustain the load it is credited with
        missing = [t for t in self.inputs if t not in streams]
        if missing:
            problems.append(f"no frames on {', '.join(missing)}")
        if loss > self.max_loss:
            problems.append(f"frame loss {loss:.1%} > {self.max_loss:.1%}")
        if fps < self.min_fps:
            problems.append(f"throughput {fps:.1f} fps < {self.min_fps:g} fps")
        return Evaluation(self.name, not problems, metrics, "; ".join(problems))


#: Evaluator registry: name -> factory taking the spec's parameters as keywords.
EVALUATORS: dict[str, Callable[..., Evaluator]] = {
    "rate": RateEvaluator,
    "latency": LatencyEvaluator,
    "detections": DetectionEvaluator,
    "pose_error": PoseErrorEvaluator,
    "frames": FrameEvaluator,
}


def register_evaluator(name: str, factory: Callable[..., Evaluator]) -> None:
    """Make ``factory(**params)`` the evaluator called ``name`` in this process.

    :func:`~adcloud.sim.replay.run_replay` sends the factories its job uses to the
    executors with cloudpickle: register a class or a module-level function.
    """
    EVALUATORS[name] = factory


def _factory(name: str) -> Callable[..., Evaluator]:
    """The factory registered as ``name``, or imported from ``package.module:attr``."""
    factory = EVALUATORS.get(name)
    if factory is not None:
        return factory
    if ":" in name:
        found: Callable[..., Evaluator] = import_object(name, "evaluator")
        return found
    raise SimError(
        f"unknown evaluator {name!r}; known: {', '.join(sorted(EVALUATORS))}, "
        "or your own as package.module:attr"
    )


def build_evaluator(spec: EvaluatorSpec) -> Evaluator:
    """The evaluator ``spec`` names; raises :class:`SimError` on unknown names or bad params."""
    factory = _factory(spec.name)
    params: Mapping[str, inspect.Parameter] | None
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature: the call decides
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in dict(spec.params) if k not in params]
        if unknown:
            raise SimError(
                f"evaluator {spec.name!r}: unknown parameter(s) {', '.join(unknown)}; it takes "
                f"{', '.join(params)}"
            )
    try:
        evaluator = factory(**dict(spec.params))
    except (TypeError, ValueError) as err:
        raise SimError(
            f"evaluator {spec.name!r}: bad parameters {dict(spec.params)}: {err}"
        ) from err
    _check_evaluator(spec.name, evaluator)
    return evaluator


def _check_evaluator(name: str, evaluator: object) -> None:
    """Raise :class:`SimError` unless ``evaluator`` has what :class:`Evaluator` promises: a
    user's factory may return anything, and a missing ``truth_topics`` found only on the
    executors would fail every task (and so the job) rather than the job's validation."""
    truth = getattr(evaluator, "truth_topics", None)
    problems = []
    if not isinstance(getattr(evaluator, "name", None), str):
        problems.append("no name (a str)")
    if not isinstance(truth, tuple | list) or not all(isinstance(t, str) for t in truth):
        problems.append(f"truth_topics {truth!r} is no tuple of topic names")
    if not callable(getattr(evaluator, "evaluate", None)):
        problems.append("no evaluate(data) method")
    if problems:
        raise SimError(
            f"evaluator {name!r} made a {type(evaluator).__name__} with {'; '.join(problems)}: "
            "an evaluator has name, truth_topics and evaluate(data) (see Evaluator)"
        )


def _value(text: str) -> str | float | int:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def parse_evaluator(text: str) -> EvaluatorSpec:
    """Parse ``name:key=value,key=value`` (values become int, float or str).

    ``name`` may be an import path, ``package.module:attr`` or ``module:attr`` (a module
    on the ``PYTHONPATH``, ``my_evals:Lateness``); ``rate:topic``, ``rate`` being a
    registered name, stays a name with a bad parameter list.
    """
    name, _, rest = text.partition(":")
    head, _, tail = rest.partition(":")
    if IMPORT_PATH.match(f"{name}:{head}") and ("." in name or name not in EVALUATORS):
        name, rest = f"{name}:{head}", tail
    params: Mapping[str, str | float | int] = {}
    if rest:
        try:
            params = {
                k.strip(): _value(v.strip()) for k, v in (p.split("=", 1) for p in rest.split(","))
            }
        except ValueError:
            raise SimError(f"evaluator {text!r}: expected name:key=value,key=value") from None
    return EvaluatorSpec(name.strip(), tuple(sorted(params.items())))
