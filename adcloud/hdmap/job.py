"""The map build as one Spark job: bags -> poses -> aligned scans -> grid tiles -> labels.

:func:`run_pipeline` chains the four stages on a SparkSession:

0. ETL -- every bag becomes a :class:`~adcloud.binpipe.BinPipeRDD` (each task reads its own
   byte range); executors decode LiDAR sweeps into :class:`~adcloud.hdmap.model.Scan` objects
   and gather the low-rate streams (IMU, odometry, GPS, ``/tf_static``) and the sweeps'
   stamps, which reach the driver with the job that caches the sweeps
   (:meth:`~adcloud.hdmap.exchange.Exchange.hand_over_gathering`) and are merged per drive.
1. Poses -- keyframes and segments are chosen on the driver from the scans' stamps; each
   segment's keyframe sweeps are grouped on an executor and solved there
   (:func:`~adcloud.hdmap.poses.solve_segment`: ICP through :mod:`adcloud.hetero` plus a
   GTSAM graph); the driver joins the segments and closes loops.
2. Alignment -- executors de-skew every sweep into the map frame with the joined trajectory;
   the job that caches the aligned sweeps also brings each one's sensor position and sign
   candidates to the driver.
3. Grid -- per-scan tile partials, merged by tile key (``combineByKey``, many at a time),
   finalised and written as GeoTIFF tiles by the executors; the point-cloud map tiles
   likewise. An incremental build merges the previous version's statistics only into the
   tiles within the new sweeps' reach and carries the others unchanged
   (:mod:`adcloud.hdmap.kept`).  An executor that does not see the output directory
   (another host, no shared filesystem) returns its tiles' files to the driver, which
   writes them.
   The same job finds the paint cells of the tiles along the roads: each tile, padded
   with strips of its neighbours, is tested on an executor as it would be in one array.
4. Labels -- lane markings, centre lines and signs, on the driver, from those paint cells
   and point lookups on the tiles (:class:`~adcloud.hdmap.tilelayers.TileLayers`): the
   driver never holds the grid whole, so a map's extent is not bounded by its memory.

Intermediates go through an :class:`~adcloud.hdmap.exchange.Exchange`: cached in executor
memory (``mode="memory"``, one job) or written to fsync'ed files between stages
(``mode="files"``, the separate-jobs comparison).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray
from pyspark import RDD, StorageLevel
from pyspark.broadcast import Broadcast
from pyspark.sql import SparkSession
from scipy.spatial import cKDTree

from adcloud._scratch import scratch_dir
from adcloud.binpipe import BinPipeRDD, decoded_messages
from adcloud.config import load_settings, settings_dict, warn_unknown_variables
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import (
    DriveAccumulator,
    DriveData,
    DriveTopics,
    StreamChunk,
    drive_name,
)
from adcloud.hdmap.errors import DriveDataError, HdmapError
from adcloud.hdmap.exchange import Exchange, dump_items, load_items
from adcloud.hdmap.geotiff import read_grid_tile, tile_file_name, write_grid_tile, write_preview
from adcloud.hdmap.grid import (
    LAYERS,
    GridSettings,
    GridTile,
    TilePartial,
    TransientPatches,
    coarsen_tile,
    finalize_tile,
    merge_many_partials,
    overview_factor,
    scan_partials,
    transient_patches,
)
from adcloud.hdmap.kept import (
    GRID_DIR,
    STATE_CLOUD,
    STATE_LABELS,
    STATE_TILES,
    KeptVersion,
    keys_within,
)
from adcloud.hdmap.labels import (
    LabelSettings,
    PaintCells,
    paint_mask_values,
    paint_reach,
    resample_polyline,
)
from adcloud.hdmap.lanelet import LaneletSettings
from adcloud.hdmap.loops import (
    DriveTies,
    Keyframe,
    KeyframeArchive,
    LoopClosure,
    LoopSettings,
    UnplacedDrive,
    find_loop_closures,
)
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
from adcloud.hdmap.tilelayers import TileLayers
from adcloud.hdmap.trajectory import Trajectory
from adcloud.hetero.devices import ComputeDevice, as_device

__all__ = [
    "STATE_CLOUD",
    "STATE_TILES",
    "KeptTiles",
    "PipelineResult",
    "StageSettings",
    "run_pipeline",
    "write_tile_outputs",
]


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
        # a typo in a stage's name (ADCLOUD_HDMAP_LANLET_...) is beyond each section's check
        sections = {"hdmap": type(settings)}
        sections.update({f"hdmap_{n}": type(getattr(base, n)) for n in STAGE_SECTIONS})
        warn_unknown_variables(sections, environ)
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
    #: The grid along the roads, for the label stage (None: no tile there).
    layers: TileLayers | None
    #: Its paint cells (in ``layers``' cell indices), found on the executors.
    paint: PaintCells
    #: Coarse copies of the tiles along the roads (``overview_factor`` cells in one), for
    #: the map's pictures.
    overview: list[GridTile]
    overview_factor: int
    tile_keys: list[tuple[int, int]]
    sign_points: NDArray[np.float64]
    sign_intensity: NDArray[np.float32]
    loop_closures: int
    timings: dict[str, float]
    origin: Origin
    keyframes: list[Keyframe] = field(default_factory=list)
    #: Drives that came close but were not tied by loop closures, and the GPS offsets of
    #: those that were: for the build's report.
    ties: DriveTies = field(default_factory=DriveTies)


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


def _stream_chunks(item: tuple[str, Any]) -> list[StreamChunk]:
    return [item[1]] if item[0] == "streams" else []


def _etl(
    spark: SparkSession,
    bags: Sequence[str | tuple[str, str]],
    topics: DriveTopics,
    exchange: Exchange,
) -> tuple[RDD[Any], list[StreamChunk]]:
    """Decode the bags on the executors: the decoded items, handed over for the later
    stages, and every partition's stream chunk, gathered by the same job."""
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
    return exchange.hand_over_gathering(union, "decoded", _stream_chunks)


def _drives(
    chunks: Iterable[StreamChunk],
    origin: Origin | None,
    topics: DriveTopics,
    mounts: Mapping[str, NDArray[np.float64]] | None = None,
) -> tuple[dict[str, DriveData], dict[str, list[tuple[int, str]]]]:
    """Driver: merge the executors' stream chunks per drive; returns the drives and the
    ``(stamp, frame)`` of each one's sweeps. ``mounts`` (hdmap.mounts) are applied here, by
    :meth:`DriveAccumulator.finish`: the executors' accumulators only gather ``/tf_static``
    edges, so the settings need not cross the closure."""
    merged: dict[str, DriveAccumulator] = {}
    for chunk in chunks:
        if chunk.name not in merged:
            merged[chunk.name] = DriveAccumulator(
                chunk.name, chunk.uri, topics=topics, mounts=mounts
            )
        merged[chunk.name].absorb(chunk)
    out: dict[str, DriveData] = {}
    sweeps: dict[str, list[tuple[int, str]]] = {}
    for name in sorted(merged):
        acc = merged[name]
        acc.origin = origin
        drive = acc.finish()
        origin = drive.origin  # every drive of a map shares the first one's origin
        out[name] = drive
        if found := acc.sweeps:
            sweeps[name] = found
    return out, sweeps


def _on_task_device(
    device: str, fn: Callable[[Any, ComputeDevice], Iterable[_T]]
) -> Callable[[Iterable[Any]], Iterator[_T]]:
    """A ``mapPartitions`` function applying ``fn(item, device)`` to every item, with the
    task's device (``device``, or the one Spark assigned) chosen once per partition:
    choosing it per item reads the settings and Spark's assignment every time (~0.6 ms)."""

    def run(items: Iterable[Any]) -> Iterator[_T]:
        dev = as_device(device or None)
        for item in items:
            yield from fn(item, dev)

    return run


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
    stamps: Mapping[str, Sequence[tuple[int, str]]],
    stages: StageSettings,
    device: str,
    progress: Progress,
    archive: KeyframeArchive | None = None,
    *,
    lidar_topic: str,
) -> tuple[dict[str, Trajectory], int, list[Keyframe], DriveTies]:
    """Stage 1 on the cluster: each drive's trajectory, the number of loop closures, the
    keyframes (for the next build's archive) and how the drives were tied (for the
    report)."""
    sc = scans.context
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

    def keyframe_clouds(
        scan: Scan, dev: ComputeDevice
    ) -> list[tuple[tuple[str, int], tuple[int, NDArray[np.float32]]]]:
        # De-skewed and downsampled where the sweep is: the shuffle carries a few thousand
        # points per keyframe instead of the sweep (a 32-beam sweep is ~1 MB).
        return [
            (seg, (scan.stamp, segments_b.value[seg].keyframe_cloud(scan, settings, device=dev)))
            for seg in member.value.get((scan.drive, scan.stamp), [])
        ]

    keyed = scans.mapPartitions(_on_task_device(device, keyframe_clouds))
    solutions = keyed.groupByKey(numPartitions=max(1, len(segments))).map(solve).collect()
    gps = {name: d.gps for name, d in drives.items()}
    joined = join_segments(solutions, gps, (), stages.poses, loop_settings=stages.loops)
    trajectories = joined.trajectories
    closures: list[LoopClosure] = []
    ties = DriveTies()
    keyframes = solution_keyframes(solutions, trajectories)
    # the map's drives, those too far to be loaded included
    mapped = set(archive.bounds) - set(drives) if archive is not None else set()
    if stages.poses.loop_closure:
        fixed: list[Keyframe] = []
        if archive is not None:
            # the map's keyframes near the new drives, within reach of a loop candidate
            xy = np.array([k.pose[:2, 3] for k in keyframes]).reshape(-1, 2)
            fixed = archive.near(xy, stages.loops.search_radius_m, exclude=set(drives))
            if fixed:
                progress(f"poses: {len(fixed)} keyframes of the map near the new drive(s)")
        found = find_loop_closures(
            keyframes, stages.loops, device=device or None, fixed=fixed, map_drives=mapped
        )
        closures = found.closures
        if closures:
            joined = join_segments(
                solutions, gps, closures, stages.poses, loop_settings=stages.loops, fixed=fixed
            )
            trajectories = joined.trajectories
            keyframes = solution_keyframes(solutions, trajectories)
        ties = DriveTies(
            tuple(found.untied),
            {d: (float(x), float(y), float(z)) for d, (x, y, z) in joined.gps_offsets.items()},
            tuple(found.alone),
        )
    # With no fix anywhere, the reference drive defines the frame (the origin given is
    # its start); in a map of earlier drives it and those tied to it rest on that guess.
    unplaced = [*joined.unanchored, *(joined.reference if mapped else ())]
    if unplaced:
        ties = dataclasses.replace(
            ties,
            unplaced=tuple(UnplacedDrive(d, len(gps[d].t)) for d in sorted(unplaced)),
        )
    return trajectories, len(closures), keyframes, ties


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
    scan: Scan,
    trajectories: dict[str, Trajectory],
    extrinsics: dict[str, Extrinsics],
    device: ComputeDevice,
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
    xyz, intensity = deskew(scan, traj, mounts, device=device)
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
    # Spark kills the Python worker of an interrupted task (a cancelled job, a speculative
    # copy that lost) with SIGKILL: the next tile written on this host removes its directory.
    with scratch_dir("adcloud-hdmap-tile-") as tmp:
        result = write(tmp)
        files = [
            (path.relative_to(tmp).as_posix(), path.read_bytes())
            for path in sorted(tmp.rglob("*"))
            if path.is_file()
        ]
    return result, files


def _run_sink(rdd: RDD[Any], sink: Callable[[Any], tuple[_T, Shipped]], out_dir: Path) -> list[_T]:
    """Driver: run an executor sink over ``rdd``, write the files it shipped (see
    :func:`_write_or_ship`) and return its results."""
    return _collect_shipped(rdd.map(sink), out_dir)


def _collect_shipped(rdd: RDD[tuple[_T, Shipped]], out_dir: Path) -> list[_T]:
    """Driver: collect ``(result, shipped files)`` pairs, write the files, return the results.

    Executors on the driver's machine write their files in place and ship none, so their
    pairs are collected at once. Executors on other hosts ship every file they write: their
    pairs are computed in parallel and kept by Spark, then fetched one partition at a time,
    so that the driver holds one partition's files, not the whole map's."""
    if _on_one_host(rdd.context):
        pairs: Iterable[tuple[_T, Shipped]] = rdd.collect()
        kept = None
    else:
        kept = rdd.persist(StorageLevel.MEMORY_AND_DISK)
        kept.count()
        pairs = kept.toLocalIterator()
    results = []
    try:
        for result, shipped in pairs:
            for rel, data in shipped:
                dest = out_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
            results.append(result)
    finally:
        if kept is not None:
            kept.unpersist()
    return results


@dataclass(frozen=True)
class _LabelPlan:
    """What the grid stage's executors need to find the paint cells of the tiles along the
    roads (broadcast once): the ``corridor`` tile keys, the driven ``path`` (m, 2; map
    frame, points at most 0.5 m apart), the label settings, the halo each tile needs from
    its neighbours (cells) and the coarsening of the tiles' pictures."""

    corridor: frozenset[tuple[int, int]]
    path: NDArray[np.float64]
    labels: LabelSettings
    halo: int
    overview: int


#: Paint cells farther than this beyond ``max_offset_m`` from the path stay on the executors
#: (the marking stage uses those within ``max_offset_m``, and looks 0.1 m around its lines).
_PAINT_SLACK_M = 2.0

#: What one tile's paint test returns: global cell rows and columns, ground elevation (m).
TilePaint = tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float32]]

#: What the grid stage returns of a tile: its key, its transient patches (None: carried
#: unchanged), its coarse copy and its paint cells (None: not along the roads).
TileResult = tuple[tuple[int, int], TransientPatches | None, GridTile | None, TilePaint | None]

_NEIGHBOURS = [(dx, dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1) if dx or dy]


def _halo_slices(d: int, n: int, halo: int) -> tuple[slice, slice]:
    """Where a tile at offset ``d`` (-1, 0, 1 along one axis) from a padded tile lies:
    (its own cells that fall in the padding, and where they go in the padded array)."""
    if d < 0:
        return slice(n - halo, n), slice(0, halo)
    if d > 0:
        return slice(0, halo), slice(halo + n, n + 2 * halo)
    return slice(0, n), slice(halo, halo + n)


def _tile_sink(
    item: tuple[tuple[int, int], TilePartial],
    *,
    out: str,
    token: str,
    grid: GridSettings,
    origin: Origin,
    plan: Broadcast[_LabelPlan],
) -> Iterator[tuple[tuple[int, int], tuple[str, Any]]]:
    """Executor: keep a merged tile's statistics for later builds and write its layers.

    Yields records keyed by tile for :func:`_tile_labels`: the tile's own result (its
    transient patches for the point-cloud stage, a coarse copy for the map's pictures, its
    files when it could not write them in place) and, for a tile along the roads, its
    reflectance and elevation, and the strips of it that its neighbours' paint tests read.
    """
    key, partial = item
    tile = finalize_tile(partial, grid)

    def write(root: Path) -> None:
        state = root / STATE_TILES
        state.mkdir(parents=True, exist_ok=True)
        dump_items([partial], state / f"{key[0]}_{key[1]}.npz")
        write_tile_outputs(tile, root, origin)

    _, shipped = _write_or_ship(out, token, write)
    labels = plan.value
    along = key in labels.corridor
    overview = coarsen_tile(tile, labels.overview) if along else None
    yield key, ("out", (transient_patches(partial, grid), overview, shipped))
    if not along:
        return
    values = np.where(tile.count > 0, tile.reflectance_mean, np.float32(np.nan))
    yield from _paint_records(key, values, tile.elevation_mean, labels)


def _paint_records(
    key: tuple[int, int],
    values: NDArray[np.float32],
    elevation: NDArray[np.float32],
    plan: _LabelPlan,
) -> Iterator[tuple[tuple[int, int], tuple[str, Any]]]:
    """A tile's records for the paint tests: its own reflectance (NaN where unobserved) and
    elevation, and to each neighbour along the roads the strip of it that the neighbour's
    padded test reads."""
    yield key, ("core", (values, elevation))
    n = len(values)
    for dx, dy in _NEIGHBOURS:
        other = (key[0] + dx, key[1] + dy)
        if other in plan.corridor:
            # seen from `other`, this tile lies at (-dx, -dy)
            rows, _ = _halo_slices(-dy, n, plan.halo)
            cols, _ = _halo_slices(-dx, n, plan.halo)
            yield other, ("halo", (-dx, -dy, values[rows, cols].copy()))


def _tile_paint(
    key: tuple[int, int],
    core: tuple[NDArray[np.float32], NDArray[np.float32]],
    halos: Sequence[tuple[int, int, NDArray[np.float32]]],
    plan: _LabelPlan,
    grid: GridSettings,
) -> TilePaint:
    """The paint cells of tile ``key`` near the path, from its own reflectance and
    elevation (``core``) and its neighbours' strips (from :func:`_paint_records`)."""
    n, halo = grid.tile_cells, plan.halo
    values, elevation = core
    padded = np.full((n + 2 * halo, n + 2 * halo), np.nan, np.float32)
    padded[halo : halo + n, halo : halo + n] = values
    for dx, dy, strip in halos:
        padded[_halo_slices(dy, n, halo)[1], _halo_slices(dx, n, halo)[1]] = strip
    mask = paint_mask_values(padded, plan.labels, grid.resolution)
    rows, cols = np.nonzero(mask[halo : halo + n, halo : halo + n])
    x0, y0 = grid.tile_origin(key)
    xy = np.column_stack([x0 + (cols + 0.5) * grid.resolution, y0 + (rows + 0.5) * grid.resolution])
    reach = plan.labels.max_offset_m + _PAINT_SLACK_M
    path = plan.path
    close = (
        (path[:, 0] > x0 - reach)
        & (path[:, 0] < x0 + grid.tile_size + reach)
        & (path[:, 1] > y0 - reach)
        & (path[:, 1] < y0 + grid.tile_size + reach)
    )
    keep = np.zeros(len(xy), bool)
    if close.any() and len(xy):
        dist, _ = cKDTree(path[close]).query(xy, distance_upper_bound=reach)
        keep = np.isfinite(dist)
    rows, cols = rows[keep], cols[keep]
    return (
        rows.astype(np.int64) + key[1] * n,
        cols.astype(np.int64) + key[0] * n,
        elevation[rows, cols],
    )


def _tile_labels(
    item: tuple[tuple[int, int], Iterable[tuple[str, Any]]],
    *,
    grid: GridSettings,
    plan: Broadcast[_LabelPlan],
) -> list[tuple[TileResult, Shipped]]:
    """Executor: one tile's result from the records of :func:`_tile_sink` (or
    :func:`_carried_records`: no patches, nothing written), with its paint cells when it lies
    along the roads (:func:`_tile_paint`); nothing for a key that only received neighbours'
    strips (no tile there)."""
    key, records = item
    result: Any = None
    core: Any = None
    halos = []
    for kind, value in records:
        if kind == "out":
            result = value
        elif kind == "core":
            core = value
        else:
            halos.append(value)
    if result is None:
        return []
    patches, overview, shipped = result
    paint = None if core is None else _tile_paint(key, core, halos, plan.value, grid)
    return [((key, patches, overview, paint), shipped)]


def _carried_records(
    item: tuple[tuple[int, int], str | bytes, bool], *, plan: Broadcast[_LabelPlan]
) -> Iterator[tuple[tuple[int, int], tuple[str, Any]]]:
    """Executor: the records of a tile carried from the previous version (its GeoTIFF, as a
    path or its bytes) for the label stage: a coarse copy, and its paint test's inputs; for
    a tile whose own result is reused (the third item true), only the strips its
    neighbours' paint tests read."""
    key, source, strips_only = item
    tile = read_grid_tile(source).tile
    labels = plan.value
    values = np.where(tile.count > 0, tile.reflectance_mean, np.float32(np.nan))
    records = _paint_records(key, values, tile.elevation_mean, labels)
    if strips_only:
        yield from (record for record in records if record[1][0] == "halo")
        return
    yield key, ("out", (None, coarsen_tile(tile, labels.overview), []))
    yield from records


def _label_fingerprint(key: tuple[int, int], plan: _LabelPlan, grid: GridSettings) -> str:
    """What a tile's label-stage result depends on besides its own and its neighbours' data:
    the label settings, the halo, the pictures' coarsening, the grid, and which neighbours
    lie along the roads (only those send the tile their strips)."""
    along = [d for d in _NEIGHBOURS if (key[0] + d[0], key[1] + d[1]) in plan.corridor]
    return json.dumps(
        {
            "labels": settings_dict(plan.labels),
            "halo": plan.halo,
            "overview": plan.overview,
            "resolution": grid.resolution,
            "tile_cells": grid.tile_cells,
            "neighbours": along,
        },
        sort_keys=True,
    )


def _write_label_cache(path: Path, paint: TilePaint, overview: GridTile, fingerprint: str) -> None:
    """Keep a tile's label-stage result (its paint cells and coarse copy) at ``path``,
    written beside and renamed (a carried link to the previous version's is never written
    through)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {
        "fingerprint": np.array(fingerprint),
        "rows": paint[0],
        "cols": paint[1],
        "z": paint[2],
        "key": np.array(overview.key, np.int64),
        "origin": np.array(overview.origin, np.float64),
        "resolution": np.array(overview.resolution, np.float64),
    }
    arrays.update({f"overview_{name}": getattr(overview, name) for name in LAYERS})
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as handle:
        np.savez(handle, **arrays)
    partial.replace(path)


def _read_label_cache(path: Path, fingerprint: str) -> tuple[TilePaint, GridTile] | None:
    """A tile's kept label-stage result, or None when it was made for other settings or
    neighbours, or cannot be read (the tile is then read and tested again)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data["fingerprint"]) != fingerprint:
                return None
            paint = (data["rows"], data["cols"], data["z"])
            kx, ky = (int(v) for v in data["key"])
            ox, oy = (float(v) for v in data["origin"])
            layers = {name: data[f"overview_{name}"] for name in LAYERS}
            overview = GridTile(
                key=(kx, ky), origin=(ox, oy), resolution=float(data["resolution"]), **layers
            )
    except (OSError, KeyError, ValueError) as err:
        log.warning("%s: kept label result unreadable (%s); the tile is tested again", path, err)
        return None
    return paint, overview


def _reusable_labels(
    previous: KeptVersion | None,
    carried: Iterable[tuple[int, int]],
    near: frozenset[tuple[int, int]],
    plan: _LabelPlan,
    grid: GridSettings,
) -> dict[tuple[int, int], tuple[TilePaint, GridTile]]:
    """Driver: the kept label-stage results of the carried tiles along the roads that
    neither the new points nor a changed neighbour can touch (no tile within one of them
    is in ``near``), made for the same settings and neighbours."""
    if previous is None:
        return {}
    kept = previous.label_state()
    wanted = [
        key
        for key in sorted(carried)
        if key in plan.corridor
        and key in kept
        and not any((key[0] + dx, key[1] + dy) in near for dx in (-1, 0, 1) for dy in (-1, 0, 1))
    ]
    previous.fetch([kept[key] for key in wanted])
    out = {}
    for key in wanted:
        found = _read_label_cache(previous.local(kept[key]), _label_fingerprint(key, plan, grid))
        if found is not None:
            out[key] = found
    return out


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

    Which partials meet in one ``merge_many`` call, and in what order, follows the input's
    partitions and the order in which the shuffle delivers map outputs (on a cluster,
    another one in every run): ``merge_many`` must be exact (integer sums, min/max), or a
    rebuild of the same drives writes tiles that differ in their last bits.
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


@dataclass(frozen=True)
class KeptTiles:
    """Tile statistics an earlier map version kept, one file per tile (what
    :func:`~adcloud.hdmap.exchange.dump_items` wrote: ``state/tiles/*.npz``,
    ``state/cloud/*.npz``). Executors on the driver's host read them where they merge, so
    an incremental build's driver does not hold the statistics of the whole map."""

    paths: tuple[str, ...] = ()


def _kept_items(path: str) -> list[tuple[tuple[int, int], Any]]:
    """The ``(key, partial)`` pairs of one kept file."""
    return [(item.key, item) for item in load_items(path)]


def _on_one_host(sc: Any) -> bool:
    """Whether every executor registered so far runs on the driver's machine (local mode,
    or a cluster on one machine): then executors read the driver's files. An executor that
    registered with a loopback address is on it (the driver could not reach it otherwise)."""
    driver = str(sc.getConf().get("spark.driver.host", ""))

    def address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return None

    mine = address(driver)
    for info in sc.statusTracker().getExecutorInfos():
        if info.host == driver:
            continue
        there = address(info.host)
        if there is None or not (there.is_loopback or there == mine):
            return False
    return True


def _with_previous(rdd: RDD[Any], previous: KeptTiles) -> RDD[Any]:
    """``rdd`` with an earlier version's ``(key, partial)`` pairs added, for merging."""
    sc = rdd.context
    paths = list(previous.paths)
    if not paths:
        return rdd
    slices = max(1, len(paths) // 8)
    if _on_one_host(sc):
        return rdd.union(sc.parallelize(paths, slices).flatMap(_kept_items))
    # Executors on other hosts may not see the driver's disk: it reads them for them.
    log.info("executors on other hosts: the driver reads %d kept tile files", len(paths))
    return rdd.union(sc.parallelize([p for path in paths for p in _kept_items(path)], slices))


def _cloud_sink(
    item: tuple[tuple[int, int], CloudPartial],
    *,
    out: str,
    token: str,
    settings: PointCloudMapSettings,
    grid: GridSettings,
    patches: Broadcast[dict[tuple[int, int], TransientPatches]],
) -> tuple[tuple[tuple[int, int], tuple[str, tuple[float, float]] | None], Shipped]:
    """Executor: keep a merged point-cloud tile's voxel sums, write its PCD file without
    the points that stood where the grid saw only passing things (no ghosts of moving cars;
    the kept sums are unfiltered, so a later build judges them again with more scans).
    Returns the tile's key and metadata entry (None: no points), and its files when it could
    not write them in place."""
    key, partial = item
    cloud = finalize_cloud(partial)
    transient = patches.value.get(key)
    if transient is not None:
        keep = ~transient.standing(
            cloud.xyz, settings.transient_min_height, grid.obstacle_clearance
        )
        log.debug("point-cloud tile %s: %d transient points dropped", key, int((~keep).sum()))
        cloud = MapCloud(cloud.key, cloud.xyz[keep], cloud.intensity[keep])

    def write(root: Path) -> tuple[tuple[int, int], tuple[str, tuple[float, float]] | None]:
        state = root / STATE_CLOUD
        state.mkdir(parents=True, exist_ok=True)
        dump_items([partial], state / f"{key[0]}_{key[1]}.npz")
        return key, write_cloud_tile(cloud, root, settings)

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


def _aligned_extras(scan: AlignedScan, *, signs: SignSettings) -> list[tuple[str, Any]]:
    """Executor, as the align stage hands its scans over: what the driver needs of a scan
    besides the later stages' passes over them -- its sensor's position (the reach of an
    incremental build) and the points the sign stage (``signs``) reads: well above the road
    and at most :data:`_SIGN_CANDIDATE_MARGIN` below its ``min_intensity``."""
    threshold = signs.min_intensity - _SIGN_CANDIDATE_MARGIN
    extras: list[tuple[str, Any]] = [("sensor", scan.sensor[:2].copy())]
    extras.extend(("sign", found) for found in _sign_candidates(scan, threshold))
    return extras


def _sensors(extras: Iterable[tuple[str, Any]]) -> NDArray[np.float64]:
    """The sweeps' sensor positions (n, 2) among :func:`_aligned_extras`' records."""
    xy = [value for kind, value in extras if kind == "sensor"]
    return np.array(xy, np.float64).reshape(-1, 2)


def _sign_points(
    extras: Iterable[tuple[str, Any]],
) -> tuple[NDArray[np.float64], NDArray[np.float32]]:
    """The sign candidates among :func:`_aligned_extras`' records: map-frame points (m)
    and their intensities."""
    found = [value for kind, value in extras if kind == "sign"]
    if not found:
        return np.zeros((0, 3)), np.zeros(0, np.float32)
    xyz = np.concatenate([s[0] for s in found]).astype(np.float64)
    return xyz, np.concatenate([s[1] for s in found]).astype(np.float32)


def _label_plan(
    driven: Mapping[str, Trajectory],
    corridor: frozenset[tuple[int, int]],
    grid: GridSettings,
    labels: LabelSettings,
) -> _LabelPlan:
    """What the grid stage's executors need for the label stage (see :class:`_LabelPlan`)."""
    halo = paint_reach(labels, grid.resolution)
    if halo > grid.tile_cells:
        raise HdmapError(
            f"hdmap_labels.background_window_m ({labels.background_window_m} m) reaches "
            f"{halo} cells, more than a grid tile's {grid.tile_cells}; use a window under "
            f"{grid.tile_size / 2:g} m or larger tiles (hdmap.tile_m)"
        )
    parts = [resample_polyline(t.xyz[:, :2], 0.5) for t in driven.values() if len(t)]
    path = np.concatenate(parts) if parts else np.zeros((0, 2))
    factor = overview_factor(sorted(corridor), grid.tile_cells)
    return _LabelPlan(corridor, path, labels, halo, factor)


def _label_inputs(
    paint: Sequence[tuple[tuple[int, int], TilePaint]],
    out_dir: Path,
    grid: GridSettings,
    carried: Callable[[tuple[int, int]], Path | None],
) -> tuple[TileLayers | None, PaintCells]:
    """Driver: lookups on the tiles along the roads (read from the GeoTIFFs just written or
    the previous version's, ``carried(key)``, a few at a time) and their paint cells in its
    cell indices, in row-major order."""
    if not paint:
        empty = np.zeros(0, np.int64)
        return None, PaintCells(empty, empty, np.zeros(0))

    def load(key: tuple[int, int]) -> GridTile:
        path = carried(key) or out_dir / GRID_DIR / tile_file_name(key)
        return read_grid_tile(path).tile

    layers = TileLayers([k for k, _ in paint], grid, load)
    n = grid.tile_cells
    kx, ky = layers.first_key
    rows = np.concatenate([p[0] for _, p in paint]) - ky * n
    cols = np.concatenate([p[1] for _, p in paint]) - kx * n
    z = np.concatenate([p[2] for _, p in paint])
    order = np.lexsort((cols, rows))
    return layers, PaintCells(rows[order], cols[order], z[order])


#: Beyond ``max_range``, how far a tile may lie from a sensor position and still get its
#: points (m): none, since points are kept by their horizontal distance to the same sensor
#: position; the margin only absorbs rounding.
_REACH_MARGIN_M = 1.0


@dataclass(frozen=True)
class _Reach:
    """Which of the previous version's tiles an incremental build merges (those within
    ``max_range`` of a new sweep's sensor: :data:`kept_tiles`, :data:`kept_clouds`) and which
    it carries unchanged."""

    kept_tiles: KeptTiles
    carried_tiles: frozenset[tuple[int, int]]
    kept_clouds: KeptTiles
    carried_clouds: frozenset[tuple[int, int]]
    #: The grid tiles new points may reach (every tile outside them is unchanged).
    near_tiles: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def of(
        cls,
        sensors: NDArray[np.float64],
        previous: KeptVersion | None,
        grid: GridSettings,
        cloud: PointCloudMapSettings,
    ) -> _Reach:
        """``sensors`` (n, 2): where the new sweeps were taken (map frame, m)."""
        if previous is None:
            return cls(KeptTiles(), frozenset(), KeptTiles(), frozenset())

        def split(
            state: dict[tuple[int, int], str], size: float, radius: float
        ) -> tuple[KeptTiles, frozenset[tuple[int, int]]]:
            near = keys_within(sensors, size, radius + _REACH_MARGIN_M)
            merged = sorted(k for k in state if k in near or not previous.carry)
            # local paths (a map off the local filesystem downloads only these, together)
            previous.fetch([state[k] for k in merged])
            kept = KeptTiles(tuple(str(previous.local(state[k])) for k in merged))
            return kept, frozenset(state) - frozenset(merged)

        tiles, carried_tiles = split(previous.tile_state(), grid.tile_size, grid.max_range)
        clouds, carried_clouds = split(previous.cloud_state(), cloud.tile_size, cloud.max_range)
        near = keys_within(sensors, grid.tile_size, grid.max_range + _REACH_MARGIN_M)
        return cls(tiles, carried_tiles, clouds, carried_clouds, near)


def _check_carried(written: Iterable[tuple[int, int]], carried: Iterable[Any], what: str) -> None:
    """Fail the build if a tile was written although it was carried unchanged (the reach is
    a superset of the tiles new points can land in, so this is never expected: loud, and
    before anything is committed, rather than a tile that silently lost data)."""
    both = sorted(set(written) & set(carried))
    if both:
        raise HdmapError(
            f"{what} tiles {both[:5]} got new points but were carried from the previous "
            "version unchanged; nothing is committed. Report this, and build the map again "
            "with --merge-all-tiles (hdmap.carry_tiles=false) in the meantime"
        )


@dataclass
class GridStageResult:
    """What the grid stage leaves on the driver: the transient patches of each tile it wrote
    (for the point-cloud stage), coarse copies of the tiles along the roads (``overview_factor``
    cells in one), and the label stage's lookups and paint cells."""

    patches: dict[tuple[int, int], TransientPatches]
    overview: list[GridTile]
    overview_factor: int
    layers: TileLayers | None
    paint: PaintCells


def _grid_stage(
    merged: RDD[tuple[tuple[int, int], TilePartial]],
    *,
    out_dir: Path,
    token: str,
    origin: Origin,
    plan: _LabelPlan,
    grid: GridSettings,
    carried: Mapping[tuple[int, int], Callable[[], Path]] | None = None,
    reused: Mapping[tuple[int, int], tuple[TilePaint, GridTile]] | None = None,
    fetch_carried: Callable[[Sequence[tuple[int, int]]], None] | None = None,
) -> GridStageResult:
    """Finish the merged tiles on the executors (files, coarse copies, paint cells of the
    tiles along the roads) in one Spark job, and gather what the driver needs of them.
    ``carried``: tiles along the roads carried unchanged from the previous version, each
    with a function giving a local path of its GeoTIFF (which gives its paint cells and
    coarse copy); ``reused``: those of them whose kept label-stage result holds (see
    :func:`_reusable_labels`): they are read only to give their strips to neighbours that
    are tested again; ``fetch_carried``: makes the GeoTIFFs of carried tiles local in one
    batch before they are read. Every tile's label-stage result is kept in the new version."""
    carried = carried or {}
    reused = reused or {}
    sc = merged.context
    plan_b = sc.broadcast(plan)
    try:
        sink = functools.partial(
            _tile_sink, out=str(out_dir), token=token, grid=grid, origin=origin, plan=plan_b
        )
        records = merged.flatMap(sink)
        tested = {key for key in carried if key not in reused}
        strips = {
            key
            for key in reused
            if any(
                (key[0] + dx, key[1] + dy) in plan.corridor
                and (key[0] + dx, key[1] + dy) not in reused
                for dx, dy in _NEIGHBOURS
            )
        }
        reads = sorted(tested | strips)
        if reads and fetch_carried is not None:
            fetch_carried(reads)
        if reads:
            sources: list[tuple[tuple[int, int], str | bytes, bool]]
            if _on_one_host(sc):
                sources = [(key, str(carried[key]()), key in strips) for key in reads]
            else:  # executors elsewhere may not see the driver's disk
                sources = [(key, carried[key]().read_bytes(), key in strips) for key in reads]
            reader = functools.partial(_carried_records, plan=plan_b)
            slices = max(1, len(sources) // 8)
            records = records.union(sc.parallelize(sources, slices).flatMap(reader))
        labelled = records.groupByKey().flatMap(
            functools.partial(_tile_labels, grid=grid, plan=plan_b)
        )
        tiles_out = _collect_shipped(labelled, out_dir)
    finally:
        plan_b.unpersist()
    for key, _, coarse, found in tiles_out:
        if found is not None and coarse is not None:
            name = f"{key[0]}_{key[1]}.npz"
            fingerprint = _label_fingerprint(key, plan, grid)
            _write_label_cache(out_dir / STATE_LABELS / name, found, coarse, fingerprint)
    tiles_out += [(key, None, coarse, found) for key, (found, coarse) in reused.items()]
    log.info(
        "labels: %d tiles along the roads tested, %d kept results reused (%d of them read "
        "for their neighbours)",
        sum(1 for *_, p in tiles_out if p is not None) - len(reused),
        len(reused),
        len(strips),
    )

    def local(key: tuple[int, int]) -> Path | None:
        find = carried.get(key)
        return None if find is None else find()

    layers, paint = _label_inputs(
        [(key, p) for key, _, _, p in tiles_out if p is not None], out_dir, grid, local
    )
    return GridStageResult(
        patches={key: patches for key, patches, _, _ in tiles_out if patches is not None},
        overview=sorted((o for _, _, o, _ in tiles_out if o is not None), key=lambda t: t.key),
        overview_factor=plan.overview,
        layers=layers,
        paint=paint,
    )


def run_pipeline(
    spark: SparkSession,
    bags: Sequence[str | tuple[str, str]],
    settings: HdmapSettings,
    out_dir: str | Path,
    *,
    origin: Origin | None = None,
    corridor_m: float = 15.0,
    exchange_dir: str | Path | None = None,
    previous: KeptVersion | None = None,
    corridor_trajectories: dict[str, Trajectory] | None = None,
    previous_keyframes: KeyframeArchive | None = None,
    stages: StageSettings | None = None,
    progress: Progress | None = None,
) -> PipelineResult:
    """Run stages 0-3 over ``bags`` (URIs, or ``(drive name, URI)`` pairs) and return their
    products on the driver (see the module docstring), writing grid and point-cloud tiles
    under ``out_dir``. ``previous`` (an incremental build's previous version): the tiles
    within the new drives' reach merge its statistics by key, the others are carried into
    ``out_dir`` as they are (:mod:`adcloud.hdmap.kept`);
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
        decoded, chunks = _etl(spark, bags, settings.topics, exchange)
        drives, stamps = _drives(
            chunks, origin or settings.origin, settings.topics, settings.extrinsics
        )
        scans = decoded.filter(lambda kv: kv[0] == "scan").map(lambda kv: kv[1])
        timings["etl"] = time.perf_counter() - tick
        say(f"etl: {len(drives)} drive(s) decoded")

        tick = time.perf_counter()
        trajectories, loops, keyframes, ties = _poses(
            scans,
            drives,
            stamps,
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
        aligned, extras = exchange.hand_over_gathering(
            scans.mapPartitions(
                _on_task_device(device, lambda s, d: _align(s, traj_b.value, mounts_b.value, d))
            ),
            "aligned",
            functools.partial(_aligned_extras, signs=stages.signs),
        )
        exchange.drop(decoded)  # every later stage reads the aligned scans
        timings["align"] = time.perf_counter() - tick

        tick = time.perf_counter()
        grid, cloud = stages.grid, stages.cloud
        reach = _Reach.of(_sensors(extras), previous, grid, cloud)
        partials = aligned.mapPartitions(
            _on_task_device(
                device,
                lambda a, d: scan_partials(a.xyz, a.intensity, grid, sensor_xyz=a.sensor, device=d),
            )
        )
        partials = _with_previous(partials, reach.kept_tiles)
        merged = exchange.hand_over(_merge_by_key(partials, merge_many_partials), "tiles")
        driven = {**(corridor_trajectories or {}), **trajectories}
        corridor = _corridor(driven, grid, margin_m=corridor_m)
        carried = previous.carry_grid(reach.carried_tiles, Path(out_dir)) if previous else []
        plan = _label_plan(driven, corridor, grid, stages.labels)
        reused = _reusable_labels(previous, carried, reach.near_tiles, plan, grid)
        if previous is not None:
            previous.carry_labels(reused, Path(out_dir))
        tiles = _grid_stage(
            merged,
            out_dir=Path(out_dir),
            token=token,
            origin=next(iter(drives.values())).origin,
            plan=plan,
            grid=grid,
            carried={
                key: functools.partial(previous.grid_tile, key)
                for key in carried
                if key in corridor
            }
            if previous is not None
            else None,
            reused=reused,
            fetch_carried=previous.fetch_grid if previous is not None else None,
        )
        exchange.drop(merged)
        _check_carried(tiles.patches, carried, "grid")
        written, keys = tiles.patches, sorted({*tiles.patches, *carried})
        timings["grid"] = time.perf_counter() - tick
        say(
            f"grid: {len(keys)} tiles ({len(carried)} carried unchanged), "
            f"{len(tiles.overview)} along the roads"
        )

        tick = time.perf_counter()
        clouds = aligned.mapPartitions(
            _on_task_device(
                device,
                lambda a, d: scan_cloud_partials(
                    a.xyz, a.intensity, cloud, sensor_xyz=a.sensor, device=d
                ),
            )
        )
        clouds = _merge_by_key(_with_previous(clouds, reach.kept_clouds), merge_many_cloud_partials)
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
        sunk = _run_sink(clouds, cloud_sink, Path(out_dir))
        _check_carried([key for key, _ in sunk], reach.carried_clouds, "point-cloud")
        entries = [entry for _, entry in sunk]
        if previous is not None:
            kept = previous.carry_clouds(reach.carried_clouds, cloud.tile_size, Path(out_dir))
        else:
            kept = []
        listed = [e for e in entries if e is not None] + kept
        write_pointcloud_metadata(listed, Path(out_dir), cloud)
        timings["cloud"] = time.perf_counter() - tick
        say(f"point-cloud map: {len(listed)} tiles ({len(kept)} carried unchanged)")

        sign_xyz, sign_int = _sign_points(extras)
        return PipelineResult(
            drives=drives,
            trajectories=trajectories,
            layers=tiles.layers,
            paint=tiles.paint,
            overview=tiles.overview,
            overview_factor=tiles.overview_factor,
            tile_keys=sorted(keys),
            sign_points=sign_xyz,
            sign_intensity=sign_int,
            loop_closures=loops,
            keyframes=keyframes,
            ties=ties,
            timings=timings,
            origin=next(iter(drives.values())).origin,
        )
    finally:
        exchange.release()
        (Path(out_dir) / _MARKER).unlink(missing_ok=True)
