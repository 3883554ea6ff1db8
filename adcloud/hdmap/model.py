"""The arrays one drive is mapped from, and the trajectory mapping recovers.

These plain containers are what the stages pass between each other (and across Spark
closures: they pickle as NumPy arrays). Times are int64 ns since the Unix epoch; frames
follow REP 103/105 (``map`` ENU, ``base_link`` FLU); 4x4 float64 matrices map child-frame
points into the parent frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

__all__ = ["Extrinsics", "GpsFixes", "ImuSamples", "OdomSamples", "Scan"]

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Extrinsics:
    """Sensor mounts: ``frames[name]`` is the 4x4 ``base_link <- name`` transform."""

    frames: dict[str, F64] = field(default_factory=dict)

    def get(self, name: str) -> F64:
        """The mount of frame ``name`` (identity for ``base_link``); KeyError if unknown."""
        if name == "base_link":
            return np.eye(4)
        return self.frames[name]


@dataclass(frozen=True)
class ImuSamples:
    """IMU samples in the IMU frame: ``t`` (n,) ns, ``accel`` (n, 3) m/s² specific force,
    ``gyro`` (n, 3) rad/s."""

    frame: str
    t: NDArray[np.int64]
    accel: F64
    gyro: F64


@dataclass(frozen=True)
class OdomSamples:
    """Wheel odometry: ``t`` (n,) ns, forward ``speed`` m/s and ``yaw_rate`` rad/s in
    ``base_link``."""

    t: NDArray[np.int64]
    speed: F64
    yaw_rate: F64


@dataclass(frozen=True)
class GpsFixes:
    """GNSS fixes of the antenna (frame ``frame``): ``t`` (n,) ns, ``enu`` (n, 3) m in the map
    frame (converted from WGS84 about the map origin), ``sigma`` (n, 3) m (standard deviation
    per axis from the fix covariance)."""

    frame: str
    t: NDArray[np.int64]
    enu: F64
    sigma: F64


@dataclass(frozen=True)
class Scan:
    """One LiDAR sweep in the sensor frame ``frame``, stamped at ``stamp`` (ns).

    ``xyz`` (n, 3) float32 m at each point's firing time; ``intensity`` (n,) float32;
    ``dt`` (n,) float32 s, firing time relative to ``stamp`` (0 where the sensor gives no
    per-point time); ``label`` (n,) uint16 when the bag carries per-point labels, else None.
    """

    drive: str
    stamp: int
    frame: str
    xyz: NDArray[np.float32]
    intensity: NDArray[np.float32]
    dt: NDArray[np.float32]
    label: NDArray[np.uint16] | None = None

    def __len__(self) -> int:
        return int(self.xyz.shape[0])
