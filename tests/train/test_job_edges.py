"""What a training run opens is closed when it ends, in the driver and in the executors'
Python workers (which Spark reuses from run to run)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from adcloud.train.errors import TrainError
from adcloud.train.job import run_torchrun, run_training
from tests.train.test_job import LinearTask, config, keyed_points, make_points


def _holders(root: Path) -> list[str]:
    """``pid: path`` of every file under ``root`` that a process of this user holds open."""
    held = []
    prefix = str(root.resolve())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # another user's process, or one that ended
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                held.append(f"{pid}: {target}")
    return held


@pytest.mark.parametrize("mode", ["single", "ps", "allreduce"])
def test_a_run_leaves_no_file_of_its_store_open(
    spark: SparkSession, tmp_path: Path, mode: str
) -> None:
    cfg = config(tmp_path, sync=mode, run=f"closed-{mode}", steps=4, checkpoint_every=2)
    result = run_training(spark, cfg, task=LinearTask(), keyed=keyed_points(spark, make_points(32)))
    assert result.steps == 4
    assert _holders(tmp_path / "store") == []


@pytest.mark.parametrize("count", [0, 3])
def test_a_torchrun_job_with_fewer_samples_than_processes_is_refused_before_it_joins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    """Every rank refuses alike, before the process group: not one rank failing with an
    empty shard while the others wait for it in their first collective."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg = config(tmp_path, run=f"torchrun-{count}", batch_size=4)
    says = "cannot fill the shards of 4 torchrun" if count else "gave no samples"
    with pytest.raises(TrainError, match=says):
        run_torchrun(cfg, task=LinearTask(), samples=make_points(count) if count else [])
