"""Reading a drive's streams from a bag into arrays (adcloud.hdmap.drive)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from adcloud.binpipe import read_messages
from adcloud.geodesy import geodetic_to_enu
from adcloud.hdmap.config import parse_mounts
from adcloud.hdmap.drive import DriveAccumulator, DriveTopics, check_topics, read_drive
from adcloud.hdmap.errors import DriveDataError
from adcloud.synth import DriveConfig, generate_drive
from tests.hdmap.bagedit import without_fix

CONFIG = DriveConfig(
    seconds=3, seed=3, lidar_beams=16, lidar_columns=256, camera=False, truth_raster=False
)


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


def test_check_topics_reads_the_index_and_names_what_to_set(
    bag: Path, shared_data: Path, tmp_path: Path
) -> None:
    check_topics(str(bag), DriveTopics(), origin_known=False, mounts_known=False)
    # every problem at once, each with the setting and the bag's topics of the right type
    wrong = DriveTopics(lidar="/velodyne_points", odom="/imu/data", gps="/fix")
    with pytest.raises(DriveDataError) as err:
        check_topics(str(bag), wrong, origin_known=False, mounts_known=True)
    text = str(err.value)
    assert text.startswith(f"drive {bag} cannot be mapped: 0 LiDAR sweeps on /velodyne_points")
    assert "hdmap.lidar_topic or ADCLOUD_HDMAP_LIDAR_TOPIC; its " in text
    assert "sensor_msgs/msg/PointCloud2 topics: /lidar/points" in text
    assert "/imu/data carries sensor_msgs/msg/Imu, not nav_msgs/msg/Odometry" in text
    assert "0 GPS fixes on /fix" in text and "give the map origin" in text
    assert "static transforms" not in text  # the mounts are configured
    # without GPS the origin must be known; without /tf_static the mounts
    no_gps = DriveTopics(gps="/none", tf_static="/none")
    check_topics(str(bag), no_gps, origin_known=True, mounts_known=True)
    with pytest.raises(DriveDataError, match=r"0 static transforms on /none .*hdmap\.mounts"):
        check_topics(str(bag), no_gps, origin_known=True, mounts_known=False)
    # a real recording of another robot: its odometry and GPS are found for the user
    husky = shared_data / "02_husky_gps_imu_odom_ros1" / "robot_localization_test1.bag"
    with pytest.raises(DriveDataError) as err:
        check_topics(str(husky), DriveTopics(), origin_known=False, mounts_known=False)
    text = str(err.value)
    assert "nav_msgs/msg/Odometry topics: /husky_velocity_controller/odom" in text
    assert "sensor_msgs/msg/NavSatFix topics: /fix" in text
    assert "it has no sensor_msgs/msg/PointCloud2 topic" in text
    assert "IMU" not in text  # /imu/data is there
    garbage = tmp_path / "garbage.bag"
    garbage.write_bytes(b"not a bag at all" * 64)
    with pytest.raises(DriveDataError, match=r"drive .*garbage\.bag: "):
        check_topics(str(garbage), DriveTopics(), origin_known=False, mounts_known=False)
    # a recording cut off: the index is missing (index_pos 0) or points past the end
    data = bag.read_bytes()
    at = data.index(b"index_pos=") + 10
    unindexed = tmp_path / "unindexed.bag"
    unindexed.write_bytes(data[:at] + bytes(8) + data[at + 8 :])
    with pytest.raises(DriveDataError, match=r"unindexed\.bag: the bag has no index .*reindex"):
        check_topics(str(unindexed), DriveTopics(), origin_known=False, mounts_known=False)
    cut = tmp_path / "cut.bag"
    cut.write_bytes(data[: len(data) // 2])
    cut_off = r"cut\.bag: .*before its index .* still being copied, or was cut off"
    with pytest.raises(DriveDataError, match=cut_off):
        check_topics(str(cut), DriveTopics(), origin_known=False, mounts_known=False)


def _header(t_ns: int, frame: str = "") -> SimpleNamespace:
    stamp = SimpleNamespace(sec=t_ns // 1_000_000_000, nanosec=t_ns % 1_000_000_000)
    return SimpleNamespace(stamp=stamp, frame_id=frame)


def _feed_streams(acc: DriveAccumulator) -> None:
    """Two IMU and two odometry messages: the least :meth:`DriveAccumulator.finish` takes."""
    for k in range(2):
        t = 1_000_000_000 + k * 10_000_000
        vec = SimpleNamespace(x=0.0, y=0.0, z=0.0)
        imu = SimpleNamespace(
            header=_header(t, "imu_link"), linear_acceleration=vec, angular_velocity=vec
        )
        acc.add("/imu/data", "sensor_msgs/msg/Imu", imu)
        twist = SimpleNamespace(linear=SimpleNamespace(x=5.0), angular=SimpleNamespace(z=0.0))
        odom = SimpleNamespace(header=_header(t), twist=SimpleNamespace(twist=twist))
        acc.add("/odom", "nav_msgs/msg/Odometry", odom)


def _tf_static(child: str, parent: str, xyz: tuple[float, float, float]) -> SimpleNamespace:
    transform = SimpleNamespace(
        translation=SimpleNamespace(x=xyz[0], y=xyz[1], z=xyz[2]),
        rotation=SimpleNamespace(x=0.0, y=0.0, z=0.0, w=1.0),
    )
    edge = SimpleNamespace(child_frame_id=child, header=_header(0, parent), transform=transform)
    return SimpleNamespace(transforms=[edge])


def test_configured_mounts_stand_in_for_tf_static() -> None:
    mounts = parse_mounts(["lidar=1.2,0,1.9,0,0,90", "gps=0,0,1.75,0,0,0"])
    acc = DriveAccumulator("no_tf", origin=(37.0, -122.0, 0.0), mounts=mounts)
    _feed_streams(acc)
    drive = acc.finish()
    assert sorted(drive.extrinsics.frames) == ["gps", "lidar"]
    np.testing.assert_allclose(drive.extrinsics.get("lidar"), mounts["lidar"])
    np.testing.assert_allclose(drive.extrinsics.get("gps")[:3, 3], [0, 0, 1.75])
    bare = DriveAccumulator("no_tf", origin=(37.0, -122.0, 0.0))
    _feed_streams(bare)
    with pytest.raises(DriveDataError, match=r"hdmap\.mounts, env ADCLOUD_HDMAP_MOUNTS"):
        bare.finish()


def test_configured_mount_overrides_the_recorded_one() -> None:
    mounts = parse_mounts(["lidar=0.5,0.1,2.0,0,0,180"])
    acc = DriveAccumulator("tf", origin=(37.0, -122.0, 0.0), mounts=mounts)
    _feed_streams(acc)
    acc.add("/tf_static", "tf2_msgs/msg/TFMessage", _tf_static("lidar", "base_link", (1, 0, 2)))
    acc.add("/tf_static", "tf2_msgs/msg/TFMessage", _tf_static("gps", "base_link", (0, 0, 1.75)))
    # a frame mounted on the configured one follows it
    acc.add("/tf_static", "tf2_msgs/msg/TFMessage", _tf_static("lidar_top", "lidar", (0, 0, 1)))
    drive = acc.finish()
    np.testing.assert_allclose(drive.extrinsics.get("lidar"), mounts["lidar"])
    np.testing.assert_allclose(drive.extrinsics.get("gps")[:3, 3], [0, 0, 1.75])  # recorded
    np.testing.assert_allclose(drive.extrinsics.get("lidar_top")[:3, 3], [0.5, 0.1, 3.0])


def test_a_drive_without_a_gps_fix_cannot_start_a_map(
    bag: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bag whose GPS messages are all NO_FIX passed the check (the index counts messages,
    not fixes): the dry run said "new: built", and the build failed after Spark had read
    the drives -- with --skip-bad-bags too, so one such bag stopped a first nightly build of
    every other drive. The check now reads the GPS up to a fix where the map has no origin
    yet; where it has one, GPS is optional and the bag passes as before."""
    from adcloud.cli import main  # noqa: PLC0415

    nofix = without_fix(bag, tmp_path / "nofix.bag")
    assert not read_drive(str(nofix), with_scans=False, origin=(0.0, 0.0, 0.0)).gps.t.size
    with pytest.raises(DriveDataError) as err:
        check_topics(str(nofix), DriveTopics(), origin_known=False, mounts_known=False)
    text = str(err.value)
    assert text.startswith(f"drive {nofix} cannot be mapped: 15 NavSatFix messages on /gps/fix")
    assert "none of them a fix (status NO_FIX" in text and "give the map origin" in text
    check_topics(str(nofix), DriveTopics(), origin_known=True, mounts_known=False)
    args = ["hdmap", "build", "--bags", str(nofix), str(bag), "--map", str(tmp_path / "map")]
    assert main([*args, "--dry-run"]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "error: drive " in said and "none of them a fix" in said
    assert "the build would fail on 1 bag(s)" in said
    assert main([*args, "--dry-run", "--skip-bad-bags"]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "skipped (--skip-bad-bags; tried again next build): drive " in said
    assert "1 new drive(s) to build" in said
