"""Stage 4, lanes: lane markings, lane centre lines and road reference lines.

Input is the grid stage's 5 cm raster (:class:`GridLayers`: mean LiDAR intensity, ground
elevation and point count per cell, row 0 south, column 0 west, the synth truth raster's
layout) and the driven :class:`~adcloud.hdmap.trajectory.Trajectory`. Everything is in the
``map`` frame (ENU, metres).

Markings (:func:`extract_lane_markings`)
    1. *Paint cells.* Paint (reflectance 0.55-0.8) returns several times the intensity of the
       asphalt around it (0.07-0.11), whatever the range and incidence, while sidewalks
       (0.28) are brighter but wide. A cell is paint when its intensity is at least
       ``paint_contrast`` times the local background, the grey-scale *opening* of the layer
       with a ``background_window_m`` square (the brightest level that fills the whole
       window: narrow stripes drop out of it, wide surfaces stay). The opening ignores
       unobserved (NaN) cells, so it works on the sparse rings of a single drive.
    2. *Pieces.* Paint cells within ``link_radius_m`` of each other form a piece (this
       bridges unobserved cells). A piece is traced into an ordered polyline by geodesic
       distance from one of its ends (Dijkstra on the neighbour graph, SciPy), vertices
       being the centroids of ``vertex_spacing_m`` bins; a piece whose bins are not compact
       (a ring, a junction) is cut where it stops being a simple curve. Pieces wider than
       ``max_marking_width_m`` are not stripes and are dropped, and so are pieces whose two
       sides differ in elevation by more than ``max_step_m``: a curb's face and top return
       a bright narrow stripe too (seen head-on), but paint lies flat on the road.
    3. *Lines.* Piece ends are linked across gaps up to ``max_gap_m`` when both ends point at
       each other and the join is consistent with a circular arc (so dashes on curves link,
       while parallel lines, 3.5 m apart, never do); the gap is bridged with a cubic Hermite
       curve along the two end tangents. Each line is oriented along the trajectory.
    4. *Type.* Along each line, ``coverage`` is the share of the observed length that is
       painted: ``solid`` at or above ``solid_coverage``, else ``dashed``.

Lanes and reference lines (:func:`lane_centerlines`, :func:`reference_lines`)
    Stations every ``station_spacing_m`` along the trajectory (revisited stretches, as after
    a loop closure, are used once) carry a normal line; where markings cross it at a small
    angle, consecutive crossings ``lane_width_range_m`` apart bound a lane. The lane the car
    drove is the one containing the station; with ``right_hand_traffic`` its left marking
    divides the two directions of a two-way road (lanes beyond it run against the drive),
    and that divider is the road's reference line, bridged across intersections (gaps up to
    ``max_reference_gap_m``). Stations with the same set of bounding markings form a
    *section*, the unit the lanelet2 writer turns into lanelets with shared boundaries.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import scipy.sparse as sp
from numpy.typing import NDArray
from scipy import ndimage
from scipy.sparse.csgraph import connected_components, dijkstra
from scipy.spatial import cKDTree

from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.trajectory import Trajectory

__all__ = [
    "MARKING_TYPES",
    "GridLayers",
    "GridLookup",
    "LabelSettings",
    "LaneCenterline",
    "LaneMarking",
    "PaintCells",
    "ReferenceLine",
    "extract_lane_markings",
    "hermite_bridge",
    "lane_centerlines",
    "markings_from_paint",
    "paint_mask",
    "paint_mask_values",
    "paint_reach",
    "reference_lines",
    "resample_polyline",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]

#: Marking types: what the reflectance pattern tells (``unknown`` for imported labels only).
MARKING_TYPES = ("solid", "dashed", "unknown")


# -- inputs and settings ----------------------------------------------------------------------


@dataclass(frozen=True)
class GridLayers:
    """The grid layers stage 4 reads, all ``(rows, cols)``, row 0 south, column 0 west.

    ``origin`` is the map-frame ``(x, y)`` of the south-west corner of cell ``[0, 0]`` and
    ``resolution`` the cell edge (m): cell ``[i, j]`` covers
    ``x in origin_x + resolution * [j, j + 1)``, ``y in origin_y + resolution * [i, i + 1)``.
    ``reflectance``: mean LiDAR intensity of the ground points (the sensor's unit, NaN where
    unobserved); ``elevation``: their mean height (m, NaN where unobserved); ``count``: the
    points behind each cell (0 where unobserved).
    """

    origin: tuple[float, float]
    resolution: float
    reflectance: NDArray[np.float32]
    elevation: NDArray[np.float32]
    count: NDArray[np.int32]

    def __post_init__(self) -> None:
        refl = np.asarray(self.reflectance, dtype=np.float32)
        elev = np.asarray(self.elevation, dtype=np.float32)
        count = np.asarray(self.count)
        if refl.ndim != 2:
            raise HdmapError(f"GridLayers.reflectance must be 2-D (rows, cols), got {refl.shape}")
        for name, arr in (("elevation", elev), ("count", count)):
            if arr.shape != refl.shape:
                raise HdmapError(
                    f"GridLayers.{name} has shape {arr.shape} but reflectance has {refl.shape}; "
                    "all layers must cover the same cells"
                )
        if not np.issubdtype(count.dtype, np.integer):
            raise HdmapError(f"GridLayers.count must hold integers, got {count.dtype}")
        res = float(self.resolution)
        if not (math.isfinite(res) and res > 0):
            raise HdmapError(
                f"GridLayers.resolution must be a positive number of metres, got {res}"
            )
        ox, oy = (float(v) for v in self.origin)
        if not (math.isfinite(ox) and math.isfinite(oy)):
            raise HdmapError(f"GridLayers.origin must be finite, got {self.origin}")
        object.__setattr__(self, "reflectance", refl)
        object.__setattr__(self, "elevation", elev)
        object.__setattr__(self, "count", count.astype(np.int32, copy=False))
        object.__setattr__(self, "origin", (ox, oy))
        object.__setattr__(self, "resolution", res)

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)``."""
        rows, cols = self.reflectance.shape
        return int(rows), int(cols)

    @property
    def observed(self) -> NDArray[np.bool_]:
        """Cells with a finite intensity and at least one point."""
        return np.isfinite(self.reflectance) & (self.count > 0)

    def cells_of(self, xy: F64) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Row and column of the cells holding map-frame points ``xy`` (n, 2); may be outside."""
        pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
        col = np.floor((pts[:, 0] - self.origin[0]) / self.resolution).astype(np.int64)
        row = np.floor((pts[:, 1] - self.origin[1]) / self.resolution).astype(np.int64)
        return row, col

    def elevation_at(self, xy: F64) -> F64:
        """Ground elevation (m) of the cells under ``xy`` (n, 2); NaN outside or unobserved."""
        row, col = self.cells_of(xy)
        rows, cols = self.shape
        inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
        out = np.full(row.shape, np.nan)
        out[inside] = self.elevation[row[inside], col[inside]]
        return out

    def observed_at(self, row: NDArray[np.int64], col: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Whether the cells ``(row, col)`` (any shape, may be outside) were observed."""
        rows, cols = self.shape
        inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
        out = np.zeros(np.shape(row), dtype=bool)
        out[inside] = self.observed[row[inside], col[inside]]
        return out


class GridLookup(Protocol):
    """The grid as the marking and sign stages look it up once the paint cells are found:
    point lookups only, so that a map's layers need not be one array in memory
    (:class:`GridLayers` is one; :class:`~adcloud.hdmap.tilelayers.TileLayers` reads
    tiles as they are needed). Cells are indexed as in :class:`GridLayers`: ``origin``
    is the map-frame south-west corner of cell ``(0, 0)``, rows run north, columns east."""

    @property
    def origin(self) -> tuple[float, float]: ...

    @property
    def resolution(self) -> float: ...

    def cells_of(self, xy: F64) -> tuple[NDArray[np.int64], NDArray[np.int64]]: ...

    def elevation_at(self, xy: F64) -> F64: ...

    def observed_at(self, row: NDArray[np.int64], col: NDArray[np.int64]) -> NDArray[np.bool_]: ...


@dataclass(frozen=True)
class PaintCells:
    """The paint cells of a grid (see :func:`paint_mask`), in a :class:`GridLookup`'s cell
    indices: ``rows``, ``cols`` (n,) and the cells' ground elevation ``z`` (n,, m, NaN
    where unknown). Lookups (:meth:`contains`) go through one sorted key per cell."""

    rows: NDArray[np.int64]
    cols: NDArray[np.int64]
    z: F64

    def __post_init__(self) -> None:
        rows = np.asarray(self.rows, dtype=np.int64).ravel()
        cols = np.asarray(self.cols, dtype=np.int64).ravel()
        z = np.asarray(self.z, dtype=np.float64).ravel()
        if not len(rows) == len(cols) == len(z):
            raise HdmapError(
                f"PaintCells: rows ({len(rows)}), cols ({len(cols)}) and z ({len(z)}) "
                "must have one entry per cell"
            )
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "cols", cols)
        object.__setattr__(self, "z", z)
        object.__setattr__(self, "_keys", np.sort(_cell_keys(rows, cols)))

    def __len__(self) -> int:
        return len(self.rows)

    def contains(self, row: NDArray[np.int64], col: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Whether the cells ``(row, col)`` (same shape) are paint cells."""
        keys: NDArray[np.int64] = self._keys  # type: ignore[attr-defined]
        if not len(keys):
            return np.zeros(np.shape(row), dtype=bool)
        want = _cell_keys(np.asarray(row), np.asarray(col))
        at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
        found: NDArray[np.bool_] = keys[at] == want
        return found


#: Offset that keeps the cell keys of :class:`PaintCells` positive (cells within 2^30 of 0).
_KEY_SPAN = np.int64(1 << 30)


def _cell_keys(row: NDArray[np.int64], col: NDArray[np.int64]) -> NDArray[np.int64]:
    r = row.astype(np.int64) + _KEY_SPAN
    c = col.astype(np.int64) + _KEY_SPAN
    keys: NDArray[np.int64] = r * (2 * _KEY_SPAN) + c
    return keys


@dataclass(frozen=True)
class LabelSettings:
    """How markings, lanes and reference lines are extracted (metres; see the module doc).

    Paint: ``paint_contrast`` (intensity ratio to the local background) over a
    ``background_window_m`` square opening; only cells within ``max_offset_m`` of the
    trajectory are used (farther paint is seen at grazing incidence and rarely). Pieces:
    ``link_radius_m``, ``min_piece_cells``, ``max_marking_width_m``, ``vertex_spacing_m``;
    a piece whose two sides differ in elevation by more than ``max_step_m`` is the edge of a
    raised surface (a curb's top and face return bright, narrow stripes too), not paint.
    Lines: ``max_gap_m`` and ``max_link_angle_deg``/``max_link_offset_m`` for linking,
    ``min_marking_length_m``, ``solid_coverage``; ``marking_color`` is written on every
    extracted marking (LiDAR intensity does not tell paint colours apart). Lanes:
    ``station_spacing_m``, ``lane_width_range_m``, ``max_lateral_m`` (how far from the
    trajectory lanes are looked for), ``right_hand_traffic``, ``max_reference_gap_m``.
    """

    paint_contrast: float = 2.5
    background_window_m: float = 0.6
    max_offset_m: float = 12.0
    link_radius_m: float = 0.3
    min_piece_cells: int = 6
    max_marking_width_m: float = 0.4
    max_step_m: float = 0.06
    vertex_spacing_m: float = 0.5
    max_gap_m: float = 7.5
    max_link_angle_deg: float = 25.0
    max_link_offset_m: float = 0.3
    min_marking_length_m: float = 1.0
    solid_coverage: float = 0.7
    marking_color: str = "white"
    station_spacing_m: float = 1.0
    lane_width_range_m: tuple[float, float] = (2.5, 4.5)
    max_lateral_m: float = 9.0
    right_hand_traffic: bool = True
    max_reference_gap_m: float = 30.0

    def __post_init__(self) -> None:
        positive = {
            "paint_contrast": self.paint_contrast,
            "background_window_m": self.background_window_m,
            "max_offset_m": self.max_offset_m,
            "link_radius_m": self.link_radius_m,
            "max_marking_width_m": self.max_marking_width_m,
            "max_step_m": self.max_step_m,
            "vertex_spacing_m": self.vertex_spacing_m,
            "max_gap_m": self.max_gap_m,
            "max_link_angle_deg": self.max_link_angle_deg,
            "max_link_offset_m": self.max_link_offset_m,
            "station_spacing_m": self.station_spacing_m,
            "max_lateral_m": self.max_lateral_m,
        }
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise HdmapError(f"LabelSettings.{name} must be a positive number, got {value!r}")
        if self.paint_contrast <= 1:
            raise HdmapError(
                f"LabelSettings.paint_contrast must exceed 1 (paint is brighter than asphalt), "
                f"got {self.paint_contrast}"
            )
        if not 0 < self.solid_coverage <= 1:
            raise HdmapError(
                f"LabelSettings.solid_coverage must be in (0, 1], got {self.solid_coverage}"
            )
        lo, hi = self.lane_width_range_m
        if not 0 < lo < hi:
            raise HdmapError(
                f"LabelSettings.lane_width_range_m must be (min, max) with 0 < min < max, "
                f"got {self.lane_width_range_m}"
            )
        if self.min_piece_cells < 1:
            raise HdmapError("LabelSettings.min_piece_cells must be >= 1")


# -- outputs --------------------------------------------------------------------------------


def _points3(points: Any, what: str) -> F64:
    arr = np.asarray(points, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise HdmapError(f"{what}: points must be an (n, 3) array, got shape {arr.shape}")
    return arr


def _length(points: F64) -> float:
    if len(points) < 2:
        return 0.0
    return float(np.linalg.norm(np.diff(points[:, :2], axis=0), axis=1).sum())


@dataclass(frozen=True)
class LaneMarking:
    """A painted line: ``points`` (n, 3) map-frame metres along the stripe centre, gaps of a
    dashed line included, oriented along the trajectory that observed it.

    ``type`` is one of :data:`MARKING_TYPES`; ``coverage`` the painted share of its observed
    length (NaN when unknown); ``confidence`` (0-1) the observed share of its length;
    ``source`` ``auto`` (extracted), ``human`` or ``external`` (imported labels); ``id`` a
    name unique within its map; ``attributes`` any further properties (kept verbatim).
    """

    points: F64
    type: str = "solid"
    color: str = "white"
    width_m: float = 0.15
    coverage: float = float("nan")
    confidence: float = 1.0
    source: str = "auto"
    id: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", _points3(self.points, f"lane marking {self.id!r}"))

    @property
    def length_m(self) -> float:
        """Horizontal length of the polyline (m)."""
        return _length(self.points)


@dataclass(frozen=True)
class LaneCenterline:
    """The centre line of one lane (n, 3), in the lane's driving direction.

    ``left_boundary``/``right_boundary`` (n, 3) are the bounding markings sampled at the same
    stations (left and right as seen driving the lane); ``left_marking``/``right_marking``
    the ids of those markings; ``direction`` ``along`` or ``against`` the drive that
    observed it; ``section`` numbers the stretch of road whose lanes share boundaries (-1
    for imported lanes); ``width_m`` the mean lane width.
    """

    points: F64
    left_boundary: F64 = field(default_factory=lambda: np.zeros((0, 3)))
    right_boundary: F64 = field(default_factory=lambda: np.zeros((0, 3)))
    left_marking: str = ""
    right_marking: str = ""
    direction: str = "along"
    section: int = -1
    width_m: float = float("nan")
    source: str = "auto"
    id: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        what = f"lane centre line {self.id!r}"
        object.__setattr__(self, "points", _points3(self.points, what))
        left = _points3(np.asarray(self.left_boundary).reshape(-1, 3), what)
        right = _points3(np.asarray(self.right_boundary).reshape(-1, 3), what)
        object.__setattr__(self, "left_boundary", left)
        object.__setattr__(self, "right_boundary", right)

    @property
    def length_m(self) -> float:
        """Horizontal length of the centre line (m)."""
        return _length(self.points)

    @property
    def has_boundaries(self) -> bool:
        """Whether both boundaries are known (extracted lanes; imported ones may lack them)."""
        return len(self.left_boundary) >= 2 and len(self.right_boundary) >= 2


@dataclass(frozen=True)
class ReferenceLine:
    """A road's reference line (n, 3): the line dividing its two directions, oriented along
    the drive that observed it."""

    points: F64
    source: str = "auto"
    id: str = ""
    attributes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", _points3(self.points, f"reference line {self.id!r}"))

    @property
    def length_m(self) -> float:
        """Horizontal length (m)."""
        return _length(self.points)


# -- the driven path ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Path:
    """The driven path resampled by arclength: ``xyz`` (n, 3), unit ``tangent`` (n, 2),
    ``first`` (n,) False where the station revisits a stretch driven before (earlier in the
    same drive, or by an earlier drive), ``piece`` (n,) the drive each station belongs to
    (stations of one drive are consecutive)."""

    xyz: F64
    tangent: F64
    first: NDArray[np.bool_]
    piece: NDArray[np.int64]


def resample_polyline(points: F64, spacing: float) -> F64:
    """``points`` (n, k >= 2) resampled at equal steps of at most ``spacing`` m of horizontal
    (x, y) arclength, both ends kept; other columns are interpolated linearly."""
    if len(points) < 2:
        return points.copy()
    seg = np.linalg.norm(np.diff(points[:, :2], axis=0), axis=1)
    s = np.concatenate([[0.0], np.cumsum(seg)])
    keep = np.concatenate([[True], seg > 1e-9])
    s, pts = s[keep], points[keep]
    if s[-1] <= 0:
        return points[:1].copy()
    n = max(2, math.ceil(s[-1] / spacing) + 1)
    q = np.linspace(0.0, s[-1], n)
    return np.stack([np.interp(q, s, pts[:, k]) for k in range(points.shape[1])], axis=1)


def _tangents(xy: F64, half_window: int) -> F64:
    n = len(xy)
    lo = np.clip(np.arange(n) - half_window, 0, n - 1)
    hi = np.clip(np.arange(n) + half_window, 0, n - 1)
    d = xy[hi] - xy[lo]
    norm = np.linalg.norm(d, axis=1, keepdims=True)
    out: F64 = d / np.maximum(norm, 1e-12)
    return out


Driven = Trajectory | Sequence[Trajectory]


def _driven_path(driven: Driven, spacing: float, cover_m: float = 4.5) -> _Path:
    """The path of one drive or of several drives one after another (each resampled and
    differentiated on its own): a map of many drives of the same roads gets each road's
    markings and lanes once, from the first drive that covered it. A station is covered by
    an earlier drive that passed within ``cover_m`` (that drive's station saw the same
    cross-section of the road, the opposite lanes included)."""
    trajectories = [driven] if isinstance(driven, Trajectory) else list(driven)
    if not trajectories:
        raise HdmapError("labels: no trajectory; lanes need a driven path")
    parts, tangents = [], []
    for trajectory in trajectories:
        if len(trajectory) < 2:
            raise HdmapError(
                f"labels: a trajectory has {len(trajectory)} pose(s); lanes need a driven path "
                "(at least two poses)"
            )
        xyz = resample_polyline(trajectory.xyz, spacing)
        if len(xyz) < 2:
            raise HdmapError("labels: a trajectory does not move; lanes need a driven path")
        parts.append(xyz)
        tangents.append(_tangents(xyz[:, :2], max(1, round(2.0 / spacing))))
    xyz = np.concatenate(parts)
    piece = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    # A station revisits the road when, within `near` m, a station came at least `gap` m of
    # driving earlier in the same drive (after a loop closure the same lanes would come
    # twice), or when an earlier drive passed within `cover_m`.
    near, gap = 2.0, 20.0
    lag = round(gap / spacing)
    tree = cKDTree(xyz[:, :2])
    balls = tree.query_ball_point(xyz[:, :2], near)
    earliest = np.fromiter((min(b) for b in balls), dtype=np.int64, count=len(xyz))
    first = earliest > np.arange(len(xyz)) - lag
    if len(parts) > 1:
        wide = tree.query_ball_point(xyz[:, :2], max(cover_m, near))
        before = np.fromiter((piece[min(b)] for b in wide), dtype=np.int64, count=len(xyz))
        first &= before == piece
    return _Path(xyz=xyz, tangent=np.concatenate(tangents), first=first, piece=piece)


# -- paint cells ----------------------------------------------------------------------------


def _odd(n: float) -> int:
    k = max(3, round(n))
    return k if k % 2 else k + 1


def paint_mask(layers: GridLayers, settings: LabelSettings) -> NDArray[np.bool_]:
    """Cells whose intensity is ``paint_contrast`` times the local background (see the
    module docstring); unobserved cells are never paint."""
    values = np.where(layers.observed, layers.reflectance, np.float32(np.nan))
    return paint_mask_values(values, settings, layers.resolution)


def paint_reach(settings: LabelSettings, resolution: float) -> int:
    """How many cells away a cell's paint test looks (the opening's erosion and dilation
    each reach half the window): a window of a larger grid that extends this far beyond a
    region gives the region's paint cells exactly as the whole grid would."""
    return 2 * (_odd(settings.background_window_m / resolution) // 2)


def paint_mask_values(
    values: NDArray[np.float32], settings: LabelSettings, resolution: float
) -> NDArray[np.bool_]:
    """:func:`paint_mask` of a reflectance array (rows, cols) with NaN where unobserved."""
    observed = np.isfinite(values)
    size = _odd(settings.background_window_m / resolution)
    # NaN-aware grey opening: unobserved cells neither lower the erosion nor raise the
    # dilation. A window with no observed cell has no background (and no paint).
    eroded = ndimage.minimum_filter(np.where(observed, values, np.inf), size=size)
    eroded = np.where(np.isfinite(eroded), eroded, -np.inf)
    background = ndimage.maximum_filter(eroded, size=size)
    floor = np.float32(1e-6)
    with np.errstate(invalid="ignore"):
        mask: NDArray[np.bool_] = (
            observed
            & np.isfinite(background)
            & (values >= settings.paint_contrast * np.maximum(background, floor))
        )
    return mask


# -- pieces ---------------------------------------------------------------------------------


@dataclass
class _Piece:
    """An ordered polyline traced through one cluster of paint cells."""

    points: F64  # (m, 3)
    cells: int
    width: float

    @property
    def length(self) -> float:
        return _length(self.points)

    def end_direction(self, at_start: bool, span: float = 1.5) -> F64:
        """Unit direction pointing *out of* the piece at one end (2,)."""
        pts = self.points[:, :2] if not at_start else self.points[::-1, :2]
        # walk back from the end until `span` m of polyline are covered
        seg = np.linalg.norm(np.diff(pts, axis=0), axis=1)
        acc = np.cumsum(seg[::-1])
        k = int(np.searchsorted(acc, span))
        base = pts[max(0, len(pts) - 2 - k)]
        d = pts[-1] - base
        norm = float(np.linalg.norm(d))
        return d / norm if norm > 1e-9 else np.array([1.0, 0.0])


def _graph(xy: F64, radius: float) -> sp.csr_matrix:
    n = len(xy)
    pairs = cKDTree(xy).query_pairs(radius, output_type="ndarray")
    if len(pairs) == 0:
        return sp.csr_matrix((n, n))
    w = np.linalg.norm(xy[pairs[:, 0]] - xy[pairs[:, 1]], axis=1)
    w = np.maximum(w, 1e-6)
    return sp.coo_matrix((w, (pairs[:, 0], pairs[:, 1])), shape=(n, n)).tocsr()


def _components(xy: F64, radius: float) -> list[NDArray[np.int64]]:
    if len(xy) == 0:
        return []
    _, labels = connected_components(_graph(xy, radius), directed=False)
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    return [np.asarray(g, dtype=np.int64) for g in np.split(order, bounds)]


def _trace(xy: F64, z: F64, settings: LabelSettings, depth: int = 0) -> list[_Piece]:
    """Ordered polylines through one connected cluster of paint cells (see module doc)."""
    n = len(xy)
    if n < settings.min_piece_cells:
        return []
    graph = _graph(xy, settings.link_radius_m)
    d0 = dijkstra(graph, directed=False, indices=0)
    a = int(np.argmax(np.where(np.isfinite(d0), d0, -1.0)))
    g = dijkstra(graph, directed=False, indices=a)
    g = np.where(np.isfinite(g), g, 0.0)
    step = settings.vertex_spacing_m
    bins = np.floor(g / step).astype(np.int64)
    nb = int(bins.max()) + 1
    count = np.bincount(bins, minlength=nb).astype(np.float64)
    cx = np.bincount(bins, weights=xy[:, 0], minlength=nb) / np.maximum(count, 1)
    cy = np.bincount(bins, weights=xy[:, 1], minlength=nb) / np.maximum(count, 1)
    spread = np.zeros(nb)
    np.maximum.at(spread, bins, np.hypot(xy[:, 0] - cx[bins], xy[:, 1] - cy[bins]))
    # A bin of a simple stripe holds cells within about half a bin of its centroid (along)
    # and half a stripe (across); 0.6 m means two arms of a ring or a junction.
    bad = np.flatnonzero((spread > 0.6) & (count > 0))
    if len(bad) and depth < 4:
        # Not a simple curve from `a` (a ring, or a junction of lines): keep what comes
        # before the first non-compact bin and trace what lies beyond it again.
        cut = bad[0] * step
        before = g < cut - 0.5
        after = g > cut + step + 0.5
        pieces: list[_Piece] = []
        if before.sum() >= settings.min_piece_cells:
            pieces += _trace(xy[before], z[before], settings, depth + 1)
        rest = np.flatnonzero(after)
        for group in _components(xy[rest], settings.link_radius_m):
            idx = rest[group]
            pieces += _trace(xy[idx], z[idx], settings, depth + 1)
        return pieces
    if len(bad):
        log.debug("labels: dropped a paint cluster of %d cells that is not a simple line", n)
        return []
    used = count > 0
    zz = np.where(np.isfinite(z), z, 0.0)
    zc = np.bincount(bins, weights=zz, minlength=nb)
    zn = np.bincount(bins, weights=np.isfinite(z).astype(np.float64), minlength=nb)
    with np.errstate(invalid="ignore", divide="ignore"):
        cz = np.where(zn > 0, zc / zn, np.nan)
    pts = np.stack([cx[used], cy[used], cz[used]], axis=1)
    pts = _extend_ends(pts, xy[a], xy[int(np.argmax(g))])
    width = _stripe_width(xy, pts)
    return [_Piece(points=pts, cells=n, width=width)]


def _extend_ends(pts: F64, first: F64, last: F64) -> F64:
    """Prolong the centroid polyline to the projections of the extreme cells (a bin's
    centroid lies half a bin inside the end of the paint)."""
    if len(pts) < 2:
        return np.vstack([[*first, pts[0, 2]], [*last, pts[0, 2]]]) if len(pts) else pts
    out = [pts]
    t0 = pts[0, :2] - pts[1, :2]
    t0 /= max(float(np.linalg.norm(t0)), 1e-12)
    ext0 = float((first - pts[0, :2]) @ t0)
    if ext0 > 1e-3:
        out.insert(0, np.array([[*(pts[0, :2] + ext0 * t0), pts[0, 2]]]))
    t1 = pts[-1, :2] - pts[-2, :2]
    t1 /= max(float(np.linalg.norm(t1)), 1e-12)
    ext1 = float((last - pts[-1, :2]) @ t1)
    if ext1 > 1e-3:
        out.append(np.array([[*(pts[-1, :2] + ext1 * t1), pts[-1, 2]]]))
    return np.vstack(out)


def _stripe_width(xy: F64, polyline: F64) -> float:
    """Width of the stripe: a uniform spread of width w has RMS lateral offset w / sqrt(12)."""
    dense = resample_polyline(polyline[:, :2], 0.02)
    dist, _ = cKDTree(dense).query(xy)
    return float(math.sqrt(12.0 * float(np.mean(dist**2))))


def _side_step(points: F64, layers: GridLookup) -> float:
    """Median over 2 m stretches of a polyline of the difference (m) between the median
    ground elevation on its left and on its right, 0.15-0.45 m to either side (local, so
    that the road's grade does not count); 0 where no stretch shows 3 values on each side."""
    dense = resample_polyline(points[:, :2], 0.05)
    if len(dense) < 2:
        return 0.0
    t = _tangents(dense, 2)
    n = np.column_stack([-t[:, 1], t[:, 0]])
    stretch = np.arange(len(dense)) // 40
    offsets = (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45)
    # one lookup for both sides and every offset (a tiled grid groups it by tile)
    probes = [dense + sign * off * n for sign in (1.0, -1.0) for off in offsets]
    z_sides = layers.elevation_at(np.concatenate(probes)).reshape(2, -1)
    k_all = np.tile(stretch, len(offsets))
    sides: list[tuple[F64, NDArray[np.int64]]] = []
    for z_all in z_sides:
        good = np.isfinite(z_all)
        sides.append((z_all[good], k_all[good]))
    (zl, kl), (zr, kr) = sides
    steps = []
    for k in np.intersect1d(kl, kr):
        left, right = zl[kl == k], zr[kr == k]
        if len(left) >= 3 and len(right) >= 3:
            steps.append(abs(float(np.median(left)) - float(np.median(right))))
    return float(np.median(steps)) if steps else 0.0


# -- linking pieces into lines ----------------------------------------------------------------


def _signed_angle(u: F64, v: F64) -> float:
    return float(math.atan2(u[0] * v[1] - u[1] * v[0], u[0] * v[0] + u[1] * v[1]))


def _link_cost(
    pa: F64, ua: F64, pb: F64, ub: F64, road_normal: F64 | None, settings: LabelSettings
) -> float | None:
    """Cost of joining end ``a`` (position, outward direction) to end ``b``; None if the
    two ends cannot belong to one line. ``road_normal`` is the driven path's normal next to
    the gap, when the gap lies beside the path."""
    chord = pb - pa
    gap = float(np.linalg.norm(chord))
    if gap > settings.max_gap_m:
        return None
    if gap < 1e-6:
        return 0.0
    c = chord / gap
    alpha1 = _signed_angle(ua, c)  # turn from a's heading onto the chord
    alpha2 = _signed_angle(c, -ub)  # turn from the chord onto b's heading
    limit = math.radians(settings.max_link_angle_deg)
    if gap > 1.0 and (abs(alpha1) > limit or abs(alpha2) > limit):
        return None
    if gap > settings.link_radius_m and max(abs(alpha1), abs(alpha2)) > math.pi / 2:
        # Up to 1 m a short piece's heading is too noisy to hold to the angle limit, but an
        # end whose partner lies behind it would fold the line back on itself (a 0.5 m piece
        # in a gap would take the far piece's end and leave the near one unlinked).
        return None
    if road_normal is not None and abs(float(c @ road_normal)) < math.sin(limit):
        # Along the road: both ends must keep the same offset from the driven path, which
        # follows the road's curves (and its transitions from arcs to straights).
        offset = abs(float(chord @ road_normal))
    else:
        # Elsewhere: on a circular arc the chord bisects the turn (alpha1 == alpha2); the
        # mismatch is the lateral offset between the two ends' lines.
        offset = gap * abs(math.sin((alpha1 - alpha2) / 2))
    if offset > settings.max_link_offset_m:
        return None
    return gap + 10.0 * offset


def hermite_bridge(pa: F64, ta: F64, pb: F64, tb: F64, step: float) -> F64:
    """Points strictly between ``pa`` and ``pb`` (3-D), about ``step`` apart, on the cubic
    Hermite curve with unit horizontal tangents ``ta``/``tb``.

    The tangents are scaled by the chord length over cos^2(turn / 4): with that length the
    curve between two points of a circular arc stays on the arc to 0.03 % of the radius
    for a 90-degree turn (the chord length alone strays by 0.45 %, 12 cm on a 50-degree
    turn of a 27 m radius lane), and a straight gap is unchanged."""
    gap = float(np.linalg.norm(pb[:2] - pa[:2]))
    k = int(gap // step)
    if k < 1:
        return np.zeros((0, 3))
    scale = gap / math.cos(_signed_angle(ta, tb) / 4) ** 2
    s = np.arange(1, k + 1) / (k + 1)
    h00 = 2 * s**3 - 3 * s**2 + 1
    h10 = s**3 - 2 * s**2 + s
    h01 = -2 * s**3 + 3 * s**2
    h11 = s**3 - s**2
    xy = (
        h00[:, None] * pa[:2]
        + h10[:, None] * (scale * ta)
        + h01[:, None] * pb[:2]
        + h11[:, None] * (scale * tb)
    )
    z = pa[2] + s * (pb[2] - pa[2])
    return np.column_stack([xy, z])


def _link(
    pieces: list[_Piece], path: _Path, path_tree: cKDTree, settings: LabelSettings
) -> list[list[tuple[int, bool]]]:
    """Chains of ``(piece, reversed)``: greedy matching of piece ends by cost, no cycles."""
    ends: list[tuple[int, bool, F64, F64]] = []  # piece, at_start, position, outward
    for i, p in enumerate(pieces):
        ends.append((i, True, p.points[0, :2], p.end_direction(at_start=True)))
        ends.append((i, False, p.points[-1, :2], p.end_direction(at_start=False)))
    if not ends:
        return []
    pos = np.array([e[2] for e in ends])
    tree = cKDTree(pos)
    candidates: list[tuple[float, int, int]] = []
    for a, b in tree.query_pairs(settings.max_gap_m):
        if ends[a][0] == ends[b][0]:
            continue
        mid = (ends[a][2] + ends[b][2]) / 2
        dist, k = path_tree.query(mid)
        normal = None
        if dist <= settings.max_lateral_m:
            t = path.tangent[k]
            normal = np.array([-t[1], t[0]])
        cost = _link_cost(ends[a][2], ends[a][3], ends[b][2], ends[b][3], normal, settings)
        if cost is not None:
            candidates.append((cost, a, b))
    candidates.sort()
    partner = [-1] * len(ends)
    root = list(range(len(pieces)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for _, a, b in candidates:
        if partner[a] >= 0 or partner[b] >= 0:
            continue
        ra, rb = find(ends[a][0]), find(ends[b][0])
        if ra == rb:
            continue
        partner[a], partner[b] = b, a
        root[ra] = rb
    chains: list[list[tuple[int, bool]]] = []
    seen = [False] * len(pieces)
    for i in range(len(pieces)):
        if seen[i]:
            continue
        # walk to one free end of this chain, then along it
        start_end = 2 * i
        cur = start_end
        visited = 0
        while partner[cur] >= 0 and visited <= len(pieces):
            nxt = partner[cur]
            cur = nxt ^ 1  # the other end of the next piece
            visited += 1
        chain: list[tuple[int, bool]] = []
        end = cur
        while True:
            piece = end // 2
            seen[piece] = True
            # entering at `end`: the piece runs from this end to the other one
            chain.append((piece, end % 2 == 1))
            out = end ^ 1
            if partner[out] < 0:
                break
            end = partner[out]
        chains.append(chain)
    return chains


def _chain_points(pieces: list[_Piece], chain: list[tuple[int, bool]], step: float) -> F64:
    parts: list[F64] = []
    prev: F64 | None = None
    for piece_index, rev in chain:
        pts = pieces[piece_index].points
        pts = pts[::-1] if rev else pts
        if prev is not None:
            ta = prev[-1, :2] - prev[-2, :2] if len(prev) > 1 else pts[0, :2] - prev[-1, :2]
            tb = pts[1, :2] - pts[0, :2] if len(pts) > 1 else pts[0, :2] - prev[-1, :2]
            ta = ta / max(float(np.linalg.norm(ta)), 1e-12)
            tb = tb / max(float(np.linalg.norm(tb)), 1e-12)
            parts.append(hermite_bridge(prev[-1], ta, pts[0], tb, step))
        parts.append(pts)
        prev = pts
    return np.vstack(parts)


# -- coverage and orientation ------------------------------------------------------------------


def _coverage(points: F64, layers: GridLookup, paint: PaintCells) -> tuple[float, float]:
    """``(painted share of the observed length, observed share of the length)`` sampled
    every 0.1 m, looking at the 5 x 5 cells around each sample."""
    dense = resample_polyline(points[:, :2], 0.1)
    row, col = layers.cells_of(dense)
    shifts = np.arange(-2, 3)
    # (5, 5, n): every sample's 5 x 5 neighbourhood, looked up at once
    r = row[None, None, :] + shifts[:, None, None]
    c = col[None, None, :] + shifts[None, :, None]
    r, c = np.broadcast_arrays(r, c)
    seen = layers.observed_at(r.ravel(), c.ravel()).reshape(25, -1).any(axis=0)
    painted = paint.contains(r.ravel(), c.ravel()).reshape(25, -1).any(axis=0)
    n_seen = int(seen.sum())
    observed_share = n_seen / max(len(dense), 1)
    if n_seen == 0:
        return float("nan"), 0.0
    return float((painted & seen).sum() / n_seen), float(observed_share)


def _fill_z(points: F64, layers: GridLookup) -> F64:
    out = points.copy()
    bad = ~np.isfinite(out[:, 2])
    if bad.any():
        out[bad, 2] = layers.elevation_at(out[bad, :2])
        bad = ~np.isfinite(out[:, 2])
    if bad.all():
        out[:, 2] = 0.0
    elif bad.any():
        s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(out[:, :2], axis=0), axis=1))])
        out[bad, 2] = np.interp(s[bad], s[~bad], out[~bad, 2])
    return out


def _orient(points: F64, path: _Path, tree: cKDTree) -> F64:
    """Reverse ``points`` if they run against the nearest stretch of the driven path."""
    if len(points) < 2:
        return points
    d = np.gradient(points[:, :2], axis=0)
    _, idx = tree.query(points[:, :2])
    along = float(np.sum(d * path.tangent[idx]))
    return points[::-1].copy() if along < 0 else points


# -- markings -------------------------------------------------------------------------------


def extract_lane_markings(
    layers: GridLayers, trajectory: Driven, settings: LabelSettings | None = None
) -> list[LaneMarking]:
    """Lane markings found in ``layers`` near ``trajectory`` (see the module docstring; a
    sequence of trajectories: the drives of a map, each road's markings once).

    Polylines are map-frame metres with vertices about ``vertex_spacing_m`` apart (z from
    the elevation layer), oriented along the driving direction; ids are ``marking-<n>``.
    """
    settings = settings or LabelSettings()
    rows, cols = np.nonzero(paint_mask(layers, settings))
    paint = PaintCells(rows, cols, layers.elevation[rows, cols].astype(np.float64))
    return markings_from_paint(layers, paint, trajectory, settings)


def markings_from_paint(
    layers: GridLookup,
    paint: PaintCells,
    trajectory: Driven,
    settings: LabelSettings | None = None,
) -> list[LaneMarking]:
    """:func:`extract_lane_markings` from paint cells found beforehand (on executors, tile
    by tile: :mod:`adcloud.hdmap.job`), looking the grid up through ``layers``.

    ``paint`` must hold at least the paint cells within ``max_offset_m`` of the trajectory
    and the 5 x 5 cells around the lines they form; farther ones are ignored."""
    settings = settings or LabelSettings()
    path = _driven_path(trajectory, 0.5)
    path_tree = cKDTree(path.xyz[:, :2])
    res = layers.resolution
    xy = np.column_stack(
        [layers.origin[0] + (paint.cols + 0.5) * res, layers.origin[1] + (paint.rows + 0.5) * res]
    )
    dist, _ = path_tree.query(xy, distance_upper_bound=settings.max_offset_m)
    near = np.isfinite(dist)
    xy, z = xy[near], paint.z[near]
    log.info(
        "labels: %d paint cells within %.1f m of the trajectory", len(xy), settings.max_offset_m
    )

    pieces: list[_Piece] = []
    curbs = 0
    for group in _components(xy, settings.link_radius_m):
        if len(group) < settings.min_piece_cells:
            continue
        for piece in _trace(xy[group], z[group], settings):
            if piece.width > settings.max_marking_width_m or len(piece.points) < 2:
                continue
            if _side_step(piece.points, layers) > settings.max_step_m:
                curbs += 1
                continue
            pieces.append(piece)
    log.info("labels: %d paint pieces, %d bright steps (curbs) left out", len(pieces), curbs)
    chains = _link(pieces, path, path_tree, settings)
    markings: list[LaneMarking] = []
    for chain in chains:
        pts = _chain_points(pieces, chain, settings.vertex_spacing_m)
        pts = resample_polyline(pts, settings.vertex_spacing_m)
        if _length(pts) < settings.min_marking_length_m:
            continue
        pts = _orient(_fill_z(pts, layers), path, path_tree)
        coverage, seen = _coverage(pts, layers, paint)
        kind = "solid" if not coverage < settings.solid_coverage else "dashed"
        cells = sum(pieces[i].cells for i, _ in chain)
        width = sum(pieces[i].width * pieces[i].cells for i, _ in chain) / max(cells, 1)
        markings.append(
            LaneMarking(
                points=pts,
                type=kind,
                color=settings.marking_color,
                width_m=round(float(width), 3),
                coverage=coverage,
                confidence=seen,
                source="auto",
                id=f"marking-{len(markings)}",
            )
        )
    log.info(
        "labels: %d markings (%d solid, %d dashed) from %d pieces",
        len(markings),
        sum(m.type == "solid" for m in markings),
        sum(m.type == "dashed" for m in markings),
        len(pieces),
    )
    return markings


# -- lanes and reference lines ----------------------------------------------------------------


@dataclass(frozen=True)
class _Crossing:
    lateral: float  # signed offset along the station normal (left positive), m
    marking: int
    point: F64  # (3,)


def _crossings(
    markings: Sequence[LaneMarking], path: _Path, settings: LabelSettings
) -> list[list[_Crossing]]:
    """Per station: the markings crossing its normal within ``max_lateral_m``, sorted."""
    n = len(path.xyz)
    out: list[list[_Crossing]] = [[] for _ in range(n)]
    centre = path.xyz[:, :2]
    t = path.tangent
    normal = np.column_stack([-t[:, 1], t[:, 0]])
    cos_max = math.cos(math.radians(30.0))
    for mi, m in enumerate(markings):
        pts = m.points
        if len(pts) < 2:
            continue
        seg = pts[1:, :2] - pts[:-1, :2]
        seg_len = np.linalg.norm(seg, axis=1)
        # (station, segment) pairs whose segment starts within reach of the station
        reach = settings.max_lateral_m + float(seg_len.max())
        balls = cKDTree(pts[:-1, :2]).query_ball_point(centre, reach)
        sizes = np.fromiter((len(b) for b in balls), dtype=np.int64, count=n)
        if not sizes.sum():
            continue
        st = np.repeat(np.arange(n), sizes)
        si = np.concatenate([np.asarray(b, dtype=np.int64) for b in balls if b])
        a0 = np.einsum("kj,kj->k", pts[si, :2] - centre[st], t[st])
        a1 = np.einsum("kj,kj->k", pts[si + 1, :2] - centre[st], t[st])
        parallel = np.abs(np.einsum("kj,kj->k", seg[si], t[st])) >= cos_max * seg_len[si]
        hit = (np.signbit(a0) != np.signbit(a1)) & parallel & (seg_len[si] > 1e-9)
        st, si, a0, a1 = st[hit], si[hit], a0[hit], a1[hit]
        f = a0 / (a0 - a1)
        point = pts[si] + f[:, None] * (pts[si + 1] - pts[si])
        lateral = np.einsum("kj,kj->k", point[:, :2] - centre[st], normal[st])
        for k in np.flatnonzero(np.abs(lateral) <= settings.max_lateral_m):
            out[int(st[k])].append(_Crossing(float(lateral[k]), mi, point[k]))
    for row in out:
        row.sort(key=lambda c: c.lateral)
        # one crossing per marking: the nearest to the path
        seen: dict[int, _Crossing] = {}
        for c in row:
            if c.marking not in seen or abs(c.lateral) < abs(seen[c.marking].lateral):
                seen[c.marking] = c
        row[:] = sorted(seen.values(), key=lambda c: c.lateral)
    return out


@dataclass(frozen=True)
class _StationLanes:
    """Lanes at one station: ``pairs`` of crossing indices (right, left in path terms) and
    the index of the divider crossing (-1 if the driven lane is not bounded here)."""

    pairs: tuple[tuple[int, int], ...]
    divider: int


def _station_lanes(row: list[_Crossing], settings: LabelSettings) -> _StationLanes:
    lo, hi = settings.lane_width_range_m
    pairs = tuple(
        (k, k + 1) for k in range(len(row) - 1) if lo <= row[k + 1].lateral - row[k].lateral <= hi
    )
    divider = -1
    for a, b in pairs:
        if row[a].lateral < 0 < row[b].lateral:
            divider = b if settings.right_hand_traffic else a
    return _StationLanes(pairs, divider)


def _analyse(
    markings: Sequence[LaneMarking], trajectory: Driven, settings: LabelSettings
) -> tuple[_Path, list[list[_Crossing]], list[_StationLanes]]:
    path = _driven_path(trajectory, settings.station_spacing_m, settings.max_lateral_m / 2)
    rows = _crossings(markings, path, settings)
    lanes = [_station_lanes(r, settings) for r in rows]
    return path, rows, lanes


def lane_centerlines(
    markings: Sequence[LaneMarking],
    trajectory: Driven,
    settings: LabelSettings | None = None,
) -> list[LaneCenterline]:
    """Lanes between adjacent markings along ``trajectory`` (see the module docstring; a
    sequence of trajectories: the drives of a map, each road's lanes once).

    Each lane of each section becomes one :class:`LaneCenterline` with its two boundaries,
    in its driving direction (``against`` lanes run opposite to the drive). Ids are
    ``lane-<section>-<k>``; ``left_marking``/``right_marking`` name the markings' ids.
    """
    settings = settings or LabelSettings()
    path, rows, lanes = _analyse(markings, trajectory, settings)
    # A section: consecutive first-visit stations whose lanes are bounded by the same
    # markings, with a known divider (so every lane has a direction).
    keys: list[tuple[tuple[int, int], ...] | None] = []
    for i, (row, st) in enumerate(zip(rows, lanes, strict=True)):
        if not path.first[i] or st.divider < 0 or not st.pairs:
            keys.append(None)
            continue
        div = row[st.divider].marking
        keys.append((*((row[a].marking, row[b].marking) for a, b in st.pairs), (div, -1)))
    out: list[LaneCenterline] = []
    section = 0
    i = 0
    while i < len(keys):
        key = keys[i]
        if key is None:
            i += 1
            continue
        j = i
        while j + 1 < len(keys) and keys[j + 1] == key and path.piece[j + 1] == path.piece[j]:
            j += 1
        if j > i:
            out.extend(_section_lanes(rows, lanes, range(i, j + 1), section, markings, settings))
            section += 1
        i = j + 1
    log.info("labels: %d lane centre lines in %d sections", len(out), section)
    return out


def _section_lanes(
    rows: list[list[_Crossing]],
    lanes: list[_StationLanes],
    stations: range,
    section: int,
    markings: Sequence[LaneMarking],
    settings: LabelSettings,
) -> list[LaneCenterline]:
    first = stations[0]
    row0, st0 = rows[first], lanes[first]
    divider_lateral = row0[st0.divider].lateral
    out: list[LaneCenterline] = []
    for k, (a0, b0) in enumerate(st0.pairs):
        right_id, left_id = row0[a0].marking, row0[b0].marking
        right_pts, left_pts = [], []
        for s in stations:
            by_marking = {c.marking: c for c in rows[s]}
            right_pts.append(by_marking[right_id].point)
            left_pts.append(by_marking[left_id].point)
        right = np.asarray(right_pts)
        left = np.asarray(left_pts)
        centre_lateral = (row0[a0].lateral + row0[b0].lateral) / 2
        with_drive = centre_lateral < divider_lateral
        if not settings.right_hand_traffic:
            with_drive = centre_lateral > divider_lateral
        if with_drive:
            lb, rb, lm, rm = left, right, left_id, right_id
        else:
            # driving the other way: reversed, and its left is the path's right
            lb, rb, lm, rm = right[::-1], left[::-1], right_id, left_id
        centre = (lb + rb) / 2
        width = float(np.mean(np.linalg.norm(lb[:, :2] - rb[:, :2], axis=1)))
        out.append(
            LaneCenterline(
                points=centre,
                left_boundary=lb,
                right_boundary=rb,
                left_marking=markings[lm].id,
                right_marking=markings[rm].id,
                direction="along" if with_drive else "against",
                section=section,
                width_m=round(width, 3),
                source="auto",
                id=f"lane-{section}-{k}",
            )
        )
    return out


def reference_lines(
    markings: Sequence[LaneMarking],
    trajectory: Driven,
    settings: LabelSettings | None = None,
) -> list[ReferenceLine]:
    """The road reference line(s) along ``trajectory``: the marking dividing the two
    directions (see the module docstring), bridged across gaps up to
    ``max_reference_gap_m`` by interpolating its lateral offset from the path."""
    settings = settings or LabelSettings()
    path, rows, lanes = _analyse(markings, trajectory, settings)
    n = len(path.xyz)
    lateral = np.full(n, np.nan)
    z = np.full(n, np.nan)
    for i, (row, st) in enumerate(zip(rows, lanes, strict=True)):
        if path.first[i] and st.divider >= 0:
            lateral[i] = row[st.divider].lateral
            z[i] = row[st.divider].point[2]
    known = np.flatnonzero(np.isfinite(lateral))
    out: list[ReferenceLine] = []
    if not len(known):
        return out
    max_gap = max(1, round(settings.max_reference_gap_m / settings.station_spacing_m))
    # split where the gap is too long, the path revisits (not first) or another drive starts
    breaks = np.flatnonzero(
        (np.diff(known) > max_gap)
        | ~_all_first_between(path.first, known)
        | (np.diff(path.piece[known]) != 0)
    )
    groups = np.split(known, breaks + 1)
    normal = np.column_stack([-path.tangent[:, 1], path.tangent[:, 0]])
    for group in groups:
        if len(group) < 2:
            continue
        span = np.arange(group[0], group[-1] + 1)
        lat = np.interp(span, group, lateral[group])
        zz = np.interp(span, group, z[group])
        xy = path.xyz[span, :2] + lat[:, None] * normal[span]
        pts = np.column_stack([xy, zz])
        out.append(ReferenceLine(points=pts, source="auto", id=f"reference-{len(out)}"))
    return out


def _all_first_between(first: NDArray[np.bool_], known: NDArray[np.int64]) -> NDArray[np.bool_]:
    """For consecutive known stations, whether every station between them is a first visit."""
    c = np.concatenate([[0], np.cumsum(~first)])
    return np.asarray(c[known[1:] + 1] - c[known[:-1]] == 0)
