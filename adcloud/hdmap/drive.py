"""One drive's sensor streams as arrays: what the mapping stages read from a bag.

:class:`DriveAccumulator` takes decoded messages one by one (on an executor or in this
process) and returns :class:`~adcloud.hdmap.model.Scan` objects for LiDAR sweeps while it
gathers the small streams (IMU, wheel odometry, GPS, ``/tf_static``) into arrays;
:func:`read_drive` does the whole thing for one bag in this process. Message types are
checked against what each topic must carry, so a wrong topic name fails with the bag, the
topic and the type it found instead of a confusing attribute error later.

GPS fixes become map-frame ENU coordinates about the map origin (WGS84 latitude,
longitude, ellipsoidal height): the origin given, else the drive's first valid fix.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.spatial.transform import Rotation

from adcloud.binpipe import BinpipeError, pointcloud_array, read_messages, summarize
from adcloud.geodesy import geodetic_to_enu
from adcloud.hdmap.errors import DriveDataError
from adcloud.hdmap.model import Extrinsics, GpsFixes, ImuSamples, OdomSamples, Scan

__all__ = [
    "DriveAccumulator",
    "DriveData",
    "DriveTopics",
    "StreamChunk",
    "check_topics",
    "drive_name",
    "read_drive",
    "scan_from_msg",
    "stamp_ns",
]

log = logging.getLogger(__name__)

_NS = 1_000_000_000
Origin = tuple[float, float, float]


@dataclass(frozen=True)
class DriveTopics:
    """Where each stream is in the bag (settings ``hdmap``: ``ADCLOUD_HDMAP_LIDAR_TOPIC`` …)."""

    lidar: str = "/lidar/points"
    imu: str = "/imu/data"
    odom: str = "/odom"
    gps: str = "/gps/fix"
    tf_static: str = "/tf_static"

    @property
    def all(self) -> tuple[str, ...]:
        """Every topic, LiDAR first."""
        return (self.lidar, self.imu, self.odom, self.gps, self.tf_static)

    @property
    def small(self) -> tuple[str, ...]:
        """The low-rate streams the pose stage gathers on the driver."""
        return (self.imu, self.odom, self.gps, self.tf_static)


_EXPECTED = {
    "lidar": ("sensor_msgs/msg/PointCloud2", "sensor_msgs/PointCloud2"),
    "imu": ("sensor_msgs/msg/Imu", "sensor_msgs/Imu"),
    "odom": ("nav_msgs/msg/Odometry", "nav_msgs/Odometry"),
    "gps": ("sensor_msgs/msg/NavSatFix", "sensor_msgs/NavSatFix"),
    "tf_static": ("tf2_msgs/msg/TFMessage", "tf2_msgs/TFMessage"),
}


#: How many messages each stream needs for mapping, and what names the setting of its topic.
_NEEDED = {"lidar": 1, "imu": 2, "odom": 2, "gps": 1, "tf_static": 1}
_STREAM = {
    "lidar": "LiDAR sweeps",
    "imu": "IMU messages",
    "odom": "wheel-odometry messages",
    "gps": "GPS fixes",
    "tf_static": "static transforms",
}


def check_topics(
    uri: str,
    topics: DriveTopics,
    *,
    origin_known: bool,
    mounts_known: bool,
    storage_options: Mapping[str, object] | None = None,
) -> None:
    """Check from the bag's index that ``uri`` has what mapping needs: LiDAR sweeps, IMU and
    wheel odometry on their topics, GPS fixes unless the map's origin is known
    (``origin_known``), ``/tf_static`` unless mounts are configured (``mounts_known``), each
    of the expected type.  Where the origin is not known, the GPS messages are read up to
    the first valid fix, which the map's origin is taken from (a receiver that had none
    throughout fails the check).  A DriveDataError lists every problem at once, with the
    bag's topics of the right type for a topic that is missing.  A ROS 1 bag without an
    index (a recording cut off, or a copy still being written) is an error too: the map job
    reads bags by their index."""
    try:
        summary = summarize(uri, storage_options=storage_options)
    except BinpipeError as err:
        raise DriveDataError(f"drive {uri}: {err}") from err
    if not summary.indexed:
        raise DriveDataError(
            f"drive {uri}: the bag has no index (a recording cut off, or a copy still being "
            "written); wait for the copy, or write an indexed copy (rosbag reindex, or "
            "adcloud.binpipe.reindex.reindex_bag) and build from that"
        )
    counts: dict[str, tuple[str, int]] = {}
    for t in summary.topics:
        count = counts.get(t.topic, (t.msgtype, 0))[1] + t.count
        counts[t.topic] = (t.msgtype, count)
    optional = {"gps": origin_known, "tf_static": mounts_known}
    problems = []
    for role, topic in zip(_NEEDED, (getattr(topics, r) for r in _NEEDED), strict=True):
        msgtype, count = counts.get(topic, ("", 0))
        expected = _EXPECTED[role]
        setting = f"hdmap.{role}_topic or ADCLOUD_HDMAP_{role.upper()}_TOPIC"
        if count and msgtype not in expected:
            problems.append(f"{topic} carries {msgtype}, not {expected[0]} ({setting})")
        elif (
            role == "gps"
            and count
            and not origin_known
            and not _has_fix(uri, topic, storage_options)
        ):
            # the map's origin is a drive's first fix: a receiver that never got one
            # (NO_FIX throughout) leaves none, which the index cannot tell
            problems.append(
                f"{count} NavSatFix messages on {topic}, none of them a fix (status NO_FIX or no "
                "position throughout)"
            )
        elif count < _NEEDED[role] and not optional.get(role, False):
            others = sorted(t for t, (m, n) in counts.items() if m in expected and n)
            have = (
                f"its {expected[0]} topics: {', '.join(others)}"
                if others
                else f"it has no {expected[0]} topic"
            )
            problems.append(f"{count} {_STREAM[role]} on {topic} ({setting}; {have})")
    if problems:
        hints = []
        if any("gps_topic" in p or "NavSatFix messages on" in p for p in problems):
            hints.append("without GPS, give the map origin (hdmap.origin_lat/lon/alt)")
        if any("tf_static_topic" in p for p in problems):
            hints.append("without /tf_static, give the sensor mounts (hdmap.mounts)")
        raise DriveDataError(
            f"drive {uri} cannot be mapped: {'; '.join(problems)}. Set the topics in the "
            "build's --config (section hdmap) or the environment"
            + "".join(f"; {hint}" for hint in hints)
        )


def _valid_fix(msg: Any) -> bool:
    """Whether a decoded ``sensor_msgs/NavSatFix`` is a fix (status not NO_FIX, a finite
    position)."""
    return int(msg.status.status) >= 0 and bool(np.isfinite([msg.latitude, msg.longitude]).all())


def _has_fix(uri: str, topic: str, storage_options: Mapping[str, object] | None) -> bool:
    """Whether ``topic`` of the bag holds a valid fix; reads its messages up to the first
    (normally in the bag's first chunk)."""
    try:
        for _, msg in read_messages(uri, topics=[topic], storage_options=storage_options):
            if _valid_fix(msg):
                return True
    except BinpipeError as err:
        raise DriveDataError(f"drive {uri}: {err}") from err
    return False


@dataclass(frozen=True)
class DriveData:
    """A drive ready for mapping. ``scans`` is empty when they were left on the executors."""

    name: str
    uri: str
    extrinsics: Extrinsics
    imu: ImuSamples
    odom: OdomSamples
    gps: GpsFixes
    origin: Origin
    scans: list[Scan] = field(default_factory=list)

    @property
    def span_ns(self) -> tuple[int, int]:
        """First and last time of the odometry (ns)."""
        return int(self.odom.t[0]), int(self.odom.t[-1])


def drive_name(uri: str | os.PathLike[str]) -> str:
    """The drive name of a bag URI: its last path segment without ``.bag``/``.mcap``/``.db3``,
    reduced to ``[A-Za-z0-9._-]`` (map products and trajectories are named after it)."""
    text = os.fspath(uri).rstrip("/")
    base = posixpath.basename(text.split("://", 1)[-1]) or "drive"
    for suffix in (".bag", ".mcap", ".db3"):
        if base.lower().endswith(suffix) and len(base) > len(suffix):
            base = base[: -len(suffix)]
            break
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)


def stamp_ns(header: Any) -> int:
    """A ROS header stamp in ns."""
    stamp = header.stamp
    return int(stamp.sec) * _NS + int(stamp.nanosec)


def scan_from_msg(drive: str, msg: Any, *, topic: str = "/lidar/points") -> Scan:
    """A :class:`Scan` from a decoded ``sensor_msgs/PointCloud2`` (fields ``x y z`` required;
    ``intensity``, a per-point time ``t``/``time``/``timestamp`` in s and ``label`` when
    present). Non-finite points are dropped."""
    try:
        cloud = pointcloud_array(msg, topic=topic, require=("x", "y", "z"))
    except BinpipeError as err:
        raise DriveDataError(f"drive {drive}: {err}") from None
    names = cloud.dtype.names or ()
    xyz = np.stack([cloud["x"], cloud["y"], cloud["z"]], axis=1).astype(np.float32)
    keep = np.isfinite(xyz).all(axis=1)
    n = int(keep.sum())
    intensity = (
        cloud["intensity"].astype(np.float32)[keep]
        if "intensity" in names
        else np.zeros(n, np.float32)
    )
    time_field = next((f for f in ("t", "time", "timestamp") if f in names), None)
    dt = cloud[time_field].astype(np.float32)[keep] if time_field else np.zeros(n, np.float32)
    label = cloud["label"].astype(np.uint16)[keep] if "label" in names else None
    return Scan(
        drive=drive,
        stamp=stamp_ns(msg.header),
        frame=str(msg.header.frame_id),
        xyz=np.ascontiguousarray(xyz[keep]),
        intensity=intensity,
        dt=dt,
        label=label,
    )


def _matrix(translation: Any, rotation: Any) -> NDArray[np.float64]:
    out = np.eye(4)
    out[:3, :3] = Rotation.from_quat([rotation.x, rotation.y, rotation.z, rotation.w]).as_matrix()
    out[:3, 3] = [translation.x, translation.y, translation.z]
    return out


@dataclass(frozen=True)
class StreamChunk:
    """The low-rate streams one partition of a drive gathered: rows of IMU (t, accel,
    gyro), odometry (t, speed, yaw rate) and GPS (t, lat, lon, alt, variances), with exact
    int64 times beside them, the ``/tf_static`` edges (child: (parent, 4x4)), and the stamp
    and frame of every LiDAR sweep it saw (the sweeps themselves stay on the executors)."""

    name: str
    uri: str
    imu: NDArray[np.float64]
    imu_t: NDArray[np.int64]
    odom: NDArray[np.float64]
    odom_t: NDArray[np.int64]
    gps: NDArray[np.float64]
    gps_t: NDArray[np.int64]
    imu_frame: str
    gps_frame: str
    tf: dict[str, tuple[str, NDArray[np.float64]]]
    sweep_t: NDArray[np.int64]
    sweep_frames: tuple[str, ...]


class DriveAccumulator:
    """Gathers one drive's messages into :class:`DriveData` (see the module docstring).

    ``mounts`` (frame: 4x4 ``base_link <- frame``, from the ``hdmap.mounts`` setting) take
    precedence over the ``/tf_static`` chains of the same frames and stand in for a bag
    without ``/tf_static``; only :meth:`finish` reads them.
    """

    def __init__(
        self,
        name: str,
        uri: str = "",
        *,
        topics: DriveTopics | None = None,
        origin: Origin | None = None,
        mounts: Mapping[str, NDArray[np.float64]] | None = None,
    ) -> None:
        self.name = name
        self.uri = uri or name
        self.topics = topics or DriveTopics()
        self.origin = origin
        # Configured mounts (hdmap.mounts: frame -> 4x4 base_link <- frame): they end a
        # /tf_static chain at their frame, so they override it and fill in where it is missing.
        self.mounts = {k: np.asarray(v, dtype=np.float64) for k, v in (mounts or {}).items()}
        self._role = {
            self.topics.lidar: "lidar",
            self.topics.imu: "imu",
            self.topics.odom: "odom",
            self.topics.gps: "gps",
            self.topics.tf_static: "tf_static",
        }
        self._imu: list[tuple[int, float, float, float, float, float, float]] = []
        self._imu_frame = "imu_link"
        self._odom: list[tuple[int, float, float]] = []
        self._gps: list[tuple[int, float, float, float, float, float, float]] = []
        self._gps_frame = "gps"
        self._tf: dict[str, tuple[str, NDArray[np.float64]]] = {}
        self._sweeps: list[tuple[int, str]] = []

    def add(self, topic: str, msgtype: str, msg: Any) -> Scan | None:
        """Take one decoded message; a LiDAR sweep comes back as a :class:`Scan`."""
        role = self._role.get(topic)
        if role is None:
            return None
        if msgtype not in _EXPECTED[role]:
            raise DriveDataError(
                f"drive {self.uri}: topic {topic} carries {msgtype}, but the {role} topic must "
                f"carry {_EXPECTED[role][0]}; set the right topic (hdmap settings "
                f"{role}_topic) or fix the recording"
            )
        if role == "lidar":
            scan = scan_from_msg(self.name, msg, topic=topic)
            self._sweeps.append((scan.stamp, scan.frame))
            return scan
        if role == "imu":
            a, w = msg.linear_acceleration, msg.angular_velocity
            self._imu.append((stamp_ns(msg.header), a.x, a.y, a.z, w.x, w.y, w.z))
            self._imu_frame = str(msg.header.frame_id) or self._imu_frame
        elif role == "odom":
            twist = msg.twist.twist
            self._odom.append((stamp_ns(msg.header), twist.linear.x, twist.angular.z))
        elif role == "gps":
            if not _valid_fix(msg):
                return None  # no fix
            cov = np.asarray(msg.position_covariance, dtype=np.float64)
            var = cov[[0, 4, 8]] if cov.size == 9 else np.full(3, 25.0)
            self._gps.append(
                (stamp_ns(msg.header), msg.latitude, msg.longitude, msg.altitude, *var.tolist())
            )
            self._gps_frame = str(msg.header.frame_id) or self._gps_frame
        else:
            for tf in msg.transforms:
                child = str(tf.child_frame_id).lstrip("/")
                parent = str(tf.header.frame_id).lstrip("/")
                self._tf[child] = (parent, _matrix(tf.transform.translation, tf.transform.rotation))
        return None

    def chunk(self) -> StreamChunk:
        """What this accumulator gathered, as plain arrays (each Spark partition gathers its
        own chunk; the driver merges them with :meth:`absorb`)."""
        return StreamChunk(
            name=self.name,
            uri=self.uri,
            imu=np.asarray(self._imu, dtype=np.float64).reshape(-1, 7),
            imu_t=np.asarray([r[0] for r in self._imu], dtype=np.int64),
            odom=np.asarray(self._odom, dtype=np.float64).reshape(-1, 3),
            odom_t=np.asarray([r[0] for r in self._odom], dtype=np.int64),
            gps=np.asarray(self._gps, dtype=np.float64).reshape(-1, 7),
            gps_t=np.asarray([r[0] for r in self._gps], dtype=np.int64),
            imu_frame=self._imu_frame,
            gps_frame=self._gps_frame,
            tf={child: (parent, mat) for child, (parent, mat) in self._tf.items()},
            sweep_t=np.asarray([t for t, _ in self._sweeps], dtype=np.int64),
            sweep_frames=tuple(frame for _, frame in self._sweeps),
        )

    def absorb(self, chunk: StreamChunk) -> None:
        """Add a chunk gathered from other messages of this drive."""
        for t, row in zip(chunk.imu_t.tolist(), chunk.imu.tolist(), strict=True):
            self._imu.append((int(t), *row[1:]))
        for t, row in zip(chunk.odom_t.tolist(), chunk.odom.tolist(), strict=True):
            self._odom.append((int(t), row[1], row[2]))
        for t, row in zip(chunk.gps_t.tolist(), chunk.gps.tolist(), strict=True):
            self._gps.append((int(t), *row[1:]))
        self._tf.update(chunk.tf)
        self._sweeps.extend(zip(chunk.sweep_t.tolist(), chunk.sweep_frames, strict=True))
        self._imu_frame = chunk.imu_frame if len(chunk.imu) else self._imu_frame
        self._gps_frame = chunk.gps_frame if len(chunk.gps) else self._gps_frame

    @property
    def sweeps(self) -> list[tuple[int, str]]:
        """``(stamp, frame)`` of every LiDAR sweep taken or absorbed so far, by stamp."""
        return sorted(self._sweeps)

    def _extrinsics(self) -> Extrinsics:
        frames: dict[str, NDArray[np.float64]] = {}
        for child in sorted({*self._tf, *self.mounts}):
            chain = np.eye(4)
            frame, seen = child, set()
            while frame != "base_link":
                if frame in self.mounts:  # configured: the last word on this frame's mount
                    chain = self.mounts[frame] @ chain
                    frame = "base_link"
                    break
                if frame in seen or frame not in self._tf:
                    break
                seen.add(frame)
                parent, mat = self._tf[frame]
                chain = mat @ chain
                frame = parent
            if frame == "base_link":
                frames[child] = chain
        return Extrinsics(frames)

    def finish(self, scans: list[Scan] | None = None) -> DriveData:
        """The drive, with ``scans`` attached (none when they stay on the executors)."""
        where = f"drive {self.uri}"
        if len(self._odom) < 2:
            raise DriveDataError(
                f"{where}: {len(self._odom)} wheel-odometry messages on {self.topics.odom}; "
                "mapping needs odometry (set hdmap odom_topic)"
            )
        if len(self._imu) < 2:
            raise DriveDataError(
                f"{where}: {len(self._imu)} IMU messages on {self.topics.imu}; mapping needs "
                "an IMU (set hdmap imu_topic)"
            )
        if not self._tf and not self.mounts:
            raise DriveDataError(
                f"{where}: no sensor mounts on {self.topics.tf_static}; record /tf_static "
                "or give the mounts in the settings (hdmap.mounts, env ADCLOUD_HDMAP_MOUNTS: "
                "FRAME=x,y,z,roll,pitch,yaw in m and degrees)"
            )
        imu = np.asarray(sorted(self._imu), dtype=np.float64)
        odom = np.asarray(sorted(self._odom), dtype=np.float64)
        gps = np.asarray(sorted(self._gps), dtype=np.float64).reshape(-1, 7)
        origin = self.origin
        if origin is None:
            if not len(gps):
                raise DriveDataError(
                    f"{where}: no GPS fix on {self.topics.gps} and no map origin given; "
                    "give the origin (hdmap origin_lat/origin_lon/origin_alt)"
                )
            origin = (float(gps[0, 1]), float(gps[0, 2]), float(gps[0, 3]))
        enu = (
            geodetic_to_enu(gps[:, 1], gps[:, 2], gps[:, 3], origin)
            if len(gps)
            else np.zeros((0, 3))
        )
        return DriveData(
            name=self.name,
            uri=self.uri,
            extrinsics=self._extrinsics(),
            imu=ImuSamples(
                frame=self._imu_frame,
                t=np.asarray([r[0] for r in sorted(self._imu)], np.int64),
                accel=imu[:, 1:4],
                gyro=imu[:, 4:7],
            ),
            odom=OdomSamples(
                t=np.asarray([r[0] for r in sorted(self._odom)], np.int64),
                speed=odom[:, 1],
                yaw_rate=odom[:, 2],
            ),
            gps=GpsFixes(
                frame=self._gps_frame,
                t=np.asarray([r[0] for r in sorted(self._gps)], np.int64),
                enu=np.asarray(enu, dtype=np.float64).reshape(-1, 3),
                sigma=np.sqrt(np.maximum(gps[:, 4:7], 1e-6)),
            ),
            origin=origin,
            scans=sorted(scans or [], key=lambda s: s.stamp),
        )


def read_drive(
    uri: str,
    *,
    topics: DriveTopics | None = None,
    origin: Origin | None = None,
    with_scans: bool = True,
    storage_options: Mapping[str, object] | None = None,
    mounts: Mapping[str, NDArray[np.float64]] | None = None,
) -> DriveData:
    """Read one bag (any format and URL BinPipe reads) into :class:`DriveData` in this process
    (``mounts``: configured sensor mounts, see :class:`DriveAccumulator`)."""
    topics = topics or DriveTopics()
    acc = DriveAccumulator(drive_name(uri), uri, topics=topics, origin=origin, mounts=mounts)
    wanted = topics.all if with_scans else topics.small
    scans: list[Scan] = []
    try:
        for message, decoded in read_messages(uri, topics=wanted, storage_options=storage_options):
            scan = acc.add(message.topic, message.msgtype, decoded)
            if scan is not None:
                scans.append(scan)
    except BinpipeError as err:
        raise DriveDataError(f"drive {uri}: {err}") from err
    log.info("drive %s: %d scans read", acc.name, len(scans))
    return acc.finish(scans)
