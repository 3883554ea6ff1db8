"""The ground-truth directory written next to every synthetic drive (format version 1).

``<bag>.truth/`` holds (all in the map frame: ENU metres at ``world.json``'s origin):

- ``poses.txt`` -- TUM trajectory of base_link, ``t tx ty tz qx qy qz qw`` (t in s since
  the Unix epoch, 9 decimals), at ``truth_hz``;
- ``map.geojson`` -- lane markings (solid/dashed), lane centre lines, road reference
  lines, curbs, traffic signs and poles, with local map-frame coordinates;
- ``raster.npz`` -- elevation (float32, m), reflectance (uint8, reflectance x 255) and
  label (uint8) at ``truth_raster_res_m`` (5 cm) over the route's surroundings; plain
  arrays, load with ``allow_pickle=False``;
- ``imu_bias.csv``, ``odom_scale.csv``, ``gps.csv`` -- the sensors' true error states;
- ``world.json`` -- seed, origin, frames, sensor mounts, label ids, sign types;
- ``config.json`` -- the effective :class:`~adcloud.synth.config.DriveConfig`.

``docs/synth-truth-format.md`` is the specification; :func:`read_poses`,
:func:`read_raster` and :func:`read_map` read it back.

History: version 1 (first version).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from adcloud.config import write_settings
from adcloud.synth.config import DriveConfig
from adcloud.synth.errors import SynthError
from adcloud.synth.frames import MOUNTS, camera_mounts
from adcloud.synth.labels import Label
from adcloud.synth.roads import (
    CURB_HEIGHT_M,
    DASH_GAP_M,
    DASH_PAINT_M,
    INTERSECTION_CLEAR_M,
    LANE_WIDTH_M,
    MARK_DASHED,
    MARK_OFFSET,
    MARK_REFLECTANCE,
    MARK_ROAD,
    MARK_WIDTH,
    PAVED_HALF_WIDTH_M,
    SIDEWALK_WIDTH_M,
)
from adcloud.synth.world import (
    CYL_LABEL,
    CYL_R,
    CYL_X,
    CYL_Y,
    CYL_Z0,
    CYL_Z1,
    SIGN_H,
    SIGN_HEIGHT,
    SIGN_TYPE,
    SIGN_TYPES,
    SIGN_W,
    SIGN_X,
    SIGN_Y,
    SIGN_YAW,
    SIGN_Z,
    World,
)

__all__ = [
    "TRUTH_VERSION",
    "Raster",
    "TruthWriter",
    "read_map",
    "read_poses",
    "read_raster",
    "truth_dir_for",
]

TRUTH_VERSION = 1
_NS = 1_000_000_000
_TILE = 512
_SAMPLE_M = 0.5


def truth_dir_for(bag: Path) -> Path:
    """The truth directory of a bag: ``<bag>.truth`` beside it."""
    return bag.with_name(bag.name + ".truth")


def _time_text(t_ns: int) -> str:
    return f"{t_ns // _NS}.{t_ns % _NS:09d}"


@dataclass(frozen=True)
class Raster:
    """The truth raster: ``elevation`` (m), ``reflectance`` (0..1), ``label`` (uint8).

    Cell ``[i, j]`` covers ``x in origin_x + res * [j, j + 1)``,
    ``y in origin_y + res * [i, i + 1)``: row 0 is the southern edge.
    """

    elevation: NDArray[np.float32]
    reflectance: NDArray[np.float32]
    label: NDArray[np.uint8]
    origin: tuple[float, float]
    resolution: float

    def cell_centres(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Map-frame x of each column and y of each row centre (m)."""
        h, w = self.elevation.shape
        x = self.origin[0] + (np.arange(w) + 0.5) * self.resolution
        y = self.origin[1] + (np.arange(h) + 0.5) * self.resolution
        return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)


class TruthWriter:
    """Writes a drive's truth directory; streams the time series, then the map at the end."""

    def __init__(self, root: Path, config: DriveConfig, world: World) -> None:
        self.root = root
        self.config = config
        self.world = world
        try:
            root.mkdir(parents=True)
        except FileExistsError:
            raise SynthError(f"{root} exists already; remove it or pass overwrite=True") from None
        self._files: dict[str, IO[str]] = {}
        try:
            self._open(
                "poses.txt", "# timestamp tx ty tz qx qy qz qw  (map frame, base_link; TUM)\n"
            )
            self._open(
                "imu_bias.csv",
                "t,accel_bias_x,accel_bias_y,accel_bias_z,gyro_bias_x,gyro_bias_y,gyro_bias_z\n",
            )
            self._open("odom_scale.csv", "t,scale\n")
            self._open("gps.csv", "t,published,true_e,true_n,true_u,bias_e,bias_n,bias_u\n")
        except BaseException:  # the directory is ours (mkdir made it): leave nothing behind
            self.abort()
            shutil.rmtree(root, ignore_errors=True)
            raise
        self.lo = np.array([np.inf, np.inf])
        self.hi = np.array([-np.inf, -np.inf])

    def _open(self, name: str, header: str) -> None:
        f = (self.root / name).open("w", encoding="ascii")
        f.write(header)
        self._files[name] = f

    def poses(
        self, t_ns: NDArray[np.int64], xyz: NDArray[np.float64], quat: NDArray[np.float64]
    ) -> None:
        """Append true base_link poses (map frame; quaternions ``x, y, z, w``)."""
        f = self._files["poses.txt"]
        for t, p, q in zip(t_ns.tolist(), xyz.tolist(), quat.tolist(), strict=True):
            f.write(
                f"{_time_text(t)} {p[0]:.6f} {p[1]:.6f} {p[2]:.6f} "
                f"{q[0]:.9f} {q[1]:.9f} {q[2]:.9f} {q[3]:.9f}\n"
            )
        self.cover(xyz)

    def cover(self, xyz: NDArray[np.float64]) -> None:
        """Grow the raster's bounds (the driven route's bounding box) to hold ``xyz``
        (``(N, 2+)``, map frame): the drive passes every trajectory sample, since poses at
        a low ``truth_hz`` leave up to a second of driving between them."""
        if len(xyz):
            self.lo = np.minimum(self.lo, xyz[:, :2].min(axis=0))
            self.hi = np.maximum(self.hi, xyz[:, :2].max(axis=0))

    def rows(
        self, name: str, t_ns: NDArray[np.int64], values: NDArray[np.float64], fmt: str = "{:.9g}"
    ) -> None:
        """Append CSV rows ``t, values...`` to one of the error files."""
        f = self._files[name]
        for t, row in zip(t_ns.tolist(), np.atleast_2d(values).tolist(), strict=True):
            f.write(_time_text(t) + "," + ",".join(fmt.format(v) for v in row) + "\n")

    def finish(self, extra: dict[str, Any]) -> None:
        """Close the time series and write ``map.geojson``, ``raster.npz`` and the JSON files."""
        for f in self._files.values():
            f.close()
        write_settings(self.root / "config.json", synth=self.config)
        (self.root / "map.geojson").write_text(
            json.dumps(map_geojson(self.world, self.config), indent=1) + "\n"
        )
        meta = world_json(self.world, self.config)
        meta.update(extra)
        if self.config.truth_raster and np.all(np.isfinite(self.lo)):
            m = self.config.truth_margin_m
            meta["raster"] = write_raster(
                self.root / "raster.npz",
                self.world,
                (self.lo[0] - m, self.lo[1] - m, self.hi[0] + m, self.hi[1] + m),
                self.config.truth_raster_res_m,
            )
        (self.root / "world.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    def abort(self) -> None:
        """Close open files after a failure (each of them: closing one that cannot flush its
        last lines, as on a full disk, raises, and the directory is removed anyway)."""
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()


def world_json(world: World, config: DriveConfig) -> dict[str, Any]:
    """The ``world.json`` content (without the raster block)."""
    lat, lon, alt = config.gps_origin
    # the frames /tf_static publishes: without a camera, no camera frames (a TF tree built
    # from this file had camera_link and camera_optical that the bag never mentions)
    mounts = [MOUNTS["lidar"], MOUNTS["imu"], MOUNTS["gps"]]
    if config.camera:
        mounts += [m for k in range(config.cameras) for m in camera_mounts(k, config.cameras)]
    return {
        "format": "adcloud.synth.truth",
        "version": TRUTH_VERSION,
        "seed": config.seed,
        "start_time_ns": config.start_time_ns,
        "map_frame": "map: ENU (x east, y north, z up), metres, tangent plane at the origin",
        "origin": {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt, "datum": "WGS84"},
        "gravity_mps2": 9.80665,
        "frames": {
            m.frame: {
                "parent": m.parent,
                "translation_m": list(m.translation),
                "rpy_rad": list(m.rpy),
            }
            for m in mounts
        },
        "labels": {label.name.lower(): int(label) for label in Label},
        "sign_types": list(SIGN_TYPES),
        "road": {
            "lane_width_m": LANE_WIDTH_M,
            "paved_half_width_m": PAVED_HALF_WIDTH_M,
            "curb_height_m": CURB_HEIGHT_M,
            "sidewalk_width_m": SIDEWALK_WIDTH_M,
            "dash_paint_m": DASH_PAINT_M,
            "dash_gap_m": DASH_GAP_M,
        },
        "world": world.summary(),
    }


# --------------------------------------------------------------------------- map


def _runs(mask: NDArray[np.bool_], closed: bool) -> list[NDArray[np.intp]]:
    """Index runs where ``mask`` holds (a closed sequence's wrap-around run is joined)."""
    idx = np.nonzero(mask)[0]
    if len(idx) == 0:
        return []
    breaks = np.nonzero(np.diff(idx) > 1)[0]
    runs = np.split(idx, breaks + 1)
    if closed and len(runs) > 1 and runs[0][0] == 0 and runs[-1][-1] == len(mask) - 1:
        runs = [np.concatenate([runs[-1], runs[0]]), *runs[1:-1]]
    elif closed and len(runs) == 1 and len(idx) == len(mask):
        runs = [np.concatenate([idx, idx[:1]])]
    return runs


def _line(
    world: World, road: int, n: float, keep: str | None
) -> list[tuple[NDArray[np.float64], tuple[float, float]]]:
    """Polylines ``(K, 3)`` at offset ``n`` along ``road``, optionally cut at intersections.

    ``keep="paint"`` drops points within the paint clearance of another road,
    ``keep="curb"`` those inside another road's carriageway.  Also returns each run's
    ``(s_start, s_end)``.
    """
    roads = world.roads
    length = roads.lengths[road]
    count = max(2, round(length / _SAMPLE_M))
    closed = roads.closed[road]
    s = np.arange(count) * (length / count) if closed else np.linspace(0, length, count + 1)
    x, y, _ = roads.point_at(road, s, n)
    z = world.terrain.height(x, y)
    if keep is None:
        mask = np.ones(len(s), dtype=bool)
    else:
        # the distance to the nearest centre line of a road other than this one: inside a
        # crossing road the nearest road is that one (its distance, not its ``other``,
        # which is the way back to this road's centre line)
        frame = roads.frame(x, y)
        other = np.where(frame.road == road, frame.other, frame.distance)
        limit = PAVED_HALF_WIDTH_M + (INTERSECTION_CLEAR_M if keep == "paint" else 0.0)
        mask = other > limit
    out = []
    for run in _runs(mask, closed):
        if len(run) < 2:
            continue
        pts = np.stack([x[run], y[run], z[run]], axis=1).astype(np.float64)
        out.append((pts, (float(s[run[0]]), float(s[run[-1]]))))
    return out


def _coords(pts: NDArray[np.float64]) -> list[list[float]]:
    return [[round(float(v), 4) for v in p] for p in pts]


def map_geojson(world: World, config: DriveConfig) -> dict[str, Any]:
    """The true map as a GeoJSON FeatureCollection in map-frame coordinates (m)."""
    roads = world.roads
    features: list[dict[str, Any]] = []

    def add(geom_type: str, coords: Any, props: dict[str, Any]) -> None:
        features.append(
            {
                "type": "Feature",
                "geometry": {"type": geom_type, "coordinates": coords},
                "properties": props,
            }
        )

    for road in range(roads.road_count):
        name = roads.names[road]
        for pts, _ in _line(world, road, 0.0, None):
            add(
                "LineString",
                _coords(pts),
                {
                    "kind": "reference_line",
                    "road": road,
                    "road_name": name,
                    "closed": roads.closed[road],
                },
            )
        for lane, n in (("right", -LANE_WIDTH_M / 2), ("left", LANE_WIDTH_M / 2)):
            for pts, _ in _line(world, road, n, None):
                ordered = pts if lane == "right" else pts[::-1]
                add(
                    "LineString",
                    _coords(ordered),
                    {
                        "kind": "lane_centerline",
                        "road": road,
                        "lane": lane,
                        "offset_m": n,
                        "direction": "+s" if lane == "right" else "-s",
                    },
                )
        for side in (-1.0, 1.0):
            for pts, _ in _line(world, road, side * PAVED_HALF_WIDTH_M, "curb"):
                add(
                    "LineString",
                    _coords(pts),
                    {
                        "kind": "curb",
                        "road": road,
                        "offset_m": side * PAVED_HALF_WIDTH_M,
                        "height_m": CURB_HEIGHT_M,
                    },
                )
        for row in roads.markings[roads.markings[:, MARK_ROAD] == road]:
            dashed = bool(row[MARK_DASHED])
            for pts, (s0, s1) in _line(world, road, float(row[MARK_OFFSET]), "paint"):
                props: dict[str, Any] = {
                    "kind": "lane_marking",
                    "type": "dashed" if dashed else "solid",
                    "color": "white",
                    "road": road,
                    "offset_m": float(row[MARK_OFFSET]),
                    "width_m": float(row[MARK_WIDTH]),
                    "reflectance": round(float(row[MARK_REFLECTANCE]), 4),
                    "s_range_m": [round(s0, 3), round(s1, 3)],
                }
                if dashed:
                    props.update({"dash_m": DASH_PAINT_M, "gap_m": DASH_GAP_M, "dash_phase_m": 0.0})
                add("LineString", _coords(pts), props)
    for sign in world.signs:
        add(
            "Point",
            [
                round(float(sign[SIGN_X]), 4),
                round(float(sign[SIGN_Y]), 4),
                round(float(sign[SIGN_Z]), 4),
            ],
            {
                "kind": "traffic_sign",
                "type": SIGN_TYPES[int(sign[SIGN_TYPE])],
                "facing_yaw_rad": round(float(sign[SIGN_YAW]), 6),
                "width_m": float(sign[SIGN_W]),
                "plate_height_m": float(sign[SIGN_H]),
                "height_m": round(float(sign[SIGN_HEIGHT]), 4),
            },
        )
    for cyl in world.cylinders[world.cylinders[:, CYL_LABEL] == Label.POLE]:
        add(
            "Point",
            [
                round(float(cyl[CYL_X]), 4),
                round(float(cyl[CYL_Y]), 4),
                round(float(cyl[CYL_Z0] + 0.3), 4),
            ],
            {
                "kind": "pole",
                "radius_m": float(cyl[CYL_R]),
                "height_m": round(float(cyl[CYL_Z1] - cyl[CYL_Z0] - 0.3), 4),
            },
        )
    lat, lon, alt = config.gps_origin
    mounts = list(MOUNTS.values())
    if config.camera:
        mounts += [m for k in range(1, config.cameras) for m in camera_mounts(k, config.cameras)]
    return {
        "type": "FeatureCollection",
        "adcloud:frame": "map",
        "adcloud:units": "m",
        "adcloud:origin": {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt},
        "adcloud:version": TRUTH_VERSION,
        "features": features,
    }


# --------------------------------------------------------------------------- raster


def write_raster(
    path: Path, world: World, bounds: tuple[float, float, float, float], res: float
) -> dict[str, Any]:
    """Rasterize the ground over ``bounds`` at ``res`` (m) into ``path`` (npz), strip by strip.

    Memory holds one strip of ``512`` rows; the arrays are written as ``.npy`` files
    and zipped: the byte layers deflated (level 1), the elevation stored as it is (float32
    heights deflate by ~13% at any level, for ~1.7 s of a core on a 30 s drive's raster).
    Returns the raster's description for ``world.json``.
    """
    x0 = np.floor(bounds[0] / res) * res
    y0 = np.floor(bounds[1] / res) * res
    width = int(np.ceil((bounds[2] - x0) / res))
    height = int(np.ceil((bounds[3] - y0) / res))
    layers: dict[str, np.dtype[Any]] = {
        "elevation": np.dtype("<f4"),
        "reflectance": np.dtype("u1"),
        "label": np.dtype("u1"),
    }
    tmp = {name: path.with_name(f".{name}.npy.part") for name in layers}
    files = {name: tmp[name].open("wb") for name in layers}
    try:
        for name, dt in layers.items():
            np.lib.format.write_array_header_1_0(
                files[name],
                {
                    "descr": np.lib.format.dtype_to_descr(dt),
                    "fortran_order": False,
                    "shape": (height, width),
                },
            )
        margin = PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M + INTERSECTION_CLEAR_M + 1.0
        for r0 in range(0, height, _TILE):
            rows = min(_TILE, height - r0)
            strip = {name: np.empty((rows, width), dtype=dt) for name, dt in layers.items()}
            ys = (y0 + (r0 + np.arange(rows) + 0.5) * res).astype(np.float32)
            for c0 in range(0, width, _TILE):
                cols = min(_TILE, width - c0)
                xs = (x0 + (c0 + np.arange(cols) + 0.5) * res).astype(np.float32)
                pieces = world.roads.pieces_near(
                    (float(xs[0]), float(ys[0]), float(xs[-1]), float(ys[-1])), margin
                )
                gx, gy = np.meshgrid(xs, ys)
                sample = world.ground_surface(gx, gy, pieces=pieces)
                strip["elevation"][:, c0 : c0 + cols] = sample.height
                strip["reflectance"][:, c0 : c0 + cols] = np.round(
                    np.clip(sample.reflectance, 0, 1) * 255
                )
                strip["label"][:, c0 : c0 + cols] = sample.label
            for name in layers:
                files[name].write(strip[name].tobytes())
    finally:
        for f in files.values():
            f.close()
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name in layers:
            with (
                tmp[name].open("rb") as src,
                zf.open(
                    _member(f"{name}.npy", deflate=name != "elevation"), "w", force_zip64=True
                ) as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
            tmp[name].unlink()
        for name, value in (
            ("origin", np.array([x0, y0], dtype=np.float64)),
            ("resolution", np.array(res, dtype=np.float64)),
            ("version", np.array(TRUTH_VERSION, dtype=np.int64)),
        ):
            with zf.open(_member(f"{name}.npy"), "w") as member:
                np.lib.format.write_array(member, value, allow_pickle=False)
    return {"file": path.name, "origin_m": [x0, y0], "resolution_m": res, "shape": [height, width]}


def _member(name: str, *, deflate: bool = True) -> zipfile.ZipInfo:
    """A zip member with a fixed date, so the same raster gives the same bytes."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    # ZipFile.open(info, "w") compresses at the ZipInfo's level, not at the ZipFile's
    # compresslevel, and Python 3.11 names it only privately: unset, it is zlib's level 6,
    # which took ~4x the time of level 1 on the reflectance layer.
    info._compresslevel = 1  # type: ignore[attr-defined]
    info.external_attr = 0o644 << 16
    return info


# --------------------------------------------------------------------------- readers


def _whole(truth: Path) -> Path:
    """``truth`` as a path, once it is known to be whole: ``world.json`` is written last, so
    a directory without it is what an interrupted drive (``kill -9``, a power cut) left --
    a ``poses.txt`` that may end in the middle of a line and no map or raster."""
    path = Path(truth)
    if path.is_dir() and not (path / "world.json").is_file():
        raise SynthError(
            f"{path} is an incomplete truth directory (no world.json, which a drive writes "
            "last): the drive that wrote it was interrupted; generate it again (--overwrite)"
        )
    return path


def read_poses(truth: Path) -> tuple[NDArray[np.int64], NDArray[np.float64], NDArray[np.float64]]:
    """``(t_ns, xyz (N, 3), quaternions (N, 4) as x, y, z, w)`` from ``poses.txt``."""
    t_ns = []
    rows = []
    path = _whole(truth) / "poses.txt"
    with path.open(encoding="ascii", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if line.startswith("#") or not line.strip():
                continue
            stamp, *vals = line.split()
            sec, _, frac = stamp.partition(".")
            # a row the file format does not allow (a hand-edited or foreign file) is named
            # by its line: a bare "cannot reshape array" or "invalid literal" said nowhere
            if (
                len(vals) != 7
                or not sec.isdigit()
                or not (frac == "" or frac.isdigit())
                or not all(_is_float(v) for v in vals)
            ):
                raise SynthError(
                    f"{path}:{number}: not a pose row 't tx ty tz qx qy qz qw' (t as "
                    f"seconds.nanoseconds, 7 numbers after it): {line.strip()[:80]!r}; "
                    "write the truth again with adcloud synth"
                )
            t_ns.append(int(sec) * _NS + int(frac.ljust(9, "0")[:9]))
            rows.append([float(v) for v in vals])
    arr = np.asarray(rows, dtype=np.float64).reshape(-1, 7)
    return np.asarray(t_ns, dtype=np.int64), arr[:, :3], arr[:, 3:]


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_raster(truth: Path) -> Raster:
    """The truth raster of a truth directory (no pickle involved)."""
    path = _whole(truth) / "raster.npz"
    if path.parent.is_dir() and not path.exists():
        # a bare FileNotFoundError left the reader guessing whether the drive was cut short
        raise SynthError(
            f"{path.parent} has no raster.npz: its drive was generated without the raster "
            "(truth_raster=False, --no-raster); generate it again with the raster on"
        )
    with np.load(path, allow_pickle=False) as z:
        if int(z["version"]) != TRUTH_VERSION:
            raise SynthError(f"{truth}: raster version {int(z['version'])} is not {TRUTH_VERSION}")
        origin = z["origin"]
        return Raster(
            elevation=z["elevation"],
            reflectance=z["reflectance"].astype(np.float32) / 255,
            label=z["label"],
            origin=(float(origin[0]), float(origin[1])),
            resolution=float(z["resolution"]),
        )


def read_map(truth: Path) -> dict[str, Any]:
    """The parsed ``map.geojson`` of a truth directory."""
    data: dict[str, Any] = json.loads((_whole(truth) / "map.geojson").read_text())
    return data
