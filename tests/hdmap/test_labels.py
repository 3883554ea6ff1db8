"""Stage 4 labels against a synthetic drive's ground truth: lane markings (from the truth
raster made to look observed, and from the drive's own LiDAR rasterized), lanes and the
reference line, traffic signs from the LiDAR, the semantic GeoJSON, imported labels and
their merge rules, and the errors for bad input."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import ndimage, sparse
from scipy.sparse.csgraph import connected_components
from scipy.spatial import cKDTree

import adcloud.hdmap.labels as labels_module
from adcloud.hdmap.drive import read_drive
from adcloud.hdmap.errors import HdmapError, MapFormatError
from adcloud.hdmap.labels import (
    GridLayers,
    LabelSettings,
    LaneCenterline,
    LaneMarking,
    ReferenceLine,
    extract_lane_markings,
    lane_centerlines,
    reference_lines,
    resample_polyline,
)
from adcloud.hdmap.semantic import (
    LabelArea,
    MergeSettings,
    SemanticMap,
    combine_labels,
    import_labels,
    merge_labels,
    parse_geojson,
    read_geojson,
    write_geojson,
)
from adcloud.hdmap.signs import SignSettings, TrafficSign, _clusters, detect_signs
from adcloud.hdmap.trajectory import Trajectory
from adcloud.synth import DriveConfig, Label, generate_drive, read_map, read_poses, read_raster

log = logging.getLogger(__name__)

ORIGIN = (37.3875, -122.0575, 12.0)
# Truth lines are scored within 10 m of the driven path: one drive's LiDAR sees the road
# surface densely there (the extraction itself looks 12 m out).
SCORED_OFFSET_M = 10.0
GROUND = (Label.ROAD, Label.LANE_MARKING, Label.CURB, Label.SIDEWALK, Label.TERRAIN)


@dataclass(frozen=True)
class Drive:
    truth: Path
    trajectory: Trajectory
    truth_map: dict[str, Any]
    points: np.ndarray  # map-frame LiDAR points (n, 3)
    intensity: np.ndarray
    label: np.ndarray


@pytest.fixture(scope="module")
def drive(tmp_path_factory: pytest.TempPathFactory) -> Drive:
    """A 32 s drive (two curves, nine signs in view, one of them a speed_limit_50) and its
    LiDAR in the map frame, each point placed with the true pose at its firing time."""
    out = tmp_path_factory.mktemp("labels")
    cfg = DriveConfig(seconds=32, seed=7, lidar_beams=16, lidar_columns=512, camera=False)
    res = generate_drive(cfg, out / "d.bag")
    t, xyz, q = read_poses(res.truth)
    trajectory = Trajectory.from_xyz_quat(t, xyz, q)
    data = read_drive(str(res.bag))
    mount = data.extrinsics.get("lidar")
    pts, inten, lab = [], [], []
    for scan in data.scans:
        # one pose per firing column (points of a column share their time)
        dt_ns = np.round(scan.dt.astype(np.float64) * 1e9).astype(np.int64)
        times, inverse = np.unique(scan.stamp + dt_ns, return_inverse=True)
        poses = trajectory.at(times) @ mount
        rot, trans = poses[inverse, :3, :3], poses[inverse, :3, 3]
        pts.append(np.einsum("nij,nj->ni", rot, scan.xyz.astype(np.float64)) + trans)
        inten.append(scan.intensity)
        assert scan.label is not None
        lab.append(scan.label)
    return Drive(
        truth=res.truth,
        trajectory=trajectory,
        truth_map=read_map(res.truth),
        points=np.concatenate(pts),
        intensity=np.concatenate(inten),
        label=np.concatenate(lab),
    )


def _features(truth_map: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in truth_map["features"] if f["properties"]["kind"] == kind]


def _corridor(
    layers_shape: tuple[int, int], origin: tuple[float, float], res: float, trajectory: Trajectory
) -> np.ndarray:
    """Distance (m) of every cell from the driven path."""
    path = resample_polyline(trajectory.xyz, res)
    col = ((path[:, 0] - origin[0]) / res).astype(int)
    row = ((path[:, 1] - origin[1]) / res).astype(int)
    free = np.ones(layers_shape, dtype=bool)
    free[row, col] = False
    return np.asarray(ndimage.distance_transform_edt(free) * res)


def _truth_layers(drive: Drive, seed: int = 3) -> GridLayers:
    """The truth raster as a grid stage would see it from one drive: intensity = 255 x
    reflectance x (0.3 + 0.7 cos incidence) from a LiDAR 1.9 m up, per-point noise of 5 %
    averaged over a Poisson(2) number of points, only cells within 10 m of the path and a
    point observed, elevation with 1 cm noise."""
    raster = read_raster(drive.truth)
    rng = np.random.default_rng(seed)
    shape = raster.reflectance.shape
    dist = _corridor(shape, raster.origin, raster.resolution, drive.trajectory)
    count = rng.poisson(2.0, size=shape)
    cos_incidence = 1.9 / np.sqrt(dist**2 + 1.9**2)
    noise = 1 + 0.05 * rng.standard_normal(shape) / np.sqrt(np.maximum(count, 1))
    intensity = 255 * raster.reflectance * (0.3 + 0.7 * cos_incidence) * noise
    seen = (dist < 10.0) & (count > 0)
    elevation = raster.elevation + 0.01 * rng.standard_normal(shape)
    return GridLayers(
        origin=raster.origin,
        resolution=raster.resolution,
        reflectance=np.where(seen, intensity, np.nan).astype(np.float32),
        elevation=np.where(seen, elevation, np.nan).astype(np.float32),
        count=np.where(seen, count, 0).astype(np.int32),
    )


def _lidar_layers(drive: Drive) -> GridLayers:
    """The drive's own ground points (by their labels) averaged into 5 cm cells: mean
    intensity and mean height, as the grid stage does."""
    raster = read_raster(drive.truth)
    rows, cols = raster.reflectance.shape
    ground = np.isin(drive.label, np.array(GROUND, dtype=np.uint16))
    pts = drive.points[ground]
    col = np.floor((pts[:, 0] - raster.origin[0]) / raster.resolution).astype(np.int64)
    row = np.floor((pts[:, 1] - raster.origin[1]) / raster.resolution).astype(np.int64)
    inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
    flat = row[inside] * cols + col[inside]
    count = np.bincount(flat, minlength=rows * cols).reshape(rows, cols)
    total_i = np.bincount(flat, drive.intensity[ground][inside], rows * cols).reshape(rows, cols)
    total_z = np.bincount(flat, pts[inside, 2], rows * cols).reshape(rows, cols)
    with np.errstate(invalid="ignore", divide="ignore"):
        return GridLayers(
            origin=raster.origin,
            resolution=raster.resolution,
            reflectance=(total_i / count).astype(np.float32),
            elevation=(total_z / count).astype(np.float32),
            count=count.astype(np.int32),
        )


STEP = 0.02  # truth lines are sampled every 2 cm for scoring


@dataclass(frozen=True)
class MarkingScore:
    mean_distance: float
    recovered: float
    type_agreement: float
    observed_truth_m: float
    turn_deg: float


def _score_markings(
    markings: list[LaneMarking], layers: GridLayers, drive: Drive, max_offset: float
) -> MarkingScore:
    """Mean distance of the extracted polylines from the truth lines; the share of the
    truth length (what the layers show: within ``max_offset`` of the path, observed, and
    for dashed lines from the first to the last dash seen) lying within 0.3 m of an
    extracted line; the length-weighted agreement of types."""
    raster = read_raster(drive.truth)
    truth = _features(drive.truth_map, "lane_marking")
    samples, owner = [], []
    for k, f in enumerate(truth):
        p = resample_polyline(np.asarray(f["geometry"]["coordinates"], dtype=np.float64), STEP)
        samples.append(p)
        owner.append(np.full(len(p), k))
    tpts, towner = np.vstack(samples), np.concatenate(owner)
    # what the layers show of each truth line
    row, col = layers.cells_of(tpts[:, :2])
    rows, cols = layers.shape
    inside = (row >= 0) & (row < rows) & (col >= 0) & (col < cols)
    seen_grid = ndimage.binary_dilation(layers.observed, iterations=3)
    seen = np.zeros(len(tpts), dtype=bool)
    seen[inside] = seen_grid[row[inside], col[inside]]
    path = cKDTree(resample_polyline(drive.trajectory.xyz, 0.5)[:, :2])
    near, _ = path.query(tpts[:, :2])
    seen &= near <= max_offset
    painted = np.zeros(len(tpts), dtype=bool)
    painted[inside] = raster.label[row[inside], col[inside]] == Label.LANE_MARKING
    for k in range(len(truth)):
        sel = np.flatnonzero((towner == k) & seen)
        paint_seen = sel[painted[sel]]
        if len(paint_seen):
            seen[sel[(sel < paint_seen[0]) | (sel > paint_seen[-1])]] = False
        else:
            seen[sel] = False
    dense_parts = [resample_polyline(m.points, STEP) for m in markings]
    dense = np.vstack(dense_parts)
    dense_owner = np.concatenate([np.full(len(p), i) for i, p in enumerate(dense_parts)])
    dist_to_found, nearest = cKDTree(dense[:, :2]).query(tpts[:, :2])
    recovered = seen & (dist_to_found < 0.3)
    found_type = np.array([m.type for m in markings])[dense_owner[nearest[recovered]]]
    true_type = np.array([f["properties"]["type"] for f in truth])[towner[recovered]]
    truth_tree = cKDTree(tpts[:, :2])
    distances = [truth_tree.query(resample_polyline(m.points, 0.1)[:, :2])[0] for m in markings]
    step = np.gradient(drive.trajectory.xyz[:, :2], axis=0)
    heading = np.unwrap(np.arctan2(step[:, 1], step[:, 0]))
    return MarkingScore(
        mean_distance=float(np.mean(np.concatenate(distances))),
        recovered=float(recovered.sum() / max(seen.sum(), 1)),
        type_agreement=float(np.mean(found_type == true_type)),
        observed_truth_m=float(seen.sum() * STEP),
        turn_deg=float(np.degrees(np.ptp(heading))),
    )


@dataclass(frozen=True)
class Case:
    layers: GridLayers
    markings: list[LaneMarking]


@pytest.fixture(scope="module")
def truth_case(drive: Drive) -> Case:
    layers = _truth_layers(drive)
    return Case(layers, extract_lane_markings(layers, drive.trajectory))


@pytest.fixture(scope="module")
def lidar_case(drive: Drive) -> Case:
    layers = _lidar_layers(drive)
    return Case(layers, extract_lane_markings(layers, drive.trajectory))


def test_markings_from_truth_raster_meet_the_targets(drive: Drive, truth_case: Case) -> None:
    markings = truth_case.markings
    score = _score_markings(markings, truth_case.layers, drive, SCORED_OFFSET_M)
    log.info("markings from the truth raster: %s", score)
    assert score.turn_deg > 150  # the drive takes (at least) two 90-degree curves
    assert score.observed_truth_m > 400
    assert score.mean_distance <= 0.10
    assert score.recovered >= 0.95
    assert score.type_agreement >= 0.95
    assert {m.type for m in markings} == {"solid", "dashed"}
    for m in markings:
        assert m.source == "auto" and m.id.startswith("marking-")
        assert 0.08 <= m.width_m <= 0.25
        assert np.isfinite(m.points).all()


def test_markings_from_the_drives_lidar_meet_the_targets(drive: Drive, lidar_case: Case) -> None:
    """Sparse single-drive rings, real intensities, curbs that return bright stripes."""
    markings = lidar_case.markings
    score = _score_markings(markings, lidar_case.layers, drive, SCORED_OFFSET_M)
    log.info("markings from the LiDAR grid: %s", score)
    assert score.observed_truth_m > 400
    assert score.mean_distance <= 0.10
    assert score.recovered >= 0.95
    assert score.type_agreement >= 0.95
    # no curb (0.5 m outside the edge lines) came out as a marking
    truth = np.vstack(
        [
            np.asarray(f["geometry"]["coordinates"])
            for f in _features(drive.truth_map, "lane_marking")
        ]
    )
    tree = cKDTree(resample_polyline(truth, STEP)[:, :2])
    for m in markings:
        d, _ = tree.query(m.points[:, :2])
        assert np.median(d) < 0.1, m.id


def test_a_short_piece_in_a_gap_is_linked_between_its_neighbours() -> None:
    # Ends of pieces (position, outward direction) from a real build: a solid marking at
    # x = 80 m broken at y = 37.2..39.2 m with a 0.5 m piece in the gap, slightly skewed.
    # The piece's near end must not link to the far piece (that end lies behind it, and
    # the line would fold back, leaving the near piece unlinked and the marking split).
    settings = LabelSettings()
    normal = np.array([-0.999, -0.042])  # the driven path's, beside the gap
    near_end = (np.array([79.98, 37.23]), np.array([-0.043, 0.999]))
    piece_start = (np.array([79.97, 38.22]), np.array([0.154, -0.988]))
    piece_end = (np.array([79.90, 38.73]), np.array([-0.154, 0.988]))
    far_start = (np.array([79.96, 39.17]), np.array([0.048, -0.999]))

    def cost(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float | None:
        return labels_module._link_cost(*a, *b, normal, settings)

    assert cost(piece_start, far_start) is None  # behind: 0.95 m back along the piece
    assert cost(near_end, piece_start) is not None
    assert cost(piece_end, far_start) is not None
    assert cost(near_end, far_start) is not None  # the gap alone still links
    # ends within the link radius join whatever their headings (overlapping pieces)
    overlap = (np.array([79.98, 37.10]), np.array([0.0, -1.0]))
    assert cost(near_end, overlap) is not None


def test_paint_contrast_matters(drive: Drive, truth_case: Case) -> None:
    """On a 40 m square of the map, the default finds the markings and a contrast above
    paint's over asphalt finds none: the threshold is what separates paint."""
    full = truth_case.layers
    r, c = full.cells_of(drive.trajectory.xyz[:1, :2])
    half = 400
    r0, c0 = max(0, int(r[0]) - half), max(0, int(c[0]) - half)
    window = (slice(r0, r0 + 2 * half), slice(c0, c0 + 2 * half))
    layers = GridLayers(
        origin=(full.origin[0] + c0 * full.resolution, full.origin[1] + r0 * full.resolution),
        resolution=full.resolution,
        reflectance=full.reflectance[window],
        elevation=full.elevation[window],
        count=full.count[window],
    )
    assert len(extract_lane_markings(layers, drive.trajectory)) >= 3
    strict = LabelSettings(paint_contrast=40.0)
    assert extract_lane_markings(layers, drive.trajectory, strict) == []


def test_lanes_and_reference_line_follow_the_truth(drive: Drive, truth_case: Case) -> None:
    markings = truth_case.markings
    lanes = lane_centerlines(markings, drive.trajectory)
    refs = reference_lines(markings, drive.trajectory)
    truth_lanes = {
        (f["properties"]["road"], f["properties"]["lane"]): np.asarray(f["geometry"]["coordinates"])
        for f in _features(drive.truth_map, "lane_centerline")
    }
    assert {lane.direction for lane in lanes} == {"along", "against"}
    ids = {m.id for m in markings}
    for lane in lanes:
        # the car drove the loop's right lane; the opposite lane is the loop's left lane
        truth = truth_lanes[(0, "right" if lane.direction == "along" else "left")]
        tree = cKDTree(resample_polyline(truth, STEP)[:, :2])
        d, idx = tree.query(lane.points[:, :2])
        assert d.mean() < 0.10, lane.id
        assert 3.3 < lane.width_m < 3.7
        # same driving direction as the truth lane
        dense = resample_polyline(truth, STEP)
        t_truth = np.gradient(dense[:, :2], axis=0)[idx]
        t_lane = np.gradient(lane.points[:, :2], axis=0)
        assert np.sum(t_truth * t_lane) > 0
        assert lane.left_marking in ids and lane.right_marking in ids
        assert lane.left_boundary.shape == lane.points.shape == lane.right_boundary.shape
    assert sum(lane.length_m for lane in lanes if lane.direction == "along") > 150
    ref_truth = np.vstack(
        [
            np.asarray(f["geometry"]["coordinates"])
            for f in _features(drive.truth_map, "reference_line")
            if f["properties"]["road"] == 0
        ]
    )
    tree = cKDTree(resample_polyline(ref_truth, STEP)[:, :2])
    assert len(refs) >= 1
    for ref in refs:
        d, _ = tree.query(ref.points[:, :2])
        assert d.mean() < 0.10
    assert sum(r.length_m for r in refs) > 150


def test_signs_from_the_drives_lidar(drive: Drive) -> None:
    signs = detect_signs(drive.points, drive.intensity, trajectory=drive.trajectory)
    truth = _features(drive.truth_map, "traffic_sign")
    truth_xyz = np.array([f["geometry"]["coordinates"] for f in truth])
    # a sign is observable when the drive has enough returns from its plate
    plate = drive.points[drive.label == Label.SIGN]
    near, which = cKDTree(truth_xyz).query(plate)
    hits = np.bincount(which[near < 0.6], minlength=len(truth))
    observable = np.flatnonzero(hits >= 20)
    assert len(observable) >= 8
    found_xyz = np.array([s.position for s in signs])
    d_found, match = cKDTree(truth_xyz).query(found_xyz)
    precision = float(np.mean(d_found <= 0.30))
    recall = float(
        np.mean(
            [np.min(np.linalg.norm(found_xyz - truth_xyz[k], axis=1)) <= 0.30 for k in observable]
        )
    )
    log.info(
        "signs: %d found, %d observable, recall %.3f, precision %.3f, position error mean %.3f m",
        len(signs),
        len(observable),
        recall,
        precision,
        float(d_found.mean()),
    )
    assert recall >= 0.90
    assert precision >= 0.90
    typed = 0
    for sign, k, d in zip(signs, match, d_found, strict=True):
        if d > 0.30:
            continue
        props = truth[k]["properties"]
        err = (sign.facing_yaw - props["facing_yaw_rad"] + math.pi) % (2 * math.pi) - math.pi
        assert abs(err) < math.radians(10), sign.id
        assert abs(sign.height_above_ground_m - props["height_m"]) < 0.3
        if sign.point_count >= SignSettings().min_type_points:
            assert abs(sign.width_m - props["width_m"]) < 0.1
            assert props["type"] in sign.candidates
        else:
            assert sign.type == "unknown" and sign.candidates == ()
        if sign.type != "unknown":
            assert sign.type == props["type"]
            typed += 1
    # the one plate of a distinct size (speed_limit_50, 0.6 x 0.8 m) is typed
    assert typed >= 1
    assert any(s.type == "speed_limit_50" for s in signs)


def _plate_cloud(post_behind_x: float | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A 0.75 m plate in the plane x = 0 centred at (0, -5, 2.3) above flat ground (z = 0),
    seen bright, optionally with a dim post 5 cm to the side x = ``post_behind_x``."""
    rng = np.random.default_rng(seed)
    u, v = np.meshgrid(np.linspace(-0.37, 0.37, 25), np.linspace(-0.37, 0.37, 25))
    plate = np.column_stack([rng.normal(0, 0.01, u.size), -5 + u.ravel(), 2.3 + v.ravel()])
    ground = np.column_stack(
        [rng.uniform(-1, 1, 400), rng.uniform(-6, -4, 400), rng.normal(0, 0.01, 400)]
    )
    parts, inten = [plate, ground], [np.full(len(plate), 220.0), np.full(len(ground), 20.0)]
    if post_behind_x is not None:
        z = np.linspace(0.1, 1.8, 60)
        post = np.column_stack([np.full(60, post_behind_x), np.full(60, -5.0), z])
        parts.append(post)
        inten.append(np.full(60, 60.0))
    return np.vstack(parts), np.concatenate(inten)


def test_sign_facing_from_post_then_traffic_rule() -> None:
    # a drive heading east along y = 0: the plate is 5 m to its right
    t = np.array([0, 10**9], np.int64)
    poses = np.tile(np.eye(4), (2, 1, 1))
    poses[1, 0, 3] = 10.0
    east = Trajectory(t, poses)
    # no post: right-hand traffic -> it serves the drive and faces against it (west)
    pts, inten = _plate_cloud(None)
    (sign,) = detect_signs(pts, inten, trajectory=east)
    assert math.cos(sign.facing_yaw) == pytest.approx(-1.0, abs=1e-3)
    assert sign.confidence < 1.0
    np.testing.assert_allclose(sign.position, [0.0, -5.0, 2.3], atol=0.02)
    assert sign.width_m == pytest.approx(0.74, abs=0.02)
    assert sign.height_above_ground_m == pytest.approx(2.3, abs=0.05)
    (mirrored,) = detect_signs(
        pts, inten, settings=SignSettings(right_hand_traffic=False), trajectory=east
    )
    assert math.cos(mirrored.facing_yaw) == pytest.approx(1.0, abs=1e-3)
    # a post behind the plate on its west side: the plate faces east, whatever the rule
    pts, inten = _plate_cloud(-0.06)
    (sign,) = detect_signs(pts, inten, trajectory=east)
    assert math.cos(sign.facing_yaw) == pytest.approx(1.0, abs=1e-3)
    assert sign.confidence == 1.0
    # too high above the ground to be a sign plate
    assert detect_signs(pts, inten, settings=SignSettings(max_height_m=2.0)) == []


def test_sign_settings_and_inputs_are_checked() -> None:
    with pytest.raises(HdmapError, match="min_points"):
        SignSettings(min_points=1)
    with pytest.raises(HdmapError, match="one intensity per point"):
        detect_signs(np.zeros((5, 3)), np.zeros(4))
    with pytest.raises(HdmapError, match=r"\(n, 3\)"):
        detect_signs(np.zeros((5, 2)), np.zeros(5))
    assert detect_signs(np.zeros((0, 3)), np.zeros(0)) == []


def test_label_inputs_are_checked() -> None:
    grid = np.zeros((4, 4), dtype=np.float32)
    with pytest.raises(HdmapError, match="elevation has shape"):
        GridLayers((0.0, 0.0), 0.05, grid, np.zeros((4, 5), np.float32), np.zeros((4, 4), np.int32))
    with pytest.raises(HdmapError, match="resolution"):
        GridLayers((0.0, 0.0), 0.0, grid, grid, np.zeros((4, 4), np.int32))
    with pytest.raises(HdmapError, match="count must hold integers"):
        GridLayers((0.0, 0.0), 0.05, grid, grid, grid)
    with pytest.raises(HdmapError, match="paint_contrast"):
        LabelSettings(paint_contrast=0.5)
    with pytest.raises(HdmapError, match="lane_width_range_m"):
        LabelSettings(lane_width_range_m=(4.0, 3.0))
    layers = GridLayers((0.0, 0.0), 0.05, grid, grid, np.ones((4, 4), np.int32))
    one_pose = Trajectory(np.array([0], np.int64), np.eye(4)[None])
    with pytest.raises(HdmapError, match="at least two poses"):
        extract_lane_markings(layers, one_pose)


# -- the semantic map: GeoJSON, imports, merges --------------------------------------------


def _line(x0: float, x1: float, y: float, step: float = 0.5) -> np.ndarray:
    x = np.arange(x0, x1 + 1e-9, step)
    return np.column_stack([x, np.full_like(x, y), np.full_like(x, 1.0)])


def _small_map() -> SemanticMap:
    markings = (
        LaneMarking(_line(0, 50, -1.75), "solid", coverage=1.0, confidence=0.9, id="marking-0"),
        LaneMarking(_line(0, 50, 1.75), "dashed", coverage=0.35, id="marking-1"),
        LaneMarking(_line(0, 50, 5.25), "solid", id="marking-2"),  # coverage unknown (NaN)
    )
    lane = LaneCenterline(
        points=_line(0, 50, 0.0),
        left_boundary=_line(0, 50, 1.75),
        right_boundary=_line(0, 50, -1.75),
        left_marking="marking-1",
        right_marking="marking-0",
        direction="along",
        section=0,
        width_m=3.5,
        id="lane-0-0",
    )
    sign = TrafficSign(
        position=np.array([30.0, -4.0, 3.2]),
        facing_yaw=math.pi,
        width_m=0.75,
        height_m=0.75,
        height_above_ground_m=2.2,
        candidates=("stop", "yield"),
        confidence=0.8,
        point_count=120,
        id="sign-0",
    )
    return SemanticMap(
        markings=markings,
        centerlines=(lane,),
        reference_lines=(ReferenceLine(_line(0, 50, 1.75), id="reference-0"),),
        signs=(sign,),
        origin=ORIGIN,
    )


def test_geojson_round_trip(tmp_path: Path) -> None:
    smap = _small_map()
    path = Path(write_geojson(tmp_path / "semantic.geojson", smap))
    data = json.loads(path.read_text())
    assert data["type"] == "FeatureCollection"
    assert data["adcloud:frame"] == "map" and data["adcloud:units"] == "m"
    assert data["adcloud:origin"] == {
        "latitude_deg": 37.3875,
        "longitude_deg": -122.0575,
        "height_m": 12.0,
    }
    assert data["features"][2]["properties"]["coverage"] is None  # NaN is written as null
    back = read_geojson(path)
    assert back.counts() == smap.counts()
    assert back.origin == ORIGIN
    for a, b in zip(back.markings, smap.markings, strict=True):
        np.testing.assert_allclose(a.points, b.points, atol=1e-4)
        assert (a.type, a.id, a.source, a.color) == (b.type, b.id, b.source, b.color)
        assert a.coverage == pytest.approx(b.coverage, nan_ok=True)
    lane = back.centerlines[0]
    np.testing.assert_allclose(lane.left_boundary, smap.centerlines[0].left_boundary, atol=1e-4)
    assert (lane.left_marking, lane.direction, lane.section) == ("marking-1", "along", 0)
    sign = back.signs[0]
    np.testing.assert_allclose(sign.position, [30.0, -4.0, 3.2])
    assert sign.facing_yaw == pytest.approx(math.pi, abs=1e-6)
    assert (sign.type, sign.candidates, sign.point_count) == ("unknown", ("stop", "yield"), 120)
    assert back.reference_lines[0].id == "reference-0"


def test_truth_map_imports_as_external_labels(drive: Drive) -> None:
    """The synth truth file has this layout; its curbs and poles are kept as extras."""
    path = drive.truth / "map.geojson"
    with pytest.raises(
        MapFormatError, match=r"map\.geojson: feature 0 \(reference_line\): properties\.source"
    ):
        import_labels(path)
    labels = import_labels(path, default_source="external")
    kinds = [f["properties"]["kind"] for f in drive.truth_map["features"]]
    assert len(labels.markings) == kinds.count("lane_marking")
    assert len(labels.signs) == kinds.count("traffic_sign")
    assert len(labels.extras) == kinds.count("curb") + kinds.count("pole")
    assert labels.origin == ORIGIN
    marking = labels.markings[0]
    assert marking.source == "external" and marking.attributes["offset_m"] in (-3.5, 0.0, 3.5)
    assert {s.type for s in labels.signs} >= {"stop", "yield"}


def _write(tmp_path: Path, features: list[dict[str, Any]], **top: Any) -> Path:
    data = {
        "type": "FeatureCollection",
        "adcloud:frame": "map",
        "adcloud:units": "m",
        "adcloud:version": 1,
        "features": features,
        **top,
    }
    path = tmp_path / "labels.geojson"
    path.write_text(json.dumps(data))
    return path


def _marking_feature(
    coords: list[list[float]], source: str = "human", **props: Any
) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": {"type": "LineString", "coordinates": coords},
        "properties": {"kind": "lane_marking", "type": "solid", "source": source, **props},
    }


def _sign_feature(xyz: list[float], source: str = "human", **props: Any) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": xyz},
        "properties": {
            "kind": "traffic_sign",
            "type": "stop",
            "facing_yaw_rad": 3.14,
            "source": source,
            **props,
        },
    }


def test_human_labels_win_and_survive_rebuilds(tmp_path: Path) -> None:
    auto = _small_map()
    path = _write(
        tmp_path,
        [
            # a person redraws the first 20 m of marking-0 (2 D: no heights)
            _marking_feature([[0.0, -1.8], [20.0, -1.8]], id="fix-1", note="repainted"),
            # replaces the detected sign with its real type
            _sign_feature([30.2, -4.1, 3.1], id="stop-1"),
            # deletes the automatic reference line
            {
                "type": "Feature",
                "geometry": {"type": "LineString", "coordinates": [[0, 1.75], [50, 1.75]]},
                "properties": {"kind": "reference_line", "source": "human", "action": "delete"},
            },
            # an automatic feature in the label file is not imported
            _marking_feature([[0.0, 9.0], [9.0, 9.0]], source="auto"),
            # another system's crosswalk, kept as an extra
            {
                "type": "Feature",
                "geometry": {"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1], [0, 0]]]},
                "properties": {"kind": "crosswalk"},
                "id": "cw-7",
            },
        ],
        **{
            "adcloud:origin": {
                "latitude_deg": ORIGIN[0],
                "longitude_deg": ORIGIN[1],
                "height_m": ORIGIN[2],
            }
        },
    )
    labels = import_labels(path, default_source="external")
    assert [m.id for m in labels.markings] == ["fix-1"]
    assert labels.markings[0].attributes == {"note": "repainted"}
    assert np.isnan(labels.markings[0].points[:, 2]).all()
    merged = merge_labels(auto, labels)
    ids = sorted(m.id for m in merged.markings)
    # marking-0 keeps only its part beyond the human line (x > 20.5)
    assert ids == ["fix-1", "marking-0", "marking-1", "marking-2"]
    rest = next(m for m in merged.markings if m.id == "marking-0")
    assert rest.points[:, 0].min() > 20.0 and rest.points[:, 0].max() == 50.0
    assert [s.id for s in merged.signs] == ["stop-1"]
    assert merged.signs[0].type == "stop" and merged.signs[0].source == "human"
    assert merged.reference_lines == ()
    assert [e["id"] for e in merged.extras] == ["cw-7"]
    assert merged.extras[0]["properties"]["source"] == "external"
    # the next night: a new automatic map, the same label file -> the same human features
    auto2 = replace(auto, signs=(replace(auto.signs[0], position=np.array([30.1, -4.05, 3.2])),))
    again = merge_labels(auto2, import_labels(path, default_source="external"))
    assert [s.id for s in again.signs] == ["stop-1"]
    assert sorted(m.id for m in again.markings) == ids
    # and the merged map itself round-trips, keeping the human feature's extra property
    back = read_geojson(write_geojson(tmp_path / "merged.geojson", merged))
    fix = next(m for m in back.markings if m.id == "fix-1")
    assert fix.source == "human" and fix.attributes == {"note": "repainted"}


def test_human_beats_external_and_trim_keeps_long_runs(tmp_path: Path) -> None:
    auto = _small_map()
    external = SemanticMap(
        markings=(LaneMarking(_line(0, 50, 5.3), "solid", source="external", id="ext-edge"),),
        signs=(replace(auto.signs[0], source="external", id="ext-sign"),),
        origin=ORIGIN,
    )
    human = SemanticMap(
        markings=(LaneMarking(_line(10, 49, 5.25), "solid", source="human", id="hum-edge"),),
        origin=ORIGIN,
    )
    labels = SemanticMap(
        markings=external.markings + human.markings, signs=external.signs, origin=ORIGIN
    )
    merged = merge_labels(auto, labels, MergeSettings(min_remaining_m=2.0))
    ids = sorted(m.id for m in merged.markings)
    # the external edge keeps 0..9.5 m (>= 2 m) outside the human line; its tail past 49 m
    # is under 2 m and goes; the automatic edge line loses to both
    assert ids == ["ext-edge.1", "hum-edge", "marking-0", "marking-1"]
    ext = next(m for m in merged.markings if m.id == "ext-edge.1")
    assert ext.points[:, 0].max() < 10.0
    assert [s.id for s in merged.signs] == ["ext-sign"]
    with pytest.raises(HdmapError, match="origin"):
        merge_labels(auto, replace(labels, origin=(0.0, 0.0, 0.0)))
    with pytest.raises(HdmapError, match="source human or external"):
        merge_labels(auto, auto)


def _feature_texts(smap: SemanticMap) -> list[str]:
    return sorted(json.dumps(f, sort_keys=True) for f in smap.to_geojson()["features"])


def test_a_label_file_imported_over_kept_labels() -> None:
    def sign(x: float, source: str, fid: str) -> TrafficSign:
        return TrafficSign(np.array([x, -4.0, 3.0]), math.pi, 0.75, 0.75, source=source, id=fid)

    delete = LaneMarking(_line(0, 20, 5.25), source="human", id="", attributes={"action": "delete"})
    crosswalk = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [1.0, 2.0]},
        "properties": {"kind": "crosswalk", "source": "external"},
    }
    kept = SemanticMap(
        markings=(
            LaneMarking(_line(0, 50, -1.75), source="human", id="hum-line"),
            LaneMarking(_line(0, 50, 1.75), source="external", id="ext-line"),
            delete,
        ),
        signs=(sign(10, "human", "s1"), sign(30, "external", "s2")),
        extras=(crosswalk,),
        origin=ORIGIN,
    )
    # importing the same file again changes nothing, and its delete is kept
    assert _feature_texts(combine_labels(kept, kept)) == _feature_texts(kept)
    fresh = SemanticMap(
        markings=(
            # an external line over the human one does not replace it ...
            LaneMarking(_line(0, 50, -1.75), source="external", id="ext-over-human"),
            # ... a human line over the external one does, where they overlap
            LaneMarking(_line(0, 30, 1.75), source="human", id="hum-over-ext"),
        ),
        signs=(sign(40, "human", "s1"),),  # s1 moved: the id replaces the kept one
        extras=(dict(crosswalk),),
        origin=ORIGIN,
    )
    combined = combine_labels(kept, fresh, MergeSettings(min_remaining_m=2.0))
    assert sorted(m.id for m in combined.markings) == [
        "",  # the kept delete stays until a fresh label overlaps it
        "ext-line",  # its part beyond the fresh human line (30.5..50 m)
        "ext-over-human",
        "hum-line",
        "hum-over-ext",
    ]
    rest = next(m for m in combined.markings if m.id == "ext-line")
    assert rest.points[:, 0].min() > 30.0
    assert [(s.id, float(s.position[0])) for s in combined.signs] == [("s1", 40.0), ("s2", 30.0)]
    assert len(combined.extras) == 1  # the same crosswalk, not twice
    with pytest.raises(HdmapError, match="origin"):
        combine_labels(kept, replace(fresh, origin=(0.0, 0.0, 0.0)))


def test_label_files_without_ids_keep_each_others_labels(tmp_path: Path) -> None:
    """Features without ids in successive label files (imported as a build does: over the
    kept labels read back from their file) neither replace the labels of the files before
    nor undo their deletes; a file imported again changes nothing."""
    auto = _small_map()
    auto = replace(
        auto,
        signs=(
            *auto.signs,
            replace(auto.signs[0], position=np.array([70.4, 4.2, 2.0]), id="sign-1"),
        ),
    )

    def label_file(name: str, *features: dict[str, Any]) -> Path:
        for feature in features:
            del feature["properties"]["source"]  # another system's file: default external
        (tmp_path / name).mkdir()
        return _write(tmp_path / name, list(features))

    fixes = label_file("fixes", _sign_feature([10.0, 5.0, 2.2], facing_yaw_rad=1.57))
    delete = label_file("delete", _sign_feature([70.4, 4.2, 2.0], action="delete"))
    third = label_file("third", _sign_feature([-30.0, -20.0, 2.0], type="yield"))
    kept_file = tmp_path / "kept.geojson"

    def imported(path: Path) -> SemanticMap:
        fresh = import_labels(path, default_source="external")
        if kept_file.exists():
            fresh = combine_labels(import_labels(kept_file), fresh)
        write_geojson(kept_file, fresh)
        return import_labels(kept_file)

    def signs(kept: SemanticMap) -> list[tuple[float, float, str]]:
        merged = merge_labels(auto, kept)
        return sorted((float(s.position[0]), float(s.position[1]), s.type) for s in merged.signs)

    assert signs(imported(fixes)) == [
        (10.0, 5.0, "stop"),
        (30.0, -4.0, "unknown"),
        (70.4, 4.2, "unknown"),
    ]
    assert signs(imported(delete)) == [(10.0, 5.0, "stop"), (30.0, -4.0, "unknown")]
    kept = imported(third)
    assert signs(kept) == [(-30.0, -20.0, "yield"), (10.0, 5.0, "stop"), (30.0, -4.0, "unknown")]
    for path in (fixes, delete, third):
        again = combine_labels(kept, import_labels(path, default_source="external"))
        assert _feature_texts(again) == _feature_texts(kept)
    # ids come from the content: the same in every import, different between features
    ids = [s.id for s in kept.signs]
    assert len(set(ids)) == 3 and all(i.startswith("external-") for i in ids)
    assert import_labels(fixes, default_source="external").signs[0].id in ids
    twice = label_file("twice", _sign_feature([1.0, 1.0, 2.0]), _sign_feature([1.0, 1.0, 2.0]))
    first, second = (s.id for s in import_labels(twice, default_source="external").signs)
    assert second == f"{first}-2"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", r"labels\.geojson: not valid JSON \(line 1, column 2"),
        (json.dumps({"type": "Feature"}), "not a GeoJSON FeatureCollection"),
        (json.dumps({"type": "FeatureCollection", "features": []}), r'"adcloud:frame" is None'),
        (
            json.dumps(
                {
                    "type": "FeatureCollection",
                    "adcloud:frame": "map",
                    "adcloud:version": 2,
                    "features": [],
                }
            ),
            "reads version 1",
        ),
        (
            json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": {}}),
            '"features" must be a list',
        ),
    ],
)
def test_bad_label_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "labels.geojson"
    path.write_text(content)
    with pytest.raises(MapFormatError, match=message):
        import_labels(path)


def test_a_label_file_that_is_not_utf8_text_is_named(tmp_path: Path) -> None:
    # a binary or Latin-1 file raised a raw UnicodeDecodeError (a traceback from the CLI)
    path = tmp_path / "labels.geojson"
    path.write_bytes(b'{"type": "FeatureCollection", "name": "Stra\xdfe"}')
    with pytest.raises(MapFormatError, match=r"labels\.geojson: not a UTF-8 text file \(byte 43"):
        import_labels(path)
    with pytest.raises(MapFormatError, match="is a directory; give a GeoJSON label file"):
        import_labels(tmp_path)


@pytest.mark.parametrize(("kind", "said"), [(None, "missing"), (5, "5, not a kind's name")])
def test_a_label_feature_whose_kind_is_not_a_name_says_what_it_is(
    tmp_path: Path, kind: object, said: str
) -> None:
    # "kind": 5 was reported as "properties.kind is missing"
    props = {"type": "stop", "facing_yaw_rad": 0.5} | ({} if kind is None else {"kind": kind})
    feature = {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": [1.0, 2.0, 2.0]},
        "properties": props,
    }
    path = tmp_path / "labels.geojson"
    path.write_text(
        json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": [feature]})
    )
    with pytest.raises(MapFormatError, match=f"feature 0: properties.kind is {said};"):
        import_labels(path, default_source="human")


def test_a_label_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "labels.geojson"
    text = json.dumps({"type": "FeatureCollection", "adcloud:frame": "map", "features": []})
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert len(import_labels(path)) == 0


@pytest.mark.parametrize(
    ("feature", "message"),
    [
        (
            _sign_feature([1.0, 2.0, 3.0], facing_yaw_rad=None),
            r"feature 1 \(traffic_sign\): properties\.facing_yaw_rad is required",
        ),
        (
            _sign_feature([1.0, 2.0]),
            r"feature 1 \(traffic_sign\): a traffic sign needs \[x, y, z\]",
        ),
        (
            {
                **_marking_feature([[0.0, 0.0], [1.0, 0.0]]),
                "geometry": {"type": "Point", "coordinates": [0, 0]},
            },
            r"feature 1 \(lane_marking\): geometry must be a LineString, got Point",
        ),
        (
            _marking_feature([[0.0, 0.0], ["a", 0.0]]),
            r"coordinates\[1\] must be \[x, y\] or \[x, y, z\]",
        ),
        (_marking_feature([[0.0, 0.0]]), "at least 2 positions"),
        (_marking_feature([[0.0, 0.0], [1.0, 0.0]], type="zigzag"), "properties.type is 'zigzag'"),
        (
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], type="dashd"),
            r"properties\.type is 'dashd' \(did you mean 'dashed'\?\)",
        ),
        # a number JSON cannot hold, which the map's outputs would write as nan and null
        (
            _sign_feature([1.0, 2.0, 3.0], facing_yaw_rad=math.nan),
            r"feature 1 \(traffic_sign\): properties\.facing_yaw_rad is nan; every number in "
            "the file must be finite",
        ),
        (
            _sign_feature([1.0, 2.0, 3.0], width_m=-math.inf),
            r"properties\.width_m is -inf; every number",
        ),
        (
            _marking_feature([[0.0, 0.0, 0.0], [1.0, 0.0, math.nan]]),
            r"feature 1 \(lane_marking\): geometry\.coordinates\[1\]\[2\] is nan",
        ),
        (
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], survey={"dz": [0.1, math.inf]}),
            r"properties\.survey\.dz\[1\] is inf",
        ),
        # a misspelt delete would add the feature; an unknown sign type would be published
        (
            _sign_feature([1.0, 2.0, 3.0], action="remove"),
            r"properties\.action is 'remove'; the only action is \"delete\"",
        ),
        (
            _sign_feature([1.0, 2.0, 3.0], action="delet"),
            r"properties\.action is 'delet' \(did you mean 'delete'\?\)",
        ),
        (
            _sign_feature([1.0, 2.0, 3.0], type="stopp"),
            r"feature 1 \(traffic_sign\): properties\.type is 'stopp' \(did you mean 'stop'\?\); "
            "the sign types are unknown, stop, yield",
        ),
        (
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], source="robot"),
            "properties.source is 'robot'",
        ),
        # a misspelt direction used to be kept (and read as along); shares and sizes are checked
        (
            {
                "type": "Feature",
                "geometry": {"type": "LineString", "coordinates": [[0.0, 0.0], [1.0, 0.0]]},
                "properties": {
                    "kind": "lane_centerline",
                    "source": "human",
                    "section": 3,
                    "direction": "agains",
                },
            },
            r"feature 1 \(lane_centerline\): properties\.direction is 'agains' \(did you mean "
            r"'against'\?\); a lane of a section \(properties\.section 3\) runs along or against",
        ),
        (
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], confidence=1.5),
            r"properties\.confidence must be a share from 0 to 1, got 1\.5",
        ),
        (
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], coverage=-0.1),
            r"properties\.coverage must be a share from 0 to 1",
        ),
        (
            _sign_feature([1.0, 2.0, 3.0], width_m=-0.6),
            r"feature 1 \(traffic_sign\): properties\.width_m must be a size in metres, 0 or more",
        ),
        (
            {"type": "Feature", "geometry": None, "properties": {"source": "human"}},
            r"feature 1: properties\.kind is missing",
        ),
        ([1, 2], "feature 1: must be an object"),
    ],
)
def test_bad_features_are_named(tmp_path: Path, feature: Any, message: str) -> None:
    good = _marking_feature([[0.0, 0.0], [1.0, 0.0]])
    path = _write(tmp_path, [good, feature])
    with pytest.raises(MapFormatError, match=message) as info:
        import_labels(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "place"),
    [
        ("1e400", "properties.facing_yaw_rad is inf"),  # Python's JSON reader: infinity
        ("NaN", "properties.facing_yaw_rad is nan"),
        ("-Infinity", "properties.facing_yaw_rad is -inf"),
        ("1" + "0" * 400, "properties.facing_yaw_rad is an integer too large"),
    ],
)
def test_numbers_json_reads_as_non_finite_are_refused(
    tmp_path: Path, text: str, place: str
) -> None:
    """A label file's ``facing_yaw_rad`` of NaN or 1e400 went into the map: its
    lanelet2_map.osm got ``lat="-nan"`` nodes and its kept labels a null yaw, which every
    later build then failed to read. It is refused when the file is read, naming it."""
    sign = json.dumps(_sign_feature([1.0, 2.0, 3.0], facing_yaw_rad=0.5))
    feature = sign.replace('"facing_yaw_rad": 0.5', f'"facing_yaw_rad": {text}')
    path = tmp_path / "labels.geojson"
    path.write_text(
        '{"type": "FeatureCollection", "adcloud:frame": "map", "features": [' + feature + "]}"
    )
    with pytest.raises(MapFormatError, match=rf"feature 0 \(traffic_sign\): {place}") as info:
        import_labels(path)
    assert str(path) in str(info.value)
    origin = {"latitude_deg": 37.0, "longitude_deg": float("nan"), "height_m": 0.0}
    with pytest.raises(MapFormatError, match=r'"adcloud:origin" holds nan; .* finite'):
        import_labels(_write(tmp_path, [], **{"adcloud:origin": origin}))


def _centerline_feature(left: list[list[float]]) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": {"type": "LineString", "coordinates": [[0.0, 0.0], [10.0, 0.0]]},
        "properties": {"kind": "lane_centerline", "source": "human", "left_boundary": left},
    }


@pytest.mark.parametrize(
    ("feature", "place"),
    [
        (
            _marking_feature([[0.0, 0.0], [1e12, 0.0, 0.0]]),
            r"feature 1 \(lane_marking\): coordinates\[1\] is \[1e\+12, 0, 0\], beyond any map",
        ),
        (  # a UTM northing: a file in another frame
            _centerline_feature([[0.0, 1.0], [10.0, 5_400_000.0]]),
            r"feature 1 \(lane_centerline\): properties\.left_boundary\[1\] is \[10, 5\.4e\+06\]",
        ),
        (  # millimetres
            _sign_feature([1200.0, -300.0, 2_500_000.0]),
            r"feature 1 \(traffic_sign\): coordinates\[0\] is \[1200, -300, 2\.5e\+06\]",
        ),
        (
            {
                "type": "Feature",
                "geometry": {
                    "type": "Polygon",
                    "coordinates": [[[0.0, 0.0], [3.0, 0.0], [3.0, -2e9], [0.0, 0.0]]],
                },
                "properties": {"kind": "crosswalk", "source": "human"},
            },
            r"feature 1 \(crosswalk\): geometry\.coordinates\[2\] is \[3, -2e\+09\]",
        ),
    ],
)
def test_label_positions_no_map_frame_holds_are_refused(
    tmp_path: Path, feature: dict[str, Any], place: str
) -> None:
    """A label 1e12 m out (or in UTM, or in millimetres) was imported, and published in the
    map's semantic.geojson and lanelet2_map.osm as if it were a road. It is refused when
    the file is read, naming the file, the feature and the position."""
    path = _write(tmp_path, [_marking_feature([[0.0, 0.0], [1.0, 0.0]]), feature])
    with pytest.raises(MapFormatError, match=place) as info:
        import_labels(path)
    said = str(info.value)
    assert said.startswith(f"{path}: feature 1 (")
    assert "within 1000 km of it horizontally and 10 km vertically" in said
    # the map's own files, written by builds, are read as they are
    assert len(read_geojson(path)) == 2


def test_labels_beyond_the_reach_of_the_maps_drives_are_refused(tmp_path: Path) -> None:
    """Labels in another map's frame (here: 5 km east of the map's drives) were imported
    into the map, far from anything it holds; with the map's area they are refused, and a
    label beside the driven roads is not."""
    drives = LabelArea.around([[0.0, -5.0], [80.0, 40.0]], "the drives of version 000004")
    near = _sign_feature([-900.0, 20.0, 2.0])  # a road next to the driven ones
    far = _marking_feature([[70.0, 10.0, 0.0], [5_080.0, 10.0, 0.0]], id="line-7")
    path = _write(tmp_path, [near, far])
    assert len(import_labels(path)) == 2  # without the map's area: any map frame's position
    with pytest.raises(MapFormatError) as info:
        import_labels(path, area=drives)
    assert str(info.value) == (
        f"{path}: feature 1 (lane_marking): coordinates[1] (5080.0, 10.0) lies 5.0 km outside "
        "the drives of version 000004 (x 0..80 m, y -5..40 m); labels must lie within "
        "1000 m of the map's drives: is the file in another map's frame (another origin)?"
    )
    assert len(import_labels(_write(tmp_path, [near]), area=drives)) == 1
    with pytest.raises(HdmapError, match="no finite positions"):
        LabelArea.around(np.zeros((0, 2)), "no drives")


def test_a_feature_id_given_twice_in_a_label_file_is_refused(tmp_path: Path) -> None:
    """The second feature would silently replace the first where labels are combined."""
    path = _write(
        tmp_path,
        [
            _sign_feature([1.0, 2.0, 3.0], id="s1"),
            _marking_feature([[0.0, 0.0], [1.0, 0.0]], id="m1"),
            _sign_feature([9.0, 2.0, 3.0], id="s1"),
        ],
    )
    with pytest.raises(
        MapFormatError, match=r"feature 2 \(traffic_sign\): id 's1' is the id of feature 0 too"
    ) as info:
        import_labels(path)
    assert str(path) in str(info.value)


def test_the_sign_types_are_the_catalogues(tmp_path: Path) -> None:
    path = _write(tmp_path, [_sign_feature([1.0, 2.0, 3.0], type="give_way")])
    with pytest.raises(MapFormatError, match="'give_way'; the sign types are unknown, stop"):
        import_labels(path)
    assert import_labels(path, sign_types=["give_way"]).signs[0].type == "give_way"
    # the labels a map keeps were checked when they were imported
    assert import_labels(path, check=False).signs[0].type == "give_way"


def test_a_sign_to_delete_needs_no_facing(tmp_path: Path) -> None:
    """A delete is matched by its position alone (it removes the automatic sign within
    ``sign_overlap_m``), so it needs no ``facing_yaw_rad``; kept in the map's labels (the
    yaw written as null), it reads back and deletes on every rebuild."""
    auto = _small_map()
    sign = _sign_feature([30.1, -4.0, 3.0], action="delete", id="gone")
    del sign["properties"]["facing_yaw_rad"]
    labels = import_labels(_write(tmp_path, [sign]))
    assert math.isnan(labels.signs[0].facing_yaw)
    assert merge_labels(auto, labels).signs == ()
    kept = import_labels(write_geojson(tmp_path / "imported.json", labels), check=False)
    assert [s.id for s in kept.signs] == ["gone"] and merge_labels(auto, kept).signs == ()
    # a sign that is added still needs its facing (test_bad_features_are_named)


def test_parse_geojson_names_its_source() -> None:
    with pytest.raises(MapFormatError, match=r"^upload 7: "):
        parse_geojson({"type": "FeatureCollection"}, "upload 7")


def _clusters_by_all_pairs(xyz: np.ndarray, radius: float) -> list[np.ndarray]:
    """The reference: every pair of points within ``radius`` joined, components in order."""
    close = np.linalg.norm(xyz[:, None, :] - xyz[None, :, :], axis=2) <= radius
    _, labels = connected_components(sparse.csr_matrix(close), directed=False)
    order = np.argsort(labels, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(labels[order])) + 1)


@pytest.mark.parametrize("seed", range(12))
def test_sign_point_clusters_join_exactly_the_points_within_the_radius(seed: int) -> None:
    """Clusters built from cubes are those of all point pairs: on clouds of scattered,
    dense (a plate seen many times) and lattice points, whose distances hit the radius."""
    rng = np.random.default_rng(seed)
    radius = [0.3, 0.2, 0.1, 0.45][seed % 4]
    plate = rng.normal([2.0, 0.0, 2.0], [0.01, 0.2, 0.2], (150, 3))
    scattered = rng.uniform(0.0, 3.0, (120, 3))
    lattice = np.round(rng.uniform(0.0, 2.0, (100, 3)), 1)
    xyz = np.concatenate([plate, scattered, lattice])[rng.permutation(370)]
    got = _clusters(xyz, radius)
    expected = _clusters_by_all_pairs(xyz, radius)
    assert len(got) == len(expected) > 1
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert _clusters(np.zeros((0, 3)), radius) == []
