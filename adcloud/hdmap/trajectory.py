"""Trajectories: timed rigid poses, interpolation, TUM/KITTI files and the ATE metric.

A :class:`Trajectory` holds poses of ``base_link`` in ``map`` (4x4, float64) at increasing
times (int64 ns). Between samples positions interpolate linearly and rotations by slerp
(SciPy's :class:`~scipy.spatial.transform.Slerp`). :func:`absolute_trajectory_error` is the
usual ATE: the RMSE of position differences after the least-squares rigid alignment
(Umeyama/Horn) of the estimate onto the reference, as the TUM benchmark and ``evo`` compute it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from scipy.spatial.transform import Rotation, Slerp

from adcloud.hdmap.errors import MapFormatError

__all__ = ["AteResult", "Trajectory", "absolute_trajectory_error", "rigid_alignment"]

_NS = 1_000_000_000
F64 = NDArray[np.float64]


def _stamp(t_ns: int) -> str:
    sec, rem = divmod(int(t_ns), _NS)
    return f"{sec}.{rem:09d}"


def _parse_stamp(text: str) -> int:
    sec, _, frac = text.partition(".")
    return int(sec) * _NS + int(frac.ljust(9, "0")[:9]) if frac else int(sec) * _NS


@dataclass(frozen=True)
class Trajectory:
    """Poses ``matrices[i]`` (4x4 ``map <- base_link``) at times ``t[i]`` (ns, increasing)."""

    t: NDArray[np.int64]
    matrices: F64

    def __post_init__(self) -> None:
        t = np.asarray(self.t, dtype=np.int64)
        m = np.asarray(self.matrices, dtype=np.float64)
        if t.ndim != 1 or m.shape != (t.shape[0], 4, 4):
            msg = (
                f"trajectory: {t.shape[0] if t.ndim == 1 else t.shape} times but matrices {m.shape}"
            )
            raise ValueError(msg)
        if t.size > 1 and np.any(np.diff(t) <= 0):
            raise ValueError("trajectory: times must be strictly increasing")
        object.__setattr__(self, "t", t)
        object.__setattr__(self, "matrices", m)

    @classmethod
    def from_xyz_quat(cls, t: NDArray[np.int64], xyz: F64, quat_xyzw: F64) -> Trajectory:
        """Build from positions (n, 3) and unit quaternions (n, 4) as x, y, z, w."""
        m = np.tile(np.eye(4), (len(t), 1, 1))
        m[:, :3, :3] = Rotation.from_quat(quat_xyzw).as_matrix()
        m[:, :3, 3] = xyz
        return cls(np.asarray(t, dtype=np.int64), m)

    def __len__(self) -> int:
        return int(self.t.shape[0])

    @property
    def xyz(self) -> F64:
        """Positions (n, 3)."""
        return self.matrices[:, :3, 3]

    @property
    def quat_xyzw(self) -> F64:
        """Unit quaternions (n, 4) as x, y, z, w."""
        return np.asarray(
            Rotation.from_matrix(self.matrices[:, :3, :3]).as_quat(), dtype=np.float64
        )

    @property
    def span_ns(self) -> tuple[int, int]:
        """First and last time (ns)."""
        return int(self.t[0]), int(self.t[-1])

    def at(self, t_ns: NDArray[np.int64] | int) -> F64:
        """Interpolated poses (m, 4, 4) at ``t_ns``, clamped to the trajectory's span."""
        query = np.atleast_1d(np.asarray(t_ns, dtype=np.int64))
        if len(self) == 1:
            return np.repeat(self.matrices, query.size, axis=0)
        q = np.clip(query, self.t[0], self.t[-1])
        base = self.t[0]
        times = (self.t - base).astype(np.float64)
        qf = (q - base).astype(np.float64)
        out = np.tile(np.eye(4), (q.size, 1, 1))
        out[:, :3, :3] = Slerp(times, Rotation.from_matrix(self.matrices[:, :3, :3]))(
            qf
        ).as_matrix()
        for axis in range(3):
            out[:, axis, 3] = np.interp(qf, times, self.matrices[:, axis, 3])
        return out

    def transformed(self, left: F64) -> Trajectory:
        """``left @ pose`` for every pose (e.g. an alignment onto another frame)."""
        return Trajectory(self.t, np.einsum("ij,njk->nik", left, self.matrices))

    def between(self, start_ns: int, end_ns: int) -> Trajectory:
        """The samples with ``start_ns <= t <= end_ns``."""
        keep = (self.t >= start_ns) & (self.t <= end_ns)
        return Trajectory(self.t[keep], self.matrices[keep])

    # -- files -----------------------------------------------------------------------------

    def write_tum(self, path: str | os.PathLike[str]) -> Path:
        """TUM format: ``timestamp tx ty tz qx qy qz qw`` per line (seconds with 9 decimals)."""
        path = Path(path)
        q = self.quat_xyzw
        lines = ["# timestamp tx ty tz qx qy qz qw  (map frame, base_link; TUM)"]
        for i in range(len(self)):
            x, y, z = self.matrices[i, :3, 3]
            lines.append(
                f"{_stamp(int(self.t[i]))} {x:.6f} {y:.6f} {z:.6f} "
                f"{q[i, 0]:.9f} {q[i, 1]:.9f} {q[i, 2]:.9f} {q[i, 3]:.9f}"
            )
        path.write_text("\n".join(lines) + "\n", encoding="ascii")
        return path

    def write_kitti(self, path: str | os.PathLike[str]) -> Path:
        """KITTI odometry format: the first three rows of each pose, 12 numbers per line
        (times go to ``<path>.times.txt`` in seconds, as KITTI's ``times.txt``)."""
        path = Path(path)
        rows = self.matrices[:, :3, :].reshape(len(self), 12)
        np.savetxt(path, rows, fmt="%.9e")
        times = (self.t - self.t[0]).astype(np.float64) / _NS if len(self) else np.zeros(0)
        np.savetxt(path.with_name(path.name + ".times.txt"), times, fmt="%.9f")
        return path

    @classmethod
    def read_tum(cls, path: str | os.PathLike[str]) -> Trajectory:
        """Read a TUM file (``#`` comment lines are skipped)."""
        path = Path(path)
        t: list[int] = []
        rows: list[list[float]] = []
        with path.open(encoding="ascii") as f:
            for lineno, line in enumerate(f, 1):
                if line.startswith("#") or not line.strip():
                    continue
                parts = line.split()
                if len(parts) != 8:
                    msg = f"{path}:{lineno}: expected 8 fields (TUM), got {len(parts)}"
                    raise MapFormatError(msg)
                try:
                    t.append(_parse_stamp(parts[0]))
                    rows.append([float(v) for v in parts[1:]])
                except ValueError as exc:
                    raise MapFormatError(f"{path}:{lineno}: {exc}") from None
        arr = np.asarray(rows, dtype=np.float64).reshape(-1, 7)
        return cls.from_xyz_quat(np.asarray(t, dtype=np.int64), arr[:, :3], arr[:, 3:])


def rigid_alignment(source: F64, target: F64, *, yaw_only: bool = False) -> F64:
    """The rigid transform (4x4) minimising ``sum |T @ source_i - target_i|^2`` (Umeyama,
    without scale). ``source`` and ``target`` are matched (n, 3) point sets, n >= 3.

    ``yaw_only`` restricts the rotation to one about the vertical axis (4 degrees of
    freedom): with gravity and GPS the map's roll and pitch are observed, and a drive
    along a nearly straight line leaves the full fit free to roll the map about that line.
    """
    src = np.asarray(source, dtype=np.float64)
    dst = np.asarray(target, dtype=np.float64)
    if yaw_only:
        mu_s, mu_d = src.mean(axis=0), dst.mean(axis=0)
        a, b = src[:, :2] - mu_s[:2], dst[:, :2] - mu_d[:2]
        yaw = np.arctan2(np.sum(a[:, 0] * b[:, 1] - a[:, 1] * b[:, 0]), np.sum(a * b))
        out = np.eye(4)
        out[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
        out[:3, 3] = mu_d - out[:3, :3] @ mu_s
        return out
    mu_s, mu_d = src.mean(axis=0), dst.mean(axis=0)
    cov = (dst - mu_d).T @ (src - mu_s) / len(src)
    u, _, vt = np.linalg.svd(cov)
    d = np.eye(3)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        d[2, 2] = -1
    rot = u @ d @ vt
    out = np.eye(4)
    out[:3, :3] = rot
    out[:3, 3] = mu_d - rot @ mu_s
    return out


@dataclass(frozen=True)
class AteResult:
    """Absolute trajectory error: RMSE, mean and max (m) over ``count`` matched poses after
    ``alignment`` (4x4, applied to the estimate) -- identity when ``aligned`` is False."""

    rmse: float
    mean: float
    max: float
    count: int
    alignment: F64
    aligned: bool
    errors: F64

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "rmse_m": self.rmse,
            "mean_m": self.mean,
            "max_m": self.max,
            "count": self.count,
            "aligned": self.aligned,
        }


def absolute_trajectory_error(
    estimate: Trajectory, reference: Trajectory, *, align: bool = True, yaw_only: bool = False
) -> AteResult:
    """ATE of ``estimate`` against ``reference``, at the estimate's times inside the
    reference's span (the reference is interpolated). ``align`` first fits the rigid
    transform that best maps the estimate onto the reference (the map frame's gauge: a GPS
    bias common to the whole drive is not observable); ``yaw_only`` fits yaw and translation
    only (see :func:`rigid_alignment`)."""
    lo, hi = reference.span_ns
    keep = (estimate.t >= lo) & (estimate.t <= hi)
    if keep.sum() < 3:
        raise ValueError("ATE: fewer than 3 estimated poses overlap the reference in time")
    est = estimate.xyz[keep]
    ref = reference.at(estimate.t[keep])[:, :3, 3]
    alignment = rigid_alignment(est, ref, yaw_only=yaw_only) if align else np.eye(4)
    moved = est @ alignment[:3, :3].T + alignment[:3, 3]
    err = np.linalg.norm(moved - ref, axis=1)
    return AteResult(
        rmse=float(np.sqrt(np.mean(err**2))),
        mean=float(err.mean()),
        max=float(err.max()),
        count=int(err.size),
        alignment=alignment,
        aligned=align,
        errors=err,
    )
