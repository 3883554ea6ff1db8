"""``adcloud hdmap build``: one incremental, idempotent, atomic map build.

:func:`build_map` plans against the map's current version (:class:`~adcloud.hdmap.mapdir.MapDir`:
drives known by content hash are skipped; nothing new means nothing is written), runs the
pipeline of :mod:`adcloud.hdmap.job` over the new drives only, merges their grid and
point-cloud tiles by key into the previous version's (tiles out of the new drives' reach are
copied as they are: :mod:`adcloud.hdmap.kept`), extracts the semantic layers from the
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
                                                  (a build given labels and no new drive
                                                  writes a version with just them merged)
    report/summary.html                           a page to look at; its notes name the
                                                  drives loop closures did not tie (those
                                                  that came close to no other drive too)
                                                  and each tied drive's GPS offset
    report/drive_ties.json                        the same, machine-readable
    settings.json, manifest.json                  effective settings; drives by content hash
    state/                                        tile statistics the next build merges into,
                                                  keyframes its new drives are tied to, the
                                                  automatic features before labels merged
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pyspark.sql import SparkSession

from adcloud._scratch import scratch_dir
from adcloud.config import names, settings_dict
from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import check_topics
from adcloud.hdmap.errors import DriveDataError, HdmapError, MapFormatError
from adcloud.hdmap.evaluate import GridLayers as ReportGrid
from adcloud.hdmap.exchange import dump_items, load_items
from adcloud.hdmap.geotiff import read_grid_tile, write_mosaic
from adcloud.hdmap.grid import GridSettings, GridTile, coarsen_tile, overview_factor
from adcloud.hdmap.job import PipelineResult, StageSettings, run_pipeline
from adcloud.hdmap.kept import (
    GRID_DIR,
    TILE_FOLDERS,
    TILE_SETTINGS,
    KeptVersion,
    LocalFiles,
    VersionFiles,
    check_tile_layout,
    tile_settings,
)
from adcloud.hdmap.labels import lane_centerlines, markings_from_paint, reference_lines
from adcloud.hdmap.lanelet import LaneletSummary, write_lanelet2, write_map_projector_info
from adcloud.hdmap.loops import DriveTies, KeyframeArchive
from adcloud.hdmap.mapdir import (
    MANIFEST_NAME,
    BuildPlan,
    BuildResult,
    DriveRecord,
    HashProgress,
    MapDir,
    MapDirSettings,
    MapVersion,
    Staging,
    bag_changed,
    bag_uri,
    find_bags,
    lies_below,
    local_path,
)
from adcloud.hdmap.report import TIES_JSON_NAME, write_report
from adcloud.hdmap.semantic import (
    LabelArea,
    SemanticMap,
    automatic_features,
    combine_labels,
    import_labels,
    merge_labels,
    parse_geojson,
    read_geojson,
    same_features,
    same_origin,
    write_geojson,
)
from adcloud.hdmap.signcam import SignVote, apply_camera_types, camera_sign_votes
from adcloud.hdmap.signs import TrafficSign, detect_signs
from adcloud.hdmap.trajectory import Trajectory

__all__ = ["BuildSummary", "bag_uris", "build_map", "check_layout", "plan_build"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
IMPORTED_LABELS = "labels/imported.json"
_STATE_ORIGIN = "state/origin.json"
_STATE_SIGNS = "state/sign_points.npz"
#: The camera's votes on sign types, by map position: every drive's, so that a later build
#: types its signs without reading the earlier drives' images again.
_STATE_SIGN_VOTES = "state/sign_votes.json"
#: The automatic features before imported labels were merged in: what a labels-only
#: version merges its labels into (semantic.geojson holds them already trimmed).
_STATE_AUTO = "state/auto_semantic.geojson"
#: The drives' keyframes (poses and clouds), which tie the next build's new drives to the map.
STATE_KEYFRAMES = "state/keyframes"


@dataclass(frozen=True)
class BuildSummary:
    """What a build did: the mapdir result, the pipeline's timings (s) and counts."""

    result: BuildResult
    timings: dict[str, float]
    counts: dict[str, int]
    #: Bags left out because they cannot be mapped (``skip_bad_bags``): URI -> why.
    skipped: dict[str, str] = field(default_factory=dict)
    #: What pose recovery found about how this build's drives hold together (drives that
    #: came close but were not tied, each tied drive's GPS offset): the report's notes.
    notes: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.result.changed


def _report_grid(overview: Sequence[GridTile]) -> list[ReportGrid]:
    """The coarse tiles of a version as the report draws them."""
    return [
        ReportGrid(t.elevation_mean, t.origin, t.resolution, t.reflectance_mean) for t in overview
    ]


def _tile_key(name: str, root: Path) -> tuple[int, int]:
    """The key of the grid tile file ``name`` (``<tx>_<ty>.tif``) of the version at ``root``."""
    x, _, y = name.removesuffix(".tif").partition("_")
    try:
        return int(x), int(y)
    except ValueError:
        raise MapFormatError(
            f"{root / GRID_DIR / name}: not a grid tile name (<tx>_<ty>.tif); the map "
            "version is damaged"
        ) from None


def _overview_of(files: VersionFiles, stages: StageSettings) -> list[GridTile]:
    """Coarse copies of every GeoTIFF tile of a version's ``grid/`` (downloaded together
    where the map is off the local filesystem, then read one at a time)."""
    names = [name for name in files.names(GRID_DIR) if name.endswith(".tif")]
    keys = [_tile_key(name, files.root) for name in names]
    factor = overview_factor(keys, stages.grid.tile_cells)
    files.fetch([f"{GRID_DIR}/{name}" for name in names])
    return [
        coarsen_tile(read_grid_tile(files.local(f"{GRID_DIR}/{name}")).tile, factor)
        for name in names
    ]


def _origin_info(root: Path) -> dict[str, Any]:
    origin_file = root / _STATE_ORIGIN
    info: dict[str, Any] = json.loads(origin_file.read_text()) if origin_file.is_file() else {}
    return info


@contextlib.contextmanager
def _parent_state(
    staging: Staging,
) -> Iterator[tuple[Path | None, dict[str, Any], VersionFiles | None]]:
    """The parent version's local directory (None for a first build), its
    ``state/origin.json``, and how its files are read and carried. A map that is not on a
    local filesystem is downloaded into a directory in ``staging_dir`` (or the temporary
    directory), removed when the block ends (or, when the driver was killed, by the next
    build's): all but the tile folders, whose
    files the build downloads as it merges or reads them and has copied on the map's
    storage as it carries them."""
    parent = staging.parent
    if parent is None:
        yield None, {}, None
    elif parent.path is not None:
        yield parent.path, _origin_info(parent.path), LocalFiles(parent.path)
    else:
        where = staging._mapdir.settings.staging_dir or None  # where room was made for it
        with scratch_dir("hdmap-parent-", where) as tmp:
            root = parent.fetch(tmp, skip=TILE_FOLDERS)
            yield root, _origin_info(root), staging.parent_files(root)


def _load_votes(path: Path) -> list[SignVote]:
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())["votes"]
        return [SignVote(*row) for row in rows]
    except (ValueError, KeyError, TypeError) as err:
        raise HdmapError(
            f"{path}: unreadable sign votes ({err}); delete the file to type the signs by "
            "LiDAR and this build's camera images only"
        ) from err


def _semantic(
    result: PipelineResult,
    trajectories: dict[str, Trajectory],
    imported: SemanticMap | None,
    stages: StageSettings,
    votes_for: Callable[[list[TrafficSign]], list[SignVote]] | None = None,
) -> tuple[SemanticMap, SemanticMap]:
    """The automatic features and the map published: them with ``imported`` merged in.
    ``votes_for``: the camera's votes on the types of the signs found (none: LiDAR only)."""
    layers = result.layers
    markings: list[Any] = []
    centers: list[Any] = []
    refs: list[Any] = []
    if layers is not None and trajectories:
        # All drives at once, in the order they joined the map: a road that several drives
        # covered gets its markings and lanes once, from the first of them.
        driven = list(trajectories.values())
        markings = markings_from_paint(layers, result.paint, driven, stages.labels)
        centers = lane_centerlines(markings, driven, stages.labels)
        refs = reference_lines(markings, driven, stages.labels)
    signs = detect_signs(result.sign_points, result.sign_intensity, layers, stages.signs)
    if layers is not None:
        log.info("labels: %d grid tiles read for lookups", layers.reads)
    if votes_for is not None:
        signs = apply_camera_types(signs, votes_for(signs), stages.signs)
    auto = SemanticMap(
        markings=tuple(markings),
        centerlines=tuple(centers),
        reference_lines=tuple(refs),
        signs=tuple(signs),
        origin=result.origin,
    )
    return auto, merge_labels(auto, imported) if imported is not None else auto


def _merged_labels(parent_root: Path | None, fresh: SemanticMap | None) -> SemanticMap | None:
    """The labels a new version keeps: the parent's, with ``fresh`` merged over them."""
    imported: SemanticMap | None = None
    if parent_root is not None and (parent_root / IMPORTED_LABELS).is_file():
        imported = import_labels(parent_root / IMPORTED_LABELS, check=False)
    if fresh is not None:
        imported = combine_labels(imported, fresh) if imported is not None else fresh
    return imported


def _labels_change_map(parent: MapVersion, fresh: SemanticMap) -> bool:
    """Whether merging ``fresh`` changes the labels the ``parent`` version keeps."""
    where = f"{parent.uri}/{IMPORTED_LABELS}"
    try:
        data = json.loads(parent.read_bytes(IMPORTED_LABELS))
    except MapFormatError:  # the map keeps no labels yet
        return len(fresh) > 0
    except ValueError as err:
        raise HdmapError(f"{where}: not JSON ({err}); the map version is damaged") from err
    kept = parse_geojson(data, where)
    return not same_features(kept, combine_labels(kept, fresh))


def _map_origin(parent: MapVersion) -> tuple[float, float, float] | None:
    """The map frame's origin as the version ``parent`` keeps it (None: not kept)."""
    where = f"{parent.uri}/{_STATE_ORIGIN}"
    try:
        info = json.loads(parent.read_bytes(_STATE_ORIGIN))
        lat, lon, alt = (float(v) for v in info["origin"])
    except MapFormatError:  # a version written before the origin was kept
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise MapFormatError(
            f"{where}: not the map's origin ({err}); the map version is damaged"
        ) from err
    return lat, lon, alt


def _read_labels(labels: str, stages: StageSettings, area: LabelArea | None = None) -> SemanticMap:
    """The label file ``labels`` as a build imports it (its sign types are those of the
    sign catalogue of ``stages``; with ``area``, its positions within reach of it)."""
    types = [shape.type for shape in stages.signs.catalog]
    return import_labels(labels, default_source="external", sign_types=types, area=area)


def _check_label_area(
    labels: str, stages: StageSettings, bounds: Mapping[str, Sequence[float]], what: str
) -> None:
    """Refuse the label file ``labels`` when one of its positions lies beyond the reach of
    the area of the map's drives: ``bounds``, each drive's keyframe box ``(x0, y0, x1, y1)``
    (map frame, m; :class:`KeyframeArchive`), ``what`` naming them. The file is read again:
    the area is known only once the map's version (or, for new drives, their poses) is."""
    if not bounds:  # a version written before keyframes were kept: no area to check with
        return
    corners = [xy for box in bounds.values() for xy in (box[:2], box[2:4])]
    _read_labels(labels, stages, LabelArea.around(corners, what))


def _version_bounds(parent: MapVersion) -> dict[str, tuple[float, float, float, float]]:
    """The keyframe box of each drive of the version ``parent`` (empty: none kept)."""
    where = f"{parent.uri}/{STATE_KEYFRAMES}/{KeyframeArchive.INDEX}"
    try:
        text = parent.read_bytes(f"{STATE_KEYFRAMES}/{KeyframeArchive.INDEX}")
    except MapFormatError:  # a version written before keyframes were kept
        return {}
    return KeyframeArchive.parse_index(text, where)


def _label_source(labels: str) -> str:
    """How a version's manifest names the label file it imported: a URL as given, a local
    path made absolute (a relative one says nothing once the build's directory is gone)."""
    return labels if "://" in labels else str(Path(labels).absolute())


def _check_label_origin(
    labels: str, fresh: SemanticMap, parent: MapVersion | None, settings: HdmapSettings
) -> None:
    """Refuse the labels ``fresh`` (read from ``labels``) when their map origin is not the
    map's (or, on a map without a version, the configured one): merging them would fail
    after the whole pipeline."""
    origin = _map_origin(parent) if parent is not None else settings.origin
    if not same_origin(origin, fresh.origin):
        whose = f"version {parent.id}'s" if parent is not None else "configured (hdmap.origin_*)"
        raise HdmapError(
            f'{labels}: the labels\' map origin {fresh.origin} ("adcloud:origin") differs from '
            f"the map's {origin} (the {whose}); labels must be in the map's frame: re-project "
            "them to it"
        )


def labels_would_change(
    plan: BuildPlan,
    labels: str,
    *,
    settings: HdmapSettings | None = None,
    stages: StageSettings | None = None,
) -> bool:
    """Whether importing the label file ``labels`` into the version ``plan`` builds on
    changes the labels the map keeps (what ``build --dry-run --labels`` reports).  The file
    is read and checked as a build with ``settings`` and ``stages`` reads it (its features,
    sign types and map origin): a missing, malformed or misplaced file raises
    :class:`HdmapError` naming it.  True on a map without a version, where the labels go
    into the first version with its drives."""
    settings = settings or HdmapSettings()
    stages = stages or StageSettings.from_settings(settings)
    fresh = _read_labels(labels, stages)
    _check_label_origin(labels, fresh, plan.parent, settings)
    if plan.parent is not None and plan.up_to_date:
        # with new drives, the area is the parent's and theirs: checked once they are posed
        what = f"the drives of version {plan.parent.id}"
        _check_label_area(labels, stages, _version_bounds(plan.parent), what)
    return plan.parent is None or _labels_change_map(plan.parent, fresh)


def check_layout(plan: BuildPlan, stages: StageSettings) -> None:
    """Raise :class:`~adcloud.hdmap.errors.BuildError` when ``plan`` has new drives to merge
    into a version whose tiles are laid out otherwise than ``stages`` lay them out (grid
    resolution, tile and patch size; point-cloud tile and voxel size): those tiles cannot be
    merged. Reads one small file of the version; a check before Spark starts."""
    parent = plan.parent
    if parent is None or not plan.new_drives:
        return
    where = f"{parent.uri}/{TILE_SETTINGS}"
    try:
        kept = json.loads(parent.read_bytes(TILE_SETTINGS))
    except MapFormatError:  # a version written before the record was kept
        return
    except ValueError as err:
        raise MapFormatError(f"{where}: not JSON ({err}); the map version is damaged") from err
    if not isinstance(kept, dict):
        raise MapFormatError(f"{where}: not a JSON object; the map version is damaged")
    check_tile_layout(kept, stages.grid, stages.cloud, where)


def _write_semantic(
    out: Path,
    auto: SemanticMap,
    semantic: SemanticMap,
    imported: SemanticMap | None,
    origin: tuple[float, float, float],
    stages: StageSettings,
) -> LaneletSummary:
    """The version's semantic outputs: GeoJSON, Lanelet2 map, kept labels, automatic state."""
    write_geojson(out / "semantic.geojson", semantic)
    (out / "state").mkdir(exist_ok=True)
    write_geojson(out / _STATE_AUTO, auto)
    if imported is not None:
        (out / "labels").mkdir(exist_ok=True)
        write_geojson(out / IMPORTED_LABELS, imported)
    return write_lanelet2(out / "lanelet2_map.osm", semantic, origin, stages.lanelet)


def _grid_text(keys: Sequence[tuple[int, int]], drawn: int, grid: GridSettings) -> str:
    """The report's grid row for a version whose ``keys`` tiles are in ``grid/`` and whose
    picture shows ``drawn`` coarse copies of them (a build has them of the tiles along the
    roads only): figures of the coarse copies would describe a part of the grid."""
    if not keys:
        return "no tiles"
    size = grid.tile_size
    x0, x1 = min(k[0] for k in keys) * size, (max(k[0] for k in keys) + 1) * size
    y0, y1 = min(k[1] for k in keys) * size, (max(k[1] for k in keys) + 1) * size
    return (
        f"{len(keys)} tile(s) of {size:g} m in grid/, cells of {grid.resolution * 100:g} cm, "
        f"x {x0:.1f}..{x1:.1f} m, y {y0:.1f}..{y1:.1f} m; drawn: {drawn} of them"
    )


def _write_report(
    out: Path,
    trajectories: dict[str, Trajectory],
    layers: Sequence[ReportGrid],
    semantic: SemanticMap,
    lanelets: LaneletSummary,
    inputs: dict[str, str],
    grid_text: str,
    ties: DriveTies,
) -> None:
    write_report(
        out / "report",
        trajectories=trajectories,
        grid=layers,
        grid_text=grid_text,
        lane_markings=[m.points for m in semantic.markings],
        signs=np.array([s.position for s in semantic.signs]).reshape(-1, 3),
        lanes=[c.points for c in semantic.centerlines],
        connectors=lanelets.connector_lines,
        inputs=inputs,
        title="HD map build",
        ties=ties,
    )


def _parent_ties(parent_root: Path | None) -> DriveTies:
    """The drive ties the parent version's report records (none for a first build)."""
    if parent_root is None:
        return DriveTies()
    return DriveTies.read(parent_root / "report" / TIES_JSON_NAME)


def _semantic_counts(semantic: SemanticMap, lanelets: LaneletSummary) -> dict[str, int]:
    return {
        "lane_markings": len(semantic.markings),
        "lanes": len(semantic.centerlines),
        "signs": len(semantic.signs),
        "signs_typed": sum(s.type != "unknown" for s in semantic.signs),
        "signs_typed_by_camera": sum(
            s.attributes.get("type_from") == "camera" for s in semantic.signs
        ),
        "lanelets": lanelets.lanelets,
        "lanelet_connectors": lanelets.connectors,
    }


def _relabel(
    plan: BuildPlan,
    staging: Staging,
    files: VersionFiles,
    parent_root: Path,
    origin: tuple[float, float, float],
    fresh: SemanticMap,
    stages: StageSettings,
) -> dict[str, int]:
    """A version that differs from its parent only by ``fresh`` labels merged in: the
    parent's files, with the semantic outputs and the report made again. The tiles are
    carried (links, or copies on the map's storage); the other files are copied, since
    some are written again."""
    out = staging.path
    assert staging.parent is not None
    others = []
    for rel in staging.parent.files():
        if lies_below(rel, TILE_FOLDERS):
            files.carry(rel, out)
        elif rel != MANIFEST_NAME:
            others.append(rel)
    if others:
        staging.copy_from_parent(*others, local=parent_root)
    imported = _merged_labels(parent_root, fresh)
    assert imported is not None
    if (parent_root / _STATE_AUTO).is_file():
        auto = read_geojson(parent_root / _STATE_AUTO)
    else:
        # A version written before the automatic features were kept: take them from the
        # published map, where earlier labels have already trimmed them.
        log.warning(
            "%s has no %s; merging the labels into the automatic features of its semantic.geojson",
            parent_root,
            _STATE_AUTO,
        )
        auto = automatic_features(read_geojson(parent_root / "semantic.geojson"))
    semantic = merge_labels(auto, imported)
    lanelets = _write_semantic(out, auto, semantic, imported, origin, stages)
    trajectories = {
        p.stem: Trajectory.read_tum(p) for p in sorted((parent_root / "trajectory").glob("*.tum"))
    }
    overview = _report_grid(_overview_of(files, stages))
    keys = [_tile_key(n, files.root) for n in files.names(GRID_DIR) if n.endswith(".tif")]
    ties = _parent_ties(parent_root)  # the poses are the parent's
    shutil.rmtree(out / "report", ignore_errors=True)
    _write_report(
        out,
        trajectories,
        overview,
        semantic,
        lanelets,
        {d.name: d.uri for d in plan.known_drives},
        _grid_text(keys, len(overview), stages.grid),
        ties,
    )
    return {**_semantic_counts(semantic, lanelets), "labels_imported": len(imported)}


def _write_version(
    out: Path,
    result: PipelineResult,
    trajectories: dict[str, Trajectory],
    semantic: tuple[SemanticMap, SemanticMap, SemanticMap | None],
    settings: HdmapSettings,
    stages: StageSettings,
) -> dict[str, int]:
    """``semantic``: the automatic features, the published map and the kept labels."""
    (out / "trajectory").mkdir(parents=True, exist_ok=True)
    for name, traj in trajectories.items():
        if not (out / "trajectory" / f"{name}.tum").exists():
            traj.write_tum(out / "trajectory" / f"{name}.tum")
            traj.write_kitti(out / "trajectory" / f"{name}.kitti.txt")
    auto, published, imported = semantic
    lanelets = _write_semantic(out, auto, published, imported, result.origin, stages)
    write_map_projector_info(out / "map_projector_info.yaml", result.origin)
    if result.overview:
        write_mosaic(result.overview, out / "grid_elevation.png", "elevation_mean")
        write_mosaic(result.overview, out / "grid_reflectance.png", "reflectance_mean")
    (out / "state").mkdir(exist_ok=True)
    lat, lon, alt = result.origin
    (out / _STATE_ORIGIN).write_text(json.dumps({"origin": [lat, lon, alt]}))
    dump_items([result.sign_points, result.sign_intensity], out / _STATE_SIGNS)
    (out / "settings.json").write_text(
        json.dumps({"hdmap": settings_dict(settings)}, indent=2, default=str) + "\n"
    )
    (out / TILE_SETTINGS).write_text(json.dumps(tile_settings(stages.grid, stages.cloud)))
    inputs = {name: d.uri for name, d in result.drives.items()}
    drawn = _report_grid(result.overview)
    grid_text = _grid_text(result.tile_keys, len(drawn), stages.grid)
    _write_report(out, trajectories, drawn, published, lanelets, inputs, grid_text, result.ties)
    return _semantic_counts(published, lanelets)


def bag_uris(
    bags: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
) -> list[str]:
    """The bags named by ``bags`` (files, directories, globs, URIs; one string or path is
    one name); an error if there is none or one names none."""
    items = names(bags)
    if not items:
        raise HdmapError("no bags given: give bag files, a directory or a glob")
    uris: list[str] = []
    for item in items:
        found = find_bags(item)
        if not found:
            raise HdmapError(f"no bag found at {item}; give bag files, a directory or a glob")
        uris.extend(found)
    return uris


#: What Autoware's map loader reads from a map directory (``map_path``).
AUTOWARE_FILES = (
    "pointcloud_map/",
    "pointcloud_map_metadata.yaml",
    "lanelet2_map.osm",
    "map_projector_info.yaml",
)


def _check_autoware_files(version: MapVersion) -> None:
    """Raise :class:`MapFormatError` unless ``version`` holds every file Autoware's map
    loader reads (:data:`AUTOWARE_FILES`, and every tile its point-cloud metadata lists): an
    export without one would not load on the car."""
    files = set(version.files())
    missing = [
        name
        for name in AUTOWARE_FILES
        if not (any(rel.startswith(name) for rel in files) if name.endswith("/") else name in files)
    ]
    if not missing:
        try:
            meta = yaml.safe_load(version.read_bytes("pointcloud_map_metadata.yaml"))
        except yaml.YAMLError as err:
            raise MapFormatError(
                f"{version.uri}/pointcloud_map_metadata.yaml: not valid YAML ({err}); the map "
                "version is damaged (build the map again from its bags)"
            ) from err
        tiles = meta if isinstance(meta, dict) else {}
        missing = sorted(
            f"pointcloud_map/{name}"
            for name in tiles
            if name not in ("x_resolution", "y_resolution")
            and f"pointcloud_map/{name}" not in files
        )
    if missing:
        raise MapFormatError(
            f"{version.uri}: {', '.join(missing[:5])}"
            f"{f' (and {len(missing) - 5} more)' if len(missing) > 5 else ''} missing; "
            "Autoware's map loader needs it: the map version is damaged (export another "
            "version with --version, or build the map again from its bags)"
        )


def export_map(
    map_uri: str, dest: str | Path, *, version: str | None = None, autoware: bool = False
) -> tuple[MapVersion, list[str]]:
    """Copy a version of the map (the current one unless ``version``) into the new local
    directory ``dest``: every file a person or a driving stack uses -- all but ``state/``,
    the statistics only the next build reads -- or, with ``autoware``, only what Autoware's
    map loader reads (:data:`AUTOWARE_FILES`).  Returns the version and the files copied."""
    with MapDir(map_uri) as mapdir:
        chosen = mapdir.version(version) if version is not None else mapdir.current()
        if chosen is None:
            raise HdmapError(mapdir.no_version_text())
        if chosen.path is not None:  # a map on the local disk: versions/<id> below its root
            root = chosen.path.parent.parent.resolve()
            target = local_path(dest, "an export").resolve()
            if target == root or root in target.parents:
                raise HdmapError(
                    f"{dest} lies inside the map directory {map_uri}: export to a directory "
                    "outside it (a build manages everything below it)"
                )

        if autoware:
            _check_autoware_files(chosen)

        def wanted(rel: str) -> bool:
            if autoware:
                return any(
                    rel == f or (f.endswith("/") and rel.startswith(f)) for f in AUTOWARE_FILES
                )
            return not lies_below(rel, ["state"])

        return chosen, chosen.export(dest, wanted)


def unmappable(
    drives: Sequence[DriveRecord], settings: HdmapSettings, *, origin_known: bool
) -> dict[str, str]:
    """The drives among ``drives`` whose bags lack what mapping needs, by URI, each with the
    reason (see :func:`~adcloud.hdmap.drive.check_topics`: reads the bags' indexes, and
    their GPS up to a fix when the map has no origin yet), or
    changed since the plan hashed them (:func:`~adcloud.hdmap.mapdir.bag_changed`).
    ``origin_known``: the map has an origin already, so GPS is optional."""
    bad = {}
    for drive in drives:
        changed = bag_changed(drive)
        if changed is not None:
            bad[drive.uri] = changed
            continue
        try:
            check_topics(
                drive.uri,
                settings.topics,
                origin_known=origin_known,
                mounts_known=bool(settings.mounts),
            )
        except DriveDataError as err:
            bad[drive.uri] = str(err)
    return bad


def plan_build(
    bags: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    map_uri: str,
    *,
    readmit: Sequence[str] = (),
    trust_mtime: bool = False,
    settings: HdmapSettings | None = None,
    progress: HashProgress | None = None,
) -> BuildPlan:
    """What :func:`build_map` would do, without Spark (e.g. to skip starting a session).
    ``progress(bytes hashed, bytes to hash)`` follows the hashing of the new bags.  The map
    is closed when the plan is made; its parent version stays readable (see
    :meth:`MapDir.close`), and :func:`build_map` reads it through the map it opens."""
    uris = bag_uris(bags)
    with MapDir(map_uri, _mapdir_settings(settings or HdmapSettings())) as mapdir:
        return mapdir.plan(uris, readmit=readmit, trust_mtime=trust_mtime, progress=progress)


def _mapdir_settings(settings: HdmapSettings) -> MapDirSettings:
    return MapDirSettings(keep_versions=settings.keep_versions, hash_threads=settings.hash_threads)


def build_map(
    spark: SparkSession | None,
    bags: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    map_uri: str,
    settings: HdmapSettings | None = None,
    *,
    labels: str | None = None,
    stages: StageSettings | None = None,
    progress: Progress | None = None,
    plan: BuildPlan | None = None,
    readmit: Sequence[str] = (),
    skip_bad_bags: bool = False,
    trust_mtime: bool = False,
) -> BuildSummary:
    """Build (or extend) the map at ``map_uri`` from ``bags`` (a directory, glob, URI or a
    list of them). ``labels``: a GeoJSON of human/external labels to import; they are kept
    in every later version. ``plan``: what :func:`plan_build` returned for the same bags
    and map, so that the bags are not hashed again (a build committed since is noticed and
    planned anew). ``readmit``: drives that a rollback held out to build again (names or
    SHA-256 prefixes; their bags must be among ``bags``). ``skip_bad_bags``: new bags that
    lack a stream mapping needs, or have no index or an unreadable one (a recording cut off,
    or a copy still being written), are left out of this build and reported in the summary,
    and the others are built (like Spark's ``ignoreCorruptFiles``); they are not recorded,
    so a later build tries them again. ``trust_mtime``: a bag whose URI, size and
    modification time match the manifest is not read again to hash it (see
    :meth:`MapDir.plan`). Returns what was done; nothing is written when every drive is
    already in the map and no label changes it. ``spark`` may be None when the plan has no
    new drive (a labels-only version needs no Spark)."""
    settings = settings or HdmapSettings()
    stages = stages or StageSettings.from_settings(settings)
    say = progress or (lambda text: log.info("%s", text))
    uris = bag_uris(bags)
    # Read the labels first: a bad label file fails now, not after the whole pipeline.
    fresh = _read_labels(labels, stages) if labels else None
    # closed when the build is done: a store's map (local://, alluxio://) holds threads and
    # files; the versions the summary holds stay readable (see MapDir.close)
    with MapDir(map_uri, _mapdir_settings(settings)) as mapdir:
        if plan is not None:  # made by plan_build, whose map is closed: read through this one
            plan = mapdir.adopt(plan)
        timings: dict[str, float] = {}
        counts: dict[str, int] = {}
        notes: list[str] = []
        relabel = False
        skipped: dict[str, str] = {}
        checked: set[str] = set()  # new bags whose topics were checked already
        if plan is None and (skip_bad_bags or fresh is not None):
            plan = mapdir.plan(uris, readmit=readmit, trust_mtime=trust_mtime)
        if skip_bad_bags:
            assert plan is not None  # planned above
            origin_known = settings.origin is not None or plan.parent is not None
            skipped = unmappable(plan.new_drives, settings, origin_known=origin_known)
            checked = {d.uri for d in plan.new_drives}
            for why in skipped.values():
                log.warning("skipped: %s", why)
            if skipped:
                uris = [uri for uri in uris if bag_uri(uri) not in skipped]
                kept = tuple(d for d in plan.new_drives if d.uri not in skipped)
                plan = dataclasses.replace(plan, new_drives=kept)
        if plan is not None:  # else the build checks it when it opens the parent version
            check_layout(plan, stages)
        if fresh is not None and labels:
            assert plan is not None  # planned above
            if plan.parent is None:
                _check_label_origin(labels, fresh, None, settings)
            if plan.up_to_date and plan.parent is not None:
                relabel = _labels_change_map(plan.parent, fresh)
                if not relabel:
                    say(f"{map_uri}: no new drive, and the labels are in the map already")

        def build(plan: BuildPlan, staging: Staging) -> None:
            with _parent_state(staging) as (parent_root, info, files):
                build_on(plan, staging, parent_root, info, files)

        def build_on(
            plan: BuildPlan,
            staging: Staging,
            parent_root: Path | None,
            info: dict[str, Any],
            files: VersionFiles | None,
        ) -> None:
            out = staging.path
            origin = tuple(info["origin"]) if "origin" in info else settings.origin
            if fresh is not None and not same_origin(origin, fresh.origin):
                # checked here, where the parent's origin is read anyway, before any Spark job
                raise HdmapError(
                    f'{labels}: the labels\' map origin {fresh.origin} ("adcloud:origin") differs '
                    f"from the map's {origin}; labels must be in the map's frame: re-project them "
                    "to it"
                )
            if not plan.new_drives and parent_root is not None and fresh is not None:
                say(f"merging labels into version {staging.version_id} (no new drive)")
                tick = time.perf_counter()
                if "origin" not in info:
                    raise HdmapError(
                        f"{map_uri}: version {plan.parent.id if plan.parent else '?'} has no "
                        f"{_STATE_ORIGIN}; build it again from its bags to import labels into it"
                    )
                lat, lon, alt = (float(v) for v in info["origin"])
                assert files is not None  # a parent exists
                assert labels is not None  # fresh was read from it
                if (parent_root / STATE_KEYFRAMES).is_dir():
                    bounds = KeyframeArchive(parent_root / STATE_KEYFRAMES).bounds
                    what = f"the drives of version {plan.parent.id if plan.parent else '?'}"
                    _check_label_area(labels, stages, bounds, what)
                counts.update(
                    _relabel(plan, staging, files, parent_root, (lat, lon, alt), fresh, stages)
                )
                timings["labels+outputs"] = time.perf_counter() - tick
                counts["drives_new"] = 0
                return
            archive = None
            if parent_root is not None and (parent_root / STATE_KEYFRAMES).is_dir():
                archive = KeyframeArchive(parent_root / STATE_KEYFRAMES)
            previous_traj: dict[str, Trajectory] = {}
            if parent_root is not None:
                carried = [
                    f"trajectory/{p.name}" for p in sorted((parent_root / "trajectory").iterdir())
                ]
                staging.copy_from_parent(*carried, local=parent_root)
                for path in sorted((parent_root / "trajectory").glob("*.tum")):
                    previous_traj[path.stem] = Trajectory.read_tum(path)
            # read before the pipeline runs: a record this version cannot read fails the build
            # now, not after the whole of it
            earlier_ties = _parent_ties(parent_root)
            if spark is None:
                raise HdmapError(
                    f"{map_uri}: {len(plan.new_drives)} new drive(s) to build, and no Spark "
                    "session was given"
                )
            # a tile layout the parent's tiles cannot be merged with fails here, before Spark
            previous = (
                KeptVersion.of(
                    parent_root, stages.grid, stages.cloud, carry=settings.carry_tiles, files=files
                )
                if parent_root is not None
                else None
            )
            # read before the pipeline runs: a bad file or bag fails the build now, not after it
            unchecked = [d for d in plan.new_drives if d.uri not in checked]
            bad = unmappable(unchecked, settings, origin_known=origin is not None)
            if bad:
                raise DriveDataError("; ".join(bad.values()))
            votes = _load_votes(parent_root / _STATE_SIGN_VOTES) if parent_root is not None else []
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
                previous=previous,
                corridor_trajectories=previous_traj,
                previous_keyframes=archive,
                stages=stages,
                progress=say,
            )
            shutil.rmtree(out / ".exchange", ignore_errors=True)
            # a bag written to while Spark read it: its recorded hash is not of what was built
            moved = [why for d in plan.new_drives if (why := bag_changed(d)) is not None]
            if moved:
                raise DriveDataError("; ".join(moved) + "; nothing written: build again")
            archived = KeyframeArchive.write(out / STATE_KEYFRAMES, result.keyframes, carry=archive)
            if labels and fresh is not None:  # the map's area, the new drives' included, is known
                _check_label_area(
                    labels, stages, archived.bounds, "the map's drives (new ones included)"
                )
            trajectories = {**previous_traj, **result.trajectories}
            if parent_root is not None and (parent_root / _STATE_SIGNS).is_file():
                old_pts, old_int = load_items(parent_root / _STATE_SIGNS)
                result = dataclasses.replace(
                    result,
                    sign_points=np.concatenate([old_pts, result.sign_points]),
                    sign_intensity=np.concatenate([old_int, result.sign_intensity]),
                )
            # The map's earlier drives do not move (fixed keyframes): what their builds found
            # about their ties still holds, and the report lists it with the new drives'.
            notes.extend(result.ties.notes())  # this build's own, for the command line
            result = dataclasses.replace(result, ties=earlier_ties | result.ties)
            imported = _merged_labels(parent_root, fresh)
            tick = time.perf_counter()

            def votes_for(signs: list[TrafficSign]) -> list[SignVote]:
                assert spark is not None  # checked above
                cameras = {name: (d.uri, d.extrinsics) for name, d in result.drives.items()}
                votes.extend(
                    camera_sign_votes(spark, cameras, result.trajectories, signs, stages.signs)
                )
                return votes

            auto, published = _semantic(result, trajectories, imported, stages, votes_for)
            (out / "state").mkdir(exist_ok=True)
            (out / _STATE_SIGN_VOTES).write_text(json.dumps({"votes": [list(v) for v in votes]}))
            counts.update(
                _write_version(
                    out, result, trajectories, (auto, published, imported), settings, stages
                )
            )
            if imported is not None:
                counts["labels_imported"] = len(imported)
            timings.update(result.timings)
            timings["labels+outputs"] = time.perf_counter() - tick
            counts["drives_new"] = len(new)
            counts["tiles"] = len(result.tile_keys)
            counts["loop_closures"] = result.loop_closures

        started = time.perf_counter()
        outcome = mapdir.update(
            uris,
            build,
            settings=settings,
            plan=plan,
            force=relabel,
            readmit=readmit,
            trust_mtime=trust_mtime,
            labels=_label_source(labels) if labels else None,
        )
        timings["total"] = time.perf_counter() - started
        if skipped:
            counts["bags_skipped"] = len(skipped)
        return BuildSummary(outcome, timings, counts, skipped, notes)
