"""The 5 cm grid (stage 3) and its GeoTIFF/PNG writers, on a real synthetic drive.

The drive's true poses stand in for pose recovery, so these tests measure the grid stage
alone: elevation against the truth raster (ground only), reflectance against the painted
markings, merge-order independence, transient rejection, the Spark shape of the job and
the file round trips.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from functools import reduce
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
from matplotlib.image import imread
from numpy.typing import NDArray
from pyspark.sql import SparkSession
from scipy.spatial import cKDTree

from adcloud.hdmap import grid as hdmap_grid
from adcloud.hdmap import job as hdmap_job
from adcloud.hdmap.drive import DriveData, read_drive
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.geotiff import (
    read_grid_tile,
    tile_file_name,
    write_grid_tile,
    write_mosaic,
    write_preview,
)
from adcloud.hdmap.grid import (
    GROUND,
    LAYERS,
    OBSTACLE,
    GridSettings,
    GridTile,
    TileKey,
    TilePartial,
    classify_points,
    finalize_tile,
    merge_many_partials,
    merge_partials,
    scan_partials,
    transient_patches,
)
from adcloud.hdmap.pcmap import PointCloudMapSettings, deskew, sensor_position, stitch
from adcloud.hdmap.trajectory import Trajectory
from adcloud.synth import DriveConfig, Label, Raster, generate_drive, read_poses, read_raster

log = logging.getLogger(__name__)

Cloud = tuple[NDArray[np.float64], NDArray[np.float32], NDArray[np.float64]]
Partials = list[tuple[TileKey, TilePartial]]

SETTINGS = GridSettings()


@dataclass(frozen=True)
class Drive:
    data: DriveData
    trajectory: Trajectory
    truth: Path
    raster: Raster
    origin: tuple[float, float, float]
    clouds: list[Cloud]


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> Drive:
    """A 12 s drive (16 beams), its true trajectory and its deskewed scans."""
    out = tmp_path_factory.mktemp("grid") / "d.bag"
    config = DriveConfig(seconds=12, seed=7, lidar_beams=16, lidar_columns=512, camera=False)
    result = generate_drive(config, out)
    world = json.loads((result.truth / "world.json").read_text())
    origin = world["origin"]
    geo = (origin["latitude_deg"], origin["longitude_deg"], origin["height_m"])
    data = read_drive(str(result.bag), origin=geo)
    t, xyz, quat = read_poses(result.truth)
    trajectory = Trajectory.from_xyz_quat(t, xyz, quat)
    clouds = []
    for scan in data.scans:
        points, intensity = deskew(scan, trajectory, data.extrinsics, device="numpy")
        clouds.append((points, intensity, sensor_position(scan, trajectory, data.extrinsics)))
    return Drive(data, trajectory, result.truth, read_raster(result.truth), geo, clouds)


def partials_of(clouds: Iterable[Cloud], settings: GridSettings = SETTINGS) -> list[Partials]:
    return [
        scan_partials(xyz, intensity, settings, sensor_xyz=sensor, device="numpy")
        for xyz, intensity, sensor in clouds
    ]


def fold(per_scan: Sequence[Partials]) -> dict[TileKey, TilePartial]:
    merged: dict[TileKey, TilePartial] = {}
    for partials in per_scan:
        for key, part in partials:
            merged[key] = merge_partials(merged[key], part) if key in merged else part
    return merged


def build(
    per_scan: Sequence[Partials], settings: GridSettings = SETTINGS
) -> dict[TileKey, GridTile]:
    return {key: finalize_tile(part, settings) for key, part in fold(per_scan).items()}


@pytest.fixture(scope="module")
def scan_parts(drive: Drive) -> list[Partials]:
    return partials_of(drive.clouds)


@pytest.fixture(scope="module")
def tiles(scan_parts: list[Partials]) -> dict[TileKey, GridTile]:
    return build(scan_parts)


def truth_at(raster: Raster, x: NDArray[np.float64], y: NDArray[np.float64]) -> tuple[Any, ...]:
    """Truth elevation, reflectance and label at map points (and which lie in the raster)."""
    col = np.floor((x - raster.origin[0]) / raster.resolution + 1e-9).astype(np.int64)
    row = np.floor((y - raster.origin[1]) / raster.resolution + 1e-9).astype(np.int64)
    rows, cols = raster.elevation.shape
    inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
    row, col = np.clip(row, 0, rows - 1), np.clip(col, 0, cols - 1)
    return raster.elevation[row, col], raster.reflectance[row, col], raster.label[row, col], inside


def observed_cells(
    tiles: dict[TileKey, GridTile], layer: str = "elevation_mean"
) -> tuple[Any, ...]:
    """x, y, value of every cell with a value in ``layer``, over all tiles."""
    xs, ys, values = [], [], []
    for tile in tiles.values():
        data = tile.layer(layer)
        rows, cols = np.nonzero(np.isfinite(data))
        cx, cy = tile.cell_centers()
        xs.append(cx[cols])
        ys.append(cy[rows])
        values.append(data[rows, cols])
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(values)


# -- accuracy -----------------------------------------------------------------------------------


def test_elevation_rmse_against_the_truth_raster(
    drive: Drive, tiles: dict[TileKey, GridTile], record_property: Any
) -> None:
    x, y, z = observed_cells(tiles)
    truth, _, label, inside = truth_at(drive.raster, x, y)
    error = (z - truth)[inside]
    rmse = float(np.sqrt(np.mean(error**2)))
    record_property("elevation_rmse_m", rmse)
    record_property("observed_cells", int(inside.sum()))
    log.info("elevation RMSE %.4f m over %d cells", rmse, inside.sum())
    assert inside.sum() > 20_000, "too few cells observed to measure anything"
    assert rmse <= 0.03, f"elevation RMSE {rmse:.4f} m over {inside.sum()} cells"
    # Road cells next to the route: most of them are observed, and accurately.
    route = drive.trajectory.xyz[:, :2]
    near, _ = cKDTree(route).query(np.column_stack([x, y]))
    road = inside & (near < 5.0) & np.isin(label, [Label.ROAD, Label.LANE_MARKING])
    assert np.sqrt(np.mean((z - truth)[road] ** 2)) < 0.02


def test_the_road_beside_the_route_is_covered(drive: Drive, tiles: dict[TileKey, GridTile]) -> None:
    raster = drive.raster
    rows, cols = np.nonzero(np.isin(raster.label, [Label.ROAD, Label.LANE_MARKING]))
    x = raster.origin[0] + (cols + 0.5) * raster.resolution
    y = raster.origin[1] + (rows + 0.5) * raster.resolution
    driven = drive.trajectory.between(drive.data.scans[0].stamp, drive.data.scans[-1].stamp)
    dist, _ = cKDTree(driven.xyz[:, :2]).query(np.column_stack([x, y]))
    beside = dist < 4.0
    seen = np.zeros(len(x), bool)
    for tile in tiles.values():
        col = np.floor((x - tile.origin[0]) / tile.resolution).astype(np.int64)
        row = np.floor((y - tile.origin[1]) / tile.resolution).astype(np.int64)
        n = tile.shape[0]
        mine = (col >= 0) & (col < n) & (row >= 0) & (row < n)
        seen[mine] = np.isfinite(tile.elevation_mean[row[mine], col[mine]])
    coverage = seen[beside].mean()
    assert coverage > 0.3, f"only {coverage:.1%} of the road cells beside the route observed"


def test_reflectance_shows_the_painted_markings(
    drive: Drive, tiles: dict[TileKey, GridTile]
) -> None:
    x, y, intensity = observed_cells(tiles, "reflectance_mean")
    _, reflectance, label, inside = truth_at(drive.raster, x, y)
    paint = np.median(intensity[inside & (label == Label.LANE_MARKING)])
    asphalt = np.median(intensity[inside & (label == Label.ROAD)])
    assert paint > 3 * asphalt
    # Mean intensity follows the true reflectance across all ground kinds.
    assert np.corrcoef(intensity[inside], reflectance[inside])[0, 1] > 0.6


def test_objects_are_classified_off_the_ground(drive: Drive) -> None:
    """On labelled LiDAR points: ground points are overwhelmingly ground, objects are not."""
    confusion = np.zeros((11, 3), np.int64)
    for scan, (xyz, _, sensor) in list(zip(drive.data.scans, drive.clouds, strict=True))[::10]:
        assert scan.label is not None
        classes = classify_points(xyz, sensor_xyz=sensor, device="numpy")
        np.add.at(confusion, (scan.label.astype(np.int64), classes.astype(np.int64)), 1)
    ground_labels = [Label.ROAD, Label.LANE_MARKING, Label.CURB, Label.SIDEWALK, Label.TERRAIN]
    objects = [Label.BUILDING, Label.POLE, Label.SIGN, Label.VEGETATION, Label.VEHICLE]
    on_ground = confusion[ground_labels]
    of_objects = confusion[objects]
    assert on_ground[:, GROUND].sum() > 0.9 * on_ground.sum()
    assert of_objects[:, GROUND].sum() < 0.03 * of_objects.sum()
    assert of_objects[:, OBSTACLE].sum() > 0.2 * of_objects.sum()


def test_ground_near_a_standing_point_is_masked_exactly_within_the_radius() -> None:
    # The cell pre-filter in front of the tree query must not lose a pair: ground points at
    # exactly the radius (inclusive), just beyond it, and far from anything, around clusters
    # of standing points far from the origin.
    rng = np.random.default_rng(5)
    settings = GridSettings()
    radius = settings.mask_radius
    far = np.array([5.1e3, -2.7e3])  # float rounding of map-frame metres far from the origin
    poles = rng.uniform(-40, 40, (30, 2)) + far
    standing_xy = np.repeat(poles, 8, axis=0) + rng.normal(0, 0.2, (240, 2))
    angle = rng.uniform(0, 2 * np.pi, 240)
    ring = np.column_stack([np.cos(angle), np.sin(angle)])
    ground_xy = np.concatenate(
        [
            standing_xy + radius * ring,  # at the radius
            standing_xy + np.nextafter(radius, np.inf) * 1.0001 * ring,  # just beyond
            rng.uniform(-45, 45, (3000, 2)) + far,
        ]
    )
    xy = np.concatenate([standing_xy, ground_xy])
    pts = np.column_stack([xy, np.zeros(len(xy))])
    standing = np.arange(len(xy)) < len(standing_xy)
    got = hdmap_grid._near_obstacle(pts, ~standing, standing, settings)
    dist = cKDTree(standing_xy).query(ground_xy)[0]
    want = np.concatenate([np.zeros(len(standing_xy), bool), dist <= radius])
    np.testing.assert_array_equal(got, want)
    assert want.sum() >= 240 and (~want[len(standing_xy) :]).sum() > 1000


def test_a_flat_plane_across_a_tile_edge_is_exact() -> None:
    step = 0.02
    gx, gy = np.meshgrid(np.arange(19.003, 21.0, step), np.arange(5.003, 7.0, step))
    xyz = np.column_stack([gx.ravel(), gy.ravel(), np.full(gx.size, 1.25)])
    parts = dict(scan_partials(xyz, np.full(len(xyz), 100.0), device="numpy"))
    assert sorted(parts) == [(0, 0), (1, 0)]
    assert sum(int(p.count.sum()) for p in parts.values()) == len(xyz)
    for key, part in parts.items():
        tile = finalize_tile(part)
        assert tile.origin == (key[0] * 20.0, 0.0)
        valid = np.isfinite(tile.elevation_mean)
        assert valid.sum() > 0.9 * len(part)
        np.testing.assert_allclose(tile.elevation_mean[valid], 1.25, atol=1e-6)
        np.testing.assert_allclose(tile.reflectance_mean[valid], 100.0, atol=1e-4)
        rows, cols = np.nonzero(valid)
        cx, cy = tile.cell_centers()
        assert np.all((cx[cols] > 19.0) & (cx[cols] < 21.0))
        assert np.all((cy[rows] > 5.0) & (cy[rows] < 7.0))


# -- merging ------------------------------------------------------------------------------------


def assert_same_partial(a: TilePartial, b: TilePartial) -> None:
    for f in fields(TilePartial):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype, f.name
            np.testing.assert_array_equal(va, vb, err_msg=f.name, strict=True)
        else:
            assert va == vb, f.name


def test_merge_order_does_not_change_a_bit(scan_parts: list[Partials]) -> None:
    flat = [item for partials in scan_parts for item in partials]
    by_key: dict[TileKey, list[TilePartial]] = {}
    for key, part in flat:
        by_key.setdefault(key, []).append(part)
    rng = random.Random(3)
    for parts in by_key.values():
        forward = reduce(merge_partials, parts)
        backward = reduce(merge_partials, parts[::-1])
        shuffled = parts[:]
        rng.shuffle(shuffled)
        # a balanced tree of merges, as reduceByKey builds across partitions
        while len(shuffled) > 1:
            shuffled = [
                merge_partials(shuffled[i], shuffled[i + 1])
                if i + 1 < len(shuffled)
                else shuffled[i]
                for i in range(0, len(shuffled), 2)
            ]
        assert_same_partial(forward, backward)
        assert_same_partial(forward, shuffled[0])
        assert_same_partial(
            merge_partials(parts[0], parts[-1]), merge_partials(parts[-1], parts[0])
        )


def test_merging_many_at_once_equals_merging_two_at_a_time(scan_parts: list[Partials]) -> None:
    by_key: dict[TileKey, list[TilePartial]] = {}
    for key, part in (item for partials in scan_parts for item in partials):
        by_key.setdefault(key, []).append(part)
    assert max(len(parts) for parts in by_key.values()) > 5
    for parts in by_key.values():
        assert_same_partial(merge_many_partials(parts), reduce(merge_partials, parts))
        assert_same_partial(merge_many_partials(parts[:1]), parts[0])
    with pytest.raises(HdmapError, match="at least one"):
        merge_many_partials([])


def test_partials_are_small_and_pickle(scan_parts: list[Partials]) -> None:
    sizes = [len(pickle.dumps(partials)) for partials in scan_parts]
    assert max(sizes) < 1_000_000, f"a scan's partials pickle to {max(sizes)} bytes"
    _, part = scan_parts[len(scan_parts) // 2][0]
    assert_same_partial(pickle.loads(pickle.dumps(part)), part)


def _partials_task(rows: Iterable[Cloud]) -> Iterable[tuple[TileKey, TilePartial]]:
    for xyz, intensity, sensor in rows:
        yield from scan_partials(xyz, intensity, SETTINGS, sensor_xyz=sensor, device="numpy")


def test_the_spark_job_shape_gives_the_local_result(
    spark: SparkSession, drive: Drive, scan_parts: list[Partials]
) -> None:
    clouds = drive.clouds[:24]
    rdd = spark.sparkContext.parallelize(clouds, 4)
    merged = dict(rdd.mapPartitions(_partials_task).reduceByKey(merge_partials, 3).collect())
    local = fold(scan_parts[:24])
    assert sorted(merged) == sorted(local)
    for key, part in local.items():
        assert_same_partial(merged[key], part)


def test_the_jobs_buffered_merge_by_key_gives_the_local_result(
    spark: SparkSession,
    drive: Drive,
    scan_parts: list[Partials],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a threshold of a few rows makes the map-side buffers compact again and again
    monkeypatch.setattr(hdmap_job, "_COMPACT_ROWS", 50)
    rdd = spark.sparkContext.parallelize(drive.clouds[:24], 3).mapPartitions(_partials_task)
    merged = dict(hdmap_job._merge_by_key(rdd, merge_many_partials).collect())
    local = fold(scan_parts[:24])
    assert sorted(merged) == sorted(local)
    for key, part in local.items():
        assert_same_partial(merged[key], part)


# -- transients ---------------------------------------------------------------------------------


def car_points(center: NDArray[np.float64], heading: float, ground: float) -> NDArray[np.float64]:
    """The surface of a 4.6 x 1.9 x 1.5 m box standing on the ground, every 10 cm."""
    hx, hy, hz = 2.3, 0.95, 1.5
    u = np.arange(-hx, hx + 1e-9, 0.1)
    v = np.arange(-hy, hy + 1e-9, 0.1)
    w = np.arange(0.02, hz + 1e-9, 0.1)
    faces = []
    for side in (-hy, hy):
        a, c = np.meshgrid(u, w)
        faces.append(np.column_stack([a.ravel(), np.full(a.size, side), c.ravel()]))
    for side in (-hx, hx):
        b, c = np.meshgrid(v, w)
        faces.append(np.column_stack([np.full(b.size, side), b.ravel(), c.ravel()]))
    a, b = np.meshgrid(u, v)
    faces.append(np.column_stack([a.ravel(), b.ravel(), np.full(a.size, hz)]))
    local = np.concatenate(faces)
    cos, sin = np.cos(heading), np.sin(heading)
    out = np.empty_like(local)
    out[:, 0] = center[0] + cos * local[:, 0] - sin * local[:, 1]
    out[:, 1] = center[1] + sin * local[:, 0] + cos * local[:, 1]
    out[:, 2] = ground + local[:, 2]
    return out


def footprint(
    points: NDArray[np.float64], tiles: dict[TileKey, GridTile]
) -> list[tuple[TileKey, int, int]]:
    cells = set()
    for x, y in points[:, :2]:
        key = SETTINGS.tile_of(float(x), float(y))
        ox, oy = SETTINGS.tile_origin(key)
        cells.add((key, int((y - oy) // SETTINGS.resolution), int((x - ox) // SETTINGS.resolution)))
    return [cell for cell in cells if cell[0] in tiles]


def values(
    tiles: dict[TileKey, GridTile], cells: list[tuple[TileKey, int, int]], layer: str
) -> NDArray[Any]:
    return np.array([tiles[key].layer(layer)[row, col] for key, row, col in cells])


@dataclass(frozen=True)
class CarScene:
    """Scans 40-70 of the drive as recorded (``clean``) and with an oncoming car driving
    through them plus a parked one (``busy``); the car's points per scan."""

    clean: list[Cloud]
    busy: list[Cloud]
    moving: list[NDArray[np.float64]]
    parked: NDArray[np.float64]


@pytest.fixture(scope="module")
def car_scene(drive: Drive) -> CarScene:
    scans = list(range(40, 70))
    clouds = [drive.clouds[i] for i in scans]
    stamps = [drive.data.scans[i].stamp for i in scans]
    ahead = 1.5e9  # the oncoming car starts 1.5 s of our driving ahead, in the other lane
    raster = drive.raster

    def car_at(t_ns: float) -> NDArray[np.float64]:
        pose = drive.trajectory.at(int(t_ns))[0]
        heading = float(np.arctan2(pose[1, 0], pose[0, 0]))
        center = pose[:3, 3] + 3.5 * pose[:3, 1]  # one lane to the left
        ground = float(truth_at(raster, center[:1], center[1:2])[0][0])
        return car_points(center, heading, ground)

    # Oncoming: it drives our route backwards at 1.5 times our speed.
    moving = [car_at(stamps[0] + ahead - 1.5 * (s - stamps[0])) for s in stamps]
    parked = car_at(stamps[0] + 2.5 * ahead)
    busy = []
    for (xyz, intensity, sensor), car in zip(clouds, moving, strict=True):
        both = np.concatenate([car, parked])
        shine = np.full(len(both), 200.0, np.float32)
        busy.append((np.concatenate([xyz, both]), np.concatenate([intensity, shine]), sensor))
    return CarScene(clouds, busy, moving, parked)


def test_a_moving_car_leaves_no_ghost_and_a_parked_one_stays(
    drive: Drive, car_scene: CarScene
) -> None:
    clouds, moving, parked = car_scene.clean, car_scene.moving, car_scene.parked
    raster = drive.raster
    clean = build(partials_of(clouds))
    busy_parts = partials_of(car_scene.busy)
    busy = build(busy_parts)
    swept = footprint(np.concatenate(moving[2:-2]), clean)
    assert len(swept) > 2000
    # No ghost: nothing stands where the car drove, the road is still there and unchanged.
    assert np.isnan(values(busy, swept, "obstacle_top")).all()
    base = np.isfinite(values(clean, swept, "elevation_mean"))
    kept = np.isfinite(values(busy, swept, "elevation_mean"))
    assert base.sum() > 300
    assert kept[base].mean() > 0.8  # the car hides some ground while it passes: holes, no ghost
    both = base & kept
    # Fewer points where the car hid the ground, but nothing of the car: no cell higher,
    # no cell brighter (the car returns 200, the road about 12).
    for layer, limit in (("elevation_max", 0.01), ("elevation_mean", 0.03)):
        rise = values(busy, swept, layer)[both] - values(clean, swept, layer)[both]
        assert rise.max() < limit, f"{layer} rose by {rise.max()} m where the car drove"
        assert np.abs(rise).max() < 0.05, f"{layer} changed by {np.abs(rise).max()} m"
    brighter = (
        values(busy, swept, "reflectance_mean")[both]
        - values(clean, swept, "reflectance_mean")[both]
    )
    assert brighter.max() < 5.0
    # The parked car is static structure: it stays, at its height, with no ground below.
    still = footprint(parked, busy)
    top = values(busy, still, "obstacle_top")
    assert np.isfinite(top).mean() > 0.5
    ground = float(truth_at(raster, parked[:1, 0], parked[:1, 1])[0][0])
    np.testing.assert_allclose(np.nanmax(top), ground + 1.5, atol=0.1)
    assert np.isfinite(values(busy, still, "elevation_mean")).mean() < 0.1
    # Without the occupied-vs-observed rule the moving car would leave its trail.
    naive = build(busy_parts, GridSettings(static_ratio=0.01))
    assert np.isfinite(values(naive, swept, "obstacle_top")).mean() > 0.5


def test_the_point_cloud_map_drops_the_moving_car_and_keeps_the_parked_one(
    car_scene: CarScene,
) -> None:
    # The point-cloud map is judged with the grid's patch statistics (as the job does).
    merged = fold(partials_of(car_scene.busy))
    patches = {key: transient_patches(part, SETTINGS) for key, part in merged.items()}
    cloud_settings = PointCloudMapSettings(tile_size=SETTINGS.tile_size)
    tiles = stitch(car_scene.busy, cloud_settings, device="numpy")
    raw = np.concatenate([c.xyz for c in tiles.values()])
    kept = np.concatenate(  # tiles beyond the grid's range keep every point, as in the job
        [
            c.xyz[~patches[key].standing(c.xyz, 0.1, SETTINGS.obstacle_clearance)]
            if key in patches
            else c.xyz
            for key, c in tiles.items()
        ]
    )

    def on(car: NDArray[np.float64], points: NDArray[np.float64]) -> int:
        """Map points on the car's surface, above the road."""
        dist, _ = cKDTree(car).query(points, distance_upper_bound=0.12)
        return int((np.isfinite(dist) & (points[:, 2] > car[:, 2].min() + 0.3)).sum())

    # The grid judges patches within its max_range of the sensor: the car's points there.
    near = [
        car[np.hypot(*(car[:, :2] - sensor[:2]).T) < SETTINGS.max_range - 2.0]
        for car, (_, _, sensor) in zip(car_scene.moving, car_scene.clean, strict=True)
    ]
    trail = np.concatenate(near[2:-2])
    assert on(trail, raw) > 300  # without the filter the car leaves its trail
    assert on(trail, kept) < 0.03 * on(trail, raw)
    assert on(car_scene.parked, kept) > 0.95 * on(car_scene.parked, raw) > 100
    # the road it drove on stays: the recorded scans' road points are all still there
    clean = np.concatenate(
        [c.xyz for c in stitch(car_scene.clean, cloud_settings, device="numpy").values()]
    )
    beside, _ = cKDTree(trail[:, :2]).query(clean[:, :2], distance_upper_bound=0.5)
    road = clean[np.isfinite(beside) & (clean[:, 2] < trail[:, 2].min() + 0.1)]
    assert len(road) > 500
    found, _ = cKDTree(kept).query(road, distance_upper_bound=0.08)
    assert np.isfinite(found).mean() > 0.98


# -- devices ------------------------------------------------------------------------------------


@pytest.mark.opencl
def test_opencl_partials_match_the_numpy_reference(
    drive: Drive, scan_parts: list[Partials]
) -> None:
    for i in (5, 50, 100):
        xyz, intensity, sensor = drive.clouds[i]
        got = dict(scan_partials(xyz, intensity, SETTINGS, sensor_xyz=sensor, device=None))
        want = dict(scan_parts[i])
        assert sorted(got) == sorted(want)
        for key, part in want.items():
            other = got[key]
            for name in ("cells", "count", "scans", "patches", "patch_seen", "patch_occupied"):
                np.testing.assert_array_equal(
                    getattr(other, name), getattr(part, name), err_msg=name
                )
            for name in ("min_z", "max_z", "obstacle_top"):
                np.testing.assert_allclose(getattr(other, name), getattr(part, name), atol=1e-5)
            # device sums are float32: a few micrometres per point
            tol = 20 * np.maximum(part.count, 1)
            assert np.all(np.abs(other.sum_z - part.sum_z) <= tol)


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_gets_a_clear_error(scan_parts: list[Partials]) -> None:
    with pytest.raises(HdmapError, match=r"\(n, 3\)"):
        scan_partials(np.zeros((10, 2)), None, device="numpy")
    with pytest.raises(HdmapError, match="intensity has 3 values for 10 points"):
        scan_partials(np.zeros((10, 3)), np.zeros(3), device="numpy")
    with pytest.raises(HdmapError, match="sensor_xyz"):
        scan_partials(np.zeros((10, 3)), None, sensor_xyz=np.zeros(2), device="numpy")
    (ka, a), (kb, b) = scan_parts[0][0], scan_parts[0][1]
    assert ka != kb
    with pytest.raises(HdmapError, match="merge partials by tile key"):
        merge_partials(a, b)
    with pytest.raises(HdmapError, match="finalize with the settings"):
        finalize_tile(a, GridSettings(resolution=0.1, tile_cells=200))
    with pytest.raises(HdmapError, match="resolution must be a positive number"):
        GridSettings(resolution=0.0)
    with pytest.raises(HdmapError, match="static_ratio"):
        GridSettings(static_ratio=0.0)
    with pytest.raises(HdmapError, match="unknown grid layer 'height'"):
        finalize_tile(a).layer("height")
    assert scan_partials(np.zeros((0, 3)), None, device="numpy") == []


# -- GeoTIFF and previews -----------------------------------------------------------------------


def fullest(tiles: dict[TileKey, GridTile]) -> GridTile:
    return max(tiles.values(), key=lambda t: int(np.isfinite(t.elevation_mean).sum()))


def test_geotiff_round_trip(drive: Drive, tiles: dict[TileKey, GridTile], tmp_path: Path) -> None:
    tile = fullest(tiles)
    path = write_grid_tile(tile, tmp_path / "grid", drive.origin)  # a new directory
    assert path == tmp_path / "grid" / tile_file_name(tile.key)
    back = read_grid_tile(path)
    assert back.origin == drive.origin
    assert back.tile.key == tile.key
    assert back.tile.origin == tile.origin
    assert back.tile.resolution == tile.resolution
    for name in LAYERS:
        got, want = back.tile.layer(name), tile.layer(name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    with tifffile.TiffFile(path) as tif:
        page = tif.pages.first
        geo = page.geotiff_tags
        assert page.is_geotiff
        assert geo is not None
        data = page.asarray()
    rows = tile.shape[0]
    assert geo["ModelPixelScale"][:2] == [tile.resolution, tile.resolution]
    assert geo["ModelTiepoint"][3:5] == [tile.origin[0], tile.origin[1] + rows * tile.resolution]
    assert int(geo["ProjectedCSTypeGeoKey"]) == 32767
    assert int(geo["ProjCoordTransGeoKey"]) == 21
    assert geo["ProjNatOriginLatGeoKey"] == drive.origin[0]
    assert f"lat {drive.origin[0]:.9f}" in geo["GTCitationGeoKey"]
    # north-up: the file's first row is the tile's northern edge
    np.testing.assert_array_equal(data[0, 0], tile.elevation_mean[-1])


def test_reading_something_that_is_not_a_grid_tile_fails_clearly(tmp_path: Path) -> None:
    text = tmp_path / "notes.tif"
    text.write_text("not an image")
    with pytest.raises(MapFormatError, match=r"notes\.tif: not a readable TIFF"):
        read_grid_tile(text)
    plain = tmp_path / "plain.tif"
    tifffile.imwrite(plain, np.zeros((4, 4), np.float32))
    with pytest.raises(MapFormatError, match="without the GeoTIFF tags"):
        read_grid_tile(plain)
    with pytest.raises(MapFormatError, match=r"missing\.tif"):
        read_grid_tile(tmp_path / "missing.tif")


def test_writer_rejects_a_bad_origin(tiles: dict[TileKey, GridTile], tmp_path: Path) -> None:
    with pytest.raises(HdmapError, match="WGS84"):
        write_grid_tile(fullest(tiles), tmp_path / "t.tif", (137.0, 0.0, 0.0))


def test_previews(tiles: dict[TileKey, GridTile], tmp_path: Path) -> None:
    tile = fullest(tiles)
    png = write_preview(tile, tmp_path / "tile.png", "reflectance_mean", max_pixels=100)
    image = imread(png)
    assert image.shape == (100, 100, 4)
    # empty 4 x 4 blocks are transparent, observed ones opaque; rows are north-up
    block = tile.reflectance_mean.reshape(100, 4, 100, 4)
    empty = ~np.isfinite(block).any(axis=(1, 3))
    np.testing.assert_array_equal(image[..., 3] == 0, np.flipud(empty))
    mosaic = write_mosaic(tiles, tmp_path / "mosaic.png", "elevation_mean", max_pixels=600)
    assert imread(mosaic).shape[0] > 200
