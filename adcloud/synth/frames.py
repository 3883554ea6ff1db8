"""Frames, sensor mounts and rotation helpers.

Frames (REP 103/105): ``map`` (ENU, metres, the truth frame; its geographic origin is
``DriveConfig.gps_origin``), ``odom`` (where wheel odometry starts, 2D), ``base_link``
(FLU: x forward, y left, z up; on the ground under the rear-axle centre) and the sensor
frames below, fixed to ``base_link`` and published on ``/tf_static``.  Camera images use
``camera_optical`` (x right, y down, z forward).

Quaternions are ``(x, y, z, w)`` like ROS messages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "MOUNTS",
    "SensorMount",
    "camera_mounts",
    "camera_prefix",
    "euler_matrix",
    "matrix_quaternion",
    "quaternion_matrix",
]

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class SensorMount:
    """A frame fixed to ``parent``: translation (m) and rotation (roll, pitch, yaw in rad)."""

    frame: str
    parent: str
    translation: tuple[float, float, float]
    rpy: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @property
    def rotation(self) -> F64:
        """``(3, 3)`` rotation from this frame to ``parent``."""
        return euler_matrix(*self.rpy)

    @property
    def quaternion(self) -> tuple[float, float, float, float]:
        """The rotation as ``(x, y, z, w)``."""
        q = matrix_quaternion(self.rotation[None])[0]
        return float(q[0]), float(q[1]), float(q[2]), float(q[3])


#: The sensor frames of the synthetic car (published on ``/tf_static``).
MOUNTS: dict[str, SensorMount] = {
    "lidar": SensorMount("lidar", "base_link", (1.2, 0.0, 1.9)),
    "imu": SensorMount("imu_link", "base_link", (0.3, 0.0, 0.45)),
    "gps": SensorMount("gps", "base_link", (0.0, 0.0, 1.75)),
    "camera": SensorMount("camera_link", "base_link", (1.8, 0.0, 1.4), (0.0, 0.08, 0.0)),
    "camera_optical": SensorMount(
        "camera_optical", "camera_link", (0.0, 0.0, 0.0), (-np.pi / 2, 0.0, -np.pi / 2)
    ),
}


def camera_prefix(index: int) -> str:
    """The topic prefix of camera ``index``: ``/camera`` for the first, ``/camera<k>`` after."""
    return "/camera" if index == 0 else f"/camera{index}"


def camera_mounts(index: int, count: int) -> tuple[SensorMount, SensorMount]:
    """``(link, optical)`` mounts of camera ``index`` of ``count`` evenly spaced in yaw.

    Camera 0 is the forward camera of :data:`MOUNTS`; camera ``k`` looks ``k / count`` of a
    turn to the left of it, from the roof edge in that direction (frames ``camera<k>_link``
    and ``camera<k>_optical``).
    """
    link, optical = MOUNTS["camera"], MOUNTS["camera_optical"]
    if index == 0:
        return link, optical
    yaw = 2 * np.pi * index / count
    x, _, z = link.translation
    mount = SensorMount(
        f"camera{index}_link",
        "base_link",
        (round(x * float(np.cos(yaw)), 6), round(0.9 * float(np.sin(yaw)), 6), z),
        (link.rpy[0], link.rpy[1], float(yaw)),
    )
    return mount, SensorMount(f"camera{index}_optical", mount.frame, (0.0, 0.0, 0.0), optical.rpy)


def euler_matrix(roll: float | F64, pitch: float | F64, yaw: float | F64) -> F64:
    """Rotation matrices ``R = Rz(yaw) Ry(pitch) Rx(roll)`` (``(3, 3)`` or ``(N, 3, 3)``)."""
    r, p, y = (np.asarray(v, dtype=np.float64) for v in (roll, pitch, yaw))
    cr, sr, cp, sp, cy, sy = np.cos(r), np.sin(r), np.cos(p), np.sin(p), np.cos(y), np.sin(y)
    m = np.empty((*np.broadcast(r, p, y).shape, 3, 3))
    m[..., 0, 0] = cy * cp
    m[..., 0, 1] = cy * sp * sr - sy * cr
    m[..., 0, 2] = cy * sp * cr + sy * sr
    m[..., 1, 0] = sy * cp
    m[..., 1, 1] = sy * sp * sr + cy * cr
    m[..., 1, 2] = sy * sp * cr - cy * sr
    m[..., 2, 0] = -sp
    m[..., 2, 1] = cp * sr
    m[..., 2, 2] = cp * cr
    return m


def matrix_euler(m: F64) -> tuple[F64, F64, F64]:
    """``(roll, pitch, yaw)`` of rotation matrices ``(N, 3, 3)`` (ZYX convention)."""
    yaw = np.arctan2(m[..., 1, 0], m[..., 0, 0])
    pitch = -np.arcsin(np.clip(m[..., 2, 0], -1.0, 1.0))
    roll = np.arctan2(m[..., 2, 1], m[..., 2, 2])
    return roll, pitch, yaw


def matrix_quaternion(m: F64) -> F64:
    """Unit quaternions ``(N, 4)``, ``(x, y, z, w)`` with ``w >= 0``, of rotations ``(N, 3, 3)``.

    Shepperd's method: the largest of ``|w|, |x|, |y|, |z|`` comes from the diagonal, the
    others from the off-diagonal sums and differences.  Taking every component's size from
    the diagonal and its sign from ``w``'s differences gave half-turns about tilted axes
    (``w = 0``: a sign from rounding noise) a wrong quaternion, and pure rotations
    ``1e-9`` components on the axes they do not turn about.
    """
    m = np.asarray(m, dtype=np.float64)
    m00, m11, m22 = m[..., 0, 0], m[..., 1, 1], m[..., 2, 2]
    d01, d02, d12 = (
        m[..., 1, 0] - m[..., 0, 1],
        m[..., 0, 2] - m[..., 2, 0],
        m[..., 2, 1] - m[..., 1, 2],
    )
    s01, s02, s12 = (
        m[..., 1, 0] + m[..., 0, 1],
        m[..., 0, 2] + m[..., 2, 0],
        m[..., 2, 1] + m[..., 1, 2],
    )
    # 4 w^2 - 1, 4 x^2 - 1, 4 y^2 - 1, 4 z^2 - 1: the largest component squared is at
    # least 1/4, so s = 4 |largest| >= 2 and no division loses precision
    diag = np.stack([m00 + m11 + m22, m00 - m11 - m22, m11 - m00 - m22, m22 - m00 - m11], -1)
    case = np.argmax(diag, axis=-1)
    s = 2 * np.sqrt(np.maximum(1.0 + np.max(diag, axis=-1), 1e-300))
    big = s / 4
    cases = [
        (big, d12 / s, d02 / s, d01 / s),  # w largest
        (d12 / s, big, s01 / s, s02 / s),  # x
        (d02 / s, s01 / s, big, s12 / s),  # y
        (d01 / s, s02 / s, s12 / s, big),  # z
    ]
    w, x, y, z = (np.choose(case, [c[i] for c in cases]) for i in range(4))
    q = np.stack([x, y, z, w], axis=-1) * np.where(w < 0, -1.0, 1.0)[..., None]
    return np.asarray(q / np.linalg.norm(q, axis=-1, keepdims=True), dtype=np.float64)


def quaternion_matrix(q: F64) -> F64:
    """Rotation matrices of quaternions ``(..., 4)`` given as ``(x, y, z, w)``."""
    q = np.asarray(q, dtype=np.float64)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    x, y, z, w = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    m = np.empty((*q.shape[:-1], 3, 3))
    m[..., 0, 0] = 1 - 2 * (y * y + z * z)
    m[..., 0, 1] = 2 * (x * y - z * w)
    m[..., 0, 2] = 2 * (x * z + y * w)
    m[..., 1, 0] = 2 * (x * y + z * w)
    m[..., 1, 1] = 1 - 2 * (x * x + z * z)
    m[..., 1, 2] = 2 * (y * z - x * w)
    m[..., 2, 0] = 2 * (x * z - y * w)
    m[..., 2, 1] = 2 * (y * z + x * w)
    m[..., 2, 2] = 1 - 2 * (x * x + y * y)
    return m
