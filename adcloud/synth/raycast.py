"""Vectorized NumPy ray casting against a :class:`~adcloud.synth.world.World`.

This is the reference implementation: every step is a whole-array operation, and a
future OpenCL kernel (``adcloud.hetero``) must reproduce :func:`cast_rays` on the same
world arrays.

Ground
    The ground is the terrain on the carriageway and the terrain plus the curb height
    elsewhere.  The terrain's slope bound ``s`` brackets each ray's hit analytically
    (``h0 / (-dz + s*|dxy|) <= t <= h0 / (-dz - s*|dxy|)``), a 12-sample march finds the
    first sign change inside the bracket and Illinois false position refines it.  Both
    surfaces (road level and raised level) come from the same march; a ray that reaches
    the raised level over the road and the road level off it hit the curb face, found
    by bisection on the road distance.
Objects
    Rays come in *bins* (groups of rays with nearby origins and directions, e.g. a few
    LiDAR columns and beams, or an 8x8 pixel tile).  Each bin's angular extent is tested
    against every object's bounding cylinder, and only the surviving (ray, object) pairs
    are intersected exactly: vertical cylinders (with a top cap), yaw-rotated boxes (slab
    test) and spheres.  Moving vehicles are placed at each ray's own time.

All geometry is in the map frame (ENU, metres); times are seconds since the drive start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.labels import Label
from adcloud.synth.roads import CURB_HEIGHT_M, PAVED_HALF_WIDTH_M, RoadFrame
from adcloud.synth.world import (
    BOX_CX,
    BOX_CY,
    BOX_CZ,
    BOX_HX,
    BOX_HY,
    BOX_HZ,
    BOX_LABEL,
    BOX_REFL,
    BOX_YAW,
    CYL_LABEL,
    CYL_R,
    CYL_REFL,
    CYL_X,
    CYL_Y,
    CYL_Z0,
    CYL_Z1,
    MOV_HX,
    MOV_HY,
    MOV_HZ,
    MOV_SPEED,
    SPH_LABEL,
    SPH_R,
    SPH_REFL,
    SPH_X,
    SPH_Y,
    SPH_Z,
    World,
)

__all__ = ["Hits", "cast_rays"]

F32 = NDArray[np.float32]
_MARCH_SAMPLES = 12
_REFINE_STEPS = 5
_CURB_SAMPLES = 4
_CURB_STEPS = 4

# Object kinds in the culling table.
_CYL, _BOX, _SPH, _MOV = 0, 1, 2, 3


@dataclass(frozen=True)
class Hits:
    """What each ray hit: range (m along the unit ray, ``inf`` = nothing within
    ``max_range``), :class:`Label` id, reflectance (0..1) and the unit surface normal
    (map frame; zeros where nothing was hit)."""

    range: F32
    label: NDArray[np.uint8]
    reflectance: F32
    normal: F32


def cast_rays(
    world: World,
    origins: NDArray[np.floating],
    directions: NDArray[np.floating],
    times: NDArray[np.floating],
    *,
    max_range: float,
    bins: NDArray[np.integer],
) -> Hits:
    """Cast rays ``origins + t * directions`` (``(R, 3)``, unit directions) into ``world``.

    ``times`` (``(R,)``, s since the drive start) place the moving vehicles; ``bins``
    (``(R,)`` small non-negative ints) groups rays whose origins lie within a few
    centimetres and whose directions span a few degrees -- coarser bins are correct but
    slower.  Returns the nearest hit per ray.
    """
    o = np.ascontiguousarray(origins, dtype=np.float32)
    d = np.ascontiguousarray(directions, dtype=np.float32)
    n = len(o)
    t_g, lab_g, ref_g, nrm_g = _cast_ground(world, o, d, max_range)
    t_p, lab_p, ref_p, nrm_p = _cast_objects(
        world, o, d, np.asarray(times, dtype=np.float64), max_range, np.asarray(bins)
    )
    obj = t_p < t_g
    t = np.where(obj, t_p, t_g)
    label = np.where(obj, lab_p, lab_g)
    refl = np.where(obj, ref_p, ref_g)
    normal = np.where(obj[:, None], nrm_p, nrm_g)
    miss = ~(t <= max_range)
    t[miss] = np.inf
    label[miss] = Label.UNLABELED
    refl[miss] = 0
    normal[miss] = 0
    assert len(t) == n
    return Hits(
        t.astype(np.float32),
        label.astype(np.uint8),
        refl.astype(np.float32),
        normal.astype(np.float32),
    )


# --------------------------------------------------------------------------- ground


def _cast_ground(
    world: World, o: F32, d: F32, max_range: float
) -> tuple[F32, NDArray[np.uint8], F32, F32]:
    n = len(o)
    t_out = np.full(n, np.inf, dtype=np.float32)
    lab_out = np.zeros(n, dtype=np.uint8)
    ref_out = np.zeros(n, dtype=np.float32)
    nrm_out = np.zeros((n, 3), dtype=np.float32)
    terrain = world.terrain
    slope = np.float32(world.max_slope * 1.001 + 1e-4)
    curb = np.float32(CURB_HEIGHT_M)
    h0 = o[:, 2] - terrain.height(o[:, 0], o[:, 1])
    dh = np.hypot(d[:, 0], d[:, 1])
    descent_max = -d[:, 2] + slope * dh
    with np.errstate(divide="ignore", invalid="ignore"):
        # widened a little so that float32 rounding never puts a root outside the bracket
        t_lo = np.maximum((h0 - curb) / descent_max * np.float32(0.999) - np.float32(1e-3), 0)
        descent_min = -d[:, 2] - slope * dh
        widened = h0 / descent_min * np.float32(1.001) + np.float32(1e-3)
        t_hi = np.where(descent_min > 0, widened, np.inf)
    t_hi = np.minimum(t_hi, np.float32(max_range))
    cand = np.nonzero((descent_max > 1e-6) & (h0 > 0) & (t_lo < max_range))[0]
    if len(cand) == 0:
        return t_out, lab_out, ref_out, nrm_out
    oc, dc = o[cand], d[cand]
    lo, hi = t_lo[cand], t_hi[cand]
    frac = np.linspace(0, 1, _MARCH_SAMPLES, dtype=np.float32)
    ts = lo[:, None] + (hi - lo)[:, None] * frac[None, :]
    g = (
        oc[:, 2:3]
        + ts * dc[:, 2:3]
        - terrain.height(oc[:, 0:1] + ts * dc[:, 0:1], oc[:, 1:2] + ts * dc[:, 1:2])
    )

    def height_above(rows: NDArray[np.intp], level: np.float32) -> Callable[[F32], F32]:
        ro, rd = oc[rows], dc[rows]

        def f(t: F32) -> F32:
            x = ro[:, 0] + t * rd[:, 0]
            y = ro[:, 1] + t * rd[:, 1]
            return np.asarray(
                ro[:, 2] + t * rd[:, 2] - terrain.height(x, y) - level, dtype=np.float32
            )

        return f

    def first_crossing(level: np.float32) -> tuple[F32, NDArray[np.bool_]]:
        below = g <= level
        has = below.any(axis=1)
        k = np.argmax(below, axis=1)
        rows = np.nonzero(has & (k > 0))[0]
        root = np.full(len(oc), np.inf, dtype=np.float32)
        at_start = has & (k == 0)
        root[at_start] = lo[at_start]
        if len(rows):
            kk = k[rows]
            a, b = ts[rows, kk - 1], ts[rows, kk]
            ga, gb = g[rows, kk - 1] - level, g[rows, kk] - level
            root[rows] = _illinois(height_above(rows, level), a, b, ga, gb)
        return root, np.asarray(has, dtype=bool)

    t_road, has_road = first_crossing(np.float32(0))
    t_raised, has_raised = first_crossing(curb)

    hit_t = np.full(len(oc), np.inf, dtype=np.float32)
    hit_lab = np.zeros(len(oc), dtype=np.uint8)
    hit_ref = np.zeros(len(oc), dtype=np.float32)
    curb_face = np.zeros(len(oc), dtype=bool)

    # 1. reaching the raised level over raised ground: sidewalk, curb top or grass.
    rows = np.nonzero(has_raised)[0]
    px, py = _point(oc[rows], dc[rows], t_raised[rows])
    frame = world.roads.frame(px, py)
    raised = frame.distance > PAVED_HALF_WIDTH_M
    top = rows[raised]
    if len(top):
        sample = world.ground_surface(px[raised], py[raised], frame=_subset(frame, raised))
        hit_t[top] = t_raised[top]
        hit_lab[top] = sample.label
        hit_ref[top] = sample.reflectance

    # 2. below the raised level over the road: the road, unless a curb face comes first.
    rows = rows[~raised]
    if len(rows):
        end = np.where(has_road[rows], t_road[rows], np.minimum(hi[rows], max_range))
        start = t_raised[rows]
        ro, rd = oc[rows], dc[rows]
        found = np.zeros(len(rows), dtype=bool)
        prev_t = start.copy()
        half = np.float32(PAVED_HALF_WIDTH_M)
        qx, qy = _point(ro, rd, start)
        prev_d = world.roads.distance(qx, qy) - half  # < 0: over the road
        a = np.zeros(len(rows), dtype=np.float32)
        b = np.zeros(len(rows), dtype=np.float32)
        fa = np.zeros(len(rows), dtype=np.float32)
        fb = np.zeros(len(rows), dtype=np.float32)
        for j in range(1, _CURB_SAMPLES + 1):
            tj = start + (end - start) * np.float32(j / _CURB_SAMPLES)
            qx, qy = _point(ro, rd, tj)
            dj = world.roads.distance(qx, qy) - half
            new = (dj > 0) & ~found
            a[new], b[new], fa[new], fb[new] = prev_t[new], tj[new], prev_d[new], dj[new]
            found |= new
            prev_t, prev_d = tj, dj
        road = ~found & has_road[rows]
        if road.any():
            r = rows[road]
            qx, qy = _point(oc[r], dc[r], t_road[r])
            sample = world.ground_surface(qx, qy)
            hit_t[r] = t_road[r]
            hit_lab[r] = sample.label
            hit_ref[r] = sample.reflectance
        if found.any():
            r = rows[found]
            # the road-distance crossing of W between the last road and the first raised sample
            ro, rd = oc[r], dc[r]

            def over_curb(t: F32) -> F32:
                x, y = _point(ro, rd, t)
                return np.asarray(half - world.roads.distance(x, y), dtype=np.float32)

            fa_r = np.maximum(-fa[found], np.float32(1e-6))
            hit_t[r] = _illinois(over_curb, a[found], b[found], fa_r, -fb[found], steps=_CURB_STEPS)
            hit_lab[r] = Label.CURB
            hit_ref[r] = np.float32(0.32)
            curb_face[r] = True

    ok = np.isfinite(hit_t)
    idx = cand[ok]
    t_out[idx] = hit_t[ok]
    lab_out[idx] = hit_lab[ok]
    ref_out[idx] = hit_ref[ok]
    hx, hy = _point(oc[ok], dc[ok], hit_t[ok])
    gx, gy = terrain.gradient(hx, hy)
    normal = np.stack([-gx, -gy, np.ones_like(gx)], axis=1)
    face = curb_face[ok]
    normal[face] = np.stack(
        [-dc[ok][face, 0], -dc[ok][face, 1], np.zeros(int(face.sum()), np.float32)], axis=1
    )
    normal /= np.linalg.norm(normal, axis=1, keepdims=True)
    nrm_out[idx] = normal
    return t_out, lab_out, ref_out, nrm_out


def _point(o: F32, d: F32, t: F32) -> tuple[F32, F32]:
    return o[:, 0] + t * d[:, 0], o[:, 1] + t * d[:, 1]


def _subset(frame: RoadFrame, mask: NDArray[np.bool_]) -> RoadFrame:
    return RoadFrame(
        frame.distance[mask], frame.n[mask], frame.s[mask], frame.road[mask], frame.other[mask]
    )


def _illinois(
    f: Callable[[F32], F32], a: F32, b: F32, ga: F32, gb: F32, steps: int = _REFINE_STEPS
) -> F32:
    """Root of ``f`` in ``[a, b]`` with ``f(a) > 0 >= f(b)`` (Illinois false position)."""
    side = np.zeros(len(a), dtype=np.int8)
    m = b
    for _ in range(steps):
        with np.errstate(divide="ignore", invalid="ignore"):
            m = (a * gb - b * ga) / (gb - ga)
        m = np.where(np.isfinite(m) & (m >= a) & (m <= b), m, (a + b) * np.float32(0.5))
        gm = f(m)
        pos = gm > 0
        a = np.where(pos, m, a)
        ga = np.where(pos, gm, ga)
        b = np.where(pos, b, m)
        gb = np.where(pos, gb, gm)
        ga = np.where(~pos & (side == -1), ga * np.float32(0.5), ga)
        gb = np.where(pos & (side == 1), gb * np.float32(0.5), gb)
        side = np.where(pos, 1, -1).astype(np.int8)
    return np.asarray(m, dtype=np.float32)


# --------------------------------------------------------------------------- objects


def _object_table(world: World, t_mid: float, t_spread: float) -> NDArray[np.float64]:
    """Culling table ``(P, 7)``: cx, cy, horizontal radius, zlo, zhi, kind, row."""
    parts = []
    c = world.cylinders
    if len(c):
        parts.append(
            np.stack(
                [
                    c[:, CYL_X],
                    c[:, CYL_Y],
                    c[:, CYL_R],
                    c[:, CYL_Z0],
                    c[:, CYL_Z1],
                    np.full(len(c), _CYL),
                    np.arange(len(c)),
                ],
                axis=1,
            )
        )
    b = world.boxes
    if len(b):
        parts.append(
            np.stack(
                [
                    b[:, BOX_CX],
                    b[:, BOX_CY],
                    np.hypot(b[:, BOX_HX], b[:, BOX_HY]),
                    b[:, BOX_CZ] - b[:, BOX_HZ],
                    b[:, BOX_CZ] + b[:, BOX_HZ],
                    np.full(len(b), _BOX),
                    np.arange(len(b)),
                ],
                axis=1,
            )
        )
    s = world.spheres
    if len(s):
        parts.append(
            np.stack(
                [
                    s[:, SPH_X],
                    s[:, SPH_Y],
                    s[:, SPH_R],
                    s[:, SPH_Z] - s[:, SPH_R],
                    s[:, SPH_Z] + s[:, SPH_R],
                    np.full(len(s), _SPH),
                    np.arange(len(s)),
                ],
                axis=1,
            )
        )
    m = world.movers
    if len(m):
        boxes = world.mover_boxes(t_mid)
        grow = m[:, MOV_SPEED] * t_spread
        parts.append(
            np.stack(
                [
                    boxes[:, BOX_CX],
                    boxes[:, BOX_CY],
                    np.hypot(m[:, MOV_HX], m[:, MOV_HY]) + grow,
                    boxes[:, BOX_CZ] - m[:, MOV_HZ] - 0.2 * grow - 0.5,
                    boxes[:, BOX_CZ] + m[:, MOV_HZ] + 0.2 * grow + 0.5,
                    np.full(len(m), _MOV),
                    np.arange(len(m)),
                ],
                axis=1,
            )
        )
    if not parts:
        return np.zeros((0, 7))
    return np.concatenate(parts)


def _wrap(a: NDArray[np.floating]) -> NDArray[np.floating]:
    """Angles wrapped to [-pi, pi) (keeps float32)."""
    pi = a.dtype.type(np.pi)
    return np.asarray((a + pi) % (2 * pi) - pi)


def _candidate_pairs(
    o: F32, d: F32, bins: NDArray[np.integer], table: NDArray[np.float64], max_range: float
) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """(ray, table row) pairs whose bin's angular extent meets the object's bounding cylinder."""
    order = np.argsort(bins, kind="stable")
    sb = bins[order]
    starts = np.concatenate([[0], np.nonzero(np.diff(sb))[0] + 1])
    counts = np.diff(np.concatenate([starts, [len(sb)]]))
    os_, ds = o[order], d[order]
    nb = len(starts)
    ref = np.add.reduceat(os_, starts, axis=0) / counts[:, None]
    spread = np.maximum.reduceat(
        np.linalg.norm(os_ - np.repeat(ref, counts, axis=0), axis=1), starts
    )
    hsum = np.add.reduceat(ds[:, :2], starts, axis=0)
    phi_b = np.arctan2(hsum[:, 1], hsum[:, 0])
    dh = np.hypot(ds[:, 0], ds[:, 1])
    phi = np.arctan2(ds[:, 1], ds[:, 0])
    dev = np.abs(_wrap(phi - np.repeat(phi_b, counts)))
    dev[dh < 1e-3] = np.pi
    beta = np.maximum.reduceat(dev, starts)
    elev = np.arctan2(ds[:, 2], dh)
    e_lo = np.minimum.reduceat(elev, starts)
    e_hi = np.maximum.reduceat(elev, starts)

    # objects that can be within range of any ray at all
    centre = ref.mean(axis=0)
    reach = float(np.max(np.linalg.norm(ref - centre, axis=1) + spread))
    dist = np.hypot(table[:, 0] - centre[0], table[:, 1] - centre[1]) - table[:, 2]
    table_rows = np.nonzero(dist <= max_range + reach)[0]
    tab = table[table_rows].astype(np.float32)
    ref = ref.astype(np.float32)
    spread = spread.astype(np.float32)
    phi_b = phi_b.astype(np.float32)
    beta = beta.astype(np.float32)
    if len(tab) == 0 or nb == 0:
        empty = np.zeros(0, dtype=np.intp)
        return empty, empty
    dx = tab[None, :, 0] - ref[:, 0:1]
    dy = tab[None, :, 1] - ref[:, 1:2]
    dist_h = np.hypot(dx, dy)
    grow = tab[None, :, 2] + spread[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        alpha = np.where(dist_h > grow, np.arcsin(np.clip(grow / dist_h, 0, 1)), np.pi)
    az_ok = np.abs(_wrap(np.arctan2(dy, dx) - phi_b[:, None])) <= beta[:, None] + alpha
    near = np.maximum(dist_h - grow, 0.01)
    far = dist_h + grow
    zlo = tab[None, :, 3] - ref[:, 2:3] - spread[:, None]
    zhi = tab[None, :, 4] - ref[:, 2:3] + spread[:, None]
    el_min = np.minimum(np.arctan2(zlo, near), np.arctan2(zlo, far))
    el_max = np.maximum(np.arctan2(zhi, near), np.arctan2(zhi, far))
    ok = (
        az_ok & (el_max >= e_lo[:, None]) & (el_min <= e_hi[:, None]) & (dist_h - grow <= max_range)
    )
    b_idx, p_idx = np.nonzero(ok)
    if len(b_idx) == 0:
        empty = np.zeros(0, dtype=np.intp)
        return empty, empty
    per = counts[b_idx]
    total = int(per.sum())
    pair_of = np.repeat(np.arange(len(b_idx)), per)
    first = np.repeat(np.cumsum(per) - per, per)
    pos = starts[b_idx][pair_of] + (np.arange(total) - first)
    return order[pos], table_rows[p_idx][pair_of]


def _cast_objects(
    world: World,
    o: F32,
    d: F32,
    times: NDArray[np.float64],
    max_range: float,
    bins: NDArray[np.integer],
) -> tuple[F32, NDArray[np.uint8], F32, F32]:
    n = len(o)
    t_best = np.full(n, np.inf, dtype=np.float32)
    label = np.zeros(n, dtype=np.uint8)
    refl = np.zeros(n, dtype=np.float32)
    normal = np.zeros((n, 3), dtype=np.float32)
    if n == 0:
        return t_best, label, refl, normal
    t_mid = float((times.min() + times.max()) / 2)
    t_spread = float(times.max() - times.min())
    table = _object_table(world, t_mid, t_spread)
    ray, row = _candidate_pairs(o, d, bins, table, max_range)
    if len(ray) == 0:
        return t_best, label, refl, normal
    kind = table[row, 5].astype(np.int8)
    index = table[row, 6].astype(np.intp)
    results = []
    sel = kind == _CYL
    if sel.any():
        hit = _hit_cylinders(world.cylinders[index[sel]], o[ray[sel]], d[ray[sel]])
        results.append((*hit, ray[sel]))
    sel = kind == _SPH
    if sel.any():
        hit = _hit_spheres(world.spheres[index[sel]], o[ray[sel]], d[ray[sel]])
        results.append((*hit, ray[sel]))
    sel_b, sel_m = kind == _BOX, kind == _MOV
    if sel_b.any() or sel_m.any():
        boxes = np.concatenate(
            [world.boxes[index[sel_b]], world.mover_boxes(times[ray[sel_m]], index[sel_m])]
        )
        rays = np.concatenate([ray[sel_b], ray[sel_m]])
        results.append((*_hit_boxes(boxes, o[rays], d[rays]), rays))
    for t, *_rest, rays in results:
        np.minimum.at(t_best, rays, t)
    for t, lab, ref, nrm, rays in results:
        win = np.isfinite(t) & (t == t_best[rays])
        label[rays[win]] = lab[win]
        refl[rays[win]] = ref[win]
        normal[rays[win]] = nrm[win]
    return t_best, label, refl, normal


def _hit_cylinders(
    c: NDArray[np.float64], o: F32, d: F32
) -> tuple[F32, NDArray[np.uint8], F32, F32]:
    c32 = c.astype(np.float32)
    wx = o[:, 0] - c32[:, CYL_X]
    wy = o[:, 1] - c32[:, CYL_Y]
    r = c32[:, CYL_R]
    a = d[:, 0] ** 2 + d[:, 1] ** 2
    b = wx * d[:, 0] + wy * d[:, 1]
    cc = wx * wx + wy * wy - r * r
    disc = b * b - a * cc
    with np.errstate(divide="ignore", invalid="ignore"):
        t_side = (-b - np.sqrt(np.maximum(disc, 0))) / a
        z = o[:, 2] + t_side * d[:, 2]
        side = (disc >= 0) & (cc > 0) & (t_side > 0) & (z >= c32[:, CYL_Z0]) & (z <= c32[:, CYL_Z1])
        t_cap = (c32[:, CYL_Z1] - o[:, 2]) / d[:, 2]
        qx = wx + t_cap * d[:, 0]
        qy = wy + t_cap * d[:, 1]
        cap = (d[:, 2] < 0) & (t_cap > 0) & (qx * qx + qy * qy <= r * r)
    t = np.where(side, t_side, np.inf)
    t = np.where(cap & (t_cap < t), t_cap, t).astype(np.float32)
    use_cap = cap & (t == t_cap)
    with np.errstate(divide="ignore", invalid="ignore"):
        nx = (wx + t * d[:, 0]) / r
        ny = (wy + t * d[:, 1]) / r
    normal = np.stack([nx, ny, np.zeros_like(nx)], axis=1)
    normal[use_cap] = (0, 0, 1)
    return t, c[:, CYL_LABEL].astype(np.uint8), c32[:, CYL_REFL], normal.astype(np.float32)


def _hit_spheres(s: NDArray[np.float64], o: F32, d: F32) -> tuple[F32, NDArray[np.uint8], F32, F32]:
    s32 = s.astype(np.float32)
    w = o - s32[:, [SPH_X, SPH_Y, SPH_Z]]
    r = s32[:, SPH_R]
    b = np.einsum("ij,ij->i", w, d)
    cc = np.einsum("ij,ij->i", w, w) - r * r
    disc = b * b - cc
    t = -b - np.sqrt(np.maximum(disc, 0))
    ok = (disc >= 0) & (cc > 0) & (t > 0)
    t = np.where(ok, t, np.inf).astype(np.float32)
    with np.errstate(invalid="ignore"):
        normal = (w + t[:, None] * d) / r[:, None]
    return t, s[:, SPH_LABEL].astype(np.uint8), s32[:, SPH_REFL], normal.astype(np.float32)


def _hit_boxes(bx: NDArray[np.float64], o: F32, d: F32) -> tuple[F32, NDArray[np.uint8], F32, F32]:
    b32 = bx.astype(np.float32)
    c = np.cos(b32[:, BOX_YAW])
    s = np.sin(b32[:, BOX_YAW])
    px = o[:, 0] - b32[:, BOX_CX]
    py = o[:, 1] - b32[:, BOX_CY]
    pz = o[:, 2] - b32[:, BOX_CZ]
    local_o = (c * px + s * py, -s * px + c * py, pz)
    local_d = (c * d[:, 0] + s * d[:, 1], -s * d[:, 0] + c * d[:, 1], d[:, 2])
    half = (b32[:, BOX_HX], b32[:, BOX_HY], b32[:, BOX_HZ])
    near = []
    far = []
    with np.errstate(divide="ignore", invalid="ignore"):
        for lo_, ld, h in zip(local_o, local_d, half, strict=True):
            inv = np.float32(1) / np.asarray(ld, dtype=np.float32)
            t1 = (-h - lo_) * inv
            t2 = (h - lo_) * inv
            near.append(np.minimum(t1, t2))
            far.append(np.maximum(t1, t2))
    tn = np.stack(near, axis=1)
    tn = np.where(np.isnan(tn), -np.inf, tn)
    tf = np.stack(far, axis=1)
    tf = np.where(np.isnan(tf), np.inf, tf)
    t_near = tn.max(axis=1)
    t_far = tf.min(axis=1)
    ok = (t_near <= t_far) & (t_near > 0)
    t = np.where(ok, t_near, np.inf).astype(np.float32)
    axis = np.argmax(tn, axis=1)
    ld = np.stack(local_d, axis=1)
    sign = -np.sign(ld[np.arange(len(ld)), axis])
    nl = np.zeros((len(ld), 3), dtype=np.float32)
    nl[np.arange(len(ld)), axis] = sign
    normal = np.stack([c * nl[:, 0] - s * nl[:, 1], s * nl[:, 0] + c * nl[:, 1], nl[:, 2]], axis=1)
    return t, bx[:, BOX_LABEL].astype(np.uint8), b32[:, BOX_REFL], normal.astype(np.float32)
