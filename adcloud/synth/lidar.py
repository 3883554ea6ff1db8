"""A spinning LiDAR: ray-cast sweeps with noise, dropouts, intensity and labels.

The sensor spins counter-clockwise (seen from above) at ``lidar_hz``; a sweep has
``lidar_columns`` firings, each firing all ``lidar_beams`` lasers at once at evenly
spaced elevations from ``lidar_fov_down_deg`` to ``lidar_fov_up_deg``.  Column ``c`` of
the sweep stamped ``T`` fires at ``T - period * (C - c) / C`` from the pose the car has
*then*: points are raw, in the ``lidar`` frame at their own firing time, like a real
driver's output (the motion of the car during a sweep is in the data; de-skew with the
per-point ``t``).

Per point: ``x, y, z`` (float32, m, lidar frame), ``intensity`` (float32, 0..255: 255 x
reflectance x (0.3 + 0.7 cos(incidence)), 5 % multiplicative noise), ``t`` (float32, s
relative to the header stamp, always negative), ``ring`` (uint16, 0 = lowest beam) and
``label`` (uint16, :class:`~adcloud.synth.labels.Label`).  Range noise is Gaussian along
the beam: ``lidar_range_noise_m`` plus the label's extra noise in quadrature.  Returns
are dropped at random (``lidar_dropout``), more often when weak (far, dark, grazing),
below 1 m and beyond ``lidar_max_range_m``; the cloud is unorganized and dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.config import DriveConfig
from adcloud.synth.frames import MOUNTS
from adcloud.synth.labels import RANGE_NOISE_EXTRA_M
from adcloud.synth.raycast import cast_rays
from adcloud.synth.trajectory import Trajectory
from adcloud.synth.world import World

__all__ = ["POINT_DTYPE", "LidarModel"]

#: The point layout of ``/lidar/points`` (24 bytes, little-endian).
POINT_DTYPE = np.dtype(
    [
        ("x", "<f4"),
        ("y", "<f4"),
        ("z", "<f4"),
        ("intensity", "<f4"),
        ("t", "<f4"),
        ("ring", "<u2"),
        ("label", "<u2"),
    ]
)

MIN_RANGE_M = 1.0
_COLUMNS_PER_BIN = 8
_BEAM_GROUPS = 4


@dataclass(frozen=True)
class LidarModel:
    """Beam geometry and noise of the LiDAR (from :class:`DriveConfig`)."""

    beams: int
    columns: int
    period: float
    elevations: NDArray[np.float64]
    azimuths: NDArray[np.float64]
    max_range: float
    range_noise: float
    dropout: float

    @classmethod
    def from_config(cls, config: DriveConfig) -> LidarModel:
        """The LiDAR a drive uses."""
        elev = np.radians(
            np.linspace(config.lidar_fov_down_deg, config.lidar_fov_up_deg, config.lidar_beams)
        )
        c = config.lidar_columns
        az = -np.pi + 2 * np.pi * (np.arange(c) + 0.5) / c
        return cls(
            beams=config.lidar_beams,
            columns=c,
            period=1.0 / config.lidar_hz,
            elevations=elev,
            azimuths=az,
            max_range=config.lidar_max_range_m,
            range_noise=config.lidar_range_noise_m,
            dropout=config.lidar_dropout,
        )

    def directions(self) -> NDArray[np.float64]:
        """Unit beam directions in the lidar frame, ``(columns, beams, 3)``."""
        az = self.azimuths[:, None]
        el = self.elevations[None, :]
        return np.stack(
            np.broadcast_arrays(np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)),
            axis=-1,
        )

    def column_offsets(self) -> NDArray[np.float64]:
        """Firing time of each column relative to the sweep stamp (s, negative)."""
        c = self.columns
        return -self.period * (c - np.arange(c)) / c

    def sweep(
        self, world: World, trajectory: Trajectory, stamp: float, rng: np.random.Generator
    ) -> NDArray[np.void]:
        """The points (:data:`POINT_DTYPE`) of the sweep that ends at ``stamp`` (s)."""
        mount = MOUNTS["lidar"]
        offsets = self.column_offsets()
        times = stamp + offsets
        origin, rot = trajectory.mount_pose(times, np.asarray(mount.translation), mount.rotation)
        local = self.directions()
        world_dirs = np.einsum("cij,cbj->cbi", rot, local)
        cols, beams = self.columns, self.beams
        origins = np.repeat(origin, beams, axis=0)
        ray_times = np.repeat(times, beams)
        col_bin = np.arange(cols) // _COLUMNS_PER_BIN
        beam_bin = np.arange(beams) * _BEAM_GROUPS // beams
        bins = (col_bin[:, None] * _BEAM_GROUPS + beam_bin[None, :]).ravel()
        dirs = world_dirs.reshape(-1, 3)
        hits = cast_rays(world, origins, dirs, ray_times, max_range=self.max_range, bins=bins)

        n = cols * beams
        sigma = np.sqrt(
            self.range_noise**2 + RANGE_NOISE_EXTRA_M[hits.label].astype(np.float64) ** 2
        )
        noise = rng.standard_normal(n) * sigma
        gain = rng.standard_normal(n)
        drop_draw = rng.random(n)
        r_true = hits.range.astype(np.float64)
        r_meas = r_true + noise
        cos_inc = np.abs(np.einsum("ij,ij->i", hits.normal, dirs.astype(np.float32))).astype(
            np.float64
        )
        refl = hits.reflectance.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            power = refl * cos_inc / (r_true / 50.0) ** 2
            p_drop = self.dropout + (1 - self.dropout) * np.exp(-power / 0.002)
        keep = (
            np.isfinite(r_true)
            & (r_meas >= MIN_RANGE_M)
            & (r_meas <= self.max_range)
            & (drop_draw >= np.nan_to_num(p_drop, nan=1.0))
        )
        idx = np.nonzero(keep)[0]
        out = np.empty(len(idx), dtype=POINT_DTYPE)
        xyz = local.reshape(-1, 3)[idx] * r_meas[idx, None]
        out["x"] = xyz[:, 0]
        out["y"] = xyz[:, 1]
        out["z"] = xyz[:, 2]
        inten = 255.0 * refl[idx] * (0.3 + 0.7 * cos_inc[idx]) * (1 + 0.05 * gain[idx])
        out["intensity"] = np.clip(inten, 0, 255)
        out["t"] = np.repeat(offsets, beams)[idx]
        out["ring"] = (idx % beams).astype(np.uint16)
        out["label"] = hits.label[idx]
        return out
