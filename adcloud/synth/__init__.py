"""Synthetic drives with ground truth: ROS bags of a car driving a procedural world.

``generate_drive(DriveConfig(seconds=60, seed=7), "drive.bag")`` writes a ROS 1 bag
(or a ROS 2 sqlite3 / MCAP bag) with LiDAR, IMU, wheel odometry, GPS, camera and TF,
and ``drive.bag.truth/`` with the true poses, the true map (lanes, signs, a 5 cm
elevation/reflectance raster) and the sensors' true errors.  The same config and seed
give the same bytes.

- :mod:`~adcloud.synth.world` -- the world as arrays of primitives (:func:`build_world`);
- :mod:`~adcloud.synth.raycast` -- vectorized ray casting (the NumPy reference);
- :mod:`~adcloud.synth.trajectory` -- the route and the driver's dynamics;
- :mod:`~adcloud.synth.lidar`, ``imu``, ``odometry``, ``gnss``, ``camera`` -- sensors;
- :mod:`~adcloud.synth.truth` -- the truth directory (``docs/synth-truth-format.md``);
- :mod:`~adcloud.synth.command` -- ``adcloud synth``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud._lazy import lazy_exports

if TYPE_CHECKING:
    from adcloud.synth.config import DriveConfig
    from adcloud.synth.drive import DriveResult, generate_drive
    from adcloud.synth.errors import SynthError
    from adcloud.synth.labels import Label
    from adcloud.synth.truth import Raster, read_map, read_poses, read_raster, truth_dir_for
    from adcloud.synth.world import World, build_world

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "config": ("DriveConfig",),
        "drive": ("DriveResult", "generate_drive"),
        "errors": ("SynthError",),
        "labels": ("Label",),
        "truth": ("Raster", "read_map", "read_poses", "read_raster", "truth_dir_for"),
        "world": ("World", "build_world"),
    },
)

__all__ = [
    "DriveConfig",
    "DriveResult",
    "Label",
    "Raster",
    "SynthError",
    "World",
    "build_world",
    "generate_drive",
    "read_map",
    "read_poses",
    "read_raster",
    "truth_dir_for",
]
