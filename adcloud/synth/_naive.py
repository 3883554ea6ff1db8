"""A naive per-ray ray caster in plain Python: the baseline and the test oracle.

It shares nothing with :mod:`adcloud.synth.raycast` but the world's arrays: the ground
is found by marching each ray in fixed steps with a scalar height function (terrain
sines, road distances and the curb step re-implemented here) and bisecting the first
step that ends below ground; every object is intersected in a loop.  It is about three
orders of magnitude slower than the vectorized caster: ``benchmarks/bench_synth.py``
times it on a sample of rays as the naive baseline, and the tests compare the two on
random rays.
"""

from __future__ import annotations

import math

import numpy as np

from adcloud.synth.labels import Label
from adcloud.synth.roads import CURB_HEIGHT_M, PAVED_HALF_WIDTH_M
from adcloud.synth.world import World

__all__ = ["cast_ray_naive"]


def _terrain(world: World, x: float, y: float) -> float:
    t = world.terrain
    z = t.base + t.grad[0] * x + t.grad[1] * y
    for a, kx, ky, ph in t.waves.tolist():
        z += a * math.sin(kx * x + ky * y + ph)
    return z


def _road_distance(world: World, x: float, y: float) -> float:
    best = math.inf
    for kind, _road, _s0, length, p0, p1, p2, p3, p4 in world.roads.pieces.tolist():
        if kind == 0:
            along = min(max((x - p0) * p2 + (y - p1) * p3, 0.0), length)
            d = math.hypot(x - p0 - along * p2, y - p1 - along * p3)
        else:
            ang = math.atan2(y - p1, x - p0)
            rel = ((ang - p3) * (1 if p4 > 0 else -1)) % (2 * math.pi)
            if rel <= abs(p4):
                d = abs(math.hypot(x - p0, y - p1) - p2)
            else:
                d = min(
                    math.hypot(x - p0 - p2 * math.cos(e), y - p1 - p2 * math.sin(e))
                    for e in (p3, p3 + p4)
                )
        best = min(best, d)
    return best


def _ground(world: World, x: float, y: float) -> float:
    z = _terrain(world, x, y)
    return z + CURB_HEIGHT_M if _road_distance(world, x, y) > PAVED_HALF_WIDTH_M else z


def _box_hit(o: list[float], d: list[float], box: list[float]) -> float:
    cx, cy, cz, hx, hy, hz, yaw = box[:7]
    c, s = math.cos(yaw), math.sin(yaw)
    px, py, pz = o[0] - cx, o[1] - cy, o[2] - cz
    lo = (c * px + s * py, -s * px + c * py, pz)
    ld = (c * d[0] + s * d[1], -s * d[0] + c * d[1], d[2])
    t_near, t_far = -math.inf, math.inf
    for oo, dd, h in zip(lo, ld, (hx, hy, hz), strict=True):
        if abs(dd) < 1e-12:
            if abs(oo) > h:
                return math.inf
            continue
        t1, t2 = (-h - oo) / dd, (h - oo) / dd
        t_near = max(t_near, min(t1, t2))
        t_far = min(t_far, max(t1, t2))
    return t_near if t_near <= t_far and t_near > 0 else math.inf


def cast_ray_naive(
    world: World,
    origin: np.ndarray,
    direction: np.ndarray,
    time: float,
    *,
    max_range: float,
    step: float = 0.1,
) -> tuple[float, int]:
    """Range (m, ``inf`` for no hit) and label of one ray; ``time`` places moving cars."""
    o = [float(v) for v in origin]
    d = [float(v) for v in direction]
    best, label = math.inf, int(Label.UNLABELED)
    for x, y, z0, z1, r, lab, _ in world.cylinders.tolist():
        wx, wy = o[0] - x, o[1] - y
        a = d[0] ** 2 + d[1] ** 2
        b = wx * d[0] + wy * d[1]
        c = wx * wx + wy * wy - r * r
        disc = b * b - a * c
        if disc >= 0 and c > 0 and a > 0:
            t = (-b - math.sqrt(disc)) / a
            if 0 < t < best and z0 <= o[2] + t * d[2] <= z1:
                best, label = t, int(lab)
        if d[2] < 0:
            t = (z1 - o[2]) / d[2]
            if 0 < t < best and math.hypot(wx + t * d[0], wy + t * d[1]) <= r:
                best, label = t, int(lab)
    for x, y, z, r, lab, _ in world.spheres.tolist():
        w = (o[0] - x, o[1] - y, o[2] - z)
        b = w[0] * d[0] + w[1] * d[1] + w[2] * d[2]
        c = w[0] ** 2 + w[1] ** 2 + w[2] ** 2 - r * r
        disc = b * b - c
        if disc >= 0 and c > 0:
            t = -b - math.sqrt(disc)
            if 0 < t < best:
                best, label = t, int(lab)
    boxes = world.boxes.tolist()
    if len(world.movers):
        boxes += world.mover_boxes(time).tolist()
    for box in boxes:
        t = _box_hit(o, d, box)
        if t < best:
            best, label = t, int(box[7])
    # ground: march in fixed steps, then bisect the first step that ends below ground
    limit = min(best, max_range)
    t_prev = 0.0
    t = step
    while t_prev < limit:
        t = min(t, limit)
        if o[2] + t * d[2] < _ground(world, o[0] + t * d[0], o[1] + t * d[1]):
            a, b = t_prev, t
            for _ in range(40):
                m = 0.5 * (a + b)
                if o[2] + m * d[2] < _ground(world, o[0] + m * d[0], o[1] + m * d[1]):
                    b = m
                else:
                    a = m
            best = b
            label = -1  # ground: the caller classifies it
            break
        t_prev, t = t, t + step
    if best > max_range:
        return math.inf, int(Label.UNLABELED)
    return best, label
