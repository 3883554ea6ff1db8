"""Trajectory interpolation, TUM/KITTI files and the ATE metric."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from adcloud.hdmap.errors import MapFormatError
from adcloud.hdmap.trajectory import Trajectory, absolute_trajectory_error, rigid_alignment

_NS = 1_000_000_000


def _circle(n: int = 200, radius: float = 20.0) -> Trajectory:
    t = np.arange(n, dtype=np.int64) * (_NS // 10) + 1_700_000_000 * _NS
    yaw = np.linspace(0, 2 * np.pi, n, endpoint=False)
    xyz = np.stack([radius * np.cos(yaw), radius * np.sin(yaw), 0.1 * np.sin(3 * yaw)], axis=1)
    quat = Rotation.from_euler("z", (yaw + np.pi / 2)[:, None]).as_quat()
    return Trajectory.from_xyz_quat(t, xyz, quat)


def test_interpolation_is_exact_at_samples_and_midway_between() -> None:
    traj = _circle()
    np.testing.assert_allclose(traj.at(traj.t), traj.matrices, atol=1e-9)
    mid = (traj.t[10] + traj.t[11]) // 2
    pose = traj.at(mid)[0]
    np.testing.assert_allclose(pose[:3, 3], (traj.xyz[10] + traj.xyz[11]) / 2, atol=1e-9)
    yaw = Rotation.from_matrix(pose[:3, :3]).as_euler("zyx")[0]
    want = Rotation.from_matrix(traj.matrices[10, :3, :3]).as_euler("zyx")[0] + np.pi / 200
    assert yaw == pytest.approx(want, abs=1e-9)
    # outside the span: clamped to the ends
    np.testing.assert_allclose(traj.at(traj.t[0] - _NS)[0], traj.matrices[0], atol=1e-12)


def test_tum_round_trip_and_kitti(tmp_path: Path) -> None:
    traj = _circle()
    back = Trajectory.read_tum(traj.write_tum(tmp_path / "t.tum"))
    np.testing.assert_array_equal(back.t, traj.t)
    np.testing.assert_allclose(back.matrices, traj.matrices, atol=1e-6)
    kitti = np.loadtxt(traj.write_kitti(tmp_path / "t.txt"))
    assert kitti.shape == (len(traj), 12)
    np.testing.assert_allclose(kitti[5].reshape(3, 4), traj.matrices[5, :3], atol=1e-8)


def test_bad_tum_line_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.tum"
    path.write_text("# header\n1.0 1 2 3 0 0 0 1\n2.0 1 2 3\n")
    with pytest.raises(MapFormatError, match=r"bad.tum:3: expected 8 fields"):
        Trajectory.read_tum(path)


def test_rigid_alignment_recovers_a_transform() -> None:
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(50, 3)) * 10
    truth = np.eye(4)
    truth[:3, :3] = Rotation.from_euler("xyz", [0.1, -0.2, 0.7]).as_matrix()
    truth[:3, 3] = [3.0, -1.0, 0.5]
    moved = pts @ truth[:3, :3].T + truth[:3, 3]
    np.testing.assert_allclose(rigid_alignment(pts, moved), truth, atol=1e-9)


def test_ate_ignores_a_constant_offset_only_when_aligning() -> None:
    ref = _circle()
    shifted = ref.transformed(
        np.array([[1, 0, 0, 0.5], [0, 1, 0, -0.3], [0, 0, 1, 0.7], [0, 0, 0, 1.0]])
    )
    assert absolute_trajectory_error(shifted, ref).rmse < 1e-9
    raw = absolute_trajectory_error(shifted, ref, align=False)
    assert raw.rmse == pytest.approx(np.sqrt(0.5**2 + 0.3**2 + 0.7**2), rel=1e-9)
    # noise survives alignment
    rng = np.random.default_rng(1)
    noisy = Trajectory(ref.t, ref.matrices.copy())
    noisy.matrices[:, :3, 3] += rng.normal(scale=0.05, size=(len(ref), 3))
    assert absolute_trajectory_error(noisy, ref).rmse == pytest.approx(0.05 * np.sqrt(3), rel=0.15)


def test_yaw_only_alignment_keeps_roll_and_pitch() -> None:
    ref = _circle()
    truth = np.eye(4)
    truth[:3, :3] = Rotation.from_euler("z", 0.3).as_matrix()
    truth[:3, 3] = [2.0, -1.0, 0.4]
    moved = ref.transformed(truth)
    fit = rigid_alignment(ref.xyz, moved.xyz, yaw_only=True)
    np.testing.assert_allclose(fit, truth, atol=1e-9)
    # points on a straight line: the yaw-only fit cannot roll about the line
    line = np.stack([np.linspace(0, 50, 20), np.zeros(20), np.zeros(20)], axis=1)
    noisy = line + np.random.default_rng(2).normal(scale=0.01, size=line.shape)
    fit = rigid_alignment(line, noisy, yaw_only=True)
    assert np.allclose(fit[2, :3], [0, 0, 1])
