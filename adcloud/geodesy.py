"""WGS84 geodesy for map frames: exact conversions between latitude/longitude/height and a
local ENU tangent plane about an origin (through ECEF; the "LocalCartesian" projection that
GeographicLib and Autoware's map projector use).

Hand-written because it is twenty lines of closed-form WGS84 and every service needs it; a
projection library would add a large dependency for no extra accuracy.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["enu_to_geodetic", "geodetic_to_enu"]

F64 = NDArray[np.float64]

_A = 6378137.0
_F = 1 / 298.257223563
_E2 = _F * (2 - _F)


def _geodetic_to_ecef(lat: F64, lon: F64, h: F64) -> F64:
    lat, lon = np.radians(lat), np.radians(lon)
    n = _A / np.sqrt(1 - _E2 * np.sin(lat) ** 2)
    return np.stack(
        [
            (n + h) * np.cos(lat) * np.cos(lon),
            (n + h) * np.cos(lat) * np.sin(lon),
            (n * (1 - _E2) + h) * np.sin(lat),
        ],
        axis=-1,
    )


def _ecef_to_geodetic(p: F64) -> tuple[F64, F64, F64]:
    x, y, z = p[..., 0], p[..., 1], p[..., 2]
    lon = np.arctan2(y, x)
    r = np.hypot(x, y)
    lat = np.arctan2(z, r * (1 - _E2))
    h = np.zeros_like(r)
    for _ in range(6):
        n = _A / np.sqrt(1 - _E2 * np.sin(lat) ** 2)
        h = r / np.cos(lat) - n
        lat = np.arctan2(z, r * (1 - _E2 * n / (n + h)))
    return np.degrees(lat), np.degrees(lon), h


def _enu_basis(lat0: float, lon0: float) -> F64:
    la, lo = np.radians(lat0), np.radians(lon0)
    return np.array(
        [
            [-np.sin(lo), np.cos(lo), 0.0],
            [-np.sin(la) * np.cos(lo), -np.sin(la) * np.sin(lo), np.cos(la)],
            [np.cos(la) * np.cos(lo), np.cos(la) * np.sin(lo), np.sin(la)],
        ]
    )


def enu_to_geodetic(enu: F64, origin: tuple[float, float, float]) -> tuple[F64, F64, F64]:
    """Latitude, longitude (degrees) and height (m) of map-frame points ``(N, 3)``."""
    base = _geodetic_to_ecef(np.array(origin[0]), np.array(origin[1]), np.array(origin[2]))
    ecef = base + np.asarray(enu) @ _enu_basis(origin[0], origin[1])
    return _ecef_to_geodetic(ecef)


def geodetic_to_enu(lat: F64, lon: F64, h: F64, origin: tuple[float, float, float]) -> F64:
    """Map-frame coordinates ``(N, 3)`` (m) of WGS84 positions."""
    base = _geodetic_to_ecef(np.array(origin[0]), np.array(origin[1]), np.array(origin[2]))
    ecef = _geodetic_to_ecef(np.asarray(lat), np.asarray(lon), np.asarray(h))
    return np.asarray((ecef - base) @ _enu_basis(origin[0], origin[1]).T)
