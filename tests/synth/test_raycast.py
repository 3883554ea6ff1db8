"""The vectorized ray caster against analytic cases and the naive per-ray caster."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.synth import Label, World
from adcloud.synth._naive import cast_ray_naive
from adcloud.synth.raycast import Hits, cast_rays
from adcloud.synth.roads import CURB_HEIGHT_M, PAVED_HALF_WIDTH_M
from adcloud.synth.world import BOX_LABEL, CYL_LABEL, CYL_R, CYL_Z0, CYL_Z1

GROUND = {Label.ROAD, Label.LANE_MARKING, Label.CURB, Label.SIDEWALK, Label.TERRAIN}


def _cast(
    world: World, o: np.ndarray, d: np.ndarray, t: float = 0.0, max_range: float = 150.0
) -> Hits:
    o = np.atleast_2d(o).astype(np.float64)
    d = np.atleast_2d(d).astype(np.float64)
    d = d / np.linalg.norm(d, axis=1, keepdims=True)
    o = np.broadcast_to(o, d.shape)
    return cast_rays(
        world, o, d, np.full(len(d), t), max_range=max_range, bins=np.arange(len(d)) // 16
    )


def test_straight_down_hits_the_ground_at_its_height(world: World) -> None:
    x, y, _ = world.roads.point_at(
        0, np.linspace(0, world.roads.lengths[0], 40, endpoint=False), -1.75
    )
    z = world.ground_height(x, y)
    o = np.stack([x, y, z + 2.0], axis=1)
    hits = _cast(world, o, np.tile([0.0, 0.0, -1.0], (len(o), 1)))
    np.testing.assert_allclose(hits.range, 2.0, atol=2e-3)
    assert set(hits.label.tolist()) <= {Label.ROAD, Label.LANE_MARKING}
    np.testing.assert_allclose(hits.normal[:, 2], 1.0, atol=0.01)


def test_horizontal_ray_hits_a_pole_at_its_radius(world: World) -> None:
    pole = world.cylinders[world.cylinders[:, CYL_LABEL] == Label.POLE][0]
    x, y = pole[0], pole[1]
    z = 0.5 * (pole[CYL_Z0] + pole[CYL_Z1])
    angles = np.linspace(0, 2 * np.pi, 12, endpoint=False)
    o = np.stack([x + 5 * np.cos(angles), y + 5 * np.sin(angles), np.full(12, z)], axis=1)
    hits = _cast(world, o, -(o - [x, y, z]))
    # a tree or sign may stand between: every ray hits something within 5 m - r, most the pole
    assert (hits.range <= 5 - pole[CYL_R] + 1e-3).all()
    on_pole = hits.label == Label.POLE
    assert on_pole.sum() >= 9
    np.testing.assert_allclose(hits.range[on_pole], 5 - pole[CYL_R], atol=1e-3)


def test_box_faces(world: World) -> None:
    building = world.boxes[world.boxes[:, BOX_LABEL] == Label.BUILDING][0]
    cx, cy, cz, hx, _hy, _hz, yaw = building[:7]
    ax = np.array([np.cos(yaw), np.sin(yaw), 0.0])
    o = np.array([cx, cy, cz]) + ax * (hx + 3.0)
    hits = _cast(world, o, -ax)
    assert hits.label[0] == Label.BUILDING
    assert hits.range[0] == pytest.approx(3.0, abs=1e-3)
    np.testing.assert_allclose(hits.normal[0], ax, atol=1e-4)


def test_rays_into_the_sky_miss(world: World) -> None:
    o = np.array([[0.0, 0.0, 50.0]])
    hits = _cast(world, o, np.array([[0.1, 0.2, 1.0], [0.0, 0.0, 1.0]]))
    assert np.isinf(hits.range).all()
    assert (hits.label == Label.UNLABELED).all()


def test_curb_face_is_hit_from_the_road(world: World) -> None:
    s = 0.5 * (world.roads.crossings(0)[0][1] + world.roads.crossings(0)[1][0])  # no intersection
    x, y, heading = world.roads.point_at(0, np.array([s]), -1.0)
    left = np.array([-np.sin(heading[0]), np.cos(heading[0]), 0.0])
    z = float(world.ground_height(x, y)[0])
    o = np.array([x[0], y[0], z + 0.07])
    # a nearly level ray towards the right curb (3 m away) strikes its face
    hits = _cast(world, o, -left + [0, 0, -0.002])
    assert hits.label[0] == Label.CURB
    assert hits.range[0] == pytest.approx(PAVED_HALF_WIDTH_M - 1.0, abs=0.02)
    assert abs(hits.normal[0, 2]) < 1e-3
    assert CURB_HEIGHT_M > 0.07


def test_matches_the_naive_caster_on_lidar_like_rays(world: World) -> None:
    rng = np.random.default_rng(5)
    x, y, _ = world.roads.point_at(0, rng.uniform(0, world.roads.lengths[0], 3), -1.75)
    rays = []
    for px, py in zip(x, y, strict=True):
        pz = float(world.ground_height(np.array([px]), np.array([py]))[0]) + 1.9
        az = rng.uniform(-np.pi, np.pi, 60)
        el = rng.uniform(np.radians(-25), np.radians(12), 60)
        d = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], axis=1)
        rays += [(np.array([px, py, pz]), di) for di in d]
    o = np.array([r[0] for r in rays])
    d = np.array([r[1] for r in rays])
    fast = cast_rays(
        world, o, d, np.full(len(d), 1.0), max_range=100.0, bins=np.arange(len(d)) // 4
    )
    naive = [
        cast_ray_naive(world, oi, di, 1.0, max_range=100.0, step=0.1)
        for oi, di in zip(o, d, strict=True)
    ]
    r_naive = np.array([r for r, _ in naive])
    l_naive = np.array([lab for _, lab in naive])
    both = np.isfinite(r_naive) & np.isfinite(fast.range)
    agree_hit = np.isfinite(r_naive) == np.isfinite(fast.range)
    close = np.abs(r_naive[both] - fast.range[both]) < 0.01
    assert agree_hit.mean() >= 0.98, agree_hit.mean()
    assert close.mean() >= 0.98, close.mean()
    # same surface class: the naive caster reports -1 for any ground
    same = np.where(
        l_naive[both] == -1,
        np.isin(fast.label[both], list(GROUND)),
        l_naive[both] == fast.label[both],
    )
    assert same.mean() >= 0.98
    assert both.sum() > 100


def test_moving_vehicles_are_hit_where_they_are_at_the_ray_time(world: World) -> None:
    t = 3.0
    car = world.mover_boxes(t)[0]
    cx, cy, cz, _hx, hy = car[:5]
    yaw = car[6]
    side = np.array([-np.sin(yaw), np.cos(yaw), 0.0])
    o = np.array([cx, cy, cz]) + side * (hy + 2.0)
    hit_now = _cast(world, o, -side, t=t)
    assert hit_now.label[0] == Label.VEHICLE
    assert hit_now.range[0] == pytest.approx(2.0, abs=1e-3)
    later = _cast(world, o, -side, t=t + 2.0)
    assert later.label[0] != Label.VEHICLE or later.range[0] > 2.5
