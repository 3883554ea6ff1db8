"""Rotation helpers: quaternions of rotation matrices."""

from __future__ import annotations

import numpy as np

from adcloud.synth.frames import MOUNTS, euler_matrix, matrix_quaternion, quaternion_matrix


def test_half_turns_about_tilted_axes_give_their_quaternion() -> None:
    """A half turn (``w = 0``) about an axis off the coordinate axes took the signs of ``x, y,
    z`` from rounding noise in the matrix: a quarter of them came back as another rotation
    (errors up to 1.5 in the matrix), e.g. a rear camera pitched up instead of down."""
    rng = np.random.default_rng(0)
    axes = rng.normal(size=(2000, 3))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    angles = np.where(np.arange(2000) % 2 == 0, np.pi, rng.uniform(-np.pi, np.pi, 2000))
    q = np.concatenate([axes * np.sin(angles / 2)[:, None], np.cos(angles / 2)[:, None]], 1)
    rot = quaternion_matrix(q)
    back = matrix_quaternion(rot)
    assert np.abs(quaternion_matrix(back) - rot).max() < 1e-12
    assert (back[:, 3] >= 0).all()
    assert np.allclose(np.abs(np.einsum("ij,ij->i", back, q)), 1.0)  # q or -q


def test_turns_about_one_axis_have_no_other_components() -> None:
    """The camera mount's pure 0.08 rad pitch had ``x = 5e-9`` on /tf_static."""
    q = matrix_quaternion(euler_matrix(np.zeros(3), [0.08, 0.0, 0.0], [0.0, 0.3, np.pi]))
    assert q[0, 0] == q[0, 2] == 0.0
    assert q[1, 0] == q[1, 1] == 0.0
    assert abs(q[2, 0]) < 1e-15 and abs(q[2, 1]) < 1e-15
    assert MOUNTS["camera"].quaternion[0] == 0.0
    assert MOUNTS["camera_optical"].quaternion == (-0.5, 0.5, -0.5, 0.5)
