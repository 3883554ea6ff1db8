"""Synthetic drive generation: simulated time per wall time, against two baselines.

Target (issue: synth): one minute of a 32-beam drive with all sensors in at most two
minutes on 2 cores, i.e. simulated/wall >= 0.5, with the peak memory printed.

Measured, each drive in its own process (so each peak RSS is its own), after a 1 s
warm-up drive:

- ``full``: the drive with every sensor (LiDAR 32 x 1024 at 10 Hz, camera, IMU,
  odometry, GPS, TF, ground truth and the 5 cm raster), ROS 1, uncompressed;
- baseline ``no-lidar``: the same drive without the LiDAR, to show what the ray casting
  costs;
- baseline ``naive``: the per-ray Python caster (:mod:`adcloud.synth._naive`) on a
  random sample of one sweep's rays, extrapolated to every ray of the drive, against
  the vectorized caster on whole sweeps from the same poses.

    .venv/bin/python benchmarks/bench_synth.py            # 60 s, 32 beams
    .venv/bin/python benchmarks/bench_synth.py --seconds 10 --beams 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def child(args: argparse.Namespace) -> None:
    """Generate one drive and print its figures as JSON (runs in a fresh process)."""
    from adcloud.synth import DriveConfig, generate_drive  # noqa: PLC0415

    config = DriveConfig(seconds=args.seconds, lidar_beams=args.beams, lidar=not args.no_lidar)
    started = time.perf_counter()
    cpu = time.process_time()
    result = generate_drive(config, Path(args.out), overwrite=True)
    wall = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "wall_s": wall,
                "cpu_s": time.process_time() - cpu,
                "peak_rss_mib": peak_kib / 1024,
                "bag_mb": result.bytes / 1e6,
                "messages": result.message_count,
            }
        )
    )


def run_child(seconds: float, beams: int, out: Path, no_lidar: bool) -> dict[str, float]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--seconds",
        str(seconds),
        "--beams",
        str(beams),
        "--out",
        str(out),
    ]
    if no_lidar:
        cmd.append("--no-lidar")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def naive_vs_vectorized(beams: int, sample: int, sweeps_in_drive: int) -> tuple[float, float]:
    """Seconds for all LiDAR rays of the drive: (naive extrapolated, vectorized extrapolated)."""
    from adcloud.synth import DriveConfig, build_world  # noqa: PLC0415
    from adcloud.synth._naive import cast_ray_naive  # noqa: PLC0415
    from adcloud.synth.frames import MOUNTS  # noqa: PLC0415
    from adcloud.synth.lidar import LidarModel  # noqa: PLC0415
    from adcloud.synth.trajectory import Driver, Trajectory, make_route  # noqa: PLC0415

    config = DriveConfig(lidar_beams=beams)
    world = build_world(config.seed)
    driver = Driver(world, make_route(world, config), config)
    traj = Trajectory.from_samples(
        world, np.concatenate([driver.initial_sample(), driver.advance(2.1)])
    )
    model = LidarModel.from_config(config)
    rng = np.random.default_rng(0)
    model.sweep(world, traj, 0.2, rng)  # warm-up
    started = time.perf_counter()
    stamps = np.arange(0.2, 2.05, 0.1)
    for stamp in stamps:
        model.sweep(world, traj, float(stamp), rng)
    per_sweep = (time.perf_counter() - started) / len(stamps)
    mount = MOUNTS["lidar"]
    origin, rot = traj.mount_pose(np.array([1.0]), np.asarray(mount.translation), mount.rotation)
    dirs = model.directions().reshape(-1, 3) @ rot[0].T
    pick = rng.choice(len(dirs), size=sample, replace=False)
    started = time.perf_counter()
    for i in pick:
        cast_ray_naive(world, origin[0], dirs[i], 1.0, max_range=config.lidar_max_range_m)
    per_ray = (time.perf_counter() - started) / sample
    rays = model.beams * model.columns
    return per_ray * rays * sweeps_in_drive, per_sweep * sweeps_in_drive


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--beams", type=int, default=32)
    parser.add_argument(
        "--naive-rays", type=int, default=200, help="rays timed with the naive caster"
    )
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--no-lidar", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    cores = len(os.sched_getaffinity(0))
    print(
        f"synth benchmark: {args.seconds:g} s drive, {args.beams} beams, {cores} cores, "
        f"numpy {np.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-synth-") as tmp:
        root = Path(tmp)
        run_child(1.0, args.beams, root / "warmup.bag", False)
        full = run_child(args.seconds, args.beams, root / "full.bag", False)
        bare = run_child(args.seconds, args.beams, root / "nolidar.bag", True)
    sweeps = round(args.seconds * 10) - 1
    naive_s, vector_s = naive_vs_vectorized(args.beams, args.naive_rays, sweeps)

    ratio = args.seconds / full["wall_s"]
    print(f"{'run':<28}{'wall s':>9}{'cpu s':>9}{'sim/wall':>10}{'peak MiB':>10}{'bag MB':>9}")
    for name, r in (("full (all sensors)", full), ("baseline: no LiDAR", bare)):
        print(
            f"{name:<28}{r['wall_s']:9.1f}{r['cpu_s']:9.1f}{args.seconds / r['wall_s']:10.2f}"
            f"{r['peak_rss_mib']:10.0f}{r['bag_mb']:9.0f}"
        )
    print(
        f"simulated/wall (full): {ratio:.2f}  "
        f"(target >= 0.5: {'met' if ratio >= 0.5 else 'MISSED'})"
    )
    print(f"LiDAR share of the wall time: {1 - bare['wall_s'] / full['wall_s']:.0%}")
    print(
        f"LiDAR ray casting for the whole drive: vectorized {vector_s:.1f} s, naive per-ray "
        f"loop {naive_s / 3600:.1f} h (extrapolated from {args.naive_rays} rays): "
        f"{naive_s / vector_s:.0f}x faster"
    )


if __name__ == "__main__":
    main()
