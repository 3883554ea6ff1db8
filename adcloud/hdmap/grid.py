"""Stage 3: the 5 cm grid map -- ground elevation and reflectance in tiles merged by key.

The grid is a fixed lattice in the ``map`` frame (ENU, metres): cell ``(gx, gy)`` covers
``x in [gx * r, (gx + 1) * r)`` and ``y in [gy * r, (gy + 1) * r)`` for the resolution
``r`` (computed in float64 on the host), and tile ``(tx, ty)`` holds the ``n x n`` cells
(``n`` = :attr:`GridSettings.tile_cells`) with ``gx // n == tx`` and ``gy // n == ty``.
Every drive therefore puts a given place in the same tile and cell, and tiles from
different scans and drives merge by key. Inside a tile, row 0 is the *southern* edge (as
in :mod:`adcloud.hetero.raster` and the synth truth raster); image writers flip the rows.

Three pure functions, shaped for Spark (``flatMap`` / ``reduceByKey`` / ``mapValues``):

1. :func:`scan_partials` -- one deskewed scan (map-frame points) to sparse
   :class:`TilePartial` objects, one per tile it touches (only the cells it hit: a few
   hundred kilobytes per scan, cheap to pickle). Points are classified (below), then
   reduced per cell by :func:`adcloud.hetero.rasterize` (OpenCL where a device is
   available): counts, sums, minima and maxima.
2. :func:`merge_partials` -- associative, commutative and *exact*: counts and sums are
   integers (heights in micrometres, intensities in millionths) and extrema are min/max,
   so any merge order gives a bit-identical tile.
3. :func:`finalize_tile` -- dense :class:`GridTile` layers, with the cell filters.

Ground only
    The elevation layers describe the ground surface (as the synth truth raster does:
    nothing standing on the ground is in it). :func:`classify_points` works per scan: the
    lowest point of every ``coarse_cell`` column, and the slope-limited lower envelope of
    those minima (``min over neighbours of their minimum + max_slope * distance`` within
    ``reference_radius``). A column whose minimum is more than ``seed_height`` above the
    envelope holds no ground (a car roof, a wall seen without the road in front of it) and
    takes the envelope as its reference; other columns take their own minimum. Points up
    to ``ground_band`` above the reference are ground candidates, points up to
    ``obstacle_clearance`` above it are obstacles, higher ones are ignored (canopies,
    overhangs). Ground candidates within ``mask_radius`` (horizontally) of any higher point
    of the same scan are dropped: they are the foot of something standing there (a car's
    flank reaching down to the road, a wall, a pole, a bush).

Transients
    Moving things are judged per *patch* (``patch_cells`` square, 0.5 m): at 5 cm a sparse
    LiDAR sees most cells once or never, a patch in many scans. Each partial counts per
    patch the scans that saw it empty (``patch_seen``: ground returns there, or a beam that
    passed through it lower than ``free_height`` -- anything taller standing there would
    have returned that beam) and the scans that saw an obstacle in it
    (``patch_occupied``). :func:`finalize_tile` calls the obstacle cells of a patch
    *static structure* when the patch was occupied in at least ``static_ratio`` of the
    scans that observed it; ``obstacle_top`` keeps their height and their ground is not
    trusted. A moving car occupies a patch in a few scans while many more see through it:
    its points never enter the ground statistics (they are obstacles, or masked as their
    foot) and it is not static, so it leaves no ghost in any layer. Free-space evidence
    needs ``sensor_xyz``; without it only ground returns count as seeing a patch empty.

Cell filters
    A ground cell needs ``min_points`` points, a spread ``max - min`` within
    ``max_spread``, a mean within ``max_step`` of the median of its
    ``block_cells``-square block, and no neighbour within ``step_cells`` cells more than
    ``max_step`` higher or lower. LiDAR range noise scatters points a few centimetres
    across a curb's edge and an object's foot seen from afar can look flat, so cells that
    disagree with the ground around them are left empty rather than averaged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import ndimage
from scipy.spatial import cKDTree

from adcloud.hdmap._groups import group_rows, reduce_groups
from adcloud.hdmap.errors import HdmapError
from adcloud.hetero import GridSpec, rasterize
from adcloud.hetero.devices import ComputeDevice, as_device

__all__ = [
    "GROUND",
    "IGNORED",
    "LAYERS",
    "OBSTACLE",
    "GridSettings",
    "GridTile",
    "TileKey",
    "TilePartial",
    "TransientPatches",
    "classify_points",
    "coarsen_tile",
    "finalize_tile",
    "merge_many_partials",
    "merge_partials",
    "overview_factor",
    "scan_partials",
    "transient_patches",
]

log = logging.getLogger(__name__)

TileKey = tuple[int, int]
F32 = NDArray[np.float32]
F64 = NDArray[np.float64]

#: Point classes of :func:`classify_points`.
IGNORED, GROUND, OBSTACLE = 0, 1, 2

#: The float/int layers of a :class:`GridTile`, in band order.
LAYERS = (
    "elevation_mean",
    "elevation_min",
    "elevation_max",
    "count",
    "reflectance_mean",
    "scans",
    "obstacle_top",
)

# Fixed-point quanta of the exact sums: heights in micrometres, intensities in millionths.
Z_QUANTUM = 1e-6
I_QUANTUM = 1e-6


@dataclass(frozen=True)
class GridSettings:
    """How the grid is laid out and which points describe the ground (metres throughout;
    see the module docstring for the rules each field tunes)."""

    #: Cell edge (m).
    resolution: float = 0.05
    #: Cells along a tile's edge (400 x 5 cm = 20 m tiles).
    tile_cells: int = 400
    #: Horizontal distance from the sensor of the points used: closer is the car itself,
    #: farther (beyond 30 m a 16-beam sensor sees no ground on flat land) mostly objects.
    min_range: float = 2.0
    max_range: float = 30.0
    #: Columns of the per-scan ground reference, and how far their envelope reaches (as
    #: far as max_range: the ground seen around the car then bounds every column).
    coarse_cell: float = 1.0
    reference_radius: float = 30.0
    #: Steepest ground slope (rise over run) the envelope allows.
    max_slope: float = 0.07
    #: A column whose lowest point is this far above the envelope holds no ground.
    seed_height: float = 0.25
    #: Points up to this far above the reference are ground (covers a 15 cm curb).
    ground_band: float = 0.25
    #: Points above the ground band and up to this height are obstacles.
    obstacle_clearance: float = 3.0
    #: Ground candidates this close (horizontally) to a higher point are dropped.
    mask_radius: float = 0.3
    #: Cell filters of :func:`finalize_tile`.
    min_points: int = 1
    max_spread: float = 0.12
    max_step: float = 0.05
    block_cells: int = 20
    step_cells: int = 2
    #: Transients are judged per patch of this many cells square (0.5 m): at 5 cm a
    #: sparse LiDAR sees most cells once or never, a patch in many scans.
    patch_cells: int = 10
    #: Free space: a beam passing a patch below this height above the ground (and at
    #: least free_margin short of its return) saw it empty; free_rays beams per scan.
    free_height: float = 1.5
    free_margin: float = 1.0
    free_rays: int = 4096
    #: Obstacles in a patch occupied in at least this fraction of the scans observing it
    #: are static structure; elsewhere they were passing through.
    static_ratio: float = 0.5

    def __post_init__(self) -> None:
        positive = {
            "resolution": self.resolution,
            "max_range": self.max_range,
            "coarse_cell": self.coarse_cell,
            "reference_radius": self.reference_radius,
            "seed_height": self.seed_height,
            "max_slope": self.max_slope,
            "ground_band": self.ground_band,
            "max_spread": self.max_spread,
            "max_step": self.max_step,
            "free_height": self.free_height,
        }
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise HdmapError(f"GridSettings.{name} must be a positive number, got {value!r}")
        if self.tile_cells < 1 or self.tile_cells > 1 << 15:
            raise HdmapError(
                f"GridSettings.tile_cells must be in [1, 32768], got {self.tile_cells}"
            )
        if not 0 <= self.min_range < self.max_range:
            raise HdmapError(
                f"GridSettings needs 0 <= min_range < max_range, got {self.min_range}, "
                f"{self.max_range}"
            )
        if self.obstacle_clearance <= self.ground_band:
            raise HdmapError("GridSettings.obstacle_clearance must exceed ground_band")
        if not self.mask_radius >= 0 or self.min_points < 1:
            raise HdmapError("GridSettings.mask_radius must be >= 0 and min_points >= 1")
        if self.patch_cells < 1 or self.tile_cells % self.patch_cells:
            raise HdmapError(
                f"GridSettings.patch_cells ({self.patch_cells}) must divide tile_cells "
                f"({self.tile_cells})"
            )
        if self.free_margin < 0 or self.free_rays < 0:
            raise HdmapError("GridSettings.free_margin and free_rays must be >= 0")
        if self.block_cells < 1 or self.step_cells < 0:
            raise HdmapError("GridSettings.block_cells must be >= 1 and step_cells >= 0")
        if not 0 < self.static_ratio <= 1:
            raise HdmapError(
                f"GridSettings.static_ratio must be in (0, 1], got {self.static_ratio}"
            )

    @property
    def tile_size(self) -> float:
        """A tile's edge (m)."""
        return self.resolution * self.tile_cells

    def tile_origin(self, key: TileKey) -> tuple[float, float]:
        """Map-frame ``(x, y)`` of the south-west corner of tile ``key`` (m)."""
        return key[0] * self.tile_size, key[1] * self.tile_size

    def tile_of(self, x: float, y: float) -> TileKey:
        """The key of the tile holding map-frame point ``(x, y)``."""
        size = self.tile_size
        return math.floor(x / size), math.floor(y / size)


@dataclass(frozen=True)
class TilePartial:
    """Sparse per-cell statistics of one tile from some scans; merge with :func:`merge_partials`.

    ``cells`` are the sorted flat indices ``row * tile_cells + col`` of the cells that hold
    anything; the other arrays are aligned with it: ``count`` ground points, ``sum_z``
    their heights (int64, :data:`Z_QUANTUM` m), ``min_z``/``max_z`` (float32, NaN where no
    ground point), ``sum_intensity`` (int64, :data:`I_QUANTUM`), ``scans`` (scans with
    ground here), ``obstacle_top`` (float32, highest obstacle point, NaN where none).

    ``patches`` are the sorted flat indices of the ``patch_cells``-square patches (row-major
    over the tile's ``tile_cells // patch_cells`` patches per side) that any scan saw;
    ``patch_seen`` counts the scans that saw the patch empty (ground returns there, or a
    beam passing through it low), ``patch_occupied`` the scans that saw an obstacle in it.
    """

    key: TileKey
    resolution: float
    tile_cells: int
    cells: NDArray[np.int32]
    count: NDArray[np.int32]
    sum_z: NDArray[np.int64]
    min_z: F32
    max_z: F32
    sum_intensity: NDArray[np.int64]
    scans: NDArray[np.int32]
    obstacle_top: F32
    patch_cells: int
    patches: NDArray[np.int32]
    patch_seen: NDArray[np.int32]
    patch_occupied: NDArray[np.int32]

    def __len__(self) -> int:
        return int(self.cells.shape[0])


@dataclass(frozen=True)
class GridTile:
    """Dense layers of one tile, each ``(tile_cells, tile_cells)`` with row 0 the south edge.

    ``elevation_*``: ground height (m, map frame; NaN where not observed or not trusted);
    ``count``: ground points behind each cell (int32); ``reflectance_mean``: their mean
    intensity (the LiDAR's unit); ``scans``: scans that saw ground there (int32);
    ``obstacle_top``: height of static structure standing there (m, NaN elsewhere).
    ``origin`` is the map-frame south-west corner (m).
    """

    key: TileKey
    origin: tuple[float, float]
    resolution: float
    elevation_mean: F32
    elevation_min: F32
    elevation_max: F32
    count: NDArray[np.int32]
    reflectance_mean: F32
    scans: NDArray[np.int32]
    obstacle_top: F32

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, cols)`` of every layer."""
        rows, cols = self.elevation_mean.shape
        return int(rows), int(cols)

    def layer(self, name: str) -> NDArray[Any]:
        """The layer called ``name`` (one of :data:`LAYERS`)."""
        if name not in LAYERS:
            raise HdmapError(f"unknown grid layer {name!r}; layers are {', '.join(LAYERS)}")
        value: NDArray[Any] = getattr(self, name)
        return value

    def cell_centers(self) -> tuple[F64, F64]:
        """Map-frame x (cols,) and y (rows,) of the cell centres (m)."""
        rows, cols = self.shape
        x: F64 = self.origin[0] + (np.arange(cols, dtype=np.float64) + 0.5) * self.resolution
        y: F64 = self.origin[1] + (np.arange(rows, dtype=np.float64) + 0.5) * self.resolution
        return x, y


# -- point classification ---------------------------------------------------------------------


def _check_cloud(xyz: NDArray[Any], intensity: NDArray[Any] | None) -> tuple[F64, F32]:
    array = np.asarray(xyz)
    if array.ndim != 2 or array.shape[1] != 3:
        raise HdmapError(f"xyz_map must be an (n, 3) array of map-frame points, got {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise HdmapError(f"xyz_map must hold floats (metres), got dtype {array.dtype}")
    if intensity is None:
        values = np.zeros(len(array), np.float32)
    else:
        values = np.asarray(intensity, dtype=np.float32).reshape(-1)
        if values.shape[0] != array.shape[0]:
            raise HdmapError(
                f"intensity has {values.shape[0]} values for {array.shape[0]} points; pass one "
                "intensity per point"
            )
    return array.astype(np.float64, copy=False), values


@dataclass(frozen=True)
class _Ground:
    """One scan's classes and its ground reference (per ``coarse_cell`` column)."""

    classes: NDArray[np.int8]
    grid: GridSpec | None
    reference: F64


def classify_points(
    xyz_map: NDArray[Any],
    settings: GridSettings | None = None,
    *,
    sensor_xyz: NDArray[Any] | None = None,
    device: ComputeDevice | str | None = None,
) -> NDArray[np.int8]:
    """Class of every point of one scan: :data:`GROUND`, :data:`OBSTACLE` or :data:`IGNORED`.

    ``xyz_map`` (n, 3) are one scan's deskewed map-frame points (m); ``sensor_xyz`` the
    sensor's map-frame position, which enables the ``min_range``/``max_range`` limits. See
    the module docstring for the rules; ground candidates at the foot of an obstacle come
    out as :data:`IGNORED`.
    """
    settings = settings or GridSettings()
    xyz, _ = _check_cloud(xyz_map, None)
    return _classify(xyz, settings, _sensor(sensor_xyz), as_device(device)).classes


def _sensor(sensor_xyz: NDArray[Any] | None) -> F64 | None:
    if sensor_xyz is None:
        return None
    sensor = np.asarray(sensor_xyz, dtype=np.float64).reshape(-1)
    if sensor.shape != (3,) or not np.isfinite(sensor).all():
        raise HdmapError(f"sensor_xyz must be a finite map-frame point (3,), got {sensor}")
    return sensor


def _in_range(xyz: F64, sensor: F64 | None, settings: GridSettings) -> NDArray[np.bool_]:
    usable: NDArray[np.bool_] = np.all(np.isfinite(xyz), axis=1)
    if sensor is not None:
        with np.errstate(invalid="ignore"):
            reach = np.hypot(xyz[:, 0] - sensor[0], xyz[:, 1] - sensor[1])
        usable = usable & (reach >= settings.min_range) & (reach <= settings.max_range)
    return usable


def _classify(xyz: F64, settings: GridSettings, sensor: F64 | None, dev: ComputeDevice) -> _Ground:
    classes = np.zeros(len(xyz), np.int8)
    index = np.flatnonzero(_in_range(xyz, sensor, settings))
    if not len(index):
        return _Ground(classes, None, np.zeros((0, 0)))
    pts = xyz[index]
    coarse = GridSpec.covering(pts, settings.coarse_cell)
    column_min = rasterize(pts, coarse, intensity_column=None, device=dev).min_z.astype(np.float64)
    lowest = _lower_envelope(column_min, settings)
    # A column holds ground when its lowest point is near the slope-limited lower envelope
    # of the columns around it; otherwise (car roofs, walls seen without the ground in
    # front of them) the envelope is its reference.
    seeded = column_min <= lowest + settings.seed_height
    reference = np.where(seeded, column_min, lowest)
    height = pts[:, 2] - _reference_at(pts, coarse, reference)
    ground = height <= settings.ground_band
    obstacle = ~ground & (height <= settings.obstacle_clearance)
    standing = ~ground
    if settings.mask_radius > 0 and standing.any() and ground.any():
        ground &= ~_near_obstacle(pts, ground, standing, settings)
    classes[index[ground]] = GROUND
    classes[index[obstacle]] = OBSTACLE
    return _Ground(classes, coarse, reference)


def _reference_at(pts: F64, coarse: GridSpec, reference: F64) -> F64:
    """The ground reference under each point (the nearest column's at the grid's edge)."""
    col, row = _cells_of(pts, coarse.origin_x, coarse.origin_y, coarse.cell_size)
    col = np.clip(col, 0, coarse.width - 1)
    row = np.clip(row, 0, coarse.height - 1)
    out: F64 = reference[row, col]
    return out


def _free_samples(xyz: F64, sensor: F64, ground: _Ground, settings: GridSettings) -> F64:
    """Points (k, 2) where this scan's beams passed low through empty air.

    Each beam is sampled every patch width up to ``free_margin`` short of its return (or
    to ``max_range`` for farther returns); samples between ``ground_band`` and
    ``free_height`` above the ground reference prove that nothing taller stood there at
    that moment (a car would have returned the beam). At most ``free_rays`` beams, evenly
    spread over the scan, are traced: a patch is crossed by many.
    """
    if ground.grid is None:
        return np.zeros((0, 2))
    rays = np.flatnonzero(np.isfinite(xyz).all(axis=1))
    if len(rays) > settings.free_rays:
        rays = rays[np.linspace(0, len(rays) - 1, settings.free_rays).astype(np.int64)]
    ends = xyz[rays]
    step = settings.patch_cells * settings.resolution
    delta = ends - sensor
    length = np.linalg.norm(delta, axis=1)
    reach = np.hypot(delta[:, 0], delta[:, 1])
    # Beams to returns beyond max_range still crossed the air within it.
    usable = np.minimum(
        length - settings.free_margin, length * settings.max_range / np.maximum(reach, 1e-9)
    )
    # Trace only the stretch where the beam is low: heights above the ground interpolate
    # between the sensor's and the return's (with slack for the terrain's curvature).
    h0 = float(sensor[2] - _reference_at(sensor[None, :], ground.grid, ground.reference)[0])
    h1 = ends[:, 2] - _reference_at(ends, ground.grid, ground.reference)
    slack = 0.2
    low, high = settings.ground_band - slack, settings.free_height + slack
    with np.errstate(divide="ignore", invalid="ignore"):
        t_a = (low - h0) / (h1 - h0)
        t_b = (high - h0) / (h1 - h0)
    flat = np.abs(h1 - h0) < 1e-9
    inside = (h0 > low) & (h0 < high)
    t_lo = np.where(flat, np.where(inside, 0.0, 1.0), np.clip(np.minimum(t_a, t_b), 0, 1))
    t_hi = np.where(flat, np.where(inside, 1.0, 0.0), np.clip(np.maximum(t_a, t_b), 0, 1))
    start = t_lo * length
    stop = np.minimum(t_hi * length, usable)
    samples = np.maximum(np.floor((stop - start) / step), 0).astype(np.int64)
    total = int(samples.sum())
    if not total:
        return np.zeros((0, 2))
    ray = np.repeat(np.arange(len(ends)), samples)
    first = np.repeat(np.cumsum(samples) - samples, samples)
    along = (start[ray] + (np.arange(total) - first + 0.5) * step) / length[ray]
    # sensor + delta[ray] * along, one coordinate at a time (the same arithmetic without
    # gathering rows of three; a scan traces ~60k samples).
    at = np.empty((total, 2))
    for c in (0, 1):
        np.multiply(delta[:, c][ray], along, out=at[:, c])
        at[:, c] += sensor[c]
    height = sensor[2] + delta[:, 2][ray] * along - _reference_at(at, ground.grid, ground.reference)
    low = (height > settings.ground_band) & (height < settings.free_height)
    out: F64 = at[low]
    return out


def _lower_envelope(column_min: F64, settings: GridSettings) -> F64:
    """``min over c' of column_min[c'] + max_slope * |c - c'|`` within ``reference_radius``.

    Chamfer steps: repeated 3 x 3 grey erosions whose structuring element adds the climb
    over one cell (or one diagonal), so the envelope rises at ``max_slope`` away from low
    columns -- ground seen 10 m away still bounds a column whose own points are a wall.
    """
    step = settings.max_slope * settings.coarse_cell
    structure = -step * np.array([[2**0.5, 1.0, 2**0.5], [1.0, 0.0, 1.0], [2**0.5, 1.0, 2**0.5]])
    out = np.where(np.isnan(column_min), np.inf, column_min)
    for _ in range(max(1, round(settings.reference_radius / settings.coarse_cell))):
        out = ndimage.grey_erosion(out, structure=structure, mode="constant", cval=np.inf)
    return out


def _cells_of(
    pts: F64, origin_x: float, origin_y: float, cell: float
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Column and row of points in a lattice, in float32 exactly as the raster kernels do."""
    inv = np.float32(1.0) / np.float32(cell)
    fx = (pts[:, 0] - origin_x).astype(np.float32) * inv
    fy = (pts[:, 1] - origin_y).astype(np.float32) * inv
    return np.floor(fx).astype(np.int64), np.floor(fy).astype(np.int64)


def _near_obstacle(
    pts: F64, ground: NDArray[np.bool_], standing: NDArray[np.bool_], settings: GridSettings
) -> NDArray[np.bool_]:
    """Ground candidates within ``mask_radius`` (horizontally) of a point standing above."""
    radius = settings.mask_radius
    # Only ground points in the 3 x 3 cells around a standing point's cell can be that
    # close: most of a sweep's ground is far from anything standing, and is settled by a
    # sorted lookup instead of a tree query (the same answer, in half the time).  Cells are
    # a hair wider than the radius, so rounding cannot put a pair at the radius two apart.
    cell = np.floor(pts[:, :2] / (radius * 1.001)).astype(np.int64)
    packed = (cell[:, 0] << 32) + cell[:, 1]
    occupied = np.unique(packed[standing])
    idx = np.flatnonzero(ground)
    own = packed[idx]
    candidate = np.zeros(len(idx), bool)
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            key = own + ((dx << 32) + dy)
            at = np.minimum(np.searchsorted(occupied, key), len(occupied) - 1)
            candidate |= occupied[at] == key
    idx = idx[candidate]
    near = np.zeros(len(pts), bool)
    if not len(idx):
        return near
    tree = cKDTree(pts[standing, :2])
    # the nearest standing point within the radius (inclusive) -- twice as fast as
    # counting every neighbour with query_ball_point
    bound = np.nextafter(radius, np.inf)
    dist, _ = tree.query(pts[idx, :2], k=1, distance_upper_bound=bound)
    near[idx[np.isfinite(dist)]] = True
    return near


# -- per-scan partials ------------------------------------------------------------------------


def scan_partials(
    xyz_map: NDArray[Any],
    intensity: NDArray[Any] | None,
    settings: GridSettings | None = None,
    *,
    sensor_xyz: NDArray[Any] | None = None,
    device: ComputeDevice | str | None = None,
) -> list[tuple[TileKey, TilePartial]]:
    """The sparse tile statistics of one deskewed scan, one ``(key, partial)`` per tile.

    ``xyz_map`` (n, 3) map-frame points (m) of *one* scan (the per-scan counts ``scans``,
    ``patch_seen`` and ``patch_occupied`` assume so), ``intensity`` (n,) or None,
    ``sensor_xyz`` the sensor's map-frame position (enables the range limits and the
    free-space evidence for transients; give it). The reductions run on ``device`` (an
    address, a device, or None for the task's device; ``"numpy"`` for the reference).
    """
    settings = settings or GridSettings()
    xyz, values = _check_cloud(xyz_map, intensity)
    dev = as_device(device)
    sensor = _sensor(sensor_xyz)
    ground = _classify(xyz, settings, sensor, dev)
    keep = ground.classes != IGNORED
    free = _free_samples(xyz, sensor, ground, settings) if sensor is not None else np.zeros((0, 2))
    if not keep.any() and not len(free):
        return []
    pts, vals, cls = xyz[keep], values[keep], ground.classes[keep]
    vals = np.where(np.isfinite(vals), vals, np.float32(0))
    n, res, m = settings.tile_cells, settings.resolution, settings.patch_cells
    per_side = n // m
    # Cells on the map-frame lattice, in float64 on the host so that every scan and drive
    # bins a place identically; tiles are numbered in this scan by their packed key.
    gx, gy = _lattice(pts[:, :2], res)
    fx, fy = _lattice(free, res)
    tx, ty = np.floor_divide(gx, n), np.floor_divide(gy, n)
    ftx, fty = np.floor_divide(fx, n), np.floor_divide(fy, n)
    tiles, (tile_of, free_tile_of) = _number_tiles((tx, ty), (ftx, fty))
    local = np.mod(gy, n) * n + np.mod(gx, n)
    cell_keys, slot = np.unique(tile_of * (n * n) + local, return_inverse=True)
    slot = slot.reshape(-1)
    ground_layers, obstacle_layers = _reduce_cells(pts, vals, cls, slot, len(cell_keys), dev)
    # Patches: where this scan saw ground or empty air, and where it saw something standing.
    # A scan's tiles hold a few thousand patches: marks over all of them, not sorts.
    patch = tile_of * per_side**2 + (np.mod(gy, n) // m) * per_side + np.mod(gx, n) // m
    free_patch = free_tile_of * per_side**2 + (np.mod(fy, n) // m) * per_side + np.mod(fx, n) // m
    seen = np.zeros(len(tiles) * per_side**2, bool)
    seen[patch[cls == GROUND]] = True
    seen[free_patch] = True
    occupied = np.zeros_like(seen)
    occupied[patch[cls == OBSTACLE]] = True
    patch_keys = np.flatnonzero(seen | occupied)
    patch_seen = seen[patch_keys].astype(np.int32)
    patch_occupied = occupied[patch_keys].astype(np.int32)
    cell_bounds = np.searchsorted(cell_keys // (n * n), np.arange(len(tiles) + 1))
    patch_bounds = np.searchsorted(patch_keys // per_side**2, np.arange(len(tiles) + 1))
    out: list[tuple[TileKey, TilePartial]] = []
    for i, (key_x, key_y) in enumerate(_unpack(tiles)):
        lo, hi = int(cell_bounds[i]), int(cell_bounds[i + 1])
        plo, phi = int(patch_bounds[i]), int(patch_bounds[i + 1])
        key = (int(key_x), int(key_y))
        count = ground_layers["count"][lo:hi]
        seen_here = count > 0
        out.append(
            (
                key,
                TilePartial(
                    key=key,
                    resolution=res,
                    tile_cells=n,
                    cells=(cell_keys[lo:hi] - i * n * n).astype(np.int32),
                    count=count.astype(np.int32),
                    sum_z=_fixed(
                        np.where(seen_here, ground_layers["sum_z"][lo:hi], 0.0), Z_QUANTUM
                    ),
                    min_z=ground_layers["min_z"][lo:hi].astype(np.float32),
                    max_z=ground_layers["max_z"][lo:hi].astype(np.float32),
                    sum_intensity=_fixed(
                        np.where(seen_here, ground_layers["sum_i"][lo:hi], 0.0), I_QUANTUM
                    ),
                    scans=seen_here.astype(np.int32),
                    obstacle_top=obstacle_layers["max_z"][lo:hi].astype(np.float32),
                    patch_cells=m,
                    patches=(patch_keys[plo:phi] - i * per_side**2).astype(np.int32),
                    patch_seen=patch_seen[plo:phi],
                    patch_occupied=patch_occupied[plo:phi],
                ),
            )
        )
    return out


def _number_tiles(
    *parts: tuple[NDArray[np.int64], NDArray[np.int64]],
) -> tuple[NDArray[np.int64], list[NDArray[np.int64]]]:
    """The packed keys (sorted) of the tiles ``(tx, ty)`` in ``parts``, and each part's
    index into them.  A scan spans a few tiles: they are marked in their bounding box (row
    major in x, as the packed keys sort) instead of sorting every point's key."""
    xs = np.concatenate([tx for tx, _ in parts])
    ys = np.concatenate([ty for _, ty in parts])
    if not len(xs):
        return np.zeros(0, np.int64), [np.zeros(0, np.int64) for _ in parts]
    x0, y0 = int(xs.min()), int(ys.min())
    height = int(ys.max()) - y0 + 1
    box = np.zeros((int(xs.max()) - x0 + 1) * height, bool)
    box[(xs - x0) * height + (ys - y0)] = True
    present = np.flatnonzero(box)
    number = np.cumsum(box) - 1
    keys = _pack(present // height + x0, present % height + y0)
    return keys, [number[(tx - x0) * height + (ty - y0)] for tx, ty in parts]


def _lattice(xy: F64, res: float) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    return np.floor(xy[:, 0] / res).astype(np.int64), np.floor(xy[:, 1] / res).astype(np.int64)


_TILE_OFFSET = 1 << 30


def _pack(tx: NDArray[np.int64], ty: NDArray[np.int64]) -> NDArray[np.int64]:
    """Tile keys as sortable int64 (x major), for tiles within +-2^30 of the origin."""
    out: NDArray[np.int64] = ((tx + _TILE_OFFSET) << 32) | (ty + _TILE_OFFSET)
    return out


def _unpack(packed: NDArray[np.int64]) -> list[tuple[int, int]]:
    tx = (packed >> 32) - _TILE_OFFSET
    ty = (packed & 0xFFFFFFFF) - _TILE_OFFSET
    return list(zip(tx.tolist(), ty.tolist(), strict=True))


def _fixed(values: F64, quantum: float) -> NDArray[np.int64]:
    """Sums as integers of ``quantum``: adding them is exact, in any order."""
    out: NDArray[np.int64] = np.rint(values / quantum).astype(np.int64)
    return out


def _reduce_cells(
    pts: F64,
    vals: F32,
    cls: NDArray[np.int8],
    slot: NDArray[np.int64],
    cells: int,
    dev: ComputeDevice,
) -> tuple[dict[str, NDArray[Any]], dict[str, NDArray[Any]]]:
    """Per-cell count, sum, min and max of the ground and obstacle points via the raster
    kernels, run as a segmented reduction over the scan's occupied cells.

    The kernels bin ``floor(x / cell_size)``; giving each point ``x = slot + 0.5`` on a
    one-row grid of 1 m cells makes their bins exactly the occupied cells (sparse, a few
    thousand per scan) instead of a dense 5 cm raster of the scan's whole footprint.
    Heights go in relative to a reference near the scan (float32 on devices) and come back
    in float64.
    """
    z0 = float(np.floor(np.median(pts[:, 2]))) if len(pts) else 0.0
    grid = GridSpec(0.0, 0.0, 1.0, max(cells, 1), 1)
    out: list[dict[str, NDArray[Any]]] = []
    for wanted, with_values in ((GROUND, True), (OBSTACLE, False)):
        mask = cls == wanted
        rows = np.empty((int(mask.sum()), 3), np.float32)
        rows[:, 0] = slot[mask].astype(np.float32) + np.float32(0.5)
        rows[:, 1] = 0.5
        rows[:, 2] = (pts[mask, 2] - z0).astype(np.float32)
        if len(rows):
            raster = rasterize(
                rows, grid, intensity=vals[mask] if with_values else None, device=dev
            )
            count = raster.count[0].astype(np.int64)
            layers = {
                "count": count,
                "sum_z": (raster.mean_z[0].astype(np.float64) + z0) * count,
                "min_z": raster.min_z[0].astype(np.float64) + z0,
                "max_z": raster.max_z[0].astype(np.float64) + z0,
                "sum_i": raster.mean_intensity[0].astype(np.float64) * count,
            }
        else:
            nan = np.full(cells, np.nan)
            layers = {
                "count": np.zeros(cells, np.int64),
                "sum_z": np.zeros(cells),
                "min_z": nan,
                "max_z": nan,
                "sum_i": np.zeros(cells),
            }
        out.append(layers)
    return out[0], out[1]


# -- merge and finalize -----------------------------------------------------------------------


def merge_partials(a: TilePartial, b: TilePartial) -> TilePartial:
    """The statistics of ``a`` and ``b`` together (same tile); exact, so associative and
    commutative: any merge order gives a bit-identical result."""
    return merge_many_partials([a, b])


def merge_many_partials(parts: Sequence[TilePartial]) -> TilePartial:
    """The statistics of all ``parts`` together (same tile), in one pass.

    Folding a tile's partials two at a time re-copies the growing tile at every step
    (quadratic in the number of scans over it); this groups every row once.  Integer sums
    and min/max are exact, so the result equals any order of :func:`merge_partials`.
    """
    if not parts:
        raise HdmapError("merge_many_partials needs at least one partial")
    a = parts[0]
    for b in parts[1:]:
        if b.key != a.key or b.tile_cells != a.tile_cells or b.resolution != a.resolution:
            raise HdmapError(
                f"cannot merge tile {a.key} ({a.tile_cells} cells of {a.resolution} m) with "
                f"tile {b.key} ({b.tile_cells} cells of {b.resolution} m); merge partials by "
                "tile key and build every drive with the same GridSettings"
            )
        if b.patch_cells != a.patch_cells:
            raise HdmapError(
                f"cannot merge tile {a.key}: patches of {a.patch_cells} and {b.patch_cells} "
                "cells; build every drive with the same GridSettings"
            )
    if len(parts) == 1:
        return a
    cells, order, starts = group_rows([p.cells for p in parts])
    patches, porder, pstarts = group_rows([p.patches for p in parts])

    def cell(name: str, op: np.ufunc) -> NDArray[Any]:
        return reduce_groups([getattr(p, name) for p in parts], order, starts, op)

    def patch(name: str) -> NDArray[Any]:
        return reduce_groups([getattr(p, name) for p in parts], porder, pstarts, np.add)

    return TilePartial(
        key=a.key,
        resolution=a.resolution,
        tile_cells=a.tile_cells,
        cells=cells,
        count=cell("count", np.add),
        sum_z=cell("sum_z", np.add),
        min_z=cell("min_z", np.fmin),
        max_z=cell("max_z", np.fmax),
        sum_intensity=cell("sum_intensity", np.add),
        scans=cell("scans", np.add),
        obstacle_top=cell("obstacle_top", np.fmax),
        patch_cells=a.patch_cells,
        patches=patches,
        patch_seen=patch("patch_seen"),
        patch_occupied=patch("patch_occupied"),
    )


def _consistent(
    cells: NDArray[np.int32], z: F64, n: int, settings: GridSettings
) -> NDArray[np.bool_]:
    """Which cells agree with the ground around them: within ``max_step`` of the median
    height of the cells of their ``block_cells`` x ``block_cells`` block.

    A cell whose few points came from the foot of a bush, or from the face of a curb, stands
    out from the many ground cells around it even when its own points agree with each other.
    """
    if not len(cells):
        return np.zeros(0, bool)
    b = settings.block_cells
    block = (cells // n // b) * ((n + b - 1) // b) + (cells % n) // b
    order = np.lexsort((z, block))
    sorted_block = block[order]
    starts = np.flatnonzero(np.r_[True, np.diff(sorted_block) != 0])
    sizes = np.diff(np.r_[starts, len(order)])
    # The median of each block: the middle element(s) of its run in the sorted order.
    lo = z[order[starts + (sizes - 1) // 2]]
    hi = z[order[starts + sizes // 2]]
    median = np.repeat((lo + hi) / 2, sizes)
    ok = np.zeros(len(cells), bool)
    ok[order] = np.abs(z[order] - median) <= settings.max_step
    return ok


def _off_steps(
    cells: NDArray[np.int32], z: F64, n: int, settings: GridSettings
) -> NDArray[np.bool_]:
    """Which cells have no neighbour within ``step_cells`` cells whose height differs by
    more than ``max_step``: cells on a step (a curb edge) mix the two levels."""
    if not len(cells):
        return np.zeros(0, bool)
    flat = np.full(n * n, np.nan)
    flat[cells] = z
    dense = flat.reshape(n, n)
    size = 2 * settings.step_cells + 1
    high = ndimage.maximum_filter(np.where(np.isnan(dense), -np.inf, dense), size=size)
    low = ndimage.minimum_filter(np.where(np.isnan(dense), np.inf, dense), size=size)
    span = np.maximum(high.reshape(-1)[cells] - z, z - low.reshape(-1)[cells])
    ok: NDArray[np.bool_] = span <= settings.max_step
    return ok


def _static_patches(p: TilePartial, settings: GridSettings) -> NDArray[np.bool_]:
    """Per entry of ``p.patches``: static structure, i.e. occupied in at least
    ``static_ratio`` of the scans that observed it; other occupied patches saw things pass."""
    observed = p.patch_seen + p.patch_occupied
    out: NDArray[np.bool_] = (p.patch_occupied > 0) & (
        p.patch_occupied >= settings.static_ratio * observed
    )
    return out


def _patch_of_cells(p: TilePartial) -> NDArray[np.int64]:
    """The flat patch index (row-major over the tile's patches) of each of ``p.cells``."""
    n, k = p.tile_cells, p.patch_cells
    out: NDArray[np.int64] = (p.cells // n // k) * (n // k) + (p.cells % n) // k
    return out


@dataclass(frozen=True)
class TransientPatches:
    """Where a merged tile saw only passing things: per patch (row 0 the south edge),
    ``transient`` (occupied in some scans but seen empty in most) and ``ground`` (the mean
    ground height of its cells, m; NaN where no ground was seen).  Small (a few KB a tile),
    so the point-cloud map can drop the same ghosts the grid drops."""

    key: TileKey
    origin: tuple[float, float]
    patch_size: float
    transient: NDArray[np.bool_]
    ground: F32

    def standing(
        self, xyz: NDArray[Any], min_height: float, max_height: float
    ) -> NDArray[np.bool_]:
        """Which map-frame points stand in a transient patch, more than ``min_height`` and
        at most ``max_height`` above its ground (static overhangs are occupied in most
        scans, so their patches are not transient)."""
        pts = np.asarray(xyz, dtype=np.float64)
        per_side = self.transient.shape[0]
        col = np.floor((pts[:, 0] - self.origin[0]) / self.patch_size).astype(np.int64)
        row = np.floor((pts[:, 1] - self.origin[1]) / self.patch_size).astype(np.int64)
        inside = (col >= 0) & (col < per_side) & (row >= 0) & (row < per_side)
        out = np.zeros(len(pts), bool)
        r, c = row[inside], col[inside]
        height = pts[inside, 2] - self.ground[r, c]
        with np.errstate(invalid="ignore"):
            out[inside] = self.transient[r, c] & (height > min_height) & (height <= max_height)
        return out


def transient_patches(
    partial: TilePartial, settings: GridSettings | None = None
) -> TransientPatches:
    """The patches of a merged tile where obstacles were passing through (the complement
    of :func:`finalize_tile`'s static structure among occupied patches), with their ground."""
    settings = settings or GridSettings()
    p = partial
    n = p.tile_cells
    per_side = n // p.patch_cells
    transient = np.zeros(per_side * per_side, bool)
    transient[p.patches] = (p.patch_occupied > 0) & ~_static_patches(p, settings)
    patch_of = _patch_of_cells(p)
    has = p.count > 0
    sum_z = np.bincount(
        patch_of[has],
        weights=p.sum_z[has].astype(np.float64) * Z_QUANTUM,
        minlength=per_side * per_side,
    )
    count = np.bincount(patch_of[has], weights=p.count[has], minlength=per_side * per_side)
    with np.errstate(invalid="ignore", divide="ignore"):
        ground = (sum_z / count).reshape(per_side, per_side)
    unknown = np.isnan(ground)
    if unknown.all():
        transient[:] = False  # no ground anywhere in the tile: nothing to measure from
    elif unknown.any():
        # a passing car hides the ground of the patches it covers: take the nearest seen
        nearest = ndimage.distance_transform_edt(
            unknown, return_distances=False, return_indices=True
        )
        ground = ground[nearest[0], nearest[1]]
    return TransientPatches(
        key=p.key,
        origin=(p.key[0] * n * p.resolution, p.key[1] * n * p.resolution),
        patch_size=p.patch_cells * p.resolution,
        transient=transient.reshape(per_side, per_side),
        ground=ground.astype(np.float32),
    )


def finalize_tile(partial: TilePartial, settings: GridSettings | None = None) -> GridTile:
    """Dense layers of a merged tile, with the ground and transient rules applied (see the
    module docstring). ``settings`` must match the partial's resolution and tile size."""
    settings = settings or GridSettings()
    built = (partial.tile_cells, partial.resolution, partial.patch_cells)
    if built != (settings.tile_cells, settings.resolution, settings.patch_cells):
        raise HdmapError(
            f"tile {partial.key} was built with {partial.tile_cells} cells of "
            f"{partial.resolution} m (patches of {partial.patch_cells}) but settings say "
            f"{settings.tile_cells} of {settings.resolution} m (patches of "
            f"{settings.patch_cells}); finalize with the settings the partials were built with"
        )
    n = settings.tile_cells
    p = partial
    # Static structure: obstacle points in a patch that was occupied in enough of the scans
    # that observed it; in other patches the obstacles were passing through.
    static_patch = _static_patches(p, settings)
    patch_of = _patch_of_cells(p)
    position = np.clip(np.searchsorted(p.patches, patch_of), 0, max(len(p.patches) - 1, 0))
    in_static = np.zeros(len(p), bool)
    if len(p.patches):
        in_static = (p.patches[position] == patch_of) & static_patch[position]
    static = in_static & np.isfinite(p.obstacle_top)
    with np.errstate(invalid="ignore", divide="ignore"):
        spread = p.max_z - p.min_z
        mean_z = p.sum_z.astype(np.float64) * Z_QUANTUM / p.count
        mean_i = p.sum_intensity.astype(np.float64) * I_QUANTUM / p.count
    ok = (p.count >= settings.min_points) & ~static & (spread <= settings.max_spread)
    ok[ok] = _consistent(p.cells[ok], mean_z[ok], n, settings)
    ok[ok] = _off_steps(p.cells[ok], mean_z[ok], n, settings)

    def dense(values: NDArray[Any], mask: NDArray[np.bool_], fill: Any, dtype: Any) -> NDArray[Any]:
        out = np.full(n * n, fill, dtype)
        out[p.cells[mask]] = values[mask]
        return out.reshape(n, n)

    tile = GridTile(
        key=p.key,
        origin=settings.tile_origin(p.key),
        resolution=settings.resolution,
        elevation_mean=dense(mean_z, ok, np.nan, np.float32),
        elevation_min=dense(p.min_z, ok, np.nan, np.float32),
        elevation_max=dense(p.max_z, ok, np.nan, np.float32),
        count=dense(p.count, ok, 0, np.int32),
        reflectance_mean=dense(mean_i, ok, np.nan, np.float32),
        scans=dense(p.scans, ok, 0, np.int32),
        obstacle_top=dense(p.obstacle_top, static, np.nan, np.float32),
    )
    log.debug(
        "grid tile %s: %d ground cells, %d static-structure cells, %d dropped",
        p.key,
        int(ok.sum()),
        int(static.sum()),
        int(len(p) - ok.sum() - static.sum()),
    )
    return tile


#: Layers that hold counts: a coarse cell sums them; the others are NaN-aware means.
_SUM_LAYERS = ("count", "scans")


def coarsen_tile(tile: GridTile, factor: int) -> GridTile:
    """``tile`` with cells ``factor`` times larger (``factor`` must divide its side): counts
    summed, the other layers averaged over the finer cells that have a value (NaN where
    none has). For pictures of a whole map, where the full resolution would not fit."""
    rows, cols = tile.shape
    if factor < 1 or rows % factor or cols % factor:
        raise HdmapError(
            f"coarsen_tile: factor {factor} must be >= 1 and divide the tile's "
            f"{rows} x {cols} cells"
        )
    if factor == 1:
        return tile

    def coarse(name: str) -> NDArray[Any]:
        blocks = tile.layer(name).reshape(rows // factor, factor, cols // factor, factor)
        if name in _SUM_LAYERS:
            sums: NDArray[np.int32] = blocks.sum(axis=(1, 3), dtype=np.int64).astype(np.int32)
            return sums
        finite = np.isfinite(blocks)
        total = np.where(finite, blocks, 0.0).sum(axis=(1, 3), dtype=np.float64)
        n = finite.sum(axis=(1, 3))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean: F32 = np.where(n > 0, total / np.maximum(n, 1), np.nan).astype(np.float32)
        return mean

    return GridTile(
        key=tile.key,
        origin=tile.origin,
        resolution=tile.resolution * factor,
        **{name: coarse(name) for name in LAYERS},
    )


def overview_factor(keys: Sequence[TileKey], tile_cells: int, max_pixels: int = 1024) -> int:
    """The coarsening (a divisor of ``tile_cells``) at which the tiles ``keys`` still give a
    picture of at least about ``max_pixels`` along the longer side of their bounding box:
    the largest divisor not above ``ceil(side / max_pixels)``."""
    if not keys:
        return 1
    xs, ys = [k[0] for k in keys], [k[1] for k in keys]
    side = max(max(xs) - min(xs) + 1, max(ys) - min(ys) + 1) * tile_cells
    most = max(1, -(-side // max(1, max_pixels)))
    return max(d for d in range(1, min(most, tile_cells) + 1) if tile_cells % d == 0)
