"""The map build as one Spark job: bags -> poses -> aligned scans -> grid tiles -> labels.

:func:`run_pipeline` chains the four stages on a SparkSession:

0. ETL -- every bag becomes a :class:`~adcloud.binpipe.BinPipeRDD` (each task reads its own
   byte range); executors decode LiDAR sweeps into :class:`~adcloud.hdmap.model.Scan` objects
   and gather the low-rate streams (IMU, odometry, GPS, ``/tf_static``), which the driver
   merges per drive.
1. Poses -- keyframes and segments are chosen on the driver from the scans' stamps; each
   segment's keyframe sweeps are grouped on an executor and solved there
   (:func:`~adcloud.hdmap.poses.solve_segment`: ICP through :mod:`adcloud.hetero` plus a
   GTSAM graph); the driver joins the segments and closes loops.
2. Alignment -- executors de-skew every sweep into the map frame with the joined trajectory.
3. Grid -- per-scan tile partials, merged by tile key (``combineByKey``, many at a time),
   finalised and written as GeoTIFF tiles by the executors; the point-cloud map tiles
   likewise.  An executor that does not see the output directory (another host, no shared
   filesystem) returns its tiles' files to the driver, which writes them.
4. Labels -- lane markings, centre lines and signs from the merged layers, on the driver.

Intermediates go through an :class:`~adcloud.hdmap.exchange.Exchange`: cached in executor
memory (``mode="memory"``, one job) or written to fsync'ed files between stages
(``mode="files"``, the separate-jobs comparison).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray
from pyspark import RDD
from pyspark.broadcast import Broadcast
from pyspark.sql import SparkSession

from adcloud.binpipe import BinPipeRDD, decoded_messages
from adcloud.config import load_settings
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import DriveAccumulator, DriveData, DriveTopics, drive_name
from adcloud.hdmap.errors import DriveDataError, HdmapError
from adcloud.hdmap.exchange import Exchange, dump_items
from adcloud.hdmap.geotiff import read_grid_tile, tile_file_name, write_grid_tile, write_preview
from adcloud.hdmap.grid import (
    GridSettings,
    GridTile,
    TilePartial,
    TransientPatches,
    finalize_tile,
    merge_many_partials,
    scan_partials,
    transient_patches,
)
from adcloud.hdmap.labels import LabelSettings
from adcloud.hdmap.lanelet import LaneletSettings
from adcloud.hdmap.loops import Keyframe, KeyframeArchive, LoopSettings, find_loop_closures
from adcloud.hdmap.model import Extrinsics, Scan
from adcloud.hdmap.pcmap import (
    CloudPartial,
    MapCloud,
    PointCloudMapSettings,
    deskew,
    finalize_cloud,
    merge_many_cloud_partials,
    scan_cloud_partials,
    sensor_position,
    write_cloud_tile,
    write_pointcloud_metadata,
)
from adcloud.hdmap.poses import (
    PoseSettings,
    SegmentInput,
    SegmentSolution,
    join_segments,
    propagate,
    solution_keyframes,
    solve_segment,
    split_segments,
)
from adcloud.hdmap.signs import SignSettings
from adcloud.hdmap.trajectory import Trajectory

__all__ = [
    "STATE_CLOUD",
    "STATE_TILES",
    "PipelineResult",
    "StageSettings",
    "run_pipeline",
    "write_tile_outputs",
]

#: Where a map version keeps its merged tile statistics (for the next incremental build).
STATE_TILES = "state/tiles"
#: Where grid tiles (GeoTIFF) go in a map version.
GRID_DIR = "grid"
#: ... and its point-cloud tiles' voxel sums.
STATE_CLOUD = "state/cloud"

log = logging.getLogger(__name__)

Origin = tuple[float, float, float]
Progress = Callable[[str], None]


#: The settings section of each stage, in a config file (``hdmap_<stage>``) and the
#: environment (``ADCLOUD_HDMAP_<STAGE>_<FIELD>``).
STAGE_SECTIONS = ("poses", "loops", "grid", "cloud", "labels", "signs", "lanelet")


@dataclass(frozen=True)
class StageSettings:
    """The stages' own settings (defaults derived from :class:`HdmapSettings`)."""

    poses: PoseSettings = field(default_factory=PoseSettings)
    loops: LoopSettings = field(default_factory=LoopSettings)
    grid: GridSettings = field(default_factory=GridSettings)
    cloud: PointCloudMapSettings = field(default_factory=PointCloudMapSettings)
    labels: LabelSettings = field(default_factory=LabelSettings)
    signs: SignSettings = field(default_factory=SignSettings)
    lanelet: LaneletSettings = field(default_factory=LaneletSettings)

    @classmethod
    def load(
        cls,
        settings: HdmapSettings,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> StageSettings:
        """:meth:`from_settings`, then each stage's section of ``file`` (``hdmap_poses``,
        ``hdmap_loops``, ``hdmap_grid``, ``hdmap_cloud``, ``hdmap_labels``, ``hdmap_signs``,
        ``hdmap_lanelet``), then ``ADCLOUD_HDMAP_<STAGE>_<FIELD>``. ``settings`` keeps the
        last word on what it names (segment length, grid resolution and tile size); the
        point-cloud tile size follows the grid's unless ``hdmap_cloud.tile_size`` is set."""
        base = cls.from_settings(settings)
        fixed = {"poses": ("segment_seconds",), "grid": ("resolution", "tile_cells")}
        stages = {}
        for name in STAGE_SECTIONS:
            current = getattr(base, name)
            keep = {k: getattr(current, k) for k in fixed.get(name, ())}
            # from_settings' values are the defaults the file and environment may change
            # (the point-cloud tile size, which follows the grid's)
            defaults = {
                f.name: getattr(current, f.name)
                for f in dataclasses.fields(current)
                if f.name not in keep
            }
            stages[name] = load_settings(
                type(current),
                f"hdmap_{name}",
                file=file,
                environ=environ,
                defaults=defaults,
                **keep,
            )
        return cls(**stages)

    @classmethod
    def from_settings(cls, settings: HdmapSettings) -> StageSettings:
        """Each stage's defaults with what ``settings`` names: segment length, grid
        resolution and tile size, and point-cloud tiles of the grid tiles' size (which the
        point-cloud stage needs to drop moving objects)."""
        cells = max(1, round(settings.tile_m / settings.resolution))
        grid = dataclasses.replace(GridSettings(), resolution=settings.resolution, tile_cells=cells)
        return cls(
            poses=dataclasses.replace(PoseSettings(), segment_seconds=settings.segment_s),
            grid=grid,
            cloud=dataclasses.replace(PointCloudMapSettings(), tile_size=grid.tile_size),
        )


@dataclass
class PipelineResult:
    """What the stages produced (on the driver) and how long each took (s)."""

    drives: dict[str, DriveData]
    trajectories: dict[str, Trajectory]
    tiles: list[GridTile]
    tile_keys: list[tuple[int, int]]
    sign_points: NDArray[np.float64]
    sign_intensity: NDArray[np.float32]
    loop_closures: int
    timings: dict[str, float]
    origin: Origin
    keyframes: list[Keyframe] = field(default_factory=list)


# -- stage 0: ETL ---------------------------------------------------------------------------


#: Bag bytes per ETL partition.  Every later stage keeps these partitions and caches them
#: (decoded, then aligned sweeps: ~1.1x the bag bytes), and Spark re-reads a spilled block
#: into one buffer: half BinPipe's default keeps those blocks small for 1 GiB executors.
_PARTITION_BYTES = 64 << 20


def _etl_partition(
    blocks: Iterable[bytes | bytearray], *, drive: str, uri: str, topics: DriveTopics
) -> Iterator[tuple[str, Any]]:
    """Executor: decode one partition into ("scan", Scan) items and one ("streams", acc)."""
    acc = DriveAccumulator(drive, uri, topics=topics)
    for message, decoded in decoded_messages(blocks):
        scan = acc.add(message.topic, message.msgtype, decoded)
        if scan is not None:
            yield "scan", scan
    yield "streams", acc.chunk()


def _etl(
    spark: SparkSession,
    bags: Sequence[str | tuple[str, str]],
    topics: DriveTopics,
    exchange: Exchange,
) -> RDD[Any]:
    rdds: list[RDD[Any]] = []
    names: set[str] = set()
    for bag in bags:
        name, uri = (drive_name(bag), bag) if isinstance(bag, str) else bag
        if name in names:
            raise HdmapError(f"two drives are named {name!r}; give every bag a distinct name")
        names.add(name)
        pipe = BinPipeRDD.from_bags(
            spark, uri, topics=list(topics.all), partition_bytes=_PARTITION_BYTES
        )
        part = functools.partial(_etl_partition, drive=name, uri=uri, topics=topics)
        rdds.append(pipe.rdd.mapPartitions(part))
    union = spark.sparkContext.union(rdds) if len(rdds) > 1 else rdds[0]
    return exchange.hand_over(union, "decoded")


def _drives(
    decoded: RDD[Any],
    origin: Origin | None,
    topics: DriveTopics,
    mounts: Mapping[str, NDArray[np.float64]] | None = None,
) -> dict[str, DriveData]:
    """Driver: merge the executors' stream chunks per drive. ``mounts`` (hdmap.mounts) are
    applied here, by :meth:`DriveAccumulator.finish`: the executors' accumulators only
    gather ``/tf_static`` edges, so the settings need not cross the closure."""
    merged: dict[str, DriveAccumulator] = {}
    for _, chunk in decoded.filter(lambda kv: kv[0] == "streams").collect():
        if chunk.name not in merged:
            merged[chunk.name] = DriveAccumulator(
                chunk.name, chunk.uri, topics=topics, mounts=mounts
            )
        merged[chunk.name].absorb(chunk)
    out: dict[str, DriveData] = {}
    for name in sorted(merged):
        acc = merged[name]
        acc.origin = origin
        drive = acc.finish()
        origin = drive.origin  # every drive of a map shares the first one's origin
        out[name] = drive
    return out


# -- stage 1: poses -------------------------------------------------------------------------


def _stub(drive: str, stamp: int, frame: str) -> Scan:
    empty = np.zeros((0, 3), np.float32)
    return Scan(drive, stamp, frame, empty, np.zeros(0, np.float32), np.zeros(0, np.float32))


def _solve(
    item: tuple[tuple[str, int], Iterable[tuple[int, NDArray[np.float32]]]],
    segments: Broadcast[dict[tuple[str, int], SegmentInput]],
    settings: PoseSettings,
    device: str,
) -> SegmentSolution:
    key, clouds = item
    seg = segments.value[key]
    by_stamp = dict(clouds)
    ready = tuple(by_stamp[int(t)] for t in seg.stamps)
    return solve_segment(dataclasses.replace(seg, clouds=ready), settings, device=device or None)


def _poses(
    scans: RDD[Scan],
    drives: dict[str, DriveData],
    stages: StageSettings,
    device: str,
    progress: Progress,
    archive: KeyframeArchive | None = None,
    *,
    lidar_topic: str,
) -> tuple[dict[str, Trajectory], int, list[Keyframe]]:
    sc = scans.context
    stamps: dict[str, list[tuple[int, str]]] = {}
    for owner, stamp, frame in scans.map(lambda s: (s.drive, s.stamp, s.frame)).collect():
        stamps.setdefault(owner, []).append((stamp, frame))
    segments: dict[tuple[str, int], SegmentInput] = {}
    membership: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name, drive in drives.items():
        if name not in stamps:
            raise DriveDataError(
                f"drive {drive.uri}: no LiDAR sweeps on topic {lidar_topic!r} "
                "(hdmap.lidar_topic); check the topics the bag records and set "
                "hdmap.lidar_topic (ADCLOUD_HDMAP_LIDAR_TOPIC) to its PointCloud2 topic"
            )
        propagated = propagate(drive.imu, drive.odom, drive.extrinsics, stages.poses)
        stub = dataclasses.replace(
            drive, scans=[_stub(name, t, f) for t, f in sorted(stamps[name])]
        )
        for seg in split_segments(stub, propagated, stages.poses):
            segments[(name, seg.index)] = seg
            for t in seg.stamps:
                membership.setdefault((name, int(t)), []).append((name, seg.index))
    progress(f"poses: {len(segments)} segments of {len(drives)} drive(s)")
    member = sc.broadcast(membership)
    segments_b = sc.broadcast(segments)
    settings = stages.poses
    solve = functools.partial(_solve, segments=segments_b, settings=settings, device=device)

    dev = device or None

    def keyframe_clouds(
        scan: Scan,
    ) -> list[tuple[tuple[str, int], tuple[int, NDArray[np.float32]]]]:
        # De-skewed and downsampled where the sweep is: the shuffle carries a few thousand
        # points per keyframe instead of the sweep (a 32-beam sweep is ~1 MB).
        return [
            (seg, (scan.stamp, segments_b.value[seg].keyframe_cloud(scan, settings, device=dev)))
            for seg in member.value.get((scan.drive, scan.stamp), [])
        ]

    keyed = scans.flatMap(keyframe_clouds)
    solutions = keyed.groupByKey(numPartitions=max(1, len(segments))).map(solve).collect()
    gps = {name: d.gps for name, d in drives.items()}
    trajectories = join_segments(solutions, gps, (), stages.poses, loop_settings=stages.loops)
    closures = []
    keyframes = solution_keyframes(solutions, trajectories)
    if stages.poses.loop_closure:
        fixed: list[Keyframe] = []
        if archive is not None:
            # the map's keyframes near the new drives, within reach of a loop candidate
            xy = np.array([k.pose[:2, 3] for k in keyframes]).reshape(-1, 2)
            fixed = archive.near(xy, stages.loops.search_radius_m, exclude=set(drives))
            if fixed:
                progress(f"poses: {len(fixed)} keyframes of the map near the new drive(s)")
        closures = find_loop_closures(keyframes, stages.loops, device=device or None, fixed=fixed)
        if closures:
            trajectories = join_segments(
                solutions, gps, closures, stages.poses, loop_settings=stages.loops, fixed=fixed
            )
            keyframes = solution_keyframes(solutions, trajectories)
    return trajectories, len(closures), keyframes


def write_tile_outputs(tile: GridTile, out: Path, origin: Origin) -> None:
    """The files of one finished grid tile: GeoTIFF layers and a PNG preview."""
    path = write_grid_tile(tile, out / GRID_DIR, origin)
    write_preview(tile, out / GRID_DIR / "preview" / path.with_suffix(".png").name)


# -- stages 2 and 3: alignment and grid -----------------------------------------------------


@dataclass(frozen=True)
class AlignedScan:
    """A sweep de-skewed into the map frame, with the sensor's position at its stamp."""

    drive: str
    stamp: int
    xyz: NDArray[np.float64]
    intensity: NDArray[np.float32]
    sensor: NDArray[np.float64]


def _align(
    scan: Scan, trajectories: dict[str, Trajectory], extrinsics: dict[str, Extrinsics], device: str
) -> list[AlignedScan]:
    traj = trajectories[scan.drive]
    lo, hi = traj.span_ns
    times = scan.stamp + np.rint(scan.dt.astype(np.float64) * 1e9).astype(np.int64)
    keep = (times >= lo) & (times <= hi)
    if not keep.any():
        return []
    if not keep.all():
        scan = dataclasses.replace(
            scan,
            xyz=scan.xyz[keep],
            intensity=scan.intensity[keep],
            dt=scan.dt[keep],
            label=None if scan.label is None else scan.label[keep],
        )
    mounts = extrinsics[scan.drive]
    xyz, intensity = deskew(scan, traj, mounts, device=device or None)
    sensor = sensor_position(scan, traj, mounts) if lo <= scan.stamp <= hi else xyz.mean(axis=0)
    return [AlignedScan(scan.drive, scan.stamp, xyz, intensity, sensor)]


def _corridor(
    trajectories: dict[str, Trajectory], grid: GridSettings, margin_m: float
) -> frozenset[tuple[int, int]]:
    """Keys of the tiles within ``margin_m`` of any trajectory (where roads are)."""
    keys: set[tuple[int, int]] = set()
    size = grid.tile_size
    for traj in trajectories.values():
        xy = traj.xyz[:, :2]
        for dx in (-margin_m, 0.0, margin_m):
            for dy in (-margin_m, 0.0, margin_m):
                cells = np.floor((xy + np.array([dx, dy])) / size).astype(np.int64)
                keys.update(map(tuple, np.unique(cells, axis=0).tolist()))
    return frozenset(keys)


#: Bytes per cell of the label stage's mosaic (float32 reflectance and elevation, int32 count).
MOSAIC_CELL_BYTES = 12


def _available_memory() -> int | None:
    """Bytes of memory this machine can still give (``MemAvailable``), None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_mosaic_memory(
    keys: Iterable[tuple[int, int]], tile_cells: int, resolution: float
) -> None:
    """Refuse a label-stage mosaic over the tiles ``keys`` that this driver cannot hold.

    The label stage lays the tiles along the roads into one array over their bounding box;
    a map that is large in extent (a long drive, drives far apart) needs more memory than
    the driver has, and running out of it kills the build late, after the costly stages.
    """
    keys = list(keys)
    if not keys:
        return
    xs, ys = [k[0] for k in keys], [k[1] for k in keys]
    nx, ny = max(xs) - min(xs) + 1, max(ys) - min(ys) + 1
    need = nx * ny * tile_cells * tile_cells * MOSAIC_CELL_BYTES
    have = _available_memory()
    if have is not None and need > 0.8 * have:
        side = tile_cells * resolution
        raise HdmapError(
            f"the label stage would need {need / 2**30:.1f} GiB of driver memory for one "
            f"mosaic over {nx} x {ny} tiles ({nx * side:.0f} x {ny * side:.0f} m, {len(keys)} "
            f"of them along the roads), and this machine has {have / 2**30:.1f} GiB available. "
            "Build the area as several maps (group the drives by region), or run the driver "
            "on a machine with more memory; nothing was written"
        )


#: The file the driver leaves in the output directory while executors write tiles into it.
_MARKER = ".adcloud-driver"

_T = TypeVar("_T")

#: Files an executor could not write in place: (path relative to the output directory, bytes).
Shipped = list[tuple[str, bytes]]


def _leave_marker(out_dir: Path) -> str:
    """Driver: a random token in the output directory, for executors to recognise it by."""
    token = uuid.uuid4().hex
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / _MARKER).write_text(token)
    return token


def _write_or_ship(out: str, token: str, write: Callable[[Path], _T]) -> tuple[_T, Shipped]:
    """Executor: run ``write`` on the output directory if this process sees the driver's
    marker there (same host, or a filesystem both share); otherwise on a private temporary
    directory, whose files are returned for the driver to write.

    On a multi-host cluster whose map lives on the driver's disk or in remote storage
    (staged on the driver's disk), tiles written "in place" would land on the executor's
    own disk and never reach the map.
    """
    root = Path(out)
    try:
        here = (root / _MARKER).read_text() == token
    except OSError:
        here = False
    if here:
        return write(root), []
    with tempfile.TemporaryDirectory(prefix="adcloud-hdmap-tile-") as tmp:
        result = write(Path(tmp))
        files = [
            (path.relative_to(tmp).as_posix(), path.read_bytes())
            for path in sorted(Path(tmp).rglob("*"))
            if path.is_file()
        ]
    return result, files


def _run_sink(rdd: RDD[Any], sink: Callable[[Any], tuple[_T, Shipped]], out_dir: Path) -> list[_T]:
    """Driver: run an executor sink over ``rdd``, write the files it shipped (see
    :func:`_write_or_ship`) and return its results."""
    results = []
    for result, shipped in rdd.map(sink).collect():
        for rel, data in shipped:
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
        results.append(result)
    return results


def _tile_sink(
    item: tuple[tuple[int, int], TilePartial],
    *,
    out: str,
    token: str,
    grid: GridSettings,
    origin: Origin,
) -> tuple[tuple[tuple[int, int], TransientPatches], Shipped]:
    """Executor: keep a merged tile's statistics for later builds and write its layers;
    returns the tile's transient patches (a few KB) for the point-cloud stage, and its
    files when it could not write them in place."""
    key, partial = item

    def write(root: Path) -> None:
        state = root / STATE_TILES
        state.mkdir(parents=True, exist_ok=True)
        dump_items([partial], state / f"{key[0]}_{key[1]}.npz")
        write_tile_outputs(finalize_tile(partial, grid), root, origin)

    _, shipped = _write_or_ship(out, token, write)
    return (key, transient_patches(partial, grid)), shipped


#: Rows a key's buffered partials reach before they are merged into one on the map side.
_COMPACT_ROWS = 500_000


def _merge_by_key(pairs: RDD[Any], merge_many: Callable[[Sequence[Any]], Any]) -> RDD[Any]:
    """``reduceByKey`` for tile partials, merging many at a time.

    ``reduceByKey`` folds a tile's partials two at a time, re-copying the growing tile for
    every scan that touches it: quadratic in the scans per tile, and most of the grid and
    point-cloud stages' time on a one-minute drive.  Here each key's partials are buffered
    and merged in one pass (:func:`merge_many_partials`) once the buffered rows reach the
    merged part's size (at least :data:`_COMPACT_ROWS`): each row is regrouped O(log n)
    times and a buffer holds about twice its tile.
    """

    def compact(buf: list[Any]) -> list[Any]:
        pending = sum(len(p) for p in buf[1:])
        if len(buf) > 1 and pending >= max(len(buf[0]), _COMPACT_ROWS):
            return [merge_many(buf)]
        return buf

    def add(buf: list[Any], part: Any) -> list[Any]:
        buf.append(part)
        return compact(buf)

    def join(a: list[Any], b: list[Any]) -> list[Any]:
        return compact(a + b)

    return pairs.combineByKey(lambda part: [part], add, join).mapValues(merge_many)


def _with_previous(rdd: RDD[Any], previous: list[Any]) -> RDD[Any]:
    if not previous:
        return rdd
    return rdd.union(rdd.context.parallelize(previous, max(1, len(previous) // 8)))


def _cloud_sink(
    item: tuple[tuple[int, int], CloudPartial],
    *,
    out: str,
    token: str,
    settings: PointCloudMapSettings,
    grid: GridSettings,
    patches: Broadcast[dict[tuple[int, int], TransientPatches]],
) -> tuple[tuple[str, tuple[float, float]] | None, Shipped]:
    """Executor: keep a merged point-cloud tile's voxel sums, write its PCD file without
    the points that stood where the grid saw only passing things (no ghosts of moving cars;
    the kept sums are unfiltered, so a later build judges them again with more scans).
    Returns the tile's metadata entry, and its files when it could not write them in place."""
    key, partial = item
    cloud = finalize_cloud(partial)
    transient = patches.value.get(key)
    if transient is not None:
        keep = ~transient.standing(
            cloud.xyz, settings.transient_min_height, grid.obstacle_clearance
        )
        log.debug("point-cloud tile %s: %d transient points dropped", key, int((~keep).sum()))
        cloud = MapCloud(cloud.key, cloud.xyz[keep], cloud.intensity[keep])

    def write(root: Path) -> tuple[str, tuple[float, float]] | None:
        state = root / STATE_CLOUD
        state.mkdir(parents=True, exist_ok=True)
        dump_items([partial], state / f"{key[0]}_{key[1]}.npz")
        return write_cloud_tile(cloud, root, settings)

    return _write_or_ship(out, token, write)


def _sign_candidates(
    scan: AlignedScan, min_intensity: float
) -> list[tuple[NDArray[Any], NDArray[Any]]]:
    keep = scan.intensity >= min_intensity
    keep &= scan.xyz[:, 2] > scan.sensor[2] - 1.0  # well above the road (sensor ~1.9 m up)
    if not keep.any():
        return []
    return [(scan.xyz[keep], scan.intensity[keep])]


#: Sign candidates go down to this much (LiDAR intensity) below the sign stage's
#: ``min_intensity`` (150 at the default 160): :func:`~adcloud.hdmap.signs.detect_signs`
#: also reads the dimmer points around a bright plate, to find its post.
_SIGN_CANDIDATE_MARGIN = 10.0


def _sign_points(
    aligned: RDD[AlignedScan], settings: SignSettings
) -> tuple[NDArray[np.float64], NDArray[np.float32]]:
    """The map-frame points (m) and intensities of the aligned sweeps that the sign stage
    (``settings``) reads: well above the road and at most :data:`_SIGN_CANDIDATE_MARGIN`
    below its ``min_intensity``."""
    threshold = settings.min_intensity - _SIGN_CANDIDATE_MARGIN
    found = aligned.flatMap(lambda a: _sign_candidates(a, threshold)).collect()
    if not found:
        return np.zeros((0, 3)), np.zeros(0, np.float32)
    xyz = np.concatenate([s[0] for s in found]).astype(np.float64)
    return xyz, np.concatenate([s[1] for s in found]).astype(np.float32)


def run_pipeline(
    spark: SparkSession,
    bags: Sequence[str | tuple[str, str]],
    settings: HdmapSettings,
    out_dir: str | Path,
    *,
    origin: Origin | None = None,
    corridor_m: float = 15.0,
    exchange_dir: str | Path | None = None,
    previous_tiles: Iterable[tuple[tuple[int, int], TilePartial]] = (),
    previous_cloud: Iterable[tuple[tuple[int, int], CloudPartial]] = (),
    corridor_trajectories: dict[str, Trajectory] | None = None,
    previous_keyframes: KeyframeArchive | None = None,
    stages: StageSettings | None = None,
    progress: Progress | None = None,
) -> PipelineResult:
    """Run stages 0-3 over ``bags`` (URIs, or ``(drive name, URI)`` pairs) and return their
    products on the driver (see the module docstring), writing grid and point-cloud tiles
    under ``out_dir``. ``previous_tiles`` and
    ``previous_cloud`` (an incremental build's earlier tile statistics) merge by key;
    ``corridor_trajectories`` (earlier drives) widen the roads the label stage looks at;
    ``previous_keyframes`` (the map's keyframe archive) ties the new drives to the map by
    loop closures."""
    say = progress or (lambda text: log.info("%s", text))
    stages = stages or StageSettings.from_settings(settings)
    exchange = Exchange(settings.mode, exchange_dir)
    timings: dict[str, float] = {}
    token = _leave_marker(Path(out_dir))
    tick = time.perf_counter()
    try:
        decoded = _etl(spark, bags, settings.topics, exchange)
        drives = _drives(decoded, origin or settings.origin, settings.topics, settings.extrinsics)
        scans = decoded.filter(lambda kv: kv[0] == "scan").map(lambda kv: kv[1])
        timings["etl"] = time.perf_counter() - tick
        say(f"etl: {len(drives)} drive(s) decoded")

        tick = time.perf_counter()
        trajectories, loops, keyframes = _poses(
            scans,
            drives,
            stages,
            settings.device,
            say,
            previous_keyframes,
            lidar_topic=settings.topics.lidar,
        )
        timings["poses"] = time.perf_counter() - tick
        say(f"poses: {len(trajectories)} trajectories, {loops} loop closure(s)")

        tick = time.perf_counter()
        sc = spark.sparkContext
        traj_b = sc.broadcast(trajectories)
        mounts_b = sc.broadcast({n: d.extrinsics for n, d in drives.items()})
        device = settings.device
        aligned = exchange.hand_over(
            scans.flatMap(lambda s: _align(s, traj_b.value, mounts_b.value, device)), "aligned"
        )
        exchange.drop(decoded)  # every later stage reads the aligned scans
        timings["align"] = time.perf_counter() - tick

        tick = time.perf_counter()
        grid = stages.grid
        partials = aligned.flatMap(
            lambda a: scan_partials(
                a.xyz, a.intensity, grid, sensor_xyz=a.sensor, device=device or None
            )
        )
        partials = _with_previous(partials, list(previous_tiles))
        merged = exchange.hand_over(_merge_by_key(partials, merge_many_partials), "tiles")
        corridor = _corridor(
            {**(corridor_trajectories or {}), **trajectories}, grid, margin_m=corridor_m
        )
        check_mosaic_memory(corridor, grid.tile_cells, grid.resolution)  # before the grid stage
        map_origin = next(iter(drives.values())).origin
        sink = functools.partial(
            _tile_sink, out=str(out_dir), token=token, grid=grid, origin=map_origin
        )
        written = dict(_run_sink(merged, sink, Path(out_dir)))
        exchange.drop(merged)
        keys = sorted(written)
        # The label stage reads the tiles along the roads back from the GeoTIFFs just
        # written: shipping dense layers through the driver's JVM would cost more memory.
        tiles = [
            read_grid_tile(Path(out_dir) / GRID_DIR / tile_file_name(key)).tile
            for key in keys
            if key in corridor
        ]
        timings["grid"] = time.perf_counter() - tick
        say(f"grid: {len(keys)} tiles, {len(tiles)} along the roads")

        tick = time.perf_counter()
        cloud = stages.cloud
        clouds = aligned.flatMap(
            lambda a: scan_cloud_partials(
                a.xyz, a.intensity, cloud, sensor_xyz=a.sensor, device=device or None
            )
        )
        clouds = _merge_by_key(
            _with_previous(clouds, list(previous_cloud)), merge_many_cloud_partials
        )
        if math.isclose(cloud.tile_size, grid.tile_size):
            # the grid's tiles cover the same squares: its transient patches filter ghosts
            patches_b = sc.broadcast(written)
        else:
            log.warning(
                "point-cloud tiles (%g m) and grid tiles (%g m) differ: moving objects are "
                "not removed from the point-cloud map; leave hdmap_cloud.tile_size unset "
                "(it follows hdmap.tile_m) or give both the same size",
                cloud.tile_size,
                grid.tile_size,
            )
            patches_b = sc.broadcast({})
        cloud_sink = functools.partial(
            _cloud_sink,
            out=str(out_dir),
            token=token,
            settings=cloud,
            grid=grid,
            patches=patches_b,
        )
        entries = _run_sink(clouds, cloud_sink, Path(out_dir))
        write_pointcloud_metadata([e for e in entries if e is not None], Path(out_dir), cloud)
        timings["cloud"] = time.perf_counter() - tick
        say(f"point-cloud map: {len(entries)} tiles")

        sign_xyz, sign_int = _sign_points(aligned, stages.signs)
        return PipelineResult(
            drives=drives,
            trajectories=trajectories,
            tiles=tiles,
            tile_keys=sorted(keys),
            sign_points=sign_xyz,
            sign_intensity=sign_int,
            loop_closures=loops,
            keyframes=keyframes,
            timings=timings,
            origin=next(iter(drives.values())).origin,
        )
    finally:
        exchange.release()
        (Path(out_dir) / _MARKER).unlink(missing_ok=True)
