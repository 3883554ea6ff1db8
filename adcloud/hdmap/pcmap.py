"""Stage 2: deskewed scans, scan registration and the stitched point-cloud map.

Deskew
    A spinning LiDAR fires its columns over a whole sweep while the car moves; each point
    is taken from the sensor frame into ``base_link`` (the mount from the drive's
    ``/tf_static``, with :func:`adcloud.hetero.transform_points`) and then into ``map`` with
    the pose the car had *when that point fired* (``stamp + dt``, interpolated by
    :meth:`~adcloud.hdmap.trajectory.Trajectory.at`).

Registration
    :func:`register_scan` aligns two clouds with point-to-plane ICP through
    :func:`adcloud.hetero.align` (OpenCL kernels where a device is available);
    :func:`open3d_register` is the CPU reference path and benchmark baseline with Open3D's
    point-to-plane ICP. Both take the same arguments, weight residuals with the same Huber
    loss (0.1 m) and return ``(4x4, rmse)`` with the same RMSE definition. Register a scan
    against a local map (its neighbours stitched), not against one other sweep: two sparse
    sweeps share few surfaces (a 16-beam sensor's ground rings lie elsewhere in each), and
    scan-to-scan point-to-plane ICP slides along them.

Stitching
    The map is a voxel grid (``voxel_size``) cut into square tiles (``tile_size``) on a
    fixed lattice in the map frame, like the grid map, so drives merge by tile key. Per
    scan, :func:`scan_cloud_partials` averages points per voxel with
    :func:`adcloud.hetero.voxel_downsample` and keeps per-voxel sums (positions relative to
    the tile's south-west corner, as integers of :data:`SUM_QUANTUM`) and counts;
    :func:`merge_cloud_partials` adds them, exactly, and :func:`finalize_cloud` gives one
    centroid per voxel. Integer sums make the merge associative and commutative to the
    bit: Spark hands a tile's partials to the merge in whatever order the shuffle delivers
    them and groups them as its partitions fell, and float sums in another order differ in
    the last bits -- a rebuild of the same drives would write other tile files.
    :func:`stitch` does all three in this process. Moving objects are not removed here; the
    grid map (:mod:`adcloud.hdmap.grid`) tells static structure from traffic.

Files (Autoware's divided point-cloud map)
    :func:`write_pointcloud_map` (or, tile by tile on executors, :func:`write_cloud_tile`
    then :func:`write_pointcloud_metadata`) writes ``<dir>/pointcloud_map/<x>_<y>.pcd`` (binary PCD
    with fields ``x y z intensity``, float32, as Open3D writes it; ``<x>_<y>`` is the tile's
    south-west corner in metres) and ``<dir>/pointcloud_map_metadata.yaml`` as Autoware's
    ``pointcloud_map_loader`` reads it::

        x_resolution: 20.0
        y_resolution: 20.0
        -20_40.pcd: [-20.0, 40.0]   # -20 <= x < 0, 40 <= y < 60

    PCD stores float32, so coordinates keep about a millimetre within ~10 km of the map
    origin (Autoware's map frame has the same limitation).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray

from adcloud.hdmap._groups import group_rows, reduce_groups
from adcloud.hdmap.errors import DriveDataError, HdmapError, MapFormatError
from adcloud.hdmap.model import Extrinsics, Scan
from adcloud.hdmap.trajectory import Trajectory
from adcloud.hetero import align, transform_points, voxel_downsample
from adcloud.hetero.devices import ComputeDevice, as_device

__all__ = [
    "METADATA_FILE",
    "SUM_QUANTUM",
    "TILE_DIR",
    "CloudPartial",
    "MapCloud",
    "PointCloudMapSettings",
    "PointCloudMetadata",
    "deskew",
    "finalize_cloud",
    "merge_cloud_partials",
    "merge_many_cloud_partials",
    "open3d_register",
    "pcd_bytes",
    "read_pointcloud_map",
    "read_pointcloud_metadata",
    "register_scan",
    "scan_cloud_partials",
    "sensor_position",
    "stitch",
    "write_cloud_tile",
    "write_pointcloud_map",
    "write_pointcloud_metadata",
]

log = logging.getLogger(__name__)

F32 = NDArray[np.float32]
F64 = NDArray[np.float64]
TileKey = tuple[int, int]

#: Autoware's names: the tile directory and the metadata file beside it.
TILE_DIR = "pointcloud_map"
METADATA_FILE = "pointcloud_map_metadata.yaml"

#: The unit of a :class:`CloudPartial`'s sums: micrometres for positions and millionths
#: for intensities, as the grid's (:data:`adcloud.hdmap.grid.Z_QUANTUM`). int64 sums hold
#: 9e8 points of a voxel 10 km from the origin (or of intensity 10 000) before they overflow.
SUM_QUANTUM = 1e-6

_XY_BITS = 16
_HUBER = 0.1  # m, adcloud.hetero.align's default
_Z_OFFSET = 1 << 31
_TILE_OFFSET = 1 << 30  # tile keys packed into one int64: tiles within +-2^30 of the origin


# -- deskew -----------------------------------------------------------------------------------


def deskew(
    scan: Scan,
    trajectory: Trajectory,
    extrinsics: Extrinsics,
    *,
    device: ComputeDevice | str | None = None,
    slack_ns: int = 10_000,
) -> tuple[F64, F32]:
    """Map-frame points of ``scan`` (n, 3) float64 and their intensities (n,) float32.

    Each point moves with the ``map <- base_link`` pose of ``trajectory`` at its own firing
    time ``scan.stamp + dt`` and the ``base_link <- scan.frame`` mount of ``extrinsics``.
    Rows map to rows. Firing times may lie up to ``slack_ns`` outside the trajectory (float32
    ``dt`` rounding); further out raises :class:`DriveDataError`.
    """
    where = f"scan {scan.drive}@{scan.stamp}"
    xyz = np.asarray(scan.xyz)
    if xyz.ndim != 2 or xyz.shape[1] != 3:
        raise HdmapError(f"{where}: xyz must be an (n, 3) array, got shape {xyz.shape}")
    n = len(xyz)
    dt = np.asarray(scan.dt).reshape(-1)
    intensity = np.asarray(scan.intensity, dtype=np.float32).reshape(-1)
    if dt.shape[0] != n or intensity.shape[0] != n:
        raise HdmapError(
            f"{where}: {n} points but {dt.shape[0]} dt and {intensity.shape[0]} intensity "
            "values; every per-point field needs one value per point"
        )
    mount = _mount(scan, extrinsics)
    if n == 0:
        return np.empty((0, 3)), intensity
    base = transform_points(xyz, mount, device=device).astype(np.float64)
    times = scan.stamp + np.rint(dt.astype(np.float64) * 1e9).astype(np.int64)
    lo, hi = trajectory.span_ns
    if times.min() < lo - slack_ns or times.max() > hi + slack_ns:
        raise DriveDataError(
            f"{where}: points fire between {int(times.min())} and {int(times.max())} ns but "
            f"the trajectory spans {lo}..{hi} ns; give a trajectory that covers every scan "
            "(or leave out the scans outside it)"
        )
    # A sweep has one firing time per column: interpolate poses once per distinct time.
    unique, inverse = np.unique(times, return_inverse=True)
    poses = _window(trajectory, int(unique[0]), int(unique[-1])).at(unique)
    inverse = inverse.reshape(-1)
    out = np.einsum("nij,nj->ni", poses[inverse, :3, :3], base) + poses[inverse, :3, 3]
    return out, intensity


def sensor_position(scan: Scan, trajectory: Trajectory, extrinsics: Extrinsics) -> F64:
    """Map-frame position (3,) of the scan's sensor at the scan's stamp (m)."""
    pose = _window(trajectory, scan.stamp, scan.stamp).at(scan.stamp)[0] @ _mount(scan, extrinsics)
    out: F64 = pose[:3, 3].copy()
    return out


def _mount(scan: Scan, extrinsics: Extrinsics) -> F64:
    try:
        return extrinsics.get(scan.frame)
    except KeyError:
        known = ", ".join(sorted(extrinsics.frames)) or "none"
        raise DriveDataError(
            f"scan {scan.drive}@{scan.stamp}: no mount for frame {scan.frame!r} (known: "
            f"{known}); the drive's /tf_static must carry base_link -> {scan.frame}"
        ) from None


def _window(trajectory: Trajectory, start_ns: int, end_ns: int) -> Trajectory:
    """The samples that bracket ``[start_ns, end_ns]``: interpolating in them gives what the
    whole trajectory gives, without building a slerp over every pose of the drive."""
    i0 = max(int(np.searchsorted(trajectory.t, start_ns, side="right")) - 1, 0)
    i1 = min(int(np.searchsorted(trajectory.t, end_ns, side="left")) + 1, len(trajectory))
    return Trajectory(trajectory.t[i0:i1], trajectory.matrices[i0:i1])


# -- registration -----------------------------------------------------------------------------


def _cloud(points: NDArray[Any], what: str) -> F64:
    array = np.asarray(points)
    if array.ndim != 2 or array.shape[1] < 3 or not np.issubdtype(array.dtype, np.number):
        raise HdmapError(f"{what} must be an (n, 3) array of points (m), got shape {array.shape}")
    xyz = array[:, :3].astype(np.float64)
    return xyz[np.isfinite(xyz).all(axis=1)]


def _init(init: NDArray[Any] | None) -> F64:
    matrix = np.eye(4) if init is None else np.asarray(init, dtype=np.float64)
    if matrix.shape != (4, 4) or not np.isfinite(matrix).all():
        raise HdmapError(f"init must be a finite 4x4 transform, got shape {matrix.shape}")
    return matrix


def register_scan(
    source: NDArray[Any],
    target: NDArray[Any],
    init: NDArray[Any] | None = None,
    voxel: float = 0.25,
    max_dist: float = 1.0,
    *,
    device: ComputeDevice | str | None = None,
) -> tuple[F64, float]:
    """Point-to-plane ICP through :func:`adcloud.hetero.align` on ``device``.

    ``source`` and ``target`` are (n, 3+) clouds (m); the result maps source into target
    coordinates, starting from ``init`` (4x4, identity by default), after voxel
    downsampling by ``voxel`` m and matching within ``max_dist`` m; ``rmse`` is the
    Huber-weighted point-to-plane residual (m) of the last iteration's matches.
    """
    src, tgt = _cloud(source, "source"), _cloud(target, "target")
    result = align(
        src, tgt, _init(init), voxel_size=voxel, max_distance=max_dist, huber=_HUBER, device=device
    )
    return result.transform, float(result.rmse)


def open3d_register(
    source: NDArray[Any],
    target: NDArray[Any],
    init: NDArray[Any] | None = None,
    voxel: float = 0.25,
    max_dist: float = 1.0,
) -> tuple[F64, float]:
    """The CPU reference: Open3D's point-to-plane ICP with the arguments of
    :func:`register_scan` (target normals from a hybrid search of radius
    ``max(2.5 * voxel, 0.3)`` m and 30 neighbours, Huber loss at 0.1 m, at most 60
    iterations).

    ``rmse`` is the Huber-weighted point-to-plane residual (m) over Open3D's final
    correspondences, the quantity :func:`register_scan` reports.
    """
    import open3d as o3d  # noqa: PLC0415 - heavy import, only for this path

    src, tgt = _cloud(source, "source"), _cloud(target, "target")
    reg = o3d.pipelines.registration
    src_pc = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(src))
    tgt_pc = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(tgt))
    if voxel > 0:
        src_pc = src_pc.voxel_down_sample(voxel)
        tgt_pc = tgt_pc.voxel_down_sample(voxel)
    if len(src_pc.points) < 6 or len(tgt_pc.points) < 6:
        raise HdmapError(
            f"too few points to register ({len(src_pc.points)} source, {len(tgt_pc.points)} "
            f"target after {voxel} m voxels); give denser clouds or a smaller voxel"
        )
    radius = max(2.5 * voxel, 0.3)
    tgt_pc.estimate_normals(o3d.geometry.KDTreeSearchParamHybrid(radius=radius, max_nn=30))
    result = reg.registration_icp(
        src_pc,
        tgt_pc,
        max_dist,
        _init(init),
        # Huber weights like adcloud.hetero.align's (0.1 m), so both solve the same problem.
        reg.TransformationEstimationPointToPlane(reg.HuberLoss(k=_HUBER)),
        reg.ICPConvergenceCriteria(max_iteration=60),
    )
    transform = np.asarray(result.transformation, dtype=np.float64)
    pairs = np.asarray(result.correspondence_set)
    if not len(pairs):
        return transform, math.inf
    moved = np.asarray(src_pc.points)[pairs[:, 0]] @ transform[:3, :3].T + transform[:3, 3]
    normals = np.asarray(tgt_pc.normals)[pairs[:, 1]]
    residual = np.abs(
        np.einsum("ij,ij->i", moved - np.asarray(tgt_pc.points)[pairs[:, 1]], normals)
    )
    weight = np.minimum(1.0, _HUBER / np.maximum(residual, 1e-12))
    return transform, float(np.sqrt(np.mean(weight * residual**2)))


# -- stitching --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointCloudMapSettings:
    """Layout of the point-cloud map: ``tile_size`` (m, Autoware recommends about 20 m),
    ``voxel_size`` (m) and the horizontal distance from the sensor of the points kept
    (``min_range`` drops the car's own body, ``max_range`` sparse far points); moving
    things are dropped within the grid's ``max_range`` (beyond it no patch is judged)."""

    tile_size: float = 20.0
    voxel_size: float = 0.1
    min_range: float = 2.0
    max_range: float = 60.0
    #: Where the grid saw only passing things (its transient patches; the job needs grid
    #: and point-cloud tiles of one size), points more than this above the ground are
    #: dropped: what was there moved on.
    transient_min_height: float = 0.1

    def __post_init__(self) -> None:
        for name in ("tile_size", "voxel_size", "max_range"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise HdmapError(f"PointCloudMapSettings.{name} must be positive, got {value!r}")
        if not 0 <= self.min_range < self.max_range:
            raise HdmapError("PointCloudMapSettings needs 0 <= min_range < max_range")
        if not self.transient_min_height >= 0:
            raise HdmapError(
                "PointCloudMapSettings.transient_min_height must be >= 0, got "
                f"{self.transient_min_height!r}"
            )
        if self.tile_size / self.voxel_size >= 1 << _XY_BITS:
            raise HdmapError(
                f"a tile of {self.tile_size} m holds more than 65535 voxels of "
                f"{self.voxel_size} m along an edge; use larger voxels or smaller tiles"
            )

    def tile_origin(self, key: TileKey) -> tuple[float, float]:
        """Map-frame ``(x, y)`` of the south-west corner of tile ``key`` (m)."""
        return key[0] * self.tile_size, key[1] * self.tile_size


@dataclass(frozen=True)
class CloudPartial:
    """Per-voxel sums of one tile from some scans (merge with :func:`merge_cloud_partials`).

    ``voxels``: sorted packed int64 voxel keys within the tile; ``count`` (int64) points
    per voxel; ``sums`` (m, 4) int64, in :data:`SUM_QUANTUM`: x, y relative to the tile's
    south-west corner, z, and intensity, summed over the voxel's points (each scan's sums
    rounded once, then added exactly).

    Kept in ``state/cloud`` of every map version. Versions written before the sums were
    integers kept float64 metres there; such a partial is rounded to the integers when it
    is read (:meth:`__post_init__`), so an incremental build merges it with new ones.
    """

    key: TileKey
    tile_size: float
    voxel_size: float
    voxels: NDArray[np.int64]
    count: NDArray[np.int64]
    sums: NDArray[np.int64]

    def __post_init__(self) -> None:
        sums = np.asarray(self.sums)
        if np.issubdtype(sums.dtype, np.floating):  # kept by an earlier version
            object.__setattr__(self, "sums", _fixed(sums))

    def __len__(self) -> int:
        return int(self.voxels.shape[0])


def _fixed(values: NDArray[Any]) -> NDArray[np.int64]:
    """Float sums as integers of :data:`SUM_QUANTUM`: adding them is exact, in any order."""
    out: NDArray[np.int64] = np.rint(values / SUM_QUANTUM).astype(np.int64)
    return out


@dataclass(frozen=True)
class MapCloud:
    """The points of one map tile: ``xyz`` (m, 3) float64 map frame, ``intensity`` (m,)."""

    key: TileKey
    xyz: F64
    intensity: F32

    def __len__(self) -> int:
        return int(self.xyz.shape[0])


def scan_cloud_partials(
    xyz_map: NDArray[Any],
    intensity: NDArray[Any] | None,
    settings: PointCloudMapSettings | None = None,
    *,
    sensor_xyz: NDArray[Any] | None = None,
    device: ComputeDevice | str | None = None,
) -> list[tuple[TileKey, CloudPartial]]:
    """Voxel sums of one deskewed scan, one ``(key, partial)`` per tile it touches.

    ``xyz_map`` (n, 3) map-frame points (m), ``intensity`` (n,) or None (zeros),
    ``sensor_xyz`` the sensor position that enables the range limits.
    """
    settings = settings or PointCloudMapSettings()
    xyz = np.asarray(xyz_map)
    if xyz.ndim != 2 or xyz.shape[1] != 3 or not np.issubdtype(xyz.dtype, np.floating):
        raise HdmapError(f"xyz_map must be an (n, 3) float array (m), got {xyz.shape} {xyz.dtype}")
    values = (
        np.zeros(len(xyz), np.float64)
        if intensity is None
        else np.asarray(intensity, dtype=np.float64).reshape(-1)
    )
    if values.shape[0] != xyz.shape[0]:
        raise HdmapError(f"intensity has {values.shape[0]} values for {xyz.shape[0]} points")
    keep = np.isfinite(xyz).all(axis=1) & np.isfinite(values)
    if sensor_xyz is not None:
        sensor = np.asarray(sensor_xyz, dtype=np.float64).reshape(-1)
        if sensor.shape != (3,):
            raise HdmapError(f"sensor_xyz must be a map-frame point (3,), got {sensor.shape}")
        reach = np.hypot(xyz[:, 0] - sensor[0], xyz[:, 1] - sensor[1])
        keep &= (reach >= settings.min_range) & (reach <= settings.max_range)
    if not keep.any():
        return []
    rows = np.column_stack([xyz[keep].astype(np.float64), values[keep]])
    voxels = voxel_downsample(rows, settings.voxel_size, device=as_device(device))
    centroids = voxels.points.astype(np.float64)
    counts = voxels.counts.astype(np.int64)
    size, v = settings.tile_size, settings.voxel_size
    tx = np.floor(centroids[:, 0] / size).astype(np.int64)
    ty = np.floor(centroids[:, 1] / size).astype(np.int64)
    local = centroids.copy()
    local[:, 0] -= tx * size
    local[:, 1] -= ty * size
    limit = (1 << _XY_BITS) - 1
    ix = np.clip(np.floor(local[:, 0] / v).astype(np.int64), 0, limit)
    iy = np.clip(np.floor(local[:, 1] / v).astype(np.int64), 0, limit)
    iz = np.floor(centroids[:, 2] / v).astype(np.int64) + _Z_OFFSET
    packed = (iz << (2 * _XY_BITS)) | (iy << _XY_BITS) | ix
    # One sort by (tile, voxel) for the whole scan instead of a np.unique per tile (a scan
    # touches tens of tiles): each voxel gets its slot in the scan, and one bincount per
    # column sums every tile at once. bincount adds a slot's values in the points' order,
    # as a per-tile bincount did, so the sums are the same to the bit.
    tiles, tile_of = np.unique(
        ((tx + _TILE_OFFSET) << 32) | (ty + _TILE_OFFSET), return_inverse=True
    )
    tile_of = tile_of.reshape(-1)
    order = np.lexsort((packed, tile_of))
    sorted_tile, sorted_voxel = tile_of[order], packed[order]
    first = np.ones(len(order), bool)
    first[1:] = (sorted_tile[1:] != sorted_tile[:-1]) | (sorted_voxel[1:] != sorted_voxel[:-1])
    slot = np.empty(len(order), np.int64)
    slot[order] = np.cumsum(first) - 1
    n_slots = int(first.sum())
    voxel_keys = sorted_voxel[first]
    count = np.bincount(slot, weights=counts, minlength=n_slots).astype(np.int64)
    sums = np.empty((n_slots, 4), np.int64)
    for c in range(4):
        sums[:, c] = _fixed(np.bincount(slot, weights=local[:, c] * counts, minlength=n_slots))
    bounds = np.searchsorted(sorted_tile[first], np.arange(len(tiles) + 1))
    out: list[tuple[TileKey, CloudPartial]] = []
    for i, packed_tile in enumerate(tiles.tolist()):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        key = ((packed_tile >> 32) - _TILE_OFFSET, (packed_tile & 0xFFFFFFFF) - _TILE_OFFSET)
        out.append(
            (
                key,
                CloudPartial(
                    key=key,
                    tile_size=size,
                    voxel_size=v,
                    voxels=voxel_keys[lo:hi],
                    count=count[lo:hi],
                    sums=sums[lo:hi],
                ),
            )
        )
    return out


def merge_cloud_partials(a: CloudPartial, b: CloudPartial) -> CloudPartial:
    """The voxel sums of ``a`` and ``b`` together (same tile and layout)."""
    return merge_many_cloud_partials([a, b])


def merge_many_cloud_partials(parts: Sequence[CloudPartial]) -> CloudPartial:
    """The voxel sums of all ``parts`` together (same tile and layout), in one pass
    (folding two at a time re-copies the growing tile for every scan over it). The sums
    are integers: any order and grouping of the parts gives the same result, to the bit."""
    if not parts:
        raise HdmapError("merge_many_cloud_partials needs at least one partial")
    a = parts[0]
    for b in parts[1:]:
        if a.key != b.key or a.tile_size != b.tile_size or a.voxel_size != b.voxel_size:
            raise HdmapError(
                f"cannot merge map tile {a.key} ({a.tile_size} m, voxels {a.voxel_size} m) "
                f"with {b.key} ({b.tile_size} m, voxels {b.voxel_size} m); merge by tile key "
                "and build every drive with the same PointCloudMapSettings"
            )
    if len(parts) == 1:
        return a
    voxels, order, starts = group_rows([p.voxels for p in parts])
    count = reduce_groups([p.count for p in parts], order, starts, np.add)
    sums = reduce_groups([p.sums for p in parts], order, starts, np.add)
    return CloudPartial(a.key, a.tile_size, a.voxel_size, voxels, count, sums)


def finalize_cloud(partial: CloudPartial) -> MapCloud:
    """One point per voxel (its points' centroid and mean intensity), in voxel order."""
    mean = partial.sums.astype(np.float64) * SUM_QUANTUM / partial.count[:, None]
    x0, y0 = partial.key[0] * partial.tile_size, partial.key[1] * partial.tile_size
    xyz = mean[:, :3].copy()
    xyz[:, 0] += x0
    xyz[:, 1] += y0
    return MapCloud(partial.key, xyz, mean[:, 3].astype(np.float32))


def stitch(
    clouds: Iterable[tuple[NDArray[Any], NDArray[Any] | None, NDArray[Any] | None]],
    settings: PointCloudMapSettings | None = None,
    *,
    device: ComputeDevice | str | None = None,
) -> dict[TileKey, MapCloud]:
    """The point-cloud map of deskewed scans in this process.

    ``clouds`` yields ``(xyz_map, intensity, sensor_xyz)`` per scan (intensity and sensor
    may be None); the result is :func:`finalize_cloud` of every tile.
    """
    settings = settings or PointCloudMapSettings()
    dev = as_device(device)
    parts: dict[TileKey, list[CloudPartial]] = {}
    for xyz, intensity, sensor in clouds:
        for key, part in scan_cloud_partials(
            xyz, intensity, settings, sensor_xyz=sensor, device=dev
        ):
            parts.setdefault(key, []).append(part)
    return {
        key: finalize_cloud(merge_many_cloud_partials(tile)) for key, tile in sorted(parts.items())
    }


# -- files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointCloudMetadata:
    """Autoware's ``pointcloud_map_metadata.yaml``: tile edges (m) and each file's
    south-west corner ``(x_min, y_min)`` (m, map frame)."""

    x_resolution: float
    y_resolution: float
    tiles: dict[str, tuple[float, float]]


def _tile_name(origin: tuple[float, float]) -> str:
    return f"{origin[0]:g}_{origin[1]:g}.pcd"


def pcd_bytes(xyz: NDArray[Any], intensity: NDArray[Any]) -> bytes:
    """A binary PCD (v0.7) of ``x y z intensity`` float32 points, byte for byte what
    Open3D's ``t.io.write_point_cloud(..., write_ascii=False)`` writes for them.

    Written here rather than through Open3D because the tiles are written on executors,
    where importing Open3D costs each Python worker 1.2-1.6 s (its extension module and,
    through its visualization package, Dash and Plotly) for what is a ten-line header and
    one array. Readers (PCL, Autoware, Open3D) parse it as any other binary PCD."""
    n = len(xyz)
    points = np.empty((n, 4), np.float32)
    points[:, :3] = xyz
    points[:, 3] = intensity
    header = (
        "# .PCD v0.7 - Point Cloud Data file format\n"
        "VERSION 0.7\n"
        "FIELDS x y z intensity\n"
        "SIZE 4 4 4 4\n"
        "TYPE F F F F\n"
        "COUNT 1 1 1 1\n"
        f"WIDTH {n}\n"
        "HEIGHT 1\n"
        "VIEWPOINT 0 0 0 1 0 0 0\n"
        f"POINTS {n}\n"
        "DATA binary\n"
    )
    # PCD's binary data is little-endian, as every machine adcloud runs on.
    return header.encode("ascii") + points.astype("<f4", copy=False).tobytes()


def write_cloud_tile(
    cloud: MapCloud,
    out_dir: str | os.PathLike[str],
    settings: PointCloudMapSettings | None = None,
) -> tuple[str, tuple[float, float]] | None:
    """Write one tile as ``<out_dir>/pointcloud_map/<x>_<y>.pcd`` (binary, ``x y z
    intensity`` float32) and return its metadata entry ``(file name, (x_min, y_min))``;
    None for a tile without points (nothing is written). Runs on executors: each tile is
    written where it was merged, and :func:`write_pointcloud_metadata` lists them."""
    if not len(cloud):
        return None
    settings = settings or PointCloudMapSettings()
    origin = settings.tile_origin(cloud.key)
    tile_dir = Path(out_dir) / TILE_DIR
    tile_dir.mkdir(parents=True, exist_ok=True)
    name = _tile_name(origin)
    # Written beside and renamed into place: a reader never sees half a tile.
    partial = tile_dir / f".{name}.partial.pcd"
    try:
        with partial.open("wb") as f:
            f.write(pcd_bytes(cloud.xyz, cloud.intensity))
    except OSError as e:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise MapFormatError(f"{tile_dir / name}: cannot write the tile: {e}") from e
    partial.replace(tile_dir / name)
    return name, (float(origin[0]), float(origin[1]))


def write_pointcloud_metadata(
    entries: Iterable[tuple[str, tuple[float, float]]],
    out_dir: str | os.PathLike[str],
    settings: PointCloudMapSettings | None = None,
) -> Path:
    """Write ``<out_dir>/pointcloud_map_metadata.yaml`` listing ``entries`` (from
    :func:`write_cloud_tile`) in Autoware's format; returns its path."""
    settings = settings or PointCloudMapSettings()
    document: dict[str, Any] = {
        "x_resolution": float(settings.tile_size),
        "y_resolution": float(settings.tile_size),
    }
    for name, (x_min, y_min) in sorted(entries, key=lambda e: (e[1][0], e[1][1])):
        document[name] = [float(x_min), float(y_min)]
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    meta = root / METADATA_FILE
    partial = root / f".{METADATA_FILE}.partial"
    partial.write_text(
        yaml.safe_dump(document, sort_keys=False, default_flow_style=None), encoding="utf-8"
    )
    partial.replace(meta)
    log.info("point-cloud map: %d tiles listed in %s", len(document) - 2, meta)
    return meta


def write_pointcloud_map(
    clouds: Mapping[TileKey, MapCloud],
    out_dir: str | os.PathLike[str],
    settings: PointCloudMapSettings | None = None,
) -> Path:
    """Write every tile (:func:`write_cloud_tile`) and the metadata
    (:func:`write_pointcloud_metadata`) under ``out_dir``; returns the metadata's path.
    Tiles without points are left out."""
    entries = [write_cloud_tile(cloud, out_dir, settings) for _, cloud in sorted(clouds.items())]
    return write_pointcloud_metadata([e for e in entries if e is not None], out_dir, settings)


def read_pointcloud_metadata(path: str | os.PathLike[str]) -> PointCloudMetadata:
    """Parse an Autoware ``pointcloud_map_metadata.yaml``."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise MapFormatError(f"{path}: cannot read point-cloud map metadata: {err}") from err
    if not isinstance(data, dict):
        raise MapFormatError(f"{path}: expected a YAML mapping, got {type(data).__name__}")
    try:
        x_res, y_res = float(data.pop("x_resolution")), float(data.pop("y_resolution"))
    except (KeyError, TypeError, ValueError) as err:
        raise MapFormatError(
            f"{path}: needs numeric x_resolution and y_resolution (Autoware's format)"
        ) from err
    tiles: dict[str, tuple[float, float]] = {}
    for name, value in data.items():
        if not (isinstance(value, list) and len(value) == 2):
            raise MapFormatError(f"{path}: entry {name!r} must be [x_min, y_min], got {value!r}")
        tiles[str(name)] = (float(value[0]), float(value[1]))
    return PointCloudMetadata(x_res, y_res, tiles)


def read_pointcloud_map(map_dir: str | os.PathLike[str]) -> dict[TileKey, MapCloud]:
    """Read a map written by :func:`write_pointcloud_map` (tile keys from the metadata)."""
    import open3d as o3d  # noqa: PLC0415 - heavy import, only for this path

    root = Path(map_dir)
    meta = read_pointcloud_metadata(root / METADATA_FILE)
    out: dict[TileKey, MapCloud] = {}
    for name, (x_min, y_min) in meta.tiles.items():
        path = root / TILE_DIR / name
        if not path.is_file():
            raise MapFormatError(f"{path}: listed in {root / METADATA_FILE} but missing")
        pcd = o3d.t.io.read_point_cloud(path)
        if "positions" not in pcd.point or "intensity" not in pcd.point:
            raise MapFormatError(f"{path}: not a PCD with x y z intensity fields")
        key = (round(x_min / meta.x_resolution), round(y_min / meta.y_resolution))
        out[key] = MapCloud(
            key,
            pcd.point.positions.numpy().astype(np.float64),
            pcd.point.intensity.numpy().reshape(-1).astype(np.float32),
        )
    return out
