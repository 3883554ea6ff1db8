"""``adcloud.train.barrier.check_slots`` on a cluster whose executors are all there."""

from __future__ import annotations

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
