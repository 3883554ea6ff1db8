"""Evaluators on hand-made scenario data, and the registry."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from adcloud.binpipe import Message, MessageDecoder
from adcloud.binpipe.decode import ConnectionInfo, standard_typestore
from adcloud.sim import (
    EVALUATORS,
    Evaluation,
    EvaluatorSpec,
    Scenario,
    ScenarioData,
    SimError,
    build_evaluator,
    parse_evaluator,
    plan_scenarios,
    register_evaluator,
)
from adcloud.sim.examples.obstacle_node import detect, ros1_header
from adcloud.sim.replay import _read_messages
from adcloud.synth import DriveResult

from .conftest import CountAtLeast

_NS = 1_000_000_000


def _data(stamps: list[int], latencies: list[float]) -> ScenarioData:
    scenario = Scenario("s", "x.bag", 0, 2 * _NS, 0)
    outputs = [Message("/out", t, "std_msgs/msg/Empty", b"") for t in stamps]
    return ScenarioData(scenario, [], outputs, latencies, MessageDecoder())


def test_rate() -> None:
    data = _data([k * _NS // 10 for k in range(20)], [1.0] * 20)  # 10 Hz over 2 s
    ok = build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=9.5)).evaluate(data)
    assert ok.passed
    assert ok.metrics["rate_hz[/out]"] == pytest.approx(10.0)
    slow = build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=12)).evaluate(data)
    assert not slow.passed
    assert "10.00 Hz < 12 Hz" in slow.reason


def test_rate_ignores_outputs_outside_the_range() -> None:
    data = _data([-_NS, 3 * _NS], [1.0, 1.0])
    result = build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=0.1)).evaluate(data)
    assert not result.passed


def test_latency() -> None:
    data = _data([0, 1, 2, 3], [math.nan, 5.0, 10.0, 80.0])
    spec = EvaluatorSpec.of("latency", max_ms=50)
    result = build_evaluator(spec).evaluate(data)
    assert not result.passed
    assert result.metrics["latency_max_ms"] == pytest.approx(80.0)
    p50 = build_evaluator(EvaluatorSpec.of("latency", max_ms=50, stat="p50")).evaluate(data)
    assert p50.passed
    empty = build_evaluator(spec).evaluate(_data([], []))
    assert not empty.passed


def test_parse_evaluator() -> None:
    spec = parse_evaluator("rate:topic=/obstacles,min_hz=8")
    assert spec == EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8)
    assert parse_evaluator("detections") == EvaluatorSpec("detections")
    with pytest.raises(SimError, match="key=value"):
        parse_evaluator("rate:topic")


def test_unknown_evaluator_and_bad_params() -> None:
    with pytest.raises(SimError, match="known: "):
        build_evaluator(EvaluatorSpec("nope"))
    with pytest.raises(SimError, match=r"'rate': unknown parameter\(s\) min_hzz; it takes topic, "):
        build_evaluator(EvaluatorSpec.of("rate", topic="/x", min_hzz=1))
    with pytest.raises(SimError, match=r"rate: min_hz must be a finite number >= 0, not 'fast'"):
        build_evaluator(EvaluatorSpec.of("rate", topic="/x", min_hz="fast"))
    with pytest.raises(SimError, match="stat"):
        build_evaluator(EvaluatorSpec.of("latency", max_ms=1, stat="p42"))


@pytest.mark.parametrize(
    ("name", "params", "says"),
    [
        ("frames", {"inputs": "/c", "max_loss": math.nan}, "max_loss must be a finite number"),
        (
            "frames",
            {"inputs": "/c", "max_loss": -1},
            "max_loss must be a finite number >= 0 and <= 1, not -1",
        ),
        ("frames", {"inputs": "/c", "min_fps": math.inf}, "min_fps must be a finite number"),
        ("latency", {"max_ms": math.nan}, "max_ms must be a finite number > 0"),
        ("rate", {"topic": "/x", "min_hz": math.nan}, "min_hz must be a finite number >= 0"),
        ("detections", {"min_recall": 1.5}, "min_recall must be a finite number >= 0 and <= 1"),
        ("detections", {"min_points": 2.5}, "min_points must be a whole number, not 2.5"),
        ("detections", {"classes": ""}, "classes must be label numbers joined by '+'"),
        ("detections", {"classes": "7+car"}, "classes must be label numbers joined by '+'"),
        ("pose_error", {"topic": "/x", "max_m": 0}, "max_m must be a finite number > 0, not 0"),
    ],
)
def test_limits_that_would_pass_or_fail_everything_are_refused(
    name: str, params: dict[str, object], says: str
) -> None:
    """``loss > nan`` is never true: a NaN limit passed every camera count."""
    with pytest.raises(SimError, match=f"evaluator {name}: {re.escape(says)}"):
        build_evaluator(EvaluatorSpec.of(name, **params))


def test_user_evaluator_registration() -> None:
    register_evaluator("count_at_least", CountAtLeast)
    try:
        result = build_evaluator(EvaluatorSpec.of("count_at_least", n=2)).evaluate(_data([0], [1]))
        assert not result.passed
        assert result.metrics == {"count": 1.0}
    finally:
        del EVALUATORS["count_at_least"]


def test_evaluator_by_import_path() -> None:
    spec = parse_evaluator("adcloud.sim.evaluators:RateEvaluator:topic=/out,min_hz=9.5")
    assert spec == EvaluatorSpec.of(
        "adcloud.sim.evaluators:RateEvaluator", topic="/out", min_hz=9.5
    )
    assert parse_evaluator("adcloud.sim.evaluators:RateEvaluator").params == ()
    data = _data([k * _NS // 10 for k in range(20)], [1.0] * 20)
    assert build_evaluator(spec).evaluate(data).passed
    with pytest.raises(SimError, match="cannot import no_such_module"):
        build_evaluator(EvaluatorSpec("no_such_module.x:Y"))
    with pytest.raises(SimError, match="has no attribute 'Nope'"):
        build_evaluator(EvaluatorSpec("adcloud.sim.evaluators:Nope"))
    with pytest.raises(SimError, match="not a factory"):
        build_evaluator(EvaluatorSpec("adcloud.sim.evaluators:EVALUATORS"))


def test_detections_name_an_output_of_another_type() -> None:
    """A node echoing its clouds where detections belong: the evaluator says which topic
    carries which type, before decoding anything (no ``AttributeError`` from a field the
    type lacks)."""
    data = _data([0], [1.0])
    data.outputs = [Message("/obstacles", 0, "sensor_msgs/msg/PointCloud2", b"")]
    evaluator = build_evaluator(EvaluatorSpec.of("detections", topic="/obstacles"))
    with pytest.raises(
        SimError,
        match=r"^/obstacles carries sensor_msgs/msg/PointCloud2, not geometry_msgs/msg/PoseArray$",
    ):
        evaluator.evaluate(data)
    data.outputs = []
    data.messages = [Message("/lidar/points", 0, "sensor_msgs/msg/Image", b"")]
    with pytest.raises(SimError, match=r"/lidar/points carries sensor_msgs/msg/Image, not sensor"):
        evaluator.evaluate(data)


def test_pose_error_names_an_output_or_truth_of_another_type() -> None:
    data = _data([0], [1.0])
    data.outputs = [Message("/estimate", 0, "sensor_msgs/msg/PointCloud2", b"")]
    data.messages = [Message("/truth", t, "nav_msgs/msg/Odometry", b"") for t in (0, _NS)]
    evaluator = build_evaluator(
        EvaluatorSpec.of("pose_error", topic="/estimate", truth_topic="/truth")
    )
    with pytest.raises(
        SimError,
        match=r"/estimate carries sensor_msgs/msg/PointCloud2, not nav_msgs/msg/Odometry or "
        r"geometry_msgs/msg/PoseStamped or geometry_msgs/msg/PoseWithCovarianceStamped$",
    ):
        evaluator.evaluate(data)
    data.outputs = []
    data.messages = [Message("/truth", t, "sensor_msgs/Imu", b"") for t in (0, _NS)]
    with pytest.raises(
        SimError, match=r"^/truth carries sensor_msgs/Imu, not nav_msgs/msg/Odometry"
    ):
        evaluator.evaluate(data)


def _pose(topic: str, stamp: int, x: float) -> Message:
    store = standard_typestore("ros1")
    t = store.types
    msg = t["geometry_msgs/msg/PoseStamped"](
        header=t["std_msgs/msg/Header"](
            seq=0, stamp=t["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id="map"
        ),
        pose=t["geometry_msgs/msg/Pose"](
            position=t["geometry_msgs/msg/Point"](x=x, y=0.0, z=0.0),
            orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
        ),
    )
    data = bytes(store.serialize_ros1(msg, "geometry_msgs/msg/PoseStamped"))
    return Message(topic, stamp, "geometry_msgs/msg/PoseStamped", data)


@pytest.mark.parametrize("order", [(1.0, math.nan), (math.nan, 1.0)])
def test_pose_error_fails_a_nan_pose_wherever_it_falls(order: tuple[float, float]) -> None:
    # truth moves from x=0 to x=2 over 2 s; the estimate at 0.5 s and 1 s, one NaN (a
    # diverged filter): max() kept the first of a NaN and a number
    truth = [_pose("/truth", 0, 0.0), _pose("/truth", 2 * _NS, 2.0)]
    outputs = [_pose("/est", _NS // 2, order[0] / 2), _pose("/est", _NS, order[1])]
    conns = [
        ConnectionInfo(topic, "geometry_msgs/msg/PoseStamped", "", "", "", "ros1")
        for topic in ("/truth", "/est")
    ]
    data = ScenarioData(
        Scenario("s", "x.bag", 0, 2 * _NS, 0), truth, outputs, [1.0, 1.0], MessageDecoder(conns)
    )
    spec = EvaluatorSpec.of("pose_error", topic="/est", truth_topic="/truth", max_m=0.5)
    result = build_evaluator(spec).evaluate(data)
    assert not result.passed
    assert math.isnan(result.metrics["max_m"])
    assert result.reason == "1 of 2 poses on /est have no finite error (a NaN or infinite position)"


def test_pose_error_leaves_out_the_poses_outside_the_truths_span() -> None:
    """The truth spans 0-2 s (x from 0 to 2 m); an estimate at 3 s, right where the
    vehicle was by then (x = 3), was compared with the last truth pose (x = 2): 1 m of
    "error" the estimate did not make. Outside the span there is no truth to compare with."""
    truth = [_pose("/truth", 0, 0.0), _pose("/truth", 2 * _NS, 2.0)]
    conns = [
        ConnectionInfo(topic, "geometry_msgs/msg/PoseStamped", "", "", "", "ros1")
        for topic in ("/truth", "/est")
    ]
    spec = EvaluatorSpec.of("pose_error", topic="/est", truth_topic="/truth", max_m=0.5)

    def evaluate(outputs: list[Message]) -> Evaluation:
        data = ScenarioData(
            Scenario("s", "x.bag", 0, 4 * _NS, 0), truth, outputs, [1.0], MessageDecoder(conns)
        )
        return build_evaluator(spec).evaluate(data)

    result = evaluate([_pose("/est", _NS, 1.1), _pose("/est", 3 * _NS, 3.0)])
    assert result.passed, result.reason
    assert result.metrics["max_m"] == pytest.approx(0.1)
    assert result.metrics["outside_truth"] == 1.0
    after = evaluate([_pose("/est", 3 * _NS, 3.0)])
    assert not after.passed
    assert after.reason == (
        "none of the 1 poses on /est lies within the truth's span on /truth: nothing to "
        "compare them with"
    )
    edges = evaluate([_pose("/est", 0, 0.0), _pose("/est", 2 * _NS, 2.0)])
    assert edges.passed and "outside_truth" not in edges.metrics


def test_a_nan_detection_does_not_hide_the_others(drive: DriveResult) -> None:
    # the example detector's exact answers, each with one NaN pose more: a false positive
    # per cloud, as a detection far away is -- not a frame where nothing matches
    store = standard_typestore("ros1")
    t = store.types
    (scenario,) = plan_scenarios(str(drive.bag))
    clouds, conns = _read_messages(scenario, ["/lidar/points"])
    clouds = clouds[:5]
    decoder = MessageDecoder(
        [*conns, ConnectionInfo("/obstacles", "geometry_msgs/msg/PoseArray", "", "", "", "ros1")]
    )
    outputs = []
    for msg in clouds:
        cloud = decoder.decode(msg)
        found = [*map(tuple, detect(cloud)), (math.nan, math.nan, 0.0)]
        poses = [
            t["geometry_msgs/msg/Pose"](
                position=t["geometry_msgs/msg/Point"](x=float(x), y=float(y), z=float(z)),
                orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
            )
            for x, y, z in found
        ]
        out = t["geometry_msgs/msg/PoseArray"](header=ros1_header(cloud.header, t), poses=poses)
        data = bytes(store.serialize_ros1(out, "geometry_msgs/msg/PoseArray"))
        outputs.append(Message("/obstacles", msg.timestamp, "geometry_msgs/msg/PoseArray", data))
    data = ScenarioData(scenario, clouds, outputs, [1.0] * len(outputs), decoder)
    result = build_evaluator(EvaluatorSpec.of("detections")).evaluate(data)
    truth = result.metrics["truth_objects"]
    assert truth > 5
    assert result.metrics["recall"] == 1.0
    assert result.metrics["detected_objects"] == truth + 5
    assert result.metrics["precision"] == pytest.approx(truth / (truth + 5))


def test_an_evaluator_in_a_top_level_module_is_named_on_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--eval my_evals:AtLeast`` (a module of its own on the PYTHONPATH) was refused:
    "expected name:key=value,key=value"."""
    (tmp_path / "my_evals.py").write_text(
        "from adcloud.sim import Evaluation\n"
        "class AtLeast:\n"
        "    name, truth_topics = 'at_least', ()\n"
        "    def __init__(self, n=1):\n"
        "        self.n = n\n"
        "    def evaluate(self, data):\n"
        "        return Evaluation(self.name, len(data.outputs) >= self.n)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert parse_evaluator("my_evals:AtLeast") == EvaluatorSpec("my_evals:AtLeast")
    spec = parse_evaluator("my_evals:AtLeast:n=2")
    assert spec == EvaluatorSpec.of("my_evals:AtLeast", n=2)
    assert build_evaluator(spec).evaluate(_data([0, 1], [1.0, 1.0])).passed
    # a registered name with a parameter list lacking "=" stays a bad parameter list
    with pytest.raises(SimError, match="expected name:key=value"):
        parse_evaluator("rate:topic")


class _NoTruthTopics:
    name = "no_truth"

    def evaluate(self, data: ScenarioData) -> Evaluation:
        return Evaluation(self.name, True)


def _not_an_evaluator() -> int:
    return 5


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        (_NoTruthTopics, "made a _NoTruthTopics with truth_topics None is no tuple of topic"),
        (_not_an_evaluator, "made a int with no name (a str); truth_topics None is no tuple"),
    ],
)
def test_what_a_factory_makes_is_checked_when_it_is_built(
    factory: object, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An evaluator without ``truth_topics`` passed the job's validation and failed every
    Spark task (and so the job) with an AttributeError traceback."""
    monkeypatch.setitem(EVALUATORS, "odd", factory)
    with pytest.raises(SimError, match=re.escape(f"evaluator 'odd' {says}")):
        build_evaluator(EvaluatorSpec("odd"))


def test_rate_over_a_range_of_one_message_is_not_a_rate() -> None:
    """A bag of one cloud is a scenario of 1 ns: its one output was a rate of 1e9 Hz,
    passing any ``min_hz``."""
    one = ScenarioData(
        Scenario("s", "x.bag", 0, 1, 0),
        [],
        [Message("/out", 0, "std_msgs/msg/Empty", b"")],
        [math.nan],
        MessageDecoder(),
    )
    result = build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=8)).evaluate(one)
    assert not result.passed
    assert result.metrics == {}
    assert result.reason == (
        "the evaluated range (1e-09 s) is shorter than one period at 8 Hz: too short to "
        "measure a rate on /out"
    )
    # one period is enough: 1 output in 0.125 s is 8 Hz
    short = replace(one, scenario=Scenario("s", "x.bag", 0, _NS // 8, 0))
    ok = build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=8)).evaluate(short)
    assert ok.passed
    assert ok.metrics["rate_hz[/out]"] == pytest.approx(8.0)


def _fed(count: int, answered: list[int], end: int, period: int = _NS // 10) -> ScenarioData:
    """``count`` inputs on /in every ``period`` from 0, the outputs answering ``answered``
    of them, over the range ``[0, end)``."""
    inputs = [Message("/in", k * period, "std_msgs/msg/Empty", b"") for k in range(count)]
    outputs = [Message("/out", k * period, "std_msgs/msg/Empty", b"") for k in answered]
    return ScenarioData(
        Scenario("s", "x.bag", 0, end, 0),
        inputs,
        outputs,
        [1.0] * len(outputs),
        MessageDecoder(),
        input_topics=("/in",),
    )


def _hz(data: ScenarioData, min_hz: float = 10) -> Evaluation:
    return build_evaluator(EvaluatorSpec.of("rate", topic="/out", min_hz=min_hz)).evaluate(data)


def test_rate_of_a_whole_bag_counts_the_period_after_its_last_message() -> None:
    """A whole bag's range ends 1 ns after its last message: 5 inputs at 10 Hz span 0.4 s,
    so a node answering each measured 12.5 Hz, and one that dropped a frame 10 Hz, passing
    ``min_hz=10``."""
    whole_bag = 4 * _NS // 10 + 1
    every = _hz(_fed(5, [0, 1, 2, 3, 4], whole_bag))
    assert every.passed, every.reason
    assert every.metrics["rate_hz[/out]"] == pytest.approx(10.0)
    dropped = _hz(_fed(5, [0, 1, 3, 4], whole_bag), min_hz=9)
    assert not dropped.passed
    assert dropped.metrics["rate_hz[/out]"] == pytest.approx(8.0)
    assert dropped.reason == "/out at 8.00 Hz < 9 Hz"


def test_rate_is_the_same_in_a_window_and_counts_a_node_that_stops() -> None:
    # a window [0, 1 s) of a longer bag holds 10 inputs: 10 Hz, as over the whole bag
    assert _hz(_fed(10, list(range(10)), _NS)).metrics["rate_hz[/out]"] == pytest.approx(10.0)
    # inputs that stop (a sensor that dies) leave only the time they were fed
    assert _hz(_fed(3, [0, 1, 2], _NS)).metrics["rate_hz[/out]"] == pytest.approx(10.0)
    # a node that stops answering half-way is at half the rate
    half = _hz(_fed(10, [0, 1, 2, 3, 4], _NS))
    assert not half.passed
    assert half.metrics["rate_hz[/out]"] == pytest.approx(5.0)


def test_rate_period_comes_from_the_warm_up_and_ignores_truth_topics() -> None:
    """One input in the range (a short window) takes its period from the warm-up inputs;
    truth topics fed to evaluators, not the node, do not stretch the time."""
    inputs = [Message("/in", k * _NS // 10, "std_msgs/msg/Empty", b"") for k in range(5)]
    truth = [Message("/truth", k * _NS // 100, "std_msgs/msg/Empty", b"") for k in range(60)]
    data = ScenarioData(
        Scenario("s", "x.bag", 4 * _NS // 10, 4 * _NS // 10 + 1, 0),
        sorted([*inputs, *truth], key=lambda m: m.timestamp),
        [Message("/out", 4 * _NS // 10, "std_msgs/msg/Empty", b"")],
        [1.0],
        MessageDecoder(),
        input_topics=("/in",),
    )
    result = _hz(data)
    assert result.passed, result.reason
    assert result.metrics["rate_hz[/out]"] == pytest.approx(10.0)


def test_latency_of_only_the_start_up_output_says_so() -> None:
    """One frame: the only output is the first, whose latency is the start-up; "no output
    to measure latency on" sent the user looking for a silent node."""
    result = build_evaluator(EvaluatorSpec.of("latency", max_ms=100)).evaluate(
        _data([_NS], [math.nan])
    )
    assert not result.passed
    assert result.reason.startswith("no latency to measure on the 1 output(s): the first")
    assert "start-up" in result.reason


def test_detections_without_any_truth_cloud_fail() -> None:
    """No cloud on ``cloud_topic`` (misspelt, or not in the bag) is no truth at all: a
    node that detected nothing passed with precision and recall 1."""
    data = _data([], [])
    spec = EvaluatorSpec.of("detections", topic="/obstacles", cloud_topic="/lidar/pointz")
    result = build_evaluator(spec).evaluate(data)
    assert not result.passed
    assert result.reason.startswith(
        "no clouds on /lidar/pointz in the scenario: no truth to judge the detections on "
        "/obstacles against"
    )
    assert result.metrics == {"truth_objects": 0.0, "detected_objects": 0.0}
