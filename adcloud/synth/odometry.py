"""Wheel odometry: speed and yaw rate from the wheels, dead-reckoned in the ``odom`` frame.

The measured speed is the true speed of ``base_link`` (along the road surface) times
``1 + scale error`` plus white noise; the scale error starts at ``odom_scale_error`` and
random-walks with ``odom_scale_drift`` per sqrt(s) (bounded to +-5 %, or to
+-``odom_scale_error`` when that is larger).  The yaw rate is
the true body yaw rate plus white noise.  Both read exactly zero at standstill.  The
pose integrates them from ``(0, 0, 0)`` at the drive start ``t = 0`` (midpoint rule; the
first reading stands for the time before it), in 2D.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.config import DriveConfig
from adcloud.synth.trajectory import Trajectory

__all__ = ["OdometrySamples", "WheelOdometry"]

F64 = NDArray[np.float64]
_SCALE_BOUND = 0.05


@dataclass(frozen=True)
class OdometrySamples:
    """Odometry at ``t`` (s): measured ``speed`` (m/s), ``yaw_rate`` (rad/s), the pose
    ``x, y, yaw`` (odom frame, m, rad) and the true ``scale`` factor in the speed."""

    t: F64
    speed: F64
    yaw_rate: F64
    x: F64
    y: F64
    yaw: F64
    scale: F64


def _fold(value: float, bound: float) -> float:
    """``value`` reflected into ``[-bound, bound]`` at both bounds as often as it takes:
    one reflection left a step longer than the bound outside it (a drift of 2 per sqrt(s)
    gave scales from -1.5 to 3.1, and wheel speeds that ran backwards)."""
    folded = (value + bound) % (4 * bound)
    return float((folded if folded <= 2 * bound else 4 * bound - folded) - bound)


class WheelOdometry:
    """Dead reckoning from wheel speeds; call :meth:`measure` in time order."""

    def __init__(self, config: DriveConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        self.scale_error = float(config.odom_scale_error)
        # a start beyond +-5 % widens the bound: reflecting it at 5 % turned +15 % into -5 %
        self.scale_bound = max(_SCALE_BOUND, abs(self.scale_error))
        self.pose = (0.0, 0.0, 0.0)
        self.last: tuple[float, float, float] | None = None  # t, speed, yaw rate

    def measure(self, trajectory: Trajectory, t: F64) -> OdometrySamples:
        """Measurements at times ``t`` (s, increasing, after any earlier call's)."""
        cfg = self.config
        vel, _, omega, rot = trajectory.kinematics(t)
        forward = np.einsum("ni,ni->n", vel, rot[:, :, 0])
        true_speed = np.sign(forward) * np.linalg.norm(vel, axis=1)
        moving = np.abs(true_speed) > 0.005
        n = len(t)
        prev_t = self.last[0] if self.last is not None else (float(t[0]) if n else 0.0)
        dt = np.diff(np.concatenate([[prev_t], t]))
        scale = np.empty(n)
        err = self.scale_error
        draws = self.rng.standard_normal((n, 3))
        for i in range(n):
            err += cfg.odom_scale_drift * np.sqrt(max(dt[i], 0.0)) * draws[i, 0]
            if abs(err) > self.scale_bound:  # reflect at the bound
                err = np.sign(err) * (2 * self.scale_bound - abs(err))
                if abs(err) > self.scale_bound:  # a step longer than the bound
                    err = _fold(err, self.scale_bound)
            scale[i] = 1.0 + err
        self.scale_error = err
        speed = np.where(moving, true_speed * scale + cfg.odom_speed_noise * draws[:, 1], 0.0)
        yaw_rate = np.where(moving, omega[:, 2] + cfg.odom_yaw_rate_noise * draws[:, 2], 0.0)
        xs, ys, yaws = np.empty(n), np.empty(n), np.empty(n)
        x, y, yaw = self.pose
        last_v, last_w = (self.last[1], self.last[2]) if self.last is not None else (0.0, 0.0)
        step = dt
        if self.last is None and n:
            # the odom frame is base_link at the drive start (t = 0), not at the first
            # sample (3 ms later, 2.4 cm further at 8 m/s): the first reading holds till then
            last_v, last_w = float(speed[0]), float(yaw_rate[0])
            step = np.diff(np.concatenate([[0.0], t]))
        for i in range(n):
            v_mid = 0.5 * (last_v + speed[i])
            w_mid = 0.5 * (last_w + yaw_rate[i])
            heading = yaw + 0.5 * w_mid * step[i]
            x += v_mid * np.cos(heading) * step[i]
            y += v_mid * np.sin(heading) * step[i]
            yaw += w_mid * step[i]
            xs[i], ys[i], yaws[i] = x, y, yaw
            last_v, last_w = speed[i], yaw_rate[i]
        self.pose = (x, y, yaw)
        if n:
            self.last = (float(t[-1]), float(speed[-1]), float(yaw_rate[-1]))
        return OdometrySamples(t, speed, yaw_rate, xs, ys, yaws, scale)
