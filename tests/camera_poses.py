"""Hold the synthetic camera at a chosen pose (for tests of what it sees)."""

from __future__ import annotations

from typing import Any

import numpy as np


class FixedPose:
    """A stand-in trajectory for :meth:`adcloud.synth.camera.CameraModel.render`: the
    camera's optical frame stays at ``pose`` (4x4 ``map <- optical``) whatever the time."""

    def __init__(self, pose: np.ndarray) -> None:
        self.pose = (pose[None, :3, 3], pose[None, :3, :3])

    def mount_pose(self, *_: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.pose


def looking_at(eye: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The ``map <- camera optical`` pose at ``eye`` with z towards ``target``, y down."""
    z = (target - eye) / np.linalg.norm(target - eye)
    x = np.cross(z, [0.0, 0.0, 1.0])
    x /= np.linalg.norm(x)
    pose = np.eye(4)
    pose[:3, :3] = np.column_stack([x, np.cross(z, x), z])
    pose[:3, 3] = eye
    return pose
