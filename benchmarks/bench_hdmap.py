"""adcloud.hdmap: the map build against its baselines, in one run.

Baselines, in the same run and on the same data:
- the same stages as separate jobs exchanging fsync'ed files (``mode="files"``) against the
  one-job pipeline with intermediates cached in executor memory (target >= 2x);
- Open3D's point-to-plane ICP (``adcloud.hdmap.pcmap.open3d_register``) against
  ``adcloud.hetero.align`` on OpenCL, on the same scan-to-local-map pairs and the same cores,
  at equal or better error (target >= 1x);
- KISS-ICP LiDAR odometry: its ATE next to the build's trajectory ATE;
- the whole build of a one-minute 32-beam drive (target <= 60 s on 2 cores);
- the build on a standalone cluster with 2 executors against 1 (target >= 1.7x), each
  application warmed up first by the unmeasured build of a 5 s drive (``--no-cluster-warmup``
  measures from the application's first job);
- a nightly build adding a short drive to the map of the long one: tiles out of the new
  drive's reach carried as they are, against the same build merging every tile again
  (``hdmap.carry_tiles=false``, what every build did before) -- time and the disk the new
  version takes, and the bytes the same build moves on a map kept on an object store,
  reported;
- a map version uploaded to and copied on an S3 server (moto's, on this machine): one
  fsspec call with every file against one call per file (reported);
- planning a nightly build of four new bags (hashing them): ``hdmap.hash_threads`` bags at
  a time against one after the other (reported).

    .venv/bin/python benchmarks/bench_hdmap.py              # everything (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_hdmap.py --beams 16   # a cheaper drive
    .venv/bin/python benchmarks/bench_hdmap.py --skip-cluster --skip-modes
    .venv/bin/python benchmarks/bench_hdmap.py --nightly-only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
from _cpu import CpuShare
from _timeline import event_log_conf, slot_report
from fsspec.implementations.memory import MemoryFileSystem

from adcloud.hdmap import HdmapSettings, build_map, evaluate_map, read_drive
from adcloud.hdmap.baseline import kiss_icp_trajectory
from adcloud.hdmap.mapdir import MapDir, MapDirSettings
from adcloud.hdmap.pcmap import deskew, open3d_register, register_scan
from adcloud.hdmap.trajectory import Trajectory, absolute_trajectory_error
from adcloud.hetero import list_devices
from adcloud.synth import DriveConfig, generate_drive, read_poses


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _truth(truth_dir: Path) -> Trajectory:
    t, xyz, quat = read_poses(truth_dir)
    return Trajectory.from_xyz_quat(t, xyz, quat)


def _session(master: str, **conf: str):  # type: ignore[no-untyped-def]
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    return get_session(
        SparkSettings(master=master, app_name="bench-hdmap", driver_memory="3g"),
        **{"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", **conf},
    )


def bench_build(bag: Path, truth: Path, work: Path, modes: bool) -> dict[str, float]:
    """Whole build (memory mode), accuracy, and the files-mode comparison on local[2]."""
    spark = _session("local[2]")
    out: dict[str, float] = {}
    times: dict[str, list[float]] = {"memory": [], "files": []}
    order = ["memory", "files"] if modes else ["memory"]
    rounds = 2 if modes else 1
    for r in range(rounds):
        for mode in order:
            target = work / f"map-{mode}-{r}"
            started = time.perf_counter()
            summary = build_map(spark, str(bag), str(target), HdmapSettings(mode=mode))
            elapsed = time.perf_counter() - started
            times[mode].append(elapsed)
            stages = ", ".join(f"{k} {v:.1f}" for k, v in summary.timings.items())
            print(f"build ({mode}): {elapsed:.1f} s [{stages}] load {_load()}", flush=True)
            if r == 0 and mode == "memory":
                result = evaluate_map(str(target), truth)
                for m in result.metrics:
                    verdict = {True: "met", False: "NOT met", None: "n/a"}[m.passed]
                    value = "n/a" if m.value is None else f"{m.value:.4f}"
                    print(f"  {m.name}: {value} {m.unit} (target {m.op} {m.target:g}: {verdict})")
                out["ate_m"] = result.metric("ate_rmse").value or float("nan")
            shutil.rmtree(target, ignore_errors=True)
    out["memory_s"] = min(times["memory"])
    verdict = "met" if out["memory_s"] <= 60 else "NOT met"
    print(f"whole build, best of {rounds}: {out['memory_s']:.1f} s (target <= 60 s: {verdict})")
    if modes:
        out["files_s"] = min(times["files"])
        ratio = out["files_s"] / out["memory_s"]
        verdict = "met" if ratio >= 2 else "NOT met"
        print(
            f"one job (memory) vs separate jobs (files, fsync): {out['memory_s']:.1f} s vs "
            f"{out['files_s']:.1f} s -> {ratio:.2f}x (target >= 2x: {verdict}); medians "
            f"{statistics.median(times['memory']):.1f} / {statistics.median(times['files']):.1f}"
        )
    spark.stop()
    return out


def bench_icp(bag: Path, truth_dir: Path, pairs: int) -> None:
    """OpenCL ICP vs Open3D on scan-to-local-map pairs built with the truth poses."""
    drive = read_drive(str(bag))
    truth = _truth(truth_dir)
    scans = drive.scans[5 :: max(1, len(drive.scans) // (pairs + 6))][: pairs + 1]
    rng = np.random.default_rng(0)
    rows = []
    device = next((d.address for d in list_devices() if d.kind != "numpy"), "numpy")
    for scan in scans[:pairs]:
        i = next(k for k, s in enumerate(drive.scans) if s.stamp == scan.stamp)
        local = [
            drive.scans[j] for j in range(max(0, i - 6), min(len(drive.scans), i + 7)) if j != i
        ]
        target = np.concatenate([deskew(s, truth, drive.extrinsics)[0] for s in local])
        source, _ = deskew(scan, truth, drive.extrinsics)
        centre = source.mean(axis=0)
        source, target = source - centre, target - centre
        init = np.eye(4)
        yaw = rng.normal(scale=0.03)
        init[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
        init[:3, 3] = rng.normal(scale=0.5, size=3) * [1, 1, 0.2]
        timings = {}
        errors = {}
        runners = {
            "opencl": functools.partial(register_scan, source, target, init, device=device),
            "open3d": functools.partial(open3d_register, source, target, init),
        }
        for name, fn in runners.items():
            fn()  # warm-up (program build, caches)
            started = time.perf_counter()
            transform, _ = fn()
            timings[name] = time.perf_counter() - started
            errors[name] = float(np.linalg.norm(transform[:3, 3]))
        rows.append((timings["opencl"], timings["open3d"], errors["opencl"], errors["open3d"]))
    t_cl, t_o3d, e_cl, e_o3d = (float(np.median([r[k] for r in rows])) for k in range(4))
    ratio = t_o3d / t_cl
    equal = e_cl <= e_o3d + 0.005
    verdict = "met" if ratio >= 1 and equal else "NOT met"
    print(
        f"ICP, {len(rows)} scan-to-local-map pairs (0.25 m voxels) on {device}: OpenCL "
        f"{t_cl * 1e3:.0f} ms at {e_cl * 100:.1f} cm vs Open3D {t_o3d * 1e3:.0f} ms at "
        f"{e_o3d * 100:.1f} cm (median residual translation) -> {ratio:.2f}x "
        f"(target >= 1x at equal or better error: {verdict})"
    )


def bench_kiss(bag: Path, truth_dir: Path, ours: float) -> None:
    drive = read_drive(str(bag))
    started = time.perf_counter()
    kiss = kiss_icp_trajectory(drive.scans, mount=drive.extrinsics.get("lidar"))
    seconds = time.perf_counter() - started
    ate = absolute_trajectory_error(kiss, _truth(truth_dir)).rmse
    print(
        f"trajectory ATE: adcloud {ours * 100:.1f} cm vs KISS-ICP {ate * 100:.1f} cm "
        f"(KISS-ICP ran {seconds:.1f} s)"
    )


def lost_executors(spark) -> int:  # type: ignore[no-untyped-def]
    """Executors of this application that died (e.g. out of memory: exit code 52), from
    Spark's status store; -1 if it cannot be read."""
    lost = 0
    try:
        summaries = spark.sparkContext._jsc.sc().statusStore().executorList(False).iterator()
        while summaries.hasNext():
            summary = summaries.next()
            if summary.id() != "driver" and not summary.isActive():
                lost += 1
    except Exception:  # an internal API; the figure is only a warning
        return -1
    return lost


def bench_cluster(
    bag: Path, work: Path, rounds: int, warmup: Path | None = None, slots: bool = False
) -> None:
    """The whole build with 1 and 2 executors of one core each.  With ``warmup`` (a short
    drive) each application first builds its map, unmeasured, as every Spark application of
    the training benchmark does: a fresh executor JVM compiles its hot paths and its Python
    workers import their modules in the first jobs, which a long-lived cluster pays once.
    ``slots``: print, for each application's best round, where its task slots stood idle
    (Spark's event log, :mod:`_timeline`)."""
    from adcloud.spark import StandaloneCluster  # noqa: PLC0415

    best: dict[int, float] = {}
    lost: dict[int, int] = {}
    windows: dict[int, tuple[float, float]] = {}
    events = work / "events"
    with StandaloneCluster(1, cores=2, memory="3g", log_dir=work / "logs") as cluster:
        for executors in (1, 2):
            conf = {
                **cluster.session_conf(),
                "spark.cores.max": str(executors),
                "spark.executor.cores": "1",
                "spark.executor.memory": "1400m",
                **(event_log_conf(events) if slots else {}),
            }
            spark = _session(cluster.master_url, **conf)
            if warmup is not None:
                started = time.perf_counter()
                build_map(spark, str(warmup), str(work / "cluster-warmup"))
                shutil.rmtree(work / "cluster-warmup", ignore_errors=True)
                print(
                    f"{executors} executor(s): warm-up build of {warmup.name} "
                    f"{time.perf_counter() - started:.1f} s (not counted)",
                    flush=True,
                )
            runs = []
            for r in range(rounds):
                target = work / f"cluster-{executors}-{r}"
                started, wall = time.perf_counter(), time.time()
                with CpuShare() as share:
                    build_map(spark, str(bag), str(target))
                runs.append(time.perf_counter() - started)
                if runs[-1] == min(runs):
                    windows[executors] = (wall, time.time())
                shutil.rmtree(target, ignore_errors=True)
                print(
                    f"{executors} executor(s): {runs[-1]:.1f} s (load {_load()}); {share}",
                    flush=True,
                )
            best[executors] = min(runs)
            lost[executors] = lost_executors(spark)
            if lost[executors]:
                print(
                    f"WARNING: {lost[executors]} executor(s) of the {executors}-executor "
                    "application died (see 'Lost executor' above: out of memory?) and were "
                    "replaced; its time includes the retries",
                    flush=True,
                )
            spark.stop()
    for executors, (began, ended) in windows.items() if slots else ():
        report = slot_report(events, began, ended, executors)
        print(f"{executors} executor(s), best round:\n{report}", flush=True)
    ratio = best[1] / best[2]
    verdict = "met" if ratio >= 1.7 else "NOT met"
    if any(n != 0 for n in lost.values()):
        verdict = "not a valid comparison: executors were lost"
    print(
        f"standalone cluster, best of {rounds}: 1 executor {best[1]:.1f} s, 2 executors "
        f"{best[2]:.1f} s -> {ratio:.2f}x (target >= 1.7x: {verdict})"
    )


def bench_nightly(cfg: DriveConfig, bag: Path, work: Path, seconds: float) -> None:
    """The map of ``bag``, then a nightly build adding a ``seconds`` drive of the same world
    (its first stretch): carrying the tiles out of its reach against merging them all."""
    night = generate_drive(dataclasses.replace(cfg, seconds=seconds), work / "night.bag")
    spark = _session("local[2]")
    base = work / "nightly-base"
    build_map(spark, str(bag), str(base))
    times: dict[bool, float] = {}
    for carry in (True, False):
        target = work / f"nightly-{carry}"
        shutil.copytree(base, target)
        started = time.perf_counter()
        summary = build_map(
            spark, [str(bag), str(night.bag)], str(target), HdmapSettings(carry_tiles=carry)
        )
        times[carry] = time.perf_counter() - started
        t = summary.timings
        before = {p.name: p.stat().st_mtime_ns for p in (base / "versions").rglob("grid/*.tif")}
        version = summary.result.version
        assert version is not None and version.path is not None
        grid = sorted(version.path.glob("grid/*.tif"))
        carried = sum(before.get(p.name) == p.stat().st_mtime_ns for p in grid)
        # the disk the new version took: its files that are not the parent's (hard links)
        older = [d for d in (target / "versions").iterdir() if d != version.path]
        parent = {p.stat().st_ino for d in older for p in d.rglob("*") if p.is_file()}
        files = [p.stat() for p in version.path.rglob("*") if p.is_file()]
        whole = sum(f.st_size for f in files)
        own = sum(f.st_size for f in files if f.st_nlink == 1 or f.st_ino not in parent)
        print(
            f"nightly build, {'carrying' if carry else 'merging every tile'}: "
            f"{times[carry]:.1f} s (grid {t['grid']:.1f}, cloud {t['cloud']:.1f}, labels and "
            f"outputs {t['labels+outputs']:.1f}); {carried} of {len(grid)} grid tiles carried; "
            f"new disk {own / 2**20:.0f} of {whole / 2**20:.0f} MiB; load {_load()}",
            flush=True,
        )
        shutil.rmtree(target, ignore_errors=True)
    print(
        f"nightly build of a {seconds:.0f} s drive into the map: {times[True]:.1f} s carrying "
        f"vs {times[False]:.1f} s merging every tile -> {times[False] / times[True]:.2f}x "
        "(reported)"
    )
    _nightly_on_a_store(spark, base, [str(bag), str(night.bag)])
    spark.stop()
    bench_s3_moves(base / "versions" / "000001", work)


@contextlib.contextmanager
def _s3_server(work: Path) -> Iterator[str]:
    """moto's S3-protocol server in a subprocess on 127.0.0.1; yields its endpoint URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with (work / "moto.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_path = work / "moto.log"
                    raise RuntimeError(f"the S3 server did not start (see {log_path})") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_s3_moves(version: Path, work: Path, rounds: int = 3) -> None:
    """A real map version uploaded to and copied on an S3 server (moto's, on this machine)
    by the map directory's fsspec backend, one list per move, against one fsspec call per
    file (what it did before).  Reported: moto answers on 127.0.0.1 in about a millisecond,
    where S3 takes tens, so this is the least the lists gain."""
    import fsspec  # noqa: PLC0415

    from adcloud.hdmap.mapdir import _FsspecFiles  # noqa: PLC0415

    files = sorted(p for p in version.rglob("*") if p.is_file())
    rels = [p.relative_to(version).as_posix() for p in files]
    size = sum(p.stat().st_size for p in files) / 1e6
    with _s3_server(work) as endpoint:
        options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        fs.mkdir("bench-maps")
        backend = _FsspecFiles(fs)
        times: dict[str, list[float]] = {k: [] for k in ("put 1", "put n", "copy 1", "copy n")}
        for r in range(rounds):
            base = f"bench-maps/r{r}"
            started = time.perf_counter()
            for p, rel in zip(files, rels, strict=True):
                fs.put_file(str(p), f"{base}/one/{rel}")
            times["put 1"].append(time.perf_counter() - started)
            started = time.perf_counter()
            backend.put_tree(version, f"{base}/list")
            times["put n"].append(time.perf_counter() - started)
            started = time.perf_counter()
            for rel in rels:
                fs.copy(f"{base}/one/{rel}", f"{base}/one-copy/{rel}")
            times["copy 1"].append(time.perf_counter() - started)
            started = time.perf_counter()
            backend.copy_many([(f"{base}/list/{rel}", f"{base}/list-copy/{rel}") for rel in rels])
            times["copy n"].append(time.perf_counter() - started)
            assert fs.cat_file(f"{base}/list-copy/{rels[-1]}") == files[-1].read_bytes()
        best = {k: min(v) for k, v in times.items()}
    print(
        f"a map version on S3 (moto on 127.0.0.1; {len(files)} files, {size:.0f} MB), best of "
        f"{rounds}: upload one call per file {best['put 1']:.2f} s, one list "
        f"{best['put n']:.2f} s -> {best['put 1'] / best['put n']:.2f}x; carried copies one "
        f"call per file {best['copy 1']:.2f} s, one list {best['copy n']:.2f} s -> "
        f"{best['copy 1'] / best['copy n']:.2f}x (reported; load {_load()})",
        flush=True,
    )


def _nightly_on_a_store(spark: object, base: Path, bags: list[str]) -> None:
    """The carrying nightly build of the map ``base`` kept on an object store (fsspec's
    in-memory one): the bytes it reads from and writes to the store, against the whole
    parent downloaded and the whole new version uploaded (what such builds did before)."""
    fs = fsspec.filesystem("memory")
    bucket = f"/bench-nightly-{time.monotonic_ns()}/map"
    for path in sorted(base.rglob("*")):
        if path.is_file():
            fs.pipe_file(f"{bucket}/{path.relative_to(base).as_posix()}", path.read_bytes())
    moved = {"read": 0, "written": 0, "copied": 0}
    store_open, store_copy = MemoryFileSystem._open, MemoryFileSystem.cp_file

    def opened(self: MemoryFileSystem, path: str, mode: str = "rb", **kw: object) -> object:
        f = store_open(self, path, mode, **kw)
        if mode == "rb":
            moved["read"] += int(self.size(path))
        return f

    def copied(self: MemoryFileSystem, path1: str, path2: str, **kw: object) -> None:
        moved["copied"] += int(self.size(path1))
        store_copy(self, path1, path2, **kw)

    written_before = sum(fs.du(bucket, total=False).values())
    MemoryFileSystem._open, MemoryFileSystem.cp_file = opened, copied  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        summary = build_map(spark, bags, f"memory://{bucket}")  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
    finally:
        MemoryFileSystem._open, MemoryFileSystem.cp_file = store_open, store_copy  # type: ignore[method-assign]
    version = summary.result.version
    assert version is not None
    sizes = fs.du(bucket, total=False)
    moved["written"] = sum(sizes.values()) - written_before - moved["copied"]
    parent = sum(v for k, v in sizes.items() if "/versions/000001/" in k)
    new = sum(v for k, v in sizes.items() if f"/versions/{version.id}/" in k)
    mib = 2**20
    print(
        f"nightly build of the map on an object store: {seconds:.1f} s; read "
        f"{moved['read'] / mib:.0f} MiB from it, wrote {moved['written'] / mib:.0f} MiB, had it "
        f"copy {moved['copied'] / mib:.0f} MiB; a whole download and upload would move "
        f"{parent / mib:.0f} + {new / mib:.0f} MiB (reported)",
        flush=True,
    )
    fs.rm(bucket.rsplit("/", 1)[0], recursive=True)


def bench_planning(bag: Path, work: Path, copies: int = 4, rounds: int = 3) -> None:
    """Plan a build of ``copies`` new bags (the drive's bytes, each with one byte of its own
    appended, so that every one is a new drive): hashed one at a time against
    ``MapDirSettings.hash_threads`` at a time.  The bags are in the page cache (read once
    before), so this measures hashing on the cores, not the disk."""
    bags = []
    for i in range(copies):
        copy = work / f"plan-{i}.bag"
        shutil.copyfile(bag, copy)
        with copy.open("ab") as f:
            f.write(bytes([i]))
        bags.append(copy)
    threads = MapDirSettings().hash_threads
    times: dict[int, list[float]] = {1: [], threads: []}
    for r in range(rounds):
        for n in (1, threads) if r % 2 == 0 else (threads, 1):
            started = time.perf_counter()
            plan = MapDir(work / f"plan-map-{n}", MapDirSettings(hash_threads=n)).plan(bags)
            times[n].append(time.perf_counter() - started)
            assert len(plan.new_drives) == copies
    total = sum(b.stat().st_size for b in bags) / 1e6
    one, many = min(times[1]), min(times[threads])
    print(
        f"planning {copies} new bags ({total:.0f} MB, page-cached), best of {rounds}: one at a "
        f"time {one:.2f} s ({total / one:.0f} MB/s), {threads} at a time {many:.2f} s "
        f"({total / many:.0f} MB/s) -> {one / many:.2f}x (reported; load {_load()})"
    )
    for b in bags:
        b.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beams", type=int, default=32, help="LiDAR beams of the drive (32)")
    parser.add_argument("--seconds", type=float, default=60.0, help="drive length (60 s)")
    parser.add_argument("--pairs", type=int, default=8, help="ICP scan pairs (8)")
    parser.add_argument("--rounds", type=int, default=1, help="cluster rounds (1)")
    parser.add_argument(
        "--cluster-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each cluster application first builds a 5 s drive, unmeasured (default: on)",
    )
    parser.add_argument(
        "--slots",
        action="store_true",
        help="with the cluster figure: where each application's task slots stood idle, "
        "job by job (from Spark's event log)",
    )
    parser.add_argument("--skip-modes", action="store_true", help="no files-mode comparison")
    parser.add_argument("--skip-cluster", action="store_true", help="no 1 vs 2 executors")
    parser.add_argument("--skip-kiss", action="store_true", help="no KISS-ICP baseline")
    parser.add_argument("--skip-build", action="store_true", help="no build/accuracy/modes")
    parser.add_argument("--skip-icp", action="store_true", help="no OpenCL vs Open3D ICP")
    parser.add_argument("--skip-nightly", action="store_true", help="no nightly-build figure")
    parser.add_argument("--nightly-only", action="store_true", help="only the nightly-build figure")
    parser.add_argument(
        "--night-seconds", type=float, default=10.0, help="the nightly drive's length (10 s)"
    )
    args = parser.parse_args(argv)
    if args.nightly_only:
        args.skip_build = args.skip_icp = args.skip_kiss = args.skip_cluster = True
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-hdmap-") as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        cfg = DriveConfig(seconds=args.seconds, seed=7, lidar_beams=args.beams, camera=False)
        drive = generate_drive(cfg, work / "drive.bag")
        print(
            f"== hdmap: {args.seconds:.0f} s drive, {args.beams} beams x 1024 columns, "
            f"{drive.bytes / 1e6:.0f} MB (generated in {time.perf_counter() - started:.0f} s); "
            f"2 cores, load {_load()} =="
        )
        figures = (
            {}
            if args.skip_build
            else bench_build(drive.bag, drive.truth, work, not args.skip_modes)
        )
        if not args.skip_icp:
            bench_icp(drive.bag, drive.truth, args.pairs)
        if not args.skip_kiss and not args.skip_build:
            bench_kiss(drive.bag, drive.truth, figures.get("ate_m", float("nan")))
        if not args.skip_cluster:
            warmup = None
            if args.cluster_warmup:
                short = dataclasses.replace(cfg, seconds=5.0)
                warmup = generate_drive(short, work / "warmup.bag").bag
            bench_cluster(drive.bag, work, args.rounds, warmup, args.slots)
        if not args.skip_nightly:
            bench_nightly(cfg, drive.bag, work, args.night_seconds)
            bench_planning(drive.bag, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
