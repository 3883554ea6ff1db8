"""The ego vehicle: a route on the loop and a driver with plausible dynamics.

:class:`Driver` integrates a kinematic single-track model at 1 kHz in the map frame:
speed with acceleration, braking and jerk limits, curvature with a steering-rate
limit, and a yaw-rate and lateral-acceleration limit.  A 100 Hz controller follows the
right-hand lane of the loop (road 0) with a small lane wander, slows down for curves
and stops at each stop line for ``stop_dwell_s``.  The car sits on the terrain: its
height, pitch and roll follow the road surface.

:class:`Trajectory` is a stretch of those 1 kHz samples (a few hundred ms) with the
derived kinematics: sensors interpolate poses, body rates and specific forces from it.
The drive is generated window by window, so memory stays bounded whatever its length.

Times are seconds since the drive start; positions are the map frame (ENU, m);
``base_link`` is FLU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from adcloud.synth.config import DriveConfig
from adcloud.synth.frames import euler_matrix, matrix_euler
from adcloud.synth.roads import LANE_WIDTH_M
from adcloud.synth.world import World

__all__ = ["GRAVITY", "Driver", "Route", "Trajectory", "make_route"]

F64 = NDArray[np.float64]

#: Standard gravity (m/s^2); the map frame's gravity vector is ``(0, 0, -GRAVITY)``.
GRAVITY = 9.80665
#: Dynamics step (s).
DT = 1e-3
_CONTROL_EVERY = 10
_JERK = 3.0  # m/s^3
_K_RATE = 0.1  # 1/m/s: how fast the steering can change the path curvature
_ROUTE_STEP = 0.25


@dataclass(frozen=True)
class Route:
    """The driven path: the centre of the right-hand lane of the loop, sampled every 0.25 m.

    ``x, y, heading (unwrapped), curvature, speed`` are per sample; ``speed`` is the
    allowed speed (m/s) from the curve and cruise limits; ``stops`` are stop-line
    arclengths (m).
    """

    s: F64
    x: F64
    y: F64
    heading: F64
    curvature: F64
    speed: F64
    length: float
    stops: tuple[float, ...]
    start: float


def make_route(world: World, config: DriveConfig) -> Route:
    """The route of a drive: lane ``n = -1.75`` of the loop, starting at a seeded place."""
    roads = world.roads
    length = roads.lengths[0]
    n = round(length / _ROUTE_STEP)
    s = np.arange(n) * (length / n)
    lane = -LANE_WIDTH_M / 2
    x, y, heading = roads.point_at(0, s, lane)
    heading = np.unwrap(heading)
    # lane-centre curvature; the arc radius of the right-hand lane is R + 1.75
    curvature = roads.curvature_at(0, s, lane)
    rng = np.random.default_rng(np.random.SeedSequence([config.seed, 0xD21E]))
    phase = rng.uniform(0, 2 * np.pi)
    cruise = config.speed_mps * (1 - 0.08 * (1 + np.sin(2 * np.pi * 3 * s / length + phase)))
    lat = 0.8 * config.max_lateral_accel_mps2
    with np.errstate(divide="ignore"):
        v_curve = np.sqrt(lat / np.abs(curvature))
        v_yaw = 0.8 * config.max_yaw_rate_rps / np.abs(curvature)
    speed = np.minimum(np.minimum(cruise, v_curve), v_yaw)
    # braking ahead of curves and accelerating out of them, around the loop twice
    ds = length / n
    brake = 0.5 * config.max_decel_mps2
    accel = 0.6 * config.max_accel_mps2
    v = np.concatenate([speed, speed])
    for i in range(2 * n - 2, -1, -1):
        v[i] = min(v[i], math.sqrt(v[i + 1] ** 2 + 2 * brake * ds))
    for i in range(1, 2 * n):
        v[i] = min(v[i], math.sqrt(v[i - 1] ** 2 + 2 * accel * ds))
    speed = np.minimum(v[:n], v[n:])
    start = float(rng.uniform(0, length))
    f64 = np.float64
    return Route(
        s=np.asarray(s, dtype=f64),
        x=np.asarray(x, dtype=f64),
        y=np.asarray(y, dtype=f64),
        heading=np.asarray(heading, dtype=f64),
        curvature=np.asarray(curvature, dtype=f64),
        speed=np.asarray(speed, dtype=f64),
        length=float(length),
        stops=world.stops,
        start=start,
    )


@dataclass
class _State:
    t: float
    x: float
    y: float
    yaw: float
    v: float
    a: float
    k: float
    index: int
    next_stop: int
    dwell: float
    armed: bool
    s_travelled: float


class Driver:
    """Drives ``route`` from ``t = -0.1 s``; :meth:`advance` yields 1 kHz samples.

    Deterministic for a given world, route and config.
    """

    def __init__(self, world: World, route: Route, config: DriveConfig) -> None:
        self.world = world
        self.route = route
        self.config = config
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 0xD21F]))
        # lane wander: two slow sine waves that repeat every lap (m)
        self._wander = [
            (rng.uniform(0.08, 0.18), int(rng.integers(3, 7)), rng.uniform(0, 2 * np.pi)),
            (rng.uniform(0.03, 0.08), int(rng.integers(9, 17)), rng.uniform(0, 2 * np.pi)),
        ]
        i = round(route.start / _ROUTE_STEP) % len(route.s)
        s0 = float(route.s[i])
        stops = route.stops
        next_stop = 0
        for j, stop in enumerate(stops):
            if stop > s0:
                next_stop = j
                break
        else:
            next_stop = 0
        self._stop_offset = 0.0
        self.state = _State(
            t=-0.1,
            x=float(route.x[i]),
            y=float(route.y[i]),
            yaw=float(route.heading[i]),
            v=float(config.start_speed_mps),
            a=0.0,
            k=float(route.curvature[i]),
            index=i,
            next_stop=next_stop,
            dwell=0.0,
            armed=True,
            s_travelled=0.0,
        )
        self._laps = 0
        self._k_cmd = float(route.curvature[i])
        self._da = 0.0
        self._dk = 0.0
        self._step = 0
        self._skip_stop_if_unreachable()

    def _skip_stop_if_unreachable(self) -> None:
        if not self.route.stops:
            return
        st = self.state
        ahead = self._stop_distance()
        if ahead < st.v * st.v / (2 * 0.8 * self.config.max_decel_mps2) + 1.0:
            st.armed = False  # too close to stop in comfort: drive through this time

    def _stop_distance(self) -> float:
        stop = self.route.stops[self.state.next_stop]
        here = float(self.route.s[self.state.index])
        return (stop - here) % self.route.length

    def _wander_at(self, s: float) -> float:
        length = self.route.length
        return sum(a * math.sin(2 * math.pi * k * s / length + ph) for a, k, ph in self._wander)

    def _control(self) -> None:
        st, r, cfg = self.state, self.route, self.config
        n = len(r.s)
        # nearest route sample, searching forward from the last one
        best_i, best_d = st.index, math.inf
        for j in range(-4, 60):
            i = (st.index + j) % n
            d = (r.x[i] - st.x) ** 2 + (r.y[i] - st.y) ** 2
            if d < best_d:
                best_i, best_d = i, d
        st.index = best_i
        hx, hy = math.cos(r.heading[best_i]), math.sin(r.heading[best_i])
        dx, dy = st.x - r.x[best_i], st.y - r.y[best_i]
        along = dx * hx + dy * hy
        lateral = hx * dy - hy * dx
        s_here = float(r.s[best_i]) + along
        heading_err = (st.yaw - r.heading[best_i] + math.pi) % (2 * math.pi) - math.pi
        preview = (best_i + round(max(st.v, 1.0) * 0.3 / _ROUTE_STEP)) % n
        k_cmd = (
            float(r.curvature[preview])
            - 0.02 * (lateral - self._wander_at(s_here))
            - 0.2 * heading_err
        )
        v = max(st.v, 0.1)
        k_max = min(0.2, cfg.max_yaw_rate_rps / v, 1.2 * cfg.max_lateral_accel_mps2 / (v * v))
        self._k_cmd = max(-k_max, min(k_max, k_cmd))
        target = float(r.speed[best_i])
        a_cmd = None
        if r.stops and cfg.stop_dwell_s > 0:
            ahead = (r.stops[st.next_stop] - s_here) % r.length
            if ahead > r.length - 5.0:
                ahead -= r.length
            if not st.armed and ahead > 20.0:  # past the line it was released from
                st.armed = True
        if r.stops and cfg.stop_dwell_s > 0 and st.armed:
            comfort = 0.6 * cfg.max_decel_mps2
            target = min(target, math.sqrt(2 * comfort * max(ahead - 0.5, 0.0)))
            if ahead < 1.5 and st.v < 0.5:
                # at the line: brake gently to a standstill, wait, then go on
                a_cmd = -0.5 if st.v > 0 else 0.0
                if st.v == 0.0:
                    st.dwell += DT * _CONTROL_EVERY
                    if st.dwell >= cfg.stop_dwell_s:
                        st.dwell = 0.0
                        st.armed = False
                        st.next_stop = (st.next_stop + 1) % len(r.stops)
                        a_cmd = None
        if a_cmd is None:
            a_cmd = max(-cfg.max_decel_mps2, min(cfg.max_accel_mps2, 1.2 * (target - st.v)))
        # spread each change over the control period (within the jerk and steering-rate
        # limits), so acceleration and yaw rate are continuous: no spikes in the IMU
        n = _CONTROL_EVERY
        self._da = max(-_JERK * DT, min(_JERK * DT, (a_cmd - st.a) / n))
        self._dk = max(-_K_RATE * DT, min(_K_RATE * DT, (self._k_cmd - st.k) / n))

    def advance(self, t_end: float) -> F64:
        """Integrate up to ``t_end`` (s) and return the new samples ``(N, 6)``.

        Columns: t, x, y, yaw (unwrapped), horizontal speed (m/s), curvature (1/m).
        Sample times are exact multiples of 1 ms.
        """
        st = self.state
        out: list[tuple[float, float, float, float, float, float]] = []
        steps = round((t_end - st.t) / DT)
        for _ in range(max(steps, 0)):
            if self._step % _CONTROL_EVERY == 0:
                self._control()
            self._step += 1
            st.a += self._da
            st.k += self._dk
            v0 = st.v
            st.v = max(0.0, st.v + st.a * DT)
            if st.v == 0.0 and st.a < 0:
                st.a = 0.0
                self._da = 0.0
            v_mid = 0.5 * (v0 + st.v)
            yaw_mid = st.yaw + 0.5 * v_mid * st.k * DT
            st.yaw += v_mid * st.k * DT
            st.x += v_mid * math.cos(yaw_mid) * DT
            st.y += v_mid * math.sin(yaw_mid) * DT
            st.s_travelled += v_mid * DT
            st.t = round((st.t + DT) * 1000) / 1000
            out.append((st.t, st.x, st.y, st.yaw, st.v, st.k))
        return np.asarray(out, dtype=np.float64).reshape(-1, 6)

    def initial_sample(self) -> F64:
        """The state at ``t = -0.1 s`` as one row like :meth:`advance`'s."""
        st = self.state
        return np.array([[st.t, st.x, st.y, st.yaw, st.v, st.k]])


@dataclass(frozen=True)
class Trajectory:
    """1 kHz samples of the ego pose over a span, with derived kinematics.

    ``position`` (base_link origin in map), ``rotation`` (base_link to map) and
    ``euler`` (roll, pitch, unwrapped yaw) per sample.  Derivatives are central
    differences, valid from the second to the second-to-last sample.
    """

    t: F64
    position: F64
    rotation: F64
    euler: F64

    @classmethod
    def from_samples(cls, world: World, samples: F64) -> Trajectory:
        """Lift :meth:`Driver.advance` rows onto the terrain (height, pitch, roll)."""
        t = samples[:, 0]
        x, y, yaw = samples[:, 1], samples[:, 2], samples[:, 3]
        z = world.terrain.height(x, y)
        gx, gy = world.terrain.gradient(x, y)
        up = np.stack([-gx, -gy, np.ones_like(gx)], axis=1)
        up /= np.linalg.norm(up, axis=1, keepdims=True)
        head = np.stack([np.cos(yaw), np.sin(yaw), np.zeros_like(yaw)], axis=1)
        fwd = head - np.sum(head * up, axis=1, keepdims=True) * up
        fwd /= np.linalg.norm(fwd, axis=1, keepdims=True)
        left = np.cross(up, fwd)
        rot = np.stack([fwd, left, up], axis=2)
        roll, pitch, yaw_r = matrix_euler(rot)
        yaw_u = yaw + np.angle(np.exp(1j * (yaw_r - yaw)))
        euler = np.stack([roll, pitch, yaw_u], axis=1)
        return cls(t=t, position=np.stack([x, y, z], axis=1), rotation=rot, euler=euler)

    def _locate(self, times: F64) -> tuple[NDArray[np.intp], F64]:
        times = np.asarray(times, dtype=np.float64)
        f = (times - self.t[0]) / DT
        i = np.clip(np.floor(f).astype(np.intp), 0, len(self.t) - 2)
        w = f - i
        if np.any(w < -1e-6) or np.any(w > 1 + 1e-6):
            lo, hi = float(self.t[0]), float(self.t[-1])
            raise ValueError(f"times outside the trajectory span [{lo}, {hi}] s")
        return i, w

    def pose(self, times: F64) -> tuple[F64, F64]:
        """``(positions (N, 3), rotations (N, 3, 3))`` of base_link in map at ``times``."""
        i, w = self._locate(times)
        p = self.position[i] * (1 - w)[:, None] + self.position[i + 1] * w[:, None]
        e = self.euler[i] * (1 - w)[:, None] + self.euler[i + 1] * w[:, None]
        return p, euler_matrix(e[:, 0], e[:, 1], e[:, 2])

    def mount_pose(self, times: F64, translation: F64, rotation: F64) -> tuple[F64, F64]:
        """Pose of a frame fixed to base_link (``translation``, ``rotation`` to base_link)."""
        p, r = self.pose(times)
        return p + r @ np.asarray(translation), r @ np.asarray(rotation)

    def _node_rates(self, translation: F64) -> tuple[F64, F64, F64]:
        """Velocity and acceleration (map) of a body point, and body angular rate, per node."""
        pts = self.position + self.rotation @ np.asarray(translation)
        vel = np.zeros_like(pts)
        acc = np.zeros_like(pts)
        vel[1:-1] = (pts[2:] - pts[:-2]) / (2 * DT)
        acc[1:-1] = (pts[2:] - 2 * pts[1:-1] + pts[:-2]) / (DT * DT)
        rel = np.swapaxes(self.rotation[:-2], 1, 2) @ self.rotation[2:]
        omega = np.zeros_like(pts)
        omega[1:-1, 0] = (rel[:, 2, 1] - rel[:, 1, 2]) / 2
        omega[1:-1, 1] = (rel[:, 0, 2] - rel[:, 2, 0]) / 2
        omega[1:-1, 2] = (rel[:, 1, 0] - rel[:, 0, 1]) / 2
        omega /= 2 * DT
        for arr in (vel, acc, omega):
            arr[0] = arr[1]
            arr[-1] = arr[-2]
        return vel, acc, omega

    def kinematics(self, times: F64, translation: F64 | None = None) -> tuple[F64, F64, F64, F64]:
        """At ``times``: velocity and acceleration (map, m/s, m/s^2) of the body point
        ``translation`` (base_link, m), the body angular rate (base_link, rad/s) and the
        base_link rotation."""
        i, w = self._locate(times)
        vel, acc, omega = self._node_rates(np.zeros(3) if translation is None else translation)

        def lerp(a: F64) -> F64:
            return np.asarray(a[i] * (1 - w)[:, None] + a[i + 1] * w[:, None])

        _, rot = self.pose(times)
        return lerp(vel), lerp(acc), lerp(omega), rot

    def imu(self, times: F64, translation: F64, rotation: F64) -> tuple[F64, F64]:
        """True specific force (m/s^2) and angular rate (rad/s) in a sensor frame at ``times``.

        Specific force ``f = R^T (a + g_up)``: at rest on flat ground it reads ``+9.81`` on z.
        """
        _, acc, omega, rot = self.kinematics(times, translation)
        world_to_sensor = np.swapaxes(rot @ np.asarray(rotation), 1, 2)
        f = world_to_sensor @ (acc + np.array([0.0, 0.0, GRAVITY]))[:, :, None]
        w = np.asarray(rotation).T @ omega[:, :, None]
        return f[:, :, 0], w[:, :, 0]
