"""The ego vehicle's route and dynamics."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.synth import DriveConfig, World
from adcloud.synth.roads import LANE_WIDTH_M, PIECE_ROAD
from adcloud.synth.trajectory import DT, GRAVITY, Driver, Trajectory, make_route

CONFIG = DriveConfig(seed=7)


@pytest.fixture(scope="module")
def samples(world: World) -> np.ndarray:
    """130 s of 1 kHz driver samples (more than two laps of stops)."""
    driver = Driver(world, make_route(world, CONFIG), CONFIG)
    return np.concatenate([driver.initial_sample(), driver.advance(130.0)])


def test_dynamics_stay_within_limits(samples: np.ndarray) -> None:
    t, v, k = samples[:, 0], samples[:, 4], samples[:, 5]
    np.testing.assert_allclose(np.diff(t), DT, atol=1e-9)
    accel = np.diff(v) / DT
    assert v.min() >= 0
    assert v.max() <= CONFIG.speed_mps + 0.1
    assert accel.max() <= CONFIG.max_accel_mps2 + 1e-6
    assert accel.min() >= -CONFIG.max_decel_mps2 - 1e-6
    jerk = np.diff(accel) / DT
    moving = (v[:-2] > 0) & (v[1:-1] > 0) & (v[2:] > 0)  # coming to rest is an allowed jolt
    assert np.abs(jerk[moving]).max() <= 3.0 + 1e-3
    yaw_rate = v * k
    assert np.abs(yaw_rate).max() <= CONFIG.max_yaw_rate_rps
    assert np.abs(v * v * k).max() <= 1.2 * CONFIG.max_lateral_accel_mps2 + 1e-6


def test_car_keeps_its_lane(world: World, samples: np.ndarray) -> None:
    loop = np.nonzero(world.roads.pieces[:, PIECE_ROAD] == 0)[0]
    frame = world.roads.frame(samples[:, 1], samples[:, 2], loop)
    offset = frame.n + LANE_WIDTH_M / 2
    assert np.abs(offset).max() < 0.6
    assert np.abs(offset).mean() < 0.25


def test_car_stops_at_stop_lines_and_revisits_places(world: World, samples: np.ndarray) -> None:
    still = samples[:, 4] < 0.01
    runs = np.split(np.nonzero(still)[0], np.nonzero(np.diff(np.nonzero(still)[0]) > 1)[0] + 1)
    long_runs = [r for r in runs if len(r) * DT >= CONFIG.stop_dwell_s - 0.05]
    assert len(long_runs) >= 2
    loop = np.nonzero(world.roads.pieces[:, PIECE_ROAD] == 0)[0]
    for run in long_runs:
        f = world.roads.frame(samples[run[0], 1:2], samples[run[0], 2:3], loop)
        gap = min(abs(float(f.s[0]) - stop) for stop in world.stops)
        assert gap < 2.5
    # a loop: after a lap the car passes within a metre of where it started
    start = samples[0, 1:3]
    later = samples[samples[:, 0] > 30.0, 1:3]
    assert np.hypot(*(later - start).T).min() < 1.0


def test_trajectory_follows_the_terrain_and_reads_gravity_at_rest(
    world: World, samples: np.ndarray
) -> None:
    still = np.nonzero(samples[:, 4] < 1e-9)[0]
    runs = np.split(still, np.nonzero(np.diff(still) > 1)[0] + 1)
    longest = max(runs, key=len)
    i = int(longest[len(longest) // 2])
    traj = Trajectory.from_samples(world, samples[i - 200 : i + 200])
    t = samples[i - 5 : i + 5, 0]
    pos, rot = traj.pose(t)
    np.testing.assert_allclose(pos[:, 2], world.terrain.height(pos[:, 0], pos[:, 1]), atol=1e-9)
    f, w = traj.imu(t, np.zeros(3), np.eye(3))
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), GRAVITY, atol=1e-6)
    # on a slope the accelerometer sees gravity tilted: z axis is the terrain normal
    gx, gy = world.terrain.gradient(pos[:, 0], pos[:, 1])
    normal = np.stack([-gx, -gy, np.ones_like(gx)], axis=1)
    normal /= np.linalg.norm(normal, axis=1, keepdims=True)
    np.testing.assert_allclose(rot[:, :, 2], normal, atol=1e-9)
    np.testing.assert_allclose(w, 0, atol=1e-9)
