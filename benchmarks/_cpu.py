"""Which processes kept the cores busy during a benchmark block, read from ``/proc``.

On a 2-core machine the 2-vs-1-executor ratios depend on how much of a core the driver, the
executor JVMs and the daemons take besides the executors' Python work; the benchmarks print
this beside those ratios so the figure can be judged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

Kinds = Sequence[tuple[str, tuple[bytes, ...]]]

#: Spark's processes by command line; the first match wins (the driver JVM's command line
#: names the Python daemon module in its --conf too, so the JVMs come first).
SPARK_KINDS: Kinds = (
    ("executor JVMs", (b"CoarseGrainedExecutorBackend",)),
    ("driver JVM", (b"SparkSubmit",)),
    ("master/worker daemons", (b"deploy.master.Master", b"deploy.worker.Worker")),
    ("Python workers", (b"_pyspark_daemon", b"pyspark.daemon", b"pyspark.worker")),
)

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def processes(kinds: Kinds = SPARK_KINDS) -> Iterator[tuple[str, str]]:
    """``(kind, pid)`` of this machine's processes that match ``kinds``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        kind = next((k for k, marks in kinds if any(m in cmd for m in marks)), None)
        if kind is not None:
            yield kind, proc.name


#: The column for child processes that ended during the block (a replay's nodes under test,
#: recycled Python workers): their CPU time reaches their parent's ``cutime``/``cstime``.
EXITED = "their exited children"


#: The benchmark's own process: the Spark driver's Python side (the job's driver-side work).
DRIVER = "driver Python"


def _cpu_seconds(kinds: Kinds) -> tuple[dict[str, float], float]:
    per: dict[str, float] = {}
    for kind, pid in [(DRIVER, str(os.getpid())), *processes(kinds)]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        per[f"{kind}/{pid}"] = (int(fields[11]) + int(fields[12])) / _TICK
        if kind != DRIVER:  # the benchmark's own children (drive generation) are not Spark's
            per[f"{EXITED}/{pid}"] = (int(fields[13]) + int(fields[14])) / _TICK
    cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return per, (sum(cpu) - cpu[3] - cpu[4]) / _TICK


class CpuShare:
    """Cores each kind of process kept busy while the ``with`` block ran, and the machine's
    busy cores.  A tracked process that ended inside the block is counted only through its
    parent's ``EXITED`` column, if the parent is tracked."""

    def __init__(self, kinds: Kinds = SPARK_KINDS) -> None:
        self.kinds = kinds
        self.cores: dict[str, float] = {}
        self.machine = 0.0

    def __enter__(self) -> CpuShare:
        self._start = time.perf_counter()
        self._before, self._busy = _cpu_seconds(self.kinds)
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._start
        after, busy = _cpu_seconds(self.kinds)
        for key, used in after.items():
            kind = key.split("/", 1)[0]
            share = (used - self._before.get(key, 0.0)) / wall
            self.cores[kind] = self.cores.get(kind, 0.0) + share
        self.machine = (busy - self._busy) / wall

    def __str__(self) -> str:
        names = [DRIVER, *(kind for kind, _ in self.kinds), EXITED]
        parts = ", ".join(f"{kind} {self.cores.get(kind, 0.0):.2f}" for kind in names)
        return f"cores busy: machine {self.machine:.2f} of {os.cpu_count()} ({parts})"
