"""``adcloud.train.barrier.check_slots`` on a cluster whose executors are all there, and on a
``local-cluster`` master whose executors are still registering."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest

from adcloud.train.barrier import check_slots
from adcloud.train.errors import TrainError


class _Cluster:
    """What ``check_slots`` reads of a SparkContext on a standalone cluster whose JVM does not
    offer Spark's own count: the master, the conf, the executors (the driver listed too)."""

    master = "spark://10.0.0.1:7077"

    def __init__(self, executors: int, cores: int) -> None:
        self._executors, self._cores = executors, cores
        self._jsc = None  # Spark's count unavailable: the estimate from conf and executors

    def getConf(self) -> Any:
        return SimpleNamespace(
            get=lambda key, default=None: {"spark.executor.cores": str(self._cores)}.get(
                key, default
            )
        )

    def statusTracker(self) -> Any:
        infos = [SimpleNamespace(numRunningTasks=0)] * (self._executors + 1)
        return SimpleNamespace(getExecutorInfos=lambda: infos)


def test_too_few_slots_on_a_cluster_are_refused_once_the_count_settles() -> None:
    """A cluster of 2 one-core executors and 4 trainers: the count will not grow by waiting,
    yet the check waited all of sync_timeout_s (120 s by default) before it said so."""
    started = time.monotonic()
    with pytest.raises(TrainError, match=r"train.workers=4 .* has 2 \(executors"):
        check_slots(_Cluster(executors=2, cores=1), 4, wait_s=600)
    assert time.monotonic() - started < 60  # about the 5 s the count must hold, not 600


def test_enough_slots_pass_at_once() -> None:
    check_slots(_Cluster(executors=2, cores=2), 4, wait_s=600)


_LOCAL_CLUSTER_CHECK = """
from adcloud.spark import SparkSettings, get_session
from adcloud.train.barrier import check_slots, task_slots
spark = get_session(SparkSettings.load(master="local-cluster[2,1,1024]"))
try:
    print("slots at start:", task_slots(spark.sparkContext), flush=True)
    check_slots(spark.sparkContext, 2, wait_s=60)
    print("enough slots", flush=True)
finally:
    spark.stop()
"""


@pytest.mark.cluster
def test_a_local_cluster_s_executors_are_waited_for() -> None:
    """``local-cluster[2,1,1024]`` runs two executor JVMs that register a second or two
    after the session starts: taken for ``local[N]``, whose slots are there at once, two
    trainers were refused with "has 0 ... lower train.workers to 1"."""
    done = subprocess.run(
        [sys.executable, "-c", _LOCAL_CLUSTER_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "enough slots" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.returncode == 0


def test_a_cluster_without_executors_is_not_told_to_lower_the_workers() -> None:
    """No executor registered (a cluster without free cores): "lower train.workers to 1" led
    to the same refusal with workers=1."""
    with pytest.raises(TrainError) as refused:
        check_slots(_Cluster(executors=0, cores=2), 2, wait_s=1)
    said = str(refused.value)
    assert "has 0 (executors alive" in said and "no executor has registered" in said
    assert "lower train.workers" not in said
