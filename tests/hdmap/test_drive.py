"""Reading a drive's streams from a bag into arrays (adcloud.hdmap.drive)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adcloud.binpipe import read_messages
from adcloud.geodesy import geodetic_to_enu
from adcloud.hdmap.drive import DriveAccumulator, DriveTopics, read_drive
from adcloud.hdmap.errors import DriveDataError
from adcloud.synth import DriveConfig, generate_drive

CONFIG = DriveConfig(seconds=3, seed=3, lidar_beams=16, lidar_columns=256, camera=False)


@pytest.fixture(scope="module")
def bag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_drive(CONFIG, tmp_path_factory.mktemp("drive") / "short.bag").bag


def test_read_drive_gives_every_stream(bag: Path) -> None:
    drive = read_drive(str(bag))
    assert drive.name == "short"
    assert len(drive.scans) == 29  # sweeps stamped at k/10 s, k >= 1, inside 3 s
    assert drive.imu.t.shape == (300,) and drive.odom.t.shape == (150,)
    assert np.all(np.diff(drive.imu.t) > 0)
    scan = drive.scans[0]
    assert scan.frame == "lidar" and scan.label is not None
    assert scan.xyz.dtype == np.float32 and len(scan) > 1000
    assert float(scan.dt.min()) == pytest.approx(-0.1) and float(scan.dt.max()) < 0
    np.testing.assert_allclose(drive.extrinsics.get("lidar")[:3, 3], [1.2, 0, 1.9], atol=1e-9)
    np.testing.assert_allclose(drive.extrinsics.get("gps")[:3, 3], [0, 0, 1.75], atol=1e-9)
    # GPS in ENU about the first fix, sigma from the covariance
    assert np.allclose(drive.gps.enu[0], 0)
    assert np.allclose(drive.gps.sigma[:, 0], 1.118, atol=1e-3)


def test_origin_given_is_used(bag: Path) -> None:
    origin = (37.3875, -122.0575, 12.0)
    drive = read_drive(str(bag), origin=origin, with_scans=False)
    assert drive.scans == [] and drive.origin == origin
    fix = next(d for m, d in read_messages(str(bag), topics=["/gps/fix"]))
    enu = geodetic_to_enu(
        np.array([fix.latitude]), np.array([fix.longitude]), np.array([fix.altitude]), origin
    )
    np.testing.assert_allclose(drive.gps.enu[0], enu[0], atol=1e-6)


def test_wrong_message_type_names_topic_and_type(bag: Path) -> None:
    topics = DriveTopics(odom="/imu/data", imu="/odom")
    with pytest.raises(
        DriveDataError, match=r"topic /imu/data carries sensor_msgs/msg/Imu, but the odom topic"
    ):
        read_drive(str(bag), topics=topics, with_scans=False)


def test_missing_streams_are_reported(bag: Path) -> None:
    acc = DriveAccumulator("empty")
    with pytest.raises(DriveDataError, match="wheel-odometry"):
        acc.finish()
    with pytest.raises(DriveDataError, match="no sensor mounts"):
        read_drive(str(bag), topics=DriveTopics(tf_static="/nothing"), with_scans=False)
