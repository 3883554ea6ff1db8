"""In-process bag read throughput: rosbags vs ``read_partition`` vs ``_bag_blocks``.

No Spark: one Python process reads the whole bag three ways, interleaved, several
rounds, and the median of each is compared with rosbags' (the baseline, measured in
the same run):

- ``rosbags``: ``rosbags.rosbag1.Reader(path).messages()``, touching each message
  (open and index read included);
- ``read_partition``: every partition of ``plan_partitions`` (as ``from_bags`` plans
  for two cores: ~64 MiB partitions, at least two), each message's data touched;
- ``_bag_blocks``: the same partitions read *and* encoded into BinPipe blocks, as a
  Spark task of ``BinPipeRDD.from_bags`` does;
- ``local:// read``: ``read_partition`` of the same bag stored in the local tiered store's
  MEM tier (``/dev/shm``), read through ``adcloud.store.filesystem`` and
  ``LocalStore.read_range`` (skipped with ``--no-store``);
- ``alluxio:// read``: the same, from that store served by ``adcloud store serve`` (the
  Alluxio 2.x REST proxy API) in a process of its own on 127.0.0.1: HTTP, streams and
  range reads as from a proxy on an executor's host (skipped with ``--no-store``).

Bags: a generated LiDAR bag (``bench_binpipe.write_bag``: lz4 chunks of 16k-point
PointCloud2 plus 10 small Imu per cloud) and the bz2 husky bag of the shared data.
MB/s is bag file bytes per second.

    .venv/bin/python benchmarks/bench_bagread.py [--bag-mb 100] [--rounds 7] [--profile]
        [--bag KEEP.bag] [--husky PATH] [--no-store]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rosbags.rosbag1 import Reader as Ros1Reader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_binpipe import write_bag

from adcloud.binpipe.bags import BagPartition, plan_partitions, read_partition
from adcloud.binpipe.codec import DEFAULT_BLOCK_BYTES
from adcloud.binpipe.rdd import DEFAULT_PARTITION_BYTES, _bag_blocks
from adcloud.store import LocalStore

HUSKY = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared"
    / "data"
    / "02_husky_gps_imu_odom_ros1"
    / "robot_localization_test1.bag"
).resolve()


def rosbags_read(path: Path) -> int:
    """Baseline: every message through rosbags, its bytes touched."""
    n = 0
    with Ros1Reader(path) as reader:
        for _conn, _t, raw in reader.messages():
            n += len(raw)
    return n


def partitions(path: Path | str, options: dict[str, Any] | None = None) -> list[BagPartition]:
    return plan_partitions(
        str(path),
        partition_bytes=DEFAULT_PARTITION_BYTES,
        min_partitions=2,
        storage_options=options,
    )


def stored(path: Path, options: dict[str, Any]) -> str:
    """``path`` put into the MEM tier of the store ``options`` open; its URL."""
    with LocalStore("local://", background=False, **options) as store:
        with (
            path.open("rb") as src,
            store.open(f"/bench/{path.name}", "wb", write_type="MUST_CACHE") as out,
        ):
            shutil.copyfileobj(src, out, 8 << 20)
        assert store.stat(f"/bench/{path.name}").tier == "MEM"
    return f"local:///bench/{path.name}"


@contextlib.contextmanager
def served(options: dict[str, Any]) -> Iterator[str]:
    """The store ``options`` open, served by ``adcloud store serve`` in a process of its own
    (so that the proxy does not share this process's interpreter): its ``alluxio://`` URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "ADCLOUD_STORE_ROOT": options["root"],
        "ADCLOUD_STORE_MEM_DIR": options["mem_dir"],
        "ADCLOUD_STORE_MEM_CAPACITY": options["mem_capacity"],
    }
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    proc = subprocess.Popen(
        [adcloud, "store", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"adcloud store serve did not start: {err}")
            time.sleep(0.1)
        yield f"alluxio://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ours_read(parts: list[BagPartition]) -> int:
    n = 0
    for part in parts:
        for msg in read_partition(part):
            n += len(msg.data)
    return n


def ours_blocks(parts: list[BagPartition]) -> int:
    n = 0
    for block in _bag_blocks(parts, DEFAULT_BLOCK_BYTES):
        n += len(block)
    return n


def bench(
    name: str,
    path: Path,
    rounds: int,
    store: dict[str, Any] | None = None,
    proxy: str | None = None,
) -> dict[str, float]:
    """Wall-clock MB/s (median and best of ``rounds``, interleaved) and ratios to rosbags.

    The CPU column is MB per second of this process's CPU time (user + system): less
    sensitive than wall time to other processes competing for the cores.
    """
    size = path.stat().st_size
    parts = partitions(path)
    runs: dict[str, Callable[[], int]] = {
        "rosbags": lambda: rosbags_read(path),
        "read_partition": lambda: ours_read(parts),
        "_bag_blocks": lambda: ours_blocks(parts),
    }
    if store is not None:
        url = stored(path, store)
        in_store = partitions(url, store)
        runs["local:// read"] = lambda: ours_read(in_store)
        if proxy is not None:
            via_proxy = partitions(proxy + url.removeprefix("local://"))
            runs["alluxio:// read"] = lambda: ours_read(via_proxy)
    assert ours_read(parts) == rosbags_read(path), "payload bytes differ from rosbags"
    if store is not None:
        assert ours_read(in_store) == ours_read(parts), "the stored bag reads otherwise"
        if proxy is not None:
            assert ours_read(via_proxy) == ours_read(parts), "the served bag reads otherwise"
    for fn in runs.values():
        fn()  # warm-up: imports, caches, the allocator's steady state
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            gc.collect()
            c, t = time.process_time(), time.perf_counter()
            fn()
            wall[key].append(time.perf_counter() - t)
            cpu[key].append(time.process_time() - c)
    mbps = {k: size / statistics.median(v) / 1e6 for k, v in wall.items()}
    cpu_mbps = {k: size / statistics.median(v) / 1e6 for k, v in cpu.items()}
    print(f"[{name}] {size / 1e6:.1f} MB, {len(parts)} partitions, median of {rounds} rounds")
    print(f"  {'':15s} wall MB/s   (best) vs rosbags   CPU MB/s     vs")
    for key in runs:
        best = size / min(wall[key]) / 1e6
        print(
            f"  {key:15s} {mbps[key]:9.1f} {best:8.1f} {mbps[key] / mbps['rosbags']:9.2f}x"
            f"   {cpu_mbps[key]:8.1f} {cpu_mbps[key] / cpu_mbps['rosbags']:5.2f}x"
        )
    return mbps


def profile(path: Path) -> None:
    parts = partitions(path)
    prof = cProfile.Profile()
    prof.enable()
    ours_blocks(parts)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bag-mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bag", type=Path, help="reuse this generated LiDAR bag")
    parser.add_argument("--husky", type=Path, default=HUSKY, help="the bz2 husky bag")
    parser.add_argument("--profile", action="store_true", help="cProfile _bag_blocks too")
    parser.add_argument(
        "--no-store", action="store_true", help="skip the local:// and alluxio:// reads"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="adcloud-bagread-") as tmp,
        tempfile.TemporaryDirectory(prefix="adcloud-bagread-", dir="/dev/shm") as shm,
    ):
        store = None
        if not args.no_store:  # a store of this run's own: MEM in /dev/shm, room for the bags
            store = {"root": f"{tmp}/store", "mem_dir": shm, "mem_capacity": "2GiB"}
        lidar = args.bag
        if lidar is None or not lidar.exists():
            lidar = args.bag or Path(tmp) / "lidar.bag"
            write_bag(lidar, args.bag_mb)
        with served(store) if store is not None else contextlib.nullcontext() as proxy:
            bench(f"lidar {lidar.name}", lidar, args.rounds, store, proxy)
            if args.husky.exists():
                bench(f"husky {args.husky.name}", args.husky, args.rounds, store, proxy)
        if args.profile:
            profile(lidar)
            if args.husky.exists():
                profile(args.husky)


if __name__ == "__main__":
    main()
