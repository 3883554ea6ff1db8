"""A small forward camera rendered by ray casting the same world as the LiDAR.

A global-shutter pinhole camera (no distortion) in the ``camera_optical`` frame, one ray
through each pixel centre.  Pixel centres are at whole pixel coordinates, as in ROS's
``CameraInfo`` and OpenCV: ``K`` projects a point seen in pixel ``(u, v)`` to ``(u, v)``,
so the principal point of the centred camera is ``((W - 1) / 2, (H - 1) / 2)``.  Colour is
the label's albedo (ground brightened by its reflectance, so paint is white and asphalt
dark; a sign plate's face in its type's :data:`~adcloud.synth.world.SIGN_FACE_COLORS`, its
back grey) shaded by a fixed sun, with distance haze, a sky gradient where nothing is hit
and Gaussian pixel noise (2 DN).  The label image holds the
:class:`~adcloud.synth.labels.Label` id of every pixel (0 = sky).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.config import DriveConfig
from adcloud.synth.frames import MOUNTS, SensorMount
from adcloud.synth.labels import LABEL_COLORS, Label
from adcloud.synth.raycast import cast_rays
from adcloud.synth.trajectory import Trajectory
from adcloud.synth.world import (
    SIGN_BACK_COLOR,
    SIGN_FACE_COLORS,
    SIGN_TYPE,
    SIGN_X,
    SIGN_YAW,
    SIGN_Z,
    World,
)

__all__ = ["CameraModel"]

_SUN = np.array([0.35, 0.45, 0.82]) / np.linalg.norm([0.35, 0.45, 0.82])
_TILE = 8
_MAX_RANGE = 150.0
_GROUND = (Label.ROAD, Label.LANE_MARKING, Label.CURB, Label.SIDEWALK, Label.TERRAIN)


@dataclass(frozen=True)
class CameraModel:
    """Intrinsics: image size (pixels), focal lengths and principal point (pixels; pixel
    centres at whole coordinates)."""

    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float
    #: Where the camera sits on the car and its optical frame (the forward camera by default).
    link: SensorMount = MOUNTS["camera"]
    optical: SensorMount = MOUNTS["camera_optical"]

    @classmethod
    def from_config(
        cls, config: DriveConfig, mounts: tuple[SensorMount, SensorMount] | None = None
    ) -> CameraModel:
        """A camera of the drive (square pixels, centred principal point) on ``mounts``
        (``(link, optical)``; default the forward camera)."""
        w, h = config.camera_width, config.camera_height
        f = (w / 2) / np.tan(np.radians(config.camera_hfov_deg) / 2)
        link, optical = mounts or (MOUNTS["camera"], MOUNTS["camera_optical"])
        # the image centre in whole-pixel-centre coordinates (ROS, OpenCV): w / 2 put K half
        # a pixel right of and below the rays the image was rendered with
        return cls(w, h, float(f), float(f), (w - 1) / 2, (h - 1) / 2, link, optical)

    @property
    def k(self) -> tuple[float, ...]:
        """The 3x3 camera matrix, row-major."""
        return (self.fx, 0.0, self.cx, 0.0, self.fy, self.cy, 0.0, 0.0, 1.0)

    def optical_pose(
        self, trajectory: Trajectory, t: float
    ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Position and rotation (camera_optical to map) at time ``t`` (s)."""
        rot = self.link.rotation @ self.optical.rotation
        p, r = trajectory.mount_pose(np.array([t]), np.asarray(self.link.translation), rot)
        return p[0], r[0]

    def render(
        self, world: World, trajectory: Trajectory, t: float, rng: np.random.Generator
    ) -> tuple[NDArray[np.uint8], NDArray[np.uint8]]:
        """``(rgb (H, W, 3), labels (H, W))`` of the frame exposed at ``t`` (s)."""
        origin, rot = self.optical_pose(trajectory, t)
        v, u = np.mgrid[0 : self.height, 0 : self.width]
        local = np.stack(
            [(u - self.cx) / self.fx, (v - self.cy) / self.fy, np.ones(u.shape)],
            axis=-1,
        ).reshape(-1, 3)
        local /= np.linalg.norm(local, axis=1, keepdims=True)
        dirs = local @ rot.T
        n = len(dirs)
        bins = ((v // _TILE) * ((self.width + _TILE - 1) // _TILE) + u // _TILE).ravel()
        hits = cast_rays(
            world,
            np.broadcast_to(origin, (n, 3)),
            dirs,
            np.full(n, t),
            max_range=_MAX_RANGE,
            bins=bins,
        )
        base = LABEL_COLORS[hits.label].astype(np.float64)
        _paint_sign_faces(base, world, origin, dirs, hits.range, hits.normal, hits.label)
        ground = np.isin(hits.label, np.array(_GROUND, dtype=np.uint8)) & (
            hits.label != Label.LANE_MARKING
        )
        base[ground] *= (0.55 + 1.5 * hits.reflectance[ground])[:, None]
        shade = 0.45 + 0.55 * np.clip(hits.normal.astype(np.float64) @ _SUN, 0, 1)
        colour = base * shade[:, None]
        hit = np.isfinite(hits.range)
        sky = np.array([0.55, 0.70, 0.90]) * (0.85 + 0.15 * np.clip(dirs[:, 2:3], 0, 1) * 4)
        haze = np.where(hit, 1 - np.exp(-np.where(hit, hits.range, 0) / 250.0), 1.0)[:, None]
        colour = colour * (1 - haze) + sky * haze
        img = np.clip(colour * 255 + rng.standard_normal(colour.shape) * 2.0, 0, 255)
        rgb = img.reshape(self.height, self.width, 3).round().astype(np.uint8)
        return rgb, hits.label.reshape(self.height, self.width)


def _paint_sign_faces(
    base: NDArray[np.float64],
    world: World,
    origin: NDArray[np.float64],
    dirs: NDArray[np.float64],
    ranges: NDArray[np.floating],
    normals: NDArray[np.floating],
    labels: NDArray[np.uint8],
) -> None:
    """Give the sign pixels of ``base`` (in place) their plate's face or back colour: the
    plate is the sign nearest the hit point, its face the side its yaw points to."""
    hit = np.flatnonzero((labels == Label.SIGN) & np.isfinite(ranges))
    if hit.size == 0 or len(world.signs) == 0:
        return
    points = origin + dirs[hit] * ranges[hit, None].astype(np.float64)
    centres = world.signs[:, SIGN_X : SIGN_Z + 1]
    nearest = np.argmin(((points[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2), axis=1)
    sign = world.signs[nearest]
    facing = np.column_stack([np.cos(sign[:, SIGN_YAW]), np.sin(sign[:, SIGN_YAW])])
    front = (normals[hit, :2].astype(np.float64) * facing).sum(axis=1) > 0
    faces = np.asarray(SIGN_FACE_COLORS, dtype=np.float64)
    base[hit] = np.where(
        front[:, None], faces[sign[:, SIGN_TYPE].astype(np.int64)], np.asarray(SIGN_BACK_COLOR)
    )
