"""The replay job: scenarios from bags, fed to a node on the executors, one result each.

Python API::

    from adcloud.sim import EvaluatorSpec, NodeSpec, ReplayJob, run_replay

    job = ReplayJob(
        bags=("drives/*.bag",),
        node=NodeSpec("python -m adcloud.sim.examples.obstacle_node"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        evaluators=(EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8),),
    )
    results = run_replay(spark, job)      # ReplayResults: .results, .passed, .to_dataframe()

The driver cuts the bags into :class:`~adcloud.sim.scenario.Scenario` descriptions
(indexes only); each Spark task reads its scenario's messages, runs the node through its
adapter, evaluates and returns one :class:`ScenarioResult`.  A node that crashes, hangs
or writes garbage gives a failed result with its reason; only infrastructure failures
(an unreadable bag, a roscore that does not start) fail the task, which Spark retries.
:func:`run_scenario` is the same work without Spark.

Evaluators and adapters registered on the driver (:func:`register_evaluator`,
:func:`register_adapter`) travel with the job: a Spark task's Python worker starts with
the built-in registries only, so :func:`run_replay` pickles (cloudpickle) the factories
the job names and each task registers them before it runs.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import json
import logging
import math
import pickle
import re
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from adcloud.binpipe.bags import plan_partitions, read_partition
from adcloud.binpipe.codec import Message
from adcloud.binpipe.decode import ConnectionInfo, MessageDecoder
from adcloud.config import names
from adcloud.sim.adapters import (
    ADAPTERS,
    NodeRun,
    NodeSpec,
    ReplayTiming,
    check_ros,
    get_adapter,
)
from adcloud.sim.errors import SimError
from adcloud.sim.evaluators import (
    EVALUATORS,
    Evaluation,
    Evaluator,
    EvaluatorSpec,
    ScenarioData,
    build_evaluator,
)
from adcloud.sim.scenario import Scenario, ScenarioCut, plan_scenarios

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["ReplayJob", "ReplayResults", "ScenarioResult", "run_replay", "run_scenario"]

log = logging.getLogger(__name__)

#: ROS 1 graph resource names: ``/a/b_c``; no spaces, no empty segments.
_TOPIC = re.compile(r"^/?[A-Za-z][A-Za-z0-9_]*(/[A-Za-z][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class ReplayJob:
    """Everything a replay job needs; a description that pickles cheaply.

    ``bags`` are URLs, globs or directories (any fsspec URL).  ``timing`` sets the replay
    rate, synchronous mode and timeouts (:class:`~adcloud.sim.adapters.ReplayTiming`).
    """

    bags: tuple[str, ...]
    node: NodeSpec
    input_topics: tuple[str, ...]
    output_topics: tuple[str, ...]
    evaluators: tuple[EvaluatorSpec, ...] = ()
    cut: ScenarioCut = field(default_factory=ScenarioCut)
    timing: ReplayTiming = field(default_factory=ReplayTiming)
    storage_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        for name in ("bags", "input_topics", "output_topics"):  # one string is one name
            object.__setattr__(self, name, names(getattr(self, name)))

    def validate(self) -> ReplayJob:
        """Return ``self`` if usable, else raise :class:`SimError` naming the problem."""
        if not self.input_topics:
            raise SimError("a replay job needs at least one input topic")
        timing = self.timing
        for topic in (
            *self.input_topics,
            *self.output_topics,
            *timing.trigger_topics,
            *timing.answer_topics,
        ):
            if not _TOPIC.match(topic):
                raise SimError(
                    f"bad topic name {topic!r}: ROS names are like /lidar/points "
                    "(letters, digits, underscores; segments start with a letter)"
                )
        for topic in timing.trigger_topics:
            if topic not in self.input_topics:
                raise SimError(
                    f"trigger topic {topic!r} is not an input topic "
                    f"({', '.join(self.input_topics)}); synchronous mode waits only after "
                    "inputs: add it to the input topics or leave it out of the triggers"
                )
        for topic in timing.answer_topics:
            if self.output_topics and topic not in self.output_topics:
                raise SimError(
                    f"answer topic {topic!r} is not an output topic "
                    f"({', '.join(self.output_topics)}); only outputs answer inputs: add it "
                    "to the output topics or leave it out of the answers"
                )
        get_adapter(self.node.adapter)
        if self.node.adapter == "ros1" and not self.output_topics:
            # the pipe adapter takes every topic then; the bridge subscribes by name only
            raise SimError(
                "the ros1 adapter collects only the output topics it is given: its bridge "
                "subscribes to them by name; name the topics the node publishes (--outputs)"
            )
        if not self.node.args:
            raise SimError("the node command is empty")
        for spec in self.evaluators:
            build_evaluator(spec)
        self.cut.validate()
        timing.validate()
        if not self.bags and self.cut.file is None:
            raise SimError("no bags given")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The effective job as JSON-able data (written next to every report)."""
        data = asdict(self)
        data["evaluators"] = [{"name": e.name, "params": dict(e.params)} for e in self.evaluators]
        data["storage_options"] = sorted(k for k, _ in self.storage_options)
        # the report is shared: a credential in the node's environment is not written out
        data["node"]["env"] = [
            [k, "<hidden>" if _SECRET_NAME.search(k) else v] for k, v in self.node.env
        ]
        return data


#: Environment variables whose values :meth:`ReplayJob.to_dict` does not write out.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY", re.I)

_NAN_FIELDS = ("latency_p50_ms", "latency_p95_ms", "latency_max_ms", "startup_ms")


@dataclass(frozen=True)
class ScenarioResult:
    """The outcome of one scenario (times in ns, durations in s, latencies in ms).

    Latencies are per output over the evaluated range, start-up excluded; ``startup_ms``
    is the time from the first input to the first output.  ``metrics`` are the
    evaluators' metrics named ``<evaluator>.<metric>``; ``evaluations`` each evaluator's
    verdict; ``exit_code`` is None when the node was
    killed (timeout) or never started.
    """

    scenario: str
    uri: str
    start: int
    end: int
    passed: bool
    reason: str
    metrics: dict[str, float]
    evaluations: list[dict[str, Any]]
    input_count: int
    output_counts: dict[str, int]
    latency_p50_ms: float
    latency_p95_ms: float
    latency_max_ms: float
    startup_ms: float
    wall_s: float
    exit_code: int | None
    stderr_tail: str
    adapter: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: every float finite or None (NaN and infinite latencies and
        metrics, the evaluations' included, become None), so strict JSON parsers read it."""
        data: dict[str, Any] = _finite_json(asdict(self))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScenarioResult:
        """Inverse of :meth:`to_dict` (None latencies and metrics become NaN again)."""
        fixed = dict(data)
        for key in _NAN_FIELDS:
            fixed[key] = math.nan if fixed[key] is None else float(fixed[key])
        fixed["metrics"] = _nan_metrics(fixed["metrics"])
        fixed["evaluations"] = [
            {**e, "metrics": _nan_metrics(e["metrics"])} for e in fixed["evaluations"]
        ]
        return cls(**fixed)


def _finite_json(value: Any) -> Any:
    """``value`` (JSON-able data) with every NaN or infinite float, at any depth, made None:
    JSON has no such numbers, and ``json.dumps`` would write ``NaN``, which strict parsers
    (``jq``, browsers, Java) reject."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(v) for v in value]
    return value


def _nan_metrics(metrics: dict[str, float | None]) -> dict[str, float]:
    return {k: math.nan if v is None else float(v) for k, v in metrics.items()}


def _read_messages(
    scenario: Scenario, topics: Sequence[str]
) -> tuple[list[Message], list[ConnectionInfo]]:
    """The scenario's messages on ``topics``, time-ordered, as owned bytes."""
    if scenario.end <= scenario.feed_start:
        return [], []
    parts = plan_partitions(
        scenario.uri,
        topics=topics,
        start=scenario.feed_start,
        end=scenario.end,
        partitions_per_bag=1,
        storage_options=dict(scenario.storage_options),
    )
    conns: dict[tuple[str, str], ConnectionInfo] = {}
    for part in parts:
        for c in part.connections:
            info = ConnectionInfo(
                c.topic, c.msgtype, c.msgdef_format, c.msgdef, c.md5sum, c.serialization
            )
            conns.setdefault((c.topic, c.msgtype), info)

    def owned(part: Any) -> Iterator[Message]:
        for m in read_partition(part):
            yield Message(m.topic, m.timestamp, m.msgtype, bytes(m.data))

    merged = heapq.merge(*(owned(p) for p in parts), key=lambda m: m.timestamp)
    return list(merged), list(conns.values())


def _latencies(run: NodeRun) -> tuple[list[float], float]:
    """Per-output latency (ms) and the start-up time (ms, first input to first output).

    The first output's latency includes the node's start-up (imports, model loading), so
    it is reported as start-up and left out (NaN) of the per-message latencies.

    An output is measured from an input written before it came back: one stamped ahead
    of the inputs (the next input's time, a clock running ahead) answers the latest
    input written by then, not a later one -- that would make its latency negative.
    """
    stamps = [ts for ts, _ in run.sent]
    written = [at for _, at in run.sent]
    out = []
    for msg, got in zip(run.outputs, run.received, strict=True):
        i = min(bisect.bisect_right(stamps, msg.timestamp), bisect.bisect_right(written, got)) - 1
        out.append((got - run.sent[i][1]) * 1000.0 if i >= 0 else math.nan)
    startup = math.nan
    if out and run.sent:
        startup = (run.received[0] - run.sent[0][1]) * 1000.0
        out[0] = math.nan
    return out, startup


def _stat(values: Sequence[float], q: float) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.percentile(finite, q)) if finite else math.nan


def _evaluate(evaluator: Evaluator, data: ScenarioData) -> Evaluation:
    """``evaluator``'s verdict on ``data``, its metrics as floats.

    An evaluator that cannot judge the scenario fails it with the reason: its
    :class:`SimError`, or the text and place of anything else it raises or a verdict that
    is not an :class:`Evaluation` (a user's evaluator meeting an unexpected message) --
    the other evaluations and scenarios, and so the Spark job, go on.  ``passed`` must be
    a bool (NumPy's too: ``value <= limit`` of a NumPy number is one): a string such as
    ``"no"`` would pass, and a NumPy bool does not go into the result's JSON.
    """
    try:
        verdict = evaluator.evaluate(data)
        if not isinstance(verdict, Evaluation):
            raise SimError(f"it returned {type(verdict).__name__}, not an Evaluation")
        if not isinstance(verdict.passed, bool | np.bool_):
            shown = repr(verdict.passed)[:60]
            raise SimError(
                f"its verdict's passed is {type(verdict.passed).__name__} {shown}, not a bool"
            )
        metrics = {str(k): float(v) for k, v in verdict.metrics.items()}
    except SimError as err:
        return Evaluation(evaluator.name, False, {}, f"cannot evaluate: {err}")
    except Exception as err:  # a user's evaluator may raise anything
        log.warning(
            "evaluator %s failed on scenario %s", evaluator.name, data.scenario.name, exc_info=True
        )
        where = traceback.extract_tb(err.__traceback__)[-1]
        return Evaluation(
            evaluator.name,
            False,
            {},
            f"cannot evaluate: {type(err).__name__}: {err} (raised in {where.name}, "
            f"{where.filename}:{where.lineno})",
        )
    return replace(verdict, passed=bool(verdict.passed), metrics=metrics)


def _published(run: NodeRun, job: ReplayJob) -> dict[str, str]:
    """The topics outside the output topics that a ROS node published, when an output
    topic got nothing (a mismatch; a ROS node's debug topics beside answers are no news)."""
    silent = set(job.output_topics) - {m.topic for m in run.outputs}
    return run.published if silent else {}


def _elsewhere(run: NodeRun, job: ReplayJob) -> bool:
    """Whether the node said something outside the output topics worth telling."""
    return bool(run.ignored or _published(run, job))


def _dropped(run: NodeRun, job: ReplayJob, *, also: bool = False) -> str:
    """What the node wrote outside the output topics (a misspelt ``--outputs`` reads as a
    node that said nothing)."""
    said = []
    outputs = ", ".join(job.output_topics)
    if run.ignored:
        elsewhere = ", ".join(f"{topic} ({n})" for topic, n in sorted(run.ignored.items()))
        said.append(
            f"the node {'also ' if also else ''}wrote on {elsewhere}, which are not output "
            f"topics ({outputs}): dropped"
        )
    published = _published(run, job)
    if published:
        elsewhere = ", ".join(f"{topic} ({kind})" for topic, kind in sorted(published.items()))
        said.append(
            f"the node {'also ' if also else ''}published on {elsewhere}, which are not "
            f"output topics ({outputs}): not read"
        )
    return "; ".join(said)


def _failure_with_progress(run: NodeRun, inputs: int, job: ReplayJob) -> str:
    """``run.failure`` told with how far the replay got.  A node that timed out having
    answered nothing, in synchronous mode, is most often one that does not answer the
    inputs it is sent (another input topic than ``--inputs``, answers on a topic other than
    ``--outputs``): each input then waits out its quiet period, and the reason says so."""
    assert run.failure is not None
    if not run.sent:  # it failed before its first input (start-up): nothing to add
        return run.failure
    said = (
        f"{run.failure} ({len(run.sent):,} of {inputs:,} inputs sent, "
        f"{len(run.outputs):,} outputs received)"
    )
    if _elsewhere(run, job):
        said += f"; {_dropped(run, job)}"
    if "timed out" in run.failure and not run.outputs and job.timing.sync:
        said += (
            "; in synchronous mode each input waits for the node's answer, for at least "
            "the quiet period: check that the node reads the input topics and answers on "
            "the output topics, or replay without waiting (--no-sync) or waiting only "
            "after some inputs (--triggers)"
        )
    return said


def run_scenario(scenario: Scenario, job: ReplayJob) -> ScenarioResult:
    """Replay one scenario through the job's node and evaluate it (no Spark needed)."""
    started = time.monotonic()
    evaluators = [build_evaluator(spec) for spec in job.evaluators]
    truth_topics = sorted({t for e in evaluators for t in e.truth_topics} - set(job.input_topics))
    messages, conns = _read_messages(scenario, [*job.input_topics, *truth_topics])
    wanted = set(job.input_topics)
    inputs = [m for m in messages if m.topic in wanted]
    input_conns = [c for c in conns if c.topic in wanted]

    def result(
        run: NodeRun, passed: bool, reason: str, evals: Sequence[Evaluation]
    ) -> ScenarioResult:
        lat, startup = _latencies(run)
        lat = [
            v
            for m, v in zip(run.outputs, lat, strict=True)
            if scenario.start <= m.timestamp < scenario.end
        ]
        metrics = {f"{e.name}.{k}": float(v) for e in evals for k, v in e.metrics.items()}
        return ScenarioResult(
            scenario=scenario.name,
            uri=scenario.uri,
            start=scenario.start,
            end=scenario.end,
            passed=passed,
            reason=reason,
            metrics=metrics,
            evaluations=[asdict(e) for e in evals],
            input_count=len(inputs),
            output_counts=dict(Counter(m.topic for m in run.outputs)),
            latency_p50_ms=_stat(lat, 50),
            latency_p95_ms=_stat(lat, 95),
            latency_max_ms=_stat(lat, 100),
            startup_ms=startup,
            wall_s=time.monotonic() - started,
            exit_code=run.exit_code,
            stderr_tail=run.stderr_tail,
            adapter=job.node.adapter,
        )

    if not inputs:
        topics = ", ".join(job.input_topics)
        why = (
            f"no messages on the input topics ({topics}) in the scenario "
            f"(`adcloud bag info {scenario.uri}` lists the bag's topics)"
        )
        return result(NodeRun(), False, why, [])
    run = get_adapter(job.node.adapter).run(
        job.node, inputs, input_conns, job.output_topics, job.timing
    )
    if run.failure is not None:
        return result(run, False, _failure_with_progress(run, len(inputs), job), [])
    described = {c.topic for c in run.output_connections}
    serialization = conns[0].serialization if conns else "ros1"
    guessed = [
        ConnectionInfo(m.topic, m.msgtype, "", "", "", serialization)
        for m in {m.topic: m for m in run.outputs if m.topic not in described}.values()
    ]
    # Outputs without a META record are assumed serialized like the inputs and of a
    # standard type (rosbags' bundled definitions).
    decoder = MessageDecoder([*conns, *run.output_connections, *guessed])
    span = run.received[-1] - run.sent[0][1] if run.received and run.sent else math.nan
    data = ScenarioData(
        scenario, messages, run.outputs, _latencies(run)[0], decoder, span, job.input_topics
    )
    evals = [_evaluate(evaluator, data) for evaluator in evaluators]
    failed = [f"{e.name}: {e.reason}" for e in evals if not e.passed]
    if failed and _elsewhere(run, job):  # a misspelt output topic reads as a silent node
        failed.append(_dropped(run, job, also=True))
    return result(run, not failed, "; ".join(failed), evals)


#: A registry entry on its way to the executors: registry, name, pickled factory.
_Carried = tuple[str, str, bytes]
_REGISTRIES: dict[str, dict[str, Callable[..., Any]]] = {
    "evaluator": EVALUATORS,
    "node adapter": ADAPTERS,
}


def _carry(job: ReplayJob) -> tuple[_Carried, ...]:
    """The registry entries ``job`` names, pickled with cloudpickle for its tasks."""
    from pyspark import cloudpickle  # noqa: PLC0415 - pyspark is heavy; import on use

    wanted = [("evaluator", spec.name) for spec in job.evaluators]
    wanted.append(("node adapter", job.node.adapter))
    out: list[_Carried] = []
    for kind, name in dict.fromkeys(wanted):
        factory = _REGISTRIES[kind].get(name)
        if factory is None:
            continue  # an import path, resolved on the executor
        try:
            blob: bytes = cloudpickle.dumps(factory)  # type: ignore[no-untyped-call]
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise SimError(
                f"{kind} {name!r} registered on the driver cannot be sent to the executors "
                f"({err}); register a class or a module-level function, or name it as "
                "package.module:attr"
            ) from err
        out.append((kind, name, blob))
    return tuple(out)


@contextlib.contextmanager
def _registered(carried: Sequence[_Carried]) -> Iterator[None]:
    """Register the driver's ``carried`` entries in this worker while the block runs."""
    saved: list[tuple[dict[str, Callable[..., Any]], str, Callable[..., Any] | None]] = []
    try:
        for kind, name, blob in carried:
            registry = _REGISTRIES[kind]
            try:
                factory = pickle.loads(blob)
            except Exception as err:  # whatever unpickling a user's factory raises
                raise SimError(
                    f"{kind} {name!r} registered on the driver cannot be loaded on this "
                    f"executor ({type(err).__name__}: {err}); install the module that "
                    "defines it on the executors too"
                ) from err
            saved.append((registry, name, registry.get(name)))
            registry[name] = factory
        yield
    finally:
        for registry, name, previous in reversed(saved):
            if previous is None:
                registry.pop(name, None)
            else:
                registry[name] = previous


def _task(item: tuple[int, Scenario], job: ReplayJob, carried: tuple[_Carried, ...] = ()) -> str:
    _index, scenario = item
    with _registered(carried):
        res = run_scenario(scenario, job)
    log.info("scenario %s: %s", scenario.name, "pass" if res.passed else f"FAIL ({res.reason})")
    return json.dumps(res.to_dict(), allow_nan=False)


@dataclass(frozen=True)
class ReplayResults:
    """The results of a replay job, in scenario order, with the job that made them."""

    job: ReplayJob
    results: tuple[ScenarioResult, ...]
    wall_s: float

    @property
    def passed(self) -> bool:
        """Whether every scenario passed (False for a job without scenarios)."""
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failed(self) -> list[ScenarioResult]:
        """The failed scenarios."""
        return [r for r in self.results if not r.passed]

    def to_dataframe(self, spark: SparkSession) -> DataFrame:
        """The results as a Spark DataFrame (one row per scenario)."""
        from pyspark.sql.types import (  # noqa: PLC0415 - pyspark is heavy; import on use
            BooleanType,
            DoubleType,
            IntegerType,
            LongType,
            MapType,
            StringType,
            StructField,
            StructType,
        )

        schema = StructType(
            [
                StructField("scenario", StringType(), False),
                StructField("uri", StringType(), False),
                StructField("start", LongType(), False),
                StructField("end", LongType(), False),
                StructField("passed", BooleanType(), False),
                StructField("reason", StringType(), False),
                StructField("metrics", MapType(StringType(), DoubleType()), False),
                StructField("input_count", LongType(), False),
                StructField("output_counts", MapType(StringType(), LongType()), False),
                StructField("latency_p50_ms", DoubleType(), True),
                StructField("latency_p95_ms", DoubleType(), True),
                StructField("latency_max_ms", DoubleType(), True),
                StructField("startup_ms", DoubleType(), True),
                StructField("wall_s", DoubleType(), False),
                StructField("exit_code", IntegerType(), True),
                StructField("stderr_tail", StringType(), False),
                StructField("adapter", StringType(), False),
            ]
        )
        rows = [
            (
                r.scenario,
                r.uri,
                r.start,
                r.end,
                r.passed,
                r.reason,
                r.metrics,
                r.input_count,
                r.output_counts,
                r.latency_p50_ms,
                r.latency_p95_ms,
                r.latency_max_ms,
                r.startup_ms,
                r.wall_s,
                r.exit_code,
                r.stderr_tail,
                r.adapter,
            )
            for r in self.results
        ]
        return spark.createDataFrame(rows, schema)


def run_replay(
    spark: SparkSession, job: ReplayJob, scenarios: Sequence[Scenario] | None = None
) -> ReplayResults:
    """Run ``job`` on Spark: one task per scenario; returns every scenario's result.

    ``scenarios`` overrides the job's cut (e.g. a subset to re-run).
    """
    job.validate()
    if job.node.adapter == "ros1":
        check_ros()  # fail on the driver, with the install hint, before any task starts
    started = time.monotonic()
    if scenarios is None:
        scenarios = plan_scenarios(
            list(job.bags), job.cut, storage_options=dict(job.storage_options)
        )
    if not scenarios:
        raise SimError("the bags gave no scenario")
    log.info("replaying %d scenarios through %s", len(scenarios), job.node.args)
    task = functools.partial(_task, job=job, carried=_carry(job))
    sc = spark.sparkContext
    rows = sc.parallelize(list(enumerate(scenarios)), len(scenarios)).map(task).collect()
    results = tuple(ScenarioResult.from_dict(json.loads(r)) for r in rows)
    return ReplayResults(job, results, time.monotonic() - started)
