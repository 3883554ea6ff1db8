"""Start-up of Spark's JVMs with and without adcloud's class archive (adcloud/_jvm_archive.py).

    .venv/bin/python benchmarks/bench_startup.py [--rounds 3]

Each round measures, in fresh processes, with the archive and then without it (the baseline:
a directory that holds none, so Spark starts as pyspark starts it): (1) a local session until
``get_session`` returns, and its first jobs (an RDD job and a DataFrame aggregation); (2) a
standalone cluster of 2 workers until both are ALIVE; and each whole process, Python's start
included. Prints the medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SESSION = """
import json, time
t0 = time.perf_counter()
from adcloud.spark import get_session
spark = get_session(**{"spark.ui.showConsoleProgress": "false"})
t1 = time.perf_counter()
spark.sparkContext.parallelize(range(64), 4).map(lambda x: x * x).sum()
spark.range(100000).selectExpr("id % 7 as k").groupBy("k").count().collect()
t2 = time.perf_counter()
spark.stop()
print(json.dumps({"session": t1 - t0, "first_jobs": t2 - t1}))
"""

CLUSTER = """
import json, time
from adcloud.spark import StandaloneCluster
t0 = time.perf_counter()
with StandaloneCluster(2, cores=1, memory="1g"):
    print(json.dumps({"cluster": time.perf_counter() - t0}))
"""


def measure(code: str, archive_dir: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if archive_dir is not None:
        env["ADCLOUD_JVM_ARCHIVE_DIR"] = archive_dir
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process"] = time.perf_counter() - started
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from adcloud.spark import class_archive_options  # noqa: PLC0415

    if not class_archive_options():
        print("no class archive for this Java and pyspark: run `make install` first")
        return 1
    runs: dict[str, dict[str, list[float]]] = {"archive": {}, "baseline": {}}
    with tempfile.TemporaryDirectory() as empty:
        for index in range(args.rounds):
            for label, where in (("archive", None), ("baseline", empty)):
                for code, prefix in ((SESSION, "session "), (CLUSTER, "cluster ")):
                    for key, value in measure(code, where).items():
                        name = key if key != "process" else f"{prefix}process"
                        runs[label].setdefault(name, []).append(value)
            print(f"round {index + 1} of {args.rounds} done", flush=True)
    print(f"\n{'what':<22}{'baseline s':>12}{'archive s':>12}{'ratio':>8}")
    for name, base in runs["baseline"].items():
        mine = statistics.median(runs["archive"][name])
        ref = statistics.median(base)
        print(f"{name:<22}{ref:>12.2f}{mine:>12.2f}{ref / mine:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
