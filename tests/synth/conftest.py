"""Synthetic drives shared by the synth tests (session scope, a few seconds each)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rosbags.highlevel import AnyReader

from adcloud.synth import DriveConfig, DriveResult, World, build_world, generate_drive

#: The small drive most tests read: 4 s, 16 beams, every sensor, a GPS outage inside.
SMALL = DriveConfig(seconds=4.0, seed=7, lidar_beams=16, gps_hz=10, gps_outage=(1.5, 1.0))


@pytest.fixture(scope="session")
def world() -> World:
    """The world of seed 7."""
    return build_world(7)


@pytest.fixture(scope="session")
def small_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """:data:`SMALL` written as a ROS 1 bag."""
    return generate_drive(SMALL, tmp_path_factory.mktemp("small") / "drive.bag")


@pytest.fixture(scope="session")
def quiet_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """6 s without any sensor noise, bias or scale error (no LiDAR, no camera)."""
    config = DriveConfig(
        seconds=6.0,
        seed=11,
        lidar=False,
        camera=False,
        truth_raster=False,
        imu_accel_noise=0,
        imu_gyro_noise=0,
        imu_accel_bias=0,
        imu_gyro_bias=0,
        imu_accel_bias_walk=0,
        imu_gyro_bias_walk=0,
        odom_speed_noise=0,
        odom_yaw_rate_noise=0,
        odom_scale_error=0,
        odom_scale_drift=0,
        gps_noise_m=0,
        gps_bias_m=0,
    )
    return generate_drive(config, tmp_path_factory.mktemp("quiet") / "quiet.bag")


@pytest.fixture(scope="session")
def gps_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """40 s of 10 Hz GPS with white noise only (no bias), an outage from 10 to 15 s."""
    config = DriveConfig(
        seconds=40.0,
        seed=3,
        lidar=False,
        camera=False,
        truth_raster=False,
        gps_hz=10,
        gps_noise_m=1.5,
        gps_bias_m=0.0,
        gps_outage=(10.0, 5.0),
    )
    return generate_drive(config, tmp_path_factory.mktemp("gps") / "gps.bag")


Messages = list[tuple[str, int, Any]]


def _read_messages(bag: Path, topics: list[str] | None = None) -> Messages:
    out = []
    with AnyReader([Path(bag)]) as reader:
        conns = [c for c in reader.connections if topics is None or c.topic in topics]
        for conn, t, raw in reader.messages(connections=conns):
            out.append((conn.topic, t, reader.deserialize(raw, conn.msgtype)))
    return out


@pytest.fixture(scope="session")
def read_bag() -> Callable[..., Messages]:
    """``read_bag(bag, topics=None)``: ``(topic, record time ns, decoded message)`` in bag order."""
    return _read_messages
