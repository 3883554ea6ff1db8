"""What this machine gives two processes at once: the ceiling of every "2 vs 1" target.

    .venv/bin/python benchmarks/bench_machine.py [--rounds 3] [--seconds 1.0]

Several benchmarks compare 2 executors (or 2 trainers) with 1 on the same 2 cores and aim at
1.7x.  That presumes the machine itself runs two busy processes twice as fast as one.  This
benchmark measures it without Spark: the same fixed piece of work runs in one process alone
(the baseline) and then in two processes at once, each started from a barrier so that they
overlap, and the ratio printed is the throughput of two over one (2.0x: two full cores).

Three kinds of work, because they share different parts of the machine:

- ``python``: an interpreter loop (one core's pipeline and its caches);
- ``numpy-cache``: arithmetic on arrays that fit in a core's L2 cache;
- ``numpy-stream``: arithmetic on 32 MB arrays, bound by the memory bandwidth both cores share
  (the kind of work of rasterizing a grid or voxelizing a point cloud).

Rounds alternate alone and together; medians are printed.  Anything else running on the
machine lowers the "together" figure: look at the load average printed with it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from typing import Any


def _python(units: int) -> None:
    total = 0
    for i in range(units * 1_000_000):
        total += i * i


def _numpy_cache(units: int) -> None:
    import numpy as np  # noqa: PLC0415

    values = np.random.default_rng(0).random(65_536)  # 512 KiB: inside one core's L2
    for _ in range(units * 100):
        values = np.sqrt(values * values + 1.0)


def _numpy_stream(units: int) -> None:
    import numpy as np  # noqa: PLC0415

    values = np.random.default_rng(0).random(4_000_000)  # 32 MB: well past the caches
    for _ in range(units * 2):
        values = np.sqrt(values * values + 1.0)


WORK: dict[str, Callable[[int], None]] = {
    "python": _python,
    "numpy-cache": _numpy_cache,
    "numpy-stream": _numpy_stream,
}


def _child(name: str, units: int, barrier: Barrier, out: Any) -> None:
    work = WORK[name]
    work(1)  # imports and first-touch page faults, outside the timing
    barrier.wait()
    started = time.perf_counter()
    work(units)
    out.put(time.perf_counter() - started)


def timed(name: str, units: int, processes: int) -> float:
    """Seconds until the last of ``processes`` copies of the work finishes."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    out = context.Queue()
    procs = [
        context.Process(target=_child, args=(name, units, barrier, out)) for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    seconds = [float(out.get(timeout=600)) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{name}: a worker process failed (exit {proc.exitcode})")
    return max(seconds)


def calibrate(name: str, seconds: float) -> int:
    """How many units of ``name`` take about ``seconds`` in one process."""
    one = timed(name, 1, 1)
    return max(1, round(seconds / max(one, 1e-6)))


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alone/together pairs per work")
    parser.add_argument(
        "--seconds", type=float, default=1.0, help="length of one piece of work, alone"
    )
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; load average {_load()}", flush=True)
    print("work            alone (s)  two at once (s)  throughput, two vs one")
    ratios = {}
    for name in WORK:
        units = calibrate(name, args.seconds)
        alone, together = [], []
        for _ in range(args.rounds):
            alone.append(timed(name, units, 1))
            together.append(timed(name, units, 2))
        one, two = statistics.median(alone), statistics.median(together)
        ratios[name] = 2 * one / two
        spread = [2 * a / t for a, t in zip(alone, together, strict=True)]
        print(
            f"{name:14s}  {one:9.3f}  {two:15.3f}  {ratios[name]:5.2f}x "
            f"(rounds {min(spread):.2f}-{max(spread):.2f}x; load {_load()})",
            flush=True,
        )
    print(
        "\nA Spark application with 2 executors can at best approach these figures; its "
        "driver and JVMs share the same cores."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
