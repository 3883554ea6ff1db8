"""LiDAR sweeps: points on world surfaces within the noise, intensity, labels, motion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from adcloud.synth import DriveResult, Label, World, read_poses
from adcloud.synth.frames import quaternion_matrix
from adcloud.synth.labels import RANGE_NOISE_EXTRA_M
from adcloud.synth.roads import PAVED_HALF_WIDTH_M
from adcloud.synth.world import BOX_LABEL, CYL_LABEL
from tests.synth.conftest import SMALL

Reader = Callable[..., list[tuple[str, int, Any]]]
NS = 1_000_000_000
GROUND = [Label.ROAD, Label.LANE_MARKING, Label.SIDEWALK, Label.TERRAIN]
_TYPES = {7: "<f4", 4: "<u2", 2: "u1", 8: "<f8", 6: "<u4"}


def _points(msg: Any) -> np.ndarray:
    """The cloud as a structured array, laid out from the message's own PointField list."""
    dtype = np.dtype(
        {
            "names": [f.name for f in msg.fields],
            "formats": [_TYPES[f.datatype] for f in msg.fields],
            "offsets": [f.offset for f in msg.fields],
            "itemsize": msg.point_step,
        }
    )
    return np.frombuffer(np.asarray(msg.data, dtype=np.uint8).tobytes(), dtype=dtype)


@pytest.fixture(scope="module")
def sweeps(small_drive: DriveResult, read_bag: Reader) -> list[tuple[int, np.ndarray]]:
    return [(t, _points(m)) for _, t, m in read_bag(small_drive.bag, ["/lidar/points"])]


@pytest.fixture(scope="module")
def mount(small_drive: DriveResult, read_bag: Reader) -> tuple[np.ndarray, np.ndarray]:
    ((_, _, tf),) = read_bag(small_drive.bag, ["/tf_static"])
    (tr,) = [t for t in tf.transforms if t.child_frame_id == "lidar"]
    q = tr.transform.rotation
    v = tr.transform.translation
    return np.array([v.x, v.y, v.z]), quaternion_matrix(np.array([q.x, q.y, q.z, q.w]))


def _base_pose(
    truth: tuple[np.ndarray, np.ndarray, np.ndarray], t_ns: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """base_link pose at ``t_ns`` by interpolating the 100 Hz truth (nlerp for rotations)."""
    tt, xyz, quat = truth
    i = np.clip(np.searchsorted(tt, t_ns, side="right") - 1, 0, len(tt) - 2)
    w = ((t_ns - tt[i]) / (tt[i + 1] - tt[i]))[:, None]
    p = xyz[i] * (1 - w) + xyz[i + 1] * w
    q0, q1 = quat[i], quat[i + 1]
    q1 = np.where((np.sum(q0 * q1, axis=1) < 0)[:, None], -q1, q1)
    return p, quaternion_matrix(q0 * (1 - w) + q1 * w)


def _to_map(
    points: np.ndarray, stamp: int, truth: Any, mount: Any, deskew: bool = True
) -> np.ndarray:
    xyz = np.stack([points["x"], points["y"], points["z"]], axis=1).astype(np.float64)
    offsets = np.round(points["t"].astype(np.float64) * 1e9).astype(np.int64) if deskew else 0
    p, rot = _base_pose(truth, stamp + offsets + np.zeros(len(points), dtype=np.int64))
    local = mount[0] + xyz @ mount[1].T
    return np.asarray(p + np.einsum("nij,nj->ni", rot, local))


def _box_distance(p: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Unsigned distance from points ``(N, 3)`` to the surfaces of boxes ``(N, 9)``."""
    c, s = np.cos(boxes[:, 6]), np.sin(boxes[:, 6])
    d = p - boxes[:, :3]
    local = np.stack([c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1], d[:, 2]], axis=1)
    q = np.abs(local) - boxes[:, 3:6]
    outside = np.linalg.norm(np.maximum(q, 0), axis=1)
    inside = np.minimum(q.max(axis=1), 0)
    return np.asarray(np.abs(outside + inside))


def _surface_distance(world: World, p: np.ndarray, label: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Distance from each point to the nearest world surface of its own class (m)."""
    out = np.full(len(p), np.inf)
    ground = np.isin(label, GROUND)
    if ground.any():
        out[ground] = np.abs(p[ground, 2] - world.ground_height(p[ground, 0], p[ground, 1]))
        road_d = world.roads.distance(p[ground, 0], p[ground, 1])
        edge = np.abs(road_d - PAVED_HALF_WIDTH_M) < 0.15  # a point at the curb edge may be either
        out[np.nonzero(ground)[0][edge]] = 0.0
    curb = label == Label.CURB
    if curb.any():
        face = np.abs(world.roads.distance(p[curb, 0], p[curb, 1]) - PAVED_HALF_WIDTH_M)
        top = np.abs(p[curb, 2] - world.ground_height(p[curb, 0], p[curb, 1]))
        out[curb] = np.minimum(face, top)
    for lab in (Label.POLE, Label.VEGETATION):
        sel = np.nonzero(label == lab)[0]
        if not len(sel):
            continue
        cyl = world.cylinders[world.cylinders[:, CYL_LABEL] == lab]
        q = p[sel]
        radial = np.abs(
            np.hypot(q[:, None, 0] - cyl[None, :, 0], q[:, None, 1] - cyl[None, :, 1])
            - cyl[None, :, 4]
        )
        below = np.maximum(cyl[None, :, 2] - q[:, None, 2], 0) + np.maximum(
            q[:, None, 2] - cyl[None, :, 3], 0
        )
        cap = np.abs(q[:, None, 2] - cyl[None, :, 3]) + np.maximum(
            np.hypot(q[:, None, 0] - cyl[None, :, 0], q[:, None, 1] - cyl[None, :, 1])
            - cyl[None, :, 4],
            0,
        )
        best = np.minimum(np.hypot(radial, below), cap).min(axis=1)
        if lab == Label.VEGETATION:
            sph = world.spheres
            sd = np.abs(
                np.linalg.norm(q[:, None, :] - sph[None, :, :3], axis=2) - sph[None, :, 3]
            ).min(axis=1)
            best = np.minimum(best, sd)
        out[sel] = best
    for lab in (Label.BUILDING, Label.SIGN, Label.VEHICLE):
        sel = np.nonzero(label == lab)[0]
        if not len(sel):
            continue
        boxes = world.boxes[world.boxes[:, BOX_LABEL] == lab]
        best = np.full(len(sel), np.inf)
        for box in boxes:
            best = np.minimum(best, _box_distance(p[sel], np.broadcast_to(box, (len(sel), 9))))
        if lab == Label.VEHICLE:
            for k in range(len(world.movers)):
                moving = world.mover_boxes(t[sel], np.full(len(sel), k))
                best = np.minimum(best, _box_distance(p[sel], moving))
        out[sel] = best
    return out


def test_point_layout(
    sweeps: list[tuple[int, np.ndarray]], small_drive: DriveResult, read_bag: Reader
) -> None:
    (_, _, msg), *_ = read_bag(small_drive.bag, ["/lidar/points"])
    assert [(f.name, f.datatype, f.offset) for f in msg.fields] == [
        ("x", 7, 0),
        ("y", 7, 4),
        ("z", 7, 8),
        ("intensity", 7, 12),
        ("t", 7, 16),
        ("ring", 4, 20),
        ("label", 4, 22),
    ]
    assert (msg.height, msg.point_step, msg.is_dense, msg.is_bigendian) == (1, 24, True, False)
    period = 1 / SMALL.lidar_hz
    for _, pts in sweeps:
        assert pts["t"].max() < 0
        assert pts["t"].min() >= -period - 1e-6
        assert pts["ring"].max() < SMALL.lidar_beams
        assert set(np.unique(pts["label"]).tolist()) <= {int(v) for v in Label} - {0}
        assert (
            0.3 * SMALL.lidar_beams * SMALL.lidar_columns
            < len(pts)
            < SMALL.lidar_beams * SMALL.lidar_columns
        )


def test_points_lie_on_world_surfaces_within_the_noise(
    world: World, sweeps: list[tuple[int, np.ndarray]], small_drive: DriveResult, mount: Any
) -> None:
    truth = read_poses(small_drive.truth)
    checked = 0
    for stamp, pts in sweeps[::3]:
        p = _to_map(pts, stamp, truth, mount)
        t_rel = (stamp - SMALL.start_time_ns) / NS + pts["t"].astype(np.float64)
        label = pts["label"].astype(np.int64)
        dist = _surface_distance(world, p, label, t_rel)
        sigma = np.sqrt(
            SMALL.lidar_range_noise_m**2 + RANGE_NOISE_EXTRA_M[label].astype(np.float64) ** 2
        )
        within = dist <= 5 * sigma + 0.002
        assert within.mean() >= 0.998, (
            stamp,
            within.mean(),
            np.unique(label[~within], return_counts=True),
        )
        assert (dist <= 10 * sigma + 0.01).all()
        checked += len(pts)
    assert checked > 50_000


def test_the_motion_of_the_car_is_in_each_sweep(
    world: World, sweeps: list[tuple[int, np.ndarray]], small_drive: DriveResult, mount: Any
) -> None:
    """Ignoring the per-point time (one pose for the whole sweep) puts points off the surfaces."""
    truth = read_poses(small_drive.truth)
    stamp, pts = sweeps[len(sweeps) // 2]
    label = pts["label"].astype(np.int64)
    t_rel = (stamp - SMALL.start_time_ns) / NS + pts["t"].astype(np.float64)
    sigma = np.sqrt(
        SMALL.lidar_range_noise_m**2 + RANGE_NOISE_EXTRA_M[label].astype(np.float64) ** 2
    )
    right = _to_map(pts, stamp, truth, mount)
    skewed = _to_map(pts, stamp, truth, mount, deskew=False)
    assert np.hypot(*(skewed[:, :2] - right[:, :2]).T).max() > 0.5  # ~1 m of travel per sweep
    ok_right = (_surface_distance(world, right, label, t_rel) <= 5 * sigma + 0.002).mean()
    ok_skewed = (_surface_distance(world, skewed, label, t_rel) <= 5 * sigma + 0.002).mean()
    assert ok_right >= 0.998
    assert ok_skewed < 0.9


def test_lane_paint_is_brighter_than_asphalt(sweeps: list[tuple[int, np.ndarray]]) -> None:
    pts = np.concatenate([p for _, p in sweeps])
    paint = pts["intensity"][pts["label"] == Label.LANE_MARKING]
    road = pts["intensity"][pts["label"] == Label.ROAD]
    signs = pts["intensity"][pts["label"] == Label.SIGN]
    assert len(paint) > 200
    assert np.median(paint) > 3 * np.median(road)
    assert np.percentile(paint, 10) > np.percentile(road, 90)
    if len(signs):
        assert np.median(signs) > np.median(road)
    for lab in (
        Label.ROAD,
        Label.SIDEWALK,
        Label.TERRAIN,
        Label.BUILDING,
        Label.VEGETATION,
        Label.POLE,
    ):
        assert (pts["label"] == lab).any(), lab
