"""Settings of a map build (section ``hdmap``; ``ADCLOUD_HDMAP_<FIELD>`` overrides).

One flat, frozen object a user sets from YAML, the environment or the CLI; the stages'
own settings objects are derived from it by :meth:`HdmapSettings.topics_` and the job.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy.spatial.transform import Rotation

from adcloud.errors import ConfigError
from adcloud.hdmap.drive import DriveTopics

__all__ = ["MODES", "HdmapSettings", "parse_mounts"]

#: How the stages hand data to each other: cached in executor memory, or through files.
MODES = ("memory", "files")


@dataclass(frozen=True)
class HdmapSettings:
    """What a build reads and how it runs.

    - ``*_topic``: where each stream is in the bags (defaults: the synthetic drives' names,
      which are also the usual ROS ones).
    - ``origin_lat/lon/alt``: the map frame's WGS84 origin (ENU tangent plane; degrees,
      degrees, ellipsoidal metres), all three or none. Unset (NaN): the first build takes
      its first drive's first GPS fix and every later build of the same map keeps it.
    - ``resolution``: grid cell size (m); ``tile_m``: grid tile size (m; 20 m, as Autoware's
      point-cloud tiles), and the point-cloud tiles' unless ``hdmap_cloud.tile_size`` is set.
    - ``segment_s``: drive segments solved in parallel by the pose stage (s).
    - ``device``: ICP/raster device address (empty: adcloud.hetero's policy).
    - ``mode``: ``memory`` (one Spark job, intermediates cached) or ``files`` (stages as
      separate jobs exchanging files under ``exchange_dir``, fsync'ed: the comparison mode;
      the stage folders made there are deleted when the build ends; on a multi-host cluster
      ``exchange_dir`` must be a directory every host mounts).
    - ``keep_versions``: map versions kept by the nightly build's garbage collection (0:
      every version is kept).
    - ``hash_threads``: how many new bags a build's plan hashes at a time on the driver
      (bags on a local disk hash on that many cores, bags in object storage over that many
      streams).
    - ``carry_tiles``: an incremental build copies the tiles out of the new drives' reach
      as they are (:mod:`adcloud.hdmap.kept`); False merges and writes every tile again
      (as a build does by itself when the grid or point-cloud settings changed). The tile
      layout -- ``resolution``, ``tile_m``, the grid's patch and the point-cloud map's
      voxel size -- is the map's own from its first build: a version keeps only sums over
      its cells, so a build with another layout is refused (build a new map for one).
    - ``mounts``: sensor mounts ``"FRAME=x,y,z,roll,pitch,yaw"`` (m, degrees; the
      ``base_link <- FRAME`` transform, rotation as extrinsic xyz Euler angles). They fill
      in for ``/tf_static`` and override its chains of the same frames (see
      :func:`parse_mounts`); in the environment, entries joined by commas.
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
    hash_threads: int = 4
    mounts: tuple[str, ...] = ()
    carry_tiles: bool = True

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            object.__setattr__(
                self, spec.name, _typed(spec.name, getattr(self, spec.name), str(spec.type))
            )
        # The settings loader splits a string on commas, which also separate the values
        # of one entry: glue the pieces back (and keep the canonical entries).
        object.__setattr__(self, "mounts", _mount_entries(self.mounts))
        parse_mounts(self.mounts)
        if self.mode not in MODES:
            raise ConfigError(f"hdmap.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        # Written so that NaN fails each test too (every comparison with NaN is False).
        if not 0.005 <= self.resolution <= 5:
            raise ConfigError(f"hdmap.resolution: {self.resolution} m is outside 0.005..5 m")
        if not (math.isfinite(self.tile_m) and self.tile_m >= 10 * self.resolution):
            raise ConfigError(
                f"hdmap.tile_m: {self.tile_m} m must be a finite size of >= 10 cells "
                f"({10 * self.resolution:g} m)"
            )
        if not (math.isfinite(self.segment_s) and self.segment_s > 1):
            raise ConfigError(f"hdmap.segment_s: {self.segment_s} s must be finite and > 1 s")
        _check_origin(self.origin_lat, self.origin_lon, self.origin_alt)
        if self.keep_versions < 0:  # 0 keeps every version, as the map directory's own
            raise ConfigError(
                f"hdmap.keep_versions: give 1 or more versions to keep, or 0 to keep every "
                f"version, not {self.keep_versions}"
            )
        if self.hash_threads < 1:
            raise ConfigError(f"hdmap.hash_threads: {self.hash_threads} must be >= 1")

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
    def extrinsics(self) -> dict[str, NDArray[np.float64]]:
        """The configured mounts as ``frame: 4x4 base_link <- frame`` (plain, picklable)."""
        return parse_mounts(self.mounts)

    @property
    def origin(self) -> tuple[float, float, float] | None:
        """The configured origin, or None when it is to be taken from the data."""
        values = (self.origin_lat, self.origin_lon, self.origin_alt)
        if all(math.isnan(v) for v in values):  # unset (__post_init__ refuses a partial one)
            return None
        return values


def _typed(name: str, value: Any, kind: str) -> Any:
    """``value`` of field ``name`` as its annotation ``kind`` says (an int as a float; a
    list of mounts as a tuple), or :class:`ConfigError` naming the field. The file and
    environment loader converts text already; this catches the Python API's mistakes
    (``resolution="0.05"``, ``keep_versions=2.5``), which would fail later -- or after
    a build committed its version. A bool is no number here: ``True`` is not 1 version."""

    def wrong(what: str) -> ConfigError:
        return ConfigError(f"hdmap.{name} must be {what}, got {value!r} ({type(value).__name__})")

    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong("a number")
        return float(value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise wrong("a whole number (an int)")
        return int(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise wrong("True or False")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    if kind == "tuple[str, ...]":
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise wrong("a list of strings")
        return tuple(items)
    raise ConfigError(f"internal: hdmap.{name} has a type ({kind}) the settings do not check")


def _check_origin(lat: float, lon: float, alt: float) -> None:
    """Raise :class:`ConfigError` unless the origin is unset (all NaN) or a WGS84 latitude,
    longitude and height: a partial origin names what is missing, and an impossible one is
    refused here rather than inside the build's Spark tasks (same wording as theirs)."""
    values = {"origin_lat": lat, "origin_lon": lon, "origin_alt": alt}
    unset = [name for name, value in values.items() if math.isnan(value)]
    if len(unset) == len(values):
        return
    if unset:
        given = ", ".join(f"{n}={v}" for n, v in values.items() if n not in unset)
        raise ConfigError(
            f"hdmap.origin: {', '.join(unset)} missing ({given} given); set all of "
            "origin_lat, origin_lon and origin_alt, or none to take the first GPS fix"
        )
    if not (-90 <= lat <= 90 and -180 <= lon <= 180 and math.isfinite(alt)):
        raise ConfigError(
            f"hdmap.origin: origin {(lat, lon, alt)!r} is not a WGS84 latitude, longitude and "
            "height (origin_lat in -90..90 degrees, origin_lon in -180..180 degrees, "
            "origin_alt finite metres)"
        )


def _mount_entries(values: Sequence[str] | str) -> tuple[str, ...]:
    """``values`` as whole ``FRAME=...`` entries: a piece without ``=`` continues an entry
    before it that has fewer than 6 values (what splitting ``"lidar=1,0,2,0,0,0"`` on
    commas leaves)."""
    pieces = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for piece in (str(p).strip() for p in pieces):
        if out and "=" not in piece and "=" in out[-1] and out[-1].count(",") < 5:
            out[-1] = f"{out[-1]},{piece}"
        elif piece:
            out.append(piece)
    return tuple(out)


def parse_mounts(entries: Sequence[str]) -> dict[str, NDArray[np.float64]]:
    """Sensor mounts from ``hdmap.mounts`` entries ``"FRAME=x,y,z,roll,pitch,yaw"``.

    ``x y z`` in metres and ``roll pitch yaw`` in degrees, extrinsic xyz (as
    ``Rotation.from_euler("xyz", ..., degrees=True)``); the result maps each frame (leading
    ``/`` dropped) to its 4x4 float64 ``base_link <- FRAME`` transform. Raises
    :class:`~adcloud.errors.ConfigError` naming the entry and what is wrong with it.
    """
    out: dict[str, NDArray[np.float64]] = {}
    for entry in _mount_entries(entries):
        where = f"hdmap.mounts: entry {entry!r}"
        name, sep, rest = entry.partition("=")
        frame = name.strip().lstrip("/")
        if not sep:
            raise ConfigError(f"{where} has no '='; write FRAME=x,y,z,roll,pitch,yaw")
        if not frame:
            raise ConfigError(f"{where} names no frame before '='")
        if frame == "base_link":
            raise ConfigError(f"{where}: base_link is the reference frame and has no mount")
        if frame in out:
            raise ConfigError(f"{where}: frame {frame!r} is mounted twice")
        texts = [t.strip() for t in rest.split(",")]
        if len(texts) != 6:
            raise ConfigError(
                f"{where} has {len(texts)} values; give 6: x,y,z (m),roll,pitch,yaw (degrees)"
            )
        values = []
        for text in texts:
            try:
                values.append(float(text))
            except ValueError:
                raise ConfigError(f"{where}: {text!r} is not a number") from None
        if not all(math.isfinite(v) for v in values):
            raise ConfigError(f"{where}: the values must be finite")
        mat = np.eye(4)
        mat[:3, :3] = Rotation.from_euler("xyz", values[3:], degrees=True).as_matrix()
        mat[:3, 3] = values[:3]
        out[frame] = mat
    return out
