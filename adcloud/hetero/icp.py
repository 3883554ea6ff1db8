"""Point-to-plane ICP on a voxel-hash grid: correspondences, normals, normal equations, align.

The target cloud goes into a :class:`PointGrid`: a uniform lattice of cells of edge
``cell`` metres (at least the search radius), its points sorted by cell and a hash table
from packed cell keys to cell ranges (:mod:`adcloud.hetero.lattice`).  A radius search then
visits the 27 cells around a point -- exact for radii up to ``cell`` and O(N) overall, not
O(N*M) brute force.

Frames and units: metres.  ``transform`` (4x4 rigid) maps source coordinates into the target
frame.  Correspondence indices refer to the rows of the target array given to
:func:`build_grid`; -1 means no target point within ``max_distance``.  Normals are unit
vectors (NaN rows where a point has fewer than ``min_neighbors`` neighbours), oriented
towards ``viewpoint`` (the sensor; the frame's origin by default).

Point-to-plane normal equations: residual ``r = n . (T s - q)``, Jacobian
``J = [(T s - o) x n, n]`` for an increment ``(w, d)`` (rotation vector, translation)
applied on the left, rotating about the grid's origin ``o`` in the target frame's axes;
:func:`apply_increment` applies a solution.  Devices reduce ``JtJ`` (6x6) and ``Jtr`` (6)
with work-group reductions in float32 and the host adds the group sums in float64.

Non-finite points are dropped from grids; non-finite queries match nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, OpenCLDevice, as_device
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.lattice import (
    KEY_OFFSET,
    build_table,
    cell_indices,
    lattice_origin,
    local_float32,
    pack_keys,
)
from adcloud.hetero.transform import as_points, as_rigid
from adcloud.hetero.voxel import voxel_downsample

if TYPE_CHECKING:
    from adcloud.hetero._kernels.icp import GridOnDevice

__all__ = [
    "Alignment",
    "Matches",
    "NormalEquations",
    "PointGrid",
    "align",
    "apply_increment",
    "build_grid",
    "estimate_normals",
    "nearest_neighbors",
    "normal_equations",
]

log = logging.getLogger(__name__)
#: Neighbours a point needs within the radius for a normal (estimate_normals, align).
_NORMAL_NEIGHBORS = 5

_OFFSETS = np.array(
    [(dx, dy, dz) for dz in (-1, 0, 1) for dy in (-1, 0, 1) for dx in (-1, 0, 1)], np.int64
)  # ascending packed-key order, as the kernels visit them


@dataclass(frozen=True, eq=False)
class PointGrid:
    """A point cloud bucketed into a uniform grid (see the module docstring).

    ``origin`` (3,) float64 metres, on multiples of ``cell``; ``points`` (M, 3) float32
    coordinates relative to ``origin``, sorted by cell; ``order`` (M,) the row of the input
    cloud each sorted point came from (non-finite rows are left out); ``cell_keys``
    (sorted), ``cell_start``, ``cell_count`` describe the occupied cells and
    ``table_keys``/``table_values``/``table_bits`` the hash table over them.
    """

    origin: NDArray[np.float64]
    cell: float
    points: NDArray[np.float32]
    order: NDArray[np.int64]
    size: int
    cell_keys: NDArray[np.uint64]
    cell_start: NDArray[np.int32]
    cell_count: NDArray[np.int32]
    table_keys: NDArray[np.uint64]
    table_values: NDArray[np.int32]
    table_bits: int

    def rank(self) -> NDArray[np.int64]:
        """For each input row, its index in :attr:`points` (-1 for dropped rows)."""
        rank = np.full(self.size, -1, np.int64)
        rank[self.order] = np.arange(len(self.order))
        return rank


def build_grid(points: NDArray[Any], cell: float) -> PointGrid:
    """Bucket ``points`` (N, C>=3; only xyz is used) into cells of edge ``cell`` metres."""
    array = as_points(points)
    cell = float(cell)
    if not (np.isfinite(cell) and cell > 0):
        raise HeteroError(f"the grid cell size must be a positive number of metres, got {cell!r}")
    origin = lattice_origin(array, cell)
    local = local_float32(array, origin)
    cells, usable = cell_indices(local, cell)
    rows = np.flatnonzero(usable)
    keys = pack_keys(cells[rows])
    order_in_rows = np.argsort(keys, kind="stable")
    sorted_keys = keys[order_in_rows]
    order = rows[order_in_rows]
    cell_keys, starts, counts = np.unique(sorted_keys, return_index=True, return_counts=True)
    table_keys, table_values, bits = build_table(cell_keys)
    return PointGrid(
        origin=origin,
        cell=cell,
        points=np.ascontiguousarray(local[order]),
        order=order.astype(np.int64),
        size=len(array),
        cell_keys=cell_keys,
        cell_start=starts.astype(np.int32),
        cell_count=counts.astype(np.int32),
        table_keys=table_keys,
        table_values=table_values,
        table_bits=bits,
    )


@dataclass(frozen=True)
class Matches:
    """Nearest-neighbour correspondences: ``index`` (N,) int64 target row or -1 and
    ``distance`` (N,) float32 metres (inf where there is none)."""

    index: NDArray[np.int64]
    distance: NDArray[np.float32]


@dataclass(frozen=True)
class NormalEquations:
    """Point-to-plane Gauss-Newton system: ``jtj`` (6, 6), ``jtr`` (6,) float64, ``cost``
    (sum of weighted squared residuals, m^2) and ``count`` (terms)."""

    jtj: NDArray[np.float64]
    jtr: NDArray[np.float64]
    cost: float
    count: int


@dataclass(frozen=True)
class Alignment:
    """The result of :func:`align`.

    ``transform`` (4x4 float64) maps source into target coordinates; ``rmse`` is the
    point-to-plane residual (m) over the ``inliers`` matched source points of the last
    iteration; ``fitness`` the matched fraction of the downsampled source; ``device`` the
    address the kernels ran on.
    """

    transform: NDArray[np.float64]
    iterations: int
    converged: bool
    rmse: float
    inliers: int
    fitness: float
    device: str


# -- rigid-motion helpers ------------------------------------------------------------------------


def _rotation(omega: NDArray[np.float64]) -> NDArray[np.float64]:
    """Rodrigues: the rotation matrix of rotation vector ``omega`` (radians)."""
    angle = float(np.linalg.norm(omega))
    if angle < 1e-12:
        return np.eye(3)
    axis = omega / angle
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    rotation: NDArray[np.float64] = np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * (k @ k)
    return rotation


def _translation(offset: NDArray[np.float64]) -> NDArray[np.float64]:
    matrix = np.eye(4)
    matrix[:3, 3] = offset
    return matrix


def apply_increment(
    transform: NDArray[Any], increment: NDArray[Any], center: NDArray[Any]
) -> NDArray[np.float64]:
    """``transform`` moved by ``increment`` = (w, d) applied on the left about ``center``.

    ``w`` is a rotation vector (radians) about ``center`` (target frame, metres) and ``d``
    a translation (metres), as solved from :func:`normal_equations` (center: the grid
    origin).
    """
    xi = np.asarray(increment, np.float64)
    step = np.eye(4)
    step[:3, :3] = _rotation(xi[:3])
    step[:3, 3] = xi[3:]
    c = np.asarray(center, np.float64)
    return _translation(c) @ step @ _translation(-c) @ as_rigid(transform)


def _rt(matrix: NDArray[np.float64]) -> NDArray[np.float32]:
    """R row-major then t, as float32 for the kernels."""
    return np.concatenate([matrix[:3, :3].ravel(), matrix[:3, 3]]).astype(np.float32)


def _query_frame(
    queries: NDArray[Any], transform: NDArray[np.float64], grid: PointGrid
) -> tuple[NDArray[np.float32], NDArray[np.float64]]:
    """Queries as float32 rows plus the transform from those rows into the grid frame.

    The rows are relative to an origin near the queries, float32 queries too: the device
    moves rows in float32, and a translation of geo-referenced size (10^5-10^6 m) in that
    product lost decimetres that the float64 reference kept (other matches, other
    distances).  A float32 origin makes the float32 shift exact.
    """
    origin = lattice_origin(queries, grid.cell)
    if queries.dtype == np.float32:
        origin = origin.astype(np.float32).astype(np.float64)
    rows = np.ascontiguousarray(local_float32(queries, origin))
    return rows, _translation(-grid.origin) @ transform @ _translation(origin)


# -- public kernels ------------------------------------------------------------------------------


def nearest_neighbors(
    queries: NDArray[Any],
    target: PointGrid | NDArray[Any],
    max_distance: float,
    *,
    transform: NDArray[Any] | None = None,
    device: ComputeDevice | str | None = None,
) -> Matches:
    """The nearest target point within ``max_distance`` metres of each query.

    ``queries`` (N, C>=3) are moved by ``transform`` (default identity) into the target
    frame first.  ``target`` is a :class:`PointGrid` whose ``cell`` is at least
    ``max_distance``, or a cloud (a grid with ``cell = max_distance`` is built).  Ties go
    to the target point that comes first in the grid's order.
    """
    array = as_points(queries, what="queries")
    radius = float(max_distance)
    if not (np.isfinite(radius) and radius > 0):
        raise HeteroError(f"max_distance must be a positive number of metres, got {max_distance!r}")
    grid = target if isinstance(target, PointGrid) else build_grid(target, radius)
    if radius > grid.cell * (1 + 1e-6):
        raise HeteroError(
            f"max_distance {radius} m exceeds the grid cell {grid.cell} m: the 27-cell "
            "search would miss neighbours; build the grid with a larger cell"
        )
    matrix = np.eye(4) if transform is None else as_rigid(transform)
    if len(array) == 0 or len(grid.points) == 0:
        return Matches(np.full(len(array), -1, np.int64), np.full(len(array), np.inf, np.float32))
    rows, to_grid = _query_frame(array, matrix, grid)
    dev = as_device(device)
    if isinstance(dev, OpenCLDevice):
        from adcloud.hetero._kernels.icp import GridOnDevice, MatchOnDevice  # noqa: PLC0415

        matcher = MatchOnDevice(GridOnDevice(dev, grid), rows)
        matcher.set_transform(_rt(to_grid))
        matcher.nearest(radius)
        index, d2 = matcher.matches()
    else:
        index, d2 = _nearest_numpy(rows, to_grid, grid, radius)
    found = index >= 0
    original = np.full(len(array), -1, np.int64)
    original[found] = grid.order[index[found]]
    return Matches(original, np.sqrt(d2).astype(np.float32))


def estimate_normals(
    points: NDArray[Any],
    radius: float,
    *,
    min_neighbors: int = _NORMAL_NEIGHBORS,
    viewpoint: NDArray[Any] | None = None,
    device: ComputeDevice | str | None = None,
) -> NDArray[np.float32]:
    """Unit normals (N, 3) float32 by PCA of the neighbours within ``radius`` metres.

    The normal is the eigenvector of the smallest eigenvalue of the neighbourhood's
    covariance (the point itself included), oriented towards ``viewpoint`` (default: the
    frame's origin).  Rows with fewer than ``min_neighbors`` neighbours, a degenerate
    neighbourhood (all eigenvalues equal, e.g. duplicated points) or non-finite points are
    NaN.
    """
    array = as_points(points)
    view = _viewpoint(viewpoint)
    out = np.full((len(array), 3), np.nan, np.float32)
    if len(array) == 0:
        return out
    grid = build_grid(array, radius)
    if len(grid.points) == 0:
        return out
    out[grid.order] = _grid_normals(grid, radius, min_neighbors, view, as_device(device))
    return out


def _viewpoint(viewpoint: NDArray[Any] | None) -> NDArray[np.float64] | None:
    """``viewpoint`` as a finite (3,) float64 position, or None; :class:`HeteroError` else."""
    if viewpoint is None:
        return None
    try:
        view = np.asarray(viewpoint, np.float64)
    except (TypeError, ValueError) as err:
        raise HeteroError(f"viewpoint must be an (x, y, z) position in metres: {err}") from err
    if view.shape != (3,) or not np.isfinite(view).all():
        msg = f"viewpoint must be a finite (x, y, z) position in metres, got {viewpoint!r}"
        raise HeteroError(msg)
    return view


def _grid_normals(
    grid: PointGrid,
    radius: float,
    min_neighbors: int,
    viewpoint: NDArray[Any] | None,
    device: ComputeDevice,
    on_device: GridOnDevice | None = None,
) -> NDArray[np.float32]:
    """:func:`estimate_normals` of ``grid``'s own points, in its sorted order (any cell
    size of at least ``radius``: the search reads the neighbouring cells). ``on_device``:
    the grid already in the device's buffers."""
    if isinstance(device, OpenCLDevice):
        from adcloud.hetero._kernels.icp import GridOnDevice  # noqa: PLC0415

        uploaded = on_device or GridOnDevice(device, grid)
        normals = uploaded.normals_of_grid(radius, min_neighbors)
    else:
        normals = _normals_numpy(grid, radius, min_neighbors)
    view = np.zeros(3) if viewpoint is None else np.asarray(viewpoint, np.float64)
    towards = (view - grid.origin).astype(np.float32) - grid.points
    flip = np.einsum("ij,ij->i", normals, towards) < 0
    normals[flip] *= -1
    return normals


def normal_equations(
    source: NDArray[Any],
    grid: PointGrid,
    normals: NDArray[Any],
    index: NDArray[Any],
    transform: NDArray[Any],
    *,
    huber: float = 0.0,
    device: ComputeDevice | str | None = None,
) -> NormalEquations:
    """Point-to-plane normal equations of matched points (see the module docstring).

    ``source`` (N, C>=3) in the source frame; ``grid`` of the target; ``normals`` (rows of
    the target cloud, as :func:`estimate_normals` returns them); ``index`` (N,) the matched
    target row per source point or -1 (:func:`nearest_neighbors`); ``transform`` source to
    target.  ``huber`` > 0 weights residuals above it (metres) by ``huber / |r|``.
    Unmatched points and matches with a NaN normal add nothing.
    """
    array = as_points(source, what="source")
    matrix = as_rigid(transform)
    try:
        match = np.asarray(index, np.int64)
        target_normals = np.asarray(normals, np.float32)
    except (TypeError, ValueError) as err:
        raise HeteroError(f"index and normals must be arrays of numbers: {err}") from err
    if match.shape != (len(array),) or target_normals.shape != (grid.size, 3):
        raise HeteroError("index must have one entry per source row and normals one per target row")
    bad = np.flatnonzero((match < -1) | (match >= grid.size))
    if len(bad):
        msg = (
            f"index[{bad[0]}] = {match[bad[0]]} is not a target row (0..{grid.size - 1}) "
            f"or -1 ({len(bad)} such entries)"
        )
        raise HeteroError(msg)
    if len(array) == 0 or len(grid.points) == 0:
        return NormalEquations(np.zeros((6, 6)), np.zeros(6), 0.0, 0)
    rank = grid.rank()
    sorted_match = np.where(match >= 0, rank[np.clip(match, 0, None)], -1).astype(np.int32)
    sorted_normals = np.ascontiguousarray(target_normals[grid.order])
    rows, to_grid = _query_frame(array, matrix, grid)
    dev = as_device(device)
    if isinstance(dev, OpenCLDevice):
        from adcloud.hetero._kernels.icp import GridOnDevice, MatchOnDevice  # noqa: PLC0415

        matcher = MatchOnDevice(GridOnDevice(dev, grid, sorted_normals), rows)
        matcher.set_transform(_rt(to_grid))
        matcher.set_matches(sorted_match)
        sums = matcher.system(huber)
    else:
        sums = _system_numpy(rows, to_grid, grid, sorted_normals, sorted_match, huber)
    return _unpack_system(sums)


def _unpack_system(sums: NDArray[np.float64]) -> NormalEquations:
    jtj = np.zeros((6, 6))
    jtj[np.triu_indices(6)] = sums[:21]
    jtj = jtj + np.triu(jtj, 1).T
    return NormalEquations(jtj, sums[21:27].copy(), float(sums[27]), round(sums[28]))


# -- NumPy references ----------------------------------------------------------------------------


def _neighbour_cells(
    cells: NDArray[np.int64], offset: NDArray[np.int64], grid: PointGrid
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(start, count) of the grid cell at ``cells + offset`` (count 0 where empty)."""
    neighbour = cells + offset
    inside = (np.abs(neighbour) < KEY_OFFSET).all(axis=1)
    keys = pack_keys(np.where(inside[:, None], neighbour, 0))
    position = np.searchsorted(grid.cell_keys, keys)
    position = np.minimum(position, len(grid.cell_keys) - 1)
    hit = inside & (grid.cell_keys[position] == keys)
    start = np.where(hit, grid.cell_start[position], 0).astype(np.int64)
    count = np.where(hit, grid.cell_count[position], 0).astype(np.int64)
    return start, count


def _query_cells(
    points: NDArray[np.float32], cell: float
) -> tuple[NDArray[np.int64], NDArray[np.bool_]]:
    """Cells of local points, and which ones the kernels would search (as ``cell_of``)."""
    inv = np.float32(1.0) / np.float32(cell)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = points * inv
    ok = np.isfinite(scaled).all(axis=1)
    ok &= (np.abs(np.where(ok[:, None], scaled, 0)) < np.float32(KEY_OFFSET)).all(axis=1)
    cells = np.zeros(scaled.shape, np.int64)
    cells[ok] = np.floor(scaled[ok]).astype(np.int64)
    return cells, ok


def _nearest_numpy(
    rows: NDArray[np.float32], to_grid: NDArray[np.float64], grid: PointGrid, radius: float
) -> tuple[NDArray[np.int32], NDArray[np.float32]]:
    """Reference grid search: for each of the 27 neighbour cells, walk the k-th point of
    every query's cell in lockstep, keeping the nearest within the radius."""
    moved = (rows.astype(np.float64) @ to_grid[:3, :3].T + to_grid[:3, 3]).astype(np.float32)
    cells, searchable = _query_cells(moved, grid.cell)
    r2 = np.float32(radius) ** 2
    best = np.full(len(rows), -1, np.int32)
    best_d2 = np.full(len(rows), np.inf, np.float32)
    queries = np.flatnonzero(searchable)
    for offset in _OFFSETS:
        start, count = _neighbour_cells(cells[queries], offset, grid)
        active = np.flatnonzero(count > 0)
        k = 0
        while len(active):
            q = queries[active]
            j = start[active] + k
            diff = grid.points[j] - moved[q]
            d2 = np.einsum("ij,ij->i", diff, diff)
            better = (d2 <= r2) & (d2 < best_d2[q])
            best[q[better]] = j[better]
            best_d2[q[better]] = d2[better]
            k += 1
            active = active[count[active] > k]
    return best, best_d2


def _normals_numpy(grid: PointGrid, radius: float, min_neighbors: int) -> NDArray[np.float32]:
    """Reference PCA normals of the grid's points (sorted order), batched ``eigh``."""
    points = grid.points
    m = len(points)
    cells, searchable = _query_cells(points, grid.cell)
    r2 = np.float32(radius) ** 2
    s1 = np.zeros((m, 3))
    s2 = np.zeros((m, 3, 3))
    count = np.zeros(m, np.int64)
    queries = np.flatnonzero(searchable)
    for offset in _OFFSETS:
        start, n_cell = _neighbour_cells(cells[queries], offset, grid)
        active = np.flatnonzero(n_cell > 0)
        k = 0
        while len(active):
            q = queries[active]
            d = (grid.points[start[active] + k] - points[q]).astype(np.float64)
            near = np.einsum("ij,ij->i", d, d) <= r2
            qn, dn = q[near], d[near]  # each query appears once per step: plain adds
            s1[qn] += dn
            s2[qn] += dn[:, :, None] * dn[:, None, :]
            count[qn] += 1
            k += 1
            active = active[n_cell[active] > k]
    normals = np.full((m, 3), np.nan, np.float32)
    enough = count >= min_neighbors
    if enough.any():
        k_inv = 1.0 / count[enough]
        mean = s1[enough] * k_inv[:, None]
        cov = s2[enough] * k_inv[:, None, None] - mean[:, :, None] * mean[:, None, :]
        values, vectors = np.linalg.eigh(cov)
        # All eigenvalues equal (e.g. duplicated points: zero covariance): no normal, as
        # on the device.
        degenerate = values[:, 2] - values[:, 0] <= 1e-6 * np.abs(values[:, 2])
        found = vectors[:, :, 0].astype(np.float32)
        found[degenerate] = np.nan
        normals[enough] = found
    return normals


def _system_numpy(
    rows: NDArray[np.float32],
    to_grid: NDArray[np.float64],
    grid: PointGrid,
    normals: NDArray[np.float32],
    match: NDArray[np.int32],
    huber: float,
) -> NDArray[np.float64]:
    """Reference normal equations (float64), packed like the kernel's sums."""
    matched = np.flatnonzero(match >= 0)
    j = match[matched]
    n = normals[j].astype(np.float64)
    keep = np.isfinite(n).all(axis=1)
    matched, j, n = matched[keep], j[keep], n[keep]
    p = rows[matched].astype(np.float64) @ to_grid[:3, :3].T + to_grid[:3, 3]
    r = np.einsum("ij,ij->i", n, p - grid.points[j])
    w = np.ones_like(r)
    if huber > 0:
        big = np.abs(r) > huber
        w[big] = huber / np.abs(r[big])
    jac = np.concatenate([np.cross(p, n), n], axis=1)
    jtj = np.einsum("i,ij,ik->jk", w, jac, jac)
    jtr = np.einsum("i,ij,i->j", w, jac, r)
    sums = np.zeros(29)
    sums[:21] = jtj[np.triu_indices(6)]
    sums[21:27] = jtr
    sums[27] = float(np.sum(w * r * r))
    sums[28] = float(len(r))
    return sums


# -- align ---------------------------------------------------------------------------------------


class _Matcher(Protocol):
    def set_transform(self, rt: NDArray[np.float32]) -> None: ...
    def nearest(self, max_distance: float) -> None: ...
    def system(self, huber: float) -> NDArray[np.float64]: ...


class _NumpyMatcher:
    """The NumPy reference behind the same calls as the device matcher."""

    def __init__(
        self, grid: PointGrid, normals: NDArray[np.float32], rows: NDArray[np.float32]
    ) -> None:
        self.grid = grid
        self.normals = normals
        self.rows = rows
        self.to_grid = np.eye(4)
        self.match = np.full(len(rows), -1, np.int32)

    def set_transform(self, rt: NDArray[np.float32]) -> None:
        self.to_grid = np.eye(4)
        self.to_grid[:3, :3] = rt[:9].astype(np.float64).reshape(3, 3)
        self.to_grid[:3, 3] = rt[9:]

    def nearest(self, max_distance: float) -> None:
        self.match, _ = _nearest_numpy(self.rows, self.to_grid, self.grid, max_distance)

    def system(self, huber: float) -> NDArray[np.float64]:
        return _system_numpy(self.rows, self.to_grid, self.grid, self.normals, self.match, huber)


def _orthonormalize(matrix: NDArray[np.float64]) -> NDArray[np.float64]:
    u, _, vt = np.linalg.svd(matrix[:3, :3])
    out = matrix.copy()
    out[:3, :3] = u @ vt
    return out


def align(
    source: NDArray[Any],
    target: NDArray[Any],
    init: NDArray[Any] | None = None,
    *,
    voxel_size: float = 0.25,
    max_distance: float = 1.0,
    normal_radius: float | None = None,
    iterations: int = 30,
    huber: float = 0.1,
    tolerance: float = 1e-5,
    device: ComputeDevice | str | None = None,
) -> Alignment:
    """Point-to-plane ICP: the rigid transform that maps ``source`` onto ``target``.

    Both clouds (N, C>=3, metres) are voxel-downsampled (``voxel_size``; 0 keeps them),
    the target's normals estimated within ``normal_radius`` (default ``2.5 * voxel_size``,
    at least 0.3 m), and Gauss-Newton runs from ``init`` (default identity) for at most
    ``iterations`` steps, matching within ``max_distance`` metres, until a step moves less
    than ``tolerance`` (radians and metres); ``iterations=0`` evaluates ``init`` (its
    ``rmse``, ``inliers`` and ``fitness``) without moving it.  Residuals above ``huber`` metres are
    down-weighted (Huber; 0 for plain least squares).  Correspondences and the 6x6 reduction run on
    the device with the clouds kept in device buffers between iterations.
    """
    # a negative size used to keep the clouds as they were, as 0 does
    number = isinstance(voxel_size, int | float | np.number) and not isinstance(voxel_size, bool)
    if not (number and np.isfinite(voxel_size) and voxel_size >= 0):
        raise HeteroError(f"voxel_size must be 0 (keep the clouds) or more, got {voxel_size!r}")
    whole = isinstance(iterations, int | np.integer) and not isinstance(iterations, bool)
    if not (whole and iterations >= 0):
        raise HeteroError(f"iterations must be a whole number >= 0, got {iterations!r}")
    dev = as_device(device)
    matrix = np.eye(4) if init is None else as_rigid(init)
    src = as_points(source, what="source")[:, :3]
    tgt = as_points(target, what="target")[:, :3]
    if voxel_size > 0:
        src = voxel_downsample(src, voxel_size, device=dev).points
        tgt = voxel_downsample(tgt, voxel_size, device=dev).points
    radius = normal_radius if normal_radius is not None else max(2.5 * voxel_size, 0.3)
    grid = build_grid(tgt, max_distance)
    on_device = None
    if isinstance(dev, OpenCLDevice):
        from adcloud.hetero._kernels.icp import GridOnDevice, MatchOnDevice  # noqa: PLC0415

        on_device = GridOnDevice(dev, grid)
    if radius == max_distance:
        # One grid serves the normals and the matching (the same cells, the same order).
        sorted_normals = _grid_normals(grid, radius, _NORMAL_NEIGHBORS, None, dev, on_device)
    else:
        normals = estimate_normals(tgt, radius, device=dev)
        sorted_normals = np.ascontiguousarray(normals[grid.order])
    src = src[np.isfinite(src).all(axis=1)]
    if len(src) < 6 or len(grid.points) < 6:
        raise HeteroError(f"too few points to align ({len(src)} source, {len(grid.points)} target)")
    if not np.isfinite(sorted_normals).any():
        # every match would add nothing: the error said no correspondences were within
        # max_distance and asked for a closer initial guess
        raise HeteroError(
            f"no target point has a normal: none has {_NORMAL_NEIGHBORS} neighbours within "
            f"normal_radius {radius} m (the target is too sparse); raise normal_radius"
        )
    source_origin = lattice_origin(src, voxel_size or 1.0)
    rows = local_float32(src, source_origin)
    matcher: _Matcher
    if on_device is not None:
        on_device.set_normals(sorted_normals)
        matcher = MatchOnDevice(on_device, rows)
    else:
        matcher = _NumpyMatcher(grid, sorted_normals, rows)
    # Work in the grid frame with source rows relative to their own origin: small numbers.
    local = _translation(-grid.origin) @ matrix @ _translation(source_origin)
    converged = False
    done = 0
    system = NormalEquations(np.zeros((6, 6)), np.zeros(6), 0.0, 0)
    # iterations=0 reported rmse 0 over 0 inliers (a perfect fit): evaluate init instead
    for done in range(1 if iterations else 0, iterations + 1):
        matcher.set_transform(_rt(local))
        matcher.nearest(max_distance)
        system = _unpack_system(matcher.system(huber))
        if system.count < 6:
            raise HeteroError(
                f"ICP iteration {done}: only {system.count} correspondences within "
                f"{max_distance} m; is the initial guess close enough?"
            )
        if not iterations:
            break
        damping = 1e-9 * np.trace(system.jtj) * np.eye(6)
        xi = np.linalg.solve(system.jtj + damping, -system.jtr)
        local = apply_increment(local, xi, np.zeros(3))
        local = _orthonormalize(local)
        if np.linalg.norm(xi[:3]) < tolerance and np.linalg.norm(xi[3:]) < tolerance:
            converged = True
            break
    result = _translation(grid.origin) @ local @ _translation(-source_origin) if done else matrix
    rmse = float(np.sqrt(system.cost / max(system.count, 1)))
    log.debug("ICP: %d iterations, rmse %.4f m, %d inliers", done, rmse, system.count)
    return Alignment(
        transform=result,
        iterations=done,
        converged=converged,
        rmse=rmse,
        inliers=system.count,
        fitness=system.count / len(src),
        device=dev.info.address,
    )
