"""Grid rasterization of points: per-cell count, mean/min/max height and mean intensity.

Frames and units: metres in the points' frame.  A :class:`GridSpec` has ``height`` rows and
``width`` columns of square cells of ``cell_size``; cell ``(row, col)`` covers
``x in [origin_x + col * cell_size, origin_x + (col + 1) * cell_size)`` and likewise ``y``
with ``row`` -- so row 0 is the grid's *lowest* y (flip the rows to draw it north-up).
A point's cell is computed in float32 as ``floor((x - origin_x) * float32(1 / cell_size))``,
identically on devices and in the NumPy reference.

Points outside the grid, with a non-finite x, y or z, or with a non-finite intensity (when
intensity is used) are skipped.  Empty cells have count 0 and NaN in the float layers.

On devices, per-cell sums are float32 (the reference sums in float64): means agree to about
1e-6 relative up to ~10k points per cell; denser cells lose digits of the mean in proportion
to their heights' magnitude (100k points at z ~ 1,500 m: metres), so give heights relative
to a reference near the data, as :mod:`adcloud.hdmap` does.  Min and max are exact.

Two device strategies (see ``_kernels/raster.cl``): ``atomic`` (GPUs) and ``binned`` (CPUs,
no atomics, deterministic; counts are exact up to 2^24 points per cell);
``host`` runs the NumPy reference whatever the device.  ``auto`` picks by device kind, and
on a CPU device (PoCL) gives small rasters -- under :data:`HOST_BELOW` points and cells, such
as one LiDAR sweep's -- to the host: the kernels then run on the very cores NumPy would use,
and their five launches (~1 ms each on PoCL) cost more than the whole reduction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, DeviceKind, OpenCLDevice, as_device
from adcloud.hetero.errors import HeteroError
from adcloud.hetero.transform import as_points

__all__ = ["HOST_BELOW", "GridSpec", "Raster", "rasterize"]

_STRATEGIES = ("auto", "atomic", "binned", "host")
#: On CPU devices, ``auto`` rasterizes on the host when both the points and the cells are
#: fewer (``benchmarks/bench_hetero.py``: one sweep, 22k points into 3k-16k cells, takes
#: 0.7-2 ms in NumPy and 4-6 ms on PoCL; from ~300k points or ~150k cells PoCL is faster).
HOST_BELOW = 50_000
_MAX_CELLS = 2**31 - 1


@dataclass(frozen=True)
class GridSpec:
    """A 2-D grid: origin (m), square cell edge (m), width (columns) and height (rows)."""

    origin_x: float
    origin_y: float
    cell_size: float
    width: int
    height: int

    def __post_init__(self) -> None:
        if not (_is_real(self.cell_size) and np.isfinite(self.cell_size) and self.cell_size > 0):
            raise HeteroError(
                f"cell_size must be a positive number of metres, got {self.cell_size!r}"
            )
        if not all(_is_real(v) and np.isfinite(v) for v in (self.origin_x, self.origin_y)):
            raise HeteroError(
                f"the grid origin must be finite numbers, got {self.origin_x!r}, {self.origin_y!r}"
            )
        for name in ("width", "height"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise HeteroError(f"grid {name} must be a whole number of cells, got {value!r}")
        # Python ints: a product of NumPy int32 sizes wraps around and passed the check
        cells = int(self.width) * int(self.height)
        if self.width < 1 or self.height < 1 or cells > _MAX_CELLS:
            raise HeteroError(f"grid size {self.height} x {self.width} is empty or too large")

    @classmethod
    def covering(cls, points: NDArray[Any], cell_size: float, margin: float = 0.0) -> GridSpec:
        """The smallest grid on multiples of ``cell_size`` holding the finite points' x, y.

        Every finite point lands in a cell of it as :func:`rasterize` computes cells (in
        float32), also the points on the edges of its first and last cells.
        """
        array = np.asarray(points)
        if array.ndim != 2 or array.shape[1] < 2:
            raise HeteroError(f"points to cover must be (N, C>=2), got shape {array.shape}")
        xy = array[:, :2] if array.dtype == np.float32 else array[:, :2].astype(np.float64)
        xy = xy[np.isfinite(xy).all(axis=1)]
        if not len(xy):
            raise HeteroError("no finite point to cover")
        if not (_is_real(cell_size) and np.isfinite(cell_size) and cell_size > 0):
            raise HeteroError(f"cell_size must be a positive number of metres, got {cell_size!r}")
        size = float(cell_size)
        lowest, highest = xy.min(axis=0), xy.max(axis=0)
        low = np.floor((lowest.astype(np.float64) - margin) / size) * size
        high = highest.astype(np.float64) + margin
        # The float64 extent alone lost points: float32 cells round up at the far edge, and
        # down below the origin at the near one (the mins and maxes give the extreme cells:
        # rounding keeps the order).
        inv = np.float32(1.0) / np.float32(size)
        first = np.floor(_offsets(lowest, low) * inv)
        while (first < 0).any():
            low = low + np.where(first < 0, first, 0.0) * size
            first = np.floor(_offsets(lowest, low) * inv)
        last = np.floor(_offsets(highest, low) * inv).astype(np.float64)
        width, height = (
            np.maximum(np.floor((high - low) / size), last).astype(np.int64) + 1
        ).tolist()
        return cls(float(low[0]), float(low[1]), size, int(width), int(height))

    @property
    def shape(self) -> tuple[int, int]:
        """``(height, width)``, the shape of every layer."""
        return (self.height, self.width)


@dataclass(frozen=True)
class Raster:
    """The layers of :func:`rasterize`, each ``grid.shape``: ``count`` int32, the others
    float32 (metres for heights, the input's unit for intensity; NaN where empty)."""

    count: NDArray[np.int32]
    mean_z: NDArray[np.float32]
    min_z: NDArray[np.float32]
    max_z: NDArray[np.float32]
    mean_intensity: NDArray[np.float32]
    grid: GridSpec


def rasterize(
    points: NDArray[Any],
    grid: GridSpec,
    *,
    intensity: NDArray[Any] | None = None,
    intensity_column: int | None = 3,
    strategy: str = "auto",
    device: ComputeDevice | str | None = None,
) -> Raster:
    """Rasterize ``points`` (N, C>=3: x y z [intensity ...]) into ``grid``.

    Intensity comes from ``intensity`` (N,) when given, else from column
    ``intensity_column`` of ``points`` when it exists, else the layer is all NaN.
    ``strategy``: ``auto``, ``atomic``, ``binned`` (devices only) or ``host`` (see the
    module doc).
    """
    array = as_points(points)
    if strategy not in _STRATEGIES:
        raise HeteroError(f"strategy must be one of {', '.join(_STRATEGIES)}, got {strategy!r}")
    values: NDArray[np.float32] | None = None
    column: int | None = None
    if intensity is not None:
        values = np.ascontiguousarray(np.asarray(intensity).reshape(-1), np.float32)
        if len(values) != len(array):
            raise HeteroError(f"intensity has {len(values)} values for {len(array)} points")
    elif intensity_column is not None and intensity_column < array.shape[1]:
        if intensity_column < 3:
            raise HeteroError("intensity_column must be 3 or more (0-2 are x y z)")
        column = intensity_column
    dev = as_device(device)
    if strategy == "auto" and isinstance(dev, OpenCLDevice) and dev.info.kind == DeviceKind.CPU:
        small = len(array) < HOST_BELOW and grid.width * grid.height < HOST_BELOW
        strategy = "host" if small else "binned"
    if not isinstance(dev, OpenCLDevice) or len(array) == 0 or strategy == "host":
        layers = _raster_numpy(array, values, column, grid)
        return Raster(**layers, grid=grid)
    from adcloud.hetero._kernels import raster as kernels  # noqa: PLC0415 - needs pyopencl

    origin = (grid.origin_x, grid.origin_y)
    if array.dtype == np.float32:
        rows = np.ascontiguousarray(array)
    else:
        rows = _local_rows(array, grid)
        origin = (0.0, 0.0)
    if strategy == "auto":
        strategy = "binned" if dev.info.kind == DeviceKind.CPU else "atomic"
    layers = kernels.rasterize(
        dev, rows, values, column, origin, grid.cell_size, grid.shape, strategy
    )
    return Raster(**layers, grid=grid)


def _local_rows(array: NDArray[Any], grid: GridSpec) -> NDArray[np.float32]:
    """float32 rows with x, y relative to the grid origin (shifted in float64)."""
    rows = array.astype(np.float32)
    rows[:, 0] = (array[:, 0] - grid.origin_x).astype(np.float32)
    rows[:, 1] = (array[:, 1] - grid.origin_y).astype(np.float32)
    return rows


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool, string or None; a NumPy scalar or
    0-d array is one)."""
    if isinstance(value, bool | str | bytes):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _offsets(values: NDArray[Any], origin: Any) -> NDArray[np.float32]:
    """float32 offsets of coordinates from a grid origin, as :func:`rasterize` computes
    them: float32 input in float32, anything else in float64 and then rounded."""
    if values.dtype == np.float32:
        offsets: NDArray[np.float32] = values - np.asarray(origin).astype(np.float32)
        return offsets
    rounded: NDArray[np.float32] = (values - origin).astype(np.float32)
    return rounded


def _raster_numpy(
    array: NDArray[Any],
    values: NDArray[np.float32] | None,
    column: int | None,
    grid: GridSpec,
) -> dict[str, NDArray[Any]]:
    """The NumPy reference: ``np.bincount`` sums and ``np.minimum.at``/``maximum.at``."""
    x = _offsets(array[:, 0], grid.origin_x)
    y = _offsets(array[:, 1], grid.origin_y)
    z = array[:, 2].astype(np.float32)
    if values is None and column is not None:
        values = array[:, column].astype(np.float32)
    inv = np.float32(1.0) / np.float32(grid.cell_size)
    with np.errstate(invalid="ignore", over="ignore"):
        fx = x * inv
        fy = y * inv
    ok = (fx >= 0) & (fx < grid.width) & (fy >= 0) & (fy < grid.height) & np.isfinite(z)
    if values is not None:
        ok &= np.isfinite(values)
    cell = fy[ok].astype(np.int64) * grid.width + fx[ok].astype(np.int64)
    cells = grid.width * grid.height
    zs = z[ok]
    count = np.bincount(cell, minlength=cells)
    empty = count == 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_z = np.bincount(cell, weights=zs, minlength=cells) / count
        if values is not None:
            mean_v = np.bincount(cell, weights=values[ok], minlength=cells) / count
        else:
            mean_v = np.full(cells, np.nan)
    min_z = np.full(cells, np.inf, np.float32)
    np.minimum.at(min_z, cell, zs)
    max_z = np.full(cells, -np.inf, np.float32)
    np.maximum.at(max_z, cell, zs)
    min_z[empty] = np.nan
    max_z[empty] = np.nan
    shape = grid.shape
    return {
        "count": count.astype(np.int32).reshape(shape),
        "mean_z": mean_z.astype(np.float32).reshape(shape),
        "min_z": min_z.reshape(shape),
        "max_z": max_z.reshape(shape),
        "mean_intensity": mean_v.astype(np.float32).reshape(shape),
    }
