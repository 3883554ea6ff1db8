"""The pose_error evaluator against the truth odometry recorded in a synthetic drive."""

from __future__ import annotations

import json
import pickle

from adcloud.sim import (
    EvaluatorSpec,
    NodeSpec,
    ReplayJob,
    ReplayTiming,
    plan_scenarios,
    run_scenario,
)
from adcloud.synth import DriveResult


def _job(bag: str, command: str) -> ReplayJob:
    return ReplayJob(
        bags=(bag,),
        node=NodeSpec(command),
        input_topics=("/odom", "/ground_truth/odom"),
        output_topics=("/estimate",),
        evaluators=(EvaluatorSpec.of("pose_error", topic="/estimate", max_m=0.05),),
        # The node answers only one of the two input topics: wait for it alone.
        timing=ReplayTiming(trigger_topics=("/odom",), quiet_s=0.05),
    ).validate()


def test_truth_as_estimate_has_no_error(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    job = _job(str(drive.bag), bad_nodes["relay_pose"] + " /ground_truth/odom")
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert result.passed, result.reason
    assert result.output_counts == {"/estimate": 300}
    assert result.metrics["pose_error.max_m"] < 1e-9


def test_wheel_odometry_is_not_the_truth(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    job = _job(str(drive.bag), bad_nodes["relay_pose"] + " /odom")
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert not result.passed
    assert result.metrics["pose_error.max_m"] > 1.0  # odom frame != map frame
    assert "max error" in result.reason


def test_job_pickles_and_serializes(drive: DriveResult) -> None:
    job = _job(str(drive.bag), "node")
    assert pickle.loads(pickle.dumps(job)) == job
    data = json.loads(json.dumps(job.to_dict()))
    assert data["evaluators"] == [
        {"name": "pose_error", "params": {"max_m": 0.05, "topic": "/estimate"}}
    ]
    assert data["timing"]["trigger_topics"] == ["/odom"]
