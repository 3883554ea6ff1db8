"""Perception replay: camera streams at their frame rate into a real-time detector, and how
many cameras of a rig a detector sustains."""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from rich.console import Console

from adcloud.sim import (
    CameraLoad,
    CameraSweep,
    NodeSpec,
    ReplayResults,
    ScenarioResult,
    SimError,
    camera_replay_job,
    camera_sweep,
    command,
    plan_scenarios,
    run_scenario,
)
from adcloud.sim.perception import check_sweep_target
from adcloud.synth import DriveConfig, DriveResult, generate_drive

CAMERAS = ["/camera/image_raw", "/camera/labels"]
NODE = f"{sys.executable} -m adcloud.sim.examples.camera_node"


@pytest.fixture(scope="module")
def camera_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """2 s with the camera on (5 Hz: 10 frames per stream), no LiDAR."""
    config = DriveConfig(seconds=2.0, seed=5, lidar=False, camera=True, truth_raster=False)
    return generate_drive(config, tmp_path_factory.mktemp("sim-camera") / "camera.bag")


def test_fast_detector_keeps_up(camera_drive: DriveResult) -> None:
    job = camera_replay_job([str(camera_drive.bag)], NodeSpec(NODE), CAMERAS, "/detections")
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert result.passed, result.reason
    assert result.metrics["frames.frames"] == 20
    assert result.metrics["frames.loss_rate"] == 0.0
    # Paced at the frame rate: 2 streams x 5 Hz.
    assert 7 <= result.metrics["frames.throughput_fps"] <= 13
    assert result.wall_s >= 1.8


def test_the_example_detector_answers_ros2_frames(tmp_path: Path) -> None:
    # an MCAP bag's images carry ROS 2 headers (no seq); the node writes ROS 1 detections
    config = DriveConfig(
        seconds=1.0, seed=5, lidar=False, camera=True, truth_raster=False, format="mcap"
    )
    drive = generate_drive(config, tmp_path / "camera")
    job = camera_replay_job([str(drive.bag)], NodeSpec(NODE), CAMERAS, "/detections", rate=4.0)
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert result.exit_code == 0, result.reason
    assert result.metrics["frames.answered"] > 0
    assert result.output_counts["/detections"] > 0


def test_slow_detector_drops_frames(camera_drive: DriveResult) -> None:
    job = camera_replay_job(
        [str(camera_drive.bag)],
        NodeSpec(NODE + " --work-ms 250"),
        CAMERAS,
        "/detections",
        max_loss=0.1,
    )
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert not result.passed
    assert "frame loss" in result.reason
    assert 0.3 < result.metrics["frames.loss_rate"] < 0.9
    assert result.metrics["frames.throughput_fps"] < 5


def test_a_crashed_detector_lost_every_frame(
    camera_drive: DriveResult, bad_nodes: dict[str, str]
) -> None:
    """A node that crashed gives no frame metrics: that is 100 % loss of the frames it was
    fed, not a load of 0 frames with a NaN (null in sweep.json) loss rate."""
    job = camera_replay_job(
        [str(camera_drive.bag)], NodeSpec(bad_nodes["crash"]), CAMERAS, "/detections"
    )
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert not result.passed and result.metrics == {}
    load = CameraLoad.of(ReplayResults(job, (result,), result.wall_s), CAMERAS)
    assert (load.frames, load.loss_rate, load.throughput_fps) == (20, 1.0, 0.0)
    assert not load.passed and "exit code 3" in load.reason
    written = CameraSweep((load,), max_loss=0.05, rate=1.0).to_dict()["loads"][0]
    assert (written["frames"], written["loss_rate"]) == (20, 1.0)


def test_a_camera_topic_without_frames_fails_its_load(camera_drive: DriveResult) -> None:
    """A misspelt camera topic (not in the bag) was replayed as no stream at all, and the
    load passed: a sweep said the detector sustained 2 cameras having fed it one."""
    topics = ["/camera/image_raw", "/camera9/image_raw"]
    job = camera_replay_job(
        [str(camera_drive.bag)], NodeSpec(NODE), topics, "/detections", rate=4.0
    )
    (scenario,) = plan_scenarios(list(job.bags))
    result = run_scenario(scenario, job)
    assert not result.passed
    # The detector may also drop frames of the real topic on a loaded machine ("; frame loss
    # 10.0% > 5.0%" follows then): the missing topic must be named either way.
    assert result.reason.split("; ")[0] == "frames: no frames on /camera9/image_raw"
    assert result.metrics["frames.frames"] == 10
    load = CameraLoad.of(ReplayResults(job, (result,), result.wall_s), topics)
    assert not load.passed and CameraSweep((load,), 0.05, 4.0).sustained == 0


@pytest.fixture(scope="module")
def rig_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """2 s of a three-camera rig at 5 Hz (10 frames per camera), no LiDAR."""
    config = DriveConfig(seconds=2.0, seed=5, lidar=False, cameras=3, truth_raster=False)
    return generate_drive(config, tmp_path_factory.mktemp("sim-rig") / "rig.bag")


RIG = ["/camera/image_raw", "/camera1/image_raw", "/camera2/image_raw"]


def test_a_sweep_finds_how_many_cameras_a_detector_sustains(
    spark: SparkSession, rig_drive: DriveResult, tmp_path: Path
) -> None:
    # 150 ms per frame: one camera at 5 Hz (a frame every 200 ms) fits, two do not.
    kept = []
    sweep = camera_sweep(
        spark,
        [str(rig_drive.bag)],
        NodeSpec(NODE + " --work-ms 150"),
        RIG,
        "/detections",
        on_load=lambda load, results: kept.append(results),
    )
    assert [lo.cameras for lo in sweep.loads] == [1, 2, 3]
    one, two, three = sweep.loads
    assert one.passed and one.loss_rate == 0.0 and one.frames == 10
    assert not two.passed and "frame loss" in two.reason
    assert (two.frames, three.frames) == (20, 30)
    assert 0.15 < two.loss_rate < three.loss_rate < 0.9
    assert sweep.sustained == 1
    url = sweep.write(str(tmp_path / "sweep"), kept)
    written = json.loads((tmp_path / "sweep/sweep.json").read_text())
    assert url.startswith("file://") and written["sustained"] == 1
    assert [lo["cameras"] for lo in written["loads"]] == [1, 2, 3]
    assert (tmp_path / "sweep/sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (tmp_path / "sweep/cameras-3/results.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["metrics"]["frames.frames"] == 30


def test_a_fast_detector_sustains_the_whole_rig(
    spark: SparkSession, rig_drive: DriveResult
) -> None:
    sweep = camera_sweep(
        spark, [str(rig_drive.bag)], NodeSpec(NODE), RIG, "/detections", counts=[3]
    )
    (load,) = sweep.loads
    assert load.passed, load.reason
    assert load.loss_rate == 0.0 and 11 <= load.throughput_fps <= 19  # 3 x 5 Hz
    assert sweep.sustained == 3


@pytest.mark.parametrize(
    ("topics", "counts", "words"),
    [
        (RIG, [0, 2], "camera counts must be in 1..3"),
        (RIG, [4], "camera counts must be in 1..3"),
        (RIG[:1] * 2, None, "distinct topics"),
    ],
)
def test_a_sweep_refuses_counts_it_cannot_replay(
    spark: SparkSession, topics: list[str], counts: list[int] | None, words: str
) -> None:
    with pytest.raises(SimError, match=words):
        camera_sweep(spark, ["unused.bag"], NodeSpec(NODE), topics, "/d", counts=counts)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adcloud")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def _sweep_of(counts: list[int], result: ScenarioResult) -> tuple[CameraSweep, list[ReplayResults]]:
    """A sweep over ``counts`` of :data:`RIG` whose every count gave ``result``."""
    kept = [
        ReplayResults(
            camera_replay_job(["rig.bag"], NodeSpec(NODE), RIG[:n], "/detections"), (result,), 0.1
        )
        for n in counts
    ]
    loads = [CameraLoad.of(res, RIG[:n]) for res, n in zip(kept, counts, strict=True)]
    return CameraSweep(tuple(loads), max_loss=0.05, rate=1.0), kept


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_sweep_report_replaces_the_earlier_one_whole_or_not_at_all(
    camera_drive: DriveResult,
    bad_nodes: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A smaller sweep left the bigger earlier sweep's cameras-3/ beside a sweep.json that
    did not list it; a sweep report that failed midway was left half-written."""
    job = camera_replay_job([str(camera_drive.bag)], NodeSpec(bad_nodes["crash"]), CAMERAS, "/d")
    result = run_scenario(plan_scenarios(list(job.bags))[0], job)
    rep = tmp_path / "rep"
    big, kept = _sweep_of([1, 2, 3], result)
    assert big.write(str(rep), kept) == rep.as_uri()
    assert sorted(p.name for p in rep.iterdir()) == [
        "cameras-1",
        "cameras-2",
        "cameras-3",
        "sweep.json",
        "sweep.png",
    ]
    earlier = _tree(rep)
    small, kept = _sweep_of([1, 2], result)

    def broken(self: CameraSweep) -> bytes:
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(CameraSweep, "plot", broken)
    with pytest.raises(RuntimeError, match="the plot failed"):
        small.write(str(rep), kept)
    assert _tree(rep) == earlier  # staged reports gone, nothing replaced
    monkeypatch.undo()
    small.write(str(rep), kept)
    assert sorted(p.name for p in rep.iterdir()) == [
        "cameras-1",
        "cameras-2",
        "sweep.json",
        "sweep.png",
    ]
    written = json.loads((rep / "sweep.json").read_text())
    assert [lo["cameras"] for lo in written["loads"]] == [1, 2]
    assert sorted(p.name for p in (rep / "cameras-2").iterdir()) == [
        "job.json",
        "junit.xml",
        "latency.png",
        "report.html",
        "results.jsonl",
    ]


@pytest.mark.parametrize(
    ("place", "says"),
    [
        ("notes.txt", r"rep holds files a camera sweep did not write \(e\.g\. notes\.txt\)"),
        (
            "cameras-2/notes.txt",
            r"rep/cameras-2 holds files a replay report did not write \(e\.g\. notes\.txt\)",
        ),
        ("cameras-3", r"rep/cameras-3 is a file, not a directory a replay report can write"),
        ("", r"rep is a file, not a directory a camera sweep can write into"),
    ],
)
def test_the_cameras_command_checks_its_whole_report_target_before_spark_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, place: str, says: str
) -> None:
    """Only cameras-1 was checked: a cameras-2 of foreign files was found once the whole
    sweep had run (and its results were lost); foreign files beside sweep.json went
    unnoticed."""
    rep = tmp_path / "rep"
    target = rep / place if place else rep
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("mine")

    def no_spark(master: str | None) -> None:
        raise AssertionError("Spark started for a sweep whose report would be refused")

    monkeypatch.setattr(command, "_session", no_spark)
    argv = ["sim", "cameras", "b.bag", "--node", "n", "--cameras", ",".join(RIG)]
    args = _parse([*argv, "--report", str(rep)])
    with pytest.raises(SimError, match=says):
        args.func(args, Console(file=io.StringIO()))
    with pytest.raises(SimError, match=says):
        check_sweep_target(str(rep))
    assert target.read_text() == "mine"


def test_the_cameras_command_prints_the_sweep_and_holds_the_required_count(
    spark: SparkSession,
    rig_drive: DriveResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(command, "_session", lambda master: spark)
    argv = ["sim", "cameras", str(rig_drive.bag), "--node", NODE + " --work-ms 150"]
    argv += ["--cameras", ",".join(RIG), "--counts", "1,2", "--report", str(tmp_path / "rep")]
    args = _parse([*argv, "--require", "2"])
    out = io.StringIO()
    assert args.func(args, Console(file=out, width=200)) == 1
    text = out.getvalue()
    assert "the detector sustains 1 of 3 camera(s)" in text
    assert "FAIL" in text and "pass" in text
    assert json.loads((tmp_path / "rep/sweep.json").read_text())["sustained"] == 1
    assert (tmp_path / "rep/cameras-2/junit.xml").exists()


def test_the_cameras_command_refuses_counts_that_are_not_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parse(["sim", "cameras", "b.bag", "--node", "n", "--cameras", "/a", "--counts", "1,x"])
    assert "--counts takes comma-separated whole numbers, not '1,x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--max-loss", "nan"], "evaluator frames: max_loss must be a finite number"),
        (["--max-loss", "-1"], "evaluator frames: max_loss must be a finite number >= 0"),
        (["--max-latency-ms", "nan"], "evaluator latency: max_ms must be a finite number"),
    ],
)
def test_the_cameras_command_checks_its_limits_before_spark_starts(
    monkeypatch: pytest.MonkeyPatch, option: list[str], says: str
) -> None:
    """A NaN --max-loss passed every camera count; now it is refused before any job."""

    def no_spark(master: str | None) -> None:
        raise AssertionError("Spark started for a sweep whose limits are wrong")

    monkeypatch.setattr(command, "_session", no_spark)
    args = _parse(["sim", "cameras", "b.bag", "--node", "n", "--cameras", "/a", *option])
    with pytest.raises(SimError, match=re.escape(says)):
        args.func(args, Console(file=io.StringIO()))
