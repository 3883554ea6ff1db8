"""Spark resource scheduling for real: each task runs its kernel on the device Spark gave it.

A standalone cluster (one worker, two cores) advertises two ``gpu`` resources found by
``deploy/discover_opencl.sh``.  PoCL's CPU device stands in for GPUs, honestly: the script is
told (``ADCLOUD_HETERO_GPU_KINDS=cpu``, ``ADCLOUD_HETERO_SPLIT=2``) to offer it as its two
equal sub-devices ``0:0:0/2`` and ``0:0:1/2`` (``clCreateSubDevices``), which run on
disjoint compute units.  The application asks for ``spark.executor.resource.gpu.amount=2``
and ``spark.task.resource.gpu.amount=1``; every task reports the addresses Spark gave it and
the OpenCL device it opened.  The driver runs in a subprocess because this test process
already holds the suite's local SparkContext.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from adcloud.hetero import DeviceKind, list_devices
from adcloud.spark import StandaloneCluster

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.cluster, pytest.mark.opencl, pytest.mark.spark]

DISCOVERY = """#!/bin/sh
# PoCL's CPU device stands in for two GPUs: its two equal sub-devices.
ADCLOUD_HETERO_GPU_KINDS=cpu ADCLOUD_HETERO_SPLIT=2 ADCLOUD_PYTHON={python} \\
    exec {script} gpu
"""

DRIVER = """
import json, os, sys, time
import numpy as np
from adcloud.hetero import map_partitions, transform_points
from adcloud.spark import get_session, wait_for_executors

def probe(points, *, device):
    started = time.time()
    matrix = np.eye(4)
    matrix[:3, 3] = [1.0, -2.0, 0.5]
    moved = transform_points(points, matrix, device=device)
    error = float(np.abs(moved - (points[:, :3] + [1.0, -2.0, 0.5])).max())
    time.sleep(0.4)  # long enough that the two cores run tasks side by side
    cl_device = device.device
    return {
        "opened": device.info.address,
        "compute_units": int(cl_device.max_compute_units),
        "sub_device": cl_device.parent_device is not None,
        "error": error,
        "start": started,
        "end": time.time(),
    }

spark = get_session()
wait_for_executors(spark, 1)
clouds = [np.random.default_rng(i).normal(0, 10, (5000, 3)).astype(np.float32) for i in range(8)]
rdd = spark.sparkContext.parallelize(clouds, 8)
results = map_partitions(rdd, probe, with_info=True).collect()
print(json.dumps([
    {"partition": r.partition, "address": r.address, "resource": r.resource,
     "assigned": list(r.assigned), "pid": r.pid, **r.value}
    for r in results
]), flush=True)
spark.stop()
"""


@pytest.fixture(scope="module")
def task_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cpu = [d for d in list_devices() if d.kind == DeviceKind.CPU]
    if not cpu or cpu[0].compute_units < 2:
        pytest.skip("needs an OpenCL CPU device with two compute units to split")
    base = tmp_path_factory.mktemp("gpu-cluster")
    script = base / "discover-gpus.sh"
    script.write_text(
        DISCOVERY.format(python=sys.executable, script=REPO_ROOT / "deploy" / "discover_opencl.sh")
    )
    script.chmod(0o755)
    light = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    with StandaloneCluster(
        1, cores=2, memory="1g", resources={"gpu": (2, script)}, log_dir=base / "logs"
    ) as cluster:
        (worker,) = cluster.status()["workers"]
        assert worker["resources"]["gpu"]["addresses"] == ["0:0:0/2", "0:0:1/2"]
        conf = {
            **cluster.session_conf(),
            "spark.ui.enabled": "false",
            "spark.executor.cores": "2",
            "spark.executor.resource.gpu.amount": "2",
            "spark.executor.resource.gpu.discoveryScript": str(script),
            "spark.task.resource.gpu.amount": "1",
            "spark.driver.extraJavaOptions": light,
            "spark.executor.extraJavaOptions": light,
        }
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("ADCLOUD_SPARK_", "ADCLOUD_HETERO_", "PYSPARK_", "SPARK_"))
        }
        env.update(
            ADCLOUD_SPARK_MASTER=cluster.master_url,
            ADCLOUD_SPARK_APP_NAME="hetero-resources",
            ADCLOUD_SPARK_DRIVER_MEMORY="512m",
            ADCLOUD_SPARK_EXECUTOR_MEMORY="512m",
            ADCLOUD_SPARK_CONF=",".join(f"{k}={v}" for k, v in conf.items()),
        )
        proc = subprocess.run(
            [sys.executable, "-c", DRIVER],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.fail(f"driver failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_every_task_opens_exactly_the_device_spark_assigned(
    task_reports: list[dict[str, Any]],
) -> None:
    assert len(task_reports) == 8
    for report in task_reports:
        assert report["resource"] == "gpu"
        assert len(report["assigned"]) == 1  # spark.task.resource.gpu.amount=1
        assert report["address"] == report["opened"] == report["assigned"][0]
        assert report["sub_device"] and report["compute_units"] == 1
        assert report["error"] < 1e-4  # and the kernel computed the right thing there
    assert {r["address"] for r in task_reports} == {"0:0:0/2", "0:0:1/2"}


def test_tasks_running_at_the_same_time_hold_different_devices(
    task_reports: list[dict[str, Any]],
) -> None:
    overlapping = 0
    for i, a in enumerate(task_reports):
        for b in task_reports[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"]:
                overlapping += 1
                assert a["address"] != b["address"], (a, b)
    assert overlapping >= 1, "the two cores never ran tasks side by side"
    assert len({r["pid"] for r in task_reports}) >= 2  # one Python worker per core
