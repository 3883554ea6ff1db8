"""The procedural world: terrain, roads, and everything standing on them, as plain arrays.

A :class:`World` is data only -- NumPy arrays of primitives whose columns are named by
the ``CYL_*``, ``BOX_*``, ``SPH_*`` and ``MOV_*`` constants -- so the NumPy ray caster
(:mod:`adcloud.synth.raycast`) and a future OpenCL kernel read the same description.
Everything is in the map frame (ENU, metres, z up); times are seconds since the drive
start.

The ground is ``terrain(x, y)`` on the carriageway (within ``PAVED_HALF_WIDTH_M`` of a
road centre line) and ``terrain(x, y) + CURB_HEIGHT_M`` everywhere else (curb, sidewalk,
grass): a vertical curb face separates them.

:func:`build_world` makes a world from a seed; the same seed always gives the same world.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.labels import Label
from adcloud.synth.roads import (
    CURB_HEIGHT_M,
    CURB_TOP_M,
    LANE_WIDTH_M,
    PAVED_HALF_WIDTH_M,
    PIECE_KIND,
    PIECE_LEN,
    PIECE_P,
    PIECE_ROAD,
    PIECE_S0,
    SIDEWALK_WIDTH_M,
    RoadFrame,
    RoadNetwork,
    make_roads,
)
from adcloud.synth.terrain import Terrain, make_terrain

__all__ = [
    "SIGN_BACK_COLOR",
    "SIGN_FACE_COLORS",
    "SIGN_TYPES",
    "GroundSample",
    "World",
    "build_world",
]

FloatArray = NDArray[np.floating]

# Vertical cylinders: poles, sign posts, tree trunks.
CYL_X, CYL_Y, CYL_Z0, CYL_Z1, CYL_R, CYL_LABEL, CYL_REFL = range(7)
# Boxes rotated by yaw about z: buildings, walls, sign plates, parked vehicles.
BOX_CX, BOX_CY, BOX_CZ, BOX_HX, BOX_HY, BOX_HZ, BOX_YAW, BOX_LABEL, BOX_REFL = range(9)
# Spheres: tree canopies, bushes.
SPH_X, SPH_Y, SPH_Z, SPH_R, SPH_LABEL, SPH_REFL = range(6)
# Moving vehicles: boxes going back and forth along a straight street (see World.mover_boxes).
(
    MOV_X0,
    MOV_Y0,
    MOV_UX,
    MOV_UY,
    MOV_LEN,
    MOV_SPEED,
    MOV_PHASE,
    MOV_HX,
    MOV_HY,
    MOV_HZ,
    MOV_REFL,
) = range(11)
# Signs (truth): plate centre, facing yaw (plate normal), plate size, type, height above ground.
SIGN_X, SIGN_Y, SIGN_Z, SIGN_YAW, SIGN_W, SIGN_H, SIGN_TYPE, SIGN_HEIGHT = range(8)

#: Traffic-sign types; ``World.signs[:, SIGN_TYPE]`` indexes this tuple.
SIGN_TYPES = (
    "stop",
    "yield",
    "speed_limit_30",
    "speed_limit_50",
    "no_parking",
    "pedestrian_crossing",
)

#: The albedo (RGB, 0..1) the camera sees on each type's face (by :data:`SIGN_TYPES` index):
#: the synthetic stand-in for the printed face a real sign classifier reads, one hue per
#: type. The back of every plate is :data:`SIGN_BACK_COLOR` (grey, like bare sheet metal).
SIGN_FACE_COLORS: tuple[tuple[float, float, float], ...] = (
    (0.85, 0.12, 0.12),  # stop: red
    (0.90, 0.80, 0.10),  # yield: yellow
    (0.80, 0.15, 0.80),  # speed_limit_30: magenta
    (0.10, 0.75, 0.80),  # speed_limit_50: cyan
    (0.12, 0.25, 0.85),  # no_parking: blue
    (0.15, 0.70, 0.20),  # pedestrian_crossing: green
)
SIGN_BACK_COLOR = (0.45, 0.45, 0.45)

_CAR_HALF = (2.3, 0.95, 0.75)
_LANE_CENTRE = LANE_WIDTH_M / 2


@dataclass(frozen=True)
class GroundSample:
    """Ground height (m), label (uint8 :class:`Label`) and reflectance (0..1) at points."""

    height: FloatArray
    label: NDArray[np.uint8]
    reflectance: FloatArray


@dataclass(frozen=True)
class World:
    """A synthetic world (map frame, metres).  See the module docstring for the columns.

    ``stops`` are the arclengths on road 0 (the loop) of the stop lines the route's
    driving direction meets; ``bounds`` is ``(xmin, ymin, xmax, ymax)`` of the placed
    objects.
    """

    seed: int
    terrain: Terrain
    roads: RoadNetwork
    cylinders: NDArray[np.float64]
    boxes: NDArray[np.float64]
    spheres: NDArray[np.float64]
    movers: NDArray[np.float64]
    signs: NDArray[np.float64]
    stops: tuple[float, ...]
    bounds: tuple[float, float, float, float]

    @property
    def max_slope(self) -> float:
        """Bound of the terrain slope (rise over run)."""
        return self.terrain.max_slope

    def ground_height(self, x: FloatArray, y: FloatArray) -> FloatArray:
        """Height (m) of the ground surface at ``(x, y)``, curbs and sidewalks included."""
        frame = self.roads.frame(x, y)
        z = self.terrain.height(x, y)
        return np.where(frame.distance > PAVED_HALF_WIDTH_M, z + CURB_HEIGHT_M, z)

    def ground_surface(
        self,
        x: FloatArray,
        y: FloatArray,
        *,
        frame: RoadFrame | None = None,
        pieces: NDArray[np.intp] | None = None,
    ) -> GroundSample:
        """Height, label and reflectance of the ground seen from above at ``(x, y)``.

        ``pieces`` limits the road search (see :meth:`RoadNetwork.frame`).
        """
        if frame is None:
            frame = self.roads.frame(x, y, pieces)
        dt = frame.distance.dtype
        d = frame.distance
        z = self.terrain.height(np.asarray(x, dtype=dt), np.asarray(y, dtype=dt))
        raised = d > PAVED_HALF_WIDTH_M
        height = np.where(raised, z + dt.type(CURB_HEIGHT_M), z)
        painted, paint_refl = self.roads.paint(frame)
        tex = ground_texture(np.asarray(x, dtype=dt), np.asarray(y, dtype=dt))
        label = np.full(d.shape, Label.TERRAIN, dtype=np.uint8)
        refl = (0.2 + 0.05 * tex).astype(dt)
        side = d <= PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M
        label[side] = Label.SIDEWALK
        refl = np.where(side, (0.28 + 0.02 * tex).astype(dt), refl)
        curb = raised & (d <= PAVED_HALF_WIDTH_M + CURB_TOP_M)
        label[curb] = Label.CURB
        refl = np.where(curb, dt.type(0.32), refl)
        label[~raised] = Label.ROAD
        refl = np.where(~raised, (0.09 + 0.02 * tex).astype(dt), refl)
        paint = painted & ~raised
        label[paint] = Label.LANE_MARKING
        refl = np.where(paint, paint_refl, refl)
        return GroundSample(height, label, refl)

    def mover_boxes(
        self, t: float | FloatArray, index: NDArray[np.intp] | None = None
    ) -> NDArray[np.float64]:
        """Boxes (``BOX_*`` columns) of moving vehicles at times ``t`` (s since the start).

        With ``index`` (mover rows, same shape as ``t``) one box per ``(index, t)`` pair;
        without it, ``t`` must be a scalar and all movers are returned.  A mover drives
        its street's right-hand lane to the far end, turns and comes back.
        """
        if index is None:
            index = np.arange(len(self.movers))
            t = np.full(len(self.movers), float(np.asarray(t)))
        t = np.asarray(t, dtype=np.float64)
        m = self.movers[index]
        length = m[:, MOV_LEN]
        u = np.mod(m[:, MOV_PHASE] + m[:, MOV_SPEED] * t, 2 * length)
        forward = u < length
        along = np.where(forward, u, 2 * length - u)
        lane = np.where(forward, -_LANE_CENTRE, _LANE_CENTRE)
        cx = m[:, MOV_X0] + along * m[:, MOV_UX] - lane * m[:, MOV_UY]
        cy = m[:, MOV_Y0] + along * m[:, MOV_UY] + lane * m[:, MOV_UX]
        cz = self.terrain.height(cx, cy) + m[:, MOV_HZ]
        out = np.empty((len(m), 9))
        out[:, BOX_CX] = cx
        out[:, BOX_CY] = cy
        out[:, BOX_CZ] = cz
        out[:, BOX_HX] = m[:, MOV_HX]
        out[:, BOX_HY] = m[:, MOV_HY]
        out[:, BOX_HZ] = m[:, MOV_HZ]
        out[:, BOX_YAW] = np.arctan2(m[:, MOV_UY], m[:, MOV_UX])
        out[:, BOX_LABEL] = Label.VEHICLE
        out[:, BOX_REFL] = m[:, MOV_REFL]
        return out

    def summary(self) -> dict[str, object]:
        """Counts and sizes for ``world.json``."""
        return {
            "roads": [
                {"id": i, "name": name, "closed": closed, "length_m": round(length, 3)}
                for i, (name, closed, length) in enumerate(
                    zip(self.roads.names, self.roads.closed, self.roads.lengths, strict=True)
                )
            ],
            "cylinders": len(self.cylinders),
            "boxes": len(self.boxes),
            "spheres": len(self.spheres),
            "moving_vehicles": len(self.movers),
            "signs": len(self.signs),
            "max_slope": round(self.max_slope, 5),
            "bounds": [round(v, 3) for v in self.bounds],
        }


def ground_texture(x: FloatArray, y: FloatArray) -> FloatArray:
    """A cheap deterministic texture in [-1, 1] that varies over ~1--10 m."""
    return np.sin(0.73 * x + 1.31 * y) * np.sin(1.87 * x - 0.61 * y) * 0.7 + 0.3 * np.sin(
        0.21 * x - 0.17 * y
    )


class _Placer:
    """Collects primitives and rejects overlaps (bounding circles in the ground plane)."""

    def __init__(self, world_roads: RoadNetwork, terrain: Terrain) -> None:
        self.roads = world_roads
        self.terrain = terrain
        self.cyl: list[list[float]] = []
        self.box: list[list[float]] = []
        self.sph: list[list[float]] = []
        self.signs: list[list[float]] = []
        self.circles: list[tuple[float, float, float]] = []

    def ground(self, x: float, y: float) -> float:
        """Raised ground height (sidewalk/grass level) at a point off the road."""
        return float(self.terrain.height(np.array([x]), np.array([y]))[0]) + CURB_HEIGHT_M

    def free(self, x: float, y: float, radius: float) -> bool:
        return all(np.hypot(x - cx, y - cy) > radius + cr for cx, cy, cr in self.circles)

    def road_distance(self, x: FloatArray, y: FloatArray) -> FloatArray:
        return self.roads.frame(np.asarray(x, np.float64), np.asarray(y, np.float64)).distance

    def candidate(
        self,
        rng: np.random.Generator,
        bounds: tuple[float, float, float, float],
        near: tuple[float, float],
    ) -> tuple[float, float]:
        """A random point: 70 % of the time ``near[0]..near[1]`` m beside a road, else anywhere."""
        if rng.uniform() < 0.7:
            road = int(rng.integers(0, self.roads.road_count))
            s = rng.uniform(0, self.roads.lengths[road])
            n = float(rng.choice([-1.0, 1.0])) * rng.uniform(*near)
            x, y, _ = self.roads.point_at(road, np.array([s]), n)
            return float(x[0]), float(y[0])
        return rng.uniform(bounds[0], bounds[2]), rng.uniform(bounds[1], bounds[3])


def _add_pole(
    p: _Placer, x: float, y: float, height: float, radius: float, label: int, refl: float
) -> None:
    g = p.ground(x, y)
    p.cyl.append([x, y, g - 0.3, g + height, radius, label, refl])
    p.circles.append((x, y, radius + 0.3))


def _place_street_lights(p: _Placer, rng: np.random.Generator) -> None:
    for road in range(p.roads.road_count):
        length = p.roads.lengths[road]
        s = rng.uniform(0, 10.0)
        side = 1.0
        while s < length:
            n = side * (PAVED_HALF_WIDTH_M + 0.6)
            x, y, _ = p.roads.point_at(road, np.array([s]), n)
            frame = p.roads.frame(x, y)
            if (
                frame.other[0] > PAVED_HALF_WIDTH_M + 10
                and frame.distance[0] > PAVED_HALF_WIDTH_M + 0.3
            ):
                _add_pole(p, float(x[0]), float(y[0]), rng.uniform(6.5, 8.0), 0.12, Label.POLE, 0.4)
            s += rng.uniform(28.0, 40.0)
            side = -side


def _add_sign(
    p: _Placer,
    road: int,
    s: float,
    side: float,
    facing_back: bool,
    kind: int,
    rng: np.random.Generator,
) -> None:
    """A plate on a post beside ``road`` at ``s``; ``side`` -1 right / +1 left of +s."""
    n = side * (PAVED_HALF_WIDTH_M + 1.0)
    x, y, heading = p.roads.point_at(road, np.array([s]), n)
    xs, ys, h = float(x[0]), float(y[0]), float(heading[0])
    facing = h + np.pi if facing_back else h
    g = p.ground(xs, ys)
    height = rng.uniform(2.0, 2.6)
    width = 0.75 if SIGN_TYPES[kind] != "speed_limit_50" else 0.6
    plate_h = 0.75 if SIGN_TYPES[kind] != "speed_limit_50" else 0.8
    # the post stands 5 cm behind the plate
    px, py = xs - 0.05 * np.cos(facing), ys - 0.05 * np.sin(facing)
    p.cyl.append([px, py, g - 0.3, g + height, 0.035, Label.POLE, 0.35])
    p.box.append([xs, ys, g + height, 0.02, width / 2, plate_h / 2, facing, Label.SIGN, 0.9])
    p.signs.append([xs, ys, g + height, facing, width, plate_h, kind, height])
    p.circles.append((xs, ys, 0.6))


def _place_signs(p: _Placer, rng: np.random.Generator) -> tuple[float, ...]:
    stops: list[float] = []
    # The loop stops at its first intersection (both directions) and has the right of way
    # at the second; the cross street yields at both.
    for s_in, s_out in p.roads.crossings(0)[:1]:
        stop = s_in - 3.0
        stops.append(stop % p.roads.lengths[0])
        _add_sign(p, 0, s_in - 5.0, -1.0, True, SIGN_TYPES.index("stop"), rng)
        _add_sign(p, 0, s_out + 5.0, 1.0, False, SIGN_TYPES.index("stop"), rng)
    for s_in, s_out in p.roads.crossings(1):
        _add_sign(p, 1, s_in - 6.0, -1.0, True, SIGN_TYPES.index("yield"), rng)
        _add_sign(p, 1, s_out + 6.0, 1.0, False, SIGN_TYPES.index("yield"), rng)
    # A few more along the roads, away from intersections.
    others = [
        SIGN_TYPES.index(k)
        for k in ("speed_limit_30", "speed_limit_50", "no_parking", "pedestrian_crossing")
    ]
    placed = 0
    for _ in range(60):
        if placed >= 6:
            break
        road = int(rng.integers(0, p.roads.road_count))
        s = rng.uniform(0, p.roads.lengths[road])
        side = float(rng.choice([-1.0, 1.0]))
        x, y, _ = p.roads.point_at(road, np.array([s]), side * (PAVED_HALF_WIDTH_M + 1.0))
        frame = p.roads.frame(x, y)
        if frame.other[0] < PAVED_HALF_WIDTH_M + 12 or not p.free(float(x[0]), float(y[0]), 1.5):
            continue
        if frame.distance[0] < PAVED_HALF_WIDTH_M + 0.5:
            continue
        _add_sign(p, road, s, side, side < 0, int(rng.choice(others)), rng)
        placed += 1
    return tuple(sorted(stops))


def _footprint(
    cx: float, cy: float, hx: float, hy: float, yaw: float, k: int = 5
) -> tuple[FloatArray, FloatArray]:
    u = np.linspace(-1, 1, k)
    gx, gy = np.meshgrid(u * hx, u * hy)
    c, s = np.cos(yaw), np.sin(yaw)
    return cx + c * gx - s * gy, cy + s * gx + c * gy


def _place_buildings(
    p: _Placer, rng: np.random.Generator, bounds: tuple[float, float, float, float], yaw0: float
) -> None:
    placed = 0
    clearance = PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M + 3.0
    for _ in range(600):
        if placed >= 34:
            break
        cx, cy = p.candidate(rng, bounds, (clearance + 5.0, clearance + 25.0))
        hx = rng.uniform(5.0, 15.0)
        hy = rng.uniform(4.0, 11.0)
        yaw = yaw0 + rng.uniform(-0.15, 0.15)
        radius = float(np.hypot(hx, hy))
        if not p.free(cx, cy, radius + 2.0):
            continue
        fx, fy = _footprint(cx, cy, hx, hy, yaw)
        if np.min(p.road_distance(fx, fy)) < clearance:
            continue
        ground = p.terrain.height(fx, fy) + CURB_HEIGHT_M
        bottom = float(np.min(ground)) - 1.0
        top = float(np.max(ground)) + rng.uniform(4.0, 22.0)
        p.box.append(
            [
                cx,
                cy,
                (top + bottom) / 2,
                hx,
                hy,
                (top - bottom) / 2,
                yaw,
                Label.BUILDING,
                rng.uniform(0.25, 0.5),
            ]
        )
        p.circles.append((cx, cy, radius))
        placed += 1


def _place_walls(p: _Placer, rng: np.random.Generator) -> None:
    lines = [i for i, row in enumerate(p.roads.pieces) if row[PIECE_KIND] == 0]
    placed = 0
    for _ in range(80):
        if placed >= 6:
            break
        row = p.roads.pieces[int(rng.choice(lines))]
        road = int(row[PIECE_ROAD])
        length = rng.uniform(15.0, 40.0)
        s = row[PIECE_S0] + rng.uniform(0, max(1.0, row[PIECE_LEN] - length))
        n = float(rng.choice([-1.0, 1.0])) * rng.uniform(9.0, 12.0)
        xs, ys, hs = p.roads.point_at(road, np.array([s, s + length]), n)
        cx, cy = float(xs.mean()), float(ys.mean())
        yaw = float(hs[0])
        fx, fy = _footprint(cx, cy, length / 2, 0.15, yaw, k=9)
        if np.min(p.road_distance(fx, fy)) < PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M + 1.5:
            continue
        if not all(p.free(float(a), float(b), 0.5) for a, b in zip(fx[0], fy[0], strict=True)):
            continue
        ground = p.terrain.height(fx, fy) + CURB_HEIGHT_M
        bottom = float(np.min(ground)) - 0.5
        top = float(np.max(ground)) + rng.uniform(1.5, 2.5)
        p.box.append(
            [
                cx,
                cy,
                (top + bottom) / 2,
                length / 2,
                0.15,
                (top - bottom) / 2,
                yaw,
                Label.BUILDING,
                rng.uniform(0.3, 0.5),
            ]
        )
        for a, b in zip(fx[0], fy[0], strict=True):
            p.circles.append((float(a), float(b), 0.4))
        placed += 1


def _place_vegetation(
    p: _Placer, rng: np.random.Generator, bounds: tuple[float, float, float, float]
) -> None:
    trees = bushes = 0
    for _ in range(3000):
        if trees >= 80 and bushes >= 60:
            break
        x, y = p.candidate(rng, bounds, (7.0, 30.0))
        d = float(p.road_distance(np.array([x]), np.array([y]))[0])
        if trees < 80:
            canopy = rng.uniform(1.5, 3.0)
            if d < PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M + canopy + 0.5 or not p.free(x, y, canopy):
                continue
            g = p.ground(x, y)
            trunk_top = g + rng.uniform(2.0, 3.5)
            p.cyl.append(
                [x, y, g - 0.3, trunk_top, rng.uniform(0.12, 0.25), Label.VEGETATION, 0.22]
            )
            p.sph.append([x, y, trunk_top + 0.7 * canopy, canopy, Label.VEGETATION, 0.35])
            p.circles.append((x, y, canopy))
            trees += 1
        else:
            r = rng.uniform(0.4, 1.1)
            if d < PAVED_HALF_WIDTH_M + SIDEWALK_WIDTH_M + r + 0.5 or not p.free(x, y, r):
                continue
            p.sph.append([x, y, p.ground(x, y) - 0.3 * r, r, Label.VEGETATION, 0.3])
            p.circles.append((x, y, r))
            bushes += 1


def _place_parked(p: _Placer, rng: np.random.Generator) -> None:
    """Rows of parked cars on lots beside straight roads."""
    lines = [i for i, row in enumerate(p.roads.pieces) if row[PIECE_KIND] == 0]
    rows = 0
    for _ in range(60):
        if rows >= 3:
            break
        row = p.roads.pieces[int(rng.choice(lines))]
        road = int(row[PIECE_ROAD])
        count = int(rng.integers(2, 5))
        s = row[PIECE_S0] + rng.uniform(0, max(1.0, row[PIECE_LEN] - 3.0 * count))
        n = float(rng.choice([-1.0, 1.0])) * rng.uniform(11.0, 14.0)
        ss = s + 3.0 * np.arange(count)
        xs, ys, hs = p.roads.point_at(road, ss, n)
        if np.min(p.road_distance(xs, ys)) < 10.0:
            continue
        if not all(p.free(float(a), float(b), 2.5) for a, b in zip(xs, ys, strict=True)):
            continue
        for a, b, h in zip(xs, ys, hs, strict=True):
            # parked nose-in: the long axis across the road
            g = p.ground(float(a), float(b))
            p.box.append(
                [
                    float(a),
                    float(b),
                    g + _CAR_HALF[2],
                    _CAR_HALF[0],
                    _CAR_HALF[1],
                    _CAR_HALF[2],
                    float(h) + np.pi / 2,
                    Label.VEHICLE,
                    rng.uniform(0.2, 0.6),
                ]
            )
            p.circles.append((float(a), float(b), 2.5))
        rows += 1


def _movers(roads: RoadNetwork, rng: np.random.Generator) -> NDArray[np.float64]:
    """Two to three cars going back and forth on the cross street (road 1)."""
    row = roads.pieces[roads.pieces[:, PIECE_ROAD] == 1][0]
    p = row[PIECE_P:]
    margin = 5.0
    length = row[PIECE_LEN] - 2 * margin
    out = []
    for _ in range(int(rng.integers(2, 4))):
        out.append(
            [
                p[0] + margin * p[2],
                p[1] + margin * p[3],
                p[2],
                p[3],
                length,
                rng.uniform(6.0, 11.0),
                rng.uniform(0, 2 * length),
                *_CAR_HALF,
                rng.uniform(0.25, 0.6),
            ]
        )
    return np.asarray(out, dtype=np.float64)


def build_world(seed: int) -> World:
    """The world of ``seed``: a road loop with a crossing street on hilly terrain, with
    street lights, signs, buildings, walls, trees, bushes, parked and moving cars.

    Deterministic: the same seed gives an identical world; different seeds differ in the
    layout, the terrain and every object.
    """
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x57A1D]))
    roads = make_roads(rng.spawn(1)[0])
    terrain = make_terrain(rng.spawn(1)[0])
    corners = []
    for row in roads.pieces:
        p = row[PIECE_P:]
        if row[PIECE_KIND] == 0:
            corners += [(p[0], p[1]), (p[0] + p[2] * row[PIECE_LEN], p[1] + p[3] * row[PIECE_LEN])]
        else:
            corners += [(p[0] - p[2], p[1] - p[2]), (p[0] + p[2], p[1] + p[2])]
    xy = np.asarray(corners)
    margin = 60.0
    bounds = (
        float(xy[:, 0].min() - margin),
        float(xy[:, 1].min() - margin),
        float(xy[:, 0].max() + margin),
        float(xy[:, 1].max() + margin),
    )
    first = roads.pieces[0, PIECE_P:]
    yaw0 = float(np.arctan2(first[3], first[2]))
    placer = _Placer(roads, terrain)
    obj_rng = rng.spawn(1)[0]
    _place_street_lights(placer, obj_rng)
    stops = _place_signs(placer, obj_rng)
    _place_buildings(placer, obj_rng, bounds, yaw0)
    _place_walls(placer, obj_rng)
    _place_parked(placer, obj_rng)
    _place_vegetation(placer, obj_rng, bounds)
    return World(
        seed=int(seed),
        terrain=terrain,
        roads=roads,
        cylinders=np.asarray(placer.cyl, dtype=np.float64).reshape(-1, 7),
        boxes=np.asarray(placer.box, dtype=np.float64).reshape(-1, 9),
        spheres=np.asarray(placer.sph, dtype=np.float64).reshape(-1, 6),
        movers=_movers(roads, rng.spawn(1)[0]),
        signs=np.asarray(placer.signs, dtype=np.float64).reshape(-1, 8),
        stops=stops,
        bounds=bounds,
    )
