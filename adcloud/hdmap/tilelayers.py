"""The grid as the label stage looks it up on the driver: tile by tile, never as one array.

Once the executors have found the paint cells (:mod:`adcloud.hdmap.job`), tracing and
linking lane markings, testing their sides for curbs, scoring their coverage and finding the
ground under signs are point lookups near the roads. One array over the map's bounding box
would cost 12 bytes per 5 cm cell -- 4.8 GB for a 1 km square, 480 GB for 10 km -- so
:class:`TileLayers` loads a tile's ground elevation and observed cells when a lookup first
touches it (from the version's GeoTIFF tiles) and keeps the most recent
``cache_tiles`` of them (0.8 MB each at the default 400 x 400 cells).

Cells are indexed from the south-west corner of the lowest tile key, as
:class:`~adcloud.hdmap.labels.GridLayers` indexes a mosaic of the same tiles, so that both
give the same cells for the same points.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.geotiff import read_grid_tile, tile_file_name
from adcloud.hdmap.grid import GridSettings, GridTile, TileKey

__all__ = ["TileLayers"]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]

#: A loaded tile: ground elevation (m, NaN where unobserved) and observed cells.
_Loaded = tuple[NDArray[np.float32], NDArray[np.bool_]]


class TileLayers:
    """Point lookups on the tiles ``keys`` of a grid (a
    :class:`~adcloud.hdmap.labels.GridLookup`); ``load(key)`` returns a tile's
    :class:`~adcloud.hdmap.grid.GridTile`. Cells of tiles not in ``keys`` are unobserved."""

    def __init__(
        self,
        keys: Iterable[TileKey],
        grid: GridSettings,
        load: Callable[[TileKey], GridTile],
        *,
        cache_tiles: int = 64,
    ) -> None:
        self._keys = frozenset((int(k[0]), int(k[1])) for k in keys)
        if not self._keys:
            raise HdmapError("TileLayers needs at least one tile key")
        if cache_tiles < 1:
            raise HdmapError(f"TileLayers.cache_tiles must be >= 1, got {cache_tiles}")
        self._n = grid.tile_cells
        self._load = load
        self._cache: OrderedDict[TileKey, _Loaded] = OrderedDict()
        self._cache_tiles = cache_tiles
        self._k0 = (min(k[0] for k in self._keys), min(k[1] for k in self._keys))
        self._origin = grid.tile_origin(self._k0)
        self._resolution = grid.resolution
        self.reads = 0
        """Tiles loaded so far (a tile evicted and needed again counts again)."""

    @classmethod
    def from_directory(
        cls, directory: str | Path, keys: Iterable[TileKey], grid: GridSettings, **kwargs: int
    ) -> TileLayers:
        """Lookups on the GeoTIFF tiles in ``directory`` (a map version's ``grid/``)."""
        root = Path(directory)

        def load(key: TileKey) -> GridTile:
            return read_grid_tile(root / tile_file_name(key)).tile

        return cls(keys, grid, load, **kwargs)

    @property
    def origin(self) -> tuple[float, float]:
        """Map-frame south-west corner of cell ``(0, 0)`` (m): the lowest key's tile corner."""
        return self._origin

    @property
    def resolution(self) -> float:
        """Cell edge (m)."""
        return self._resolution

    @property
    def first_key(self) -> TileKey:
        """The lowest tile key (x, then y): cell ``(0, 0)`` lies in that tile's corner."""
        return self._k0

    @property
    def keys(self) -> frozenset[TileKey]:
        """The tiles looked up."""
        return self._keys

    def cells_of(self, xy: F64) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Row and column of the cells holding map-frame points ``xy`` (n, 2)."""
        pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
        col = np.floor((pts[:, 0] - self._origin[0]) / self._resolution).astype(np.int64)
        row = np.floor((pts[:, 1] - self._origin[1]) / self._resolution).astype(np.int64)
        return row, col

    def elevation_at(self, xy: F64) -> F64:
        """Ground elevation (m) of the cells under ``xy`` (n, 2); NaN where unobserved."""
        row, col = self.cells_of(xy)
        out = np.full(row.shape, np.nan)
        for idx, tile, r, c in self._by_tile(row, col):
            out[idx] = tile[0][r, c]
        return out

    def observed_at(self, row: NDArray[np.int64], col: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Whether the cells ``(row, col)`` (same shape) were observed."""
        flat_r = np.asarray(row, dtype=np.int64).ravel()
        out = np.zeros(flat_r.shape, dtype=bool)
        for idx, tile, r, c in self._by_tile(flat_r, np.asarray(col, dtype=np.int64).ravel()):
            out[idx] = tile[1][r, c]
        return out.reshape(np.shape(row))

    def _by_tile(
        self, row: NDArray[np.int64], col: NDArray[np.int64]
    ) -> Iterable[tuple[NDArray[np.int64], _Loaded, NDArray[np.int64], NDArray[np.int64]]]:
        """For each known tile the cells fall in: their positions, the tile, and their
        row/column inside it."""
        if not len(row):
            return
        n = self._n
        tx, ty = col // n, row // n
        span = np.int64(1 << 31)
        code = (tx + span) * (2 * span) + (ty + span)
        codes, inverse = np.unique(code, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.searchsorted(inverse[order], np.arange(len(codes) + 1))
        for u in range(len(codes)):
            idx = order[bounds[u] : bounds[u + 1]]
            key = (int(tx[idx[0]]) + self._k0[0], int(ty[idx[0]]) + self._k0[1])
            if key not in self._keys:
                continue
            yield idx, self._tile(key), row[idx] % n, col[idx] % n

    def _tile(self, key: TileKey) -> _Loaded:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        tile = self._load(key)
        if tile.shape != (self._n, self._n):
            raise HdmapError(
                f"grid tile {key} has {tile.shape} cells; this map's tiles have "
                f"{self._n} x {self._n} (the tiles and the build settings disagree)"
            )
        observed = np.isfinite(tile.reflectance_mean) & (tile.count > 0)
        loaded = (tile.elevation_mean, observed)
        self.reads += 1
        self._cache[key] = loaded
        if len(self._cache) > self._cache_tiles:
            self._cache.popitem(last=False)
        return loaded
