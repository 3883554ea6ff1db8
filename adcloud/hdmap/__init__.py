"""HD maps from drives: poses -> ICP-aligned scans -> a 5 cm grid -> lanes and signs.

- :func:`build_map` -- the nightly build (``adcloud hdmap build``): incremental by content
  hash, idempotent and atomic over a versioned map directory (:class:`MapDir`, whose
  ``roll_back`` republishes an earlier version); :func:`plan_build` says what it would do;
  :func:`export_map` copies a version out for a driving stack; :func:`diff_versions` says
  what changed between two versions (``adcloud hdmap diff``);
- :func:`run_pipeline` -- the four stages as one Spark job (intermediates in executor
  memory, or exchanged through files for comparison);
- stages: :func:`estimate_trajectory` (GTSAM pose graph with GPS, odometry, IMU, LiDAR scan
  matching and loop closures), :func:`scan_partials` / :func:`merge_partials` /
  :func:`finalize_tile` (grid tiles), :func:`extract_lane_markings`, :func:`detect_signs`;
- outputs: GeoTIFF tiles, Autoware point-cloud tiles and ``map_projector_info.yaml``,
  ``lanelet2_map.osm``, GeoJSON, TUM/KITTI trajectories, an HTML report;
- :func:`evaluate_map` -- accuracy against a synthetic drive's truth (``adcloud hdmap eval``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud._lazy import lazy_exports

if TYPE_CHECKING:
    from adcloud.hdmap.build import BuildSummary, build_map, export_map, plan_build
    from adcloud.hdmap.config import HdmapSettings
    from adcloud.hdmap.diff import MapDiff, diff_versions
    from adcloud.hdmap.drive import DriveData, DriveTopics, read_drive
    from adcloud.hdmap.errors import BuildError, DriveDataError, HdmapError, MapFormatError
    from adcloud.hdmap.evaluate import EvalResult, evaluate_map
    from adcloud.hdmap.grid import (
        GridSettings,
        GridTile,
        finalize_tile,
        merge_partials,
        scan_partials,
    )
    from adcloud.hdmap.job import PipelineResult, StageSettings, run_pipeline
    from adcloud.hdmap.labels import GridLayers, extract_lane_markings, lane_centerlines
    from adcloud.hdmap.mapdir import MapDir, MapVersion
    from adcloud.hdmap.poses import PoseSettings, estimate_trajectory
    from adcloud.hdmap.semantic import SemanticMap, import_labels, merge_labels
    from adcloud.hdmap.signs import detect_signs
    from adcloud.hdmap.trajectory import Trajectory, absolute_trajectory_error

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "build": ("BuildSummary", "build_map", "export_map", "plan_build"),
        "config": ("HdmapSettings",),
        "diff": ("MapDiff", "diff_versions"),
        "drive": ("DriveData", "DriveTopics", "read_drive"),
        "errors": ("BuildError", "DriveDataError", "HdmapError", "MapFormatError"),
        "evaluate": ("EvalResult", "evaluate_map"),
        "grid": ("GridSettings", "GridTile", "finalize_tile", "merge_partials", "scan_partials"),
        "job": ("PipelineResult", "StageSettings", "run_pipeline"),
        "labels": ("GridLayers", "extract_lane_markings", "lane_centerlines"),
        "mapdir": ("MapDir", "MapVersion"),
        "poses": ("PoseSettings", "estimate_trajectory"),
        "semantic": ("SemanticMap", "import_labels", "merge_labels"),
        "signs": ("detect_signs",),
        "trajectory": ("Trajectory", "absolute_trajectory_error"),
    },
)

__all__ = [
    "BuildError",
    "BuildSummary",
    "DriveData",
    "DriveDataError",
    "DriveTopics",
    "EvalResult",
    "GridLayers",
    "GridSettings",
    "GridTile",
    "HdmapError",
    "HdmapSettings",
    "MapDiff",
    "MapDir",
    "MapFormatError",
    "MapVersion",
    "PipelineResult",
    "PoseSettings",
    "SemanticMap",
    "StageSettings",
    "Trajectory",
    "absolute_trajectory_error",
    "build_map",
    "detect_signs",
    "diff_versions",
    "estimate_trajectory",
    "evaluate_map",
    "export_map",
    "extract_lane_markings",
    "finalize_tile",
    "import_labels",
    "lane_centerlines",
    "merge_labels",
    "merge_partials",
    "plan_build",
    "read_drive",
    "run_pipeline",
    "scan_partials",
]
