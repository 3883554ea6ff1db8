"""Run every benchmark in this directory, one after another, each in its own process.

    .venv/bin/python benchmarks/run_all.py [NAME ...]     # e.g. codec binpipe

Each benchmark measures its named baseline in the same run and prints the ratio;
record the figures with this command in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Benchmarks for a GPU machine, run there by ``gpu_checks.sh`` (after a ``prepare`` here).
GPU_ONLY = {"train_gpu"}


def main() -> int:
    wanted = set(sys.argv[1:])
    scripts = sorted(HERE.glob("bench_*.py"))
    failed = []
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        if name in GPU_ONLY and name not in wanted:
            print(f"=== {name}: skipped (for a GPU machine: see benchmarks/gpu_checks.sh)")
            continue
        print(f"=== {name} ({script.name})", flush=True)
        if subprocess.call([sys.executable, str(script)]) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
