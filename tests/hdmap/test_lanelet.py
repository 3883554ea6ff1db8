"""Lanes from markings on a drawn road, and the Lanelet2 / Autoware outputs read back with
lanelet2 itself: lanelet count, bounds, shared boundaries, traffic-sign regulatory
elements, and that the LocalCartesian projection is exactly the map frame."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy.spatial import cKDTree

from adcloud.geodesy import geodetic_to_enu
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.labels import (
    LabelSettings,
    LaneCenterline,
    LaneMarking,
    lane_centerlines,
    reference_lines,
    resample_polyline,
)
from adcloud.hdmap.lanelet import (
    LaneletSettings,
    load_lanelet2,
    routing_graph,
    write_lanelet2,
    write_map_projector_info,
)
from adcloud.hdmap.semantic import SemanticMap, automatic_features, merge_labels
from adcloud.hdmap.signs import TrafficSign
from adcloud.hdmap.trajectory import Trajectory

ORIGIN = (37.3875, -122.0575, 12.0)


def _road_centre() -> np.ndarray:
    """A 40 m straight heading east, then a 90-degree left curve of 25 m radius, then 20 m
    north; z rises 2 % (x, y, z every 0.25 m)."""
    straight = np.column_stack([np.arange(0.0, 40.0, 0.25), np.zeros(160)])
    a = np.arange(0.0, math.pi / 2, 0.25 / 25)
    arc = np.column_stack([40 + 25 * np.sin(a), 25 - 25 * np.cos(a)])
    north = np.column_stack([np.full(80, 65.0), 25 + np.arange(0.0, 20.0, 0.25)])
    xy = np.vstack([straight, arc, north])
    s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(xy, axis=0), axis=1))])
    return np.column_stack([xy, 0.02 * s])


def _offset(centre: np.ndarray, d: float) -> np.ndarray:
    t = np.gradient(centre[:, :2], axis=0)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    n = np.column_stack([-t[:, 1], t[:, 0]])
    return np.column_stack([centre[:, :2] + d * n, centre[:, 2]])


def _trajectory(path: np.ndarray, speed: float = 8.0) -> Trajectory:
    s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(path[:, :2], axis=0), axis=1))])
    t = (s / speed * 1e9).astype(np.int64) + 1_700_000_000_000_000_000
    yaw = np.arctan2(*np.gradient(path[:, :2], axis=0).T[::-1])
    quat = np.column_stack(
        [np.zeros_like(yaw), np.zeros_like(yaw), np.sin(yaw / 2), np.cos(yaw / 2)]
    )
    return Trajectory.from_xyz_quat(t, path, quat)


def _markings(centre: np.ndarray) -> list[LaneMarking]:
    return [
        LaneMarking(_offset(centre, -3.5), "solid", id="edge-right"),
        LaneMarking(_offset(centre, 0.0), "dashed", id="divider"),
        LaneMarking(_offset(centre, 3.5), "solid", id="edge-left"),
    ]


def _sign(centre: np.ndarray, index: int, side: float, facing_back: bool, sid: str) -> TrafficSign:
    t = centre[index + 1, :2] - centre[index, :2]
    heading = math.atan2(t[1], t[0])
    pos = _offset(centre, side)[index] + np.array([0.0, 0.0, 2.3])
    return TrafficSign(
        position=pos,
        facing_yaw=heading + math.pi if facing_back else heading,
        width_m=0.75,
        height_m=0.75,
        height_above_ground_m=2.3,
        type="stop" if facing_back else "unknown",
        id=sid,
    )


@pytest.fixture
def road() -> tuple[np.ndarray, Trajectory, SemanticMap]:
    centre = _road_centre()
    trajectory = _trajectory(_offset(centre, -1.75))
    markings = _markings(centre)
    lanes = lane_centerlines(markings, trajectory)
    refs = reference_lines(markings, trajectory)
    signs = (
        # right of the road, facing oncoming traffic of the driven lane
        _sign(centre, 60, -5.0, True, "sign-along"),
        # left of the road, facing the traffic of the opposite lane
        _sign(centre, 300, 5.0, False, "sign-against"),
        # far from any lane: kept, regulates nothing
        TrafficSign(
            np.array([0.0, 60.0, 2.0]), 0.0, 0.6, 0.8, type="speed_limit_50", id="sign-far"
        ),
    )
    smap = SemanticMap(
        markings=tuple(markings),
        centerlines=tuple(lanes),
        reference_lines=tuple(refs),
        signs=signs,
        origin=ORIGIN,
    )
    return centre, trajectory, smap


def test_lanes_and_reference_line_from_markings(
    road: tuple[np.ndarray, Trajectory, SemanticMap],
) -> None:
    centre, _, smap = road
    lanes = {lane.direction: lane for lane in smap.centerlines}
    assert len(smap.centerlines) == 2 and set(lanes) == {"along", "against"}
    along, against = lanes["along"], lanes["against"]
    for lane, offset in ((along, -1.75), (against, 1.75)):
        truth = resample_polyline(_offset(centre, offset), 0.002)
        d, _ = cKDTree(truth[:, :2]).query(lane.points[:, :2])
        assert d.max() < 0.02
        assert lane.width_m == pytest.approx(3.5, abs=0.01)
        assert lane.length_m > 95  # the whole 99 m road
        # heights come from the markings: the road's 2 % grade
        _, near = cKDTree(centre[:, :2]).query(lane.points[:, :2])
        np.testing.assert_allclose(lane.points[:, 2], centre[near, 2], atol=0.01)
    # the driven lane runs with the drive and has the divider on its left
    assert np.linalg.norm(along.points[0, :2] - [0.0, -1.75]) < 1.5
    assert (along.left_marking, along.right_marking) == ("divider", "edge-right")
    # the opposite lane runs the other way, so the divider is on its left as well
    assert np.linalg.norm(against.points[-1, :2] - [0.0, 1.75]) < 1.5
    assert (against.left_marking, against.right_marking) == ("divider", "edge-left")
    np.testing.assert_allclose(along.left_boundary, against.left_boundary[::-1])
    # the reference line is the divider, the road's centre
    (ref,) = smap.reference_lines
    d, _ = cKDTree(resample_polyline(centre, 0.002)[:, :2]).query(ref.points[:, :2])
    assert d.max() < 0.02 and ref.length_m > 95


def test_left_hand_traffic_mirrors_directions(
    road: tuple[np.ndarray, Trajectory, SemanticMap],
) -> None:
    centre, _, smap = road
    # a drive in the *left* lane of a left-hand-traffic road, same markings
    trajectory = _trajectory(_offset(centre, 1.75))
    lanes = lane_centerlines(smap.markings, trajectory, LabelSettings(right_hand_traffic=False))
    by_dir = {lane.direction: lane for lane in lanes}
    for direction, offset in (("along", 1.75), ("against", -1.75)):
        truth = resample_polyline(_offset(centre, offset), 0.002)
        d, _ = cKDTree(truth[:, :2]).query(by_dir[direction].points[:, :2])
        assert d.max() < 0.02


def test_a_revisited_road_gives_its_lanes_once() -> None:
    """A drive of 1.3 laps of a ring road: the second pass adds no lanes."""
    a = np.arange(0.0, 2 * math.pi, 0.25 / 40)
    ring = np.column_stack([40 * np.cos(a), 40 * np.sin(a), np.zeros_like(a)])
    markings = [
        LaneMarking(np.vstack([_offset(ring, d), _offset(ring, d)[:1]]), kind, id=name)
        for d, kind, name in ((-3.5, "solid", "r"), (0.0, "dashed", "c"), (3.5, "solid", "l"))
    ]
    laps = np.vstack([ring, ring[: int(0.3 * len(ring))]])
    trajectory = _trajectory(_offset(laps, -1.75))
    lanes = lane_centerlines(markings, trajectory)
    # the drive goes counter-clockwise in the outer lane (radius 41.75 m)
    circumference = 2 * math.pi * 41.75
    along = sum(lane.length_m for lane in lanes if lane.direction == "along")
    assert 0.9 * circumference < along < 1.02 * circumference
    refs = reference_lines(markings, trajectory)
    assert sum(r.length_m for r in refs) < 1.02 * 2 * math.pi * 40


def test_drives_of_the_same_road_give_its_lanes_once(
    road: tuple[np.ndarray, Trajectory, SemanticMap],
) -> None:
    """A map of several drives: the road driven again the other way, and part of it once
    more, adds no lane and no reference line; each drive alone would give them all again."""
    centre, trajectory, smap = road
    back = _trajectory(_offset(centre, 1.75)[::-1])
    part = _trajectory(_offset(centre, -1.75)[200:])
    alone = lane_centerlines(smap.markings, trajectory)
    together = lane_centerlines(smap.markings, [trajectory, back, part])
    assert len(lane_centerlines(smap.markings, back)) == len(alone) == len(together) == 2
    for a, b in zip(alone, together, strict=True):
        assert a.direction == b.direction and a.id == b.id
        np.testing.assert_array_equal(a.points, b.points)
    assert len(reference_lines(smap.markings, [trajectory, back, part])) == 1
    # a drive on a road of its own keeps its own lanes, never joined to the first road's
    other = _trajectory(_offset(centre, -1.75) + np.array([0.0, 300.0, 0.0]))
    moved = [
        LaneMarking(m.points + np.array([0.0, 300.0, 0.0]), m.type, id=f"{m.id}-far")
        for m in smap.markings
    ]
    both = lane_centerlines([*smap.markings, *moved], [trajectory, other])
    assert len(both) == 4 and len({lane.section for lane in both}) == 2
    assert all(np.ptp(lane.points[:, 1]) < 60 for lane in both)  # no section spans both roads


def test_lanelet2_round_trip(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    _, _, smap = road
    path = tmp_path / "lanelet2_map.osm"
    summary = write_lanelet2(path, smap)
    assert summary.lanelets == 2 and summary.regulatory_elements == 3
    assert summary.attached_signs == 2
    lmap = load_lanelet2(path, ORIGIN)
    assert len(lmap.laneletLayer) == 2
    assert len(lmap.regulatoryElementLayer) == 3
    lanelets = {ll.attributes["adcloud:id"]: ll for ll in lmap.laneletLayer}
    lanes = {lane.id: lane for lane in smap.centerlines}
    assert set(lanelets) == set(lanes)
    all_input = np.vstack(
        [m.points for m in smap.markings]
        + [c.points for c in smap.centerlines]
        + [r.points for r in smap.reference_lines]
    )
    lo, hi = all_input.min(axis=0) - 1e-3, all_input.max(axis=0) + 1e-3
    for lane_id, ll in lanelets.items():
        lane = lanes[lane_id]
        assert ll.attributes["type"] == "lanelet" and ll.attributes["subtype"] == "road"
        for bound, expected in (
            (ll.leftBound, lane.left_boundary),
            (ll.rightBound, lane.right_boundary),
        ):
            got = np.array([[p.x, p.y, p.z] for p in bound])
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, atol=1e-3)  # < 1 mm after lat/lon
            assert (got >= lo).all() and (got <= hi).all()
        centre = np.array([[p.x, p.y, p.z] for p in ll.centerline])
        np.testing.assert_allclose(centre, lane.points, atol=1e-3)
    along = next(ll for i, ll in lanelets.items() if lanes[i].direction == "along")
    against = next(ll for i, ll in lanelets.items() if lanes[i].direction == "against")
    # the divider is one line string shared by both lanes, inverted for the opposite one
    assert along.leftBound.id == against.leftBound.id
    assert against.leftBound.inverted() and not along.leftBound.inverted()
    assert along.leftBound.attributes["subtype"] == "dashed"
    assert along.rightBound.attributes["subtype"] == "solid"
    # signs: regulatory elements referring to their plates, on the lanes they face
    (re_along,) = along.regulatoryElements
    (re_against,) = against.regulatoryElements
    assert re_along.attributes["adcloud:id"] == "sign-along"
    assert re_along.attributes["sign_type"] == "stop"
    assert re_against.attributes["adcloud:id"] == "sign-against"
    signs = {s.id: s for s in smap.signs}
    for re in lmap.regulatoryElementLayer:
        assert re.attributes["subtype"] == "traffic_sign"
        (plate,) = re.parameters["refers"]
        assert plate.attributes["type"] == "traffic_sign"
        sign = signs[re.attributes["adcloud:id"]]
        assert plate.attributes["subtype"] == sign.type
        edge = np.array([[p.x, p.y, p.z] for p in plate])
        np.testing.assert_allclose(edge.mean(axis=0)[:2], sign.position[:2], atol=1e-3)
        assert edge[0, 2] == pytest.approx(sign.position[2] - sign.height_m / 2, abs=1e-3)
        assert np.linalg.norm(edge[0, :2] - edge[1, :2]) == pytest.approx(sign.width_m, abs=1e-3)
    # the reference line and no stray markings (all three bound lanes)
    kinds = [ls.attributes["type"] for ls in lmap.lineStringLayer]
    assert kinds.count("reference_line") == 1
    assert kinds.count("traffic_sign") == 3


def test_the_same_map_gives_the_same_file_in_one_process(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    # Ids are the map's own (from 1), not lanelet2's process-wide counter: a second build in
    # the same driver or notebook writes the same bytes.
    _, _, smap = road
    first, second = tmp_path / "a.osm", tmp_path / "b.osm"
    write_lanelet2(first, smap)
    write_lanelet2(second, smap)
    assert first.read_bytes() == second.read_bytes()
    ids = [int(e.get("id")) for e in ET.parse(first).getroot() if e.get("id")]
    assert min(ids) == 1 and len(set(ids)) == len(ids)


def test_the_projection_is_the_map_frame(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    """Every node's WGS84 latitude/longitude/ele, converted back to the map frame by
    adcloud's own ECEF-based geodesy, lands on the point written (``local_x/y`` tags)."""
    _, _, smap = road
    path = tmp_path / "lanelet2_map.osm"
    write_lanelet2(path, smap)
    nodes = ET.parse(path).getroot().findall("node")
    assert len(nodes) > 500
    lat = np.array([float(n.get("lat")) for n in nodes])
    lon = np.array([float(n.get("lon")) for n in nodes])
    tags = [{t.get("k"): t.get("v") for t in n.findall("tag")} for n in nodes]
    ele = np.array([float(t["ele"]) for t in tags])
    local = np.array([[float(t["local_x"]), float(t["local_y"])] for t in tags])
    enu = geodetic_to_enu(lat, lon, ele, ORIGIN)
    np.testing.assert_allclose(enu[:, :2], local, atol=2e-3)
    # heights: the map's z range (0..2 m on this road) above the origin's 12 m
    assert enu[:, 2].min() > -0.01 and enu[:, 2].max() < 5.0


def test_imported_lane_without_boundaries_gets_virtual_bounds(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    centre = road[0]
    lane = LaneCenterline(points=_offset(centre, 10.0)[:80], width_m=3.0, source="human", id="h-1")
    smap2 = SemanticMap(centerlines=(lane,), origin=ORIGIN)
    path = tmp_path / "lanelet2_map.osm"
    assert write_lanelet2(path, smap2).lanelets == 1
    (ll,) = load_lanelet2(path, ORIGIN).laneletLayer
    assert ll.leftBound.attributes["type"] == "virtual"
    left = np.array([[p.x, p.y] for p in ll.leftBound])
    right = np.array([[p.x, p.y] for p in ll.rightBound])
    np.testing.assert_allclose(np.linalg.norm(left - right, axis=1), 3.0, atol=0.01)
    assert ll.attributes["adcloud:source"] == "human"


def test_map_projector_info(tmp_path: Path) -> None:
    path = write_map_projector_info(tmp_path / "map" / "map_projector_info.yaml", ORIGIN)
    info = yaml.safe_load(path.read_text())
    assert info == {
        "projector_type": "LocalCartesian",
        "vertical_datum": "WGS84",
        "map_origin": {"latitude": 37.3875, "longitude": -122.0575, "altitude": 12.0},
    }
    with pytest.raises(HdmapError, match="not a WGS84 position"):
        write_map_projector_info(tmp_path / "x.yaml", (95.0, 0.0, 0.0))


def test_lanelet_errors(road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path) -> None:
    _, _, smap = road
    with pytest.raises(HdmapError, match="origin is unknown"):
        write_lanelet2(tmp_path / "a.osm", SemanticMap(markings=smap.markings))
    with pytest.raises(HdmapError, match="not a WGS84"):
        write_lanelet2(tmp_path / "a.osm", smap, origin=(0.0, 200.0, 0.0))
    with pytest.raises(MapFormatError, match="no such Lanelet2 map"):
        load_lanelet2(tmp_path / "missing.osm", ORIGIN)
    with pytest.raises(HdmapError, match="attach_radius_m"):
        LaneletSettings(attach_radius_m=0.0)
    with pytest.raises(HdmapError, match="connect_gap_m"):
        LaneletSettings(connect_gap_m=-1.0)
    with pytest.raises(HdmapError, match="connect_max_turn_deg"):
        LaneletSettings(connect_max_turn_deg=180.0)
    with pytest.raises(HdmapError, match="connect_max_offset_m"):
        LaneletSettings(connect_max_offset_m=float("nan"))


def _ids(lanelets: object) -> list[str]:
    return sorted(ll.attributes["adcloud:id"] for ll in lanelets)  # type: ignore[attr-defined]


@pytest.fixture
def gapped_road(tmp_path: Path) -> tuple[np.ndarray, SemanticMap, Path]:
    """The road with no paint on 22 m of its curve (an intersection the drive crossed):
    two sections of two lanes each, written to ``lanelet2_map.osm``."""
    centre = _road_centre()
    s = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(centre[:, :2], axis=0), axis=1))])
    before, after = s < 42.0, s > 64.0
    markings = [
        LaneMarking(_offset(centre[part], d), kind, id=f"{name}-{tag}")
        for part, tag in ((before, "a"), (after, "b"))
        for d, kind, name in (
            (-3.5, "solid", "right"),
            (0.0, "dashed", "div"),
            (3.5, "solid", "left"),
        )
    ]
    trajectory = _trajectory(_offset(centre, -1.75))
    lanes = lane_centerlines(markings, trajectory)
    smap = SemanticMap(markings=tuple(markings), centerlines=tuple(lanes), origin=ORIGIN)
    path = tmp_path / "lanelet2_map.osm"
    summary = write_lanelet2(path, smap)
    assert summary.lanelets == 4 and summary.connectors == 2
    # the connectors' centre lines run from a lane's end to the next lane's start
    ends = {lane.points[-1, :2].tobytes() for lane in lanes}
    starts = {lane.points[0, :2].tobytes() for lane in lanes}
    assert len(summary.connector_lines) == 2
    for line in summary.connector_lines:
        assert line[0, :2].tobytes() in ends and line[-1, :2].tobytes() in starts
    return centre, smap, path


def test_connectors_make_the_lanes_routable(
    gapped_road: tuple[np.ndarray, SemanticMap, Path],
) -> None:
    """lanelet2's own routing graph finds the way across the unpainted gap in both
    directions, and only there: no lane joins the lane beside it or turns back."""
    centre, smap, path = gapped_road
    lmap = load_lanelet2(path, ORIGIN)
    graph = routing_graph(lmap)
    assert graph.checkValidity() == []  # type: ignore[attr-defined]
    by_id = {ll.attributes["adcloud:id"]: ll for ll in lmap.laneletLayer}
    lanes = {(lane.section, lane.direction): lane.id for lane in smap.centerlines}
    along0, along1 = lanes[(0, "along")], lanes[(1, "along")]
    against0, against1 = lanes[(0, "against")], lanes[(1, "against")]
    for first, last, turn in ((along0, along1, "left"), (against1, against0, "right")):
        connector = by_id[f"{first}>{last}"]
        assert _ids(graph.following(by_id[first])) == [f"{first}>{last}"]  # type: ignore[attr-defined]
        assert _ids(graph.following(connector)) == [last]  # type: ignore[attr-defined]
        route = graph.getRoute(by_id[first], by_id[last])  # type: ignore[attr-defined]
        assert route is not None
        assert _ids(route.shortestPath()) == sorted([first, f"{first}>{last}", last])
        assert connector.attributes["turn_direction"] == turn
        assert connector.attributes["adcloud:source"] == "connector"
        assert connector.leftBound.attributes["type"] == "virtual"
        # the connector starts and ends on the lanes' own boundary points
        assert (
            connector.leftBound[0].id == by_id[first].leftBound[len(by_id[first].leftBound) - 1].id
        )
        assert (
            connector.rightBound[len(connector.rightBound) - 1].id == by_id[last].rightBound[0].id
        )
    # the gap lies on the 25 m curve: the bridged centre line follows the lane's arc
    truth = resample_polyline(_offset(centre, -1.75), 0.01)
    bridged = by_id[f"{along0}>{along1}"].centerline
    d, _ = cKDTree(truth[:, :2]).query(np.array([[p.x, p.y] for p in bridged]))
    assert len(bridged) > 15 and d.max() < 0.05
    # both directions cross the gap on one divider line string, as the lanes of a section
    forward = by_id[f"{along0}>{along1}"].leftBound
    backward = by_id[f"{against1}>{against0}"].leftBound
    assert forward.id == backward.id and backward.inverted() and not forward.inverted()
    # nothing else is joined: the end of each road leads nowhere
    assert list(graph.following(by_id[along1])) == []  # type: ignore[attr-defined]
    assert list(graph.following(by_id[against0])) == []  # type: ignore[attr-defined]


def test_connectors_respect_their_settings(
    gapped_road: tuple[np.ndarray, SemanticMap, Path], tmp_path: Path
) -> None:
    _, smap, _ = gapped_road
    path = tmp_path / "other.osm"
    assert write_lanelet2(path, smap, settings=LaneletSettings(connect_gap_m=0.0)).connectors == 0
    # the gap is 22 m along the lane: a shorter reach joins nothing
    assert write_lanelet2(path, smap, settings=LaneletSettings(connect_gap_m=15.0)).connectors == 0
    # the curve turns the lanes ~50 degrees across the gap
    turn = LaneletSettings(connect_max_turn_deg=30.0)
    assert write_lanelet2(path, smap, settings=turn).connectors == 0
    assert len(load_lanelet2(path, ORIGIN).laneletLayer) == 4


def _bound_points(line: object) -> np.ndarray:
    return np.array([[p.x, p.y, p.z] for p in line])  # type: ignore[attr-defined]


def test_each_lanelet_is_bounded_by_its_own_lane_boundaries(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    """Lanes of one section share a bound only where it is the same line: a lane a human
    label cut in two keeps its section and marking ids, and an imported lane may give a
    section without marking ids; each lanelet still lies between its own boundaries."""
    centre, _, smap = road
    along = next(c for c in smap.centerlines if c.direction == "along")
    label = LaneCenterline(points=along.points[45:55], source="human", id="h-fix")
    merged = merge_labels(automatic_features(smap), SemanticMap(centerlines=(label,)))
    pieces = [c for c in merged.centerlines if c.id.startswith(f"{along.id}.")]
    assert len(pieces) == 2 and {p.section for p in pieces} == {along.section}
    drawn = LaneCenterline(
        points=_offset(centre, 12.0)[:80],
        left_boundary=_offset(centre, 13.75)[:80],
        right_boundary=_offset(centre, 10.25)[:80],
        section=7,
        source="human",
        id="h-drawn",
    )
    smap2 = replace(merged, centerlines=(*merged.centerlines, drawn))
    path = tmp_path / "lanelet2_map.osm"
    write_lanelet2(path, smap2)
    lanelets = {ll.attributes["adcloud:id"]: ll for ll in load_lanelet2(path, ORIGIN).laneletLayer}
    lanes = {c.id: c for c in smap2.centerlines if c.has_boundaries}
    assert set(lanes) <= set(lanelets)
    for lane_id, lane in lanes.items():
        ll = lanelets[lane_id]
        for bound, expected in (
            (ll.leftBound, lane.left_boundary),
            (ll.rightBound, lane.right_boundary),
        ):
            got = _bound_points(bound)
            assert got.shape == expected.shape, lane_id
            np.testing.assert_allclose(got[:, :2], expected[:, :2], atol=1e-3)
    assert lanelets["h-drawn"].leftBound.id != lanelets["h-drawn"].rightBound.id
    # the untouched opposite lane still shares the divider with nothing it does not match
    against = next(c for c in smap.centerlines if c.direction == "against")
    assert lanelets[against.id].leftBound.id not in {lanelets[p.id].leftBound.id for p in pieces}


def test_the_osm_file_is_one_consistent_graph(
    road: tuple[np.ndarray, Trajectory, SemanticMap], tmp_path: Path
) -> None:
    """Every id is used once, and every way's node and relation's member names an element
    of the file."""
    _, _, smap = road
    path = tmp_path / "lanelet2_map.osm"
    write_lanelet2(path, smap)
    root = ET.parse(path).getroot()
    ids = [(e.tag, e.get("id")) for e in root if e.get("id")]
    assert len(ids) == len(set(ids))
    have = {(tag, i) for tag, i in ids}
    refs: list[tuple[str | None, str | None]] = [
        ("node", nd.get("ref")) for way in root.iter("way") for nd in way.iter("nd")
    ]
    refs += [
        (m.get("type"), m.get("ref")) for rel in root.iter("relation") for m in rel.iter("member")
    ]
    assert refs and all(ref in have for ref in refs)
