"""Pose recovery (stage 1): propagation, de-skew, segments, GTSAM graphs, loop closures.

Accuracy is measured on the 60 s synthetic loop drive (``loop_drive``: 1 m GPS noise with
a bias, an outage from 20 s to 30 s, a drifting odometry scale and a revisit of the start)
as ATE RMSE after rigid alignment, against the truth poses; the target is 5 cm. The
expensive part -- ICP of every keyframe in every segment -- runs once per module
(``solutions``) and the tests that change the GPS solve again only what they must.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import pickle
from collections.abc import Callable
from pathlib import Path

import gtsam
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from adcloud.hdmap.baseline import kiss_icp_trajectory
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import DriveData, read_drive
from adcloud.hdmap.errors import DriveDataError, HdmapError, MapFormatError
from adcloud.hdmap.job import StageSettings
from adcloud.hdmap.loops import (
    Keyframe,
    KeyframeArchive,
    LoneDrive,
    LoopClosure,
    LoopSettings,
    UntiedDrives,
    _untied,
    find_loop_closures,
    local_keyframe,
    loop_candidates,
    verify_loop,
)
from adcloud.hdmap.model import Extrinsics, GpsFixes, ImuSamples, OdomSamples, Scan
from adcloud.hdmap.poses import (
    PoseSettings,
    SegmentSolution,
    _attitude_factor,
    _biased_gps_factor,
    _key,
    _tilt_offset,
    deskew_scan,
    estimate_trajectory,
    join_segments,
    propagate,
    select_keyframes,
    solution_keyframes,
    solve_segment,
    split_segments,
)
from adcloud.hdmap.trajectory import Trajectory, absolute_trajectory_error, rigid_alignment
from adcloud.synth import DriveResult, read_poses
from tests.device_order import sums_in_any_order

NS = 1_000_000_000
ATE_TARGET_M = 0.05


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drive(loop_drive: DriveResult) -> DriveData:
    origin = json.loads((loop_drive.truth / "world.json").read_text())["origin"]
    return read_drive(
        str(loop_drive.bag),
        origin=(origin["latitude_deg"], origin["longitude_deg"], origin["height_m"]),
    )


@pytest.fixture(scope="module")
def truth(loop_drive: DriveResult) -> Trajectory:
    t, xyz, quat = read_poses(loop_drive.truth)
    return Trajectory.from_xyz_quat(t, xyz, quat)


@pytest.fixture(scope="module")
def propagated(drive: DriveData) -> Trajectory:
    return propagate(drive.imu, drive.odom, drive.extrinsics)


@pytest.fixture(scope="module")
def solutions(drive: DriveData, propagated: Trajectory) -> list[SegmentSolution]:
    return [solve_segment(s) for s in split_segments(drive, propagated)]


@pytest.fixture(scope="module")
def joined(drive: DriveData, solutions: list[SegmentSolution]) -> Trajectory:
    return join_segments(solutions, {drive.name: drive.gps}).trajectories[drive.name]


@pytest.fixture(scope="module")
def closures(
    drive: DriveData, solutions: list[SegmentSolution], joined: Trajectory
) -> list[LoopClosure]:
    return find_loop_closures(solution_keyframes(solutions, {drive.name: joined})).closures


@pytest.fixture(scope="module")
def final(
    drive: DriveData, solutions: list[SegmentSolution], closures: list[LoopClosure]
) -> Trajectory:
    return join_segments(solutions, {drive.name: drive.gps}, closures).trajectories[drive.name]


def _cut(drive: DriveData, name: str, start_s: float, end_s: float) -> DriveData:
    """The part of ``drive`` between ``start_s`` and ``end_s`` after its start, as drive
    ``name``."""
    t0 = int(drive.odom.t[0])
    lo, hi = t0 + int(start_s * NS), t0 + int(end_s * NS)

    def inside(t: np.ndarray) -> np.ndarray:
        return (t >= lo) & (t <= hi)

    i, o, g = inside(drive.imu.t), inside(drive.odom.t), inside(drive.gps.t)
    return dataclasses.replace(
        drive,
        name=name,
        imu=ImuSamples(drive.imu.frame, drive.imu.t[i], drive.imu.accel[i], drive.imu.gyro[i]),
        odom=OdomSamples(drive.odom.t[o], drive.odom.speed[o], drive.odom.yaw_rate[o]),
        gps=GpsFixes(drive.gps.frame, drive.gps.t[g], drive.gps.enu[g], drive.gps.sigma[g]),
        scans=[dataclasses.replace(s, drive=name) for s in drive.scans if lo <= s.stamp <= hi],
    )


# -- settings ----------------------------------------------------------------------------------


def test_settings_reject_nonsense_and_load_from_the_environment() -> None:
    with pytest.raises(HdmapError, match="voxel_m"):
        PoseSettings(voxel_m=0)
    with pytest.raises(HdmapError, match="gps_robust"):
        PoseSettings(gps_robust="tukey")
    with pytest.raises(HdmapError, match="segment_overlap_s"):
        PoseSettings(segment_seconds=2, segment_overlap_s=3)
    with pytest.raises(HdmapError, match="min_fitness"):
        LoopSettings(min_fitness=1.5)
    with pytest.raises(HdmapError, match="tilt_bias_sigma_rad must be >= 0"):
        PoseSettings(tilt_bias_sigma_rad=float("nan"))
    loaded = PoseSettings.load(
        environ={"ADCLOUD_HDMAP_POSES_VOXEL_M": "0.3", "ADCLOUD_HDMAP_POSES_GPS_ROBUST": "huber"}
    )
    assert loaded.voxel_m == 0.3 and loaded.gps_robust == "huber"
    assert LoopSettings.load(environ={"ADCLOUD_HDMAP_LOOPS_STRIDE": "5"}).stride == 5


def test_a_build_reads_every_stage_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``adcloud hdmap build`` hands every stage's settings of the config file and the
    environment to the build; what ``hdmap`` names (segment length, grid resolution) wins."""
    config = tmp_path / "build.yaml"
    config.write_text(
        "hdmap:\n  segment_s: 15\nhdmap_poses:\n  voxel_m: 0.3\n"
        "hdmap_grid:\n  resolution: 0.5\nhdmap_labels:\n  max_lateral_m: 7.5\n"
    )
    env = {
        "ADCLOUD_HDMAP_LOOPS_STRIDE": "5",
        "ADCLOUD_HDMAP_POSES_SEGMENT_SECONDS": "30",
        "ADCLOUD_HDMAP_LANELET_CONNECT_GAP_M": "0",
        "ADCLOUD_HDMAP_SIGNS_MIN_POINTS": "9",
    }
    stages = StageSettings.load(HdmapSettings(segment_s=15), file=config, environ=env)
    assert stages.poses.voxel_m == 0.3 and stages.poses.segment_seconds == 15
    assert stages.loops.stride == 5 and stages.lanelet.connect_gap_m == 0
    assert stages.labels.max_lateral_m == 7.5 and stages.signs.min_points == 9
    assert stages.grid.resolution == 0.05  # hdmap.resolution names it
    assert (
        StageSettings.load(HdmapSettings()).grid
        == StageSettings.from_settings(HdmapSettings()).grid
    )

    import adcloud.hdmap.build as build  # noqa: PLC0415
    import adcloud.hdmap.command as command  # noqa: PLC0415
    from adcloud.cli import main  # noqa: PLC0415

    seen: dict[str, object] = {}

    class StopError(Exception):
        pass

    def fake_build(spark: object, bags: object, map_uri: object, settings: object, **kw: object):  # type: ignore[no-untyped-def]
        seen.update(kw, settings=settings)
        raise StopError

    plan = type(
        "Plan", (), {"up_to_date": False, "parent": None, "skipped": (), "new_drives": ()}
    )()
    monkeypatch.setattr(build, "plan_build", lambda bags, uri, **kw: plan)
    monkeypatch.setattr(build, "build_map", fake_build)
    monkeypatch.setattr(command, "_session", lambda args: None)
    monkeypatch.setenv("ADCLOUD_HDMAP_LOOPS_STRIDE", "7")
    with pytest.raises(StopError):
        main(
            [
                "hdmap",
                "build",
                "--bags",
                "x.bag",
                "--map",
                str(tmp_path / "m"),
                "--config",
                str(config),
            ]
        )
    assert seen["stages"].loops.stride == 7  # type: ignore[attr-defined]
    assert seen["stages"].poses.voxel_m == 0.3  # type: ignore[attr-defined]
    assert seen["settings"].segment_s == 15  # type: ignore[attr-defined]


# -- propagation -------------------------------------------------------------------------------


def _circle_streams(
    mount: np.ndarray, speed: float = 8.0, yaw_rate: float = 0.2, seconds: float = 10.0
) -> tuple[ImuSamples, OdomSamples, Extrinsics]:
    """A car on flat ground driving a circle, with the IMU mounted by ``mount``."""
    t = np.arange(int(seconds * 100) + 1, dtype=np.int64) * (NS // 100)
    n = len(t)
    gyro_base = np.tile([0.0, 0.0, yaw_rate], (n, 1))
    # Specific force in base_link: gravity up plus the centripetal acceleration (left).
    accel_base = np.tile([0.0, speed * yaw_rate, 9.80665], (n, 1))
    to_imu = mount[:3, :3].T
    imu = ImuSamples("imu_link", t, accel_base @ to_imu.T, gyro_base @ to_imu.T)
    odom_t = t[::2]
    odom = OdomSamples(odom_t, np.full(len(odom_t), speed), np.full(len(odom_t), yaw_rate))
    return imu, odom, Extrinsics({"imu_link": mount})


def test_propagate_follows_a_circle_through_a_rotated_imu_mount() -> None:
    mount = np.eye(4)
    mount[:3, :3] = Rotation.from_euler("xyz", [np.pi, 0.0, np.pi / 2]).as_matrix()
    mount[:3, 3] = [0.3, 0.1, 0.5]
    imu, odom, extrinsics = _circle_streams(mount)
    traj = propagate(imu, odom, extrinsics)
    speed, rate = 8.0, 0.2
    secs = (traj.t - traj.t[0]) / NS
    radius = speed / rate
    expected = np.stack([radius * np.sin(rate * secs), radius * (1 - np.cos(rate * secs))], 1)
    assert np.abs(traj.xyz[:, :2] - expected).max() < 0.01
    assert np.abs(traj.xyz[:, 2]).max() < 0.01
    yaw = Rotation.from_matrix(traj.matrices[:, :3, :3]).as_euler("xyz")[:, 2]
    assert np.abs(np.unwrap(yaw) - rate * secs).max() < 1e-3
    tilt = np.degrees(np.arccos(np.clip(traj.matrices[:, 2, 2], -1, 1)))
    assert tilt.max() < 0.05  # the centripetal acceleration is not mistaken for a tilt


def test_propagate_turns_by_the_rotation_vector_of_each_step() -> None:
    """Its per-step rotation on Python floats is Rodrigues' formula: SciPy's rotation of the
    same vector, composed on the right."""
    from adcloud.hdmap.poses import _times_exp  # noqa: PLC0415

    rng = np.random.default_rng(3)
    start = Rotation.from_rotvec(rng.normal(0, 1, 3)).as_matrix()
    for vector in [*rng.normal(0, 0.05, (20, 3)), [1e-9, 0.0, 0.0], [0.0, 0.0, np.pi / 2]]:
        got = np.array(_times_exp(start.tolist(), *map(float, vector)))
        want = start @ Rotation.from_rotvec(vector).as_matrix()
        np.testing.assert_allclose(got, want, atol=1e-14)
    assert _times_exp(start.tolist(), 0.0, 0.0, 1e-13) == start.tolist()  # below 1e-12 rad


def test_propagate_on_the_drive_is_locally_accurate(
    propagated: Trajectory, truth: Trajectory
) -> None:
    # Dead reckoning drifts (metres over the drive; the odometry scale is off by 1-2 %) but
    # over one sweep (0.1 s) it is good to a couple of centimetres: good enough to de-skew
    # sweeps and to seed ICP.
    t = propagated.t[::10]
    est, ref = propagated.at(t), truth.at(t)
    errors = []
    for a, b in zip(range(len(t) - 1), range(1, len(t)), strict=True):
        rel_est = np.linalg.inv(est[a]) @ est[b]
        rel_ref = np.linalg.inv(ref[a]) @ ref[b]
        errors.append(np.linalg.norm(rel_est[:3, 3] - rel_ref[:3, 3]))
    assert np.percentile(errors, 95) < 0.03
    drift = absolute_trajectory_error(propagated, truth).rmse
    assert drift > 0.3  # the odometry scale drifts: the factor graph has work to do


def test_propagate_rejects_bad_streams() -> None:
    imu, odom, extrinsics = _circle_streams(np.eye(4), seconds=1.0)
    with pytest.raises(DriveDataError, match="imu_link"):
        propagate(imu, odom, Extrinsics({}))
    shuffled = ImuSamples(imu.frame, imu.t[::-1].copy(), imu.accel, imu.gyro)
    with pytest.raises(DriveDataError, match=r"imu\.t.*increase"):
        propagate(shuffled, odom, extrinsics)
    broken = imu.gyro.copy()
    broken[7, 1] = np.nan
    with pytest.raises(DriveDataError, match=r"imu\.gyro: sample 7"):
        propagate(ImuSamples(imu.frame, imu.t, imu.accel, broken), odom, extrinsics)
    late = OdomSamples(odom.t + 5 * NS, odom.speed, odom.yaw_rate)
    with pytest.raises(DriveDataError, match="do not overlap"):
        propagate(imu, late, extrinsics)


# -- keyframes and de-skew ---------------------------------------------------------------------


def _straight(speed: float, seconds: float = 2.0) -> Trajectory:
    t = np.arange(int(seconds * 100) + 1, dtype=np.int64) * (NS // 100)
    m = np.tile(np.eye(4), (len(t), 1, 1))
    m[:, 0, 3] = speed * t / NS
    return Trajectory(t, m)


def test_select_keyframes_by_distance_and_by_time() -> None:
    stamps = np.arange(1, 20, dtype=np.int64) * (NS // 10)
    moving = select_keyframes(stamps, _straight(10.0), PoseSettings(keyframe_distance_m=3.0))
    gaps = np.diff(_straight(10.0).at(stamps[moving])[:, 0, 3])
    assert moving[0] == 0 and np.all(gaps >= 3.0 - 1e-9) and np.all(gaps < 4.0 + 1e-9)
    standing = select_keyframes(stamps, _straight(0.0), PoseSettings(keyframe_max_interval_s=0.5))
    assert list(standing) == [0, 5, 10, 15]


def test_deskew_scan_undoes_the_motion_during_a_sweep() -> None:
    motion = _straight(12.0)
    mount = np.eye(4)
    mount[:3, 3] = [1.2, 0.0, 1.9]
    # A wall 25 m ahead and a row of poles to the left, fired over 0.1 s while driving.
    ys, zs = np.meshgrid(np.linspace(-10, 10, 41), np.linspace(0.0, 4.0, 9))
    wall = np.stack([np.full(ys.size, 25.0), ys.ravel(), zs.ravel()], 1)
    poles = np.stack([np.linspace(5, 20, 31), np.full(31, 6.0), np.full(31, 1.0)], 1)
    world = np.concatenate([wall, poles])
    stamp = NS
    dt = -0.1 + 0.1 * np.arange(len(world)) / len(world)
    sensor = motion.at(stamp + np.round(dt * NS).astype(np.int64)) @ mount
    local = (
        np.einsum("nij,nj->ni", np.linalg.inv(sensor)[:, :3, :3], world)
        + np.linalg.inv(sensor)[:, :3, 3]
    )
    scan = Scan(
        "d",
        stamp,
        "lidar",
        local.astype(np.float32),
        np.zeros(len(world), np.float32),
        dt.astype(np.float32),
    )
    settings = PoseSettings(voxel_m=0.01, min_range_m=0.0)
    out = deskew_scan(scan, motion, mount, settings, device="numpy")
    expected = world - motion.at(stamp)[0, :3, 3]
    order = np.lexsort(out.T)
    assert out.shape == expected.shape
    assert np.abs(out[order] - expected[np.lexsort(expected.T)]).max() < 1e-3
    raw = deskew_scan(
        dataclasses.replace(scan, dt=np.zeros(len(world), np.float32)),
        motion,
        mount,
        settings,
        device="numpy",
    )
    assert np.abs(raw[np.lexsort(raw.T)] - expected[np.lexsort(expected.T)]).max() > 0.5


# -- segments ----------------------------------------------------------------------------------


def test_segments_overlap_and_cover_the_drive(
    drive: DriveData, propagated: Trajectory, solutions: list[SegmentSolution]
) -> None:
    segments = split_segments(drive, propagated)
    assert len(segments) == 3  # 60 s in segments of 20 s
    for a, b in itertools.pairwise(segments):
        shared = np.intersect1d(a.stamps, b.stamps)
        assert len(shared) > PoseSettings().local_map_keyframes and shared[0] == b.stamps[0]
    assert segments[0].stamps[0] == drive.scans[0].stamp
    back = pickle.loads(pickle.dumps(segments[0]))
    assert np.array_equal(back.stamps, segments[0].stamps)
    assert back.scans[3].xyz.tobytes() == segments[0].scans[3].xyz.tobytes()
    for sol in solutions:
        assert sol.anchored
        assert sol.matches_accepted >= 0.9 * sol.matches_tried
    again = pickle.loads(pickle.dumps(solutions[1]))
    assert np.array_equal(again.poses, solutions[1].poses)


def test_split_segments_needs_scans(drive: DriveData, propagated: Trajectory) -> None:
    with pytest.raises(DriveDataError, match="no LiDAR sweeps"):
        split_segments(dataclasses.replace(drive, scans=[]), propagated)
    lidarless = dataclasses.replace(drive, extrinsics=Extrinsics({"gps": np.eye(4)}))
    with pytest.raises(DriveDataError, match="LiDAR frame 'lidar'"):
        split_segments(lidarless, propagated)
    g = drive.gps
    bad = GpsFixes(g.frame, g.t, g.enu, np.zeros_like(g.sigma))
    with pytest.raises(DriveDataError, match=r"gps\.sigma"):
        split_segments(dataclasses.replace(drive, gps=bad), propagated)


def test_join_needs_solutions() -> None:
    with pytest.raises(HdmapError, match="no segment solutions"):
        join_segments([], {})


def test_join_does_not_depend_on_the_order_solutions_arrive_in(
    drive: DriveData,
    solutions: list[SegmentSolution],
    final: Trajectory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    closures = find_loop_closures(solution_keyframes(solutions, {drive.name: final})).closures
    with caplog.at_level("INFO", logger="adcloud.hdmap.poses"):
        ahead = join_segments(solutions, {drive.name: drive.gps}, closures).trajectories
    behind = join_segments(solutions[::-1], {drive.name: drive.gps}, closures).trajectories
    forward, backward = ahead[drive.name], behind[drive.name]
    assert np.array_equal(forward.t, backward.t)
    assert np.abs(forward.matrices - backward.matrices).max() < 1e-6
    # the drive's gravity offset is reported: a few mrad, as the synthetic IMU's bias gives
    said = [r.getMessage() for r in caplog.records if "tilt offset" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"join: drive {drive.name}: gravity's")
    x, y = (float(v) for v in said[0].split("(")[1].split(")")[0].split(","))
    assert 0.5 < np.hypot(x, y) < 15


# -- gravity's tilt offset ---------------------------------------------------------------------


def _attitude_graph(
    up: np.ndarray, poses: np.ndarray, cfg: PoseSettings
) -> tuple[gtsam.NonlinearFactorGraph, gtsam.Values, int]:
    """Poses tied by their exact relative motion with a scan match's noise (1 mrad, 2 cm), the
    first held loosely, each with the gravity direction ``up`` (k, 3) measured in its body
    frame."""
    graph, values = gtsam.NonlinearFactorGraph(), gtsam.Values()
    tight = gtsam.noiseModel.Diagonal.Sigmas(np.r_[np.full(3, 1e-3), np.full(3, 0.02)])
    for j, pose in enumerate(poses):
        values.insert(_key(j), gtsam.Pose3(pose))
        if j:
            rel = np.linalg.inv(poses[j - 1]) @ pose
            graph.add(gtsam.BetweenFactorPose3(_key(j - 1), _key(j), gtsam.Pose3(rel), tight))
    graph.add(
        gtsam.PriorFactorPose3(
            _key(0), gtsam.Pose3(poses[0]), gtsam.noiseModel.Isotropic.Sigma(6, 10.0)
        )
    )
    offset = _tilt_offset(graph, values, 0, cfg)
    for j in range(len(poses)):
        graph.add(_attitude_factor(_key(j), up[j], cfg, offset))
    return graph, values, offset


def test_the_attitude_factor_with_an_offset_has_the_derivative_of_its_error() -> None:
    cfg = PoseSettings()
    rng = np.random.default_rng(5)
    pose = np.eye(4)
    pose[:3, :3] = Rotation.from_rotvec(rng.normal(0, 0.3, 3)).as_matrix()
    up = Rotation.from_rotvec([0.01, -0.02, 0]).apply([0.0, 0.0, 1.0])
    graph, values, offset = _attitude_graph(up[None], pose[None], cfg)
    values.update(offset, np.array([0.003, -0.002]))
    factor = graph.at(graph.size() - 1)
    linear = factor.linearize(values)
    assert list(linear.keys()) == [_key(0), offset]
    whitened, _ = linear.jacobian()
    analytic = whitened * cfg.attitude_sigma_rad
    step = 1e-6
    numeric = np.zeros((3, 8))
    for i in range(8):
        moved = gtsam.Values(values)
        delta = np.zeros(8)
        delta[i] = step
        if i < 6:
            moved.update(_key(0), values.atPose3(_key(0)).retract(delta[:6]))
        else:
            moved.update(offset, values.atVector(offset) + delta[6:])
        numeric[:, i] = (factor.unwhitenedError(moved) - factor.unwhitenedError(values)) / step
    np.testing.assert_allclose(analytic, numeric, atol=1e-5)


def test_gravitys_tilt_offset_is_found_where_the_car_turns() -> None:
    """A car driving a full circle on flat ground, its gravity 4 and -3 mrad off in the body
    frame: the graph finds the offset and keeps roll and pitch right; taken as measured,
    the offset tilts the ring."""
    k = 48
    headings = np.linspace(0, 2 * np.pi, k, endpoint=False)
    poses = np.tile(np.eye(4), (k, 1, 1))
    poses[:, :3, :3] = Rotation.from_euler("z", headings[:, None]).as_matrix()
    poses[:, 0, 3], poses[:, 1, 3] = 30 * np.sin(headings), 30 * (1 - np.cos(headings))
    true_offset = np.array([0.004, -0.003])
    rng = np.random.default_rng(2)
    up = poses[:, 2, :3] + np.r_[true_offset, 0.0] + rng.normal(0, 2e-4, (k, 3))
    up /= np.linalg.norm(up, axis=1, keepdims=True)

    def tilt_errors(cfg: PoseSettings) -> tuple[np.ndarray, gtsam.Values, int]:
        graph, values, offset = _attitude_graph(up, poses, cfg)
        result = gtsam.LevenbergMarquardtOptimizer(graph, values).optimize()
        solved = np.array([result.atPose3(_key(j)).matrix() for j in range(k)])
        errors = np.linalg.norm(solved[:, 2, :2] - poses[:, 2, :2], axis=1)  # world up, x/y
        return errors, result, offset

    errors, result, offset = tilt_errors(PoseSettings())
    np.testing.assert_allclose(result.atVector(offset), true_offset, atol=3e-4)
    assert errors.max() < 5e-4
    as_measured, _, _ = tilt_errors(PoseSettings(tilt_bias_sigma_rad=0.0))
    assert np.median(as_measured) > 2e-3


# -- accuracy ----------------------------------------------------------------------------------


def test_loop_drive_is_recovered_to_a_few_centimetres(
    drive: DriveData,
    truth: Trajectory,
    propagated: Trajectory,
    joined: Trajectory,
    closures: list[LoopClosure],
    final: Trajectory,
    record_property: Callable[[str, object], None],
) -> None:
    ate = absolute_trajectory_error(final, truth)
    before = absolute_trajectory_error(joined, truth).rmse
    dead_reckoning = absolute_trajectory_error(propagated, truth).rmse
    record_property("ate_rmse_m", ate.rmse)
    record_property("ate_before_loops_m", before)
    record_property("ate_dead_reckoning_m", dead_reckoning)
    assert closures, "the drive comes back to its start: a loop closure must be found"
    assert all(abs(c.a[1] - c.b[1]) > 30 * NS for c in closures)
    assert ate.rmse <= ATE_TARGET_M
    assert ate.rmse < before and ate.rmse < dead_reckoning / 10
    # The dense trajectory covers the drive at the IMU's rate.
    assert final.t[0] <= drive.scans[0].stamp and final.t[-1] >= drive.scans[-1].stamp - NS // 10
    assert np.median(np.diff(final.t)) == NS // 100
    # ... and is as good inside the GPS outage (20-30 s) as elsewhere.
    t0 = int(drive.odom.t[0])
    outage = final.between(t0 + 20 * NS, t0 + 30 * NS)
    moved = outage.xyz @ ate.alignment[:3, :3].T + ate.alignment[:3, 3]
    inside = np.linalg.norm(moved - truth.at(outage.t)[:, :3, 3], axis=1)
    assert np.sqrt(np.mean(inside**2)) <= ATE_TARGET_M


def test_bad_gps_fixes_and_a_long_outage_do_not_break_it(
    drive: DriveData, truth: Trajectory, propagated: Trajectory
) -> None:
    g = drive.gps
    rng = np.random.default_rng(3)
    secs = (g.t - g.t[0]) / NS
    candidates = np.flatnonzero((secs < 15) | (secs > 45))
    bad = np.sort(rng.choice(candidates, 8, replace=False))
    enu = g.enu.copy()
    angle = rng.uniform(0, 2 * np.pi, len(bad))
    enu[bad, 0] += 20 * np.cos(angle)
    enu[bad, 1] += 20 * np.sin(angle)
    # No fix at all from 15 s to 45 s: the middle segment has no GPS of its own.
    keep = (secs < 15) | (secs > 45)
    fixes = GpsFixes(g.frame, g.t[keep], enu[keep], g.sigma[keep])
    spoiled = dataclasses.replace(drive, gps=fixes)
    # GPS handling is under test, not scan matching: forward matches alone keep it cheap.
    settings = PoseSettings(backward_matching=False)
    solutions = [solve_segment(s, settings) for s in split_segments(spoiled, propagated, settings)]
    rejected = np.concatenate([s.gps_rejected for s in solutions])
    assert np.isin(g.t[bad], rejected).all()
    assert not solutions[1].anchored
    gps = {drive.name: fixes}
    joined = join_segments(solutions, gps, (), settings).trajectories
    closures = find_loop_closures(solution_keyframes(solutions, joined)).closures
    final = join_segments(solutions, gps, closures, settings).trajectories[drive.name]
    assert absolute_trajectory_error(final, truth).rmse <= ATE_TARGET_M


def test_estimate_trajectory_runs_the_same_steps(drive: DriveData, truth: Trajectory) -> None:
    short = _cut(drive, drive.name, 0.0, 12.0)
    settings = PoseSettings(segment_seconds=6.0, segment_overlap_s=1.5, backward_matching=False)
    estimate = estimate_trajectory(short, settings)
    propagated = propagate(short.imu, short.odom, short.extrinsics, settings)
    solutions = [solve_segment(s, settings) for s in split_segments(short, propagated, settings)]
    assert len(solutions) == 2
    joined = join_segments(solutions, {short.name: short.gps}, (), settings).trajectories
    by_hand = joined[short.name]
    assert np.array_equal(estimate.t, by_hand.t)
    if sums_in_any_order():
        # a GPU's float atomics add voxel centroids in whatever order work-items finish,
        # which moves the result by fractions of a millimetre
        assert np.abs(estimate.matrices - by_hand.matrices).max() < 2e-3
    else:  # CPUs and NumPy sum in input order: the same steps give the same bits
        np.testing.assert_array_equal(estimate.matrices, by_hand.matrices)
    assert absolute_trajectory_error(estimate, truth).rmse <= ATE_TARGET_M


def test_a_segment_solves_the_same_from_clouds_made_elsewhere(drive: DriveData) -> None:
    # The job de-skews keyframes where their sweeps are and ships only the clouds.
    short = _cut(drive, drive.name, 0.0, 6.0)
    settings = PoseSettings(segment_seconds=6.0, backward_matching=False, device="numpy")
    propagated = propagate(short.imu, short.odom, short.extrinsics, settings)
    segment = split_segments(short, propagated, settings)[0]
    clouds = tuple(segment.keyframe_cloud(s, settings) for s in segment.scans)
    assert len(clouds) == len(segment.stamps) and all(c.dtype == np.float32 for c in clouds)
    sweeps = sum(s.xyz.nbytes + s.intensity.nbytes + s.dt.nbytes for s in segment.scans)
    assert sum(c.nbytes for c in clouds) < sweeps / 3  # what the job's shuffle no longer moves
    from_scans = solve_segment(segment, settings)
    from_clouds = solve_segment(dataclasses.replace(segment, scans=(), clouds=clouds), settings)
    np.testing.assert_array_equal(from_clouds.stamps, from_scans.stamps)
    np.testing.assert_allclose(from_clouds.poses, from_scans.poses, atol=1e-9)
    with pytest.raises(HdmapError, match="clouds"):
        solve_segment(dataclasses.replace(segment, scans=(), clouds=clouds[1:]), settings)


# -- loop closures -----------------------------------------------------------------------------


def _keyframe(drive: str, stamp_s: float, x: float, travel: float) -> Keyframe:
    pose = np.eye(4)
    pose[0, 3] = x
    return Keyframe(drive, int(stamp_s * NS), pose, travel, np.zeros((0, 3), np.float32))


def test_loop_candidates_need_a_real_revisit() -> None:
    settings = LoopSettings(search_radius_m=5.0, min_travel_m=50.0, min_interval_s=10.0, stride=1)
    keyframes = [
        _keyframe("a", 0.0, 0.0, 0.0),
        _keyframe("a", 1.0, 3.0, 3.0),  # a neighbour along the drive: not a loop
        _keyframe("a", 60.0, 1.0, 300.0),  # back at the start after 300 m: a loop
        _keyframe("a", 61.0, 40.0, 301.0),  # far from everything
        _keyframe("b", 5.0, 0.5, 0.0),  # another drive of the same place
    ]
    pairs = loop_candidates(keyframes, settings)
    assert (0, 2) in pairs or (1, 2) in pairs
    assert (0, 1) not in pairs
    assert not any(3 in p for p in pairs)
    assert any(
        4 in p and {keyframes[p[0]].drive, keyframes[p[1]].drive} == {"a", "b"} for p in pairs
    )
    too_soon = dataclasses.replace(settings, min_interval_s=100.0)
    assert all(
        keyframes[i].drive != keyframes[j].drive for i, j in loop_candidates(keyframes, too_soon)
    )


def test_verify_loop_accepts_a_revisit_and_rejects_a_wrong_guess(
    drive: DriveData, solutions: list[SegmentSolution], final: Trajectory, truth: Trajectory
) -> None:
    keyframes = solution_keyframes(solutions, {drive.name: final})
    settings = LoopSettings()
    start = 1
    back = min(
        range(len(keyframes) // 2, len(keyframes)),
        key=lambda i: np.linalg.norm(keyframes[i].pose[:3, 3] - keyframes[start].pose[:3, 3]),
    )
    a = local_keyframe(keyframes, start, settings.map_keyframes)
    b = local_keyframe(keyframes, back, settings.map_keyframes)
    closure = verify_loop(a, b, settings)
    assert closure is not None
    true_rel = np.linalg.inv(truth.at(a.stamp)[0]) @ truth.at(b.stamp)[0]
    assert np.linalg.norm(closure.relative[:3, 3] - true_rel[:3, 3]) < 0.05
    # A keyframe from the far side of the loop, claimed to be where b is: ICP must not
    # turn that into a closure.
    far = max(
        range(len(keyframes)),
        key=lambda i: np.linalg.norm(keyframes[i].pose[:3, 3] - keyframes[start].pose[:3, 3]),
    )
    impostor = dataclasses.replace(
        local_keyframe(keyframes, far, settings.map_keyframes), pose=b.pose
    )
    assert verify_loop(a, impostor, settings) is None


def test_loop_closures_tie_two_drives_of_the_same_area(drive: DriveData, truth: Trajectory) -> None:
    first, second = _cut(drive, "first", 0.0, 22.0), _cut(drive, "second", 35.0, 60.0)
    settings = PoseSettings(backward_matching=False)  # the closures are under test
    solutions = []
    for part in (first, second):
        moved = propagate(part.imu, part.odom, part.extrinsics, settings)
        solutions += [solve_segment(s, settings) for s in split_segments(part, moved, settings)]
    gps = {first.name: first.gps, second.name: second.gps}
    apart = join_segments(solutions, gps, (), settings).trajectories
    closures = find_loop_closures(solution_keyframes(solutions, apart)).closures
    assert any(c.a[0] != c.b[0] for c in closures)
    together = join_segments(solutions, gps, closures, settings).trajectories

    assert _ate_of_all(together, truth) < 0.5 * _ate_of_all(apart, truth)
    assert _ate_of_all(together, truth) < 0.1


def _ate_of_all(trajectories: dict[str, Trajectory], truth: Trajectory) -> float:
    """One ATE over all drives: small only when they agree with each other."""
    t = np.concatenate([traj.t for traj in trajectories.values()])
    m = np.concatenate([traj.matrices for traj in trajectories.values()])
    return absolute_trajectory_error(Trajectory(t, m), truth).rmse


def _solve_drive(part: DriveData, settings: PoseSettings) -> list[SegmentSolution]:
    moved = propagate(part.imu, part.odom, part.extrinsics, settings)
    return [solve_segment(s, settings) for s in split_segments(part, moved, settings)]


def test_a_new_drive_is_tied_to_the_fixed_keyframes_of_the_map(
    drive: DriveData, truth: Trajectory, tmp_path: Path
) -> None:
    """An incremental build: the first drive is the map (its keyframes archived); the
    second, whose GPS reads 1.5 m north all along, is pulled onto it by closures to those
    keyframes, which do not move."""
    settings = PoseSettings(backward_matching=False)
    first = _cut(drive, "first", 0.0, 22.0)
    cut = _cut(drive, "second", 35.0, 60.0)
    gps = dataclasses.replace(cut.gps, enu=cut.gps.enu + np.array([0.0, 1.5, 0.0]))
    second = dataclasses.replace(cut, gps=gps)
    map_solutions = _solve_drive(first, settings)
    map_traj = join_segments(map_solutions, {"first": first.gps}, (), settings).trajectories
    archive = KeyframeArchive.write(
        tmp_path / "keyframes", solution_keyframes(map_solutions, map_traj)
    )

    solutions = _solve_drive(second, settings)
    alone = join_segments(solutions, {"second": gps}, (), settings).trajectories
    keyframes = solution_keyframes(solutions, alone)
    xy = np.array([k.pose[:2, 3] for k in keyframes])
    fixed = KeyframeArchive(tmp_path / "keyframes").near(xy, LoopSettings().search_radius_m)
    assert {k.drive for k in fixed} == {"first"} and len(fixed) == len(archive.load("first"))
    closures = find_loop_closures(keyframes, fixed=fixed).closures
    assert closures and all("second" in (c.a[0], c.b[0]) for c in closures)
    assert any("first" in (c.a[0], c.b[0]) for c in closures)
    tied = join_segments(solutions, {"second": gps}, closures, settings, fixed=fixed).trajectories
    assert set(tied) == {"second"}  # the map's drive is not re-solved
    apart_err = _ate_of_all({**map_traj, **alone}, truth)
    tied_err = _ate_of_all({**map_traj, **tied}, truth)
    assert apart_err > 0.5 and tied_err < 0.1, (apart_err, tied_err)


def test_a_drive_that_no_gps_fix_places_is_named(drive: DriveData, truth: Trajectory) -> None:
    """A drive without a fix, not tied by closures, is held with its start at the origin --
    tens of metres from where it drove -- which the join used to do silently. It names such
    drives; with no fix anywhere, the first drive defines the frame (the reference)."""
    settings = PoseSettings(backward_matching=False)
    first = _cut(drive, "first", 0.0, 22.0)
    cut = _cut(drive, "second", 35.0, 60.0)
    empty = GpsFixes(cut.gps.frame, cut.gps.t[:0], cut.gps.enu[:0], cut.gps.sigma[:0])
    blind = dataclasses.replace(cut, gps=empty)
    solutions = _solve_drive(first, settings) + _solve_drive(blind, settings)

    joined = join_segments(solutions, {"first": first.gps, "second": empty}, (), settings)
    assert joined.unanchored == ("second",) and joined.reference == ()
    placed = joined.trajectories["second"].xyz[0]
    map_traj = joined.trajectories["first"]
    align = rigid_alignment(map_traj.xyz, truth.at(map_traj.t)[:, :3, 3])
    start = truth.at(cut.odom.t[:1])[0, :3, 3]
    assert np.linalg.norm(placed[:2]) < 1.0  # at the origin ...
    assert np.linalg.norm((align[:3, :3] @ placed + align[:3, 3] - start)[:2]) > 10.0  # not there

    nothing = join_segments(solutions, {}, (), settings)
    assert nothing.unanchored == ("second",) and nothing.reference == ("first",)
    only = join_segments(_solve_drive(blind, settings), {}, (), settings)
    assert only.unanchored == () and only.reference == ("second",)
    with_fix = join_segments(_solve_drive(first, settings), {"first": first.gps}, (), settings)
    assert with_fix.unanchored == () and with_fix.reference == ()


def _offset_from_map(
    map_traj: Trajectory, traj: Trajectory, truth: Trajectory
) -> tuple[float, float]:
    """Median and largest distance (m) of ``traj`` from the truth in the frame in which
    the map's trajectory ``map_traj`` best fits the truth: how far from where it belongs
    relative to the map a drive was placed."""
    align = rigid_alignment(map_traj.xyz, truth.at(map_traj.t)[:, :3, 3])
    placed = traj.xyz @ align[:3, :3].T + align[:3, 3]
    off = np.linalg.norm(placed - truth.at(traj.t)[:, :3, 3], axis=1)
    return float(np.median(off)), float(off.max())


def test_a_drive_that_overlaps_the_map_a_little_is_tied_to_it_not_to_its_gps(
    drive: DriveData, truth: Trajectory, tmp_path: Path
) -> None:
    """The map's drive (3-20 s) and a new 33 s drive (25-58 s, its GPS 2.2 m north of the
    map's) share only the few metres where the loop comes back: one closure ties them.
    That closure, not the new drive's 150 fixes repeating their bias, decides where the
    drive lies (a per-drive GPS offset in the join; with its fixes taken as independent the
    drive stayed 2.1 m off, the one closure outvoted). Backward matching keeps the new
    drive's shape good to a few centimetres away from the closure. The join returns the
    offset it estimated for the drive's GPS (the 2.2 m north), for the build's report."""
    settings = PoseSettings()
    first = _cut(drive, "first", 3.0, 20.0)
    cut = _cut(drive, "second", 25.0, 58.0)
    gps = dataclasses.replace(cut.gps, enu=cut.gps.enu + np.array([0.0, 2.2, 0.0]))
    map_solutions = _solve_drive(first, settings)
    map_joined = join_segments(map_solutions, {"first": first.gps}, (), settings)
    assert map_joined.gps_offsets == {}  # no closure: the drive is placed by its GPS
    map_traj = map_joined.trajectories["first"]
    fixed = solution_keyframes(map_solutions, {"first": map_traj})
    solutions = _solve_drive(dataclasses.replace(cut, gps=gps), settings)
    alone = join_segments(solutions, {"second": gps}, (), settings).trajectories
    found = find_loop_closures(solution_keyframes(solutions, alone), fixed=fixed)
    closures = found.closures
    assert found.untied == []  # tied: not named among the drives close but untied
    assert len([c for c in closures if "first" in (c.a[0], c.b[0])]) == 1  # a little overlap
    joined = join_segments(solutions, {"second": gps}, closures, settings, fixed=fixed)
    tied = joined.trajectories["second"]
    assert set(joined.gps_offsets) == {"second"}
    # fix minus pose, in map ENU: the 2.2 m north it was given, give or take the map
    # drive's own GPS error where the closure ties them (decimetres)
    east, north, _ = joined.gps_offsets["second"]
    assert abs(east) < 0.5 and abs(north - 2.2) < 0.5, joined.gps_offsets
    gps_only = _offset_from_map(map_traj, alone["second"], truth)
    median, largest = _offset_from_map(map_traj, tied, truth)
    assert gps_only[0] > 1.5 and median < 0.1 and largest < 0.25, (gps_only, median, largest)
    # with the offset off, the drive's own fixes win (the earlier behaviour)
    off = dataclasses.replace(settings, gps_drive_bias_sigma_m=0.0)
    held = join_segments(solutions, {"second": gps}, closures, off, fixed=fixed)
    assert held.gps_offsets == {}
    assert _offset_from_map(map_traj, held.trajectories["second"], truth)[0] > 1.0


def test_the_biased_gps_factor_has_the_derivative_of_its_error() -> None:
    rng = np.random.default_rng(3)
    pose = gtsam.Pose3(
        gtsam.Rot3(Rotation.from_rotvec(rng.normal(0, 0.5, 3)).as_matrix()), rng.normal(0, 5, 3)
    )
    lever, fix = np.array([0.3, -0.2, 1.6]), rng.normal(0, 5, 3)
    bias = int(gtsam.symbol("g", 0))
    noise = gtsam.noiseModel.Isotropic.Sigma(3, 1.0)
    factor = _biased_gps_factor(_key(0), bias, fix, lever, noise)
    values = gtsam.Values()
    values.insert(_key(0), pose)
    values.insert(bias, np.array([0.4, -1.1, 0.2]))
    # with no offset it is GTSAM's GPSFactorArm
    plain = gtsam.GPSFactorArm(_key(0), fix, lever, noise)
    zero = gtsam.Values(values)
    zero.update(bias, np.zeros(3))
    np.testing.assert_allclose(factor.unwhitenedError(zero), plain.unwhitenedError(zero))
    analytic, _ = factor.linearize(values).jacobian()
    numeric = np.zeros((3, 9))
    step = 1e-6
    for i in range(9):
        moved = gtsam.Values(values)
        delta = np.zeros(9)
        delta[i] = step
        if i < 6:
            moved.update(_key(0), pose.retract(delta[:6]))
        else:
            moved.update(bias, values.atVector(bias) + delta[6:])
        numeric[:, i] = (factor.unwhitenedError(moved) - factor.unwhitenedError(values)) / step
    np.testing.assert_allclose(analytic, numeric, atol=1e-5)


def test_drives_that_come_close_but_are_not_tied_are_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Keyframes of two drives a few metres apart whose sweeps cannot be registered (here:
    empty): no closure, and a warning names both drives, since each is then placed by its
    own GPS alone."""
    keyframes = [_keyframe("a", 0.0, 0.0, 0.0), _keyframe("b", 100.0, 3.0, 0.0)]
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.loops"):
        found = find_loop_closures(keyframes, device="numpy")
    assert found.closures == []
    # returned for the build's report, not only logged
    assert found.untied == [UntiedDrives(("a", "b"), 1, 3.0)]
    note = found.untied[0].note()
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == f"loop closures: {note}"
    assert "drives a and b come within 3.0 m" in note and "1 candidate keyframe pair" in note
    assert "not tied" in note and "own GPS alone" in note


def test_a_drive_that_comes_close_to_no_other_is_named_as_not_joined(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Drive c runs 400 m from drives a and b: no candidate pair, no closure, and nothing
    said -- its poses rested on its own GPS alone, silently. It is named with the search
    radius; so is a new drive far from every drive of the map (whose keyframes were too far
    to be loaded as fixed ones); a drive alone in a map of one is not."""
    keyframes = [_keyframe("a", 0.0, 0.0, 0.0), _keyframe("b", 100.0, 3.0, 0.0)]
    keyframes.append(_keyframe("c", 0.0, 400.0, 0.0))
    with caplog.at_level(logging.WARNING, logger="adcloud.hdmap.loops"):
        found = find_loop_closures(keyframes, LoopSettings(search_radius_m=9.5), device="numpy")
    assert found.alone == [LoneDrive("c", 9.5)]
    assert found.untied == [UntiedDrives(("a", "b"), 1, 3.0)]  # close: named as untied
    note = found.alone[0].note()
    assert f"loop closures: {note}" in [r.getMessage() for r in caplog.records]
    assert note.startswith("drive c is not joined to the map's other drives")
    assert "within 9.5 m (hdmap_loops.search_radius_m) of none of them" in note
    assert "own GPS alone" in note and "raise hdmap_loops.search_radius_m" in note
    # an incremental build: the map's drives all too far to be loaded
    alone = find_loop_closures([_keyframe("new", 0.0, 0.0, 0.0)], map_drives={"old"}).alone
    assert alone == [LoneDrive("new", LoopSettings().search_radius_m)]
    near = [_keyframe("old", 0.0, 2.0, 0.0)]
    found = find_loop_closures(
        [_keyframe("new", 0.0, 0.0, 0.0)], device="numpy", fixed=near, map_drives={"old"}
    )
    assert found.alone == [] and [u.drives for u in found.untied] == [("new", "old")]
    # one drive: there is nothing to join it to
    assert find_loop_closures([_keyframe("only", 0.0, 0.0, 0.0)]).alone == []


def test_drives_tied_through_a_third_are_not_named_as_untied() -> None:
    """Drives a and b come close with no closure between them, but each is tied to c: the
    three hold together, so the report does not say a and b are placed by their own GPS
    alone; d, close to a and tied to nothing, is named."""
    keyframes = [
        _keyframe("a", 0.0, 0.0, 0.0),
        _keyframe("b", 0.0, 3.0, 0.0),
        _keyframe("c", 0.0, 1.0, 0.0),
        _keyframe("d", 0.0, -2.0, 0.0),
    ]
    pairs = [(0, 1), (0, 2), (1, 2), (0, 3)]
    closures = [
        LoopClosure(("a", 0), ("c", 0), np.eye(4), 1.0, 0.0, 0.0),
        LoopClosure(("c", 0), ("b", 0), np.eye(4), 1.0, 0.0, 0.0),
    ]
    assert _untied(keyframes, pairs, closures) == [UntiedDrives(("a", "d"), 1, 2.0)]


def test_keyframe_archive_loads_only_nearby_drives_and_names_bad_files(tmp_path: Path) -> None:
    here = [
        dataclasses.replace(_keyframe("near", i, i, i), cloud=np.full((4, 3), i, np.float32))
        for i in range(3)
    ]
    there = [_keyframe("far", i, 500.0 + i, i) for i in range(3)]
    one = KeyframeArchive.write(tmp_path / "v1", here)
    two = KeyframeArchive.write(tmp_path / "v2", there, carry=one)
    assert sorted(two.bounds) == ["far", "near"]
    assert two.bounds["far"] == (500.0, 0.0, 502.0, 0.0)
    got = two.near(np.array([[1.0, 5.0]]), radius_m=8.0)
    assert [k.key for k in got] == [k.key for k in here]
    np.testing.assert_array_equal(got[1].cloud, here[1].cloud)
    assert two.near(np.array([[1.0, 5.0]]), radius_m=8.0, exclude={"near"}) == []
    assert two.near(np.array([[250.0, 0.0]]), radius_m=8.0) == []
    assert KeyframeArchive(tmp_path / "missing").near(np.zeros((1, 2)), 8.0) == []
    (tmp_path / "v2" / "index.json").write_text('{"drives": {"far": [1, 2]}}')
    with pytest.raises(MapFormatError, match=r"v2/index.json: not a keyframe index"):
        KeyframeArchive(tmp_path / "v2")
    (tmp_path / "v1" / "near.npz").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(MapFormatError, match=r"v1/near.npz"):
        one.load("near")


# -- baseline ----------------------------------------------------------------------------------


def test_kiss_icp_baseline_runs_and_is_beaten(
    drive: DriveData,
    final: Trajectory,
    truth: Trajectory,
    record_property: Callable[[str, object], None],
) -> None:
    scans = drive.scans[:60]
    kiss = kiss_icp_trajectory(scans, mount=drive.extrinsics.get("lidar"))
    assert np.array_equal(kiss.t, [s.stamp for s in scans])
    assert np.allclose(kiss.matrices[0], np.eye(4))
    kiss_ate = absolute_trajectory_error(kiss, truth).rmse
    ours = absolute_trajectory_error(final.between(int(kiss.t[0]), int(kiss.t[-1])), truth).rmse
    record_property("kiss_icp_ate_first_6s_m", kiss_ate)
    record_property("ours_ate_first_6s_m", ours)
    assert kiss_ate < 1.0  # it does track the car
    assert ours < kiss_ate


def test_kiss_icp_baseline_rejects_bad_input(drive: DriveData) -> None:
    with pytest.raises(DriveDataError, match="at least 2"):
        kiss_icp_trajectory(drive.scans[:1])
    with pytest.raises(DriveDataError, match="sort the sweeps"):
        kiss_icp_trajectory([drive.scans[1], drive.scans[0]])
