"""The road network: centre lines made of straight and circular pieces, lanes and paint.

Every road has two 3.5 m lanes (one per direction), a 0.5 m shoulder, a 0.15 m curb at
``|n| = PAVED_HALF_WIDTH_M`` and a 2.5 m sidewalk.  Positions along a road are given in
its Frenet coordinates: ``s`` (m along the centre line from its start) and ``n`` (m to
the left of the centre line, looking along ``s``).  Lane ``n = -1.75`` is driven along
``+s``, lane ``n = +1.75`` along ``-s`` (right-hand traffic).

Paint is defined analytically by :data:`MARKINGS` rows (offset, width, dash pattern), so
the LiDAR, the camera, the truth raster and the truth polylines all derive from the same
numbers.  Paint and curbs are interrupted where another road's carriageway crosses
(intersections).

The network is data only: :attr:`RoadNetwork.pieces` is a ``(P, 9)`` float64 array (see
``PIECE_*``), so a GPU kernel can evaluate it the same way as :meth:`RoadNetwork.frame`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CURB_HEIGHT_M",
    "CURB_TOP_M",
    "DASH_GAP_M",
    "DASH_PAINT_M",
    "INTERSECTION_CLEAR_M",
    "LANE_WIDTH_M",
    "MARKING_WIDTH_M",
    "PAVED_HALF_WIDTH_M",
    "SIDEWALK_WIDTH_M",
    "RoadFrame",
    "RoadNetwork",
    "make_roads",
]

LANE_WIDTH_M = 3.5
PAVED_HALF_WIDTH_M = 4.0
CURB_HEIGHT_M = 0.15
CURB_TOP_M = 0.15
SIDEWALK_WIDTH_M = 2.5
MARKING_WIDTH_M = 0.15
DASH_PAINT_M = 3.0
DASH_GAP_M = 6.0
#: Paint stops this far (m) outside the carriageway of a crossing road.
INTERSECTION_CLEAR_M = 1.0

# Columns of RoadNetwork.pieces.
PIECE_KIND = 0  # 0: line, 1: arc
PIECE_ROAD = 1
PIECE_S0 = 2  # arclength of the piece start along its road
PIECE_LEN = 3
# line: x0, y0, ux, uy ; arc: cx, cy, radius, theta0 (start angle), dtheta (signed sweep)
PIECE_P = 4

# Columns of RoadNetwork.markings.
MARK_ROAD = 0
MARK_OFFSET = 1  # n of the stripe centre (m)
MARK_WIDTH = 2
MARK_DASHED = 3  # 0 solid, 1 dashed (DASH_PAINT_M paint, DASH_GAP_M gap, from s = 0)
MARK_REFLECTANCE = 4

FloatArray = NDArray[np.floating]


@dataclass(frozen=True)
class RoadFrame:
    """Where points lie relative to the network (arrays shaped like the query).

    ``distance``: m to the nearest centre line; ``n``/``s``: Frenet coordinates on it;
    ``road``: its road id; ``other``: m to the nearest centre line of any *other* road
    (``inf`` with one road).
    """

    distance: FloatArray
    n: FloatArray
    s: FloatArray
    road: NDArray[np.int16]
    other: FloatArray


@dataclass(frozen=True)
class RoadNetwork:
    """Roads as pieces (``(P, 9)``), paint as markings (``(M, 5)``) and a road table.

    ``closed[r]`` says whether road ``r`` is a loop; ``lengths[r]`` is its length (m).
    """

    pieces: NDArray[np.float64]
    markings: NDArray[np.float64]
    closed: tuple[bool, ...]
    lengths: tuple[float, ...]
    names: tuple[str, ...]

    @property
    def road_count(self) -> int:
        """Number of roads."""
        return len(self.lengths)

    def frame(
        self, x: FloatArray, y: FloatArray, pieces: NDArray[np.intp] | None = None
    ) -> RoadFrame:
        """Frenet frame of points ``(x, y)`` (map frame, m) on the nearest road.

        ``pieces`` restricts the search to those piece indexes (a caller that knows the
        others are farther than any distance it cares about); the dtype of ``x`` is kept.
        """
        dt = np.result_type(x, np.float32)
        x = np.asarray(x, dtype=dt)
        y = np.asarray(y, dtype=dt)
        big = dt.type(np.inf)
        best = np.full(x.shape, big, dtype=dt)
        n_best = np.zeros(x.shape, dtype=dt)
        s_best = np.zeros(x.shape, dtype=dt)
        road_best = np.full(x.shape, -1, dtype=np.int16)
        per_road = np.full((self.road_count, *x.shape), big, dtype=dt)
        rows = range(len(self.pieces)) if pieces is None else pieces
        for i in rows:
            row = self.pieces[i]
            road = int(row[PIECE_ROAD])
            d, n, s = _piece_frame(row, x, y, dt)
            closer = d < best
            best = np.where(closer, d, best)
            n_best = np.where(closer, n, n_best)
            s_best = np.where(closer, s + dt.type(row[PIECE_S0]), s_best)
            road_best = np.where(closer, np.int16(road), road_best)
            np.minimum(per_road[road], d, out=per_road[road])
        own = np.arange(self.road_count, dtype=np.int16).reshape(-1, *([1] * x.ndim)) == road_best
        other = np.where(own, big, per_road).min(axis=0)
        return RoadFrame(best, n_best, s_best, road_best, other)

    def distance(self, x: FloatArray, y: FloatArray) -> FloatArray:
        """Distance (m) from points ``(x, y)`` to the nearest road centre line (dtype kept)."""
        dt = np.result_type(x, np.float32)
        x = np.asarray(x, dtype=dt)
        y = np.asarray(y, dtype=dt)
        best = np.full(x.shape, np.inf, dtype=dt)
        for row in self.pieces:
            np.minimum(best, _piece_distance(row, x, y, dt), out=best)
        return best

    def pieces_near(
        self, bounds: tuple[float, float, float, float], margin: float
    ) -> NDArray[np.intp]:
        """Indexes of pieces that come within ``margin`` (m) of the box ``(x0, y0, x1, y1)``."""
        keep = []
        for i, row in enumerate(self.pieces):
            bx0, by0, bx1, by1 = _piece_bounds(row)
            if (
                bx0 - margin <= bounds[2]
                and bx1 + margin >= bounds[0]
                and by0 - margin <= bounds[3]
                and by1 + margin >= bounds[1]
            ):
                keep.append(i)
        return np.asarray(keep, dtype=np.intp)

    def paint(self, frame: RoadFrame) -> tuple[NDArray[np.bool_], FloatArray]:
        """Which points of ``frame`` are painted, and the paint reflectance there (else 0)."""
        dt = frame.n.dtype
        painted = np.zeros(frame.n.shape, dtype=bool)
        refl = np.zeros(frame.n.shape, dtype=dt)
        clear = frame.other > PAVED_HALF_WIDTH_M + INTERSECTION_CLEAR_M
        period = DASH_PAINT_M + DASH_GAP_M
        for row in self.markings:
            on = (frame.road == int(row[MARK_ROAD])) & (
                np.abs(frame.n - dt.type(row[MARK_OFFSET])) <= dt.type(row[MARK_WIDTH] / 2)
            )
            if row[MARK_DASHED]:
                on &= np.mod(frame.s, dt.type(period)) < dt.type(DASH_PAINT_M)
            on &= clear
            painted |= on
            refl = np.where(on, dt.type(row[MARK_REFLECTANCE]), refl)
        return painted, refl

    def point_at(
        self, road: int, s: FloatArray, n: float | FloatArray = 0.0
    ) -> tuple[FloatArray, FloatArray, FloatArray]:
        """Map-frame ``x, y`` and heading (rad) of Frenet point ``(s, n)`` on ``road``.

        ``s`` is wrapped on closed roads and clamped to ``[0, length]`` on open ones.
        """
        s = np.asarray(s, dtype=np.float64)
        length = self.lengths[road]
        s = np.mod(s, length) if self.closed[road] else np.clip(s, 0.0, length)
        x = np.zeros_like(s)
        y = np.zeros_like(s)
        h = np.zeros_like(s)
        n_arr = np.broadcast_to(np.asarray(n, dtype=np.float64), s.shape)
        for row in self.pieces[self.pieces[:, PIECE_ROAD] == road]:
            s0, ln = row[PIECE_S0], row[PIECE_LEN]
            sel = (s >= s0) & (s <= s0 + ln)
            ls = s[sel] - s0
            nn = n_arr[sel]
            p = row[PIECE_P:]
            if row[PIECE_KIND] == 0:
                heading = np.full(ls.shape, np.arctan2(p[3], p[2]))
                cx = p[0] + ls * p[2]
                cy = p[1] + ls * p[3]
            else:
                sign = np.sign(p[4])
                ang = p[3] + sign * ls / p[2]
                cx = p[0] + p[2] * np.cos(ang)
                cy = p[1] + p[2] * np.sin(ang)
                heading = ang + sign * np.pi / 2
            x[sel] = cx - nn * np.sin(heading)
            y[sel] = cy + nn * np.cos(heading)
            h[sel] = heading
        return x, y, h

    def curvature_at(self, road: int, s: FloatArray, n: float = 0.0) -> FloatArray:
        """Signed curvature (1/m, left turn positive) of the line at offset ``n`` at ``s``."""
        s = np.asarray(s, dtype=np.float64)
        length = self.lengths[road]
        s = np.mod(s, length) if self.closed[road] else np.clip(s, 0.0, length)
        k = np.zeros_like(s)
        for row in self.pieces[self.pieces[:, PIECE_ROAD] == road]:
            if row[PIECE_KIND] != 1:
                continue
            s0, ln = row[PIECE_S0], row[PIECE_LEN]
            sel = (s >= s0) & (s < s0 + ln)
            sign = np.sign(row[PIECE_P + 4])
            k[sel] = sign / (row[PIECE_P + 2] - sign * n)
        return k

    def crossings(self, road: int, step: float = 0.25) -> list[tuple[float, float]]:
        """``(s_in, s_out)`` intervals where ``road``'s centre line runs inside another road."""
        s = np.arange(0.0, self.lengths[road], step)
        x, y, _ = self.point_at(road, s)
        inside = self.frame(x, y).other <= PAVED_HALF_WIDTH_M
        out: list[tuple[float, float]] = []
        start = None
        for i, flag in enumerate(inside):
            if flag and start is None:
                start = float(s[i])
            elif not flag and start is not None:
                out.append((start, float(s[i])))
                start = None
        if start is not None:
            out.append((start, float(self.lengths[road])))
        return out


def _piece_frame(
    row: NDArray[np.float64], x: FloatArray, y: FloatArray, dt: np.dtype
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Distance, n and local s of points relative to one piece."""
    p = row[PIECE_P:].astype(dt)
    length = dt.type(row[PIECE_LEN])
    if row[PIECE_KIND] == 0:
        wx = x - p[0]
        wy = y - p[1]
        along = wx * p[2] + wy * p[3]
        s = np.clip(along, 0, length)
        dx = wx - s * p[2]
        dy = wy - s * p[3]
        return np.hypot(dx, dy), p[2] * wy - p[3] * wx, s
    vx = x - p[0]
    vy = y - p[1]
    r = np.hypot(vx, vy)
    sign = dt.type(1.0 if p[4] > 0 else -1.0)
    sweep = abs(p[4])
    two_pi = dt.type(2 * np.pi)
    alpha = np.mod((np.arctan2(vy, vx) - p[3]) * sign, two_pi)
    inside = alpha <= sweep
    end_ang = p[3] + p[4]
    d_start = np.hypot(vx - p[2] * np.cos(p[3]), vy - p[2] * np.sin(p[3]))
    d_end = np.hypot(vx - p[2] * np.cos(end_ang), vy - p[2] * np.sin(end_ang))
    d = np.where(inside, np.abs(r - p[2]), np.minimum(d_start, d_end))
    s = np.where(inside, p[2] * alpha, np.where(d_end < d_start, length, dt.type(0)))
    return d, sign * (p[2] - r), s


def _piece_distance(
    row: NDArray[np.float64], x: FloatArray, y: FloatArray, dt: np.dtype
) -> FloatArray:
    """Distance of points to one piece (the cheap part of :func:`_piece_frame`)."""
    p = row[PIECE_P:].astype(dt)
    if row[PIECE_KIND] == 0:
        wx = x - p[0]
        wy = y - p[1]
        s = np.clip(wx * p[2] + wy * p[3], 0, dt.type(row[PIECE_LEN]))
        return np.asarray(np.hypot(wx - s * p[2], wy - s * p[3]))
    vx = x - p[0]
    vy = y - p[1]
    sign = dt.type(1.0 if p[4] > 0 else -1.0)
    alpha = np.mod((np.arctan2(vy, vx) - p[3]) * sign, dt.type(2 * np.pi))
    end_ang = p[3] + p[4]
    d_ends = np.minimum(
        np.hypot(vx - p[2] * np.cos(p[3]), vy - p[2] * np.sin(p[3])),
        np.hypot(vx - p[2] * np.cos(end_ang), vy - p[2] * np.sin(end_ang)),
    )
    return np.asarray(np.where(alpha <= abs(p[4]), np.abs(np.hypot(vx, vy) - p[2]), d_ends))


def _piece_bounds(row: NDArray[np.float64]) -> tuple[float, float, float, float]:
    p = row[PIECE_P:]
    if row[PIECE_KIND] == 0:
        x1 = p[0] + p[2] * row[PIECE_LEN]
        y1 = p[1] + p[3] * row[PIECE_LEN]
        return min(p[0], x1), min(p[1], y1), max(p[0], x1), max(p[1], y1)
    return p[0] - p[2], p[1] - p[2], p[0] + p[2], p[1] + p[2]


def _rot(x: float, y: float, yaw: float) -> tuple[float, float]:
    c, s = np.cos(yaw), np.sin(yaw)
    return float(c * x - s * y), float(s * x + c * y)


def make_roads(rng: np.random.Generator) -> RoadNetwork:
    """A seeded network: a rounded-rectangle loop crossed by a straight street.

    The loop (road 0, counter-clockwise, about 380--480 m: a lap takes about a minute) has
    four straights and four
    90-degree curves of 22--32 m radius; the street (road 1) crosses two of its
    straights, making two four-way intersections.  The whole layout is rotated by a
    random yaw about the map origin.
    """
    a = rng.uniform(130.0, 170.0)
    b = rng.uniform(75.0, 100.0)
    r = rng.uniform(22.0, 32.0)
    yaw = rng.uniform(-0.5, 0.5)
    hp = np.pi / 2
    loop: list[tuple[Any, ...]] = [
        ("line", (-a / 2 + r, -b / 2), (1.0, 0.0), a - 2 * r),
        ("arc", (a / 2 - r, -b / 2 + r), -hp, hp),
        ("line", (a / 2, -b / 2 + r), (0.0, 1.0), b - 2 * r),
        ("arc", (a / 2 - r, b / 2 - r), 0.0, hp),
        ("line", (a / 2 - r, b / 2), (-1.0, 0.0), a - 2 * r),
        ("arc", (-a / 2 + r, b / 2 - r), hp, hp),
        ("line", (-a / 2, b / 2 - r), (0.0, -1.0), b - 2 * r),
        ("arc", (-a / 2 + r, -b / 2 + r), np.pi, hp),
    ]
    xc = rng.uniform(-a / 2 + r + 30.0, a / 2 - r - 30.0)
    e1, e2 = rng.uniform(45.0, 70.0, 2)
    cross: list[tuple[Any, ...]] = [("line", (xc, -b / 2 - e1), (0.0, 1.0), b + e1 + e2)]
    rows: list[list[float]] = []
    lengths: list[float] = []
    for road, pieces in enumerate((loop, cross)):
        s0 = 0.0
        for piece in pieces:
            if piece[0] == "line":
                _, (x0, y0), (ux, uy), length = piece
                px, py = _rot(x0, y0, yaw)
                qx, qy = _rot(ux, uy, yaw)
                rows.append([0, road, s0, length, px, py, qx, qy, 0.0])
            else:
                _, (cx, cy), theta0, sweep = piece
                px, py = _rot(cx, cy, yaw)
                length = r * abs(sweep)
                rows.append([1, road, s0, length, px, py, r, theta0 + yaw, sweep])
            s0 += float(length)
        lengths.append(s0)
    half = LANE_WIDTH_M
    w = MARKING_WIDTH_M
    markings = []
    for road, centre_dashed in ((0, 1.0), (1, 0.0)):
        edge = rng.uniform(0.55, 0.7, 2)
        markings.append([road, -half, w, 0.0, edge[0]])
        markings.append([road, 0.0, w, centre_dashed, rng.uniform(0.6, 0.8)])
        markings.append([road, half, w, 0.0, edge[1]])
    return RoadNetwork(
        pieces=np.asarray(rows, dtype=np.float64),
        markings=np.asarray(markings, dtype=np.float64),
        closed=(True, False),
        lengths=tuple(lengths),
        names=("loop", "cross_street"),
    )
