"""``adcloud hdmap build``: one incremental, idempotent, atomic map build.

:func:`build_map` plans against the map's current version (:class:`~adcloud.hdmap.mapdir.MapDir`:
drives known by content hash are skipped; nothing new means nothing is written), runs the
pipeline of :mod:`adcloud.hdmap.job` over the new drives only, merges their grid and
point-cloud tiles by key into the previous version's, extracts the semantic layers from the
merged grid, and commits the new version atomically. The new drives' poses are tied to the
map by loop closures against the keyframes earlier builds kept (their poses do not move).

A version directory holds::

    trajectory/<drive>.tum, <drive>.kitti.txt     poses of base_link in map (TUM, KITTI)
    grid/<tx>_<ty>.tif, grid/preview/<tx>_<ty>.png  5 cm GeoTIFF tiles and their previews
    grid_elevation.png, grid_reflectance.png      mosaics of the whole grid
    pointcloud_map/<x>_<y>.pcd                    Autoware point-cloud map tiles
    pointcloud_map_metadata.yaml                  their index (Autoware's convention)
    lanelet2_map.osm, map_projector_info.yaml     the Lanelet2 map and its projection
    semantic.geojson                              lane markings, lanes, reference lines, signs
    labels/imported.json                          human/external labels kept across rebuilds
    report/summary.html                           a page to look at
    settings.json, manifest.json                  effective settings; drives by content hash
    state/                                        tile statistics the next build merges into,
                                                  keyframes its new drives are tied to
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pyspark.sql import SparkSession

from adcloud.config import settings_dict
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.errors import HdmapError
from adcloud.hdmap.exchange import dump_items, load_items
from adcloud.hdmap.geotiff import write_mosaic
from adcloud.hdmap.grid import GridTile
from adcloud.hdmap.job import STATE_CLOUD, STATE_TILES, PipelineResult, StageSettings, run_pipeline
from adcloud.hdmap.labels import (
    GridLayers,
    extract_lane_markings,
    lane_centerlines,
    reference_lines,
)
from adcloud.hdmap.lanelet import write_lanelet2, write_map_projector_info
from adcloud.hdmap.loops import KeyframeArchive
from adcloud.hdmap.mapdir import BuildPlan, BuildResult, MapDir, MapDirSettings, Staging, find_bags
from adcloud.hdmap.report import write_report
from adcloud.hdmap.semantic import SemanticMap, import_labels, merge_labels, write_geojson
from adcloud.hdmap.signs import detect_signs
from adcloud.hdmap.trajectory import Trajectory

__all__ = ["BuildSummary", "bag_uris", "build_map", "mosaic_layers", "plan_build"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
IMPORTED_LABELS = "labels/imported.json"
_STATE_ORIGIN = "state/origin.json"
_STATE_SIGNS = "state/sign_points.npz"
#: The drives' keyframes (poses and clouds), which tie the next build's new drives to the map.
STATE_KEYFRAMES = "state/keyframes"


@dataclass(frozen=True)
class BuildSummary:
    """What a build did: the mapdir result, the pipeline's timings (s) and counts."""

    result: BuildResult
    timings: dict[str, float]
    counts: dict[str, int]

    @property
    def changed(self) -> bool:
        return self.result.changed


def mosaic_layers(tiles: Sequence[GridTile]) -> GridLayers | None:
    """One :class:`GridLayers` covering ``tiles`` (the label stage's input)."""
    if not tiles:
        return None
    res = tiles[0].resolution
    rows, cols = tiles[0].shape
    kx = [t.key[0] for t in tiles]
    ky = [t.key[1] for t in tiles]
    x0, y0 = min(kx), min(ky)
    width, height = (max(kx) - x0 + 1) * cols, (max(ky) - y0 + 1) * rows
    refl = np.full((height, width), np.nan, np.float32)
    elev = np.full((height, width), np.nan, np.float32)
    count = np.zeros((height, width), np.int32)
    for t in tiles:
        r, c = (t.key[1] - y0) * rows, (t.key[0] - x0) * cols
        refl[r : r + rows, c : c + cols] = t.reflectance_mean
        elev[r : r + rows, c : c + cols] = t.elevation_mean
        count[r : r + rows, c : c + cols] = t.count
    origin = (
        tiles[0].origin[0] - (tiles[0].key[0] - x0) * cols * res,
        tiles[0].origin[1] - (tiles[0].key[1] - y0) * rows * res,
    )
    return GridLayers(origin=origin, resolution=res, reflectance=refl, elevation=elev, count=count)


def _origin_info(root: Path) -> dict[str, Any]:
    origin_file = root / _STATE_ORIGIN
    info: dict[str, Any] = json.loads(origin_file.read_text()) if origin_file.is_file() else {}
    return info


@contextlib.contextmanager
def _parent_state(staging: Staging) -> Iterator[tuple[Path | None, dict[str, Any]]]:
    """The parent version's local directory (None for a first build) and its
    ``state/origin.json``. A map that is not on a local filesystem is downloaded into a
    temporary directory, removed when the block ends (a whole version, every build)."""
    parent = staging.parent
    if parent is None:
        yield None, {}
    elif parent.path is not None:
        yield parent.path, _origin_info(parent.path)
    else:
        with tempfile.TemporaryDirectory(prefix="hdmap-parent-", ignore_cleanup_errors=True) as tmp:
            root = parent.fetch(tmp)
            yield root, _origin_info(root)


def _previous_items(root: Path | None, folder: str) -> list[Any]:
    if root is None or not (root / folder).is_dir():
        return []
    items: list[Any] = []
    for path in sorted((root / folder).glob("*.npz")):
        items.extend((item.key, item) for item in load_items(path))
    return items


def _semantic(
    result: PipelineResult,
    trajectories: dict[str, Trajectory],
    imported: SemanticMap | None,
    stages: StageSettings,
) -> SemanticMap:
    layers = mosaic_layers(result.tiles)
    markings: list[Any] = []
    centers: list[Any] = []
    refs: list[Any] = []
    if layers is not None and trajectories:
        # All drives at once, in the order they joined the map: a road that several drives
        # covered gets its markings and lanes once, from the first of them.
        driven = list(trajectories.values())
        markings = extract_lane_markings(layers, driven, stages.labels)
        centers = lane_centerlines(markings, driven, stages.labels)
        refs = reference_lines(markings, driven, stages.labels)
    signs = detect_signs(result.sign_points, result.sign_intensity, layers, stages.signs)
    auto = SemanticMap(
        markings=tuple(markings),
        centerlines=tuple(centers),
        reference_lines=tuple(refs),
        signs=tuple(signs),
        origin=result.origin,
    )
    return merge_labels(auto, imported) if imported is not None else auto


def _write_version(
    out: Path,
    result: PipelineResult,
    trajectories: dict[str, Trajectory],
    semantic: SemanticMap,
    settings: HdmapSettings,
    stages: StageSettings,
) -> dict[str, int]:
    (out / "trajectory").mkdir(parents=True, exist_ok=True)
    for name, traj in trajectories.items():
        if not (out / "trajectory" / f"{name}.tum").exists():
            traj.write_tum(out / "trajectory" / f"{name}.tum")
            traj.write_kitti(out / "trajectory" / f"{name}.kitti.txt")
    write_geojson(out / "semantic.geojson", semantic)
    lanelets = write_lanelet2(out / "lanelet2_map.osm", semantic, result.origin, stages.lanelet)
    write_map_projector_info(out / "map_projector_info.yaml", result.origin)
    if result.tiles:
        write_mosaic(result.tiles, out / "grid_elevation.png", "elevation_mean")
        write_mosaic(result.tiles, out / "grid_reflectance.png", "reflectance_mean")
    (out / "state").mkdir(exist_ok=True)
    lat, lon, alt = result.origin
    (out / _STATE_ORIGIN).write_text(json.dumps({"origin": [lat, lon, alt]}))
    dump_items([result.sign_points, result.sign_intensity], out / _STATE_SIGNS)
    (out / "settings.json").write_text(
        json.dumps({"hdmap": settings_dict(settings)}, indent=2, default=str) + "\n"
    )
    layers = mosaic_layers(result.tiles)
    write_report(
        out / "report",
        trajectories=trajectories,
        grid=layers,
        lane_markings=[m.points for m in semantic.markings],
        signs=np.array([s.position for s in semantic.signs]).reshape(-1, 3),
        lanes=[c.points for c in semantic.centerlines],
        connectors=lanelets.connector_lines,
        inputs={name: d.uri for name, d in result.drives.items()},
        title="HD map build",
    )
    return {
        "lane_markings": len(semantic.markings),
        "lanes": len(semantic.centerlines),
        "signs": len(semantic.signs),
        "lanelets": lanelets.lanelets,
        "lanelet_connectors": lanelets.connectors,
    }


def bag_uris(bags: str | Sequence[str]) -> list[str]:
    """The bags named by ``bags`` (files, directories, globs, URIs); an error if one names none."""
    uris: list[str] = []
    for item in [bags] if isinstance(bags, str) else bags:
        found = find_bags(item)
        if not found:
            raise HdmapError(f"no bag found at {item}; give bag files, a directory or a glob")
        uris.extend(found)
    return uris


def plan_build(bags: str | Sequence[str], map_uri: str) -> BuildPlan:
    """What :func:`build_map` would do, without Spark (e.g. to skip starting a session)."""
    return MapDir(map_uri).plan(bag_uris(bags))


def build_map(
    spark: SparkSession,
    bags: str | Sequence[str],
    map_uri: str,
    settings: HdmapSettings | None = None,
    *,
    labels: str | None = None,
    stages: StageSettings | None = None,
    progress: Progress | None = None,
    plan: BuildPlan | None = None,
) -> BuildSummary:
    """Build (or extend) the map at ``map_uri`` from ``bags`` (a directory, glob, URI or a
    list of them). ``labels``: a GeoJSON of human/external labels to import; they are kept
    in every later version. ``plan``: what :func:`plan_build` returned for the same bags
    and map, so that the bags are not hashed again (a build committed since is noticed and
    planned anew). Returns what was done; nothing is written when every drive is already
    in the map."""
    settings = settings or HdmapSettings()
    stages = stages or StageSettings.from_settings(settings)
    say = progress or (lambda text: log.info("%s", text))
    uris = bag_uris(bags)
    mapdir = MapDir(map_uri, MapDirSettings(keep_versions=settings.keep_versions))
    timings: dict[str, float] = {}
    counts: dict[str, int] = {}

    def build(plan: BuildPlan, staging: Staging) -> None:
        with _parent_state(staging) as (parent_root, info):
            build_on(plan, staging, parent_root, info)

    def build_on(
        plan: BuildPlan, staging: Staging, parent_root: Path | None, info: dict[str, Any]
    ) -> None:
        out = staging.path
        origin = tuple(info["origin"]) if "origin" in info else settings.origin
        archive = None
        if parent_root is not None and (parent_root / STATE_KEYFRAMES).is_dir():
            archive = KeyframeArchive(parent_root / STATE_KEYFRAMES)
        previous_tiles = _previous_items(parent_root, STATE_TILES)
        previous_cloud = _previous_items(parent_root, STATE_CLOUD)
        previous_traj: dict[str, Trajectory] = {}
        if parent_root is not None:
            carried = [
                f"trajectory/{p.name}" for p in sorted((parent_root / "trajectory").iterdir())
            ]
            staging.copy_from_parent(*carried)
            for path in sorted((parent_root / "trajectory").glob("*.tum")):
                previous_traj[path.stem] = Trajectory.read_tum(path)
        exchange_dir = settings.exchange_dir or str(out / ".exchange")
        new = [(d.name, d.uri) for d in plan.new_drives]
        say(f"building {len(new)} new drive(s) into version {staging.version_id}")
        result = run_pipeline(
            spark,
            new,
            settings,
            out,
            origin=origin,
            exchange_dir=exchange_dir,
            previous_tiles=previous_tiles,
            previous_cloud=previous_cloud,
            corridor_trajectories=previous_traj,
            previous_keyframes=archive,
            stages=stages,
            progress=say,
        )
        shutil.rmtree(out / ".exchange", ignore_errors=True)
        KeyframeArchive.write(out / STATE_KEYFRAMES, result.keyframes, carry=archive)
        trajectories = {**previous_traj, **result.trajectories}
        if parent_root is not None and (parent_root / _STATE_SIGNS).is_file():
            old_pts, old_int = load_items(parent_root / _STATE_SIGNS)
            result = dataclasses.replace(
                result,
                sign_points=np.concatenate([old_pts, result.sign_points]),
                sign_intensity=np.concatenate([old_int, result.sign_intensity]),
            )
        imported: SemanticMap | None = None
        if parent_root is not None and (parent_root / IMPORTED_LABELS).is_file():
            imported = import_labels(parent_root / IMPORTED_LABELS)
        if labels:
            fresh = import_labels(labels, default_source="external")
            imported = merge_labels(imported, fresh) if imported is not None else fresh
        tick = time.perf_counter()
        semantic = _semantic(result, trajectories, imported, stages)
        if imported is not None:
            (out / "labels").mkdir(exist_ok=True)
            write_geojson(out / IMPORTED_LABELS, imported)
        counts.update(_write_version(out, result, trajectories, semantic, settings, stages))
        timings.update(result.timings)
        timings["labels+outputs"] = time.perf_counter() - tick
        counts["drives_new"] = len(new)
        counts["tiles"] = len(result.tile_keys)
        counts["loop_closures"] = result.loop_closures

    started = time.perf_counter()
    outcome = mapdir.update(uris, build, settings=settings, plan=plan)
    timings["total"] = time.perf_counter() - started
    return BuildSummary(outcome, timings, counts)
