"""The semantic layers of a map, their GeoJSON form, and labels imported from people.

A :class:`SemanticMap` holds the four layers stage 4 produces -- lane markings, lane centre
lines, road reference lines, traffic signs -- plus ``extras``: imported features of other
kinds (curbs, poles, crosswalks ...) kept verbatim.

GeoJSON (format version 1)
    An RFC 7946 FeatureCollection whose coordinates are **map-frame metres** ``[x, y, z]``
    (``[x, y]`` where the height is unknown), not longitude/latitude; the foreign members
    ``"adcloud:frame": "map"``, ``"adcloud:units": "m"``, ``"adcloud:origin"`` (the map
    frame's WGS84 origin: ``latitude_deg``, ``longitude_deg``, ``height_m``) and
    ``"adcloud:version": 1`` say so -- the layout of the synthetic drives' truth
    ``map.geojson``, which therefore reads as a label file. Each feature has ``id`` and
    ``properties.kind`` (``lane_marking``, ``lane_centerline``, ``reference_line``,
    ``traffic_sign``; any other kind is an extra) and ``properties.source``: ``auto``
    (extracted by the build), ``human`` (drawn or corrected by a person) or ``external``
    (another system's labels). Properties the layer does not know are kept in the feature's
    ``attributes`` and written back unchanged.

Labels kept across rebuilds (:func:`import_labels`, :func:`merge_labels`)
    A map build regenerates every ``auto`` feature; ``human`` and ``external`` features live
    in label files that each build imports and merges:

    1. imported features are kept unchanged (except that a ``human`` feature beats an
       ``external`` one it overlaps, by rule 2 applied between the two);
    2. an automatic feature loses to an imported feature *of the same layer* that overlaps
       it: the vertices of an automatic line within ``line_overlap_m`` of an imported line
       are removed, and what remains is kept where it still runs ``min_remaining_m``; an
       automatic sign within ``sign_overlap_m`` (horizontally) of an imported sign is
       dropped;
    3. an imported feature with ``properties.action == "delete"`` removes what it overlaps
       by rule 2 and is not itself part of the merged map (the label file keeps it, so the
       deletion holds on every rebuild). ``delete`` is the only action; a sign to delete is
       matched by its position alone and needs no ``facing_yaw_rad``.

    Every number in a file must be finite: Python's JSON reader takes ``NaN`` and
    ``Infinity`` (and reads ``1e400`` as infinity), which no map output can hold.  Every
    position of a label file must also be one a map frame can hold -- within
    :data:`MAX_LABEL_OFFSET_M` of its origin horizontally and :data:`MAX_LABEL_HEIGHT_M`
    vertically -- and, imported into a map, lie within :data:`LABEL_REACH_M` of the area of
    the map's drives (:class:`LabelArea`): a position beyond is a file in another frame
    (UTM, another map's origin, millimetres), which the merge would keep far off the map.

    A label file imported into a map that keeps labels already joins them by
    :func:`combine_labels` (the new file's features win, its deletes are kept), so that
    importing the same file again changes nothing.  A feature without an ``id`` is named
    by a hash of its kind, geometry and properties (``human-3f2a...``): the same in every
    import of its file, and never the id of another file's feature, which it would
    replace.

    Lane centre lines are not re-derived from corrected markings here: re-run
    :func:`adcloud.hdmap.labels.lane_centerlines` on the merged markings for that.

History: version 1, first version.
"""

from __future__ import annotations

import codecs
import difflib
import hashlib
import json
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import fsspec
import numpy as np
from numpy.typing import NDArray
from scipy.spatial import cKDTree

from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.labels import (
    MARKING_TYPES,
    LaneCenterline,
    LaneMarking,
    ReferenceLine,
    resample_polyline,
)
from adcloud.hdmap.signs import DEFAULT_SIGN_CATALOG, TrafficSign

__all__ = [
    "FORMAT_VERSION",
    "IMPORTED_SOURCES",
    "LABEL_REACH_M",
    "MAX_LABEL_HEIGHT_M",
    "MAX_LABEL_OFFSET_M",
    "SOURCES",
    "LabelArea",
    "MergeSettings",
    "Origin",
    "SemanticMap",
    "automatic_features",
    "combine_labels",
    "import_labels",
    "merge_labels",
    "parse_geojson",
    "read_geojson",
    "same_features",
    "same_origin",
    "write_geojson",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]
#: WGS84 latitude (deg), longitude (deg), ellipsoidal height (m) of the map frame's origin.
Origin = tuple[float, float, float]

FORMAT_VERSION = 1
SOURCES = ("auto", "human", "external")
IMPORTED_SOURCES = ("human", "external")
#: The values of ``properties.action``: a feature without one is added.
ACTIONS = ("delete",)
#: The sign types a label file may name by default: those of the default sign catalogue.
_DEFAULT_SIGN_TYPES = ("unknown", *(shape.type for shape in DEFAULT_SIGN_CATALOG))
_FLOAT_MAX = sys.float_info.max
#: How far from the map frame's origin a label may lie (m, east or north): the frame is a
#: tangent plane, which 1000 km out runs 78 km above the ground; what lies farther is in
#: another frame (a UTM northing, millimetres), whatever map it is imported into.
MAX_LABEL_OFFSET_M = 1_000_000.0
#: How far above or below the map frame's origin a label may lie (m): more than any road's
#: height differs from another's within a map.
MAX_LABEL_HEIGHT_M = 10_000.0
#: How far (m, horizontally) outside the area of a map's drives its labels may lie: labels
#: of roads next to the driven ones are fine; a kilometre out, no drive of the map reaches
#: them, and the file is likely in another map's frame.
LABEL_REACH_M = 1_000.0

# Properties each kind maps onto dataclass fields; everything else goes to `attributes`.
_MARKING_KEYS = {"kind", "type", "color", "width_m", "coverage", "confidence", "source", "id"}
_CENTER_KEYS = {
    "kind",
    "left_boundary",
    "right_boundary",
    "left_marking",
    "right_marking",
    "direction",
    "section",
    "width_m",
    "source",
    "id",
}
_REFERENCE_KEYS = {"kind", "source", "id"}
_SIGN_KEYS = {
    "kind",
    "type",
    "facing_yaw_rad",
    "width_m",
    "plate_height_m",
    "height_m",
    "candidates",
    "confidence",
    "point_count",
    "source",
    "id",
}


@dataclass(frozen=True)
class SemanticMap:
    """The semantic layers of one map (map frame, metres) and the frame's WGS84 ``origin``
    (None when unknown). ``extras`` are imported GeoJSON features of other kinds, verbatim."""

    markings: tuple[LaneMarking, ...] = ()
    centerlines: tuple[LaneCenterline, ...] = ()
    reference_lines: tuple[ReferenceLine, ...] = ()
    signs: tuple[TrafficSign, ...] = ()
    extras: tuple[Mapping[str, Any], ...] = ()
    origin: Origin | None = None

    def __post_init__(self) -> None:
        for name in ("markings", "centerlines", "reference_lines", "signs", "extras"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.origin is not None:
            object.__setattr__(self, "origin", tuple(float(v) for v in self.origin))

    def __len__(self) -> int:
        return (
            len(self.markings)
            + len(self.centerlines)
            + len(self.reference_lines)
            + len(self.signs)
            + len(self.extras)
        )

    def counts(self) -> dict[str, int]:
        """Features per layer."""
        return {
            "lane_marking": len(self.markings),
            "lane_centerline": len(self.centerlines),
            "reference_line": len(self.reference_lines),
            "traffic_sign": len(self.signs),
            "extra": len(self.extras),
        }

    def to_geojson(self) -> dict[str, Any]:
        """The map as a GeoJSON FeatureCollection dict (see the module docstring)."""
        features: list[dict[str, Any]] = []
        features += [_marking_feature(m) for m in self.markings]
        features += [_centerline_feature(c) for c in self.centerlines]
        features += [_reference_feature(r) for r in self.reference_lines]
        features += [_sign_feature(s) for s in self.signs]
        features += [dict(e) for e in self.extras]
        out: dict[str, Any] = {
            "type": "FeatureCollection",
            "adcloud:frame": "map",
            "adcloud:units": "m",
        }
        if self.origin is not None:
            lat, lon, alt = self.origin
            out["adcloud:origin"] = {"latitude_deg": lat, "longitude_deg": lon, "height_m": alt}
        out["adcloud:version"] = FORMAT_VERSION
        out["features"] = features
        return out


# -- writing --------------------------------------------------------------------------------


def _num(value: float) -> float | None:
    """A JSON number, or null for NaN/inf (JSON has no NaN)."""
    v = float(value)
    return round(v, 6) if math.isfinite(v) else None


def _coords(points: F64) -> list[list[float]]:
    out: list[list[float]] = []
    for x, y, z in np.asarray(points, dtype=np.float64):
        pos = [round(float(x), 4), round(float(y), 4)]
        if math.isfinite(z):
            pos.append(round(float(z), 4))
        out.append(pos)
    return out


def _feature(
    fid: str, geometry: dict[str, Any], props: dict[str, Any], attributes: Mapping[str, Any]
) -> dict[str, Any]:
    merged = {**dict(attributes), **props}
    feature: dict[str, Any] = {"type": "Feature", "geometry": geometry, "properties": merged}
    if fid:
        feature["id"] = fid
    return feature


def _line(points: F64) -> dict[str, Any]:
    return {"type": "LineString", "coordinates": _coords(points)}


def _marking_feature(m: LaneMarking) -> dict[str, Any]:
    props = {
        "kind": "lane_marking",
        "type": m.type,
        "color": m.color,
        "width_m": _num(m.width_m),
        "coverage": _num(m.coverage),
        "confidence": _num(m.confidence),
        "source": m.source,
    }
    return _feature(m.id, _line(m.points), props, m.attributes)


def _centerline_feature(c: LaneCenterline) -> dict[str, Any]:
    props: dict[str, Any] = {
        "kind": "lane_centerline",
        "direction": c.direction,
        "section": c.section,
        "width_m": _num(c.width_m),
        "left_marking": c.left_marking,
        "right_marking": c.right_marking,
        "source": c.source,
    }
    if c.has_boundaries:
        props["left_boundary"] = _coords(c.left_boundary)
        props["right_boundary"] = _coords(c.right_boundary)
    return _feature(c.id, _line(c.points), props, c.attributes)


def _reference_feature(r: ReferenceLine) -> dict[str, Any]:
    return _feature(
        r.id, _line(r.points), {"kind": "reference_line", "source": r.source}, r.attributes
    )


def _sign_feature(s: TrafficSign) -> dict[str, Any]:
    props = {
        "kind": "traffic_sign",
        "type": s.type,
        "facing_yaw_rad": _num(s.facing_yaw),
        "width_m": _num(s.width_m),
        "plate_height_m": _num(s.height_m),
        "height_m": _num(s.height_above_ground_m),
        "candidates": list(s.candidates),
        "confidence": _num(s.confidence),
        "point_count": int(s.point_count),
        "source": s.source,
    }
    geometry = {"type": "Point", "coordinates": _coords(s.position.reshape(1, 3))[0]}
    return _feature(s.id, geometry, props, s.attributes)


def write_geojson(path: str | os.PathLike[str], semantic_map: SemanticMap) -> str:
    """Write ``semantic_map`` as GeoJSON to ``path`` (a local path or an fsspec URL);
    returns the path written."""
    data = semantic_map.to_geojson()
    features = data.pop("features")
    # One feature per line: diffs of label files stay readable, files stay compact.
    head = json.dumps(data, allow_nan=False)[:-1]
    body = ",\n".join(json.dumps(f, allow_nan=False, separators=(",", ":")) for f in features)
    text = f'{head}, "features": [\n{body}\n]}}'
    target = os.fspath(path)
    with fsspec.open(target, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    log.info("semantic: wrote %s (%s)", target, semantic_map.counts())
    return target


@dataclass(frozen=True)
class LabelArea:
    """Where the labels of a map may lie: within ``reach_m`` (horizontally) of the box
    ``x0..x1``, ``y0..y1`` (map-frame metres) that holds its drives; ``what`` names the
    box in errors ("the drives of version 000003")."""

    x0: float
    y0: float
    x1: float
    y1: float
    what: str
    reach_m: float = LABEL_REACH_M

    @classmethod
    def around(cls, xy: Any, what: str, reach_m: float = LABEL_REACH_M) -> LabelArea:
        """The box around the map-frame positions ``xy`` (n, 2), n >= 1."""
        pts = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
        if not len(pts) or not np.isfinite(pts).all():
            raise HdmapError(f"LabelArea: {what} has no finite positions to make an area of")
        (x0, y0), (x1, y1) = pts.min(axis=0), pts.max(axis=0)
        return cls(float(x0), float(y0), float(x1), float(y1), what, reach_m)

    def distance(self, xy: F64) -> F64:
        """Horizontal distance (m) of the positions ``xy`` (n, >= 2) from the box; 0 inside."""
        dx = np.maximum(np.maximum(self.x0 - xy[:, 0], xy[:, 0] - self.x1), 0.0)
        dy = np.maximum(np.maximum(self.y0 - xy[:, 1], xy[:, 1] - self.y1), 0.0)
        out: F64 = np.hypot(dx, dy)
        return out

    def describe(self) -> str:
        """``what`` and the box, for errors (whole metres)."""
        x0, y0, x1, y1 = (round(v) for v in (self.x0, self.y0, self.x1, self.y1))
        return f"{self.what} (x {x0}..{x1} m, y {y0}..{y1} m)"


# -- reading --------------------------------------------------------------------------------


class _Where:
    """Builds error messages naming the file and the feature."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = -1
        self.kind = ""

    def error(self, text: str) -> MapFormatError:
        if self.index < 0:
            return MapFormatError(f"{self.path}: {text}")
        kind = f" ({self.kind})" if self.kind else ""
        return MapFormatError(f"{self.path}: feature {self.index}{kind}: {text}")


def _non_finite(value: Any, place: str) -> tuple[str, str] | None:
    """The first number in ``value`` (a parsed JSON value at ``place``) that is no finite
    float -- NaN, an infinity (Python's JSON reader takes ``NaN``, ``Infinity`` and reads
    ``1e400`` as infinity) or an integer beyond the float range -- as (its place, how it
    reads); None when there is none.  Such a number would reach the map's outputs as
    ``nan`` and be written back as null, which no later build reads."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else (place, repr(value))
    if isinstance(value, int):
        return None if -_FLOAT_MAX <= value <= _FLOAT_MAX else (place, "an integer too large")
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item, f"{place}.{key}" if place else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for k, item in enumerate(value):
            found = _non_finite(item, f"{place}[{k}]")
            if found is not None:
                return found
    return None


def _near(value: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the value of ``known`` closest to ``value``, else ``""``."""
    guess = difflib.get_close_matches(value, known, n=1)
    return f" (did you mean {guess[0]!r}?)" if guess else ""


def _positions(coords: Any, where: _Where, what: str) -> F64:
    if not isinstance(coords, list) or not coords:
        raise where.error(f"{what} must be a non-empty list of [x, y] or [x, y, z] positions")
    out = np.full((len(coords), 3), np.nan)
    for k, pos in enumerate(coords):
        if (
            not isinstance(pos, list)
            or len(pos) not in (2, 3)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pos)
        ):
            raise where.error(
                f"{what}[{k}] must be [x, y] or [x, y, z] numbers (map-frame metres), got {pos!r}"
            )
        out[k, : len(pos)] = pos
    if not np.isfinite(out[:, :2]).all():
        raise where.error(f"{what} holds a non-finite coordinate")
    return out


def _linestring(geometry: Any, where: _Where) -> F64:
    if not isinstance(geometry, dict) or geometry.get("type") != "LineString":
        got = geometry.get("type") if isinstance(geometry, dict) else type(geometry).__name__
        raise where.error(f"geometry must be a LineString, got {got}")
    pts = _positions(geometry.get("coordinates"), where, "coordinates")
    if len(pts) < 2:
        raise where.error("a LineString needs at least 2 positions")
    return pts


def _point(geometry: Any, where: _Where) -> F64:
    if not isinstance(geometry, dict) or geometry.get("type") != "Point":
        got = geometry.get("type") if isinstance(geometry, dict) else type(geometry).__name__
        raise where.error(f"geometry must be a Point, got {got}")
    coords = geometry.get("coordinates")
    pts = _positions([coords] if isinstance(coords, list) else coords, where, "coordinates")
    out: F64 = pts[0]
    return out


def _float(props: Mapping[str, Any], key: str, where: _Where, default: float | None) -> float:
    value = props.get(key)
    if value is None:
        if default is None:
            raise where.error(f"properties.{key} is required (a number)")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise where.error(f"properties.{key} must be a number, got {value!r}")
    return float(value)


def _share(props: Mapping[str, Any], key: str, where: _Where, default: float) -> float:
    """A number from 0 to 1 (a confidence, a coverage)."""
    value = _float(props, key, where, default)
    if not 0.0 <= value <= 1.0 and not (math.isnan(value) and math.isnan(default)):
        raise where.error(f"properties.{key} must be a share from 0 to 1, got {value!r}")
    return value


def _size(props: Mapping[str, Any], key: str, where: _Where) -> float:
    """A width or height in metres: 0 or more, or left out (unknown)."""
    value = _float(props, key, where, math.nan)
    if value < 0.0:
        raise where.error(
            f"properties.{key} must be a size in metres, 0 or more, got {value!r}; leave it out "
            "where it is not known"
        )
    return value


#: The driving direction of a lane relative to the drive that mapped it.
DIRECTIONS = ("along", "against")


def _text(props: Mapping[str, Any], key: str, where: _Where, default: str) -> str:
    value = props.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise where.error(f"properties.{key} must be a string, got {value!r}")
    return value


def _rest(props: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    return {k: v for k, v in props.items() if k not in known}


def _feature_id(feature: Mapping[str, Any], props: Mapping[str, Any], where: _Where) -> str:
    fid = feature.get("id", props.get("id"))
    if fid is None:
        return ""
    if isinstance(fid, bool) or not isinstance(fid, (str, int)):
        raise where.error(f"id must be a string or a whole number, got {fid!r}")
    return str(fid)


def _content_id(
    feature: Mapping[str, Any], props: Mapping[str, Any], source: str, seen: Counter[str]
) -> str:
    """The id of a feature that has none: ``<source>-<hash>``, the hash of its kind,
    geometry and properties as written.

    Not its position in the file: :func:`combine_labels` replaces a kept label by a new
    one with its id, so position ids ("human-0") made every label file's first feature
    replace the one kept from the file imported before.  A hash names the same feature the
    same in every import of its file (importing a file again changes nothing) and
    different features differently; identical features of one file are told apart by a
    count (``-2``, ``-3`` ...) in file order."""
    content = {"geometry": feature.get("geometry"), "properties": {**props, "source": source}}
    text = json.dumps(content, sort_keys=True, default=str)
    base = f"{source}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    seen[base] += 1
    return base if seen[base] == 1 else f"{base}-{seen[base]}"


@dataclass
class _Layers:
    markings: list[LaneMarking] = field(default_factory=list)
    centerlines: list[LaneCenterline] = field(default_factory=list)
    references: list[ReferenceLine] = field(default_factory=list)
    signs: list[TrafficSign] = field(default_factory=list)
    extras: list[Mapping[str, Any]] = field(default_factory=list)
    #: content ids given so far (see :func:`_content_id`)
    unnamed: Counter[str] = field(default_factory=Counter)
    #: the features' own ids so far, with the index of the feature that has each
    ids: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _LabelRules:
    """What a label file written by people must also get right (:func:`import_labels`):
    an ``action`` the merge knows (a misspelt ``delete`` would add the feature), a sign
    ``type`` of ``sign_types`` (None: any), and ids unique in the file (a second feature
    with an id would silently replace the first when the labels are combined)."""

    sign_types: tuple[str, ...] | None
    area: LabelArea | None = None


def _geometry_positions(value: Any) -> list[list[float]]:
    """Every position in the ``coordinates`` of a GeoJSON geometry of any type (a list of
    numbers, at any depth of nesting), in file order; GeometryCollections included."""
    if isinstance(value, dict):
        if isinstance(value.get("geometries"), list):
            return [p for g in value["geometries"] for p in _geometry_positions(g)]
        return _geometry_positions(value.get("coordinates"))
    if not isinstance(value, list) or not value:
        return []
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [value]
    return [p for item in value for p in _geometry_positions(item)]


def _check_reach(where: _Where, area: LabelArea | None, fields: Mapping[str, F64]) -> None:
    """Refuse a position of ``fields`` (name in the file: (n, 3) map-frame metres, z NaN
    where not given) that no map frame holds, or that lies beyond ``area``'s reach."""
    for name, pts in fields.items():
        if not len(pts):
            continue
        with np.errstate(invalid="ignore"):  # z is NaN where the file gives none
            off = (np.abs(pts[:, :2]) > MAX_LABEL_OFFSET_M).any(axis=1) | (
                np.abs(pts[:, 2]) > MAX_LABEL_HEIGHT_M
            )
        if off.any():
            k = int(np.argmax(off))
            shown = ", ".join(f"{v:g}" for v in pts[k] if math.isfinite(v))
            raise where.error(
                f"{name}[{k}] is [{shown}], beyond any map frame: label positions are map-frame "
                f"metres (east, north, up of the map's origin), within "
                f"{MAX_LABEL_OFFSET_M / 1000:g} km of it horizontally and "
                f"{MAX_LABEL_HEIGHT_M / 1000:g} km vertically; is the file in another frame "
                "(UTM, longitude/latitude) or unit (mm)?"
            )
        if area is None:
            continue
        gap = area.distance(pts)
        if (gap > area.reach_m).any():
            k = int(np.argmax(gap > area.reach_m))
            raise where.error(
                f"{name}[{k}] ({pts[k, 0]:.1f}, {pts[k, 1]:.1f}) lies {gap[k] / 1000:,.1f} km "
                f"outside {area.describe()}; labels must lie within {area.reach_m:g} m of the "
                "map's drives: is the file in another map's frame (another origin)?"
            )


def _check_label(
    feature: Mapping[str, Any],
    props: Mapping[str, Any],
    where: _Where,
    layers: _Layers,
    rules: _LabelRules,
) -> None:
    action = props.get("action")
    if action is not None and action not in ACTIONS:
        raise where.error(
            f"properties.action is {action!r}{_near(str(action), ACTIONS)}; the only action is "
            '"delete" (the feature removes the automatic features it overlaps); leave action '
            "out to add the feature"
        )
    if where.kind == "traffic_sign" and rules.sign_types is not None:
        stype = props.get("type", "unknown")
        if isinstance(stype, str) and stype not in rules.sign_types:
            raise where.error(
                f"properties.type is {stype!r}{_near(stype, rules.sign_types)}; the sign types "
                f"are {', '.join(rules.sign_types)} (the sign catalogue's, "
                "hdmap_signs.catalog)"
            )
    fid = feature.get("id", props.get("id"))
    if isinstance(fid, (str, int)) and not isinstance(fid, bool):
        first = layers.ids.setdefault(str(fid), where.index)
        if first != where.index:
            raise where.error(
                f"id {str(fid)!r} is the id of feature {first} too; give every feature of the "
                "file its own id (a feature with another's id replaces it in the map)"
            )


def _parse_feature(
    feature: Any,
    where: _Where,
    default_source: str | None,
    layers: _Layers,
    rules: _LabelRules | None = None,
) -> None:
    if not isinstance(feature, dict) or feature.get("type") != "Feature":
        raise where.error('must be an object with "type": "Feature"')
    props = feature.get("properties")
    if not isinstance(props, dict):
        raise where.error("properties must be an object")
    kind = props.get("kind")
    if not isinstance(kind, str) or not kind:
        said = "missing" if kind is None else f"{kind!r}, not a kind's name"
        raise where.error(
            f"properties.kind is {said}; set lane_marking, lane_centerline, reference_line, "
            "traffic_sign (or another kind, kept as an extra)"
        )
    where.kind = kind
    bad = _non_finite(feature, "")
    if bad is not None:
        place, shown = bad
        raise where.error(
            f"{place} is {shown}; every number in the file must be finite, not NaN, Infinity "
            "or beyond +-1.8e308 (which reads as Infinity): correct the value, or remove it"
        )
    if rules is not None:
        _check_label(feature, props, where, layers, rules)
    source = props.get("source", default_source)
    if source is None:
        raise where.error(
            f"properties.source is missing; set one of {', '.join(SOURCES)} (or import with "
            "default_source)"
        )
    if source not in SOURCES:
        raise where.error(f"properties.source is {source!r}; expected one of {', '.join(SOURCES)}")
    fid = _feature_id(feature, props, where) or _content_id(feature, props, source, layers.unnamed)
    geometry = feature.get("geometry")
    if kind == "lane_marking":
        mtype = _text(props, "type", where, "unknown")
        if mtype not in MARKING_TYPES:
            raise where.error(
                f"properties.type is {mtype!r}{_near(mtype, MARKING_TYPES)}; expected one of "
                f"{', '.join(MARKING_TYPES)}"
            )
        fields = {"coordinates": _linestring(geometry, where)}
        layers.markings.append(
            LaneMarking(
                points=fields["coordinates"],
                type=mtype,
                color=_text(props, "color", where, "white"),
                width_m=_size(props, "width_m", where),
                coverage=_share(props, "coverage", where, math.nan),
                confidence=_share(props, "confidence", where, 1.0),
                source=source,
                id=fid,
                attributes=_rest(props, _MARKING_KEYS),
            )
        )
    elif kind == "lane_centerline":
        bounds = {}
        for key in ("left_boundary", "right_boundary"):
            raw = props.get(key)
            bounds[key] = (
                np.zeros((0, 3)) if raw is None else _positions(raw, where, f"properties.{key}")
            )
        section = props.get("section", -1)
        if isinstance(section, bool) or not isinstance(section, int):
            raise where.error(f"properties.section must be an integer, got {section!r}")
        direction = _text(props, "direction", where, "along")
        # the lanes of a section share their boundaries in the drive's direction, so theirs
        # must be one of the two; a lane without a section keeps what the file says (the
        # synthetic truth's "+s"/"-s", say), which nothing reads
        if section >= 0 and direction not in DIRECTIONS:
            raise where.error(
                f"properties.direction is {direction!r}{_near(direction, DIRECTIONS)}; a lane "
                f"of a section (properties.section {section}) runs along or against the drive "
                f"that mapped it: one of {', '.join(DIRECTIONS)}"
            )
        fields = {"coordinates": _linestring(geometry, where)}
        fields.update((f"properties.{key}", pts) for key, pts in bounds.items())
        layers.centerlines.append(
            LaneCenterline(
                points=fields["coordinates"],
                left_boundary=bounds["left_boundary"],
                right_boundary=bounds["right_boundary"],
                left_marking=_text(props, "left_marking", where, ""),
                right_marking=_text(props, "right_marking", where, ""),
                direction=direction,
                section=section,
                width_m=_size(props, "width_m", where),
                source=source,
                id=fid,
                attributes=_rest(props, _CENTER_KEYS),
            )
        )
    elif kind == "reference_line":
        fields = {"coordinates": _linestring(geometry, where)}
        layers.references.append(
            ReferenceLine(
                points=fields["coordinates"],
                source=source,
                id=fid,
                attributes=_rest(props, _REFERENCE_KEYS),
            )
        )
    elif kind == "traffic_sign":
        position = _point(geometry, where)
        fields = {"coordinates": position[None, :]}
        if not math.isfinite(position[2]):
            raise where.error("a traffic sign needs [x, y, z]: z is the plate centre's height")
        candidates = props.get("candidates", [])
        if not isinstance(candidates, list) or not all(isinstance(c, str) for c in candidates):
            raise where.error(
                f"properties.candidates must be a list of strings, got {candidates!r}"
            )
        count = props.get("point_count", 0)
        if isinstance(count, bool) or not isinstance(count, int):
            raise where.error(f"properties.point_count must be an integer, got {count!r}")
        # a delete is matched by its position alone (rule 3): it needs no facing
        facing_default = math.nan if props.get("action") == "delete" else None
        layers.signs.append(
            TrafficSign(
                position=position,
                facing_yaw=_float(props, "facing_yaw_rad", where, facing_default),
                width_m=_size(props, "width_m", where),
                height_m=_size(props, "plate_height_m", where),
                height_above_ground_m=_float(props, "height_m", where, math.nan),
                type=_text(props, "type", where, "unknown"),
                candidates=tuple(candidates),
                confidence=_share(props, "confidence", where, 1.0),
                point_count=count,
                source=source,
                id=fid,
                attributes=_rest(props, _SIGN_KEYS),
            )
        )
    else:
        if geometry is not None and not isinstance(geometry, dict):
            raise where.error("geometry must be an object or null")
        extra = dict(feature)
        extra["properties"] = {**props, "source": source}
        layers.extras.append(extra)
        found = _geometry_positions(geometry)
        xyz = np.full((len(found), 3), np.nan)
        for k, pos in enumerate(found):
            xyz[k, : min(len(pos), 3)] = pos[:3]
        fields = {"geometry.coordinates": xyz}
    if rules is not None:
        _check_reach(where, rules.area, fields)


def _parse_origin(data: Mapping[str, Any], where: _Where) -> Origin | None:
    raw = data.get("adcloud:origin")
    if raw is None:
        return None
    keys = ("latitude_deg", "longitude_deg", "height_m")
    if not isinstance(raw, dict) or not all(
        isinstance(raw.get(k), (int, float)) and not isinstance(raw.get(k), bool) for k in keys
    ):
        raise where.error(f'"adcloud:origin" must be an object with numbers {", ".join(keys)}')
    bad = _non_finite([raw[k] for k in keys], "")
    if bad is not None:
        raise where.error(
            f'"adcloud:origin" holds {bad[1]}; its {", ".join(keys)} must be finite numbers '
            "(the map frame's WGS84 origin)"
        )
    return (float(raw["latitude_deg"]), float(raw["longitude_deg"]), float(raw["height_m"]))


def parse_geojson(
    data: Any, where: str = "<geojson>", *, default_source: str | None = None
) -> SemanticMap:
    """A :class:`SemanticMap` from a parsed GeoJSON dict (see the module docstring);
    ``where`` names the source in errors."""
    return _parse(data, where, default_source, None)


def _parse(
    data: Any, where: str, default_source: str | None, rules: _LabelRules | None
) -> SemanticMap:
    w = _Where(where)
    if not isinstance(data, dict) or data.get("type") != "FeatureCollection":
        raise w.error(
            'not a GeoJSON FeatureCollection (top-level "type" must be "FeatureCollection")'
        )
    frame = data.get("adcloud:frame")
    if frame != "map":
        raise w.error(
            f'"adcloud:frame" is {frame!r}; label files must hold map-frame metres and say '
            '"adcloud:frame": "map" (convert WGS84 longitude/latitude to the map frame first)'
        )
    units = data.get("adcloud:units", "m")
    if units != "m":
        raise w.error(f'"adcloud:units" is {units!r}; only metres ("m") are supported')
    version = data.get("adcloud:version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise w.error(
            f'"adcloud:version" is {version!r}; this adcloud reads version {FORMAT_VERSION}'
        )
    if default_source is not None and default_source not in SOURCES:
        raise HdmapError(
            f"default_source must be one of {', '.join(SOURCES)}, got {default_source!r}"
        )
    origin = _parse_origin(data, w)
    features = data.get("features")
    if not isinstance(features, list):
        raise w.error('"features" must be a list')
    layers = _Layers()
    for index, feature in enumerate(features):
        w.index, w.kind = index, ""
        _parse_feature(feature, w, default_source, layers, rules)
    return SemanticMap(
        markings=tuple(layers.markings),
        centerlines=tuple(layers.centerlines),
        reference_lines=tuple(layers.references),
        signs=tuple(layers.signs),
        extras=tuple(layers.extras),
        origin=origin,
    )


def read_geojson(path: str | os.PathLike[str], *, default_source: str | None = None) -> SemanticMap:
    """Read a semantic GeoJSON file (a local path or an fsspec URL), every source included.
    Features without ``properties.source`` get ``default_source`` (an error if None)."""
    target = os.fspath(path)
    return parse_geojson(_read_json(target), target, default_source=default_source)


def _read_json(target: str) -> Any:
    try:
        with fsspec.open(target, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise MapFormatError(f"{target}: no such label file") from None
    except IsADirectoryError:
        raise MapFormatError(f"{target}: is a directory; give a GeoJSON label file") from None
    # a byte order mark, as some editors write, is skipped (RFC 8259 lets readers ignore it)
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise MapFormatError(
            f"{target}: not a UTF-8 text file (byte {bom + err.start}: {err.reason}); a label "
            "file is GeoJSON, UTF-8 encoded"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise MapFormatError(
            f"{target}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    return data


def _select(smap: SemanticMap, sources: Sequence[str]) -> SemanticMap:
    keep = set(sources)

    def pick(items: Iterable[Any]) -> tuple[Any, ...]:
        return tuple(i for i in items if i.source in keep)

    return SemanticMap(
        markings=pick(smap.markings),
        centerlines=pick(smap.centerlines),
        reference_lines=pick(smap.reference_lines),
        signs=pick(smap.signs),
        extras=tuple(e for e in smap.extras if e["properties"].get("source") in keep),
        origin=smap.origin,
    )


def automatic_features(smap: SemanticMap) -> SemanticMap:
    """The ``auto`` features of ``smap`` (what a build extracted, without imported labels)."""
    return _select(smap, ("auto",))


def import_labels(
    path: str | os.PathLike[str],
    *,
    default_source: str | None = None,
    sign_types: Collection[str] | None = None,
    check: bool = True,
    area: LabelArea | None = None,
) -> SemanticMap:
    """The ``human`` and ``external`` features of a label file, to be merged into each
    rebuild by :func:`merge_labels`; ``auto`` features in it are skipped (the build makes
    them afresh). Features without a source get ``default_source`` (e.g. ``external`` for
    another system's file); without one they are an error naming the file and feature.

    ``check``: also refuse what a file written by people gets wrong and the merge would
    take silently -- an ``action`` other than ``delete``, a sign ``type`` neither
    ``unknown`` nor among ``sign_types`` (the sign catalogue's types; default: those of
    :data:`~adcloud.hdmap.signs.DEFAULT_SIGN_CATALOG`), a feature id given twice (False:
    the labels a map keeps, checked when they were imported), and a position no map frame
    holds (beyond :data:`MAX_LABEL_OFFSET_M` or :data:`MAX_LABEL_HEIGHT_M` of the origin)
    or, with ``area`` (the map's, made by the build), farther than its ``reach_m`` from the
    map's drives."""
    target = os.fspath(path)
    types = _DEFAULT_SIGN_TYPES
    if sign_types is not None:
        types = ("unknown", *(t for t in sign_types if t != "unknown"))
    rules = _LabelRules(types, area) if check else None
    smap = _parse(_read_json(target), target, default_source, rules)
    imported = _select(smap, IMPORTED_SOURCES)
    skipped = len(smap) - len(imported)
    log.info(
        "semantic: imported %s from %s (%d automatic features skipped)",
        imported.counts(),
        os.fspath(path),
        skipped,
    )
    return imported


# -- merging --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeSettings:
    """How imported labels win over automatic features (metres; see the module doc)."""

    line_overlap_m: float = 0.5
    sign_overlap_m: float = 1.0
    min_remaining_m: float = 2.0

    def __post_init__(self) -> None:
        for name in ("line_overlap_m", "sign_overlap_m", "min_remaining_m"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise HdmapError(f"MergeSettings.{name} must be a number >= 0, got {value!r}")


def _dense(points: F64, step: float = 0.05) -> F64:
    return resample_polyline(points[:, :2], step)


_Line = TypeVar("_Line", LaneMarking, LaneCenterline, ReferenceLine)


def _trim_lines(
    items: Sequence[_Line], winners: Sequence[Any], settings: MergeSettings
) -> list[_Line]:
    """``items`` minus their vertices near any of ``winners`` (lines), split into runs."""
    if not winners:
        return list(items)
    tree = cKDTree(np.vstack([_dense(w.points) for w in winners]))
    out: list[_Line] = []
    for item in items:
        dist, _ = tree.query(item.points[:, :2])
        free = dist > settings.line_overlap_m
        if free.all():
            out.append(item)
            continue
        edges = np.flatnonzero(np.diff(np.concatenate([[0], free.astype(np.int8), [0]])))
        runs = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        kept = 0
        for a, b in runs:
            piece = item.points[a:b]
            seg = np.linalg.norm(np.diff(piece[:, :2], axis=0), axis=1).sum() if b - a > 1 else 0.0
            if seg < max(settings.min_remaining_m, 1e-9):
                continue
            suffix = f".{kept + 1}" if len(runs) > 1 else ""
            changes: dict[str, Any] = {"points": piece, "id": f"{item.id}{suffix}"}
            if isinstance(item, LaneCenterline):
                same = len(item.left_boundary) == len(item.points) == len(item.right_boundary)
                changes["left_boundary"] = item.left_boundary[a:b] if same else np.zeros((0, 3))
                changes["right_boundary"] = item.right_boundary[a:b] if same else np.zeros((0, 3))
            out.append(replace(item, **changes))
            kept += 1
    return out


def _trim_signs(
    items: Sequence[TrafficSign], winners: Sequence[TrafficSign], settings: MergeSettings
) -> list[TrafficSign]:
    if not winners:
        return list(items)
    tree = cKDTree(np.array([w.position[:2] for w in winners]))
    out = []
    for item in items:
        dist, _ = tree.query(item.position[:2])
        if dist > settings.sign_overlap_m:
            out.append(item)
    return out


def _is_delete(item: Any) -> bool:
    attrs = item.attributes if hasattr(item, "attributes") else item.get("properties", {})
    return bool(attrs.get("action") == "delete")


def _apply(losers: SemanticMap, winners: SemanticMap, settings: MergeSettings) -> SemanticMap:
    return replace(
        losers,
        markings=tuple(_trim_lines(losers.markings, winners.markings, settings)),
        centerlines=tuple(_trim_lines(losers.centerlines, winners.centerlines, settings)),
        reference_lines=tuple(
            _trim_lines(losers.reference_lines, winners.reference_lines, settings)
        ),
        signs=tuple(_trim_signs(losers.signs, winners.signs, settings)),
    )


def _without_deletes(smap: SemanticMap) -> SemanticMap:
    return replace(
        smap,
        markings=tuple(m for m in smap.markings if not _is_delete(m)),
        centerlines=tuple(c for c in smap.centerlines if not _is_delete(c)),
        reference_lines=tuple(r for r in smap.reference_lines if not _is_delete(r)),
        signs=tuple(s for s in smap.signs if not _is_delete(s)),
        extras=tuple(e for e in smap.extras if not _is_delete(e)),
    )


def same_origin(a: Origin | None, b: Origin | None) -> bool:
    """Whether two map-frame origins are the same (None, unknown, matches any)."""
    if a is None or b is None:
        return True
    return abs(a[0] - b[0]) < 1e-9 and abs(a[1] - b[1]) < 1e-9 and abs(a[2] - b[2]) < 1e-3


def _items(smap: SemanticMap) -> list[LaneMarking | LaneCenterline | ReferenceLine | TrafficSign]:
    """Every feature of ``smap`` but the extras."""
    return [*smap.markings, *smap.centerlines, *smap.reference_lines, *smap.signs]


def _text_of(feature: Mapping[str, Any]) -> str:
    return json.dumps(feature, sort_keys=True, default=str)


def same_features(a: SemanticMap, b: SemanticMap) -> bool:
    """Whether two maps hold the same features (as GeoJSON), in any order."""

    def texts(smap: SemanticMap) -> list[str]:
        return sorted(_text_of(f) for f in smap.to_geojson()["features"])

    return texts(a) == texts(b)


def combine_labels(
    kept: SemanticMap, fresh: SemanticMap, settings: MergeSettings | None = None
) -> SemanticMap:
    """The labels a map keeps once the label file ``fresh`` is imported over the ``kept`` ones.

    Every fresh feature stays -- a delete too, so that it holds on every later rebuild -- and
    replaces the kept features with its id and, by rule 2, the kept features of its layer
    that it overlaps (a kept ``human`` feature gives way to ``human`` ones only).  The rest
    of ``kept`` stays.  Importing the same file again gives the same labels.
    """
    settings = settings or MergeSettings()
    if not same_origin(kept.origin, fresh.origin):
        raise HdmapError(
            f"combine_labels: the new labels' map origin {fresh.origin} differs from the kept "
            f"labels' {kept.origin}; labels must be in the same map frame"
        )
    claimed = {item.id for item in _items(fresh) if item.id}
    claimed |= {str(e["id"]) for e in fresh.extras if e.get("id") is not None}
    same = {_text_of(e) for e in fresh.extras}

    def unclaimed(items: Iterable[Any]) -> tuple[Any, ...]:
        return tuple(i for i in items if not (i.id and i.id in claimed))

    rest = SemanticMap(
        markings=unclaimed(kept.markings),
        centerlines=unclaimed(kept.centerlines),
        reference_lines=unclaimed(kept.reference_lines),
        signs=unclaimed(kept.signs),
        # an extra (a feature of another kind) gives way to a fresh one with its id or,
        # having no id, to an identical one
        extras=tuple(
            e
            for e in kept.extras
            if (str(e["id"]) not in claimed if e.get("id") is not None else _text_of(e) not in same)
        ),
        origin=kept.origin,
    )
    human = _apply(_select(rest, ("human",)), _select(fresh, ("human",)), settings)
    external = _apply(_select(rest, ("external",)), fresh, settings)
    return SemanticMap(
        markings=fresh.markings + human.markings + external.markings,
        centerlines=fresh.centerlines + human.centerlines + external.centerlines,
        reference_lines=fresh.reference_lines + human.reference_lines + external.reference_lines,
        signs=fresh.signs + human.signs + external.signs,
        extras=fresh.extras + human.extras + external.extras,
        origin=fresh.origin if fresh.origin is not None else kept.origin,
    )


def merge_labels(
    auto: SemanticMap, imported: SemanticMap, settings: MergeSettings | None = None
) -> SemanticMap:
    """The map a rebuild publishes: ``auto`` features with the ``imported`` labels merged
    in by the rules of the module docstring. Both maps must share the map frame's origin."""
    settings = settings or MergeSettings()
    if not same_origin(auto.origin, imported.origin):
        raise HdmapError(
            f"merge_labels: the labels' map origin {imported.origin} differs from the build's "
            f"{auto.origin}; labels must be in the same map frame (re-project them first)"
        )
    bad = [item.id or "<no id>" for item in _items(imported) if item.source not in IMPORTED_SOURCES]
    if bad:
        raise HdmapError(
            f"merge_labels: imported features must have source human or external; "
            f"{', '.join(bad[:5])} do not (load label files with import_labels)"
        )
    human = _select(imported, ("human",))
    external = _apply(_select(imported, ("external",)), human, settings)
    winners = SemanticMap(
        markings=human.markings + external.markings,
        centerlines=human.centerlines + external.centerlines,
        reference_lines=human.reference_lines + external.reference_lines,
        signs=human.signs + external.signs,
        extras=human.extras + external.extras,
        origin=imported.origin,
    )
    trimmed = _apply(auto, winners, settings)
    kept = _without_deletes(winners)
    merged = SemanticMap(
        markings=kept.markings + trimmed.markings,
        centerlines=kept.centerlines + trimmed.centerlines,
        reference_lines=kept.reference_lines + trimmed.reference_lines,
        signs=kept.signs + trimmed.signs,
        extras=auto.extras + kept.extras,
        origin=auto.origin if auto.origin is not None else imported.origin,
    )
    log.info(
        "semantic: merged %s automatic with %s imported into %s",
        auto.counts(),
        imported.counts(),
        merged.counts(),
    )
    return merged
