"""Stage 2: deskew, scan registration (hetero ICP and the Open3D reference) and the
point-cloud map with its Autoware files."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import numpy as np
import open3d as o3d
import pytest
import yaml
from numpy.typing import NDArray
from scipy.spatial import cKDTree
from scipy.spatial.transform import Rotation

from adcloud.hdmap.drive import DriveData, read_drive
from adcloud.hdmap.errors import DriveDataError, HdmapError, MapFormatError
from adcloud.hdmap.exchange import dump_items, load_items
from adcloud.hdmap.model import Extrinsics, Scan
from adcloud.hdmap.pcmap import (
    METADATA_FILE,
    SUM_QUANTUM,
    TILE_DIR,
    CloudPartial,
    MapCloud,
    PointCloudMapSettings,
    deskew,
    finalize_cloud,
    merge_cloud_partials,
    merge_many_cloud_partials,
    open3d_register,
    pcd_bytes,
    read_pointcloud_map,
    read_pointcloud_metadata,
    register_scan,
    scan_cloud_partials,
    sensor_position,
    stitch,
    write_cloud_tile,
    write_pointcloud_map,
)
from adcloud.hdmap.trajectory import Trajectory
from adcloud.hetero.voxel import voxel_downsample
from adcloud.synth import (
    DriveConfig,
    Label,
    Raster,
    generate_drive,
    read_map,
    read_poses,
    read_raster,
)

F64 = NDArray[np.float64]
T0 = 1_700_000_000_000_000_000


@dataclass(frozen=True)
class Drive:
    data: DriveData
    trajectory: Trajectory
    raster: Raster
    poles: F64  # (k, 3): x, y, radius


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> Drive:
    out = tmp_path_factory.mktemp("pcmap") / "d.bag"
    config = DriveConfig(seconds=8, seed=5, lidar_beams=16, lidar_columns=512, camera=False)
    result = generate_drive(config, out)
    t, xyz, quat = read_poses(result.truth)
    poles = [
        [*f["geometry"]["coordinates"][:2], f["properties"]["radius_m"]]
        for f in read_map(result.truth)["features"]
        if f["properties"]["kind"] == "pole"
    ]
    return Drive(
        read_drive(str(result.bag)),
        Trajectory.from_xyz_quat(t, xyz, quat),
        read_raster(result.truth),
        np.asarray(poles),
    )


@pytest.fixture(scope="module")
def clouds(drive: Drive) -> list[tuple[F64, NDArray[np.float32], F64]]:
    out = []
    for scan in drive.data.scans:
        xyz, intensity = deskew(scan, drive.trajectory, drive.data.extrinsics, device="numpy")
        out.append((xyz, intensity, sensor_position(scan, drive.trajectory, drive.data.extrinsics)))
    return out


# -- deskew -------------------------------------------------------------------------------------


def turning_trajectory() -> Trajectory:
    """10 m/s with a 0.5 rad/s yaw rate, sampled at 100 Hz for 1 s."""
    t = np.arange(101) * 10_000_000
    s = t / 1e9
    yaw = 0.5 * s
    xyz = np.column_stack([20 * np.sin(yaw), 20 * (1 - np.cos(yaw)), 0.01 * s])
    quat = Rotation.from_euler("z", yaw[:, None]).as_quat()
    return Trajectory.from_xyz_quat(T0 + t, xyz, quat)


def test_deskew_recovers_a_static_world_seen_while_turning() -> None:
    trajectory = turning_trajectory()
    mount = np.eye(4)
    mount[:3, :3] = Rotation.from_euler("z", 0.02).as_matrix()
    mount[:3, 3] = [1.2, 0.0, 1.9]
    extrinsics = Extrinsics({"lidar": mount})
    rng = np.random.default_rng(4)
    world = np.column_stack(
        [rng.uniform(-30, 40, 4000), rng.uniform(-30, 40, 4000), rng.uniform(-1, 5, 4000)]
    )
    stamp = T0 + 600_000_000
    dt = -np.floor(rng.uniform(0, 512, len(world))) / 512 * 0.1
    fire = stamp + np.rint(dt * 1e9).astype(np.int64)
    sensor = trajectory.at(fire) @ mount  # map <- lidar at each firing time
    local = np.einsum("nji,nj->ni", sensor[:, :3, :3], world - sensor[:, :3, 3])
    scan = Scan(
        drive="turn",
        stamp=stamp,
        frame="lidar",
        xyz=local.astype(np.float32),
        intensity=np.full(len(world), 50.0, np.float32),
        dt=dt.astype(np.float32),
    )
    got, intensity = deskew(scan, trajectory, extrinsics, device="numpy")
    assert got.dtype == np.float64
    assert np.abs(got - world).max() < 2e-4
    np.testing.assert_array_equal(intensity, scan.intensity)
    # Ignoring the motion during the sweep is off by up to a metre: the test can tell.
    at_stamp = trajectory.at(stamp)[0] @ mount
    naive = local @ at_stamp[:3, :3].T + at_stamp[:3, 3]
    assert np.abs(naive - world).max() > 0.5
    np.testing.assert_allclose(sensor_position(scan, trajectory, extrinsics), at_stamp[:3, 3])


def raster_height(raster: Raster, xy: F64) -> F64:
    col = np.floor((xy[:, 0] - raster.origin[0]) / raster.resolution).astype(np.int64)
    row = np.floor((xy[:, 1] - raster.origin[1]) / raster.resolution).astype(np.int64)
    rows, cols = raster.elevation.shape
    out: F64 = raster.elevation[np.clip(row, 0, rows - 1), np.clip(col, 0, cols - 1)].astype(
        np.float64
    )
    return out


def test_deskewed_drive_matches_the_truth(
    drive: Drive, clouds: list[tuple[F64, NDArray[np.float32], F64]]
) -> None:
    road_dz, pole_gap, naive_gap = [], [], []
    poles = cKDTree(drive.poles[:, :2])
    for scan, (xyz, _, _) in list(zip(drive.data.scans, clouds, strict=True))[10::5]:
        assert scan.label is not None
        road = scan.label == Label.ROAD
        road_dz.append(xyz[road, 2] - raster_height(drive.raster, xyz[road, :2]))
        pole = scan.label == Label.POLE
        if pole.sum():
            dist, idx = poles.query(xyz[pole, :2])
            pole_gap.append(np.abs(dist - drive.poles[idx, 2]))
            at_stamp = drive.trajectory.at(scan.stamp)[0] @ drive.data.extrinsics.get(scan.frame)
            naive = scan.xyz[pole].astype(np.float64) @ at_stamp[:3, :3].T + at_stamp[:3, 3]
            dist, idx = poles.query(naive[:, :2])
            naive_gap.append(np.abs(dist - drive.poles[idx, 2]))
    dz = np.abs(np.concatenate(road_dz))
    assert np.median(dz) < 0.01 and np.percentile(dz, 95) < 0.04
    gap, before = np.concatenate(pole_gap), np.concatenate(naive_gap)
    assert len(gap) > 50
    assert np.median(gap) < 0.03
    assert np.median(before) > 3 * np.median(gap)


def test_deskew_says_what_is_missing(drive: Drive) -> None:
    scan = drive.data.scans[3]
    with pytest.raises(DriveDataError, match="no mount for frame 'lidar'"):
        deskew(scan, drive.trajectory, Extrinsics({"gps": np.eye(4)}), device="numpy")
    early = drive.trajectory.between(scan.stamp + 500_000_000, scan.stamp + 900_000_000)
    with pytest.raises(DriveDataError, match="trajectory spans"):
        deskew(scan, early, drive.data.extrinsics, device="numpy")
    broken = Scan(scan.drive, scan.stamp, scan.frame, scan.xyz, scan.intensity[:-1], scan.dt)
    with pytest.raises(HdmapError, match="intensity"):
        deskew(broken, drive.trajectory, drive.data.extrinsics, device="numpy")
    flat = Scan(scan.drive, scan.stamp, scan.frame, scan.xyz[:, :2], scan.intensity, scan.dt)
    with pytest.raises(HdmapError, match=r"\(n, 3\)"):
        deskew(flat, drive.trajectory, drive.data.extrinsics, device="numpy")


# -- registration -------------------------------------------------------------------------------


def perturbed_pair(clouds: list[tuple[F64, NDArray[np.float32], F64]]) -> tuple[F64, F64, F64]:
    """Scan 40 moved off by a known transform, the local map of the 12 scans around it, and
    the transform that puts the moved scan back (all in the map frame).

    Scan-to-map, as mapping registers: two single 16-beam sweeps share almost no points on
    the ground (their rings lie elsewhere), so scan-to-scan ICP slides.
    """
    source = clouds[40][0]
    target = np.concatenate([clouds[j][0] for j in range(34, 47) if j != 40])
    offset = np.eye(4)
    offset[:3, :3] = Rotation.from_euler("xyz", [0.003, -0.004, 0.03]).as_matrix()
    offset[:3, 3] = [0.5, -0.35, 0.08]
    center = source.mean(axis=0)
    # rotate about the cloud's centre so that the initial error is what the numbers say
    moved = (source - center) @ offset[:3, :3].T + center + offset[:3, 3]
    undo = np.eye(4)
    undo[:3, :3] = offset[:3, :3].T
    undo[:3, 3] = center - offset[:3, :3].T @ (center + offset[:3, 3])
    return moved, target, undo


def assert_close_transform(got: F64, want: F64, metres: float, degrees: float) -> None:
    delta = np.linalg.inv(want) @ got
    assert np.linalg.norm(delta[:3, 3]) < metres
    assert np.degrees(Rotation.from_matrix(delta[:3, :3]).magnitude()) < degrees


def test_hetero_icp_and_open3d_both_undo_a_known_offset(
    clouds: list[tuple[F64, NDArray[np.float32], F64]],
) -> None:
    source, target, undo = perturbed_pair(clouds)
    ours, rmse = register_scan(source, target, voxel=0.2, max_dist=1.5, device="numpy")
    assert_close_transform(ours, undo, 0.03, 0.1)
    assert 0 < rmse < 0.05
    reference, ref_rmse = open3d_register(source, target, np.eye(4), 0.2, 1.5)
    assert_close_transform(reference, undo, 0.06, 0.15)
    assert 0 < ref_rmse < 0.07
    # they started well off: over half a metre on average
    assert np.linalg.norm(source - clouds[40][0], axis=1).mean() > 0.5


@pytest.mark.opencl
def test_hetero_icp_on_the_opencl_device(
    clouds: list[tuple[F64, NDArray[np.float32], F64]],
) -> None:
    source, target, undo = perturbed_pair(clouds)
    on_device, _ = register_scan(source, target, voxel=0.2, max_dist=1.5, device=None)
    assert_close_transform(on_device, undo, 0.03, 0.1)


def test_registration_rejects_bad_input() -> None:
    cloud = np.random.default_rng(0).uniform(0, 10, (500, 3))
    with pytest.raises(HdmapError, match=r"source must be an \(n, 3\) array"):
        open3d_register(cloud[:, :2], cloud)
    with pytest.raises(HdmapError, match="4x4"):
        open3d_register(cloud, cloud, np.eye(3))
    with pytest.raises(HdmapError, match="too few points"):
        open3d_register(cloud[:3], cloud, None, 0.1, 1.0)
    with pytest.raises(HdmapError, match=r"target must be an \(n, 3\) array"):
        register_scan(cloud, np.zeros(5), device="numpy")


# -- the stitched map and its files --------------------------------------------------------------


def test_scan_partials_hold_each_tiles_voxel_sums(
    clouds: list[tuple[F64, NDArray[np.float32], F64]],
) -> None:
    """The partials of a scan are, tile by tile, the sums of its downsampled points grouped
    by voxel key, to the bit (a plain per-tile reference with np.unique, in the points'
    order, rounded to :data:`SUM_QUANTUM`), on tiles small enough that a scan touches tens
    of them."""
    settings = PointCloudMapSettings(tile_size=7.0, voxel_size=0.2, min_range=0.0)
    for xyz, intensity, sensor in clouds[::25]:
        parts = scan_cloud_partials(xyz, intensity, settings, sensor_xyz=sensor, device="numpy")
        assert len(parts) > 10
        reach = np.hypot(*(xyz[:, :2] - sensor[:2]).T) <= settings.max_range
        rows = np.column_stack([xyz[reach], intensity[reach].astype(np.float64)])
        voxels = voxel_downsample(rows, settings.voxel_size, device="numpy")
        pts, weights = voxels.points.astype(np.float64), voxels.counts.astype(np.int64)
        tile = np.floor(pts[:, :2] / settings.tile_size).astype(np.int64)
        expected = {}
        for kx, ky in sorted(set(map(tuple, tile.tolist()))):
            mine = (tile[:, 0] == kx) & (tile[:, 1] == ky)
            local = pts[mine] - [kx * settings.tile_size, ky * settings.tile_size, 0, 0]
            cell = np.floor(local[:, :3] / settings.voxel_size).astype(np.int64)
            _, slot = np.unique(cell, axis=0, return_inverse=True)
            slot = slot.reshape(-1)
            sums = np.stack(
                [np.bincount(slot, weights=local[:, c] * weights[mine]) for c in range(4)], 1
            )
            sums = np.rint(sums / SUM_QUANTUM).astype(np.int64)
            expected[(kx, ky)] = (np.bincount(slot, weights=weights[mine]), sums)
        assert [key for key, _ in parts] == list(expected)
        for key, part in parts:
            assert part.key == key and all(type(k) is int for k in key)
            count, sums = expected[key]
            # the same voxels (the keys pack z, y, x; compare as sets of sums)
            assert np.array_equal(np.sort(part.count), np.sort(count.astype(np.int64)))
            order_a = np.lexsort(part.sums.T[::-1])
            order_b = np.lexsort(sums.T[::-1])
            assert np.array_equal(part.sums[order_a], sums[order_b])
            assert np.all(part.voxels[1:] > part.voxels[:-1])  # sorted, each voxel once


def test_cloud_merge_order_does_not_matter(
    clouds: list[tuple[F64, NDArray[np.float32], F64]],
) -> None:
    """Any order and grouping of a tile's partials gives the same sums, to the bit: Spark
    merges them in the order and groups its shuffle and partitions give it."""
    settings = PointCloudMapSettings()
    parts: dict[tuple[int, int], list[CloudPartial]] = {}
    for xyz, intensity, sensor in clouds[20:40]:
        for key, part in scan_cloud_partials(
            xyz, intensity, settings, sensor_xyz=sensor, device="numpy"
        ):
            parts.setdefault(key, []).append(part)
    rng = random.Random(1)
    merged_many = 0
    for items in parts.values():
        forward = reduce(merge_cloud_partials, items)
        shuffled = items[:]
        rng.shuffle(shuffled)
        other = reduce(merge_cloud_partials, shuffled)
        np.testing.assert_array_equal(forward.voxels, other.voxels)
        np.testing.assert_array_equal(forward.count, other.count)
        np.testing.assert_array_equal(forward.sums, other.sums)
        a, b = finalize_cloud(forward), finalize_cloud(other)
        np.testing.assert_array_equal(a.xyz, b.xyz)
        np.testing.assert_array_equal(a.intensity, b.intensity)
        many = merge_many_cloud_partials(shuffled)
        cut = len(shuffled) // 2
        grouped = merge_many_cloud_partials(
            [merge_many_cloud_partials(shuffled[cut:]), merge_many_cloud_partials(shuffled[:cut])]
            if cut
            else shuffled
        )
        for again in (many, grouped):
            np.testing.assert_array_equal(again.voxels, forward.voxels)
            np.testing.assert_array_equal(again.count, forward.count)
            np.testing.assert_array_equal(again.sums, forward.sums)
        merged_many += len(items) > 5
    assert merged_many > 3
    with pytest.raises(HdmapError, match="at least one"):
        merge_many_cloud_partials([])


def test_kept_float_sums_of_an_earlier_version_merge_with_new_ones(
    clouds: list[tuple[F64, NDArray[np.float32], F64]], tmp_path: Path
) -> None:
    """Map versions written before the sums were integers kept float64 metres in
    ``state/cloud``: read back, they are integers of :data:`SUM_QUANTUM` that merge with a
    new build's partials, and give the centroids the float sums gave."""
    settings = PointCloudMapSettings()
    xyz, intensity, sensor = clouds[30]
    key, part = scan_cloud_partials(xyz, intensity, settings, sensor_xyz=sensor)[0]
    metres = part.sums * SUM_QUANTUM
    old = CloudPartial(key, part.tile_size, part.voxel_size, part.voxels, part.count, metres)
    path = tmp_path / "kept.npz"
    dump_items([old], path)
    (kept,) = load_items(path)
    assert kept.sums.dtype == np.int64
    np.testing.assert_array_equal(kept.sums, part.sums)
    np.testing.assert_allclose(
        finalize_cloud(kept).xyz,
        (metres / part.count[:, None])[:, :3] + [*settings.tile_origin(key), 0],
        atol=1e-9,
    )
    both = merge_cloud_partials(kept, part)
    np.testing.assert_array_equal(both.sums, 2 * part.sums)


def test_stitched_map_round_trips_through_autoware_files(
    drive: Drive, clouds: list[tuple[F64, NDArray[np.float32], F64]], tmp_path: Path
) -> None:
    settings = PointCloudMapSettings(tile_size=20.0, voxel_size=0.2)
    tiles = stitch(clouds[::4], settings, device="numpy")
    assert len(tiles) > 4
    total = sum(len(t) for t in tiles.values())
    for key, tile in tiles.items():
        x0, y0 = settings.tile_origin(key)
        assert np.all((tile.xyz[:, 0] >= x0) & (tile.xyz[:, 0] < x0 + 20))
        assert np.all((tile.xyz[:, 1] >= y0) & (tile.xyz[:, 1] < y0 + 20))
        cells = np.floor(tile.xyz / settings.voxel_size).astype(np.int64)
        assert len(np.unique(cells, axis=0)) > 0.98 * len(tile)  # one point per voxel
    # Ground in the stitched map lies on the true ground.
    everything = np.concatenate([t.xyz for t in tiles.values()])
    near = np.abs(everything[:, 2] - raster_height(drive.raster, everything[:, :2])) < 0.05
    assert near.mean() > 0.3

    meta_path = write_pointcloud_map(tiles, tmp_path, settings)
    assert meta_path == tmp_path / METADATA_FILE
    meta = yaml.safe_load(meta_path.read_text())
    assert meta["x_resolution"] == 20.0 and meta["y_resolution"] == 20.0
    files = sorted((tmp_path / TILE_DIR).glob("*.pcd"))
    assert len(files) == len(tiles) == len(meta) - 2
    for path in files:
        x_min, y_min = meta[path.name]
        assert path.name == f"{x_min:g}_{y_min:g}.pcd"
        header = path.read_bytes()[:300].decode("ascii", "replace")
        assert "FIELDS x y z intensity" in header
    parsed = read_pointcloud_metadata(meta_path)
    assert parsed.x_resolution == 20.0 and len(parsed.tiles) == len(tiles)
    back = read_pointcloud_map(tmp_path)
    assert sorted(back) == sorted(tiles)
    assert sum(len(t) for t in back.values()) == total
    for key, tile in tiles.items():
        np.testing.assert_allclose(back[key].xyz, tile.xyz, atol=1e-4)
        np.testing.assert_allclose(back[key].intensity, tile.intensity, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 5000])
def test_pcd_tiles_are_what_open3d_writes_and_reads(tmp_path: Path, n: int) -> None:
    rng = np.random.default_rng(n)
    xyz = rng.uniform(-500, 500, (n, 3))
    intensity = rng.uniform(0, 255, n).astype(np.float32)
    pcd = o3d.t.geometry.PointCloud()
    pcd.point.positions = o3d.core.Tensor.from_numpy(xyz.astype(np.float32))
    pcd.point.intensity = o3d.core.Tensor.from_numpy(intensity.reshape(-1, 1))
    assert o3d.t.io.write_point_cloud(str(tmp_path / "ref.pcd"), pcd, write_ascii=False)
    assert pcd_bytes(xyz, intensity) == (tmp_path / "ref.pcd").read_bytes()

    settings = PointCloudMapSettings()
    entry = write_cloud_tile(MapCloud((3, -2), xyz, intensity), tmp_path, settings)
    assert entry is not None
    back = o3d.t.io.read_point_cloud(str(tmp_path / TILE_DIR / entry[0]))
    np.testing.assert_array_equal(back.point.positions.numpy(), xyz.astype(np.float32))
    np.testing.assert_array_equal(back.point.intensity.numpy().ravel(), intensity)
    assert sorted(p.name for p in (tmp_path / TILE_DIR).iterdir()) == [entry[0]]


def test_a_tile_that_cannot_be_written_keeps_the_old_one(tmp_path: Path) -> None:
    settings = PointCloudMapSettings()
    cloud = MapCloud((0, 0), np.ones((4, 3)), np.ones(4, np.float32))
    name = write_cloud_tile(cloud, tmp_path, settings)
    assert name is not None
    (tmp_path / TILE_DIR / f".{name[0]}.partial.pcd").mkdir()  # the write beside fails
    with pytest.raises(MapFormatError, match=rf"{name[0]}: cannot write the tile"):
        write_cloud_tile(MapCloud((0, 0), np.zeros((2, 3)), np.ones(2, np.float32)), tmp_path)
    assert (tmp_path / TILE_DIR / name[0]).read_bytes() == pcd_bytes(cloud.xyz, cloud.intensity)


def test_map_files_that_are_not_right_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(MapFormatError, match="cannot read point-cloud map metadata"):
        read_pointcloud_map(tmp_path)
    (tmp_path / METADATA_FILE).write_text("x_resolution: 20.0\n")
    with pytest.raises(MapFormatError, match="x_resolution and y_resolution"):
        read_pointcloud_map(tmp_path)
    (tmp_path / METADATA_FILE).write_text("x_resolution: 20.0\ny_resolution: 20.0\na.pcd: [0, 0]\n")
    with pytest.raises(MapFormatError, match=r"a\.pcd: listed in"):
        read_pointcloud_map(tmp_path)
    (tmp_path / METADATA_FILE).write_text("x_resolution: 20.0\ny_resolution: 20.0\na.pcd: 3\n")
    with pytest.raises(MapFormatError, match=r"must be \[x_min, y_min\]"):
        read_pointcloud_map(tmp_path)
    empty = MapCloud((0, 0), np.zeros((0, 3)), np.zeros(0, np.float32))
    assert write_cloud_tile(empty, tmp_path) is None
    assert not (tmp_path / TILE_DIR).exists()
    with pytest.raises(HdmapError, match="voxel_size must be positive"):
        PointCloudMapSettings(voxel_size=0.0)
    with pytest.raises(HdmapError, match="transient_min_height must be >= 0"):
        PointCloudMapSettings(transient_min_height=float("nan"))
    with pytest.raises(HdmapError, match=r"\(n, 3\) float array"):
        scan_cloud_partials(np.zeros((4, 2)), None)
