"""GPS: antenna positions with metre-level noise, a slow bias and an outage, as WGS84 fixes.

The map frame is a local ENU tangent plane at ``DriveConfig.gps_origin`` (latitude,
longitude in degrees, ellipsoidal height in m, WGS84); :func:`enu_to_geodetic` and
:func:`geodetic_to_enu` convert exactly (through ECEF), so truth can be compared with
fixes at any distance from the origin.

Error model per fix: a Gauss-Markov bias (``gps_bias_m`` 1 sigma, time constant
``gps_bias_tau_s``) plus white noise (``gps_noise_m``); vertical errors are 1.5x the
horizontal ones.  During ``gps_outage`` no fix is published at all.  Fixes come at whole
multiples of ``1 / gps_hz`` after the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.geodesy import enu_to_geodetic, geodetic_to_enu
from adcloud.synth.config import DriveConfig
from adcloud.synth.frames import MOUNTS
from adcloud.synth.trajectory import Trajectory

__all__ = ["GnssModel", "GnssSamples", "enu_to_geodetic", "geodetic_to_enu"]

F64 = NDArray[np.float64]

VERTICAL_FACTOR = 1.5


@dataclass(frozen=True)
class GnssSamples:
    """Fixes at ``t`` (s): ``lat, lon`` (deg), ``alt`` (m), the true antenna position
    (``truth``, map frame), the bias in the fix (``bias``, ENU m) and whether the fix is
    ``published`` (not in the outage)."""

    t: F64
    published: NDArray[np.bool_]
    lat: F64
    lon: F64
    alt: F64
    truth: F64
    bias: F64


class GnssModel:
    """A single-frequency GPS receiver; call :meth:`measure` in time order."""

    def __init__(self, config: DriveConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        scale = np.array([1.0, 1.0, VERTICAL_FACTOR])
        self.bias = rng.standard_normal(3) * config.gps_bias_m * scale
        self.last_t: float | None = None

    def in_outage(self, t: F64) -> NDArray[np.bool_]:
        """Whether times ``t`` fall in the configured outage."""
        start, duration = self.config.gps_outage
        return (np.asarray(t) >= start) & (np.asarray(t) < start + duration)

    def measure(self, trajectory: Trajectory, t: F64) -> GnssSamples:
        """Fixes at times ``t`` (increasing, after earlier calls'), outage ones flagged."""
        cfg = self.config
        scale = np.array([1.0, 1.0, VERTICAL_FACTOR])
        biases = np.empty((len(t), 3))
        draws = self.rng.standard_normal((len(t), 6))
        for i, ti in enumerate(t):
            if self.last_t is not None:
                phi = np.exp(-(ti - self.last_t) / cfg.gps_bias_tau_s)
                self.bias = (
                    phi * self.bias + np.sqrt(1 - phi * phi) * cfg.gps_bias_m * scale * draws[i, :3]
                )
            self.last_t = float(ti)
            biases[i] = self.bias
        mount = MOUNTS["gps"]
        antenna, _ = trajectory.mount_pose(t, np.asarray(mount.translation), mount.rotation)
        measured = antenna + biases + draws[:, 3:] * cfg.gps_noise_m * scale
        lat, lon, alt = enu_to_geodetic(measured, cfg.gps_origin)
        return GnssSamples(t, ~self.in_outage(t), lat, lon, alt, antenna, biases)
