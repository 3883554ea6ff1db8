"""Stage 4 output: the semantic map as a Lanelet2 map (``lanelet2_map.osm``) and Autoware's
``map_projector_info.yaml``.

The map is built with the ``lanelet2`` Python package (``lanelet2.core``) and written with
``lanelet2.io.write`` through ``lanelet2.projection.LocalCartesianProjector``: the map frame
is the ENU tangent plane at the origin, which is exactly that projector's local frame, so
node latitudes/longitudes/``ele`` convert back to the same map-frame metres (to well under a
millimetre). Autoware loads such a map with ``projector_type: LocalCartesian``, which
:func:`write_map_projector_info` writes. Nodes also carry ``local_x``/``local_y`` tags (the
map-frame position) for tools that use Autoware's ``Local`` projector.

What goes in (Lanelet2 tagging; ``adcloud:id``/``adcloud:source`` tag every element):

- every extracted lane (a :class:`~adcloud.hdmap.labels.LaneCenterline` with boundaries)
  becomes a ``lanelet`` (``subtype road``, ``one_way yes``) whose left and right bounds are
  ``line_thin`` line strings with the marking's ``subtype`` (``solid``/``dashed``) and
  ``color``, and whose ``centerline`` is the extracted centre line. Lanes of one section
  share their boundary line strings (the opposite lane uses the inverted line string, as
  Lanelet2 expects). An imported lane without boundaries gets ``virtual`` bounds half its
  width (3.5 m when unknown) either side;
- markings that bound no lane are written as ``line_thin`` line strings;
- reference lines as line strings of ``type reference_line`` (no Lanelet2 standard exists);
- each sign as a Lanelet2 ``TrafficSign`` regulatory element (``subtype traffic_sign``,
  ``sign_type`` the detected type) referring to the plate's bottom edge (a ``traffic_sign``
  line string whose ``subtype`` is the sign type, ``height`` the plate height), attached to
  the lanelets whose traffic faces the plate within ``attach_radius_m``.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray

from adcloud.errors import MissingComponentError
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.labels import LaneCenterline, LaneMarking
from adcloud.hdmap.semantic import Origin, SemanticMap
from adcloud.hdmap.signs import TrafficSign

__all__ = [
    "LaneletSettings",
    "LaneletSummary",
    "load_lanelet2",
    "write_lanelet2",
    "write_map_projector_info",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class LaneletSettings:
    """``attach_radius_m``: how far from a lane's centre line a sign may stand to regulate
    it; ``location``: the lanelets' ``location`` tag (``urban``/``nonurban``)."""

    attach_radius_m: float = 8.0
    location: str = "urban"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.attach_radius_m) and self.attach_radius_m > 0):
            raise HdmapError(
                "LaneletSettings.attach_radius_m must be a positive number, got "
                f"{self.attach_radius_m}"
            )


@dataclass(frozen=True)
class LaneletSummary:
    """What :func:`write_lanelet2` wrote."""

    path: Path
    lanelets: int
    line_strings: int
    regulatory_elements: int
    attached_signs: int


def _lanelet2() -> Any:
    try:
        import lanelet2  # noqa: PLC0415 - optional component, imported where used
        import lanelet2.core  # noqa: PLC0415
        import lanelet2.io  # noqa: PLC0415
        import lanelet2.projection  # noqa: PLC0415
    except ImportError as err:
        raise MissingComponentError(
            "the lanelet2 Python package is not installed; install it with "
            "`pip install lanelet2` (wheels for Linux x86_64, Python 3.8-3.12)"
        ) from err
    return lanelet2


def _origin(semantic_map: SemanticMap, origin: Origin | None) -> Origin:
    chosen = origin if origin is not None else semantic_map.origin
    if chosen is None:
        raise HdmapError(
            "write_lanelet2: the map frame's WGS84 origin is unknown; pass origin="
            "(latitude_deg, longitude_deg, height_m) or set SemanticMap.origin"
        )
    lat, lon, alt = (float(v) for v in chosen)
    if not (-90 <= lat <= 90 and -180 <= lon <= 180 and math.isfinite(alt)):
        raise HdmapError(
            f"write_lanelet2: origin {chosen} is not a WGS84 latitude/longitude/height"
        )
    return lat, lon, alt


def _projector(ll2: Any, origin: Origin) -> Any:
    return ll2.projection.LocalCartesianProjector(ll2.io.Origin(*origin))


class _Builder:
    """Turns semantic features into Lanelet2 primitives with fresh ids."""

    def __init__(self, ll2: Any, semantic_map: SemanticMap, settings: LaneletSettings) -> None:
        self.ll2 = ll2
        self.core = ll2.core
        self.settings = settings
        self.markings: dict[str, LaneMarking] = {m.id: m for m in semantic_map.markings if m.id}
        self.used_markings: set[str] = set()
        self.shared: dict[tuple[int, str], Any] = {}
        self.lanelets: list[tuple[Any, LaneCenterline]] = []
        self.line_strings = 0

    def attrs(self, values: dict[str, str]) -> Any:
        return self.core.AttributeMap(values)

    def line(self, points: F64, tags: dict[str, str]) -> Any:
        core = self.core
        pts = []
        for x, y, z in points:
            zz = float(z) if math.isfinite(z) else 0.0
            p = core.Point3d(core.getId(), float(x), float(y), zz)
            p.attributes["local_x"] = f"{x:.4f}"
            p.attributes["local_y"] = f"{y:.4f}"
            pts.append(p)
        self.line_strings += 1
        return core.LineString3d(core.getId(), pts, self.attrs(tags))

    def marking_tags(self, marking_id: str) -> dict[str, str]:
        m = self.markings.get(marking_id)
        if m is None:
            return {"type": "line_thin"}
        self.used_markings.add(marking_id)
        tags = {
            "type": "line_thin",
            "color": m.color,
            "adcloud:id": m.id,
            "adcloud:source": m.source,
        }
        if m.type in ("solid", "dashed"):
            tags["subtype"] = m.type
        return tags

    def bound(self, lane: LaneCenterline, left: bool) -> Any:
        points = lane.left_boundary if left else lane.right_boundary
        marking = lane.left_marking if left else lane.right_marking
        if lane.section < 0:
            return self.line(points, self.marking_tags(marking))
        # Shared by the lanes of a section, stored in the drive's direction.
        against = lane.direction == "against"
        key = (lane.section, marking)
        if key not in self.shared:
            forward = points[::-1] if against else points
            self.shared[key] = self.line(forward, self.marking_tags(marking))
        ls = self.shared[key]
        return ls.invert() if against else ls

    def virtual_bounds(self, lane: LaneCenterline) -> tuple[Any, Any]:
        half = (lane.width_m if math.isfinite(lane.width_m) else 3.5) / 2
        pts = lane.points
        t = np.gradient(pts[:, :2], axis=0)
        t /= np.maximum(np.linalg.norm(t, axis=1, keepdims=True), 1e-12)
        n = np.column_stack([-t[:, 1], t[:, 0]])
        left = np.column_stack([pts[:, :2] + half * n, pts[:, 2]])
        right = np.column_stack([pts[:, :2] - half * n, pts[:, 2]])
        return self.line(left, {"type": "virtual"}), self.line(right, {"type": "virtual"})

    def lanelet(self, lane: LaneCenterline) -> Any:
        if lane.has_boundaries:
            left, right = self.bound(lane, True), self.bound(lane, False)
        else:
            left, right = self.virtual_bounds(lane)
        tags = {
            "type": "lanelet",
            "subtype": "road",
            "location": self.settings.location,
            "one_way": "yes",
            "participant:vehicle": "yes",
            "adcloud:id": lane.id,
            "adcloud:source": lane.source,
        }
        ll = self.core.Lanelet(self.core.getId(), left, right, self.attrs(tags))
        ll.centerline = self.line(lane.points, {"type": "centerline"})
        self.lanelets.append((ll, lane))
        return ll

    def sign(self, sign: TrafficSign) -> tuple[Any, list[Any]]:
        """The regulatory element of ``sign`` and the lanelets it regulates."""
        yaw = sign.facing_yaw
        across = np.array([-math.sin(yaw), math.cos(yaw)])
        half_w = (sign.width_m if math.isfinite(sign.width_m) else 0.6) / 2
        plate_h = sign.height_m if math.isfinite(sign.height_m) else 0.6
        bottom = sign.position[2] - plate_h / 2
        # Left to right as seen by the traffic facing the plate.
        a = sign.position[:2] + half_w * across
        b = sign.position[:2] - half_w * across
        edge = np.array([[a[0], a[1], bottom], [b[0], b[1], bottom]])
        kind = sign.type or "unknown"
        plate = self.line(
            edge,
            {
                "type": "traffic_sign",
                "subtype": kind,
                "height": f"{plate_h:.3f}",
                "adcloud:id": sign.id,
                "adcloud:source": sign.source,
            },
        )
        tags = {
            "type": "regulatory_element",
            "subtype": "traffic_sign",
            "sign_type": kind,
            "adcloud:id": sign.id,
            "adcloud:source": sign.source,
        }
        regelem = self.core.TrafficSign(
            self.core.getId(), self.attrs(tags), self.core.TrafficSignsWithType([plate], kind)
        )
        facing = np.array([math.cos(yaw), math.sin(yaw)])
        regulated = []
        for ll, lane in self.lanelets:
            pts = lane.points[:, :2]
            d = np.linalg.norm(pts - sign.position[:2], axis=1)
            k = int(np.argmin(d))
            if d[k] > self.settings.attach_radius_m or len(pts) < 2:
                continue
            k0, k1 = max(0, k - 1), min(len(pts) - 1, k + 1)
            heading = pts[k1] - pts[k0]
            norm = float(np.linalg.norm(heading))
            # the lane's traffic drives towards the plate's face
            if norm > 0 and float(heading @ facing) / norm < -0.5:
                regulated.append(ll)
        return regelem, regulated


def write_lanelet2(
    path: str | os.PathLike[str],
    semantic_map: SemanticMap,
    origin: Origin | None = None,
    settings: LaneletSettings | None = None,
) -> LaneletSummary:
    """Write ``semantic_map`` as a Lanelet2 OSM file at ``path`` (local; e.g.
    ``lanelet2_map.osm``), projected with ``LocalCartesianProjector`` about ``origin``
    (WGS84 latitude deg, longitude deg, ellipsoidal height m; default: the map's origin)."""
    settings = settings or LaneletSettings()
    ll2 = _lanelet2()
    org = _origin(semantic_map, origin)
    builder = _Builder(ll2, semantic_map, settings)
    lmap = ll2.core.LaneletMap()
    for lane in semantic_map.centerlines:
        if len(lane.points) < 2:
            continue
        lmap.add(builder.lanelet(lane))
    for marking in semantic_map.markings:
        if marking.id not in builder.used_markings:
            lmap.add(builder.line(marking.points, builder.marking_tags(marking.id)))
    for ref in semantic_map.reference_lines:
        tags = {"type": "reference_line", "adcloud:id": ref.id, "adcloud:source": ref.source}
        lmap.add(builder.line(ref.points, tags))
    attached = 0
    regelems = 0
    for sign in semantic_map.signs:
        regelem, lanelets = builder.sign(sign)
        for ll in lanelets:
            ll.addRegulatoryElement(regelem)
        attached += bool(lanelets)
        lmap.add(regelem)
        regelems += 1
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        ll2.io.write(str(target), lmap, _projector(ll2, org))
    except RuntimeError as err:
        raise HdmapError(f"{target}: lanelet2 could not write the map: {err}") from err
    summary = LaneletSummary(
        path=target,
        lanelets=len(builder.lanelets),
        line_strings=builder.line_strings,
        regulatory_elements=regelems,
        attached_signs=attached,
    )
    log.info(
        "lanelet2: wrote %s (%d lanelets, %d line strings, %d signs, %d attached to lanes)",
        target,
        summary.lanelets,
        summary.line_strings,
        summary.regulatory_elements,
        summary.attached_signs,
    )
    return summary


def load_lanelet2(path: str | os.PathLike[str], origin: Origin) -> Any:
    """Load a Lanelet2 OSM file written by :func:`write_lanelet2` (a
    ``lanelet2.core.LaneletMap`` in map-frame metres, projected about ``origin``)."""
    ll2 = _lanelet2()
    target = Path(path)
    if not target.is_file():
        raise MapFormatError(f"{target}: no such Lanelet2 map")
    try:
        lat, lon, alt = (float(v) for v in origin)
        return ll2.io.load(str(target), _projector(ll2, (lat, lon, alt)))
    except RuntimeError as err:
        raise MapFormatError(f"{target}: lanelet2 could not read the map: {err}") from err


def write_map_projector_info(path: str | os.PathLike[str], origin: Origin) -> Path:
    """Autoware's ``map_projector_info.yaml`` for a map in this LocalCartesian frame:
    ``projector_type: LocalCartesian``, ``vertical_datum: WGS84`` and ``map_origin``
    (``latitude``/``longitude`` deg, ``altitude`` m, ellipsoidal) -- the fields of
    ``autoware_map_msgs/MapProjectorInfo`` that autoware_map_projection_loader reads."""
    lat, lon, alt = (float(v) for v in origin)
    if not (-90 <= lat <= 90 and -180 <= lon <= 180 and math.isfinite(alt)):
        raise HdmapError(f"write_map_projector_info: origin {origin} is not a WGS84 position")
    info = {
        "projector_type": "LocalCartesian",
        "vertical_datum": "WGS84",
        "map_origin": {"latitude": lat, "longitude": lon, "altitude": alt},
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(info, sort_keys=False), encoding="utf-8")
    return target
