"""Generate a synthetic drive: :func:`generate_drive` writes a bag and its truth directory.

The drive is produced window by window (one LiDAR period, 100 ms by default): the
driver integrates the car up to the window's end, every sensor samples its messages
inside the window, and the messages go to the bag sorted by (time, topic order) -- so
memory holds one window and one bag chunk whatever the drive's length, plus the
message index a ROS 1 bag writes at its end (rosbags keeps ~100 bytes per message).

Timing: every message's record time equals its header stamp
(``start_time_ns`` + the sample's time).  Sensors sample on their own grid: ground truth
at ``k / truth_hz``; IMU at ``k / imu_hz + 1 ms``; odometry and ``/tf`` at
``k / odom_hz + 3 ms``; GPS at ``k / gps_hz``; LiDAR sweeps are stamped at their end,
``k / lidar_hz`` for ``k >= 1``; camera frames at ``k / camera_hz + 7 ms``.
``/tf_static`` is written once, at the start.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import sqlite3
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.camera import CameraModel
from adcloud.synth.config import DriveConfig
from adcloud.synth.errors import SynthError
from adcloud.synth.frames import (
    MOUNTS,
    camera_mounts,
    camera_prefix,
    euler_matrix,
    matrix_quaternion,
)
from adcloud.synth.gnss import VERTICAL_FACTOR, GnssModel
from adcloud.synth.imu import ImuModel
from adcloud.synth.lidar import POINT_DTYPE, LidarModel
from adcloud.synth.messages import TOPICS, MessageCodec, Topic
from adcloud.synth.odometry import WheelOdometry
from adcloud.synth.trajectory import Driver, Trajectory, make_route
from adcloud.synth.truth import TruthWriter, truth_dir_for
from adcloud.synth.world import World, build_world
from adcloud.synth.writer import open_writer

__all__ = ["DriveResult", "generate_drive"]

log = logging.getLogger(__name__)

_NS = 1_000_000_000
_MS = 1_000_000
# Sample-grid phases (ns) that keep sensors from all firing at the same instant.
_PHASE = {"truth": 0, "imu": 1 * _MS, "odom": 3 * _MS, "gps": 0, "camera": 7 * _MS}
# Noise streams: one generator per purpose, so switching a sensor off changes no other's noise.
_STREAMS = {"imu": 1, "odom": 2, "gps": 3, "lidar": 4, "camera": 5}
_BIG = 1e6


@dataclass(frozen=True)
class DriveResult:
    """What :func:`generate_drive` wrote: the bag (file or rosbag2 directory), the truth
    directory, messages per topic, bag size (bytes), simulated and wall time (s)."""

    bag: Path
    truth: Path
    format: str
    messages: dict[str, int]
    bytes: int
    seconds: float
    wall_s: float

    @property
    def message_count(self) -> int:
        """All messages in the bag."""
        return sum(self.messages.values())


def _grid(t0: int, t1: int, period: int, phase: int, first: int = 0) -> NDArray[np.int64]:
    """Sample times ``k * period + phase`` (k >= first) in ``[t0, t1)`` (ns)."""
    k0 = max(first, -((phase - t0) // period))
    k1 = -((phase - t1) // period)
    return (np.arange(k0, max(k0, k1), dtype=np.int64) * period + phase).astype(np.int64)


def _bag_size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _remove(path: Path) -> None:
    # a symlink (an --out that links to a drive elsewhere) goes, not what it points to
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class _Drive:
    """One drive in progress: sensors, the writer and the truth directory."""

    def __init__(self, config: DriveConfig, bag: Path, world: World, created: list[Path]) -> None:
        self.config = config
        self.world = world
        self.codec = MessageCodec("ros1" if config.format == "ros1" else "ros2")
        self.writer = open_writer(bag, config, self.codec.store)
        created.append(bag)
        self.truth = TruthWriter(truth_dir_for(bag), config, world)
        created.append(self.truth.root)
        self.counts: dict[str, int] = {}
        seeds = {
            name: np.random.SeedSequence([config.seed, 0x5E5, sid])
            for name, sid in _STREAMS.items()
        }
        self.rng = {name: np.random.default_rng(seed) for name, seed in seeds.items()}
        # Camera 0 keeps the "camera" stream (its images do not depend on the rig size).
        self.camera_rngs = [self.rng["camera"]] + [
            np.random.default_rng(np.random.SeedSequence([config.seed, 0x5E5, 5, k]))
            for k in range(1, config.cameras)
        ]
        self.imu = ImuModel(config, self.rng["imu"])
        self.odom = WheelOdometry(config, self.rng["odom"])
        self.gnss = GnssModel(config, self.rng["gps"])
        self.lidar = LidarModel.from_config(config) if config.lidar else None
        self.cameras = (
            [
                CameraModel.from_config(config, camera_mounts(k, config.cameras))
                for k in range(config.cameras)
            ]
            if config.camera
            else []
        )
        self.camera = self.cameras[0] if self.cameras else None
        self.topics = [
            t
            for t in TOPICS.values()
            if (config.lidar or not t.name.startswith("/lidar"))
            and (config.camera or not t.name.startswith("/camera"))
        ]
        camera_topics = [t for t in self.topics if t.name.startswith("/camera/")]
        self.topics += [
            Topic(camera_prefix(k) + t.name.removeprefix("/camera"), t.msgtype)
            for k in range(1, len(self.cameras))
            for t in camera_topics
        ]
        self.msgtypes = {t.name: t.msgtype for t in self.topics}
        self.rank = {t.name: i for i, t in enumerate(self.topics)}
        for topic in self.topics:
            self.writer.add_topic(topic.name, topic.msgtype, latched=topic.latched)
            self.counts[topic.name] = 0
        self.pending: list[tuple[int, int, str, bytes]] = []

    def emit(self, topic: str, t_ns: int, msg: object) -> None:
        data = self.codec.serialize(msg, self.msgtypes[topic])
        self.pending.append((t_ns, self.rank[topic], topic, data))

    def flush(self) -> None:
        self.pending.sort(key=lambda m: (m[0], m[1]))
        for t_ns, _, topic, data in self.pending:
            self.writer.write(topic, t_ns, data)
            self.counts[topic] += 1
        self.pending.clear()

    def abs_ns(self, t_ns: int) -> int:
        return self.config.start_time_ns + int(t_ns)

    # ----------------------------------------------------------------- sensors

    def static_tf(self) -> None:
        t = self.abs_ns(0)
        mounts = [MOUNTS["lidar"], MOUNTS["imu"], MOUNTS["gps"]]
        for cam in self.cameras:
            mounts += [cam.link, cam.optical]
        transforms = [
            self.codec.transform(t, m.parent, m.frame, m.translation, m.quaternion) for m in mounts
        ]
        self.emit("/tf_static", t, self.codec.tf(transforms))

    def ground_truth(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        if not len(t_ns):
            return
        t = t_ns / _NS
        vel, _, omega, rot = traj.kinematics(t)
        pos, _ = traj.pose(t)
        quat = matrix_quaternion(rot)
        body_v = np.einsum("nji,nj->ni", rot, vel)
        zeros = np.zeros(36)
        abs_t = np.asarray([self.abs_ns(int(v)) for v in t_ns], dtype=np.int64)
        self.truth.poses(abs_t, pos, quat)
        for i, ts in enumerate(abs_t.tolist()):
            msg = self.codec.odometry(
                "/ground_truth/odom",
                ts,
                "map",
                "base_link",
                pos[i],
                quat[i],
                body_v[i],
                omega[i],
                zeros,
                zeros,
            )
            self.emit("/ground_truth/odom", ts, msg)

    def imu_samples(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        if not len(t_ns):
            return
        cfg = self.config
        s = self.imu.measure(traj, t_ns / _NS)
        abs_t = np.asarray([self.abs_ns(int(v)) for v in t_ns], dtype=np.int64)
        self.truth.rows("imu_bias.csv", abs_t, np.hstack([s.accel_bias, s.gyro_bias]))
        frame = MOUNTS["imu"].frame
        for i, ts in enumerate(abs_t.tolist()):
            msg = self.codec.imu(
                "/imu/data",
                ts,
                frame,
                s.accel[i],
                s.gyro[i],
                cfg.imu_accel_noise**2,
                cfg.imu_gyro_noise**2,
            )
            self.emit("/imu/data", ts, msg)

    def odometry(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        if not len(t_ns):
            return
        cfg = self.config
        s = self.odom.measure(traj, t_ns / _NS)
        abs_t = np.asarray([self.abs_ns(int(v)) for v in t_ns], dtype=np.int64)
        self.truth.rows("odom_scale.csv", abs_t, s.scale[:, None])
        pose_cov = np.diag([0.05, 0.05, _BIG, _BIG, _BIG, 0.01]).ravel()
        twist_cov = np.diag(
            [
                cfg.odom_speed_noise**2 + 1e-6,
                1e-4,
                _BIG,
                _BIG,
                _BIG,
                cfg.odom_yaw_rate_noise**2 + 1e-6,
            ]
        ).ravel()
        quats = matrix_quaternion(euler_matrix(np.zeros(len(t_ns)), np.zeros(len(t_ns)), s.yaw))
        for i, ts in enumerate(abs_t.tolist()):
            pos = (s.x[i], s.y[i], 0.0)
            msg = self.codec.odometry(
                "/odom",
                ts,
                "odom",
                "base_link",
                pos,
                quats[i],
                (s.speed[i], 0.0, 0.0),
                (0.0, 0.0, s.yaw_rate[i]),
                pose_cov,
                twist_cov,
            )
            self.emit("/odom", ts, msg)
            self.emit(
                "/tf",
                ts,
                self.codec.tf([self.codec.transform(ts, "odom", "base_link", pos, quats[i])]),
            )

    def gps(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        if not len(t_ns):
            return
        cfg = self.config
        s = self.gnss.measure(traj, t_ns / _NS)
        abs_t = np.asarray([self.abs_ns(int(v)) for v in t_ns], dtype=np.int64)
        rows = np.hstack([s.published[:, None].astype(np.float64), s.truth, s.bias])
        self.truth.rows("gps.csv", abs_t, rows, fmt="{:.6f}")
        h = cfg.gps_noise_m**2 + cfg.gps_bias_m**2
        var = (h, h, h * VERTICAL_FACTOR**2)
        frame = MOUNTS["gps"].frame
        for i in np.nonzero(s.published)[0].tolist():
            ts = int(abs_t[i])
            self.emit(
                "/gps/fix",
                ts,
                self.codec.navsatfix("/gps/fix", ts, frame, s.lat[i], s.lon[i], s.alt[i], var),
            )

    def lidar_sweeps(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        assert self.lidar is not None
        for t in t_ns.tolist():
            points = self.lidar.sweep(self.world, traj, t / _NS, self.rng["lidar"])
            ts = self.abs_ns(t)
            self.emit(
                "/lidar/points",
                ts,
                self.codec.pointcloud2("/lidar/points", ts, MOUNTS["lidar"].frame, points),
            )

    def camera_frames(self, traj: Trajectory, t_ns: NDArray[np.int64]) -> None:
        for t in t_ns.tolist():
            ts = self.abs_ns(t)
            for k, (cam, rng) in enumerate(zip(self.cameras, self.camera_rngs, strict=True)):
                rgb, labels = cam.render(self.world, traj, t / _NS, rng)
                frame, prefix = cam.optical.frame, camera_prefix(k)
                info, image, label = (
                    f"{prefix}/camera_info",
                    f"{prefix}/image_raw",
                    f"{prefix}/labels",
                )
                self.emit(
                    info, ts, self.codec.camera_info(info, ts, frame, cam.width, cam.height, cam.k)
                )
                self.emit(image, ts, self.codec.image(image, ts, frame, rgb, "rgb8"))
                self.emit(label, ts, self.codec.image(label, ts, frame, labels, "mono8"))


def _open_drive(config: DriveConfig, bag: Path, world: World) -> _Drive:
    # A failure removes only what this run created: a bag or truth directory that another
    # run made between the existence check and now (building the world takes a while) is
    # that run's, and deleting it would fail that run too.
    created: list[Path] = []
    try:
        return _Drive(config, bag, world, created)
    except BaseException:
        for path in created:
            _remove(path)
        raise


def _truth_meta(drive: _Drive, config: DriveConfig, bag: Path) -> dict[str, Any]:
    """What ``world.json`` says of the sensors and the bag."""
    lidar_info = None
    if drive.lidar is not None:
        lm = drive.lidar
        lidar_info = {
            "beams": lm.beams,
            "columns": lm.columns,
            "elevations_deg": [round(float(v), 6) for v in np.degrees(lm.elevations)],
            "point_fields": list(POINT_DTYPE.names or ()),
        }
    camera_info = None
    if drive.camera is not None:
        cam = drive.camera
        camera_info = {
            "width": cam.width,
            "height": cam.height,
            "k": list(cam.k),
            # every camera of the rig: topic prefix, optical frame, mount on base_link
            "rig": [
                {
                    "prefix": camera_prefix(k),
                    "frame": c.optical.frame,
                    "translation": list(c.link.translation),
                    "yaw_deg": round(float(np.degrees(c.link.rpy[2])), 6),
                }
                for k, c in enumerate(drive.cameras)
            ],
        }
    return {
        "messages": dict(drive.counts),
        "lidar": lidar_info,
        "camera": camera_info,
        "bag": bag.name,
        "bag_format": config.format,
    }


#: What a truth directory holds (:class:`~adcloud.synth.truth.TruthWriter`).
_TRUTH_FILES = frozenset(
    {
        "poses.txt",
        "imu_bias.csv",
        "odom_scale.csv",
        "gps.csv",
        "config.json",
        "map.geojson",
        "raster.npz",
        "world.json",
    }
)
_ROS1_MAGIC = b"#ROSBAG V2.0\n"
_MCAP_MAGIC = b"\x89MCAP0\r\n"
# What rosbags' ROS 2 writer creates in a bag directory before metadata.yaml (sqlite3 with
# its journal files, or MCAP).
_ROS2_STORAGE_SUFFIXES = (".db3", ".db3-journal", ".db3-wal", ".db3-shm", ".mcap")
# The files of a whole rosbag2 directory besides metadata.yaml: its storage files, split
# (``<name>_0.db3``) or compressed per file (``.db3.zstd``) as ``ros2 bag record`` writes them.
_ROS2_BAG_SUFFIXES = (*_ROS2_STORAGE_SUFFIXES, ".zstd")


def _is_bag(path: Path) -> bool:
    """Whether ``path`` is a bag a drive may replace: a ROS 1 or MCAP file, or a rosbag2
    directory (``metadata.yaml`` and storage files only, or what a killed writer left:
    only its storage file, as ``metadata.yaml`` is written last).  Any other file in the
    directory makes it the user's folder, not a bag: a ``metadata.yaml`` beside
    ``results.csv`` and ``notes/`` took them all with it."""
    if path.is_dir():
        entries = list(path.iterdir())
        if (path / "metadata.yaml").is_file():
            return all(
                p.name == "metadata.yaml" or (p.is_file() and p.name.endswith(_ROS2_BAG_SUFFIXES))
                for p in entries
            )
        storage = {f"{path.name}{suffix}" for suffix in _ROS2_STORAGE_SUFFIXES}
        names = {p.name for p in entries}
        return bool(names) and names <= storage
    try:
        with path.open("rb") as f:
            head = f.read(13)
    except OSError:
        return False
    return head.startswith((_ROS1_MAGIC, _MCAP_MAGIC))


def _check_replaceable(bag: Path, truth: Path) -> None:
    """With overwrite, refuse to replace what is not a drive: ``--out precious`` must not
    take a folder of other files (or any file) with it."""
    if (bag.exists() or bag.is_symlink()) and not _is_bag(bag):
        raise SynthError(
            f"{bag} is not a bag (a ROS 1 or MCAP file, or a rosbag2 directory); refusing "
            "to replace it: choose another output"
        )
    if truth.exists():
        names = [p.name for p in truth.iterdir()] if truth.is_dir() else [truth.name]
        # a truth directory, whole or half-written (``*.part`` files of an interrupted run)
        foreign = [n for n in names if n not in _TRUTH_FILES and not n.endswith(".part")]
        if foreign:
            raise SynthError(
                f"{truth} holds what a drive's truth does not ({foreign[0]}); refusing to "
                "replace it: choose another output"
            )


def _dead_leftovers(path: Path, mark: str) -> list[Path]:
    """What runs that are no longer alive (``kill -9``) left beside ``path``: the old drive
    they set aside (``mark`` ``replaced``) or the new one they were writing (``part``)."""
    found = []
    for left in path.parent.glob(f".{glob.escape(path.name)}.{mark}-*"):
        pid = left.name.rpartition("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            found.append(left)
        except PermissionError:  # alive, another user's
            continue
    return found


def _dead_asides(path: Path) -> list[Path]:
    """What runs that are no longer alive (``kill -9``) set aside of ``path``."""
    return _dead_leftovers(path, "replaced")


def _exists_already(path: Path) -> SynthError:
    return SynthError(f"{path} exists already; remove it or pass overwrite=True (--overwrite)")


def _move_into_place(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, never over something that appeared at ``dst`` meanwhile
    (another run's drive): a directory claims the name with ``mkdir`` and is renamed onto
    that empty directory, a file is linked (both fail if the name is taken)."""
    if src.is_dir():
        try:
            dst.mkdir()
        except FileExistsError:
            raise _exists_already(dst) from None
        try:
            src.rename(dst)
        except BaseException:
            with contextlib.suppress(OSError):
                dst.rmdir()
            raise
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        raise _exists_already(dst) from None
    except OSError:  # a file system without hard links
        if dst.exists() or dst.is_symlink():
            raise _exists_already(dst) from None
        src.rename(dst)
        return
    src.unlink()


def _publish(staged: Path, bag: Path, truth: Path, *, overwrite: bool) -> None:
    """Move a whole drive from its staging directory to ``bag`` and ``truth`` (the truth
    first: a bag under its name is a whole drive).  With ``overwrite`` the drive there is
    set aside until the new one is in place; any failure puts it back."""
    aside: list[tuple[Path, Path]] = []
    moved: list[Path] = []
    try:
        if overwrite:
            _check_replaceable(bag, truth)
            for path in (bag, truth):
                if path.exists() or path.is_symlink():
                    kept = path.with_name(f".{path.name}.replaced-{os.getpid()}")
                    _remove(kept)
                    path.rename(kept)
                    aside.append((kept, path))
        for src, dst in ((truth_dir_for(staged), truth), (staged, bag)):
            _move_into_place(src, dst)
            moved.append(dst)
    except BaseException:
        for dst in moved:
            _remove(dst)
        for kept, path in aside:
            kept.rename(path)
        raise
    for kept, _ in aside:
        _remove(kept)


def _user_error(err: OSError, stage: Path, bag: Path) -> OSError:
    """``err`` naming the output as the user named it: a path in the staging directory
    (gone once the run failed) as its final name, and the bag where ``err`` names none
    (rosbags' writers raise ``ENOSPC`` without a file name)."""
    name = bag
    if err.filename is not None:
        try:
            name = bag.parent / Path(os.fsdecode(err.filename)).relative_to(stage)
        except ValueError:
            return err
    return OSError(err.errno, err.strerror or str(err), str(name))


def _storage_error(err: sqlite3.Error, bag: Path) -> OSError | SynthError:
    """A failure of a ``ros2`` bag's sqlite3 storage, naming the bag: sqlite3 names no
    file, and its "database or disk is full" reached the command line as a traceback
    where the other formats say "<bag>: No space left on device"."""
    if getattr(err, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(bag))
    return SynthError(f"cannot write the bag {bag} (sqlite3 storage): {err}")


# Suffixes that name one bag layout: a name with one of them written as another layout (a
# rosbag2 directory "m.mcap" holding "m.mcap.mcap", a ROS 1 file "d.mcap") is never what
# the user meant, and tools that go by the suffix then fail to open it.
_LAYOUT_SUFFIXES = {".bag": "a ROS 1 bag file", ".mcap": "an MCAP file", ".db3": "a sqlite3 file"}
_STORAGE_SUFFIX = {"ros2": ".db3", "mcap": ".mcap"}


def _check_out_name(text: str, bag: Path, fmt: str) -> None:
    """Refuse an ``out`` whose name promises another layout than ``fmt`` writes."""
    suffix = bag.suffix.lower()
    if fmt == "ros1":
        if text.endswith(("/", os.sep)):
            raise SynthError(
                f"out {text!r} names a directory, but format 'ros1' writes one .bag file: "
                f"give its file name (e.g. {str(bag / 'drive.bag')!r})"
            )
        if suffix in _LAYOUT_SUFFIXES and suffix != ".bag":
            raise SynthError(
                f"out {str(bag)!r} names {_LAYOUT_SUFFIXES[suffix]}, but format 'ros1' "
                f"writes a ROS 1 bag: name it {str(bag.with_suffix('.bag'))!r} or choose "
                f"--format {'mcap' if suffix == '.mcap' else 'ros2'}"
            )
        return
    if suffix in _LAYOUT_SUFFIXES:
        plain = bag.with_suffix("")
        inside = plain / f"{plain.name}{_STORAGE_SUFFIX[fmt]}"
        raise SynthError(
            f"out {str(bag)!r} names {_LAYOUT_SUFFIXES[suffix]}, but format {fmt!r} writes a "
            f"rosbag2 directory: out names that directory and the {_STORAGE_SUFFIX[fmt]} file "
            f"goes inside it (out={str(plain)!r} writes {str(inside)!r} and "
            f"{str(plain / 'metadata.yaml')!r})"
            + (" or choose --format ros1" if suffix == ".bag" else "")
        )


def generate_drive(
    config: DriveConfig,
    out: str | Path,
    *,
    overwrite: bool = False,
    progress: Callable[[float], None] | None = None,
) -> DriveResult:
    """Write the drive ``config`` describes to ``out`` and its truth to ``<out>.truth/``.

    ``out`` is a ``.bag`` file (``ros1``) or a rosbag2 directory (``ros2``, ``mcap``)
    that holds ``<name>.db3`` or ``<name>.mcap`` and ``metadata.yaml``; a name whose
    suffix promises another layout (``m.mcap`` for ``mcap``, ``d.mcap`` or ``dir/`` for
    ``ros1``) is refused with :class:`SynthError`.
    ``progress`` is called with the simulated seconds done after each window.  Raises
    :class:`SynthError` for bad settings or an existing output (unless ``overwrite``).

    The drive is written into a hidden staging directory beside ``out``
    (``.<name>.part-<random>-<pid>``) and moved to its name only once whole, so no run -- failed,
    interrupted or killed with ``kill -9`` -- leaves half a bag under that name, and an
    overwritten drive stays in place until then; a later run removes what killed runs left.
    """
    config.validate()
    bag = Path(out)
    if bag.name in ("", ".", ".."):
        raise SynthError(f"out must name a bag file or bag directory, not {str(out)!r}")
    _check_out_name(str(out), bag, config.format)
    truth = truth_dir_for(bag)
    if overwrite and bag.parent.is_dir():
        _check_replaceable(bag, truth)
        for path in (bag, truth):
            for stale in _dead_asides(path):  # a killed run's; this run replaces it anyway
                log.info("synth: removing %s, set aside by a run that was killed", stale)
                _remove(stale)
    for path in (bag, truth):
        if not overwrite and path.exists():
            raise _exists_already(path)
    if not bag.parent.is_dir():
        if bag.parent.exists():
            raise SynthError(
                f"{bag.parent} is not a directory, so {bag.name} cannot be written in it: "
                "choose an output in an existing directory"
            )
        raise SynthError(f"the output directory {bag.parent} does not exist")
    for stale in _dead_leftovers(bag, "part"):
        log.info("synth: removing %s, left by a run that was killed", stale)
        _remove(stale)
    # unique per call (two calls of one process may write one name), the pid last
    stage = bag.with_name(f".{bag.name}.part-{uuid.uuid4().hex[:8]}-{os.getpid()}")
    try:
        stage.mkdir()
    except OSError as err:  # e.g. a directory this user cannot write to
        raise OSError(err.errno, err.strerror or str(err), str(bag)) from err
    started = time.perf_counter()
    log.info(
        "synth: %s s drive, seed %d, %s -> %s", config.seconds, config.seed, config.format, bag
    )
    try:
        world = build_world(config.seed)
        route = make_route(world, config)
        driver = Driver(world, route, config)
        staged = stage / bag.name
        drive = _open_drive(config, staged, world)
        ok = False
        try:
            _run(drive, driver, config, progress)
            drive.writer.close()
            drive.truth.finish(_truth_meta(drive, config, bag))
            ok = True
        finally:
            if not ok:  # release the files; the staging directory goes below
                with contextlib.suppress(Exception):
                    drive.writer.abort()
                with contextlib.suppress(Exception):
                    drive.truth.abort()
        _publish(staged, bag, truth, overwrite=overwrite)
    except OSError as err:
        named = _user_error(err, stage, bag)
        if named is err:
            raise
        raise named from err
    except sqlite3.Error as err:
        raise _storage_error(err, bag) from err
    finally:
        _remove(stage)
    wall = time.perf_counter() - started
    log.info("synth: wrote %d messages to %s in %.1f s", sum(drive.counts.values()), bag, wall)
    return DriveResult(
        bag=bag,
        truth=truth,
        format=config.format,
        messages=dict(drive.counts),
        bytes=_bag_size(bag),
        seconds=config.seconds,
        wall_s=wall,
    )


def _run(
    drive: _Drive, driver: Driver, config: DriveConfig, progress: Callable[[float], None] | None
) -> None:
    duration = config.duration_ns
    window = config.period_ns(config.lidar_hz)
    lookback = window / _NS + 0.005
    buffer = driver.initial_sample()
    drive.static_tf()
    periods = {
        "truth": config.period_ns(config.truth_hz),
        "imu": config.period_ns(config.imu_hz),
        "odom": config.period_ns(config.odom_hz),
        "gps": config.period_ns(config.gps_hz),
        "camera": config.period_ns(config.camera_hz),
    }
    t0 = 0
    while t0 < duration:
        t1 = min(t0 + window, duration)
        buffer = np.concatenate([buffer, driver.advance(t1 / _NS + 0.002)])
        buffer = buffer[buffer[:, 0] >= t0 / _NS - lookback]
        traj = Trajectory.from_samples(drive.world, buffer)
        # the raster covers where the car drove in the window, whatever the truth rate
        drive.truth.cover(traj.position[(traj.t >= t0 / _NS) & (traj.t <= t1 / _NS)])
        drive.ground_truth(traj, _grid(t0, t1, periods["truth"], _PHASE["truth"]))
        drive.imu_samples(traj, _grid(t0, t1, periods["imu"], _PHASE["imu"]))
        drive.odometry(traj, _grid(t0, t1, periods["odom"], _PHASE["odom"]))
        drive.gps(traj, _grid(t0, t1, periods["gps"], _PHASE["gps"]))
        if drive.lidar is not None:
            drive.lidar_sweeps(traj, _grid(t0, t1, window, 0, first=1))
        if drive.camera is not None:
            drive.camera_frames(traj, _grid(t0, t1, periods["camera"], _PHASE["camera"]))
        drive.flush()
        t0 = t1
        if progress is not None:
            progress(t1 / _NS)
