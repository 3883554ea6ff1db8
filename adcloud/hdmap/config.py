"""Settings of a map build (section ``hdmap``; ``ADCLOUD_HDMAP_<FIELD>`` overrides).

One flat, frozen object a user sets from YAML, the environment or the CLI; the stages'
own settings objects are derived from it by :meth:`HdmapSettings.topics_` and the job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adcloud.errors import ConfigError
from adcloud.hdmap.drive import DriveTopics

__all__ = ["MODES", "HdmapSettings"]

#: How the stages hand data to each other: cached in executor memory, or through files.
MODES = ("memory", "files")


@dataclass(frozen=True)
class HdmapSettings:
    """What a build reads and how it runs.

    - ``*_topic``: where each stream is in the bags (defaults: the synthetic drives' names,
      which are also the usual ROS ones).
    - ``origin_lat/lon/alt``: the map frame's WGS84 origin (ENU tangent plane). Unset (NaN):
      the first build takes its first drive's first GPS fix and every later build of the
      same map keeps it.
    - ``resolution``: grid cell size (m); ``tile_m``: grid tile size (m; 20 m, as Autoware's
      point-cloud tiles), and the point-cloud tiles' unless ``hdmap_cloud.tile_size`` is set.
    - ``segment_s``: drive segments solved in parallel by the pose stage (s).
    - ``device``: ICP/raster device address (empty: adcloud.hetero's policy).
    - ``mode``: ``memory`` (one Spark job, intermediates cached) or ``files`` (stages as
      separate jobs exchanging files under ``exchange_dir``, fsync'ed: the comparison mode;
      the stage folders made there are deleted when the build ends).
    - ``keep_versions``: map versions kept by the nightly build's garbage collection.
    """

    lidar_topic: str = "/lidar/points"
    imu_topic: str = "/imu/data"
    odom_topic: str = "/odom"
    gps_topic: str = "/gps/fix"
    tf_static_topic: str = "/tf_static"
    origin_lat: float = float("nan")
    origin_lon: float = float("nan")
    origin_alt: float = float("nan")
    resolution: float = 0.05
    tile_m: float = 20.0
    segment_s: float = 20.0
    device: str = ""
    mode: str = "memory"
    exchange_dir: str = ""
    keep_versions: int = 5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"hdmap.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if not 0.005 <= self.resolution <= 5:
            raise ConfigError(f"hdmap.resolution: {self.resolution} m is outside 0.005..5 m")
        if self.tile_m < 10 * self.resolution:
            raise ConfigError(f"hdmap.tile_m: {self.tile_m} m must be >= 10 cells")
        if self.segment_s <= 1:
            raise ConfigError(f"hdmap.segment_s: {self.segment_s} s must be > 1 s")
        if self.keep_versions < 1:
            raise ConfigError("hdmap.keep_versions: keep at least 1 version")

    @property
    def topics(self) -> DriveTopics:
        """The bag topics as :class:`~adcloud.hdmap.drive.DriveTopics`."""
        return DriveTopics(
            lidar=self.lidar_topic,
            imu=self.imu_topic,
            odom=self.odom_topic,
            gps=self.gps_topic,
            tf_static=self.tf_static_topic,
        )

    @property
    def origin(self) -> tuple[float, float, float] | None:
        """The configured origin, or None when it is to be taken from the data."""
        values = (self.origin_lat, self.origin_lon, self.origin_alt)
        if any(math.isnan(v) for v in values):  # unset
            return None
        return values
