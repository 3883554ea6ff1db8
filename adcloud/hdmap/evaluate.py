"""Map accuracy against synthetic ground truth (``adcloud hdmap eval``).

:func:`evaluate_map` compares a map version with a truth directory written by
:mod:`adcloud.synth` (``docs/synth-truth-format.md``) and reports, against the targets in
:class:`EvalSettings`:

- trajectory ATE RMSE (<= 5 cm): :func:`~adcloud.hdmap.trajectory.absolute_trajectory_error`;
- elevation RMSE over the observed grid cells (<= 3 cm): :func:`elevation_errors`;
- lane markings: mean distance of the mapped polylines to the true painted stripes
  (<= 10 cm) and the fraction of the observable painted length recovered (>= 95 %):
  :func:`polyline_metrics`;
- traffic signs: recall and precision (>= 90 %) with one-to-one matches within 30 cm:
  :func:`sign_metrics`.

Alignment
    A map is built in its own ``map`` frame, anchored by GPS; the synthetic GPS carries a
    bias that is constant over a drive and therefore unobservable, so the map frame differs
    from the truth frame by an (almost) constant rigid transform.  That offset is not a map
    error for any use of the map except absolute georeferencing, so -- as the TUM benchmark
    and ``evo`` do for trajectories -- the evaluation first fits the rigid transform that
    best maps the estimated trajectory onto the true one (Umeyama, no scale; for a nearly
    straight drive, whose trajectory leaves the roll about the road free, yaw and
    translation only; the ``alignment`` of the ATE) and applies that one transform to
    *every* map product (the other trajectories, grid cells, polylines, signs) before
    comparing.  The products are
    thus judged in the frame the trajectory defines; the offset itself is reported.

Observable truth
    A drive observes only part of the world.  Recall-type numbers count only truth within
    ``coverage_radius_m`` (markings) or ``sign_range_m`` (signs) of the aligned driven
    trajectories (every drive of the map: they are taken to map the truth's world, as
    drives of one synthetic seed do); precision-type numbers compare with all of the truth.
    Dashed markings count only where paint is (``s mod (dash + gap) < dash`` along the
    road's reference line, as the truth format specifies), not across their gaps.

Map products read by :func:`load_map_products` (a version directory): ``trajectory/*.tum``
(one TUM file per drive, map frame); the semantic layer, ``semantic.geojson`` (or, in other
layouts, every ``*.geojson`` below the version): features of kind ``lane_marking``
(LineString/MultiLineString) and ``traffic_sign`` (Point) in map-frame metres, as the truth's
``map.geojson``; and the grid tiles, every ``<tx>_<ty>.tif`` below the version, read with
:func:`adcloud.hdmap.geotiff.read_grid_tile` (layers ``elevation_mean`` and
``reflectance_mean``).  Grids stay tiles in memory -- a city map does not fit one array --
and :func:`mosaic` assembles a (downsampled) picture when one is wanted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from scipy.optimize import linear_sum_assignment
from scipy.spatial import cKDTree
from scipy.spatial.distance import cdist

from adcloud._scratch import remove_scratch
from adcloud.errors import AdcloudError
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.mapdir import MANIFEST_NAME, MapDir, MapVersion, drive_name
from adcloud.hdmap.trajectory import AteResult, Trajectory, absolute_trajectory_error

if TYPE_CHECKING:
    from adcloud.synth import Raster

__all__ = [
    "ElevationMetrics",
    "EvalResult",
    "EvalSettings",
    "GridLayers",
    "MapProducts",
    "Metric",
    "PolylineMetrics",
    "SignMetrics",
    "Truth",
    "apply_alignment",
    "densify",
    "elevation_errors",
    "elevation_metrics",
    "elevation_rmse",
    "evaluate_map",
    "features_from_geojson",
    "load_map_products",
    "load_truth",
    "mosaic",
    "painted_marking_polylines",
    "polyline_metrics",
    "read_grid_tiles",
    "sign_metrics",
]

_LOG = logging.getLogger(__name__)

F64 = NDArray[np.float64]
_NS = 1_000_000_000


@dataclass(frozen=True)
class EvalSettings:
    """How a map is evaluated and the targets it must meet (metres, fractions).

    ``sign_match_radius_m``: an estimated sign matches a true one this close (3D when both
    carry heights).  ``marking_match_radius_m``: a stretch of true paint counts as recovered
    where a mapped polyline lies this close.  ``marking_gate_m``: mapped polyline points
    farther than this from every true stripe are false detections (reported as
    ``false_length_m``), not distance errors.  ``coverage_radius_m`` / ``sign_range_m``:
    truth this close to the driven trajectory counts as observable.  ``target_*``: the
    acceptance thresholds.
    """

    sign_match_radius_m: float = 0.3
    marking_match_radius_m: float = 0.3
    marking_gate_m: float = 1.0
    coverage_radius_m: float = 8.0
    sign_range_m: float = 15.0
    target_ate_rmse_m: float = 0.05
    target_elevation_rmse_m: float = 0.03
    target_marking_mean_distance_m: float = 0.10
    target_marking_recovered_fraction: float = 0.95
    target_sign_recall: float = 0.90
    target_sign_precision: float = 0.90

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise HdmapError(f"hdmap eval setting {f.name} must be a number >= 0: {value!r}")


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class GridLayers:
    """A grid tile or mosaic in the map frame.

    ``elevation`` (H, W) float32 m, NaN where no point was observed; ``reflectance`` (H, W)
    float32 (the LiDAR's intensity unit, or 0..1) or None; cell ``[i, j]`` covers
    ``x in origin_x + res * [j, j + 1)``, ``y in origin_y + res * [i, i + 1)`` -- row 0 is
    the southern edge, the truth raster's convention.
    """

    elevation: NDArray[np.float32]
    origin: tuple[float, float]
    resolution: float
    reflectance: NDArray[np.float32] | None = None

    def __post_init__(self) -> None:
        elev = np.asarray(self.elevation, dtype=np.float32)
        if elev.ndim != 2:
            raise MapFormatError(f"grid elevation must be 2-D (H, W), got shape {elev.shape}")
        if not (self.resolution > 0):
            raise MapFormatError(f"grid resolution must be > 0 m, got {self.resolution}")
        object.__setattr__(self, "elevation", elev)
        object.__setattr__(self, "origin", (float(self.origin[0]), float(self.origin[1])))
        if self.reflectance is not None:
            refl = np.asarray(self.reflectance, dtype=np.float32)
            if refl.shape != elev.shape:
                raise MapFormatError(
                    f"grid reflectance shape {refl.shape} differs from elevation {elev.shape}"
                )
            object.__setattr__(self, "reflectance", refl)

    @property
    def observed(self) -> NDArray[np.bool_]:
        """Cells with an elevation (H, W)."""
        return np.isfinite(self.elevation)

    @property
    def extent(self) -> tuple[float, float, float, float]:
        """``(x_min, x_max, y_min, y_max)`` of the mosaic, m (for ``imshow(extent=...)``)."""
        h, w = self.elevation.shape
        x0, y0 = self.origin
        return x0, x0 + w * self.resolution, y0, y0 + h * self.resolution

    def cell_centres(self) -> tuple[F64, F64]:
        """Map-frame x of each column centre (W,) and y of each row centre (H,), m."""
        h, w = self.elevation.shape
        x = self.origin[0] + (np.arange(w) + 0.5) * self.resolution
        y = self.origin[1] + (np.arange(h) + 0.5) * self.resolution
        return x.astype(np.float64), y.astype(np.float64)


@dataclass(frozen=True)
class MapProducts:
    """A map's products in memory, map frame: ``trajectories`` by drive name, the ``grid``
    tiles (empty if the map has none), ``lane_markings`` (polylines (n, 3) or
    (n, 2), m), ``signs`` (n, 3) plate centres (z NaN when unknown) with ``sign_types``;
    ``semantic`` says whether the map has a semantic layer at all (an empty one is judged,
    a missing one is not)."""

    trajectories: Mapping[str, Trajectory]
    grid: tuple[GridLayers, ...] = ()
    lane_markings: tuple[F64, ...] = ()
    signs: F64 = field(default_factory=lambda: np.zeros((0, 3)))
    sign_types: tuple[str, ...] = ()
    semantic: bool = False
    source: str = ""
    notes: tuple[str, ...] = ()


GridReader = Callable[[Path], Sequence[GridLayers]]
"""Reads the grid tiles of a version directory (empty when it has none)."""

SEMANTIC_NAME = "semantic.geojson"
_TILE_NAME = re.compile(r"^-?\d+_-?\d+\.tif$")


def read_grid_tiles(version_dir: str | os.PathLike[str]) -> tuple[GridLayers, ...]:
    """The grid tiles of a version directory: every ``<tx>_<ty>.tif`` below it, read with
    :func:`adcloud.hdmap.geotiff.read_grid_tile` (``elevation_mean`` and
    ``reflectance_mean``; rows south-up)."""
    from adcloud.hdmap.geotiff import read_grid_tile  # noqa: PLC0415 - pulls in the grid stage

    out = []
    for path in sorted(Path(version_dir).rglob("*.tif")):
        if not _TILE_NAME.match(path.name):
            continue
        tile = read_grid_tile(path).tile
        out.append(
            GridLayers(
                elevation=tile.elevation_mean,
                origin=tile.origin,
                resolution=tile.resolution,
                reflectance=tile.reflectance_mean,
            )
        )
    return tuple(out)


def mosaic(tiles: Sequence[GridLayers], factor: int = 1) -> GridLayers:
    """One :class:`GridLayers` over all ``tiles`` (same resolution, one lattice), averaged
    over ``factor`` x ``factor`` blocks of cells (NaN cells ignored; a block without data
    is NaN).  Reflectance is kept when every tile has it."""
    if not tiles:
        raise HdmapError("mosaic needs at least one grid tile")
    if factor < 1:
        raise HdmapError(f"mosaic factor must be >= 1, got {factor}")
    res = tiles[0].resolution
    if any(not math.isclose(t.resolution, res, rel_tol=1e-9) for t in tiles):
        raise HdmapError("mosaic: the tiles differ in resolution; mosaic one map's tiles")
    x0 = min(t.origin[0] for t in tiles)
    y0 = min(t.origin[1] for t in tiles)
    # global cell index of each tile's first row/column (the tiles share one lattice)
    offsets = [(round((t.origin[1] - y0) / res), round((t.origin[0] - x0) / res)) for t in tiles]
    rows = max(r + t.elevation.shape[0] for (r, _), t in zip(offsets, tiles, strict=True))
    cols = max(c + t.elevation.shape[1] for (_, c), t in zip(offsets, tiles, strict=True))
    shape = (-(-rows // factor), -(-cols // factor))
    names = ["elevation"] + (
        ["reflectance"] if all(t.reflectance is not None for t in tiles) else []
    )
    sums = {name: np.zeros(shape[0] * shape[1]) for name in names}
    counts = {name: np.zeros(shape[0] * shape[1]) for name in names}
    for (r0, c0), t in zip(offsets, tiles, strict=True):
        h, w = t.elevation.shape
        rr, cc = np.mgrid[r0 : r0 + h, c0 : c0 + w]
        flat = ((rr // factor) * shape[1] + cc // factor).ravel()
        for name in names:
            layer = t.elevation if name == "elevation" else t.reflectance
            assert layer is not None
            v = layer.ravel().astype(np.float64)
            ok = np.isfinite(v)
            sums[name] += np.bincount(flat[ok], weights=v[ok], minlength=sums[name].size)
            counts[name] += np.bincount(flat[ok], minlength=counts[name].size)

    def mean(name: str) -> NDArray[np.float32]:
        with np.errstate(invalid="ignore", divide="ignore"):
            m = np.where(counts[name] > 0, sums[name] / counts[name], np.nan)
        return m.reshape(shape).astype(np.float32)

    return GridLayers(
        elevation=mean("elevation"),
        origin=(x0, y0),
        resolution=res * factor,
        reflectance=mean("reflectance") if len(names) == 2 else None,
    )


def _coords(geometry: Mapping[str, Any], where: str) -> list[F64]:
    kind = geometry.get("type")
    coords = geometry.get("coordinates")
    try:
        if kind in ("LineString", "Point"):
            parts = [np.asarray(coords, dtype=np.float64)]
        elif kind in ("MultiLineString", "MultiPoint"):
            parts = [np.asarray(c, dtype=np.float64) for c in coords]  # type: ignore[union-attr]
        else:
            raise MapFormatError(f"{where}: unsupported geometry type {kind!r}")
    except (TypeError, ValueError) as err:
        raise MapFormatError(f"{where}: coordinates are not numbers: {err}") from None
    out = []
    for p in parts:
        arr = p.reshape(1, -1) if p.ndim == 1 else p
        if arr.ndim != 2 or arr.shape[1] not in (2, 3):
            raise MapFormatError(f"{where}: coordinates must be [x, y] or [x, y, z]")
        if arr.shape[1] == 2:
            arr = np.column_stack([arr, np.full(len(arr), np.nan)])
        out.append(arr)
    return out


def features_from_geojson(
    data: Mapping[str, Any], where: str = "geojson"
) -> tuple[list[F64], F64, list[str]]:
    """Lane-marking polylines (n, 3), sign positions (m, 3) and sign types from a GeoJSON
    FeatureCollection in map-frame metres (the truth's and the map's ``*.geojson``).  A
    missing z is NaN.  Raises MapFormatError for another frame or a malformed feature."""
    if data.get("type") != "FeatureCollection":
        raise MapFormatError(f"{where}: not a GeoJSON FeatureCollection")
    frame = data.get("adcloud:frame", "map")
    if frame != "map":
        raise MapFormatError(f"{where}: coordinates in frame {frame!r}; expected map-frame metres")
    lines: list[F64] = []
    signs: list[F64] = []
    types: list[str] = []
    for i, feature in enumerate(data.get("features") or []):
        props = feature.get("properties") or {}
        kind = props.get("kind")
        here = f"{where}: features[{i}]"
        if kind == "lane_marking":
            lines.extend(c for c in _coords(feature.get("geometry") or {}, here) if len(c) >= 2)
        elif kind == "traffic_sign":
            for c in _coords(feature.get("geometry") or {}, here):
                signs.append(c[0])
                types.append(str(props.get("type", "")))
    sign_arr = np.asarray(signs, dtype=np.float64).reshape(-1, 3)
    return lines, sign_arr, types


@contextlib.contextmanager
def _version_dir(source: MapVersion | str | os.PathLike[str]) -> Iterator[tuple[Path, str]]:
    """A local directory with the files of ``source`` and the URI that names it; a version
    off the local disk is downloaded into a temporary directory, removed when the block
    ends (a whole map version: it must not stay behind in ``/tmp``)."""
    if isinstance(source, MapVersion):
        with _fetched(source) as fetched:
            yield fetched
        return
    text = os.fspath(source)
    local = Path(text) if "://" not in text else None
    if local is not None and (local / MANIFEST_NAME).is_file():
        yield local, text
        return
    if local is not None and not (local / "CURRENT").exists() and local.is_dir():
        yield local, text  # a plain directory of products
        return
    # the map is opened here, so closed here: a store's map holds connections and files
    with MapDir(text) as mapdir:
        found = mapdir.current()
        if found is None:
            # a mistyped path is told from a map no build has committed to yet
            raise MapFormatError(mapdir.no_version_text())
        with _fetched(found) as fetched:
            yield fetched


@contextlib.contextmanager
def _fetched(version: MapVersion) -> Iterator[tuple[Path, str]]:
    root = version.fetch()
    try:
        yield root, version.uri
    finally:
        if version.path is None:
            remove_scratch(root)


def load_map_products(
    source: MapVersion | str | os.PathLike[str], *, grid_reader: GridReader | None = None
) -> MapProducts:
    """Read a map's products: ``source`` is a :class:`MapVersion`, a map URI (its current
    version), a version directory or a plain directory of products.  ``grid_reader`` reads
    the grid (default: :mod:`adcloud.hdmap.geotiff`'s ``read_grid`` when available)."""
    with _version_dir(source) as (root, uri):
        return _read_products(root, uri, grid_reader)


def _read_products(root: Path, uri: str, grid_reader: GridReader | None) -> MapProducts:
    notes: list[str] = []
    trajectories: dict[str, Trajectory] = {}
    for path in sorted((root / "trajectory").glob("*.tum")):
        trajectories[path.stem] = Trajectory.read_tum(path)
    lines: list[F64] = []
    signs: list[F64] = []
    types: list[str] = []
    # the build's semantic layer; other layouts: every GeoJSON of the version
    geojsons = (
        [root / SEMANTIC_NAME]
        if (root / SEMANTIC_NAME).is_file()
        else sorted(p for p in root.rglob("*.geojson") if p.is_file())
    )
    for path in geojsons:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise MapFormatError(f"{path}: not valid JSON ({err})") from None
        ls, ss, ts = features_from_geojson(data, str(path))
        lines += ls
        signs.append(ss)
        types += ts
    if not geojsons:
        notes.append("the map has no semantic GeoJSON layer")
    grid = tuple((grid_reader or read_grid_tiles)(root))
    if not grid:
        notes.append("the map has no grid tiles (<tx>_<ty>.tif)")
    return MapProducts(
        trajectories=trajectories,
        grid=grid,
        lane_markings=tuple(lines),
        signs=np.concatenate(signs) if signs else np.zeros((0, 3)),
        sign_types=tuple(types),
        semantic=bool(geojsons),
        source=uri,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- truth


@dataclass(frozen=True)
class Truth:
    """What a synthetic truth directory says: the true ``trajectory``, the painted parts of
    the lane markings (polylines (n, 3)), the sign plate centres (m, 3) and types, and the
    ground ``raster`` (:class:`adcloud.synth.Raster`, None when the drive wrote none)."""

    trajectory: Trajectory
    lane_markings: tuple[F64, ...]
    signs: F64
    sign_types: tuple[str, ...]
    raster: Raster | None
    name: str


def load_truth(truth_dir: str | os.PathLike[str]) -> Truth:
    """Read a truth directory (``<bag>.truth``) with :mod:`adcloud.synth`'s readers."""
    from adcloud.synth import read_map, read_poses, read_raster  # noqa: PLC0415

    path = Path(truth_dir)
    if not (path / "poses.txt").is_file():
        raise HdmapError(
            f"{path}: not a truth directory (no poses.txt); pass the <bag>.truth directory "
            "that `adcloud synth` wrote beside the bag"
        )
    try:
        t, xyz, quat = read_poses(path)
        geo = read_map(path)
        raster = read_raster(path) if (path / "raster.npz").is_file() else None
    except (OSError, ValueError, KeyError, AdcloudError) as err:
        raise HdmapError(f"{path}: cannot read the truth: {err}") from err
    if len(t) < 2:
        raise HdmapError(
            f"{path / 'poses.txt'}: {len(t)} pose(s); the truth needs the drive's poses (the "
            "file was cut off or emptied: write the truth again with adcloud synth)"
        )
    _, signs, types = features_from_geojson(geo, str(path / "map.geojson"))
    name = path.name.removesuffix(".truth")
    return Truth(
        trajectory=Trajectory.from_xyz_quat(t, xyz, quat),
        lane_markings=tuple(painted_marking_polylines(geo)),
        signs=signs,
        sign_types=tuple(types),
        raster=raster,
        name=drive_name(name),
    )


# --------------------------------------------------------------------------- geometry


def densify(points: F64, step: float) -> F64:
    """The polyline with vertices inserted so that no segment is longer than ``step``."""
    p = np.asarray(points, dtype=np.float64)
    if len(p) < 2:
        return p
    seg = np.diff(p, axis=0)
    n = np.maximum(1, np.ceil(np.linalg.norm(seg, axis=1) / step).astype(np.int64))
    frac = np.concatenate([np.arange(k) / k for k in n])
    start = np.repeat(p[:-1], n, axis=0)
    return np.vstack([start + np.repeat(seg, n, axis=0) * frac[:, None], p[-1:]])


def _runs(mask: NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges where ``mask`` is True."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


class _Segments:
    """Polylines as short segments with exact point-to-polyline distances.

    A k-d tree over segment midpoints gives candidates: the nearest segment's midpoint lies
    within (distance to the nearest midpoint + half the longest segment) of the query, so
    the candidates always contain it and the distances are exact, not sampled."""

    def __init__(self, polylines: Sequence[F64], max_len: float = 0.5) -> None:
        a, b, line, s0 = [], [], [], []
        self.lengths: list[float] = []
        for k, poly in enumerate(polylines):
            p = densify(np.asarray(poly, dtype=np.float64)[:, :2], max_len)
            d = np.linalg.norm(np.diff(p, axis=0), axis=1) if len(p) > 1 else np.zeros(0)
            cum = np.concatenate([[0.0], np.cumsum(d)])
            keep = d > 0
            a.append(p[:-1][keep])
            b.append(p[1:][keep])
            s0.append(cum[:-1][keep])
            line.append(np.full(int(keep.sum()), k))
            self.lengths.append(float(cum[-1]))
        self.a = np.concatenate(a) if a else np.zeros((0, 2))
        self.b = np.concatenate(b) if b else np.zeros((0, 2))
        self.s0 = np.concatenate(s0) if s0 else np.zeros(0)
        self.line = np.concatenate(line).astype(np.int64) if line else np.zeros(0, np.int64)
        self.seg_len = np.linalg.norm(self.b - self.a, axis=1)
        self.half = float(self.seg_len.max() / 2) if len(self.seg_len) else 0.0
        self.tree = cKDTree((self.a + self.b) / 2) if len(self.a) else None

    def nearest(self, points: F64) -> tuple[F64, NDArray[np.int64], F64]:
        """Distance (n,) of each point (n, 2) to the nearest segment, that segment's polyline
        index and the arclength (m along that polyline) of the nearest point."""
        pts = np.asarray(points, dtype=np.float64)[:, :2]
        n = len(pts)
        if self.tree is None or n == 0:
            return np.full(n, np.inf), np.full(n, -1, np.int64), np.full(n, np.nan)
        d0, _ = self.tree.query(pts)
        cand = self.tree.query_ball_point(pts, d0 + self.half + 1e-9)
        counts = np.fromiter((len(c) for c in cand), dtype=np.int64, count=n)
        qi = np.repeat(np.arange(n), counts)
        si = np.fromiter((j for c in cand for j in c), dtype=np.int64, count=int(counts.sum()))
        ab = self.b[si] - self.a[si]
        t = np.clip(np.einsum("ij,ij->i", pts[qi] - self.a[si], ab) / self.seg_len[si] ** 2, 0, 1)
        dist = np.linalg.norm(pts[qi] - (self.a[si] + ab * t[:, None]), axis=1)
        order = np.lexsort((dist, qi))
        best = order[np.searchsorted(qi[order], np.arange(n))]
        seg = si[best]
        return dist[best], self.line[seg], self.s0[seg] + t[best] * self.seg_len[seg]


def _reference_lines(geo: Mapping[str, Any]) -> dict[Any, F64]:
    refs = {}
    for f in geo.get("features") or []:
        props = f.get("properties") or {}
        if (
            props.get("kind") == "reference_line"
            and (f.get("geometry") or {}).get("type") == "LineString"
        ):
            refs[props.get("road")] = np.asarray(f["geometry"]["coordinates"], dtype=np.float64)
    return refs


def painted_marking_polylines(geo: Mapping[str, Any], *, step: float = 0.05) -> list[F64]:
    """The painted parts of the ``lane_marking`` features of a truth ``map.geojson``:
    solid lines whole, dashed lines cut to their dashes.  A dashed line's road arclength
    ``s`` comes from projecting it onto its road's ``reference_line`` (exact for any
    lateral offset); paint lies where ``(s - dash_phase_m) mod (dash_m + gap_m) < dash_m``.
    Polylines (n, 3), resampled every ``step`` m inside dashes."""
    refs = _reference_lines(geo)
    ref_segs = {road: _Segments([ref]) for road, ref in refs.items()}
    out: list[F64] = []
    for i, f in enumerate(geo.get("features") or []):
        props = f.get("properties") or {}
        if props.get("kind") != "lane_marking":
            continue
        for coords in _coords(f.get("geometry") or {}, f"map.geojson: features[{i}]"):
            if len(coords) < 2:
                continue
            if props.get("type") != "dashed":
                out.append(coords)
                continue
            dense = densify(coords, step)
            dash = float(props.get("dash_m", 3.0))
            period = dash + float(props.get("gap_m", 6.0))
            phase = float(props.get("dash_phase_m", 0.0))
            road = props.get("road")
            if road in ref_segs:
                _, _, s = ref_segs[road].nearest(dense)
            else:  # no reference line: arclength along the marking from its start
                s_start = float((props.get("s_range_m") or [0.0])[0])
                steps = np.linalg.norm(np.diff(dense[:, :2], axis=0), axis=1)
                s = s_start + np.concatenate([[0.0], np.cumsum(steps)])
            paint = np.mod(s - phase, period) < dash
            out.extend(dense[a:b] for a, b in _runs(paint) if b - a >= 2)
    return out


def apply_alignment(points: F64, alignment: F64) -> F64:
    """``alignment`` (4x4) applied to points (n, 3); a NaN z stays NaN and is treated as 0
    for x and y (a horizontal point under a near-level rotation)."""
    p = _as_points(points, "points to align")
    if p.shape[1] == 2:
        p = np.column_stack([p, np.zeros(len(p))])
    z_nan = ~np.isfinite(p[:, 2])
    q = np.where(z_nan[:, None], np.column_stack([p[:, :2], np.zeros(len(p))]), p)
    out = q @ alignment[:3, :3].T + alignment[:3, 3]
    out[z_nan, 2] = np.nan
    return np.asarray(out, dtype=np.float64)


def _clip(polylines: Sequence[F64], keep: Callable[[F64], NDArray[np.bool_]]) -> list[F64]:
    """The parts of the polylines whose points satisfy ``keep`` (resampled at 0.1 m)."""
    out: list[F64] = []
    for poly in polylines:
        dense = densify(np.asarray(poly, dtype=np.float64), 0.1)
        out.extend(dense[a:b] for a, b in _runs(keep(dense)) if b - a >= 2)
    return out


# --------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class ElevationMetrics:
    """Elevation errors (estimate minus truth, m) over ``count`` observed cells inside the
    truth raster: ``rmse``, ``mean`` (bias), ``median_abs``, ``p95_abs``, and ``errors``."""

    rmse: float
    mean: float
    median_abs: float
    p95_abs: float
    count: int
    errors: F64

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready summary (without the per-cell errors)."""
        return {
            "rmse_m": self.rmse,
            "mean_m": self.mean,
            "median_abs_m": self.median_abs,
            "p95_abs_m": self.p95_abs,
            "count": self.count,
        }


def elevation_errors(
    grid: GridLayers | Sequence[GridLayers], truth: Raster, alignment: F64 | None = None
) -> F64:
    """Per observed cell: aligned estimated elevation minus the true ground elevation (m).

    Each observed cell centre ``(x, y, elevation)`` is moved by ``alignment`` (4x4, map ->
    truth frame; identity if None) and compared with the truth raster's cell containing the
    moved ``(x, y)`` (nearest cell: the raster samples the ground at cell centres, and a
    curb's 15 cm step must not be smeared by interpolation).  Cells outside the raster are
    left out.  ``grid`` is one :class:`GridLayers` or its tiles; ``truth`` an
    :class:`adcloud.synth.Raster` (``elevation``, ``origin``, ``resolution``)."""
    if not isinstance(grid, GridLayers):
        parts = [elevation_errors(t, truth, alignment) for t in grid]
        return np.concatenate(parts) if parts else np.zeros(0)
    a = np.eye(4) if alignment is None else np.asarray(alignment, dtype=np.float64)
    rows, cols = np.nonzero(grid.observed)
    xs, ys = grid.cell_centres()
    pts = np.column_stack([xs[cols], ys[rows], grid.elevation[rows, cols].astype(np.float64)])
    moved = pts @ a[:3, :3].T + a[:3, 3]
    t_elev = np.asarray(truth.elevation)
    res = float(truth.resolution)
    j = np.floor((moved[:, 0] - truth.origin[0]) / res).astype(np.int64)
    i = np.floor((moved[:, 1] - truth.origin[1]) / res).astype(np.int64)
    inside = (i >= 0) & (i < t_elev.shape[0]) & (j >= 0) & (j < t_elev.shape[1])
    ref = t_elev[i[inside], j[inside]].astype(np.float64)
    err = moved[inside, 2] - ref
    return np.asarray(err[np.isfinite(err)], dtype=np.float64)


def elevation_metrics(
    grid: GridLayers | Sequence[GridLayers], truth: Raster, alignment: F64 | None = None
) -> ElevationMetrics:
    """:func:`elevation_errors` summarised (NaN statistics when no cell overlaps)."""
    err = elevation_errors(grid, truth, alignment)
    if err.size == 0:
        nan = float("nan")
        return ElevationMetrics(nan, nan, nan, nan, 0, err)
    absd = np.abs(err)
    return ElevationMetrics(
        rmse=float(np.sqrt(np.mean(err**2))),
        mean=float(err.mean()),
        median_abs=float(np.median(absd)),
        p95_abs=float(np.percentile(absd, 95)),
        count=int(err.size),
        errors=err,
    )


def elevation_rmse(
    grid: GridLayers | Sequence[GridLayers], truth: Raster, alignment: F64 | None = None
) -> float:
    """RMSE (m) of :func:`elevation_errors`; NaN when no observed cell lies on the raster."""
    return elevation_metrics(grid, truth, alignment).rmse


@dataclass(frozen=True)
class PolylineMetrics:
    """Mapped polylines against true ones (2-D, m).

    ``mean_distance_m``: length-weighted mean distance from the mapped polylines to the
    nearest true polyline, over the mapped length within the gate; ``recovered_fraction``:
    the share of the true length to which a mapped polyline lies within the match radius
    (measured along the truth, by projecting the matched mapped stretches onto it);
    ``truth_length_m``, ``estimate_length_m``, ``recovered_length_m``; ``false_length_m``:
    mapped length farther than the gate from every true line."""

    mean_distance_m: float
    recovered_fraction: float
    truth_length_m: float
    estimate_length_m: float
    recovered_length_m: float
    false_length_m: float

    def as_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def polyline_metrics(
    estimate: Sequence[F64],
    truth: Sequence[F64],
    *,
    match_radius: float = 0.3,
    gate: float = 1.0,
    step: float = 0.05,
) -> PolylineMetrics:
    """Compare mapped polylines with true ones in the plane (see :class:`PolylineMetrics`).

    Both are sequences of (n, 2) or (n, 3) arrays in the same frame (align first).  The
    mapped polylines are sampled every ``step`` m and each sample's exact distance to the
    true polylines is computed.  No mapped length within the gate gives a NaN mean."""
    truth_segs = _Segments([np.asarray(t, dtype=np.float64) for t in truth if len(t) >= 2])
    truth_len = float(sum(truth_segs.lengths))
    weighted = 0.0
    weight = 0.0
    est_len = 0.0
    false_len = 0.0
    intervals: dict[int, list[tuple[float, float]]] = {}
    for poly in estimate:
        p = densify(np.asarray(poly, dtype=np.float64)[:, :2], step)
        if len(p) < 2:
            continue
        seg = np.linalg.norm(np.diff(p, axis=0), axis=1)
        w = np.concatenate([[0.0], seg / 2]) + np.concatenate([seg / 2, [0.0]])
        dist, line, s = truth_segs.nearest(p)
        est_len += float(seg.sum())
        gated = dist <= gate
        weighted += float(np.sum(w[gated] * dist[gated]))
        weight += float(np.sum(w[gated]))
        false_len += float(np.sum(w[~gated]))
        ok = dist <= match_radius
        # consecutive matched samples on the same true line cover the truth between their
        # projections; a jump (a loop's start/end seam, another line) covers nothing
        both = ok[:-1] & ok[1:] & (line[:-1] == line[1:])
        jump = np.abs(np.diff(s)) <= 3 * np.maximum(seg, step)
        for k in np.flatnonzero(both & jump):
            lo, hi = sorted((float(s[k]), float(s[k + 1])))
            intervals.setdefault(int(line[k]), []).append((lo, hi))
    recovered = float(sum(_union_length(v) for v in intervals.values()))
    return PolylineMetrics(
        mean_distance_m=weighted / weight if weight > 0 else float("nan"),
        recovered_fraction=recovered / truth_len if truth_len > 0 else float("nan"),
        truth_length_m=truth_len,
        estimate_length_m=est_len,
        recovered_length_m=recovered,
        false_length_m=false_len,
    )


@dataclass(frozen=True)
class SignMetrics:
    """Signs matched one-to-one within a radius: ``recall`` = matched / true, ``precision``
    = matched / estimated (NaN when the denominator is 0), ``mean_error_m`` of the matches,
    ``type_accuracy`` among matches (NaN when types were not given or nothing matched)."""

    recall: float
    precision: float
    matched: int
    estimated: int
    true: int
    mean_error_m: float
    type_accuracy: float

    def as_dict(self) -> dict[str, float | int]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def _as_points(values: F64, what: str) -> F64:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return arr.reshape(0, arr.shape[-1] if arr.ndim == 2 else 2)
    if arr.ndim != 2:
        raise HdmapError(f"{what} must be an (n, 2) or (n, 3) array, got shape {arr.shape}")
    return arr


def sign_metrics(
    estimate: F64,
    truth: F64,
    *,
    radius: float = 0.3,
    estimate_types: Sequence[str] | None = None,
    truth_types: Sequence[str] | None = None,
) -> SignMetrics:
    """Match estimated sign positions (n, d) to true ones (m, d) one-to-one (Hungarian
    assignment, SciPy's ``linear_sum_assignment``) so that as many as possible lie within
    ``radius`` m, then count them (see :class:`SignMetrics`)."""
    est = _as_points(estimate, "estimated sign positions")
    tru = _as_points(truth, "true sign positions")
    nan = float("nan")
    matched_e: NDArray[np.intp] = np.zeros(0, np.intp)
    matched_t: NDArray[np.intp] = np.zeros(0, np.intp)
    d = np.zeros((0, 0))
    if len(est) and len(tru):
        if est.shape[1] != tru.shape[1]:
            raise HdmapError(
                f"sign positions differ in dimension: {est.shape[1]} vs {tru.shape[1]}"
            )
        d = cdist(est, tru)
        # pairs beyond the radius cost more than any set of valid ones: the assignment
        # maximises the number of matches, then minimises their total distance
        big = 1.0 + radius * (len(est) + len(tru))
        rows, cols = linear_sum_assignment(np.where(d <= radius, d, big))
        ok = d[rows, cols] <= radius
        matched_e, matched_t = rows[ok], cols[ok]
    tp = len(matched_e)
    type_acc = nan
    if tp and estimate_types is not None and truth_types is not None:
        same = [
            estimate_types[i] == truth_types[j] for i, j in zip(matched_e, matched_t, strict=True)
        ]
        type_acc = float(np.mean(same))
    return SignMetrics(
        recall=tp / len(tru) if len(tru) else nan,
        precision=tp / len(est) if len(est) else nan,
        matched=tp,
        estimated=len(est),
        true=len(tru),
        mean_error_m=float(d[matched_e, matched_t].mean()) if tp else nan,
        type_accuracy=type_acc,
    )


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Metric:
    """One accuracy figure and its target: passes when ``value <= target`` (``op`` "<=") or
    ``value >= target`` (">="); ``value`` None (or NaN) means not evaluated."""

    name: str
    value: float | None
    target: float
    op: str
    unit: str
    note: str = ""

    @property
    def passed(self) -> bool | None:
        """True/False against the target, None when not evaluated."""
        if self.value is None or not math.isfinite(self.value):
            return None
        return self.value <= self.target if self.op == "<=" else self.value >= self.target

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        value = self.value if self.value is not None and math.isfinite(self.value) else None
        return {
            "value": value,
            "target": self.target,
            "op": self.op,
            "unit": self.unit,
            "passed": self.passed,
            "note": self.note,
        }


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _json_ready(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in data.items()}


@dataclass(frozen=True)
class EvalResult:
    """The evaluation of one map against one truth directory.

    ``alignment`` (4x4) maps the map frame onto the truth frame (applied to every product);
    ``ate`` and ``ate_times_s`` (s since the drive's first pose, per ATE error); the
    per-product results (None when not evaluated, with the reason in ``notes``) and the
    ``metrics`` against their targets.  ``passed`` is True only when every metric was
    evaluated and meets its target; ``failures`` says which did not and why."""

    drive: str
    alignment: F64
    ate: AteResult
    ate_times_s: F64
    elevation: ElevationMetrics | None
    markings: PolylineMetrics | None
    signs: SignMetrics | None
    metrics: tuple[Metric, ...]
    notes: tuple[str, ...] = ()
    map_source: str = ""
    truth_dir: str = ""

    @property
    def passed(self) -> bool:
        """Every metric was evaluated and meets its target (a map without a grid or a
        semantic layer does not pass: its targets cannot be shown to be met)."""
        return all(m.passed is True for m in self.metrics)

    @property
    def failures(self) -> tuple[str, ...]:
        """One line per metric that did not pass: the value that missed its target, or
        why it could not be evaluated."""
        out = []
        for m in self.metrics:
            target = f"{m.op} {m.target:g} {m.unit}".rstrip()
            if m.passed is None:
                why = m.note or "nothing to compare"
                out.append(f"{m.name}: not evaluated ({why}); target {target}")
            elif not m.passed:
                assert m.value is not None
                out.append(f"{m.name}: {m.value:.4g} {m.unit} misses the target {target}")
        return tuple(out)

    def metric(self, name: str) -> Metric:
        """The metric called ``name`` (KeyError if none)."""
        for m in self.metrics:
            if m.name == name:
                return m
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (NaN as null)."""
        offset = self.alignment[:3, 3]
        yaw = math.degrees(math.atan2(self.alignment[1, 0], self.alignment[0, 0]))
        return {
            "drive": self.drive,
            "map": self.map_source,
            "truth": self.truth_dir,
            "passed": self.passed,
            "failures": list(self.failures),
            "metrics": {m.name: m.as_dict() for m in self.metrics},
            "alignment": {
                "matrix": self.alignment.tolist(),
                "offset_m": offset.tolist(),
                "yaw_deg": yaw,
            },
            "ate": self.ate.as_dict(),
            "elevation": None if self.elevation is None else _json_ready(self.elevation.as_dict()),
            "markings": None if self.markings is None else _json_ready(self.markings.as_dict()),
            "signs": None if self.signs is None else _json_ready(self.signs.as_dict()),
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """:meth:`as_dict` as indented JSON text."""
        return json.dumps(self.as_dict(), indent=2) + "\n"


def _pick_drive(products: MapProducts, truth: Truth, drive: str | None) -> str:
    names = sorted(products.trajectories)
    if not names:
        raise MapFormatError(
            f"{products.source}: the map has no trajectory (trajectory/<drive>.tum); "
            "nothing to align the map to the truth with"
        )
    if drive is not None:
        if drive not in products.trajectories:
            raise HdmapError(f"{products.source}: no drive {drive!r}; the map has {names}")
        return drive
    if truth.name in products.trajectories:
        return truth.name
    if len(names) == 1:
        # the truth of another drive would be compared all the same (metres of "error"):
        # the result's notes say so (evaluate_map), where a nightly log is not read
        _LOG.warning("%s: %s", products.source, _unnamed_truth_note(truth.name, names[0]))
        return names[0]
    raise HdmapError(
        f"{products.source}: cannot tell which of the drives {names} the truth "
        f"{truth.name!r} belongs to; name it (adcloud hdmap eval --drive NAME, or drive=NAME)"
    )


def _unnamed_truth_note(truth: str, drive: str) -> str:
    return (
        f"the truth {truth!r} is not named after the map's only drive {drive!r}: compared "
        "with it all the same (name the drive with --drive / drive= if that is right)"
    )


def _nearly_straight(trajectory: Trajectory, min_width_m: float = 2.0) -> bool:
    """Whether the drive is too close to a straight line for a full rigid fit: the minor axis
    of its horizontal spread is under ``min_width_m``, so roll about the road is not fixed."""
    xy = trajectory.xyz[:, :2] - trajectory.xyz[:, :2].mean(axis=0)
    if len(xy) < 3:
        return True
    minor = float(np.linalg.svd(xy, compute_uv=False)[-1]) / np.sqrt(len(xy))
    return bool(minor < min_width_m)


def evaluate_map(
    source: MapProducts | MapVersion | str | os.PathLike[str],
    truth_dir: str | os.PathLike[str],
    *,
    drive: str | None = None,
    settings: EvalSettings | None = None,
    grid_reader: GridReader | None = None,
) -> EvalResult:
    """Evaluate a map against a synthetic truth directory (see the module docstring).

    ``source`` is loaded products, a :class:`MapVersion`, a map URI (its current version)
    or a version directory; ``drive`` names the map's drive that ``truth_dir`` belongs to
    (default: the one named like the truth directory, or the only one)."""
    cfg = settings or EvalSettings()
    products = (
        source
        if isinstance(source, MapProducts)
        else load_map_products(source, grid_reader=grid_reader)
    )
    truth = load_truth(truth_dir)
    name = _pick_drive(products, truth, drive)
    est = products.trajectories[name]
    try:
        ate = absolute_trajectory_error(est, truth.trajectory, yaw_only=_nearly_straight(est))
    except ValueError as err:
        raise HdmapError(
            f"{products.source}: trajectory {name!r} cannot be compared with "
            f"{truth_dir}: {err}; is this the truth of that drive?"
        ) from err
    align = ate.alignment
    lo, hi = truth.trajectory.span_ns
    in_span = est.t[(est.t >= lo) & (est.t <= hi)]
    ate_times = (in_span - truth.trajectory.t[0]).astype(np.float64) / _NS
    notes = list(products.notes)
    if drive is None and name != truth.name:
        notes.append(_unnamed_truth_note(truth.name, name))

    driven = np.vstack(
        [apply_alignment(tr.xyz, align)[:, :2] for tr in products.trajectories.values()]
    )
    driven_tree = cKDTree(driven)

    def near(radius: float) -> Callable[[F64], NDArray[np.bool_]]:
        def keep(points: F64) -> NDArray[np.bool_]:
            d, _ = driven_tree.query(np.asarray(points)[:, :2], distance_upper_bound=radius)
            return np.asarray(np.isfinite(d), dtype=np.bool_)

        return keep

    elevation = None
    elevation_note = ""
    if products.grid and truth.raster is not None:
        elevation = elevation_metrics(products.grid, truth.raster, align)
    elif truth.raster is None:
        elevation_note = "the truth has no raster.npz"
        notes.append(f"{elevation_note}: elevation not evaluated")
    else:
        elevation_note = "no grid"

    markings = signs = None
    if products.semantic:
        est_lines = [apply_alignment(p, align) for p in products.lane_markings]
        options = {"match_radius": cfg.marking_match_radius_m, "gate": cfg.marking_gate_m}
        # distances against all true paint (a stripe mapped from afar is no false line),
        # recovery against the paint the drive passed
        against_all = polyline_metrics(est_lines, truth.lane_markings, **options)
        observable = _clip(truth.lane_markings, near(cfg.coverage_radius_m))
        recovery = polyline_metrics(est_lines, observable, **options)
        markings = dataclasses.replace(
            against_all,
            recovered_fraction=recovery.recovered_fraction,
            truth_length_m=recovery.truth_length_m,
            recovered_length_m=recovery.recovered_length_m,
        )
        est_signs = apply_alignment(products.signs, align)
        dims = 3 if len(est_signs) and np.all(np.isfinite(est_signs[:, 2])) else 2
        seen = near(cfg.sign_range_m)(truth.signs) if len(truth.signs) else np.zeros(0, bool)
        # recall over the signs the drive passed; precision against every true sign
        recall_part = sign_metrics(
            est_signs[:, :dims], truth.signs[seen][:, :dims], radius=cfg.sign_match_radius_m
        )
        full = sign_metrics(
            est_signs[:, :dims],
            truth.signs[:, :dims],
            radius=cfg.sign_match_radius_m,
            estimate_types=products.sign_types,
            truth_types=truth.sign_types,
        )
        signs = dataclasses.replace(full, recall=recall_part.recall, true=recall_part.true)
        if dims == 2:
            notes.append("mapped signs carry no height: signs matched in the plane")

    def value(obj: Any, attr: str) -> float | None:
        return None if obj is None else float(getattr(obj, attr))

    metrics = (
        Metric("ate_rmse", ate.rmse, cfg.target_ate_rmse_m, "<=", "m"),
        Metric(
            "elevation_rmse",
            value(elevation, "rmse"),
            cfg.target_elevation_rmse_m,
            "<=",
            "m",
            elevation_note,
        ),
        Metric(
            "marking_mean_distance",
            value(markings, "mean_distance_m"),
            cfg.target_marking_mean_distance_m,
            "<=",
            "m",
            "" if markings is not None else "no semantic layer",
        ),
        Metric(
            "marking_recovered_fraction",
            value(markings, "recovered_fraction"),
            cfg.target_marking_recovered_fraction,
            ">=",
            "",
            "" if markings is not None else "no semantic layer",
        ),
        Metric(
            "sign_recall",
            value(signs, "recall"),
            cfg.target_sign_recall,
            ">=",
            "",
            "" if signs is not None else "no semantic layer",
        ),
        Metric(
            "sign_precision",
            value(signs, "precision"),
            cfg.target_sign_precision,
            ">=",
            "",
            "" if signs is not None else "no semantic layer",
        ),
    )
    result = EvalResult(
        drive=name,
        alignment=align,
        ate=ate,
        ate_times_s=ate_times,
        elevation=elevation,
        markings=markings,
        signs=signs,
        metrics=metrics,
        notes=tuple(notes),
        map_source=products.source,
        truth_dir=os.fspath(truth_dir),
    )
    _LOG.info(
        "evaluated %s against %s: %s",
        products.source,
        truth_dir,
        "pass" if result.passed else "FAIL",
    )
    return result
