"""Replaying scenarios through pipe nodes: the example detector and misbehaving nodes."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adcloud.errors import MissingComponentError
from adcloud.sim import (
    EVALUATORS,
    CutMode,
    Evaluation,
    EvaluatorSpec,
    NodeSpec,
    ReplayJob,
    ReplayTiming,
    ScenarioCut,
    ScenarioData,
    SimError,
    plan_scenarios,
    run_scenario,
)
from adcloud.synth import DriveResult

from .conftest import OBSTACLE_NODE

EVALS = (
    EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8),
    EvaluatorSpec.of("latency", max_ms=2000, stat="p95"),
    EvaluatorSpec.of("detections", topic="/obstacles", min_precision=0.95, min_recall=0.95),
)


def _job(bag: Path | str, command: str = OBSTACLE_NODE, **timing: float) -> ReplayJob:
    return ReplayJob(
        bags=(str(bag),),
        node=NodeSpec(command),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        evaluators=EVALS,
        timing=ReplayTiming(**timing),  # type: ignore[arg-type]
    ).validate()


def _run(job: ReplayJob) -> object:
    (scenario,) = plan_scenarios(list(job.bags), job.cut)
    return run_scenario(scenario, job)


def test_example_node_passes(drive: DriveResult) -> None:
    result = _run(_job(drive.bag))
    assert result.passed, result.reason
    assert result.input_count == 29
    assert result.output_counts == {"/obstacles": 29}
    assert result.exit_code == 0
    assert result.metrics["detections.recall"] == 1.0
    assert result.metrics["detections.precision"] == 1.0
    assert result.metrics["detections.truth_objects"] > 20
    # 29 clouds at 10 Hz, each answered: 10 Hz (not 29 over the bag's 2.991 s)
    assert result.metrics["rate.rate_hz[/obstacles]"] == pytest.approx(10.0)
    assert 0 < result.latency_p50_ms <= result.latency_p95_ms <= result.latency_max_ms
    assert result.startup_ms > 0


def test_the_example_node_on_an_mcap_bag_is_judged_as_on_a_ros1_bag(
    mcap_drive: DriveResult,
) -> None:
    # ROS 2 clouds in, the node's ROS 1 detections out: its output header has a seq the
    # cloud's lacks, and the evaluator decodes both sides
    result = _run(_job(mcap_drive.bag))
    assert result.passed, result.reason
    assert result.output_counts == {"/obstacles": result.input_count}
    assert result.metrics["detections.recall"] == 1.0
    assert result.metrics["detections.precision"] == 1.0
    assert result.metrics["detections.truth_objects"] > 5


def test_an_output_stamped_ahead_of_its_input_is_measured_from_that_input(
    drive: DriveResult, bad_nodes: dict[str, str]
) -> None:
    # each answer carries the next cloud's time, and comes back before that cloud is sent:
    # it answers the cloud written before it, not the later one (a negative latency)
    job = replace(
        _job(drive.bag, bad_nodes["stamps_ahead"]),
        evaluators=(EvaluatorSpec.of("latency", max_ms=2000, stat="max"),),
    )
    result = _run(job)
    assert result.output_counts == {"/obstacles": 29}
    assert 0 <= result.latency_p50_ms <= result.latency_max_ms
    assert result.metrics["latency.latency_max_ms"] >= 0
    # every output (but the first, the start-up) is measured: none is left without input
    assert result.passed, result.reason


def test_a_passing_node_keeps_its_stderr_tail(drive: DriveResult) -> None:
    noisy = f"sh -c 'echo model loaded, 3 layers on the CPU >&2; exec {OBSTACLE_NODE}'"
    result = _run(_job(drive.bag, noisy))
    assert result.passed, result.reason
    assert "model loaded, 3 layers on the CPU" in result.stderr_tail


def test_short_sighted_detector_fails_on_recall(drive: DriveResult) -> None:
    job = _job(drive.bag, OBSTACLE_NODE + " --max-range 10")
    result = _run(job)
    assert not result.passed
    assert "recall" in result.reason
    assert result.metrics["detections.recall"] < 0.95
    assert result.metrics["detections.precision"] > 0.5


def test_crash_is_a_failed_scenario(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    result = _run(_job(drive.bag, bad_nodes["crash"], startup_timeout_s=2))
    assert not result.passed
    assert result.exit_code == 3
    assert "boom: the detector crashed" in result.stderr_tail
    assert "exit code 3" in result.reason


def test_crash_midway(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    result = _run(_job(drive.bag, bad_nodes["crash_later"]))
    assert not result.passed
    assert result.exit_code == 5
    assert "dying after 2 messages" in result.stderr_tail


def test_hang_times_out(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    result = _run(_job(drive.bag, bad_nodes["hang"], timeout_s=3, startup_timeout_s=1))
    assert not result.passed
    assert "timed out after 3" in result.reason
    assert result.exit_code is None
    assert result.wall_s < 15


def test_a_node_that_never_answers_times_out_saying_how_far_the_replay_got(
    drive: DriveResult,
) -> None:
    """A node listening on another topic than --inputs answers nothing: each input waits
    out its quiet period until the time limit.  The reason was a bare "timed out after
    3.0 s", as for a hung node; it now says how many inputs went in and came out and what
    to check."""
    deaf = OBSTACLE_NODE + " --input /camera/image"
    result = _run(_job(drive.bag, deaf, timeout_s=3, startup_timeout_s=1, quiet_s=0.25))
    assert not result.passed
    assert "timed out after 3" in result.reason
    sent = int(result.reason.split("(", 1)[1].split(" of ", 1)[0])
    assert 1 <= sent < 29, result.reason
    assert f"{sent} of 29 inputs sent, 0 outputs received" in result.reason
    assert "--no-sync" in result.reason and "--triggers" in result.reason


def test_a_node_flooding_its_outputs_fails_its_scenario_at_the_limit(drive: DriveResult) -> None:
    """Outputs are held in the executor's memory until the scenario is judged: a node that
    wrote without end (40 MB a message) took the executor, and with it the job, down."""
    result = _run(_job(drive.bag, max_output_mb=0.001))  # ~1 kB: a few detections
    assert not result.passed
    assert result.reason.startswith("node wrote more than 0.001 MiB of output messages (")
    assert "--max-output-mb" in result.reason
    assert result.exit_code is None and result.output_counts == {}
    with pytest.raises(SimError, match="max_output_mb must be a finite number > 0, not 0"):
        ReplayTiming(max_output_mb=0).validate()


def test_garbage_output(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    result = _run(_job(drive.bag, bad_nodes["garbage"], startup_timeout_s=1))
    assert not result.passed
    assert "not a BinPipe stream" in result.reason


def test_a_node_printing_on_stdout_is_told_to_print_to_stderr(
    drive: DriveResult, bad_nodes: dict[str, str]
) -> None:
    """A print() in a pipe node lands in its BinPipe stream: the reason said only that the
    node "closed its stdout" with a bad block magic, not what to change."""
    result = _run(_job(drive.bag, bad_nodes["prints"]))
    assert not result.passed
    assert "block magic b'debu'" in result.reason
    assert "the node wrote text on stdout ('debu'...), where its BinPipe output goes: " in (
        result.reason
    )
    assert "print and log to stderr" in result.reason


def test_records_that_are_not_messages(drive: DriveResult, bad_nodes: dict[str, str]) -> None:
    result = _run(_job(drive.bag, bad_nodes["not_messages"]))
    assert not result.passed
    assert "not a message" in result.reason


def test_missing_program(drive: DriveResult, tmp_path: Path) -> None:
    result = _run(_job(drive.bag, str(tmp_path / "no-such-node")))
    assert not result.passed
    assert "cannot start" in result.reason


def test_empty_bag(empty_bag: Path) -> None:
    result = _run(_job(empty_bag))
    assert not result.passed
    assert "no messages on the input topics" in result.reason
    assert f"adcloud bag info {empty_bag}" in result.reason
    assert result.input_count == 0


def test_input_topic_not_in_bag(drive: DriveResult) -> None:
    job = replace(_job(drive.bag), input_topics=("/radar/targets",))
    result = _run(job)
    assert not result.passed
    assert "no messages" in result.reason


@pytest.mark.parametrize("topic", ["lidar points", "/lidar//points", "/1lidar", ""])
def test_bad_topic_names(drive: DriveResult, topic: str) -> None:
    with pytest.raises(SimError, match="bad topic name"):
        replace(_job(drive.bag), input_topics=(topic,)).validate()


def test_bad_job_settings(drive: DriveResult) -> None:
    with pytest.raises(SimError, match="unknown node adapter"):
        replace(_job(drive.bag), node=NodeSpec("x", adapter="ros7")).validate()
    with pytest.raises(SimError, match="rate"):
        replace(_job(drive.bag), timing=ReplayTiming(rate=-1)).validate()
    with pytest.raises(SimError, match="unknown evaluator"):
        replace(_job(drive.bag), evaluators=(EvaluatorSpec("nope"),)).validate()


def test_trigger_topics_must_be_input_topics(drive: DriveResult) -> None:
    job = _job(drive.bag)
    replace(job, timing=ReplayTiming(trigger_topics=("/lidar/points",))).validate()
    with pytest.raises(SimError, match="trigger topic '/obstacles' is not an input topic"):
        replace(job, timing=ReplayTiming(trigger_topics=("/obstacles",))).validate()


def test_answer_topics_must_be_output_topics(drive: DriveResult) -> None:
    job = _job(drive.bag)
    replace(job, timing=ReplayTiming(answer_topics=("/obstacles",))).validate()
    # a pipe job without output topics takes every topic its node writes: any may answer
    replace(job, output_topics=(), timing=ReplayTiming(answer_topics=("/tracks",))).validate()
    with pytest.raises(SimError, match="answer topic '/tracks' is not an output topic"):
        replace(job, timing=ReplayTiming(answer_topics=("/tracks",))).validate()
    with pytest.raises(SimError, match="bad topic name '/tracks//2'"):
        replace(job, timing=ReplayTiming(answer_topics=("/tracks//2",))).validate()


@pytest.mark.parametrize(
    ("field", "value"), [("quiet_s", -0.5), ("timeout_s", 0.0), ("startup_timeout_s", -2.0)]
)
def test_timing_errors_name_the_field_and_value(field: str, value: float) -> None:
    timing = ReplayTiming(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(SimError, match=rf"^{field} must be .*, not {value}$"):
        timing.validate()


def test_same_results_at_real_time_and_as_fast_as_possible(drive: DriveResult) -> None:
    fast = _run(_job(drive.bag, rate=0.0))
    paced = _run(_job(drive.bag, rate=1.0))
    assert fast.output_counts == paced.output_counts
    for key in ("detections.precision", "detections.recall", "detections.truth_objects"):
        assert fast.metrics[key] == paced.metrics[key]
    assert paced.wall_s >= 2.8  # 3 s of recorded time, paced at 1x
    assert fast.wall_s < paced.wall_s


def test_a_node_slower_than_the_quiet_period_is_waited_for(
    drive: DriveResult, bad_nodes: dict[str, str]
) -> None:
    """Synchronous mode sends the next cloud only once the node answered the last one: a
    node that computes 0.2 s per cloud (ten times the quiet period) is neither flooded nor
    kept a message behind, so an output's latency is one cloud's work, not two or more."""
    job = replace(_job(drive.bag, bad_nodes["slow"], quiet_s=0.02), evaluators=()).validate()
    result = _run(job)
    assert result.passed, result.reason
    assert result.output_counts == {"/obstacles": 29}
    per_message_ms = (result.wall_s * 1000 - result.startup_ms) / result.input_count
    assert per_message_ms > 150  # the node's work paces the replay
    assert result.latency_p50_ms < 1.5 * per_message_ms, (result.latency_p50_ms, per_message_ms)


def test_windows_evaluate_only_their_range(drive: DriveResult) -> None:
    job = replace(_job(drive.bag), cut=ScenarioCut(CutMode.WINDOW, 1.5, 0.5))
    first, second = plan_scenarios(list(job.bags), job.cut)
    r1, r2 = run_scenario(first, job), run_scenario(second, job)
    assert r1.passed and r2.passed, (r1.reason, r2.reason)
    # The second window is fed 0.5 s of warm-up clouds too, but counts only its own.
    assert r2.input_count > r2.output_counts["/obstacles"] - 1
    # each window answers every cloud of the 10 Hz LiDAR: 10 Hz, although the first holds
    # 14 clouds (the LiDAR starts 0.1 s into the bag) and the last ends at the bag's end
    assert r1.metrics["rate.rate_hz[/obstacles]"] == pytest.approx(10.0)
    assert r2.metrics["rate.rate_hz[/obstacles]"] == pytest.approx(10.0)
    assert not math.isnan(r2.latency_p50_ms)


def test_python_path_of_example_node() -> None:
    assert OBSTACLE_NODE.startswith(sys.executable)


def test_missing_ros_says_how_to_install(
    drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Here, not in the ROS tests: those are skipped on the machines that lack ROS, where
    this error is the one a user meets."""
    monkeypatch.setenv("PATH", str(tmp_path))
    job = ReplayJob(
        bags=(str(drive.bag),),
        node=NodeSpec("rosrun my_pkg detector", adapter="ros1"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
    ).validate()
    (scenario,) = plan_scenarios(list(job.bags), job.cut)
    with pytest.raises(MissingComponentError, match="apt-get install"):
        run_scenario(scenario, job)


class _Broken:
    """A user evaluator with a bug: it reads a field the output type lacks (``fails``),
    or returns something else than an :class:`Evaluation`."""

    truth_topics: tuple[str, ...] = ()

    def __init__(self, returns: bool = False) -> None:
        self.name = "broken_returns" if returns else "broken"
        self.returns = returns

    def evaluate(self, data: ScenarioData) -> Evaluation:
        if self.returns:
            return None  # type: ignore[return-value]
        return Evaluation(self.name, True, {"x": data.outputs[0].pose})  # type: ignore[attr-defined]


def test_an_evaluator_meeting_another_type_fails_its_evaluation_not_the_task(
    drive: DriveResult, bad_nodes: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node echoing its clouds where poses belong: the built-in evaluators name the topic
    and types, a user's evaluator fails with its exception, and the others still judge."""
    monkeypatch.setitem(EVALUATORS, "broken", _Broken)
    job = replace(
        _job(drive.bag, bad_nodes["relay_pose"] + " /lidar/points"),
        output_topics=("/estimate",),
        evaluators=(
            EvaluatorSpec.of("detections", topic="/estimate"),
            EvaluatorSpec.of("pose_error", topic="/estimate"),
            EvaluatorSpec.of("broken"),
            EvaluatorSpec.of("broken", returns=1),
            EvaluatorSpec.of("rate", topic="/estimate", min_hz=5),
        ),
    ).validate()
    result = _run(job)
    assert not result.passed
    verdicts = {e["name"]: e for e in result.evaluations}
    assert verdicts["detections"]["reason"] == (
        "cannot evaluate: /estimate carries sensor_msgs/msg/PointCloud2, "
        "not geometry_msgs/msg/PoseArray"
    )
    assert verdicts["pose_error"]["reason"].startswith(
        "cannot evaluate: /estimate carries sensor_msgs/msg/PointCloud2, not nav_msgs/msg/Odometry"
    )
    assert verdicts["broken"]["reason"].startswith(
        "cannot evaluate: AttributeError: 'Message' object has no attribute 'pose' "
        "(raised in evaluate, "
    )
    assert verdicts["broken_returns"]["reason"] == (
        "cannot evaluate: it returned NoneType, not an Evaluation"
    )
    assert verdicts["rate"]["passed"]
    assert result.metrics["rate.rate_hz[/estimate]"] > 5
    assert "detections: cannot evaluate: /estimate carries" in result.reason


def test_outputs_on_a_misspelt_topic_are_named_when_the_scenario_fails(
    drive: DriveResult,
) -> None:
    """A node writing on /obstacle where /obstacles is expected: its outputs are dropped,
    and the failure says where they went (it read as a node that answered nothing)."""
    result = _run(_job(drive.bag, OBSTACLE_NODE + " --output /obstacle"))
    assert not result.passed and result.output_counts == {}
    assert (
        "the node also wrote on /obstacle (29), which are not output topics (/obstacles): "
        "dropped" in result.reason
    ), result.reason


def test_a_ros1_job_without_output_topics_is_refused(drive: DriveResult) -> None:
    """The pipe adapter takes every topic when none is named; the ROS 1 bridge subscribes
    by name only, so such a job collected nothing and failed every scenario."""
    job = ReplayJob(
        bags=(str(drive.bag),),
        node=NodeSpec("rosrun my_pkg detector", adapter="ros1"),
        input_topics=("/lidar/points",),
        output_topics=(),
    )
    with pytest.raises(SimError, match=r"ros1 adapter collects only the output topics"):
        job.validate()
    replace(job, node=NodeSpec("my_detector", adapter="pipe")).validate()


def test_a_node_that_dies_while_its_start_up_is_waited_for_fails_at_once(
    drive: DriveResult, tmp_path: Path
) -> None:
    """A node that died (an import error) while the first input waited out its start-up
    was reported only once that wait (``startup_timeout_s``) or 5 s more had passed."""
    node = tmp_path / "import_error.py"
    node.write_text(
        "import sys, time\ntime.sleep(0.3)\nsys.exit('ModuleNotFoundError: no_such_model')\n"
    )
    result = _run(_job(drive.bag, f"{sys.executable} {node}", startup_timeout_s=30))
    assert not result.passed
    assert result.exit_code == 1
    assert "no_such_model" in result.stderr_tail
    assert result.wall_s < 4


class _Verdict:
    """A user evaluator whose verdict's ``passed`` is ``value`` (NumPy's bool, a string)."""

    truth_topics: tuple[str, ...] = ()

    def __init__(self, kind: str) -> None:
        self.name = f"verdict_{kind}"
        self.kind = kind

    def evaluate(self, data: ScenarioData) -> Evaluation:
        count = np.float64(len(data.outputs))
        passed = count >= 1 if self.kind == "numpy" else "no"
        return Evaluation(self.name, passed, {"count": count})  # type: ignore[arg-type]


def test_a_verdict_passed_must_be_a_bool(
    drive: DriveResult, bad_nodes: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``count >= limit`` of a NumPy number is a NumPy bool, which ``json.dumps`` refused:
    the task, and so the job, failed; a string ``"no"`` passed the scenario."""
    monkeypatch.setitem(EVALUATORS, "verdict", _Verdict)
    job = replace(
        _job(drive.bag, bad_nodes["relay_pose"] + " /lidar/points"),
        output_topics=("/estimate",),
        evaluators=(
            EvaluatorSpec.of("verdict", kind="numpy"),
            EvaluatorSpec.of("verdict", kind="str"),
        ),
    ).validate()
    result = _run(job)
    verdicts = {e["name"]: e for e in result.evaluations}
    assert verdicts["verdict_numpy"]["passed"] is True
    assert not verdicts["verdict_str"]["passed"]
    assert verdicts["verdict_str"]["reason"] == (
        "cannot evaluate: its verdict's passed is str 'no', not a bool"
    )
    assert not result.passed
    assert json.loads(json.dumps(result.to_dict()))["evaluations"][0]["passed"] is True
