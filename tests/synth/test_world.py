"""The procedural world: determinism, road network, terrain, paint, curbs, objects."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.synth import Label, World, build_world
from adcloud.synth.roads import (
    CURB_HEIGHT_M,
    DASH_GAP_M,
    DASH_PAINT_M,
    LANE_WIDTH_M,
    MARKING_WIDTH_M,
    PAVED_HALF_WIDTH_M,
    PIECE_KIND,
    PIECE_ROAD,
)
from adcloud.synth.world import BOX_CX, BOX_LABEL, CYL_LABEL, SIGN_HEIGHT, SIGN_TYPE, SIGN_TYPES


def _arrays(world: World) -> list[np.ndarray]:
    return [
        world.roads.pieces,
        world.roads.markings,
        world.terrain.waves,
        world.cylinders,
        world.boxes,
        world.spheres,
        world.movers,
        world.signs,
    ]


def test_same_seed_same_world(world: World) -> None:
    again = build_world(7)
    for a, b in zip(_arrays(world), _arrays(again), strict=True):
        np.testing.assert_array_equal(a, b)
    assert again.stops == world.stops


def test_different_seeds_different_worlds(world: World) -> None:
    other = build_world(8)
    assert other.roads.lengths != world.roads.lengths
    assert not np.array_equal(other.terrain.waves, world.terrain.waves)
    assert other.boxes.shape != world.boxes.shape or not np.array_equal(other.boxes, world.boxes)


def test_road_network_has_straights_curves_a_loop_and_intersections(world: World) -> None:
    kinds = world.roads.pieces[:, PIECE_KIND]
    assert (kinds == 0).sum() >= 4
    assert (kinds == 1).sum() >= 4
    assert world.roads.closed[0]
    # the loop is closed: its end meets its start
    x, y, _ = world.roads.point_at(0, np.array([0.0, world.roads.lengths[0] - 1e-9]))
    assert np.hypot(x[1] - x[0], y[1] - y[0]) < 1e-6
    crossings = world.roads.crossings(0)
    assert len(crossings) == 2  # the street crosses the loop twice: two four-way intersections
    assert len(world.stops) == 1  # the loop stops at its first intersection only
    assert set(world.roads.pieces[:, PIECE_ROAD].astype(int)) == {0, 1}


def test_terrain_has_real_slopes(world: World) -> None:
    s = np.linspace(0, world.roads.lengths[0], 2000, endpoint=False)
    x, y, _ = world.roads.point_at(0, s)
    gx, gy = world.terrain.gradient(x, y)
    slope = np.hypot(gx, gy)
    assert slope.max() > 0.02  # a few per cent somewhere on the route
    assert slope.max() <= world.max_slope
    z = world.terrain.height(x, y)
    assert z.max() - z.min() > 1.0
    # the bound holds everywhere (it drives the ray caster's bracketing)
    rng = np.random.default_rng(0)
    px, py = rng.uniform(-300, 300, (2, 20000))
    gx, gy = world.terrain.gradient(px, py)
    assert np.hypot(gx, gy).max() <= world.max_slope + 1e-9


def _sample(world: World, road: int, s: float, n: float) -> tuple[float, int, float]:
    x, y, _ = world.roads.point_at(road, np.array([s]), n)
    g = world.ground_surface(x, y)
    return float(g.height[0]), int(g.label[0]), float(g.reflectance[0])


def test_ground_classes_across_a_road(world: World) -> None:
    s = 0.5 * (
        world.roads.crossings(0)[0][1] + world.roads.crossings(0)[1][0]
    )  # between intersections
    s = s + 1.0 - (s % (DASH_PAINT_M + DASH_GAP_M))  # 1 m into a dash of the centre line
    centre = _sample(world, 0, s, 0.0)
    lane = _sample(world, 0, s, -LANE_WIDTH_M / 2)
    edge = _sample(world, 0, s, -LANE_WIDTH_M)
    curb = _sample(world, 0, s, -PAVED_HALF_WIDTH_M - 0.05)
    walk = _sample(world, 0, s, -PAVED_HALF_WIDTH_M - 1.5)
    grass = _sample(world, 0, s, -PAVED_HALF_WIDTH_M - 6.0)
    assert centre[1] == Label.LANE_MARKING
    assert lane[1] == Label.ROAD
    assert edge[1] == Label.LANE_MARKING
    assert curb[1] == Label.CURB
    assert walk[1] == Label.SIDEWALK
    assert grass[1] == Label.TERRAIN
    # paint is much brighter than asphalt; stripes are ~15 cm wide
    assert centre[2] > 4 * lane[2]
    assert _sample(world, 0, s, -LANE_WIDTH_M + MARKING_WIDTH_M)[1] == Label.ROAD
    # the curb is a 15 cm step up from the road
    x, y, _ = world.roads.point_at(
        0, np.array([s, s]), np.array([-PAVED_HALF_WIDTH_M + 0.01, -PAVED_HALF_WIDTH_M - 0.01])
    )
    z = world.ground_height(x, y)
    assert z[1] - z[0] == pytest.approx(CURB_HEIGHT_M, abs=0.01)


def test_centre_line_is_dashed_3_on_6(world: World) -> None:
    lo, hi = world.roads.crossings(0)[0][1] + 10, world.roads.crossings(0)[1][0] - 10
    s = np.arange(lo, hi, 0.05)
    x, y, _ = world.roads.point_at(0, s, 0.0)
    painted = world.ground_surface(x, y).label == Label.LANE_MARKING
    period = DASH_PAINT_M + DASH_GAP_M
    assert painted.mean() == pytest.approx(DASH_PAINT_M / period, abs=0.02)
    np.testing.assert_array_equal(painted, np.mod(s, period) < DASH_PAINT_M)


def test_no_paint_inside_intersections(world: World) -> None:
    s_in, s_out = world.roads.crossings(0)[0]
    s = np.linspace(s_in, s_out, 50)
    for n in (-LANE_WIDTH_M, 0.0, LANE_WIDTH_M):
        x, y, _ = world.roads.point_at(0, s, n)
        labels = world.ground_surface(x, y).label
        assert not (labels == Label.LANE_MARKING).any()
        assert (labels == Label.ROAD).all()


def test_objects_signs_and_vehicles(world: World) -> None:
    labels = set(world.cylinders[:, CYL_LABEL].astype(int)) | set(
        world.boxes[:, BOX_LABEL].astype(int)
    )
    assert {Label.POLE, Label.VEGETATION, Label.BUILDING, Label.SIGN, Label.VEHICLE} <= labels
    assert len(world.spheres) > 20
    types = {SIGN_TYPES[int(t)] for t in world.signs[:, SIGN_TYPE]}
    assert {"stop", "yield"} <= types
    assert ((world.signs[:, SIGN_HEIGHT] > 1.9) & (world.signs[:, SIGN_HEIGHT] < 2.7)).all()
    # nothing stands on the carriageway except vehicles
    fixed = world.boxes[world.boxes[:, BOX_LABEL] != Label.VEHICLE]
    d = world.roads.frame(fixed[:, BOX_CX], fixed[:, BOX_CX + 1]).distance
    assert (d > PAVED_HALF_WIDTH_M).all()
    # moving vehicles move
    a, b = world.mover_boxes(0.0), world.mover_boxes(2.0)
    assert len(a) >= 2
    assert (np.hypot(*(a[:, :2] - b[:, :2]).T) > 5).all()
