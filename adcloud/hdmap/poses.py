"""Stage 1 of the HD-map build: pose recovery from IMU, wheel odometry, GPS and LiDAR.

The recipe, as the Spark job runs it (segments in parallel on executors, the join on the
driver) and as :func:`estimate_trajectory` runs it in one process:

1. :func:`propagate` dead-reckons a 3D trajectory from wheel speed and the gyro (rotated
   into ``base_link`` through the IMU mount), holding roll and pitch to gravity as the
   accelerometer sees it once the car's own acceleration is taken out. It is smooth and
   locally good, but its scale and heading drift.
2. :func:`split_segments` picks keyframe sweeps (every ``keyframe_distance_m`` of travel)
   and cuts the drive into overlapping segments of ``segment_seconds``.
3. :func:`solve_segment` (one executor task per segment) de-skews each keyframe sweep with
   the propagated motion (per-point ``dt``), voxel-downsamples it, registers it onto a
   local map of the keyframes before it and the keyframe before it onto a local map of the
   keyframes from it on, with point-to-plane ICP (:func:`adcloud.hetero.align`, OpenCL or
   its NumPy reference), and solves a GTSAM factor graph: ``Pose3`` keyframes, odometry and
   scan-matching ``BetweenFactorPose3``, and ``GPSFactorArm`` factors on the antenna's
   lever arm with a robust (Cauchy or Huber) noise model after a gate on the residual to
   a robust first fit, so bad fixes cannot pull the segment; Levenberg-Marquardt.
4. :func:`join_segments` builds the global graph: each segment's solution enters as
   relative poses between its consecutive keyframes (the overlap makes neighbouring
   segments share keyframes, which ties them together), the GPS fixes again, and the loop
   closures of :mod:`adcloud.hdmap.loops` (within a drive and across drives of the same
   area). The result is a dense trajectory per drive: the segments' corrected propagated
   motion, moved onto the globally optimised keyframes.

GPS outages need nothing special: LiDAR and odometry factors carry the chain through;
fixes far from a robust fit of the segment are dropped before the solve and the robust
kernel deflates the rest. A constant GPS bias shifts the whole map (it is unobservable);
the accuracy figures therefore use :func:`~adcloud.hdmap.trajectory.absolute_trajectory_error`
with rigid alignment.

Frames: ``map`` ENU (the GPS fixes' frame), ``base_link`` FLU; the propagated trajectory is
in a drive-local ``odom`` frame (start at the origin, heading east, tilted to gravity).
Times are int64 ns, distances metres, angles radians.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import gtsam
import numpy as np
from numpy.typing import NDArray
from scipy.ndimage import uniform_filter1d
from scipy.spatial.transform import Rotation

from adcloud.config import load_settings
from adcloud.hdmap.drive import DriveData
from adcloud.hdmap.errors import DriveDataError, HdmapError
from adcloud.hdmap.loops import Keyframe, LoopClosure, LoopSettings, find_loop_closures
from adcloud.hdmap.model import Extrinsics, GpsFixes, ImuSamples, OdomSamples, Scan
from adcloud.hdmap.trajectory import Trajectory
from adcloud.hetero import HeteroError, align, voxel_downsample
from adcloud.hetero.devices import ComputeDevice, as_device

__all__ = [
    "JoinedPoses",
    "PoseSettings",
    "SegmentInput",
    "SegmentSolution",
    "deskew_scan",
    "estimate_trajectory",
    "join_segments",
    "propagate",
    "select_keyframes",
    "solution_keyframes",
    "solve_segment",
    "split_segments",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]
_NS = 1_000_000_000
_GRAVITY = 9.80665
_ROBUST_KERNELS = ("cauchy", "huber")


@dataclass(frozen=True)
class PoseSettings:
    """Settings of pose recovery (section ``hdmap_poses``, env ``ADCLOUD_HDMAP_POSES_*``).

    Propagation: roll/pitch follow gravity with time constant ``tilt_time_constant_s``
    (0: gyro only); the gyro's yaw bias is tracked against the odometry's yaw rate with
    ``yaw_bias_time_constant_s`` (0: off).

    Keyframes and segments: a keyframe every ``keyframe_distance_m`` of travel,
    ``keyframe_angle_rad`` of turn or ``keyframe_max_interval_s``; segments of
    ``segment_seconds`` sharing ``segment_overlap_s`` with the next.

    Scan matching: points between ``min_range_m`` and ``max_range_m`` of the sensor,
    downsampled to ``voxel_m``; each keyframe is registered onto a local map of its
    ``local_map_keyframes`` predecessors (ICP: ``icp_max_distance_m`` correspondence
    distance, ``normal_radius_m``, ``icp_huber_m``, ``icp_iterations``; the sweep itself
    coarser, at ``source_voxel_m``) and, with ``backward_matching``, the keyframe before
    it onto a local map of the keyframes from it on and accepted with fitness at least
    ``icp_min_fitness``, RMSE at most ``icp_max_rmse_m`` and within ``icp_max_correction_m``
    of the propagated guess; weighted by ``icp_sigma_translation_m`` /
    ``icp_sigma_rotation_rad``. ``device``: the OpenCL address for ICP (None: the hetero
    selection policy; ``"numpy"``: the reference).

    Odometry factors: translation sigma ``odom_sigma_fraction`` of the distance plus
    ``odom_sigma_floor_m``; rotation ``odom_sigma_rotation_rad`` plus
    ``odom_sigma_rotation_rate`` per second.

    GPS: sigma of a fix ``gps_sigma_scale`` times its reported sigma, at least
    ``gps_sigma_floor_m``; robust kernel ``gps_robust`` (``cauchy`` or ``huber``) at
    ``gps_robust_k`` sigmas; fixes further than ``gps_gate_m`` from the segment's robust
    first fit are dropped. A segment is anchored to GPS when it has ``gps_min_fixes`` fixes
    spread over ``gps_min_extent_m``; otherwise it stays in its own frame until the join.
    Each drive's fixes share an error (the receiver's bias on that day; two drives differ
    by a metre or two): in the join, a drive that loop closures tie to another drive or to
    the map gets a 3D offset of its fixes (zero-mean prior of ``gps_drive_bias_sigma_m``),
    so that the closures, not the hundreds of fixes repeating the same bias, decide where
    it lies relative to the other drive. 0 turns the offset off.

    Gravity: every keyframe's roll and pitch are held to the propagated tilt (the
    accelerometer's gravity) by an attitude factor of ``attitude_sigma_rad``; without it
    the graph's roll and pitch are set only by the GPS heights, and a map can come out
    tilted by a degree. That gravity is off by a few milliradians in the body frame (the
    accelerometer's bias, the IMU's mounting, acceleration the propagation does not take
    out), the same all along a drive: each graph estimates this offset (2 DoF, one per
    segment and one per drive in the join, prior ``tilt_bias_sigma_rad``) with the poses.
    Where the car turns, scan matching ties keyframes of different headings, which a
    body-frame offset tilts different ways, and the offset comes out; without it, strong
    attitude factors would pull each heading towards its own wrong tilt. 0 takes gravity
    as measured.

    Solver: at most ``max_iterations`` Levenberg-Marquardt iterations. Loop closures are
    looked for when ``loop_closure`` is on (see :class:`~adcloud.hdmap.loops.LoopSettings`).
    """

    tilt_time_constant_s: float = 1.0
    yaw_bias_time_constant_s: float = 10.0
    keyframe_distance_m: float = 6.0
    keyframe_angle_rad: float = 0.2
    keyframe_max_interval_s: float = 2.0
    segment_seconds: float = 20.0
    segment_overlap_s: float = 2.0
    min_range_m: float = 2.0
    max_range_m: float = 80.0
    voxel_m: float = 0.4
    source_voxel_m: float = 0.8
    normal_radius_m: float = 1.0
    local_map_keyframes: int = 6
    backward_matching: bool = True
    icp_max_distance_m: float = 1.0
    icp_huber_m: float = 0.1
    icp_iterations: int = 30
    icp_min_fitness: float = 0.3
    icp_max_rmse_m: float = 0.15
    icp_max_correction_m: float = 1.5
    icp_sigma_translation_m: float = 0.02
    icp_sigma_rotation_rad: float = 0.001
    odom_sigma_fraction: float = 0.05
    odom_sigma_floor_m: float = 0.05
    odom_sigma_rotation_rad: float = 0.005
    odom_sigma_rotation_rate: float = 0.005
    gps_sigma_scale: float = 3.0
    gps_sigma_floor_m: float = 0.3
    gps_vertical_scale: float = 1.0
    gps_robust: str = "cauchy"
    gps_robust_k: float = 2.0
    gps_gate_m: float = 6.0
    gps_min_fixes: int = 5
    gps_min_extent_m: float = 20.0
    gps_drive_bias_sigma_m: float = 1.0
    attitude_sigma_rad: float = 0.005
    tilt_bias_sigma_rad: float = 0.01
    max_iterations: int = 100
    loop_closure: bool = True
    device: str | None = None

    def __post_init__(self) -> None:
        positive = (
            "keyframe_distance_m",
            "keyframe_angle_rad",
            "keyframe_max_interval_s",
            "segment_seconds",
            "max_range_m",
            "voxel_m",
            "normal_radius_m",
            "icp_max_distance_m",
            "icp_max_rmse_m",
            "icp_max_correction_m",
            "icp_sigma_translation_m",
            "icp_sigma_rotation_rad",
            "attitude_sigma_rad",
            "odom_sigma_floor_m",
            "odom_sigma_rotation_rad",
            "gps_sigma_scale",
            "gps_sigma_floor_m",
            "gps_robust_k",
            "gps_gate_m",
        )
        for name in positive:
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise HdmapError(f"pose settings: {name} must be > 0, got {value!r}")
        non_negative = (
            "tilt_time_constant_s",
            "yaw_bias_time_constant_s",
            "segment_overlap_s",
            "min_range_m",
            "icp_huber_m",
            "odom_sigma_fraction",
            "odom_sigma_rotation_rate",
            "tilt_bias_sigma_rad",
            "gps_drive_bias_sigma_m",
        )
        for name in non_negative:
            value = getattr(self, name)
            if not (np.isfinite(value) and value >= 0):
                raise HdmapError(f"pose settings: {name} must be >= 0, got {value!r}")
        if self.gps_robust not in _ROBUST_KERNELS:
            raise HdmapError(
                f"pose settings: gps_robust must be one of {', '.join(_ROBUST_KERNELS)}, "
                f"got {self.gps_robust!r}"
            )
        if self.local_map_keyframes < 1 or self.icp_iterations < 1 or self.max_iterations < 1:
            raise HdmapError(
                "pose settings: local_map_keyframes, icp_iterations and max_iterations must be "
                f">= 1, got {self.local_map_keyframes}, {self.icp_iterations}, "
                f"{self.max_iterations}"
            )
        if not 0 < self.icp_min_fitness <= 1:
            raise HdmapError(
                f"pose settings: icp_min_fitness must be in (0, 1], got {self.icp_min_fitness}"
            )
        if self.segment_overlap_s >= self.segment_seconds:
            raise HdmapError(
                f"pose settings: segment_overlap_s ({self.segment_overlap_s}) must be shorter "
                f"than segment_seconds ({self.segment_seconds})"
            )

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> PoseSettings:
        """Defaults, then the ``hdmap_poses`` section of ``file``, then
        ``ADCLOUD_HDMAP_POSES_*``, then ``overrides``."""
        return load_settings(cls, "hdmap_poses", file=file, environ=environ, **overrides)


# -- propagation ---------------------------------------------------------------------------------


def _check_times(t: NDArray[Any], where: str) -> None:
    if t.ndim != 1 or len(t) < 2:
        raise DriveDataError(f"{where}: needs at least 2 samples, got {t.shape}")
    if np.any(np.diff(t) <= 0):
        bad = int(np.flatnonzero(np.diff(t) <= 0)[0]) + 1
        raise DriveDataError(
            f"{where}: times must increase strictly; sample {bad} ({int(t[bad])} ns) does not "
            "come after the one before it -- sort the stream or drop duplicates"
        )


def _check_rows(values: NDArray[Any], n: int, width: int | None, where: str) -> None:
    shape = (n,) if width is None else (n, width)
    if values.shape != shape:
        raise DriveDataError(f"{where}: expected shape {shape}, got {values.shape}")
    if not np.isfinite(values).all():
        bad = int(np.flatnonzero(~np.isfinite(values.reshape(n, -1)).all(axis=1))[0])
        raise DriveDataError(f"{where}: sample {bad} is not finite; drop it from the stream")


def propagate(
    imu: ImuSamples,
    odom: OdomSamples,
    extrinsics: Extrinsics,
    settings: PoseSettings | None = None,
) -> Trajectory:
    """Dead-reckoned ``base_link`` poses in a drive-local ``odom`` frame at the IMU's times
    (within the odometry's span).

    Wheel speed moves the car along its x axis; the gyro, rotated into ``base_link`` by the
    IMU mount, turns it. Roll and pitch are pulled towards gravity as the accelerometer
    measures it minus the car's own acceleration (``dv/dt`` forward, ``v * yaw rate``
    sideways), and the gyro's yaw bias is tracked against the odometry's yaw rate (see
    :class:`PoseSettings`). The first pose is at the origin with zero yaw.
    """
    cfg = settings or PoseSettings()
    _check_times(imu.t, "imu.t")
    _check_times(odom.t, "odom.t")
    _check_rows(imu.accel, len(imu.t), 3, "imu.accel")
    _check_rows(imu.gyro, len(imu.t), 3, "imu.gyro")
    _check_rows(odom.speed, len(odom.t), None, "odom.speed")
    _check_rows(odom.yaw_rate, len(odom.t), None, "odom.yaw_rate")
    try:
        mount = extrinsics.get(imu.frame)
    except KeyError:
        raise DriveDataError(
            f"extrinsics: no mount for the IMU frame {imu.frame!r} (known: "
            f"{', '.join(sorted(extrinsics.frames)) or 'none'}); record /tf_static with it"
        ) from None
    inside = (imu.t >= odom.t[0]) & (imu.t <= odom.t[-1])
    if inside.sum() < 2:
        raise DriveDataError(
            f"imu.t: fewer than 2 IMU samples inside the odometry's span "
            f"[{int(odom.t[0])}, {int(odom.t[-1])}] ns; the streams do not overlap in time"
        )
    t = imu.t[inside]
    secs = (t - t[0]).astype(np.float64) / _NS
    rot_bi = mount[:3, :3]
    gyro = imu.gyro[inside] @ rot_bi.T
    accel = imu.accel[inside] @ rot_bi.T
    speed = np.interp(t, odom.t, odom.speed)
    yaw_rate = np.interp(t, odom.t, odom.yaw_rate)
    # The car's own acceleration hides gravity: take out dv/dt (smoothed over ~0.2 s, as
    # wheel speed noise differentiates badly) and the centripetal v * yaw rate.
    period = float(np.median(np.diff(secs)))
    window = max(1, round(0.2 / period))
    forward = np.gradient(uniform_filter1d(speed, window, mode="nearest"), secs)
    gravity = accel - np.stack([forward, speed * gyro[:, 2], np.zeros_like(speed)], axis=1)
    norm = np.linalg.norm(gravity, axis=1)
    usable = np.abs(norm - _GRAVITY) < 1.5
    up = gravity / np.maximum(norm, 1e-9)[:, None]

    first = max(2, round(0.5 / period))
    start = up[:first][usable[:first]]
    u0 = start.mean(axis=0) if len(start) else np.array([0.0, 0.0, 1.0])
    u0 = u0 / np.linalg.norm(u0)
    rot = Rotation.from_euler(
        "xyz", [np.arctan2(u0[1], u0[2]), np.arctan2(-u0[0], np.hypot(u0[1], u0[2])), 0.0]
    ).as_matrix()
    n = len(t)
    out = np.tile(np.eye(4), (n, 1, 1))
    rots, positions = _integrate(rot, secs, gyro, speed, yaw_rate, up, usable, cfg)
    out[:, :3, :3] = rots
    out[:, :3, 3] = positions
    return Trajectory(t, out)


def _integrate(
    rot0: F64,
    secs: F64,
    gyro: F64,
    speed: F64,
    yaw_rate: F64,
    up: F64,
    usable: NDArray[np.bool_],
    cfg: PoseSettings,
) -> tuple[F64, F64]:
    """:func:`propagate`'s sample-by-sample integration: rotations (n, 3, 3) and positions
    (n, 3). Each step depends on the last, and its arithmetic is on 3-vectors: in Python
    floats it runs ~10x faster than through NumPy's per-call overhead (0.5 s of the driver's
    time for a one-minute drive's 6,000 IMU samples before)."""
    n = len(secs)
    g = gyro.tolist()
    v = speed.tolist()
    w = yaw_rate.tolist()
    u = up.tolist()
    ok = usable.tolist()
    ts = secs.tolist()
    r = rot0.tolist()
    px = py = pz = 0.0
    yaw_bias = 0.0
    bias_tc, tilt_tc = cfg.yaw_bias_time_constant_s, cfg.tilt_time_constant_s
    rots = [r]
    positions = [(0.0, 0.0, 0.0)]
    for i in range(1, n):
        dt = ts[i] - ts[i - 1]
        if bias_tc > 0:
            # Low-pass of gyro minus odometry yaw rate: the gyro's slowly varying bias.
            gain = min(1.0, dt / bias_tc)
            yaw_bias += gain * (g[i][2] - w[i] - yaw_bias)
        a, b = g[i - 1], g[i]
        ox = 0.5 * (a[0] + b[0]) * dt
        oy = 0.5 * (a[1] + b[1]) * dt
        oz = (0.5 * (a[2] + b[2]) - yaw_bias) * dt
        step = 0.25 * (v[i - 1] + v[i]) * dt  # half the distance of this sample
        px += r[0][0] * step
        py += r[1][0] * step
        pz += r[2][0] * step
        r = _times_exp(r, ox, oy, oz)
        px += r[0][0] * step
        py += r[1][0] * step
        pz += r[2][0] * step
        if tilt_tc > 0 and ok[i]:
            # Rotating the body by a * (u_meas x u_pred) moves its predicted up vector
            # R^T e_z towards the measured one: a complementary filter on roll and pitch.
            gain = min(1.0, dt / tilt_tc)
            m, (qx, qy, qz) = u[i], r[2]
            r = _times_exp(
                r,
                gain * (m[1] * qz - m[2] * qy),
                gain * (m[2] * qx - m[0] * qz),
                gain * (m[0] * qy - m[1] * qx),
            )
        rots.append(r)
        positions.append((px, py, pz))
    return np.array(rots, np.float64), np.array(positions, np.float64)


def _times_exp(r: list[list[float]], x: float, y: float, z: float) -> list[list[float]]:
    """``r @ exp([x, y, z])``, the rotation by the rotation vector (Rodrigues), on 3 x 3
    nested lists; ``r`` itself below 1e-12 rad."""
    angle = math.sqrt(x * x + y * y + z * z)
    if angle < 1e-12:
        return r
    x, y, z = x / angle, y / angle, z / angle
    s, c = math.sin(angle), 1.0 - math.cos(angle)
    # I + s K + c K^2, K the cross-product matrix of the unit axis (K^2 = k k^T - I)
    e = (
        (1.0 - c * (y * y + z * z), -s * z + c * x * y, s * y + c * x * z),
        (s * z + c * x * y, 1.0 - c * (x * x + z * z), -s * x + c * y * z),
        (-s * y + c * x * z, s * x + c * y * z, 1.0 - c * (x * x + y * y)),
    )
    return [[row[0] * e[0][j] + row[1] * e[1][j] + row[2] * e[2][j] for j in range(3)] for row in r]


def _travel(trajectory: Trajectory) -> F64:
    """Distance driven (m) up to each sample of ``trajectory``."""
    steps = np.linalg.norm(np.diff(trajectory.xyz, axis=0), axis=1)
    return np.concatenate([[0.0], np.cumsum(steps)])


# -- keyframes and scans -------------------------------------------------------------------------


def select_keyframes(
    stamps: NDArray[np.int64], propagated: Trajectory, settings: PoseSettings | None = None
) -> NDArray[np.int64]:
    """Indices into ``stamps`` (sweep stamps, ns, increasing) of the keyframe sweeps: the
    first sweep inside the propagated span, then one whenever the car has moved
    ``keyframe_distance_m``, turned ``keyframe_angle_rad`` or ``keyframe_max_interval_s``
    has passed since the last keyframe."""
    cfg = settings or PoseSettings()
    stamps = np.asarray(stamps, np.int64)
    lo, hi = propagated.span_ns
    candidates = np.flatnonzero((stamps >= lo) & (stamps <= hi))
    if len(candidates) == 0:
        return np.zeros(0, np.int64)
    poses = propagated.at(stamps[candidates])
    chosen = [int(candidates[0])]
    last = poses[0]
    last_t = int(stamps[candidates[0]])
    for row, idx in enumerate(candidates[1:], start=1):
        rel = np.linalg.inv(last) @ poses[row]
        moved = float(np.linalg.norm(rel[:3, 3]))
        turned = float(np.arccos(np.clip((np.trace(rel[:3, :3]) - 1) / 2, -1, 1)))
        waited = (int(stamps[idx]) - last_t) / _NS
        if (
            moved >= cfg.keyframe_distance_m
            or turned >= cfg.keyframe_angle_rad
            or waited >= cfg.keyframe_max_interval_s
        ):
            chosen.append(int(idx))
            last = poses[row]
            last_t = int(stamps[idx])
    return np.asarray(chosen, np.int64)


def deskew_scan(
    scan: Scan,
    propagated: Trajectory,
    mount: F64,
    settings: PoseSettings | None = None,
    *,
    device: ComputeDevice | str | None = None,
) -> NDArray[np.float32]:
    """``scan``'s points (N, 3) float32 in ``base_link`` at ``scan.stamp``, motion de-skewed
    with ``propagated``, cropped to the range band and voxel-downsampled (``voxel_m``).

    Each point was measured at ``stamp + dt`` from the pose the car then had, so it goes
    through ``pose(stamp)^-1 @ pose(stamp + dt) @ mount``; ``mount`` is ``base_link <-
    sensor``.
    """
    cfg = settings or PoseSettings()
    xyz = np.asarray(scan.xyz, np.float64)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or scan.dt.shape != (len(xyz),):
        raise DriveDataError(
            f"scan {scan.drive}@{scan.stamp}: xyz must be (n, 3) and dt (n,), got "
            f"{xyz.shape} and {scan.dt.shape}"
        )
    rng = np.linalg.norm(xyz, axis=1)
    keep = np.isfinite(rng) & (rng >= cfg.min_range_m) & (rng <= cfg.max_range_m)
    keep &= np.isfinite(scan.dt)
    if not keep.any():
        return np.zeros((0, 3), np.float32)
    xyz = xyz[keep]
    offsets = np.round(scan.dt[keep].astype(np.float64) * _NS).astype(np.int64)
    # Points of one firing column share a time: one pose per distinct time.
    times, which = np.unique(scan.stamp + offsets, return_inverse=True)
    # Interpolate on the stretch around the sweep only: slerp over a whole drive per
    # sweep would dominate the cost.
    margin = _NS // 2
    lo, hi = propagated.span_ns
    window = propagated.between(
        max(lo, min(int(times[0]), scan.stamp) - margin),
        min(hi, max(int(times[-1]), scan.stamp) + margin),
    )
    local = window if len(window) >= 2 else propagated
    reference = np.linalg.inv(local.at(scan.stamp)[0])
    rel = np.einsum("ij,njk->nik", reference, local.at(times)) @ mount
    per_point = rel[which]
    moved = np.einsum("nij,nj->ni", per_point[:, :3, :3], xyz) + per_point[:, :3, 3]
    return voxel_downsample(moved.astype(np.float32), cfg.voxel_m, device=device).points


# -- segments ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SegmentInput:
    """What one segment solve needs (pickles as arrays; built by :func:`split_segments`).

    ``stamps`` (k,) keyframe stamps, ns, with their ``scans`` (raw sweeps) and ``travel_m``
    (distance from the drive's start); ``propagated`` the dead-reckoned trajectory over
    the segment (``odom`` frame); ``gps`` the fixes inside the segment's span;
    ``lidar_mount`` (4x4 ``base_link <- lidar``) and ``gps_lever_arm`` (3,) the antenna in
    ``base_link``.  ``clouds``, when given instead of ``scans``, are the keyframes already
    through :meth:`keyframe_cloud` (a Spark job computes them where the sweeps are and
    ships a few thousand points per keyframe instead of whole sweeps).
    """

    drive: str
    index: int
    stamps: NDArray[np.int64]
    scans: tuple[Scan, ...]
    travel_m: F64
    propagated: Trajectory
    gps: GpsFixes
    lidar_mount: F64
    gps_lever_arm: F64
    clouds: tuple[NDArray[np.float32], ...] = ()

    def keyframe_cloud(
        self,
        scan: Scan,
        settings: PoseSettings | None = None,
        *,
        device: ComputeDevice | str | None = None,
    ) -> NDArray[np.float32]:
        """What :func:`solve_segment` registers of keyframe ``scan``: de-skewed with this
        segment's propagated motion into ``base_link``, cropped and voxel-downsampled (on
        the device :func:`solve_segment` would pick: ``device``, else ``settings.device``)."""
        cfg = settings or PoseSettings()
        dev = as_device(device if device is not None else cfg.device)
        return deskew_scan(scan, self.propagated, self.lidar_mount, cfg, device=dev)

    @property
    def span_ns(self) -> tuple[int, int]:
        """First and last keyframe stamp."""
        return int(self.stamps[0]), int(self.stamps[-1])


@dataclass(frozen=True, eq=False)
class SegmentSolution:
    """A solved segment: keyframe ``stamps`` (k,) ns with their ``poses`` (k, 4, 4)
    ``map <- base_link`` (in the segment's own frame when ``anchored`` is False: it had
    too little GPS), ``clouds`` (the de-skewed downsampled keyframe sweeps in
    ``base_link``), ``travel_m``, ``dense`` (the corrected propagated trajectory over the
    segment, same frame as ``poses``), ``gps_rejected`` (times of fixes the gate dropped),
    ``gps_lever_arm`` (the antenna in ``base_link``), counts of accepted / tried scan
    matches and of used GPS fixes, the relative poses ``keyframe j-1 <- keyframe j`` the
    segment measured (``odometry``, scan matching ``forward`` and ``backward``: (k, 4, 4),
    row 0 unused, NaN where a match failed) and ``seconds`` of wall time."""

    drive: str
    index: int
    stamps: NDArray[np.int64]
    poses: F64
    clouds: tuple[NDArray[np.float32], ...]
    travel_m: F64
    dense: Trajectory
    anchored: bool
    gps_rejected: NDArray[np.int64]
    matches_accepted: int
    matches_tried: int
    gps_used: int
    gps_lever_arm: F64
    odometry: F64
    forward: F64
    backward: F64
    seconds: float
    gravity_body: F64 = field(default_factory=lambda: np.zeros((0, 3)))


def _gps_subset(gps: GpsFixes, lo: int, hi: int) -> GpsFixes:
    keep = (gps.t >= lo) & (gps.t <= hi)
    return GpsFixes(gps.frame, gps.t[keep], gps.enu[keep], gps.sigma[keep])


def _check_gps(gps: GpsFixes) -> None:
    n = len(gps.t)
    if n and np.any(np.diff(gps.t) <= 0):
        raise DriveDataError("gps.t: fix times must increase strictly; sort the fixes")
    _check_rows(gps.enu, n, 3, "gps.enu")
    _check_rows(gps.sigma, n, 3, "gps.sigma")
    if n and np.any(gps.sigma <= 0):
        raise DriveDataError("gps.sigma: every fix needs a positive sigma per axis")


def _mount(extrinsics: Extrinsics, frame: str, what: str) -> F64:
    try:
        return np.asarray(extrinsics.get(frame), np.float64)
    except KeyError:
        raise DriveDataError(
            f"extrinsics: no mount for the {what} frame {frame!r} (known: "
            f"{', '.join(sorted(extrinsics.frames)) or 'none'}); record /tf_static with it"
        ) from None


def split_segments(
    drive: DriveData,
    propagated: Trajectory,
    settings: PoseSettings | None = None,
) -> list[SegmentInput]:
    """The drive's keyframes (:func:`select_keyframes` over ``drive.scans``) cut into
    segments of ``segment_seconds``; each segment also holds the keyframes of the next
    segment's first ``segment_overlap_s``, and at least its first ``local_map_keyframes + 1``,
    so consecutive segments share keyframes. A last segment shorter than half a segment is
    merged into the one before."""
    cfg = settings or PoseSettings()
    if not drive.scans:
        raise DriveDataError(
            f"drive {drive.uri}: no LiDAR sweeps; pose recovery needs the scans "
            "(read the drive with with_scans=True)"
        )
    _check_gps(drive.gps)
    scans = sorted(drive.scans, key=lambda s: s.stamp)
    stamps = np.array([s.stamp for s in scans], np.int64)
    picks = select_keyframes(stamps, propagated, cfg)
    if len(picks) < 2:
        raise DriveDataError(
            f"drive {drive.uri}: {len(picks)} LiDAR sweep(s) inside the odometry's span; "
            "pose recovery needs at least 2"
        )
    frames = {s.frame for s in scans}
    if len(frames) != 1:
        raise DriveDataError(f"drive {drive.uri}: sweeps in several frames {sorted(frames)}")
    lidar_mount = _mount(drive.extrinsics, frames.pop(), "LiDAR")
    lever = _mount(drive.extrinsics, drive.gps.frame, "GPS antenna")[:3, 3].copy()
    kf_stamps = stamps[picks]
    travel = np.interp(kf_stamps, propagated.t, _travel(propagated))
    seconds = (kf_stamps - kf_stamps[0]) / _NS
    length, overlap = cfg.segment_seconds, cfg.segment_overlap_s
    count = max(1, int(np.floor(seconds[-1] / length + 0.5)))
    starts = sorted(
        {min(int(np.searchsorted(seconds, i * length)), len(seconds) - 2) for i in range(count)}
    )
    bounds: list[tuple[int, int]] = []
    for i, first in enumerate(starts):
        if i == len(starts) - 1:
            last = len(seconds) - 1
        else:
            # Reach into the next segment far enough that the next segment's first
            # registrations -- onto a local map still being filled -- are also made here
            # with a full map (the join takes those pairs from this segment).
            nxt = starts[i + 1]
            by_time = int(np.searchsorted(seconds, seconds[nxt] + overlap, side="right")) - 1
            last = min(max(by_time, nxt + cfg.local_map_keyframes, nxt + 1), len(seconds) - 1)
        bounds.append((first, last))
    margin = _NS // 2
    out = []
    for i, (first, last) in enumerate(bounds):
        lo, hi = int(kf_stamps[first]), int(kf_stamps[last])
        out.append(
            SegmentInput(
                drive=drive.name,
                index=i,
                stamps=kf_stamps[first : last + 1].copy(),
                scans=tuple(scans[int(j)] for j in picks[first : last + 1]),
                travel_m=travel[first : last + 1].copy(),
                propagated=propagated.between(lo - margin, hi + margin),
                gps=_gps_subset(drive.gps, lo - margin, hi + margin),
                lidar_mount=lidar_mount,
                gps_lever_arm=lever,
            )
        )
    log.info(
        "drive %s: %d keyframes of %d sweeps in %d segments",
        drive.name,
        len(picks),
        len(scans),
        len(out),
    )
    return out


# -- graph helpers -------------------------------------------------------------------------------


def _key(i: int) -> int:
    return int(gtsam.symbol("x", i))


def _pose(matrix: F64) -> gtsam.Pose3:
    return gtsam.Pose3(np.asarray(matrix, np.float64))


def _between_noise(rotation: float, translation: float) -> Any:
    return gtsam.noiseModel.Diagonal.Sigmas(
        np.array([rotation] * 3 + [translation] * 3, np.float64)
    )


def _odometry_noise(rel: F64, seconds: float, cfg: PoseSettings) -> Any:
    dist = float(np.linalg.norm(rel[:3, 3]))
    trans = cfg.odom_sigma_fraction * dist + cfg.odom_sigma_floor_m
    rot = cfg.odom_sigma_rotation_rad + cfg.odom_sigma_rotation_rate * seconds
    return _between_noise(rot, trans)


def _gps_noise(sigma: F64, cfg: PoseSettings) -> Any:
    sigmas = np.maximum(np.asarray(sigma, np.float64) * cfg.gps_sigma_scale, cfg.gps_sigma_floor_m)
    sigmas[2] *= cfg.gps_vertical_scale
    base = gtsam.noiseModel.Diagonal.Sigmas(sigmas)
    kernel = (
        gtsam.noiseModel.mEstimator.Cauchy.Create(cfg.gps_robust_k)
        if cfg.gps_robust == "cauchy"
        else gtsam.noiseModel.mEstimator.Huber.Create(cfg.gps_robust_k)
    )
    return gtsam.noiseModel.Robust.Create(kernel, base)


def _gravity_in_body(poses: F64) -> F64:
    """The map's up direction in each pose's body frame (k, 3): ``R^T e_z``."""
    up = np.asarray(poses[:, 2, :3], dtype=np.float64)
    out: F64 = up / np.linalg.norm(up, axis=1, keepdims=True)
    return out


def _skew(v: F64) -> F64:
    return np.array([[0.0, -v[2], v[1]], [v[2], 0.0, -v[0]], [-v[1], v[0], 0.0]])


#: How a tilt offset (x, y) enters the 3-vector residual of :func:`_attitude_factor`.
_OFFSET_ROWS = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])


def _attitude_factor(key: int, up_body: F64, cfg: PoseSettings, offset_key: int) -> Any:
    """Roll and pitch of ``key`` held to the gravity direction ``up_body`` (2 DoF), measured
    with the graph's tilt offset ``offset_key`` (see :func:`_tilt_offset`)."""
    if cfg.tilt_bias_sigma_rad == 0:
        return gtsam.AttitudeFactorPose3(
            key,
            gtsam.Unit3(np.array([0.0, 0.0, 1.0])),
            gtsam.noiseModel.Isotropic.Sigma(2, cfg.attitude_sigma_rad),
            gtsam.Unit3(np.asarray(up_body, dtype=np.float64)),
        )
    measured = np.asarray(up_body, dtype=np.float64)

    # GTSAM has no attitude factor with a bias; this one predicts the measured up
    # direction as the pose's (R^T e_z) plus the offset's (x, y).
    def error(this: Any, values: Any, jacobians: Any) -> F64:
        pose_key, bias_key = this.keys()
        up = values.atPose3(pose_key).rotation().matrix()[2, :].copy()
        offset = values.atVector(bias_key)
        residual: F64 = up + np.array([offset[0], offset[1], 0.0]) - measured
        if jacobians is not None:
            # Pose3 moves its rotation on the right, R exp([w]x): R^T e_z becomes
            # exp(-[w]x) R^T e_z = up + up x w; translation does not enter.
            jacobian = np.zeros((3, 6))
            jacobian[:, :3] = _skew(up)
            jacobians[0] = jacobian
            jacobians[1] = _OFFSET_ROWS
        return residual

    noise = gtsam.noiseModel.Isotropic.Sigma(3, cfg.attitude_sigma_rad)
    return gtsam.CustomFactor(noise, [key, offset_key], error)


def _tilt_offset(
    graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, index: int, cfg: PoseSettings
) -> int:
    """Add the ``index``-th tilt offset of a graph (x, y of the up direction in the body
    frame, zero-mean prior of ``tilt_bias_sigma_rad``) and return its key."""
    key = int(gtsam.symbol("b", index))
    if cfg.tilt_bias_sigma_rad > 0:
        values.insert(key, np.zeros(2))
        prior = gtsam.noiseModel.Isotropic.Sigma(2, cfg.tilt_bias_sigma_rad)
        graph.add(gtsam.PriorFactorVector(key, np.zeros(2), prior))
    return key


def _gps_bias(
    graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, index: int, cfg: PoseSettings
) -> int:
    """Add the ``index``-th drive's GPS offset (3D, m, map frame; zero-mean prior of
    ``gps_drive_bias_sigma_m``) to a graph and return its key."""
    key = int(gtsam.symbol("g", index))
    values.insert(key, np.zeros(3))
    prior = gtsam.noiseModel.Isotropic.Sigma(3, cfg.gps_drive_bias_sigma_m)
    graph.add(gtsam.PriorFactorVector(key, np.zeros(3), prior))
    return key


def _biased_gps_factor(key: int, bias_key: int, fix: F64, lever: F64, noise: Any) -> Any:
    """``GPSFactorArm`` whose fix is read with the drive's offset ``bias_key``: the antenna
    (``lever`` in ``base_link`` of pose ``key``) plus the offset predicts ``fix`` (map)."""
    measured = np.asarray(fix, dtype=np.float64)
    arm = np.asarray(lever, dtype=np.float64)

    # GTSAM's GPS factors have no bias; this is GPSFactorArm's error with one added.
    def error(this: Any, values: Any, jacobians: Any) -> F64:
        pose_key, offset_key = this.keys()
        pose = values.atPose3(pose_key)
        rotation = pose.rotation().matrix()
        residual: F64 = (
            np.asarray(pose.translation()) + rotation @ arm + values.atVector(offset_key) - measured
        )
        if jacobians is not None:
            # Pose3 moves on the right: R exp([w]x) a = R a - R [a]x w; t + R v.
            jacobian = np.zeros((3, 6))
            jacobian[:, :3] = -rotation @ _skew(arm)
            jacobian[:, 3:] = rotation
            jacobians[0] = jacobian
            jacobians[1] = np.eye(3)
        return residual

    return gtsam.CustomFactor(noise, [key, bias_key], error)


def _optimize(graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, cfg: PoseSettings) -> Any:
    params = gtsam.LevenbergMarquardtParams()
    params.setMaxIterations(cfg.max_iterations)
    params.setRelativeErrorTol(1e-7)
    params.setAbsoluteErrorTol(1e-9)
    try:
        return gtsam.LevenbergMarquardtOptimizer(graph, values, params).optimize()
    except RuntimeError as err:
        raise HdmapError(f"pose graph: GTSAM could not solve it: {err}") from err


def _fit_yaw_translation(source: F64, target: F64, weights: F64) -> F64:
    """Weighted 4-DoF fit (yaw about z, then translation) of ``source`` onto ``target``."""
    w = weights / weights.sum()
    mu_s, mu_t = w @ source, w @ target
    a, b = source[:, :2] - mu_s[:2], target[:, :2] - mu_t[:2]
    cross = float(w @ (a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0]))
    dot = float(w @ (a[:, 0] * b[:, 0] + a[:, 1] * b[:, 1]))
    yaw = np.arctan2(cross, dot)
    out = np.eye(4)
    out[:3, :3] = Rotation.from_euler("z", yaw).as_matrix()
    out[:3, 3] = mu_t - out[:3, :3] @ mu_s
    return out


def _robust_anchor(antenna: F64, fixes: F64, cfg: PoseSettings) -> tuple[F64, NDArray[np.bool_]]:
    """The yaw + translation that puts propagated antenna positions onto the GPS fixes,
    by iteratively reweighted least squares (Cauchy weights), and the fixes within the
    gate of it."""
    weights = np.ones(len(fixes))
    fit = np.eye(4)
    for _ in range(20):
        fit = _fit_yaw_translation(antenna, fixes, weights)
        resid = np.linalg.norm(antenna @ fit[:3, :3].T + fit[:3, 3] - fixes, axis=1)
        scale = max(1.4826 * float(np.median(resid)), cfg.gps_sigma_floor_m)
        weights = 1.0 / (1.0 + (resid / (2.0 * scale)) ** 2)
    resid = np.linalg.norm(antenna @ fit[:3, :3].T + fit[:3, 3] - fixes, axis=1)
    return fit, resid <= cfg.gps_gate_m


def _antenna_links(
    stamps: NDArray[np.int64],
    poses: F64,
    dense: Trajectory,
    fix_t: NDArray[np.int64],
    lever: F64,
) -> tuple[NDArray[np.int64], F64]:
    """For each fix, the nearest keyframe and the antenna's position at the fix time in
    that keyframe's ``base_link`` (carried over the gap by the dense motion)."""
    if len(stamps) == 1:
        nearest = np.zeros(len(fix_t), np.int64)
    else:
        after = np.clip(np.searchsorted(stamps, fix_t), 1, len(stamps) - 1)
        before = np.abs(fix_t - stamps[after - 1]) <= np.abs(stamps[after] - fix_t)
        nearest = np.where(before, after - 1, after)
    at_fix = dense.at(fix_t)
    inv = np.linalg.inv(poses[nearest])
    rel = inv @ at_fix
    body = np.einsum("nij,j->ni", rel[:, :3, :3], lever) + rel[:, :3, 3]
    return nearest.astype(np.int64), body


def _dense_from_keyframes(
    stamps: NDArray[np.int64], optimized: F64, reference: F64, motion: Trajectory
) -> Trajectory:
    """``motion`` moved so that it passes through ``optimized`` at the keyframes: the
    correction ``optimized @ reference^-1`` is interpolated between keyframes (linear,
    slerp) and applied on the left."""
    corrections = optimized @ np.linalg.inv(reference)
    between = Trajectory(stamps, corrections).at(motion.t)
    return Trajectory(motion.t, between @ motion.matrices)


# -- segment solve -------------------------------------------------------------------------------


def _match(
    source: NDArray[np.float32],
    target: NDArray[np.float32],
    guess: F64,
    cfg: PoseSettings,
    device: ComputeDevice | str | None,
) -> F64 | None:
    """ICP of ``source`` onto ``target`` from ``guess``; None when it does not pass."""
    if len(source) < 50 or len(target) < 50:
        return None
    try:
        result = align(
            source,
            target,
            guess,
            voxel_size=0.0,
            max_distance=cfg.icp_max_distance_m,
            normal_radius=cfg.normal_radius_m,
            iterations=cfg.icp_iterations,
            huber=cfg.icp_huber_m,
            device=device,
        )
    except HeteroError as err:
        log.debug("scan match failed: %s", err)
        return None
    moved = float(np.linalg.norm(result.transform[:3, 3] - guess[:3, 3]))
    if (
        result.fitness < cfg.icp_min_fitness
        or result.rmse > cfg.icp_max_rmse_m
        or moved > cfg.icp_max_correction_m
    ):
        log.debug(
            "scan match rejected: fitness %.2f rmse %.3f moved %.2f",
            result.fitness,
            result.rmse,
            moved,
        )
        return None
    return result.transform


def _local_map(
    clouds: Sequence[NDArray[np.float32]],
    chain: Sequence[F64],
    members: range,
    reference: int,
    cfg: PoseSettings,
    device: ComputeDevice | str | None,
) -> NDArray[np.float32]:
    """The clouds of keyframes ``members`` placed by ``chain`` in keyframe ``reference``'s
    ``base_link``, voxel-downsampled."""
    to_reference = np.linalg.inv(chain[reference])
    parts = []
    for i in members:
        rel = to_reference @ chain[i]
        parts.append(clouds[i].astype(np.float64) @ rel[:3, :3].T + rel[:3, 3])
    merged = np.concatenate(parts).astype(np.float32)
    if len(members) == 1 or len(merged) == 0:
        return merged
    return voxel_downsample(merged, cfg.voxel_m, device=device).points


def _no_match() -> F64:
    return np.full((4, 4), np.nan)


def _scan_match_chain(
    clouds: Sequence[NDArray[np.float32]],
    dr: F64,
    cfg: PoseSettings,
    device: ComputeDevice | str | None,
) -> tuple[F64, F64, F64]:
    """Scan matching of consecutive keyframes: ``forward[j]`` and ``backward[j]`` are
    relative poses ``keyframe j-1 <- keyframe j`` (NaN where ICP failed or did not run;
    row 0 unused), and the chain of poses the forward matches give (propagated motion where
    one failed).

    Forward registers keyframe ``j`` onto a local map of the ``local_map_keyframes``
    keyframes before it, backward keyframe ``j - 1`` onto one of the keyframes from ``j`` on
    (placed by the forward chain). One sparse sweep samples the ground in rings too far
    apart for good normals, hence maps of several sweeps; and point-to-plane ICP onto a map
    that lies only behind (or only ahead of) the sweep is biased on such data -- a fraction
    of a milliradian of pitch and roll per registration, measured on the synthetic drives,
    which adds up along a drive -- with opposite signs in the two directions: the graph
    gets both, and the biases cancel.
    """
    k = len(clouds)
    n = cfg.local_map_keyframes
    # The map carries the detail; a coarser source registers as well and costs less.
    sources = [
        c
        if cfg.source_voxel_m <= cfg.voxel_m or len(c) == 0
        else voxel_downsample(c, cfg.source_voxel_m, device=device).points
        for c in clouds
    ]
    forward = np.stack([_no_match() for _ in range(k)])
    backward = forward.copy()
    chain = [dr[0]]
    for j in range(1, k):
        rel_dr = np.linalg.inv(dr[j - 1]) @ dr[j]
        target = _local_map(clouds, chain, range(max(0, j - n), j), j - 1, cfg, device)
        found = _match(sources[j], target, rel_dr, cfg, device)
        if found is not None:
            forward[j] = found
        chain.append(chain[j - 1] @ (rel_dr if found is None else found))
    if cfg.backward_matching:
        for j in range(1, k):
            guess = np.linalg.inv(chain[j]) @ chain[j - 1]
            target = _local_map(clouds, chain, range(j, min(k, j + n)), j, cfg, device)
            found = _match(sources[j - 1], target, guess, cfg, device)
            if found is not None:
                backward[j] = np.linalg.inv(found)
    return forward, backward, np.array(chain)


def solve_segment(
    segment: SegmentInput,
    settings: PoseSettings | None = None,
    *,
    device: ComputeDevice | str | None = None,
) -> SegmentSolution:
    """Solve one segment (see the module docstring, step 3); runs anywhere, e.g. in a Spark
    executor with the device Spark assigned (``device`` overrides ``settings.device``)."""
    cfg = settings or PoseSettings()
    # Resolve the device once: every kernel call would otherwise run the selection policy.
    dev = as_device(device if device is not None else cfg.device)
    started = time.perf_counter()
    stamps = segment.stamps
    k = len(stamps)
    given = len(segment.clouds) if segment.clouds else len(segment.scans)
    if k < 1 or given != k or segment.travel_m.shape != (k,):
        raise HdmapError(
            f"segment {segment.drive}#{segment.index}: {k} keyframe stamps but "
            f"{given} {'clouds' if segment.clouds else 'scans'} and "
            f"{segment.travel_m.shape} travel values"
        )
    motion = segment.propagated
    clouds = segment.clouds or tuple(
        segment.keyframe_cloud(s, cfg, device=dev) for s in segment.scans
    )
    dr = motion.at(stamps)

    graph = gtsam.NonlinearFactorGraph()
    forward, backward, chain_arr = _scan_match_chain(clouds, dr, cfg, dev)
    icp_noise = _between_noise(cfg.icp_sigma_rotation_rad, cfg.icp_sigma_translation_m)
    odometry = np.stack([_no_match(), *(np.linalg.inv(dr[j - 1]) @ dr[j] for j in range(1, k))])
    for j in range(1, k):
        seconds = (int(stamps[j]) - int(stamps[j - 1])) / _NS
        graph.add(
            gtsam.BetweenFactorPose3(
                _key(j - 1),
                _key(j),
                _pose(odometry[j]),
                _odometry_noise(odometry[j], seconds, cfg),
            )
        )
        for rel in (forward[j], backward[j]):
            if np.isfinite(rel).all():
                graph.add(gtsam.BetweenFactorPose3(_key(j - 1), _key(j), _pose(rel), icp_noise))
    accepted = int(np.isfinite(forward[1:, 0, 0]).sum() + np.isfinite(backward[1:, 0, 0]).sum())
    tried = (k - 1) * (2 if cfg.backward_matching else 1)

    # Anchor to GPS: a robust yaw + translation fit of the scan-matched chain's antenna
    # track onto the fixes gives the initial guess and gates the bad fixes.
    gps = segment.gps
    lever = segment.gps_lever_arm
    chain_dense = _dense_from_keyframes(stamps, chain_arr, dr, motion)
    near, body = (
        _antenna_links(stamps, chain_arr, chain_dense, gps.t, lever)
        if len(gps.t)
        else (np.zeros(0, np.int64), np.zeros((0, 3)))
    )
    antenna = np.einsum("nij,nj->ni", chain_arr[near, :3, :3], body) + chain_arr[near, :3, 3]
    extent = float(np.ptp(antenna[:, :2], axis=0).max()) if len(antenna) else 0.0
    anchored = len(gps.t) >= cfg.gps_min_fixes and extent >= cfg.gps_min_extent_m
    if anchored:
        anchor, inliers = _robust_anchor(antenna, gps.enu, cfg)
    else:
        anchor, inliers = np.eye(4), np.zeros(len(gps.t), bool)
    initial = anchor @ chain_arr
    values = gtsam.Values()
    for j in range(k):
        values.insert(_key(j), _pose(initial[j]))
    prior = 1e3 if anchored else 1e-4
    graph.add(gtsam.PriorFactorPose3(_key(0), _pose(initial[0]), _between_noise(prior, prior)))
    used = 0
    for f in np.flatnonzero(inliers):
        graph.add(
            gtsam.GPSFactorArm(
                _key(int(near[f])), gps.enu[f], body[f], _gps_noise(gps.sigma[f], cfg)
            )
        )
        used += 1
    up = _gravity_in_body(dr)
    offset = _tilt_offset(graph, values, 0, cfg)
    for j in range(k):
        graph.add(_attitude_factor(_key(j), up[j], cfg, offset))
    result = _optimize(graph, values, cfg)
    poses = np.array([result.atPose3(_key(j)).matrix() for j in range(k)])
    dense = _dense_from_keyframes(stamps, poses, dr, motion)
    seconds = time.perf_counter() - started
    log.info(
        "segment %s#%d: %d keyframes, %d/%d scan matches, %d/%d GPS fixes%s, %.1f s",
        segment.drive,
        segment.index,
        k,
        accepted,
        tried,
        used,
        len(gps.t),
        "" if anchored else " (not anchored)",
        seconds,
    )
    return SegmentSolution(
        drive=segment.drive,
        index=segment.index,
        stamps=stamps.copy(),
        poses=poses,
        clouds=clouds,
        travel_m=segment.travel_m.copy(),
        dense=dense,
        anchored=anchored,
        gps_rejected=gps.t[~inliers] if anchored else np.zeros(0, np.int64),
        matches_accepted=accepted,
        matches_tried=tried,
        gps_used=used,
        gps_lever_arm=lever.copy(),
        odometry=odometry,
        forward=forward,
        backward=backward,
        seconds=seconds,
        gravity_body=up,
    )


# -- join ----------------------------------------------------------------------------------------


@dataclass
class _DriveSolutions:
    """One drive's solutions in segment order, with their keyframe node indices."""

    solutions: list[SegmentSolution] = field(default_factory=list)
    nodes: list[NDArray[np.int64]] = field(default_factory=list)


def _interior(stamps: NDArray[np.int64], t: NDArray[np.int64]) -> NDArray[np.int64]:
    """How far inside ``[stamps[0], stamps[-1]]`` each ``t`` lies (negative outside)."""
    return np.asarray(np.minimum(t - stamps[0], stamps[-1] - t), np.int64)


def _place(group: _DriveSolutions, initial: dict[int, F64]) -> None:
    """Initial global poses of a drive's keyframes: start from its first anchored solution
    and chain the others onto it through the keyframes they share."""
    sols, nodes = group.solutions, group.nodes
    start = next((i for i, s in enumerate(sols) if s.anchored), 0)
    order = [start, *range(start + 1, len(sols)), *range(start - 1, -1, -1)]
    for i in order:
        sol, idx = sols[i], nodes[i]
        shared = [r for r, n in enumerate(idx) if int(n) in initial]
        move = np.eye(4)
        if shared and not (i == start and sol.anchored):
            r = shared[len(shared) // 2]
            move = initial[int(idx[r])] @ np.linalg.inv(sol.poses[r])
        for r, n in enumerate(idx):
            initial.setdefault(int(n), move @ sol.poses[r])


def _pair_measurements(
    group: _DriveSolutions, cfg: PoseSettings
) -> dict[tuple[int, int], list[tuple[Any, F64]]]:
    """The relative-pose measurements (noise model, ``a <- b``) of each pair of consecutive
    keyframes ``(a, b)`` (node indices) of one drive.

    Scan matches come from the segment that made them onto a full local map -- a forward
    match not among a segment's first ``local_map_keyframes`` keyframes, a backward match
    not among its last -- and, among those, the one holding the pair furthest from its
    ends; the overlap between segments guarantees one. Odometry comes from any segment.
    """
    n = cfg.local_map_keyframes
    icp_noise = _between_noise(cfg.icp_sigma_rotation_rad, cfg.icp_sigma_translation_m)
    best: dict[tuple[int, int, str], tuple[tuple[bool, int], Any, F64]] = {}
    for sol, idx in zip(group.solutions, group.nodes, strict=True):
        k = len(idx)
        for j in range(1, k):
            pair = (int(idx[j - 1]), int(idx[j]))
            inside = min(j - 1, k - 1 - j)
            seconds = (int(sol.stamps[j]) - int(sol.stamps[j - 1])) / _NS
            candidates = (
                ("odometry", sol.odometry[j], True, _odometry_noise(sol.odometry[j], seconds, cfg)),
                ("forward", sol.forward[j], j >= n, icp_noise),
                ("backward", sol.backward[j], j + n - 1 <= k - 1, icp_noise),
            )
            for kind, rel, warm, noise in candidates:
                if not np.isfinite(rel).all():
                    continue
                key = (*pair, kind)
                score = (warm, inside)
                if key not in best or best[key][0] < score:
                    best[key] = (score, noise, rel)
    out: dict[tuple[int, int], list[tuple[Any, F64]]] = {}
    for (a, b, _), (_, noise, rel) in sorted(best.items()):
        out.setdefault((a, b), []).append((noise, rel))
    return out


def _gauge(
    gps_factors: Mapping[str, int], ties: Mapping[str, set[str]]
) -> tuple[dict[str, bool], str | None]:
    """Per drive, whether GPS holds it in ``map`` (its own fixes, or loop closures to a drive
    that has them); with no GPS anywhere, the first drive is the reference instead (False),
    returned second (None where some drive has GPS)."""
    with_gps = {d for d, n in gps_factors.items() if n > 0}
    root = None if with_gps else min(ties)
    reached = with_gps or {min(ties)}
    frontier = list(reached)
    while frontier:
        for other in ties[frontier.pop()]:
            if other not in reached:
                reached.add(other)
                frontier.append(other)
    return {d: d in reached and d != root for d in ties}, root


class JoinedPoses(NamedTuple):
    """What :func:`join_segments` returns: each drive's ``trajectories`` (by name), and for
    each drive whose GPS fixes were read with an offset of their own (one tied by loop
    closures, see :class:`PoseSettings`), ``gps_offsets``: how far its fixes read from
    where the closures put it (3, m, ``map`` ENU; fix minus pose). A few decimetres is a
    day's receiver bias; metres suggest another day's bias far off the map's, or a wrong
    antenna lever arm.

    ``unanchored``: the drives (in name order) that no GPS fix places -- none of theirs was
    used, and no loop closure ties them to a drive whose fixes were or to ``fixed``
    keyframes -- each held with its start where its odometry starts (the origin, heading
    east); ``reference``: with no fix used anywhere and no ``fixed`` keyframe tied, the drive
    that defines the frame that way (the first by name) and those loop closures tie to it,
    in name order (none of them among ``unanchored``)."""

    trajectories: dict[str, Trajectory]
    gps_offsets: dict[str, F64]
    unanchored: tuple[str, ...] = ()
    reference: tuple[str, ...] = ()


def join_segments(
    solutions: Sequence[SegmentSolution],
    gps: Mapping[str, GpsFixes],
    loop_closures: Sequence[LoopClosure] = (),
    settings: PoseSettings | None = None,
    *,
    loop_settings: LoopSettings | None = None,
    fixed: Sequence[Keyframe] = (),
) -> JoinedPoses:
    """The globally consistent trajectory of every drive in ``solutions`` (by drive name),
    and the GPS offsets of the drives tied by loop closures (:class:`JoinedPoses`).

    One graph over all keyframes: each pair of consecutive keyframes is constrained by the
    segments' measurements of it -- odometry and scan matches, each taken from a segment
    that matched it onto a full local map (:func:`_pair_measurements`; the overlaps make
    every pair belong to some segment) -- GPS fixes of ``gps[drive]`` (those no segment
    rejected) on their nearest keyframe with the robust noise model, and the
    ``loop_closures`` with a Cauchy kernel. Each drive's dense trajectory is its segments'
    ``dense`` motion corrected onto the optimised keyframes. The fixes of a drive that
    closures tie to another drive (or to ``fixed`` keyframes) are read with an offset of
    their own (see :class:`PoseSettings`, ``gps_drive_bias_sigma_m``): otherwise a drive
    that overlaps the other over a few keyframes, and so gets one or two closures, is held
    by its GPS up to a metre or two from where they put it.

    ``fixed``: keyframes of drives already in the map (an incremental build's earlier
    versions); those that loop closures name join the graph held at their poses, so the new
    drives are pulled onto the map instead of the map moving. Only drives of ``solutions``
    get a trajectory back.
    """
    cfg = settings or PoseSettings()
    loops_cfg = loop_settings or LoopSettings()
    if not solutions:
        raise HdmapError("join: no segment solutions to join")
    groups: dict[str, _DriveSolutions] = {}
    for sol in sorted(solutions, key=lambda s: (s.drive, s.index)):
        groups.setdefault(sol.drive, _DriveSolutions()).solutions.append(sol)
    node_of: dict[tuple[str, int], int] = {}
    for drive, group in groups.items():
        for sol in group.solutions:
            keys = [node_of.setdefault((drive, int(t)), len(node_of)) for t in sol.stamps]
            group.nodes.append(np.asarray(keys, np.int64))

    anchors = {k.key: k for k in fixed if k.drive not in groups}
    known = {*groups, *(key[0] for key in anchors)}
    tied = {
        d
        for loop in loop_closures
        if loop.a[0] != loop.b[0] and {loop.a[0], loop.b[0]} <= known
        for d in (loop.a[0], loop.b[0])
    }
    graph = gtsam.NonlinearFactorGraph()
    initial: dict[int, F64] = {}
    gps_factors: dict[str, int] = {}
    values = gtsam.Values()
    offsets: list[int] = []
    biases: dict[str, int] = {}
    for drive, group in groups.items():
        _place(group, initial)
        for (a, b), rels in _pair_measurements(group, cfg).items():
            for noise, rel in rels:
                graph.add(gtsam.BetweenFactorPose3(_key(a), _key(b), _pose(rel), noise))
        # GPS on the keyframe nearest each fix, in the segment holding the fix deepest.
        fixes = gps.get(drive)
        used = 0
        if fixes is not None and len(fixes.t):
            _check_gps(fixes)
            rejected = np.concatenate([s.gps_rejected for s in group.solutions])
            keep = ~np.isin(fixes.t, rejected)
            depth = np.stack([_interior(s.stamps, fixes.t) for s in group.solutions])
            owner = np.argmax(depth, axis=0)
            keep &= depth[owner, np.arange(len(fixes.t))] >= -_NS // 2
            lever = group.solutions[0].gps_lever_arm
            bias = None
            if drive in tied and cfg.gps_drive_bias_sigma_m > 0 and keep.any():
                bias = biases[drive] = _gps_bias(graph, values, len(biases), cfg)
            for o, sol in enumerate(group.solutions):
                rows = np.flatnonzero(keep & (owner == o))
                if not len(rows):
                    continue
                near, body = _antenna_links(sol.stamps, sol.poses, sol.dense, fixes.t[rows], lever)
                for f, r, b in zip(rows, near, body, strict=True):
                    node, noise = _key(int(group.nodes[o][r])), _gps_noise(fixes.sigma[f], cfg)
                    graph.add(
                        gtsam.GPSFactorArm(node, fixes.enu[f], b, noise)
                        if bias is None
                        else _biased_gps_factor(node, bias, fixes.enu[f], b, noise)
                    )
                    used += 1
        gps_factors[drive] = used
        tilted: set[int] = set()
        offset = _tilt_offset(graph, values, len(offsets), cfg)
        offsets.append(offset)
        for o, sol in enumerate(group.solutions):
            for r, up in enumerate(sol.gravity_body):
                node = int(group.nodes[o][r])
                if node not in tilted:
                    tilted.add(node)
                    graph.add(_attitude_factor(_key(node), up, cfg, offset))

    loop_noise = gtsam.noiseModel.Robust.Create(
        gtsam.noiseModel.mEstimator.Cauchy.Create(loops_cfg.robust_k),
        _between_noise(loops_cfg.sigma_rotation_rad, loops_cfg.sigma_translation_m),
    )
    ties: dict[str, set[str]] = {drive: set() for drive in groups}
    named = {key for loop in loop_closures for key in (loop.a, loop.b) if key in anchors}
    held_noise = _between_noise(1e-6, 1e-6)
    for key in sorted(named):
        n = node_of.setdefault(key, len(node_of))
        initial[n] = anchors[key].pose
        graph.add(gtsam.PriorFactorPose3(_key(n), _pose(anchors[key].pose), held_noise))
        ties.setdefault(key[0], set())
        gps_factors.setdefault(key[0], 1)  # the map holds it, as GPS would
    for loop in loop_closures:
        if loop.a not in node_of or loop.b not in node_of:
            log.warning(
                "join: loop closure %s-%s names an unknown keyframe; ignored", loop.a, loop.b
            )
            continue
        graph.add(
            gtsam.BetweenFactorPose3(
                _key(node_of[loop.a]), _key(node_of[loop.b]), _pose(loop.relative), loop_noise
            )
        )
        ties[loop.a[0]].add(loop.b[0])
        ties[loop.b[0]].add(loop.a[0])
    gauge, root = _gauge(gps_factors, ties)
    unanchored = tuple(
        sorted(d for d, held in gauge.items() if d in groups and not held and d != root)
    )
    for drive, held in gauge.items():
        if drive not in groups:
            continue
        # A drive without GPS and without closures to one that has it would float: its
        # first keyframe is held where its segments put it.
        first = int(groups[drive].nodes[0][0])
        sigma = 1e3 if held else 1e-4
        graph.add(
            gtsam.PriorFactorPose3(_key(first), _pose(initial[first]), _between_noise(sigma, sigma))
        )
    for n, pose in initial.items():
        values.insert(_key(n), _pose(pose))
    result = _optimize(graph, values, cfg)
    out: dict[str, Trajectory] = {}
    gps_offsets: dict[str, F64] = {}
    for (drive, group), offset in zip(groups.items(), offsets, strict=True):
        out[drive] = _dense_of_drive(group, result)
        if cfg.tilt_bias_sigma_rad > 0:
            # A few mrad is an accelerometer's bias; tens suggest a wrong IMU mount.
            x, y = 1e3 * result.atVector(offset)
            log.info("join: drive %s: gravity's tilt offset (%.1f, %.1f) mrad", drive, x, y)
        if drive in biases:
            gps_offsets[drive] = np.asarray(result.atVector(biases[drive]), np.float64)
            x, y, z = gps_offsets[drive]
            log.info(
                "join: drive %s: its GPS reads (%.2f, %.2f, %.2f) m off where loop closures put it",
                drive,
                x,
                y,
                z,
            )
    log.info(
        "join: %d keyframes (%d of the map, fixed), %d drives, %d GPS fixes, %d loop closures",
        len(node_of),
        len(named),
        len(groups),
        sum(gps_factors[d] for d in groups),
        len(loop_closures),
    )
    for drive in unanchored:
        log.warning(
            "join: drive %s: no GPS fix places it and no loop closure ties it to a drive "
            "that has them; its start is held at the origin",
            drive,
        )
    reference = tuple(sorted(d for d in groups if root is not None and d not in unanchored))
    return JoinedPoses(out, gps_offsets, unanchored, reference)


def _dense_of_drive(group: _DriveSolutions, result: Any) -> Trajectory:
    times = np.unique(np.concatenate([s.dense.t for s in group.solutions]))
    depth = np.stack([_interior(s.stamps, times) for s in group.solutions])
    owner = np.argmax(depth, axis=0)
    out = np.zeros((len(times), 4, 4))
    for o, (sol, idx) in enumerate(zip(group.solutions, group.nodes, strict=True)):
        rows = np.flatnonzero(owner == o)
        if not len(rows):
            continue
        optimized = np.array([result.atPose3(_key(int(n))).matrix() for n in idx])
        moved = _dense_from_keyframes(sol.stamps, optimized, sol.poses, sol.dense)
        out[rows] = moved.at(times[rows])
    return Trajectory(times, out)


def solution_keyframes(
    solutions: Sequence[SegmentSolution], trajectories: Mapping[str, Trajectory]
) -> list[Keyframe]:
    """The keyframes of ``solutions`` (each once) with poses from ``trajectories`` (the
    joined ones, so that all drives share the ``map`` frame): the input of
    :func:`~adcloud.hdmap.loops.find_loop_closures`."""
    seen: set[tuple[str, int]] = set()
    out: list[Keyframe] = []
    for sol in sorted(solutions, key=lambda s: (s.drive, s.index)):
        traj = trajectories[sol.drive]
        poses = traj.at(sol.stamps)
        for r, stamp in enumerate(sol.stamps):
            key = (sol.drive, int(stamp))
            if key in seen:
                continue
            seen.add(key)
            out.append(
                Keyframe(sol.drive, int(stamp), poses[r], float(sol.travel_m[r]), sol.clouds[r])
            )
    return out


def estimate_trajectory(
    drive: DriveData,
    settings: PoseSettings | None = None,
    *,
    loop_settings: LoopSettings | None = None,
    device: ComputeDevice | str | None = None,
) -> Trajectory:
    """The drive's ``base_link`` trajectory in ``map`` (at the IMU's rate), by the same
    steps as the Spark job, run one segment after another in this process."""
    cfg = settings or PoseSettings()
    loops_cfg = loop_settings or LoopSettings()
    dev = device if device is not None else cfg.device
    t0 = time.perf_counter()
    propagated = propagate(drive.imu, drive.odom, drive.extrinsics, cfg)
    t1 = time.perf_counter()
    segments = split_segments(drive, propagated, cfg)
    solutions = [solve_segment(s, cfg, device=dev) for s in segments]
    t2 = time.perf_counter()
    gps = {drive.name: drive.gps}
    trajectories = join_segments(solutions, gps, (), cfg, loop_settings=loops_cfg).trajectories
    t3 = time.perf_counter()
    if cfg.loop_closure:
        keyframes = solution_keyframes(solutions, trajectories)
        closures = find_loop_closures(keyframes, loops_cfg, device=dev).closures
        if closures:
            trajectories = join_segments(
                solutions, gps, closures, cfg, loop_settings=loops_cfg
            ).trajectories
    t4 = time.perf_counter()
    log.info(
        "drive %s: poses in %.1f s (propagate %.1f, segments %.1f, join %.1f, loops %.1f)",
        drive.name,
        t4 - t0,
        t1 - t0,
        t2 - t1,
        t3 - t2,
        t4 - t3,
    )
    return trajectories[drive.name]
