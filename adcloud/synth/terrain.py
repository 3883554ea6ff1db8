"""The terrain: a smooth analytic height field with real slopes.

``z = base + gx*x + gy*y + sum_k a_k * sin(kx_k*x + ky_k*y + phase_k)`` in the map frame
(ENU, metres).  Roads lie on it; sidewalks and everything off the road sit
:data:`~adcloud.synth.roads.CURB_HEIGHT_M` higher.  The bound on the gradient norm
(:attr:`Terrain.max_slope`) lets ray casting bracket every ground hit without a scan.

Evaluation follows the input dtype: float32 inputs (the ray caster) are evaluated in
float32, which differs from float64 by ~1e-5 m over the world.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["Terrain", "make_terrain"]

FloatArray = NDArray[np.floating]


@dataclass(frozen=True)
class Terrain:
    """An analytic height field: a tilted plane plus a few long sine waves.

    ``waves`` is ``(K, 4)``: amplitude (m), wave numbers kx, ky (rad/m), phase (rad).
    """

    base: float
    grad: tuple[float, float]
    waves: NDArray[np.float64]

    @property
    def max_slope(self) -> float:
        """An upper bound of the gradient norm (rise over run) anywhere."""
        k = np.hypot(self.waves[:, 1], self.waves[:, 2])
        return float(np.hypot(*self.grad) + np.sum(np.abs(self.waves[:, 0]) * k))

    def height(self, x: FloatArray, y: FloatArray) -> FloatArray:
        """Terrain height (m, map frame) at ``(x, y)``; the dtype of ``x`` is kept."""
        dt = np.result_type(x, np.float32)
        x = np.asarray(x, dtype=dt)
        y = np.asarray(y, dtype=dt)
        z = self.base + self.grad[0] * x + self.grad[1] * y
        for a, kx, ky, ph in self.waves.astype(dt):
            z = z + a * np.sin(kx * x + ky * y + ph)
        return np.asarray(z, dtype=dt)

    def gradient(self, x: FloatArray, y: FloatArray) -> tuple[FloatArray, FloatArray]:
        """``(dz/dx, dz/dy)`` at ``(x, y)``."""
        dt = np.result_type(x, np.float32)
        x = np.asarray(x, dtype=dt)
        y = np.asarray(y, dtype=dt)
        gx = np.full(x.shape, self.grad[0], dtype=dt)
        gy = np.full(x.shape, self.grad[1], dtype=dt)
        for a, kx, ky, ph in self.waves.astype(dt):
            c = a * np.cos(kx * x + ky * y + ph)
            gx = gx + kx * c
            gy = gy + ky * c
        return gx, gy


def make_terrain(rng: np.random.Generator, *, max_slope: float = 0.07) -> Terrain:
    """A random terrain whose slope bound is ``max_slope`` (a few per cent).

    Wavelengths are 150--450 m, so hills and dips span a block; the tilt is 0.5--1.5 %.
    """
    angle = rng.uniform(0, 2 * np.pi)
    tilt = rng.uniform(0.005, 0.015)
    grad = (tilt * np.cos(angle), tilt * np.sin(angle))
    n = 4
    lam = rng.uniform(150.0, 450.0, n)
    direction = rng.uniform(0, 2 * np.pi, n)
    k = 2 * np.pi / lam
    amp = rng.uniform(0.5, 1.0, n)
    budget = max_slope - tilt
    amp *= budget / float(np.sum(amp * k))
    waves = np.stack(
        [amp, k * np.cos(direction), k * np.sin(direction), rng.uniform(0, 2 * np.pi, n)], axis=1
    )
    return Terrain(base=0.0, grad=(float(grad[0]), float(grad[1])), waves=waves)
