"""The label stage over tiles: :class:`TileLayers` lookups against one array, the paint test
of tiles padded with their neighbours' strips against the test of the whole grid, and the
grid stage through Spark on tiles 100 km apart (a map no single array could cover)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pyspark.sql import SparkSession

from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.grid import (
    GridSettings,
    GridTile,
    coarsen_tile,
    merge_many_partials,
    overview_factor,
    scan_partials,
)
from adcloud.hdmap.job import (
    GRID_DIR,
    _grid_stage,
    _label_plan,
    _LabelPlan,
    _leave_marker,
    _merge_by_key,
    _paint_records,
    _tile_paint,
)
from adcloud.hdmap.labels import (
    GridLayers,
    LabelSettings,
    markings_from_paint,
    paint_mask_values,
    paint_reach,
)
from adcloud.hdmap.tilelayers import TileLayers
from adcloud.hdmap.trajectory import Trajectory
from tests.hdmap.test_evaluate import grid_tile

ORIGIN = (37.3875, -122.0575, 12.0)


def _tile(key: tuple[int, int], grid: GridSettings, rng: np.random.Generator) -> GridTile:
    """A tile with random ground: 30 % of its cells unobserved."""
    n = grid.tile_cells
    seen = rng.random((n, n)) > 0.3
    elevation = np.where(seen, rng.normal(0.0, 0.2, (n, n)), np.nan).astype(np.float32)
    reflectance = np.where(seen, rng.uniform(5, 200, (n, n)), np.nan).astype(np.float32)
    tile = grid_tile(key, elevation, reflectance)
    assert tile.origin == grid.tile_origin(key) and tile.resolution == grid.resolution
    return tile


def _one_array(tiles: dict[tuple[int, int], GridTile], grid: GridSettings) -> GridLayers:
    """The tiles as one :class:`GridLayers` over their bounding box (NaN between them)."""
    n = grid.tile_cells
    x0, y0 = min(k[0] for k in tiles), min(k[1] for k in tiles)
    w = (max(k[0] for k in tiles) - x0 + 1) * n
    h = (max(k[1] for k in tiles) - y0 + 1) * n
    refl = np.full((h, w), np.nan, np.float32)
    elev = np.full((h, w), np.nan, np.float32)
    count = np.zeros((h, w), np.int32)
    for (kx, ky), t in tiles.items():
        r, c = (ky - y0) * n, (kx - x0) * n
        refl[r : r + n, c : c + n] = t.reflectance_mean
        elev[r : r + n, c : c + n] = t.elevation_mean
        count[r : r + n, c : c + n] = t.count
    return GridLayers(grid.tile_origin((x0, y0)), grid.resolution, refl, elev, count)


def test_tile_lookups_match_one_array() -> None:
    """Elevation and observed cells looked up tile by tile are those of one array over the
    same tiles, inside, between (a missing tile) and outside them; a small cache reloads
    an evicted tile."""
    grid = GridSettings(tile_cells=40)
    rng = np.random.default_rng(1)
    keys = [(-1, 0), (0, 0), (1, 0), (-1, 1), (1, 1)]  # (0, 1) missing
    tiles = {k: _tile(k, grid, rng) for k in keys}
    loaded: list[tuple[int, int]] = []

    def load(key: tuple[int, int]) -> GridTile:
        loaded.append(key)
        return tiles[key]

    view = TileLayers(keys, grid, load, cache_tiles=2)
    dense = _one_array(tiles, grid)
    assert view.origin == dense.origin and view.resolution == dense.resolution
    xy = rng.uniform([-3.0, -1.0], [5.0, 5.0], (5000, 2))  # around and beyond the tiles
    assert np.array_equal(view.cells_of(xy)[0], dense.cells_of(xy)[0])
    assert np.array_equal(view.elevation_at(xy), dense.elevation_at(xy), equal_nan=True)
    row = rng.integers(-10, 100, (50, 60))
    col = rng.integers(-10, 130, (50, 60))
    assert np.array_equal(view.observed_at(row, col), dense.observed_at(row, col))
    assert view.observed_at(row, col).shape == (50, 60)
    # a cached tile is not read again; one evicted by two others is
    reads = view.reads
    view.elevation_at(np.array([[1.0, 1.0]]))  # tile (0, 0)
    view.elevation_at(np.array([[1.0, 1.0]]))
    assert view.reads - reads <= 1
    view.elevation_at(np.array([[-1.0, 1.0], [3.0, 1.0]]))  # tiles (-1, 0) and (1, 0)
    reads = view.reads
    view.elevation_at(np.array([[1.0, 1.0]]))
    assert view.reads == reads + 1
    assert loaded.count((0, 0)) >= 2


def test_tiles_far_apart_are_looked_up_without_an_array_between() -> None:
    """Two tiles 100 km apart: lookups in both read just those two (one array over them
    would be 2 million tiles' worth); a tile of the wrong size is named."""
    grid = GridSettings()
    rng = np.random.default_rng(2)
    tiles = {k: _tile(k, grid, rng) for k in [(0, 0), (5000, 5000)]}
    view = TileLayers(tiles, grid, tiles.__getitem__)
    xy = np.array([[10.0, 10.0], [100_010.0, 100_010.0], [50_000.0, 50_000.0]])
    z = view.elevation_at(xy)
    n = grid.tile_cells
    assert z[0] == pytest.approx(tiles[(0, 0)].elevation_mean[n // 2, n // 2], nan_ok=True)
    assert z[1] == pytest.approx(tiles[(5000, 5000)].elevation_mean[n // 2, n // 2], nan_ok=True)
    assert np.isnan(z[2]) and view.reads == 2

    small = GridSettings(tile_cells=40)
    wrong = TileLayers([(3, 4)], grid, lambda key: _tile(key, small, rng))
    with pytest.raises(HdmapError, match=r"grid tile \(3, 4\) has \(40, 40\) cells"):
        wrong.elevation_at(np.array([[61.0, 81.0]]))
    with pytest.raises(HdmapError, match="at least one tile"):
        TileLayers([], grid, tiles.__getitem__)


def test_padded_tiles_paint_like_one_array() -> None:
    """Each tile tested with its neighbours' strips gives exactly the paint cells of the
    whole grid tested as one array, across tile edges and next to a missing tile."""
    grid = GridSettings(tile_cells=40)
    labels = LabelSettings()
    halo = paint_reach(labels, grid.resolution)
    assert 0 < halo < grid.tile_cells
    rng = np.random.default_rng(3)
    keys = [(x, y) for x in range(3) for y in range(3) if (x, y) != (2, 2)]
    tiles = {k: _tile(k, grid, rng) for k in keys}
    dense = _one_array(tiles, grid)
    values = np.where(dense.observed, dense.reflectance, np.nan).astype(np.float32)
    # dim asphalt with bright stripes crossing the tile edges (and some bright noise)
    values = np.where(np.isfinite(values), np.float32(20.0) + values / 20, np.nan)
    values[:, 38:41] *= 8
    values[78:81, :] *= 8
    values = values.astype(np.float32)
    n = grid.tile_cells
    path = np.column_stack([np.linspace(0, 6, 200), np.linspace(0, 6, 200)])
    plan = _LabelPlan(frozenset(keys), path, labels, halo, 1)
    records: dict[tuple[int, int], list[tuple[str, Any]]] = defaultdict(list)
    for kx, ky in keys:
        block = (slice(ky * n, ky * n + n), slice(kx * n, kx * n + n))
        for key, record in _paint_records((kx, ky), values[block], dense.elevation[block], plan):
            records[key].append(record)
    found = set()
    for key, recs in records.items():
        core = next(v for kind, v in recs if kind == "core")
        halos = [v for kind, v in recs if kind == "halo"]
        assert len(halos) == sum(
            (key[0] + dx, key[1] + dy) in tiles
            for dx in (-1, 0, 1)
            for dy in (-1, 0, 1)
            if dx or dy
        )
        rows, cols, z = _tile_paint(key, core, halos, plan, grid)
        assert np.array_equal(z, dense.elevation[rows, cols])
        found |= set(zip(rows.tolist(), cols.tolist(), strict=True))
    # the whole grid, with unobserved cells (not a mirror image) beyond its edges
    padded = np.pad(values, halo, constant_values=np.nan)
    whole = paint_mask_values(padded, labels, grid.resolution)[halo:-halo, halo:-halo]
    expected = set(zip(*(a.tolist() for a in np.nonzero(whole)), strict=True))
    assert len(expected) > 100
    assert found == expected


def test_coarse_tiles_keep_counts_and_means() -> None:
    grid = GridSettings(tile_cells=40)
    tile = _tile((2, -1), grid, np.random.default_rng(4))
    coarse = coarsen_tile(tile, 4)
    assert coarse.shape == (10, 10) and coarse.resolution == pytest.approx(0.2)
    assert coarse.origin == tile.origin and coarse.key == tile.key
    assert coarse.count.sum() == tile.count.sum()
    block = tile.elevation_mean[:4, 4:8]
    assert coarse.elevation_mean[0, 1] == pytest.approx(np.nanmean(block), rel=1e-5)
    with pytest.raises(HdmapError, match="must be >= 1 and divide"):
        coarsen_tile(tile, 3)
    assert overview_factor([(0, 0)], 400) == 1
    assert overview_factor([(0, 0), (10, 0)], 400) == 5  # 4400 cells: at least 1024 px
    assert overview_factor([(0, 0), (10, 0)], 400, max_pixels=2048) == 2
    assert overview_factor([(0, 0), (5000, 0)], 400) == 400


def _flat_scan(
    x0: float, y0: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sweep of flat asphalt around a sensor 1.9 m above ``(x0, y0)``, with two solid
    15 cm lines 1.75 m either side of it, running north."""
    gx, gy = np.meshgrid(np.arange(-6.0, 6.0, 0.025), np.arange(-9.0, 9.0, 0.025))
    xy = np.column_stack([gx.ravel(), gy.ravel()])
    xy = xy[np.hypot(xy[:, 0], xy[:, 1]) > 2.5]
    paint = np.minimum(np.abs(xy[:, 0] - 1.75), np.abs(xy[:, 0] + 1.75)) < 0.075
    intensity = np.where(paint, 120.0, 20.0) + rng.normal(0, 2, len(xy))
    xyz = np.column_stack([xy + np.array([x0, y0]), rng.normal(0.0, 0.005, len(xy))])
    return xyz, intensity.astype(np.float32), np.array([x0, y0, 1.9])


def _straight(x0: float, y0: float, y1: float) -> Trajectory:
    y = np.arange(y0, y1, 0.5)
    xyz = np.column_stack([np.full(len(y), x0), y, np.zeros(len(y))])
    q = np.tile([0.0, 0.0, np.sqrt(0.5), np.sqrt(0.5)], (len(y), 1))  # heading north
    return Trajectory.from_xyz_quat(np.arange(len(y), dtype=np.int64) * 50_000_000, xyz, q)


def test_grid_stage_finds_lines_on_tiles_100_km_apart(spark: SparkSession, tmp_path: Path) -> None:
    """Two stretches of road 100 km apart in one map: the grid stage writes their tiles and
    finds their paint on the executors, and the lines come out at both places, with the
    driver reading only tiles along them."""
    grid = GridSettings()
    rng = np.random.default_rng(5)
    places = [(10.0, 10.0), (100_010.0, 100_010.0)]
    pairs = []
    for x0, y0 in places:
        for dy in (-6.0, 0.0, 6.0):
            xyz, intensity, sensor = _flat_scan(x0, y0 + dy, rng)
            pairs += scan_partials(xyz, intensity, grid, sensor_xyz=sensor, device="numpy")
    merged = _merge_by_key(spark.sparkContext.parallelize(pairs, 4), merge_many_partials)
    driven = {f"d{i}": _straight(x0, y0 - 12, y0 + 12) for i, (x0, y0) in enumerate(places)}
    corridor = frozenset({k for k, _ in pairs})
    result = _grid_stage(
        merged,
        out_dir=tmp_path,
        token=_leave_marker(tmp_path),
        origin=ORIGIN,
        plan=_label_plan(driven, corridor, grid, LabelSettings()),
        grid=grid,
    )
    assert sorted(result.patches) == sorted(corridor)
    assert len(list((tmp_path / GRID_DIR).glob("*.tif"))) == len(corridor)
    assert {t.key for t in result.overview} == set(corridor)
    assert result.overview_factor == 400  # a picture of 100 km: one pixel per tile
    assert result.layers is not None and len(result.paint) > 0
    markings = markings_from_paint(result.layers, result.paint, list(driven.values()))
    assert result.layers.reads <= len(corridor)
    assert len(markings) == 4, [m.points[[0, -1]] for m in markings]
    for x0, y0 in places:
        here = [m for m in markings if abs(m.points[:, 1].mean() - y0) < 20]
        offsets = sorted(float(np.median(m.points[:, 0])) - x0 for m in here)
        assert offsets == pytest.approx([-1.75, 1.75], abs=0.05)
        assert all(m.type == "solid" and m.length_m > 10 for m in here)
