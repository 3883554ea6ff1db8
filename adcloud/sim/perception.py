"""Perception replay: camera streams at their frame rate into a detector node.

:func:`camera_replay_job` builds a :class:`~adcloud.sim.replay.ReplayJob` that replays
``N`` camera topics paced to recorded time (``rate=1``: each stream at its frame rate),
free-running rather than synchronous -- a detector that cannot keep up must drop frames
or fall behind, as on the car -- starting the clock once the node has announced its
outputs (``wait_ready``: its start-up is not counted as lost frames), and judges it with
the ``frames`` evaluator (frame-loss rate, throughput in frames per second, latency)
plus, optionally, a latency bound::

    job = camera_replay_job(["drive.bag"], NodeSpec("python -m my.detector"),
                            ["/camera/image_raw", "/camera/labels"], "/detections")
    results = run_replay(spark, job)

:func:`camera_sweep` answers how many cameras a detector sustains: it replays the first
``n`` camera streams for each ``n`` in turn (one replay job after the other, so the loads
never share the machine) and reports per ``n`` the frame-loss rate, throughput and
latency, the largest ``n`` that passes (:attr:`CameraSweep.sustained`) and a plot::

    sweep = camera_sweep(spark, ["rig.bag"], NodeSpec("python -m my.detector"),
                         [f"/camera{k}/image_raw" for k in ("", 1, 2, 3)], "/detections")
    print(sweep.sustained)
    sweep.write("out/sweep")  # sweep.json, sweep.png and each load's replay report

:meth:`CameraSweep.write` replaces an earlier sweep report as a whole, once every file is
written; :func:`check_sweep_target` refuses a target it would refuse before the sweep runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import posixpath
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from adcloud._commit import JobOutput
from adcloud.sim.adapters import NodeSpec, ReplayTiming
from adcloud.sim.errors import SimError
from adcloud.sim.evaluators import EvaluatorSpec
from adcloud.sim.replay import ReplayJob, ReplayResults, ScenarioResult, run_replay
from adcloud.sim.scenario import ScenarioCut

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from adcloud.store import Store

__all__ = [
    "CameraLoad",
    "CameraSweep",
    "camera_replay_job",
    "camera_sweep",
    "check_sweep_target",
]

log = logging.getLogger(__name__)


def camera_replay_job(
    bags: Sequence[str],
    node: NodeSpec,
    camera_topics: Sequence[str],
    output_topic: str,
    *,
    rate: float = 1.0,
    max_loss: float = 0.05,
    min_fps: float = 0.0,
    max_latency_ms: float | None = None,
    cut: ScenarioCut | None = None,
    timeout_s: float = 300.0,
) -> ReplayJob:
    """A replay job for a camera detector (see the module docstring); validated."""
    evaluators = [
        EvaluatorSpec.of(
            "frames",
            inputs="+".join(camera_topics),
            output=output_topic,
            max_loss=max_loss,
            min_fps=min_fps,
        )
    ]
    if max_latency_ms is not None:
        evaluators.append(
            EvaluatorSpec.of("latency", max_ms=max_latency_ms, stat="p95", topic=output_topic)
        )
    return ReplayJob(
        bags=tuple(bags),
        node=node,
        input_topics=tuple(camera_topics),
        output_topics=(output_topic,),
        evaluators=tuple(evaluators),
        cut=cut or ScenarioCut(),
        timing=ReplayTiming(rate=rate, sync=False, timeout_s=timeout_s, wait_ready=True),
    ).validate()


@dataclass(frozen=True)
class CameraLoad:
    """The detector fed ``cameras`` streams: worst loss and latency over the scenarios,
    total throughput (answered frames per second, mean over the scenarios).

    A scenario the ``frames`` evaluator did not judge (the detector crashed, hung or wrote
    garbage) lost every frame it was fed: loss 1, throughput 0, its frames those replayed.
    """

    cameras: int
    topics: tuple[str, ...]
    passed: bool
    frames: int
    loss_rate: float
    throughput_fps: float
    latency_p50_ms: float
    latency_p95_ms: float
    reason: str

    @classmethod
    def of(cls, results: ReplayResults, topics: Sequence[str]) -> CameraLoad:
        """Summarize the replay of ``topics`` (one scenario or more)."""
        runs = results.results
        metrics = [r.metrics for r in runs]

        def worst(key: str) -> float:
            values = [m[key] for m in metrics if key in m and math.isfinite(m[key])]
            return max(values) if values else math.nan

        judged: list[ScenarioResult] = []
        unjudged: list[ScenarioResult] = []
        for r in runs:
            loss = r.metrics.get("frames.loss_rate", math.nan)
            (judged if math.isfinite(loss) else unjudged).append(r)
        losses = [r.metrics["frames.loss_rate"] for r in judged] + [1.0] * len(unjudged)
        fps = [r.metrics.get("frames.throughput_fps", 0.0) for r in runs]
        frames = sum(r.metrics.get("frames.frames", 0.0) for r in judged)
        failed = [f"{r.scenario}: {r.reason}" for r in runs if not r.passed]
        return cls(
            cameras=len(topics),
            topics=tuple(topics),
            passed=results.passed,
            frames=int(frames) + sum(r.input_count for r in unjudged),
            loss_rate=max(losses, default=1.0),
            throughput_fps=sum(fps) / len(fps) if fps else 0.0,
            latency_p50_ms=worst("frames.latency_p50_ms"),
            latency_p95_ms=worst("frames.latency_p95_ms"),
            reason="; ".join(failed),
        )


@dataclass(frozen=True)
class CameraSweep:
    """How a detector copes with 1, 2, ... cameras (see :func:`camera_sweep`)."""

    loads: tuple[CameraLoad, ...]
    max_loss: float
    rate: float

    @property
    def sustained(self) -> int:
        """The most cameras the detector sustains: the largest count that passed with every
        smaller count tried also passing (0 when even the first count fails)."""
        best = 0
        for load in sorted(self.loads, key=lambda lo: lo.cameras):
            if not load.passed:
                break
            best = load.cameras
        return best

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (NaN latencies become None)."""
        return {
            "sustained": self.sustained,
            "max_loss": self.max_loss,
            "rate": self.rate,
            "loads": [
                {
                    k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                    for k, v in asdict(load).items()
                }
                for load in self.loads
            ],
        }

    def plot(self) -> bytes:
        """A PNG: frame loss and throughput against the number of cameras (top), latency
        (bottom); the loss bound is drawn, passing counts are green."""
        import matplotlib  # noqa: PLC0415 - heavy; only plots need it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        n = [lo.cameras for lo in self.loads]
        fig, (ax1, ax3) = plt.subplots(2, 1, figsize=(6.5, 6), sharex=True)
        colors = ["tab:green" if lo.passed else "tab:red" for lo in self.loads]
        ax1.bar(n, [100 * lo.loss_rate for lo in self.loads], color=colors, alpha=0.7)
        ax1.axhline(100 * self.max_loss, color="black", linestyle="--", linewidth=1)
        for lo, color in zip(self.loads, colors, strict=True):
            ax1.annotate(
                "pass" if lo.passed else "FAIL",
                (lo.cameras, 100 * lo.loss_rate),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                color=color,
                fontsize=8,
            )
        ax1.set_ylabel("frame loss (%, bars)")
        ax2 = ax1.twinx()
        ax2.plot(n, [lo.throughput_fps for lo in self.loads], "o-", color="tab:blue")
        ax2.set_ylabel("answered frames/s (line)", color="tab:blue")
        ax1.set_title(
            f"Sustains {self.sustained} camera(s) at {self.rate:g}x frame rate "
            f"(loss <= {self.max_loss:.0%}; green: pass)"
        )
        ax3.plot(n, [lo.latency_p50_ms for lo in self.loads], "o-", label="p50")
        ax3.plot(n, [lo.latency_p95_ms for lo in self.loads], "o-", label="p95")
        ax3.set_ylabel("latency (ms)")
        ax3.set_xlabel("cameras replayed")
        ax3.set_xticks(n)
        ax3.legend()
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        return buf.getvalue()

    def write(self, uri: str, results: Sequence[ReplayResults] = ()) -> str:
        """Write ``sweep.json`` and ``sweep.png`` into the directory ``uri`` (any store
        URI), and each load's replay report (``results``) into ``cameras-<n>/``; return
        its URL.

        All or nothing: everything is staged inside ``uri`` and replaces an earlier sweep
        report there as a whole (its ``cameras-<n>/`` of counts not in this sweep
        included) once it is all written; a failure leaves the earlier report as it was.
        Raises :class:`SimError` for a target :func:`check_sweep_target` refuses.
        """
        from adcloud.sim.report import _put_report, _store_url  # noqa: PLC0415
        from adcloud.store import StoreError  # noqa: PLC0415

        url = _store_url(uri)
        store, output = _sweep_output(url)
        names = list(dict.fromkeys(f"cameras-{len(r.job.input_topics)}" for r in results))
        output.start()
        try:
            for res in results:
                where = posixpath.join(output.staging, f"cameras-{len(res.job.input_topics)}")
                _put_report(store, where, res)
            store.put(posixpath.join(output.staging, "sweep.png"), self.plot())
            text = json.dumps(self.to_dict(), indent=2) + "\n"
            store.put(posixpath.join(output.staging, "sweep.json"), text.encode("utf-8"))
        except BaseException:
            with contextlib.suppress(StoreError):  # the failure that matters is the one raised
                output.abort()
            raise
        # sweep.json, what readers start from, goes first and comes back last
        names += ["sweep.png", "sweep.json"]
        output.commit([(posixpath.join(output.staging, n), n) for n in names], first=names[-1:])
        return url


#: A sweep report's own files (``sweep.json`` last: see :meth:`JobOutput.commit`) and the
#: folders of its counts' replay reports.
_SWEEP_FILES = ("sweep.png", "sweep.json")
_COUNT_FOLDER = re.compile(r"cameras-\d+")


def _sweep_output(url: str) -> tuple[Store, JobOutput]:
    """The sweep report directory ``url`` as a :class:`JobOutput`, its ``cameras-<n>/``
    folders checked to hold replay reports only (they are replaced with it)."""
    from adcloud.sim.report import _report_output, _store_output  # noqa: PLC0415

    store, output = _store_output(
        url,
        lambda name: name in _SWEEP_FILES or bool(_COUNT_FOLDER.fullmatch(name)),
        "a camera sweep",
    )
    for entry in output.entries:
        name = posixpath.basename(entry.rstrip("/"))
        if _COUNT_FOLDER.fullmatch(name):
            _report_output(f"{url.rstrip('/')}/{name}")  # a file or foreign files: refused
    return store, output


def check_sweep_target(uri: str) -> None:
    """Raise :class:`SimError` now if :meth:`CameraSweep.write` would refuse ``uri``: a
    file, a directory holding files a sweep report does not write, or a ``cameras-<n>``
    in it that is a file or holds files a replay report does not write -- before the
    sweep runs, not once it is done."""
    from adcloud.sim.report import _store_url  # noqa: PLC0415

    _sweep_output(_store_url(uri))


def camera_sweep(
    spark: SparkSession,
    bags: Sequence[str],
    node: NodeSpec,
    camera_topics: Sequence[str],
    output_topic: str,
    *,
    counts: Sequence[int] | None = None,
    stop_after_failure: bool = False,
    on_load: Callable[[CameraLoad, ReplayResults], None] | None = None,
    **job_options: Any,
) -> CameraSweep:
    """Replay the first ``n`` of ``camera_topics`` into ``node`` for each ``n`` of
    ``counts`` (default ``1 .. len(camera_topics)``), one replay job after the other.

    ``job_options`` are :func:`camera_replay_job`'s (``rate``, ``max_loss``,
    ``max_latency_ms``, ``cut``, ...).  ``stop_after_failure`` skips the larger counts
    once one fails; ``on_load`` is called after each count (progress, keeping reports).
    """
    topics = list(dict.fromkeys(camera_topics))
    if len(topics) != len(camera_topics) or not topics:
        raise SimError(f"camera_topics must name distinct topics, not {list(camera_topics)}")
    wanted = sorted(set(counts)) if counts is not None else list(range(1, len(topics) + 1))
    bad = [n for n in wanted if not 1 <= n <= len(topics)]
    if bad or not wanted:
        raise SimError(
            f"camera counts must be in 1..{len(topics)} (the number of camera topics given), "
            f"not {bad or list(counts or [])}"
        )
    loads = []
    jobs = [camera_replay_job(bags, node, topics[:n], output_topic, **job_options) for n in wanted]
    for n, job in zip(wanted, jobs, strict=True):
        results = run_replay(spark, job)
        load = CameraLoad.of(results, topics[:n])
        log.info(
            "%d camera(s): %s, loss %.1f%%, %.1f frames/s",
            n,
            "pass" if load.passed else "FAIL",
            100 * load.loss_rate,
            load.throughput_fps,
        )
        loads.append(load)
        if on_load is not None:
            on_load(load, results)
        if stop_after_failure and not load.passed:
            break
    frames = next(e for e in jobs[0].evaluators if e.name == "frames")
    return CameraSweep(
        tuple(loads),
        max_loss=float(dict(frames.params)["max_loss"]),
        rate=jobs[0].timing.rate,
    )
