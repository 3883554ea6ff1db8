"""IMU, wheel odometry, GPS, TF and timestamps, checked against the truth."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adcloud.synth import DriveConfig, DriveResult, generate_drive, read_poses
from adcloud.synth.frames import MOUNTS, quaternion_matrix
from adcloud.synth.gnss import VERTICAL_FACTOR, geodetic_to_enu
from adcloud.synth.messages import MessageCodec
from adcloud.synth.trajectory import GRAVITY
from tests.camera_poses import FixedPose, looking_at
from tests.synth.conftest import SMALL

Reader = Callable[..., list[tuple[str, int, Any]]]
NS = 1_000_000_000


def _stamp(header: Any) -> int:
    return int(header.stamp.sec) * NS + int(header.stamp.nanosec)


def _csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with path.open() as f:
        rows = list(csv.reader(f))[1:]
    t = np.array([round(float(r[0]) * 1e3) for r in rows], dtype=np.int64)  # ms since epoch
    return t, np.array([[float(v) for v in r[1:]] for r in rows])


def _skew_exp(w: np.ndarray) -> np.ndarray:
    angle = np.linalg.norm(w)
    k = np.array([[0, -w[2], w[1]], [w[2], 0, -w[0]], [-w[1], w[0], 0]])
    if angle < 1e-12:
        return np.asarray(np.eye(3) + k)
    k /= angle
    return np.asarray(np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k)


def _truth_state(
    drive: DriveResult, read_bag: Reader
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Record time -> (position, rotation, velocity in map, body rates) from /ground_truth/odom."""
    out = {}
    for _, t, m in read_bag(drive.bag, ["/ground_truth/odom"]):
        p = m.pose.pose.position
        q = m.pose.pose.orientation
        rot = quaternion_matrix(np.array([q.x, q.y, q.z, q.w]))
        v = rot @ np.array([m.twist.twist.linear.x, m.twist.twist.linear.y, m.twist.twist.linear.z])
        w = np.array([m.twist.twist.angular.x, m.twist.twist.angular.y, m.twist.twist.angular.z])
        out[t] = (np.array([p.x, p.y, p.z]), rot, v, w)
    return out


def _integrate_imu(
    drive: DriveResult, read_bag: Reader, bias: dict[int, np.ndarray] | None
) -> tuple[float, float]:
    """Strapdown-integrate /imu/data from the true initial state; return (final error m, span s)."""
    truth = _truth_state(drive, read_bag)
    lever = np.asarray(MOUNTS["imu"].translation)
    samples = [(t, m) for _, t, m in read_bag(drive.bag, ["/imu/data"])]
    t0 = samples[0][0]
    # the truth runs at 100 Hz on whole 10 ms; the IMU 1 ms later: start from the truth before it
    start = max(t for t in truth if t <= t0)
    p, rot, v, w = truth[start]
    pos = p + rot @ lever
    vel = v + rot @ np.cross(w, lever)
    # propagate the 1 ms from the truth sample to the first IMU sample with the truth's rates
    g = np.array([0.0, 0.0, -GRAVITY])
    prev_a = prev_w = None
    prev_t = t0
    for t, m in samples:
        acc = np.array([m.linear_acceleration.x, m.linear_acceleration.y, m.linear_acceleration.z])
        gyro = np.array([m.angular_velocity.x, m.angular_velocity.y, m.angular_velocity.z])
        if bias is not None:
            b = bias[t // 1_000_000]
            acc, gyro = acc - b[:3], gyro - b[3:]
        if prev_a is None:
            dt0 = (t0 - start) / NS
            rot = rot @ _skew_exp(gyro * dt0)
            a_w = rot @ acc + g
            pos = pos + vel * dt0 + 0.5 * a_w * dt0 * dt0
            vel = vel + a_w * dt0
        else:
            dt = (t - prev_t) / NS
            a0 = rot @ prev_a + g
            rot = rot @ _skew_exp(0.5 * (prev_w + gyro) * dt)
            a1 = rot @ acc + g
            pos = pos + vel * dt + dt * dt * (a0 / 3 + a1 / 6)
            vel = vel + 0.5 * (a0 + a1) * dt
        prev_a, prev_w, prev_t = acc, gyro, t
    end = max(t for t in truth if t <= prev_t)
    p_end, r_end, v_end, w_end = truth[end]
    dt_end = (prev_t - end) / NS
    expected = p_end + r_end @ lever + (v_end + r_end @ np.cross(w_end, lever)) * dt_end
    return float(np.linalg.norm(pos - expected)), (prev_t - t0) / NS


def test_integrating_a_noise_free_imu_reproduces_the_trajectory(
    quiet_drive: DriveResult, read_bag: Reader
) -> None:
    error, span = _integrate_imu(quiet_drive, read_bag, None)
    assert span > 5.5
    assert error < 0.02  # discretisation only: 100 Hz samples of a smooth trajectory


def test_integrating_the_noisy_imu_stays_within_its_noise(
    small_drive: DriveResult, read_bag: Reader
) -> None:
    t_ms, values = _csv(small_drive.truth / "imu_bias.csv")
    bias = dict(zip(t_ms.tolist(), values, strict=True))
    error, span = _integrate_imu(small_drive, read_bag, bias)
    # white noise only (biases removed): sigma_a * sqrt(dt) * T^1.5 / sqrt(3) ~ 1 cm; 5 sigma
    sigma = SMALL.imu_accel_noise * np.sqrt(0.01) * span**1.5 / np.sqrt(3)
    gyro = GRAVITY * SMALL.imu_gyro_noise * np.sqrt(0.01) * span**2.5 / np.sqrt(20)
    assert error < 5 * (sigma + gyro) + 0.02
    raw_error, _ = _integrate_imu(small_drive, read_bag, None)
    worst = np.abs(values).max(axis=0)
    bound = 0.5 * (worst[:3].max() + GRAVITY * worst[3:].max() * span) * span**2 * np.sqrt(3)
    assert raw_error < bound + 5 * (sigma + gyro) + 0.02


def _odometry(drive: DriveResult, read_bag: Reader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [
        (
            t,
            m.twist.twist.linear.x,
            m.twist.twist.angular.z,
            m.pose.pose.position.x,
            m.pose.pose.position.y,
        )
        for _, t, m in read_bag(drive.bag, ["/odom"])
    ]
    arr = np.array(rows, dtype=np.float64)
    return arr[:, 0].astype(np.int64), arr[:, 1:3], arr[:, 3:5]


def test_integrating_noise_free_odometry_reproduces_the_path(
    quiet_drive: DriveResult, read_bag: Reader
) -> None:
    t, twist, pose = _odometry(quiet_drive, read_bag)
    truth_t, xyz, quat = read_poses(quiet_drive.truth)
    yaw0 = np.arctan2(*quaternion_matrix(quat[0])[[1, 0], 0])
    # the odom frame starts at the true pose at t = 0
    c, s = np.cos(yaw0), np.sin(yaw0)
    mapped = xyz[0, :2] + pose @ np.array([[c, s], [-s, c]])
    truth_xy = np.stack([np.interp(t, truth_t, xyz[:, i]) for i in range(2)], axis=1)
    travelled = np.sum(np.hypot(*np.diff(truth_xy, axis=0).T))
    error = np.hypot(*(mapped - truth_xy).T)
    assert travelled > 30
    assert error.max() < 0.05 + 0.003 * travelled  # 3D speed vs 2D path on slopes of a few %
    # the published pose is the integral of the published twist from the drive start
    x = y = yaw = 0.0
    dts = np.diff(np.concatenate([[truth_t[0]], t])) / NS
    last = twist[0]
    for (v, w), dt in zip(twist, dts, strict=True):
        vm, wm = 0.5 * (last[0] + v), 0.5 * (last[1] + w)
        x += vm * np.cos(yaw + 0.5 * wm * dt) * dt
        y += vm * np.sin(yaw + 0.5 * wm * dt) * dt
        yaw += wm * dt
        last = (v, w)
    assert np.hypot(x - pose[-1, 0], y - pose[-1, 1]) < 1e-6


def test_the_odom_frame_is_base_link_at_the_drive_start(
    quiet_drive: DriveResult, read_bag: Reader
) -> None:
    """The odom frame is where base_link was at ``start_time_ns``: the first /odom pose (3 ms
    later) is the way driven since.  The integration started at that first sample, so the
    whole odometry path sat 2.4 cm (at 8 m/s) behind the truth mapped through the pose at
    the start."""
    t, _, pose = _odometry(quiet_drive, read_bag)
    truth_t, xyz, quat = read_poses(quiet_drive.truth)
    start = json.loads((quiet_drive.truth / "world.json").read_text())["start_time_ns"]
    assert truth_t[0] == start  # the first true pose is the one at the drive start
    rot0 = quaternion_matrix(quat[0])
    yaw0 = np.arctan2(rot0[1, 0], rot0[0, 0])
    c, s = np.cos(yaw0), np.sin(yaw0)
    mapped = xyz[0, :2] + pose[:5] @ np.array([[c, s], [-s, c]])
    truth_xy = np.stack([np.interp(t[:5], truth_t, xyz[:, i]) for i in range(2)], axis=1)
    assert np.hypot(*(mapped - truth_xy).T).max() < 1e-3
    assert np.hypot(*pose[0]) > 0.01  # 3 ms of driving at about 8 m/s


def test_odometry_speed_carries_the_drifting_scale_error(
    small_drive: DriveResult, read_bag: Reader
) -> None:
    t, twist, _ = _odometry(small_drive, read_bag)
    truth = _truth_state(small_drive, read_bag)
    truth_t = np.array(sorted(truth))
    speed = np.array([np.linalg.norm(truth[k][2]) for k in truth_t])
    true_speed = np.interp(t, truth_t, speed)
    _, scale = _csv(small_drive.truth / "odom_scale.csv")
    assert scale[0, 0] == pytest.approx(1 + SMALL.odom_scale_error, abs=0.005)
    moving = true_speed > 1.0
    ratio = np.sum(twist[moving, 0] * true_speed[moving]) / np.sum(true_speed[moving] ** 2)
    assert ratio == pytest.approx(float(scale[moving, 0].mean()), abs=0.003)
    residual = twist[moving, 0] - true_speed[moving] * scale[moving, 0]
    assert residual.std() == pytest.approx(SMALL.odom_speed_noise, rel=0.3)


def test_a_large_odometry_scale_error_is_the_one_configured(
    tmp_path: Path, read_bag: Reader
) -> None:
    """``odom_scale_error`` may be up to 20 %; one beyond the 5 % drift bound was reflected
    at it on the first sample (+15 % became -5 %, +10 % became 0)."""
    config = DriveConfig(
        seconds=1.0,
        lidar=False,
        camera=False,
        truth_raster=False,
        odom_scale_error=0.15,
        odom_scale_drift=0.0,
        odom_speed_noise=0.0,
    )
    drive = generate_drive(config, tmp_path / "scaled.bag")
    _, scale = _csv(drive.truth / "odom_scale.csv")
    assert np.allclose(scale[:, 0], 1.15)
    t, twist, _ = _odometry(drive, read_bag)
    truth = _truth_state(drive, read_bag)
    truth_t = np.array(sorted(truth))
    true_speed = np.interp(t, truth_t, [np.linalg.norm(truth[k][2]) for k in truth_t])
    moving = true_speed > 1.0
    assert moving.any()
    assert np.allclose(twist[moving, 0], 1.15 * true_speed[moving], rtol=1e-3)


def test_a_fast_odometry_scale_drift_stays_within_its_bound(
    tmp_path: Path, read_bag: Reader
) -> None:
    """A drift whose step exceeds the 5 % bound was reflected once and left outside it:
    scales below 0 made the wheel speed run backwards while the car drove forwards."""
    config = DriveConfig(
        seconds=3.0,
        lidar=False,
        camera=False,
        truth_raster=False,
        odom_scale_drift=2.0,
        odom_speed_noise=0.0,
    )
    drive = generate_drive(config, tmp_path / "drift.bag")
    _, scale = _csv(drive.truth / "odom_scale.csv")
    assert np.abs(scale[:, 0] - 1).max() <= 0.05 + 1e-12
    assert np.ptp(scale[:, 0]) > 0.05  # it does drift, across the whole band
    _, twist, _ = _odometry(drive, read_bag)
    assert (twist[:, 0] >= 0).all()


def test_gps_errors_match_the_configured_noise_and_the_outage(
    gps_drive: DriveResult, read_bag: Reader
) -> None:
    config_noise = 1.5
    fixes = read_bag(gps_drive.bag, ["/gps/fix"])
    t = np.array([t for _, t, _ in fixes])
    lat = np.array([m.latitude for *_, m in fixes])
    lon = np.array([m.longitude for *_, m in fixes])
    alt = np.array([m.altitude for *_, m in fixes])
    origin = (37.3875, -122.0575, 12.0)
    enu = geodetic_to_enu(lat, lon, alt, origin)
    truth_ms, truth = _csv(gps_drive.truth / "gps.csv")
    published = truth[:, 0] == 1
    assert (~published).sum() == 50  # 5 s at 10 Hz
    rel = (truth_ms - truth_ms[0]) / 1e3
    assert ((rel[~published] >= 10.0) & (rel[~published] < 15.0)).all()
    assert len(t) == published.sum() == 350
    err = enu - truth[published, 1:4]
    n = len(err)
    std = err.std(axis=0)
    # sample std of n normal draws: relative standard error 1/sqrt(2n) ~ 3.8 %; allow 4 of them
    tol = 4 / np.sqrt(2 * n)
    assert std[:2] == pytest.approx([config_noise] * 2, rel=tol)
    assert std[2] == pytest.approx(config_noise * VERTICAL_FACTOR, rel=tol)
    assert (np.abs(err.mean(axis=0)) < 4 * std / np.sqrt(n)).all()
    cov = fixes[0][2].position_covariance
    assert cov[0] == pytest.approx(config_noise**2)
    assert fixes[0][2].position_covariance_type == 2


def test_gps_bias_is_recorded_in_the_truth(small_drive: DriveResult, read_bag: Reader) -> None:
    fixes = read_bag(small_drive.bag, ["/gps/fix"])
    enu = geodetic_to_enu(
        np.array([m.latitude for *_, m in fixes]),
        np.array([m.longitude for *_, m in fixes]),
        np.array([m.altitude for *_, m in fixes]),
        SMALL.gps_origin,
    )
    _, truth = _csv(small_drive.truth / "gps.csv")
    pub = truth[truth[:, 0] == 1]
    residual = enu - pub[:, 1:4] - pub[:, 4:7]
    assert np.abs(residual[:, :2]).max() < 5 * SMALL.gps_noise_m
    assert len(fixes) == round((SMALL.seconds - SMALL.gps_outage[1]) * SMALL.gps_hz)


def test_timestamps_are_monotone_and_equal_header_stamps(
    small_drive: DriveResult, read_bag: Reader
) -> None:
    per_topic: dict[str, list[int]] = defaultdict(list)
    for topic, t, msg in read_bag(small_drive.bag):
        per_topic[topic].append(t)
        if hasattr(msg, "header"):
            assert _stamp(msg.header) == t, topic
        else:  # tf2_msgs/TFMessage: every transform carries the stamp
            assert all(_stamp(tr.header) == t for tr in msg.transforms), topic
    start = SMALL.start_time_ns
    for topic, times in per_topic.items():
        arr = np.array(times)
        assert (np.diff(arr) > 0).all(), topic
        assert arr[0] >= start
        assert arr[-1] < start + SMALL.duration_ns
    counts = {k: len(v) for k, v in per_topic.items()}
    assert counts["/imu/data"] == SMALL.seconds * SMALL.imu_hz
    assert counts["/odom"] == counts["/tf"] == SMALL.seconds * SMALL.odom_hz
    assert counts["/lidar/points"] == SMALL.seconds * SMALL.lidar_hz - 1
    assert counts["/tf_static"] == 1
    assert counts == small_drive.messages


def test_static_transforms_name_every_sensor_frame(
    small_drive: DriveResult, read_bag: Reader
) -> None:
    ((_, _, msg),) = read_bag(small_drive.bag, ["/tf_static"])
    pairs = {(tr.header.frame_id, tr.child_frame_id) for tr in msg.transforms}
    assert pairs == {
        ("base_link", "lidar"),
        ("base_link", "imu_link"),
        ("base_link", "gps"),
        ("base_link", "camera_link"),
        ("camera_link", "camera_optical"),
    }
    frames = {
        topic: m.header.frame_id
        for topic, _, m in read_bag(small_drive.bag)
        if hasattr(m, "header")
    }
    assert frames["/lidar/points"] == "lidar"
    assert frames["/imu/data"] == "imu_link"
    assert frames["/gps/fix"] == "gps"
    assert frames["/camera/image_raw"] == "camera_optical"
    assert frames["/ground_truth/odom"] == "map"
    assert frames["/odom"] == "odom"


@pytest.mark.parametrize("name", ["small_drive", "quiet_drive"])
def test_world_json_lists_the_frames_tf_static_publishes(
    name: str, request: pytest.FixtureRequest, read_bag: Reader
) -> None:
    """``world.json`` ``frames`` are the sensor mounts of ``/tf_static``, no more: a drive
    without a camera listed ``camera_link`` and ``camera_optical`` there."""
    drive: DriveResult = request.getfixturevalue(name)
    ((_, _, msg),) = read_bag(drive.bag, ["/tf_static"])
    published = {tr.child_frame_id: tr for tr in msg.transforms}
    frames = json.loads((drive.truth / "world.json").read_text())["frames"]
    assert set(frames) == set(published)
    for frame, info in frames.items():
        tr = published[frame]
        assert info["parent"] == tr.header.frame_id
        v = tr.transform.translation
        assert info["translation_m"] == pytest.approx([v.x, v.y, v.z])
    if name == "quiet_drive":  # camera off
        assert "camera_link" not in frames


def test_camera_images_and_labels(small_drive: DriveResult, read_bag: Reader) -> None:
    msgs = {
        topic: m
        for topic, _, m in read_bag(
            small_drive.bag, ["/camera/image_raw", "/camera/labels", "/camera/camera_info"]
        )
    }
    img, lab, info = msgs["/camera/image_raw"], msgs["/camera/labels"], msgs["/camera/camera_info"]
    assert (img.width, img.height, img.encoding) == (
        SMALL.camera_width,
        SMALL.camera_height,
        "rgb8",
    )
    assert lab.encoding == "mono8"
    labels = np.asarray(lab.data).reshape(lab.height, lab.width)
    assert (labels[: lab.height // 4] == 0).mean() > 0.3  # sky at the top
    assert np.isin(labels[-5:], [1, 2]).mean() > 0.8  # road right in front
    assert info.K[0] == pytest.approx(SMALL.camera_width / 2)  # 90 degrees: f = w / 2


def _chromaticity(rgb: np.ndarray) -> np.ndarray:
    rgb = np.asarray(rgb, dtype=np.float64).reshape(-1, 3)
    return rgb / rgb.sum(axis=1, keepdims=True)


def test_the_camera_sees_each_sign_type_face_in_its_colour_and_the_back_in_grey(
    world: Any,
) -> None:
    from adcloud.synth import DriveConfig  # noqa: PLC0415
    from adcloud.synth.camera import CameraModel  # noqa: PLC0415
    from adcloud.synth.labels import Label  # noqa: PLC0415
    from adcloud.synth.world import SIGN_BACK_COLOR, SIGN_FACE_COLORS, SIGN_TYPES  # noqa: PLC0415

    camera = CameraModel.from_config(DriveConfig())
    faces = _chromaticity(np.asarray(SIGN_FACE_COLORS))
    seen_types = set()
    for sign in world.signs:
        centre, yaw, kind = sign[:3], float(sign[3]), int(sign[6])
        normal = np.array([np.cos(yaw), np.sin(yaw), 0.0])
        for side, expect_face in ((1.0, True), (-1.0, False)):
            eye = centre + side * 5.0 * normal
            pose = FixedPose(looking_at(eye, centre))
            rgb, labels = camera.render(world, pose, 0.0, np.random.default_rng(0))
            plate = labels == Label.SIGN
            if plate.sum() < 20:  # something stands between the eye and this plate
                continue
            colour = np.median(rgb[plate].astype(np.float64), axis=0)
            chroma = _chromaticity(colour)[0]
            if expect_face:
                nearest = int(np.argmin(np.linalg.norm(faces - chroma, axis=1)))
                assert SIGN_TYPES[nearest] == SIGN_TYPES[kind], (SIGN_TYPES[kind], colour)
                seen_types.add(kind)
            else:
                grey = _chromaticity(np.asarray(SIGN_BACK_COLOR))[0]
                assert np.abs(chroma - grey).max() < 0.04, colour
    assert len(seen_types) >= 4, seen_types


def test_camera_info_projects_each_pixels_ray_to_that_pixel(world: Any) -> None:
    """``K`` follows ROS/OpenCV (pixel centres at whole coordinates): the ray ``K^-1 (u, v,
    1)`` is the one the image shows in pixel ``(u, v)``.  With the principal point at
    ``(W / 2, H / 2)`` every projection was half a pixel off, and about 4 % of the labels
    cast through ``K`` disagreed with the label image."""
    from adcloud.synth import DriveConfig  # noqa: PLC0415
    from adcloud.synth.camera import CameraModel  # noqa: PLC0415
    from adcloud.synth.raycast import cast_rays  # noqa: PLC0415

    camera = CameraModel.from_config(DriveConfig())
    k = np.array(
        MessageCodec("ros2")
        .camera_info(
            "/camera/camera_info", 0, "camera_optical", camera.width, camera.height, camera.k
        )
        .k
    ).reshape(3, 3)
    assert k[0, 2] == (camera.width - 1) / 2 and k[1, 2] == (camera.height - 1) / 2
    sign = world.signs[0]
    centre, yaw = sign[:3], float(sign[3])
    eye = centre + 6.0 * np.array([np.cos(yaw), np.sin(yaw), -0.1])
    pose = looking_at(eye, centre)
    _, labels = camera.render(world, FixedPose(pose), 0.0, np.random.default_rng(0))
    assert len(np.unique(labels)) >= 4  # edges between sign, pole, buildings, ground, sky
    v, u = np.mgrid[0 : camera.height, 0 : camera.width]
    pixels = np.stack([u, v, np.ones_like(u)], axis=-1).reshape(-1, 3).astype(np.float64)
    rays = pixels @ np.linalg.inv(k).T
    rays /= np.linalg.norm(rays, axis=1, keepdims=True)
    n = len(rays)
    hits = cast_rays(
        world,
        np.broadcast_to(pose[:3, 3], (n, 3)),
        rays @ pose[:3, :3].T,
        np.zeros(n),
        max_range=150.0,
        bins=np.zeros(n, dtype=np.int64),
    )
    assert (hits.label.reshape(labels.shape) == labels).all()
