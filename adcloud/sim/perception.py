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
"""

from __future__ import annotations

from collections.abc import Sequence

from adcloud.sim.adapters import NodeSpec, ReplayTiming
from adcloud.sim.evaluators import EvaluatorSpec
from adcloud.sim.replay import ReplayJob
from adcloud.sim.scenario import ScenarioCut

__all__ = ["camera_replay_job"]


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
