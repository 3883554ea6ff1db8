"""Perception replay: two camera streams at their frame rate into a real-time detector."""

from __future__ import annotations

import sys

import pytest

from adcloud.sim import NodeSpec, camera_replay_job, plan_scenarios, run_scenario
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
