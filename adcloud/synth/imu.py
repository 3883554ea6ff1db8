"""The IMU: true specific force and angular rate plus bias and white noise.

Measurements are in the ``imu_link`` frame (mounted at ``MOUNTS["imu"]``, axes
parallel to base_link, so the lever arm's centripetal terms are in the data):
``accel = R^T (a + (0, 0, g)) + b_a + n_a`` (m/s^2) and ``gyro = w + b_g + n_g``
(rad/s).  Biases start at ``N(0, imu_*_bias)`` per axis and random-walk with
``imu_*_bias_walk`` per sqrt(s); ``n`` is white with ``imu_*_noise`` per sample.
The true biases are written to the truth directory (``imu_bias.csv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.config import DriveConfig
from adcloud.synth.frames import MOUNTS
from adcloud.synth.trajectory import Trajectory

__all__ = ["ImuModel", "ImuSamples"]

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class ImuSamples:
    """IMU output at ``t`` (s): measured ``accel``/``gyro`` and the biases in them (``(N, 3)``)."""

    t: F64
    accel: F64
    gyro: F64
    accel_bias: F64
    gyro_bias: F64


class ImuModel:
    """A MEMS-grade IMU with drifting biases; call :meth:`measure` in time order."""

    def __init__(self, config: DriveConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        self.accel_bias = rng.standard_normal(3) * config.imu_accel_bias
        self.gyro_bias = rng.standard_normal(3) * config.imu_gyro_bias
        self.last_t: float | None = None

    def _walk(self, start: F64, t: F64, sigma: float) -> F64:
        prev = self.last_t if self.last_t is not None else float(t[0])
        dt = np.diff(np.concatenate([[prev], t]))
        steps = (
            self.rng.standard_normal((len(t), 3)) * (sigma * np.sqrt(np.maximum(dt, 0)))[:, None]
        )
        return np.asarray(start + np.cumsum(steps, axis=0))

    def measure(self, trajectory: Trajectory, t: F64) -> ImuSamples:
        """Measurements at times ``t`` (s, increasing, after any earlier call's)."""
        cfg = self.config
        mount = MOUNTS["imu"]
        f, w = trajectory.imu(t, np.asarray(mount.translation), mount.rotation)
        ba = self._walk(self.accel_bias, t, cfg.imu_accel_bias_walk)
        bg = self._walk(self.gyro_bias, t, cfg.imu_gyro_bias_walk)
        accel = f + ba + self.rng.standard_normal(f.shape) * cfg.imu_accel_noise
        gyro = w + bg + self.rng.standard_normal(w.shape) * cfg.imu_gyro_noise
        if len(t):
            self.accel_bias, self.gyro_bias = ba[-1], bg[-1]
            self.last_t = float(t[-1])
        return ImuSamples(t, accel, gyro, ba, bg)
