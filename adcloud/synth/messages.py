"""ROS messages of a synthetic drive, built with rosbags' typestores and serialized.

One :class:`MessageCodec` per output: ROS 1 (Noetic definitions, ``serialize_ros1``,
``std_msgs/Header.seq`` counting per topic) or ROS 2 (Humble definitions, CDR).
Noetic's store lacks ``tf2_msgs/TFMessage``; it is registered with its standard
definition (MD5 ``94810edda583a504dfda3829e70d7eec``, as in ROS).

Every header stamp equals the message's record time in the bag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from rosbags.typesys import Stores, get_types_from_msg, get_typestore
from rosbags.typesys.store import Typestore

__all__ = ["TOPICS", "MessageCodec", "Topic"]

_NS = 1_000_000_000


@dataclass(frozen=True)
class Topic:
    """A topic of the drive: name, ROS 2 style type name, whether it is latched."""

    name: str
    msgtype: str
    latched: bool = False


#: Every topic a drive can have, in the order used to break timestamp ties.
TOPICS: dict[str, Topic] = {
    t.name: t
    for t in (
        Topic("/tf_static", "tf2_msgs/msg/TFMessage", latched=True),
        Topic("/ground_truth/odom", "nav_msgs/msg/Odometry"),
        Topic("/imu/data", "sensor_msgs/msg/Imu"),
        Topic("/odom", "nav_msgs/msg/Odometry"),
        Topic("/tf", "tf2_msgs/msg/TFMessage"),
        Topic("/gps/fix", "sensor_msgs/msg/NavSatFix"),
        Topic("/lidar/points", "sensor_msgs/msg/PointCloud2"),
        Topic("/camera/camera_info", "sensor_msgs/msg/CameraInfo"),
        Topic("/camera/image_raw", "sensor_msgs/msg/Image"),
        Topic("/camera/labels", "sensor_msgs/msg/Image"),
    )
}


def _stamp(t_ns: int) -> tuple[int, int]:
    return t_ns // _NS, t_ns % _NS


class MessageCodec:
    """Builds and serializes the drive's messages for ``flavour`` ``ros1`` or ``ros2``."""

    def __init__(self, flavour: str) -> None:
        self.flavour = flavour
        self.ros1 = flavour == "ros1"
        self.store: Typestore = get_typestore(
            Stores.ROS1_NOETIC if self.ros1 else Stores.ROS2_HUMBLE
        )
        if "tf2_msgs/msg/TFMessage" not in self.store.fielddefs:
            self.store.register(
                get_types_from_msg(
                    "geometry_msgs/TransformStamped[] transforms", "tf2_msgs/msg/TFMessage"
                )
            )
        self._seq: dict[str, int] = {}
        self.t = self.store.types

    def serialize(self, msg: object, msgtype: str) -> bytes:
        """Bytes of ``msg`` in this flavour's wire format."""
        if self.ros1:
            return bytes(self.store.serialize_ros1(msg, msgtype))
        return bytes(self.store.serialize_cdr(msg, msgtype))

    # ----------------------------------------------------------------- building blocks

    def header(self, topic: str | None, t_ns: int, frame: str) -> Any:
        """A ``std_msgs/Header`` stamped ``t_ns``; ROS 1 counts ``seq`` per topic from 0
        (``topic=None``: a header nested in a message, ``seq = 0``)."""
        sec, nsec = _stamp(t_ns)
        stamp = self.t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec)
        if self.ros1:
            seq = self._seq.get(topic, 0) if topic is not None else 0
            if topic is not None:
                self._seq[topic] = seq + 1
            return self.t["std_msgs/msg/Header"](seq=seq, stamp=stamp, frame_id=frame)
        return self.t["std_msgs/msg/Header"](stamp=stamp, frame_id=frame)

    def _vec(self, v: NDArray[np.float64] | tuple[float, ...]) -> Any:
        return self.t["geometry_msgs/msg/Vector3"](x=float(v[0]), y=float(v[1]), z=float(v[2]))

    def _quat(self, q: NDArray[np.float64] | tuple[float, ...]) -> Any:
        return self.t["geometry_msgs/msg/Quaternion"](
            x=float(q[0]), y=float(q[1]), z=float(q[2]), w=float(q[3])
        )

    def transform(self, t_ns: int, parent: str, child: str, xyz: Any, quat: Any) -> Any:
        """A ``geometry_msgs/TransformStamped`` ``parent -> child`` (for a TF message)."""
        tr = self.t["geometry_msgs/msg/Transform"](
            translation=self._vec(xyz), rotation=self._quat(quat)
        )
        return self.t["geometry_msgs/msg/TransformStamped"](
            header=self.header(None, t_ns, parent), child_frame_id=child, transform=tr
        )

    # ----------------------------------------------------------------- messages

    def tf(self, transforms: list[Any]) -> Any:
        """``tf2_msgs/TFMessage`` holding ``transforms``."""
        return self.t["tf2_msgs/msg/TFMessage"](transforms=transforms)

    def odometry(
        self,
        topic: str,
        t_ns: int,
        frame: str,
        child: str,
        position: Any,
        quat: Any,
        linear: Any,
        angular: Any,
        pose_cov: NDArray[np.float64],
        twist_cov: NDArray[np.float64],
    ) -> Any:
        """``nav_msgs/Odometry``: pose in ``frame``, twist in ``child`` (covariances 6x6)."""
        point = self.t["geometry_msgs/msg/Point"](
            x=float(position[0]), y=float(position[1]), z=float(position[2])
        )
        pose = self.t["geometry_msgs/msg/Pose"](position=point, orientation=self._quat(quat))
        twist = self.t["geometry_msgs/msg/Twist"](
            linear=self._vec(linear), angular=self._vec(angular)
        )
        return self.t["nav_msgs/msg/Odometry"](
            header=self.header(topic, t_ns, frame),
            child_frame_id=child,
            pose=self.t["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=pose_cov),
            twist=self.t["geometry_msgs/msg/TwistWithCovariance"](
                twist=twist, covariance=twist_cov
            ),
        )

    def imu(
        self,
        topic: str,
        t_ns: int,
        frame: str,
        accel: Any,
        gyro: Any,
        accel_var: float,
        gyro_var: float,
    ) -> Any:
        """``sensor_msgs/Imu`` without orientation (``orientation_covariance[0] = -1``)."""
        ocov = np.zeros(9)
        ocov[0] = -1.0
        return self.t["sensor_msgs/msg/Imu"](
            header=self.header(topic, t_ns, frame),
            orientation=self._quat((0.0, 0.0, 0.0, 1.0)),
            orientation_covariance=ocov,
            angular_velocity=self._vec(gyro),
            angular_velocity_covariance=np.diag([gyro_var] * 3).ravel(),
            linear_acceleration=self._vec(accel),
            linear_acceleration_covariance=np.diag([accel_var] * 3).ravel(),
        )

    def navsatfix(
        self,
        topic: str,
        t_ns: int,
        frame: str,
        lat: float,
        lon: float,
        alt: float,
        var: tuple[float, float, float],
    ) -> Any:
        """``sensor_msgs/NavSatFix`` with a GPS fix and a diagonal known covariance."""
        status = self.t["sensor_msgs/msg/NavSatStatus"](status=0, service=1)
        return self.t["sensor_msgs/msg/NavSatFix"](
            header=self.header(topic, t_ns, frame),
            status=status,
            latitude=float(lat),
            longitude=float(lon),
            altitude=float(alt),
            position_covariance=np.diag(var).ravel().astype(np.float64),
            position_covariance_type=2,
        )

    def pointcloud2(self, topic: str, t_ns: int, frame: str, points: NDArray[np.void]) -> Any:
        """``sensor_msgs/PointCloud2`` of a structured array (unorganized, dense)."""
        kinds = {"<f4": 7, "<u2": 4, "<u1": 2, "<f8": 8, "<u4": 6}
        fields = []
        assert points.dtype.names is not None
        for name in points.dtype.names:
            dt, offset = points.dtype.fields[name][:2]  # type: ignore[index]
            fields.append(
                self.t["sensor_msgs/msg/PointField"](
                    name=name, offset=int(offset), datatype=kinds[dt.str], count=1
                )
            )
        data = np.frombuffer(np.ascontiguousarray(points).tobytes(), dtype=np.uint8)
        return self.t["sensor_msgs/msg/PointCloud2"](
            header=self.header(topic, t_ns, frame),
            height=1,
            width=len(points),
            fields=fields,
            is_bigendian=False,
            point_step=points.dtype.itemsize,
            row_step=points.dtype.itemsize * len(points),
            data=data,
            is_dense=True,
        )

    def image(
        self, topic: str, t_ns: int, frame: str, pixels: NDArray[np.uint8], encoding: str
    ) -> Any:
        """``sensor_msgs/Image`` (``rgb8`` or ``mono8``), rows top to bottom."""
        h, w = pixels.shape[:2]
        channels = 1 if pixels.ndim == 2 else pixels.shape[2]
        return self.t["sensor_msgs/msg/Image"](
            header=self.header(topic, t_ns, frame),
            height=h,
            width=w,
            encoding=encoding,
            is_bigendian=0,
            step=w * channels,
            data=np.ascontiguousarray(pixels).reshape(-1),
        )

    def camera_info(
        self, topic: str, t_ns: int, frame: str, width: int, height: int, k: tuple[float, ...]
    ) -> Any:
        """``sensor_msgs/CameraInfo`` of an undistorted pinhole camera (``plumb_bob``, D = 0)."""
        fx, _, cx, _, fy, cy, *_ = k
        p = np.array([fx, 0, cx, 0, 0, fy, cy, 0, 0, 0, 1, 0], dtype=np.float64)
        names = ("D", "K", "R", "P") if self.ros1 else ("d", "k", "r", "p")
        arrays = dict(
            zip(
                names,
                (np.zeros(5), np.asarray(k, dtype=np.float64), np.eye(3).ravel(), p),
                strict=True,
            )
        )
        roi = self.t["sensor_msgs/msg/RegionOfInterest"](
            x_offset=0, y_offset=0, height=0, width=0, do_rectify=False
        )
        return self.t["sensor_msgs/msg/CameraInfo"](
            header=self.header(topic, t_ns, frame),
            height=height,
            width=width,
            distortion_model="plumb_bob",
            binning_x=0,
            binning_y=0,
            roi=roi,
            **arrays,
        )
