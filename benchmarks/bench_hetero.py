"""adcloud.hetero: every kernel on OpenCL devices against its NumPy reference, and the image
feature job on 1 vs 2 Spark executors.

Baselines, in the same run and on the same data:
- each kernel's NumPy reference (``device="numpy"``: vectorised NumPy, one core);
- for the feature job, the same job on one executor.

Targets (issue: hetero):
- ICP correspondence search and grid rasterization: >= 3x their NumPy reference on 2 cores
  (PoCL's CPU device);
- image feature job: >= 1.7x the throughput with 2 executors as with 1.

Every figure names the device it was taken on.  Where an OpenCL GPU exists the kernels also
run there and GPU/CPU ratios are printed.  Timings are medians of ``--repeat`` runs after a
warm-up run (which compiles the programs), device and NumPy measured alternately so that load
from other processes hits both alike.  The job runs 1- and 2-executor applications in
alternating rounds and compares the best run of each (medians printed beside it).

    .venv/bin/python benchmarks/bench_hetero.py            # everything (~3 min on 2 cores)
    .venv/bin/python benchmarks/bench_hetero.py --no-job   # kernels only
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from adcloud.hetero import (
    DeviceKind,
    GridSpec,
    HeteroSettings,
    align,
    build_grid,
    estimate_normals,
    extract_features,
    hog_features,
    list_devices,
    nearest_neighbors,
    open_device,
    rasterize,
    transform_points,
    voxel_downsample,
)
from adcloud.hetero._kernels.icp import GridOnDevice, MatchOnDevice
from adcloud.hetero._ply import read_ply
from adcloud.hetero.devices import ComputeDevice, OpenCLDevice
from adcloud.hetero.icp import _nearest_numpy, _rt, _system_numpy, _translation
from adcloud.hetero.lattice import lattice_origin, local_float32

REPO_ROOT = Path(__file__).resolve().parents[1]
SCAN_PAIR_NAME = "04_gicp_scan_pair_with_reference_tf"
SCAN_PAIR = (
    Path(os.environ.get("ADCLOUD_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    / SCAN_PAIR_NAME
)
"""The real scan pair; ``ADCLOUD_SHARED_DATA`` names another folder holding it."""
TARGETS = {"ICP correspondences": 3.0, "rasterize": 3.0}


def compare(
    device_fn: Callable[[], object], numpy_fn: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Median wall times (s) of the two functions, measured alternately so that load from
    other processes hits both alike; one warm-up call each (compiles the programs)."""
    device_fn()
    numpy_fn()
    device_times, numpy_times = [], []
    for _ in range(repeat):
        for fn, times in ((device_fn, device_times), (numpy_fn, numpy_times)):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    return statistics.median(device_times), statistics.median(numpy_times)


class Table:
    """Rows of (kernel, data, device time, NumPy time, speed-up), printed as they come."""

    def __init__(self, device: ComputeDevice) -> None:
        self.device = device
        self.rows: list[tuple[str, str, float, float]] = []
        print(f"\n== kernels on {device.info.describe()} vs NumPy reference (1 core) ==")
        print(f"{'kernel':<34} {'data':<44} {'device ms':>10} {'numpy ms':>10} {'speed-up':>9}")

    def add(self, kernel: str, data: str, device_s: float, numpy_s: float) -> None:
        self.rows.append((kernel, data, device_s, numpy_s))
        target = TARGETS.get(kernel)
        note = (
            f"  (target >= {target:.0f}x: {'met' if numpy_s / device_s >= target else 'NOT met'})"
            if target
            else ""
        )
        print(
            f"{kernel:<34} {data:<44} {device_s * 1e3:10.1f} {numpy_s * 1e3:10.1f} "
            f"{numpy_s / device_s:8.1f}x{note}",
            flush=True,
        )


def synthetic_scene(n: int, seed: int = 0) -> np.ndarray:
    """(n, 4) float32 x y z intensity: ground, walls, poles and clutter over 100 x 100 m."""
    rng = np.random.default_rng(seed)
    parts = []
    k = n // 4
    parts.append(np.column_stack([rng.uniform(0, 100, (k, 2)), rng.normal(0, 0.03, k)]))
    walls = np.column_stack(
        [rng.uniform(0, 100, k), np.where(rng.random(k) < 0.5, 5.0, 95.0), rng.uniform(0, 8, k)]
    )
    parts.append(walls + rng.normal(0, 0.02, walls.shape))
    poles = rng.integers(0, 50, k)
    centres = rng.uniform(10, 90, (50, 2))
    angle = rng.uniform(0, 2 * np.pi, k)
    parts.append(
        np.column_stack(
            [
                centres[poles, 0] + 0.15 * np.cos(angle),
                centres[poles, 1] + 0.15 * np.sin(angle),
                rng.uniform(0, 6, k),
            ]
        )
    )
    rest = n - 3 * k
    parts.append(np.column_stack([rng.uniform(0, 100, (rest, 2)), rng.uniform(0, 3, rest)]))
    xyz = np.concatenate(parts)[rng.permutation(n)]
    intensity = rng.uniform(0, 255, (n, 1))
    return np.ascontiguousarray(np.hstack([xyz, intensity]), dtype=np.float32)


def bench_kernels(device: ComputeDevice, repeat: int, quick: bool) -> Table:
    table = Table(device)
    n = 250_000 if quick else 1_000_000
    cloud = synthetic_scene(n)
    matrix = np.eye(4)
    matrix[:3, :3] = [[0.8, -0.6, 0], [0.6, 0.8, 0], [0, 0, 1]]
    matrix[:3, 3] = [3.0, -2.0, 0.5]

    def pair(kernel: str, data: str, fn: Callable[[ComputeDevice | str], object]) -> None:
        table.add(kernel, data, *compare(lambda: fn(device), lambda: fn("numpy"), repeat))

    pair(
        "transform",
        f"{n:,} points (N, 4) float32",
        lambda d: transform_points(cloud, matrix, device=d),
    )
    pair(
        "voxel downsample",
        f"{n:,} points, 0.25 m voxels",
        lambda d: voxel_downsample(cloud, 0.25, device=d),
    )
    # One sweep's worth of points, then a map tile of aggregated sweeps (4x the points).
    dense = synthetic_scene(4 * n, seed=5)
    for points in (cloud, dense):
        for cells, size in ((400, 0.25), (1000, 0.1), (2000, 0.05)):
            grid = GridSpec(0.0, 0.0, size, cells, cells)
            pair(
                "rasterize",
                f"{len(points):,} points -> {cells}x{cells} cells of {size} m",
                lambda d, grid=grid, points=points: rasterize(points, grid, device=d),
            )
    if isinstance(device, OpenCLDevice) and device.info.kind == DeviceKind.CPU:
        # One LiDAR sweep's reduction, as the map's grid stage runs it per sweep: on a CPU
        # device the kernels' launches cost more than NumPy's whole reduction, so ``auto``
        # gives rasters under HOST_BELOW points and cells to the host.
        sweep = synthetic_scene(22_000, seed=7)
        sweep_grid = GridSpec(0.0, 0.0, 1.0, 100, 100)
        for strategy, what in (("binned", "binned kernels"), ("auto", "auto: on the host")):
            table.add(
                f"rasterize, one sweep ({what})",
                f"{len(sweep):,} points -> 100x100 cells of 1 m",
                *compare(
                    lambda s=strategy: rasterize(sweep, sweep_grid, strategy=s, device=device),
                    lambda: rasterize(sweep, sweep_grid, device="numpy"),
                    repeat,
                ),
            )
    if isinstance(device, OpenCLDevice):
        grid = GridSpec(0.0, 0.0, 0.1, 1000, 1000)
        other = "atomic" if device.info.kind == DeviceKind.CPU else "binned"
        table.add(
            f"voxel downsample ({other} strategy)",
            f"{n:,} points, 0.25 m voxels",
            *compare(
                lambda: voxel_downsample(cloud, 0.25, strategy=other, device=device),
                lambda: voxel_downsample(cloud, 0.25, device="numpy"),
                repeat,
            ),
        )
        table.add(
            f"rasterize ({other} strategy)",
            f"{n:,} points -> 1000x1000 cells of 0.1 m",
            *compare(
                lambda: rasterize(cloud, grid, strategy=other, device=device),
                lambda: rasterize(cloud, grid, device="numpy"),
                repeat,
            ),
        )
    images = np.random.default_rng(1).integers(
        0, 256, (8 if quick else 32, 480, 640, 3), dtype=np.uint8
    )
    pair(
        "HOG features",
        f"{len(images)} RGB images 640x480",
        lambda d: hog_features(images, device=d),
    )
    small = np.random.default_rng(2).integers(0, 256, (256, 120, 160, 3), dtype=np.uint8)
    pair("HOG features", "256 RGB images 160x120", lambda d: hog_features(small, device=d))
    if SCAN_PAIR.is_dir():
        bench_icp(table, device, repeat)
    else:
        print(f"(ICP rows skipped: {SCAN_PAIR} not found)")
    return table


def bench_correspondences(
    table: Table,
    device: ComputeDevice,
    source: np.ndarray,
    target: np.ndarray,
    radius: float,
    repeat: int,
) -> None:
    """Nearest neighbours within ``radius`` of every source point, from identity."""
    grid = build_grid(target, radius)
    label = f"real scan pair {len(source):,} -> {len(target):,} pts, r {radius} m"
    origin = lattice_origin(source, 1.0)
    rows = local_float32(source, origin)
    to_grid = _translation(-grid.origin) @ _translation(origin)
    reference = functools.partial(_nearest_numpy, rows, to_grid, grid, radius)
    if isinstance(device, OpenCLDevice):
        # As inside align(): the clouds stay in device buffers between iterations.
        matcher = MatchOnDevice(GridOnDevice(device, grid), rows)
        matcher.set_transform(_rt(to_grid))

        def resident() -> None:
            matcher.nearest(radius)
            matcher.matches()

        table.add("ICP correspondences", label, *compare(resident, reference, repeat))
    api = functools.partial(nearest_neighbors, source, grid, radius, device=device)
    table.add("ICP correspondences (API call)", label, *compare(api, reference, repeat))


def bench_icp(table: Table, device: ComputeDevice, repeat: int) -> None:
    source, _ = read_ply(SCAN_PAIR / "small_gicp_source.ply")
    target, _ = read_ply(SCAN_PAIR / "small_gicp_target.ply")
    reference = np.loadtxt(SCAN_PAIR / "small_gicp_T_target_source.txt")
    small_source = voxel_downsample(source[:, :3], 0.25, device="numpy").points
    small_target = voxel_downsample(target[:, :3], 0.25, device="numpy").points
    bench_correspondences(table, device, small_source, small_target, 1.0, repeat)
    bench_correspondences(table, device, source[:, :3].copy(), target[:, :3].copy(), 0.5, 2)
    table.add(
        "normals (PCA, r 0.6 m)",
        f"{len(small_target):,} target points",
        *compare(
            lambda: estimate_normals(small_target, 0.6, device=device),
            lambda: estimate_normals(small_target, 0.6, device="numpy"),
            repeat,
        ),
    )
    if isinstance(device, OpenCLDevice):
        grid = build_grid(small_target, 1.0)
        normals = np.ascontiguousarray(
            estimate_normals(small_target, 0.6, device=device)[grid.order]
        )
        origin = lattice_origin(small_source, 1.0)
        rows = local_float32(small_source, origin)
        to_grid = _translation(-grid.origin) @ reference @ _translation(origin)
        matcher = MatchOnDevice(GridOnDevice(device, grid, normals), rows)
        matcher.set_transform(_rt(to_grid))
        matcher.nearest(1.0)
        match = matcher.matches()[0]
        table.add(
            "normal equations (6x6 reduction)",
            f"{(match >= 0).sum():,} matched points",
            *compare(
                lambda: matcher.system(0.1),
                lambda: _system_numpy(rows, to_grid, grid, normals, match, 0.1),
                repeat,
            ),
        )
    table.add(
        "ICP align (end to end)",
        f"{len(source):,} + {len(target):,} pts, 0.25 m voxels",
        *compare(
            lambda: align(source, target, device=device),
            lambda: align(source, target, device="numpy"),
            max(1, repeat // 2),
        ),
    )


# -- the image feature job on a standalone cluster ------------------------------------------------


def write_camera_bag(path: Path, count: int, height: int, width: int) -> Path:
    from rosbags.rosbag1 import Writer  # noqa: PLC0415
    from rosbags.typesys import Stores, get_typestore  # noqa: PLC0415

    store = get_typestore(Stores.ROS1_NOETIC)
    types = store.types
    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    t0 = 1_700_000_000_000_000_000
    with Writer(path) as writer:
        conn = writer.add_connection("/camera/image_raw", "sensor_msgs/msg/Image", typestore=store)
        for i in range(count):
            base = (
                128 + 90 * np.sin(x / (3 + i % 7) + y / (5 + i % 11)) + rng.normal(0, 10, x.shape)
            )
            image = np.clip(np.stack([base, 255 - base, base * 0.5 + 60], axis=-1), 0, 255).astype(
                np.uint8
            )
            stamp = t0 + i * 50_000_000
            sec, nsec = divmod(stamp, 10**9)
            header = types["std_msgs/msg/Header"](
                seq=i,
                stamp=types["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec),
                frame_id="cam",
            )
            msg = types["sensor_msgs/msg/Image"](
                header=header, height=height, width=width, encoding="rgb8", is_bigendian=0,
                step=width * 3, data=image.reshape(-1),
            )  # fmt: skip
            writer.write(conn, stamp, bytes(store.serialize_ros1(msg, "sensor_msgs/msg/Image")))
    return path


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"


def bench_job(repeat: int, rounds: int, quick: bool, workdir: Path) -> float:
    """Throughput of the feature job with 1 and 2 executors, alternating ``rounds`` times.

    Each round starts a 1-executor and then a 2-executor application on the same cluster and
    times ``repeat`` runs of each after a warm-up run.  The figure compared is the best run of
    each configuration (the least disturbed by other processes on a shared machine); medians
    and the load average are printed beside it.
    """
    from adcloud.spark import SparkSettings, StandaloneCluster, get_session  # noqa: PLC0415

    count, height, width = (240, 240, 320) if quick else (1200, 240, 320)
    bag = write_camera_bag(workdir / "camera.bag", count, height, width)
    script = workdir / "discover.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"ADCLOUD_HETERO_GPU_KINDS=cpu ADCLOUD_HETERO_SPLIT=2 ADCLOUD_PYTHON={sys.executable} "
        f"exec {REPO_ROOT / 'deploy' / 'discover_opencl.sh'} gpu\n"
    )
    script.chmod(0o755)
    print(
        f"\n== image feature job: {count} RGB images {width}x{height} "
        f"({bag.stat().st_size / 1e6:.0f} MB bag, 12 partitions), standalone cluster, "
        "1 vs 2 executors ==\n"
        "each executor: 1 core and 1 'gpu' = one PoCL sub-device of 1 compute unit "
        "(the CPU device split in two by the discovery script)"
    )
    light = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    rates: dict[int, list[float]] = {1: [], 2: []}
    with StandaloneCluster(
        1, cores=2, memory="2g", resources={"gpu": (2, script)}, log_dir=workdir / "logs"
    ) as cluster:
        for round_index in range(rounds):
            for executors in (1, 2):
                session = get_session(
                    SparkSettings(
                        master=cluster.master_url,
                        app_name=f"bench-hetero-{executors}",
                        executor_memory="768m",
                    ),
                    **{
                        **cluster.session_conf(),
                        "spark.cores.max": str(executors),
                        "spark.executor.cores": "1",
                        "spark.executor.resource.gpu.amount": "1",
                        "spark.executor.resource.gpu.discoveryScript": str(script),
                        "spark.task.resource.gpu.amount": "1",
                        "spark.ui.enabled": "false",
                        "spark.ui.showConsoleProgress": "false",
                        "spark.driver.extraJavaOptions": light,
                        "spark.executor.extraJavaOptions": light,
                    },
                )
                run = functools.partial(
                    extract_features, session, [str(bag)], str(workdir / f"out-{executors}"),
                    partitions_per_bag=12, overwrite=True, settings=HeteroSettings(),
                )  # fmt: skip
                run()  # warm-up: Python workers start, programs compile
                this_round = []
                devices: dict[str, int] = {}
                for _ in range(repeat):
                    result = run()
                    this_round.append(result.images_per_second)
                    devices = result.devices
                rates[executors] += this_round
                used = ", ".join(f"{k} x{v}" for k, v in sorted(devices.items()))
                print(
                    f"round {round_index + 1}: {executors} executor(s) "
                    f"{' '.join(f'{r:6.1f}' for r in this_round)} images/s "
                    f"(load average {_load()}; images per device: {used})",
                    flush=True,
                )
                session.stop()
    best = {k: max(v) for k, v in rates.items()}
    medians = {k: statistics.median(v) for k, v in rates.items()}
    speedup = best[2] / best[1]
    verdict = "met" if speedup >= 1.7 else "NOT met"
    print(
        f"best run: 1 executor {best[1]:.1f}, 2 executors {best[2]:.1f} images/s -> "
        f"{speedup:.2f}x (target >= 1.7x: {verdict}); medians {medians[1]:.1f} / "
        f"{medians[2]:.1f} -> {medians[2] / medians[1]:.2f}x"
    )
    return speedup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=5, help="measured runs per figure (5)")
    parser.add_argument("--quick", action="store_true", help="smaller data (a smoke run)")
    parser.add_argument("--no-job", action="store_true", help="skip the Spark feature job")
    parser.add_argument("--rounds", type=int, default=3, help="1/2-executor rounds of the job (3)")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    args = parser.parse_args(argv)
    devices = list_devices()
    cpu = next((d for d in devices if d.kind == DeviceKind.CPU), None)
    gpu = next((d for d in devices if d.kind == DeviceKind.GPU), None)
    print("OpenCL devices:", "; ".join(d.describe() for d in devices) or "none")
    tables: dict[str, Table] = {}
    if not args.no_kernels:
        for info in (cpu, gpu):
            if info is not None:
                tables[info.kind.value] = bench_kernels(
                    open_device(info.address), args.repeat, args.quick
                )
        if gpu is None:
            print("\n(no OpenCL GPU on this machine: GPU vs CPU figures not taken)")
        elif cpu is not None:
            print(f"\n== GPU ({gpu.name}) vs CPU ({cpu.name}) ==")
            # the tables differ where each device's other strategy is timed: pair by name
            cpu_rows = {(c[0], c[1]): c for c in tables["cpu"].rows}
            for g in tables["gpu"].rows:
                c = cpu_rows.get((g[0], g[1]))
                if c is not None:
                    print(f"{g[0]:<34} {g[1]:<44} {c[2] / g[2]:8.1f}x")
    if not args.no_job:
        with tempfile.TemporaryDirectory(prefix="bench-hetero-") as tmp:
            bench_job(max(1, args.repeat // 2), args.rounds, args.quick, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
