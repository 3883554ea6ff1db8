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
  the lanelets whose traffic faces the plate within ``attach_radius_m``;
- where one lane ends and another starts a little ahead (an intersection the drive crossed, a
  stretch where a marking was not seen), a *connector* lanelet joins them: its bounds start at
  the first lane's last boundary points and end at the next lane's first ones (the same
  Lanelet2 points, so ``lanelet2.routing`` finds the route through), bridged with cubic
  Hermite curves along the lanes' end tangents, tagged ``type virtual`` (nothing is painted
  there), and the lanelet carries Autoware's ``turn_direction`` (``straight``/``left``/
  ``right``). A join is made only when it is plausible driving: the gap is at most
  ``connect_gap_m``, the heading turns by at most ``connect_max_turn_deg``, and the two ends
  lie on one circular arc to within ``connect_max_offset_m`` (so a lane never joins the lane
  beside it or the opposite direction).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from numpy.typing import NDArray
from scipy.spatial import cKDTree

from adcloud.errors import MissingComponentError
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.labels import LaneCenterline, LaneMarking, hermite_bridge
from adcloud.hdmap.semantic import Origin, SemanticMap
from adcloud.hdmap.signs import TrafficSign

__all__ = [
    "LaneletSettings",
    "LaneletSummary",
    "load_lanelet2",
    "routing_graph",
    "write_lanelet2",
    "write_map_projector_info",
]

log = logging.getLogger(__name__)

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class LaneletSettings:
    """``attach_radius_m``: how far from a lane's centre line a sign may stand to regulate
    it; ``location``: the lanelets' ``location`` tag (``urban``/``nonurban``).

    Connectors (see the module docstring): ``connect_gap_m`` the longest gap bridged (0
    turns connectors off), ``connect_max_turn_deg`` the largest heading change across it,
    ``connect_max_offset_m`` how far the two ends may be from one circular arc;
    ``straight_max_turn_deg`` the heading change below which a connector is ``straight``."""

    attach_radius_m: float = 8.0
    location: str = "urban"
    connect_gap_m: float = 40.0
    connect_max_turn_deg: float = 120.0
    connect_max_offset_m: float = 1.0
    straight_max_turn_deg: float = 30.0

    def __post_init__(self) -> None:
        positive = ("attach_radius_m", "connect_max_offset_m", "straight_max_turn_deg")
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise HdmapError(f"LaneletSettings.{name} must be a positive number, got {value}")
        if not (math.isfinite(self.connect_gap_m) and self.connect_gap_m >= 0):
            raise HdmapError(
                "LaneletSettings.connect_gap_m must be a number >= 0 (0: no connectors), "
                f"got {self.connect_gap_m}"
            )
        if not (0 < self.connect_max_turn_deg < 180):
            raise HdmapError(
                "LaneletSettings.connect_max_turn_deg must be in (0, 180) degrees, got "
                f"{self.connect_max_turn_deg}"
            )


@dataclass(frozen=True)
class LaneletSummary:
    """What :func:`write_lanelet2` wrote: ``lanelets`` the lanes, ``connectors`` the
    connector lanelets joining them (not counted in ``lanelets``)."""

    path: Path
    lanelets: int
    line_strings: int
    regulatory_elements: int
    attached_signs: int
    connectors: int = 0
    #: The connectors' centre lines (map frame, (n, 3) each), e.g. to draw them.
    connector_lines: tuple[F64, ...] = ()


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
    """Turns semantic features into Lanelet2 primitives with ids numbered from 1.

    Not lanelet2's ``getId()``: its counter is global to the process, so the second map
    built in a driver or notebook would number its primitives on from the first, and two
    builds of the same drives would write different files."""

    def __init__(self, ll2: Any, semantic_map: SemanticMap, settings: LaneletSettings) -> None:
        self.ll2 = ll2
        self.core = ll2.core
        self.settings = settings
        self.markings: dict[str, LaneMarking] = {m.id: m for m in semantic_map.markings if m.id}
        self.used_markings: set[str] = set()
        #: the bound line strings of each (section, marking), with their points in the
        #: drive's direction
        self.shared: dict[tuple[int, str], list[tuple[Any, F64]]] = {}
        self.bridges: dict[tuple[int, int], Any] = {}
        self.connector_lines: list[F64] = []
        self.lanelets: list[tuple[Any, LaneCenterline]] = []
        self.line_strings = 0
        self.ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self.ids)

    def road_tags(self, element_id: str, source: str, **extra: str) -> dict[str, str]:
        """The tags of a one-way road lanelet for vehicles (``extra``: e.g. its turn)."""
        return {
            "type": "lanelet",
            "subtype": "road",
            "location": self.settings.location,
            "one_way": "yes",
            "participant:vehicle": "yes",
            **extra,
            "adcloud:id": element_id,
            "adcloud:source": source,
        }

    def attrs(self, values: dict[str, str]) -> Any:
        return self.core.AttributeMap(values)

    def points(self, points: F64) -> list[Any]:
        core = self.core
        pts = []
        for x, y, z in points:
            zz = float(z) if math.isfinite(z) else 0.0
            p = core.Point3d(self.new_id(), float(x), float(y), zz)
            p.attributes["local_x"] = f"{x:.4f}"
            p.attributes["local_y"] = f"{y:.4f}"
            pts.append(p)
        return pts

    def line(self, points: F64, tags: dict[str, str]) -> Any:
        self.line_strings += 1
        return self.core.LineString3d(self.new_id(), self.points(points), self.attrs(tags))

    def bridge(self, ends: Any, starts: Any) -> Any:
        """A ``virtual`` line string from the last point of ``ends`` to the first point of
        ``starts`` (the same Lanelet2 points), curving along both lines' tangents."""
        first, last = ends[len(ends) - 1], starts[0]
        # The connector of the opposite direction crosses the same gap of a shared bound
        # (the divider): it gets the same line string, inverted, as lanes of a section do.
        opposite = self.bridges.get((last.id, first.id))
        if opposite is not None:
            return opposite.invert()
        a, b = _coords(ends), _coords(starts)
        ta, tb = _direction(a, at_start=False), _direction(b, at_start=True)
        inner = hermite_bridge(a[-1], ta, b[0], tb, BRIDGE_STEP_M)
        self.line_strings += 1
        line = self.core.LineString3d(
            self.new_id(), [first, *self.points(inner), last], self.attrs({"type": "virtual"})
        )
        self.bridges[(first.id, last.id)] = line
        return line

    def connector(
        self, before: Any, lane: LaneCenterline, after: Any, nxt: LaneCenterline, turn: float
    ) -> Any:
        """The connector lanelet from lanelet ``before`` (of ``lane``) to ``after``."""
        left = self.bridge(before.leftBound, after.leftBound)
        right = self.bridge(before.rightBound, after.rightBound)
        straight = math.radians(self.settings.straight_max_turn_deg)
        direction = "straight" if abs(turn) <= straight else ("left" if turn > 0 else "right")
        tags = self.road_tags(f"{lane.id}>{nxt.id}", "connector", turn_direction=direction)
        ll = self.core.Lanelet(self.new_id(), left, right, self.attrs(tags))
        pa, pb = lane.points[-1], nxt.points[0]
        ta = _direction(lane.points, at_start=False)
        tb = _direction(nxt.points, at_start=True)
        centre = np.vstack([pa, hermite_bridge(pa, ta, pb, tb, BRIDGE_STEP_M), pb])
        ll.centerline = self.line(centre, {"type": "centerline"})
        self.connector_lines.append(centre)
        return ll

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
        # Shared by the lanes of a section, stored in the drive's direction -- where it is
        # the same line: an imported lane may carry a section without marking ids (its two
        # bounds would be one line), and a lane trimmed by a label keeps its section and
        # markings but only a part of their points.
        against = lane.direction == "against"
        forward = points[::-1] if against else points
        lines = self.shared.setdefault((lane.section, marking), [])
        ls = next(
            (
                line
                for line, kept in lines
                if kept.shape == forward.shape
                and np.allclose(kept, forward, rtol=0, atol=1e-6, equal_nan=True)
            ),
            None,
        )
        if ls is None:
            ls = self.line(forward, self.marking_tags(marking))
            lines.append((ls, forward))
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
        tags = self.road_tags(lane.id, lane.source)
        ll = self.core.Lanelet(self.new_id(), left, right, self.attrs(tags))
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
            self.new_id(), self.attrs(tags), self.core.TrafficSignsWithType([plate], kind)
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


#: Vertex spacing of the bridged bounds and centre line of a connector (m).
BRIDGE_STEP_M = 1.0


def _coords(line: Any) -> F64:
    return np.array([[p.x, p.y, p.z] for p in line], dtype=np.float64)


def _direction(points: F64, at_start: bool, span: float = 3.0) -> F64:
    """Unit horizontal driving direction at the start or the end of a polyline: the slope at
    the end of a quadratic fitted (by arc length) to its last ``span`` metres. A secant over
    the same metres would lag on curves, and one noisy vertex would tilt a short one."""
    xy = points[:, :2] if at_start else points[::-1, :2]
    s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(xy, axis=0), axis=1))])
    near = s <= span
    if int(near.sum()) >= 3 and s[near][-1] > 0:
        v = np.array([np.polyfit(s[near], xy[near, k], 2)[1] for k in (0, 1)])
    else:
        v = xy[min(1, len(xy) - 1)] - xy[0]
    if not at_start:
        v = -v
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else np.array([1.0, 0.0])


def _signed_angle(u: F64, v: F64) -> float:
    return float(math.atan2(u[0] * v[1] - u[1] * v[0], u[0] * v[0] + u[1] * v[1]))


def _join(pa: F64, ta: F64, pb: F64, tb: F64, settings: LaneletSettings) -> float | None:
    """The heading change (rad, left positive) of driving from a lane's end (``pa``,
    direction ``ta``) into another's start (``pb``, ``tb``); None when that is not a
    plausible connection (see the module docstring)."""
    chord = pb[:2] - pa[:2]
    gap = float(np.linalg.norm(chord))
    turn = _signed_angle(ta, tb)
    if gap > settings.connect_gap_m or abs(turn) > math.radians(settings.connect_max_turn_deg):
        return None
    if gap < 1e-3:
        return turn
    c = chord / gap
    into, out_of = _signed_angle(ta, c), _signed_angle(c, tb)
    if abs(into) >= math.pi / 2 or abs(out_of) >= math.pi / 2:
        return None  # the next lane starts behind, or is entered backwards
    # On a circular arc the chord bisects the turn; the mismatch is the lateral offset of
    # the next lane from the arc (3.5 m for the lane beside it).
    if gap * abs(math.sin((into - out_of) / 2)) > settings.connect_max_offset_m:
        return None
    return turn


def _connect(builder: _Builder, lmap: Any) -> int:
    """Add a connector lanelet for every plausible lane end -> lane start join."""
    lanes = builder.lanelets
    if not lanes or builder.settings.connect_gap_m <= 0:
        return 0
    starts = np.array([lane.points[0, :2] for _, lane in lanes])
    tree = cKDTree(starts)
    made = 0
    for ll, lane in lanes:
        pa, ta = lane.points[-1], _direction(lane.points, at_start=False)
        for j in sorted(tree.query_ball_point(pa[:2], builder.settings.connect_gap_m)):
            after, nxt = lanes[j]
            tb = _direction(nxt.points, at_start=True)
            turn = _join(pa, ta, nxt.points[0], tb, builder.settings)
            if turn is not None:
                lmap.add(builder.connector(ll, lane, after, nxt, turn))
                made += 1
    return made


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
    connectors = _connect(builder, lmap)
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
        connectors=connectors,
        connector_lines=tuple(builder.connector_lines),
    )
    log.info(
        "lanelet2: wrote %s (%d lanelets and %d connectors, %d line strings, %d signs, "
        "%d attached to lanes)",
        target,
        summary.lanelets,
        summary.connectors,
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


def routing_graph(lanelet_map: Any) -> Any:
    """lanelet2's ``RoutingGraph`` of a loaded map for vehicles (lanelet2's German traffic
    rules, its built-in set): ``following``, ``getRoute`` and ``shortestPath`` as a
    driving stack's planner sees the map."""
    ll2 = _lanelet2()
    rules = ll2.traffic_rules.create(
        ll2.traffic_rules.Locations.Germany, ll2.traffic_rules.Participants.Vehicle
    )
    return ll2.routing.RoutingGraph(lanelet_map, rules)


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
