"""The commands deploy/local/README.md shows run as written against a real standalone cluster."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.processes import alive

if TYPE_CHECKING:
    from adcloud.spark import StandaloneCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "deploy" / "local" / "README.md"

_JOB = """\
from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("readme-spark-submit").getOrCreate()
# a Python lambda: the executors must start the interpreter PYSPARK_PYTHON names
print("RESULT", spark.sparkContext.parallelize(range(10), 2).map(lambda x: x * 2).sum())
spark.stop()
"""


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "deploy/local/README.md has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_spark_submit_line_runs_python_on_the_executors(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    """The README's ``spark-submit`` line, run from the checkout as shown: the executors
    start Python in their own work directories, so a relative PYSPARK_PYTHON failed every
    task ("Cannot run program .venv/bin/python")."""
    (line,) = [c for c in _readme_commands() if "spark-submit" in c]
    job = tmp_path / "my_job.py"
    job.write_text(_JOB)
    command = line.replace("my_job.py", str(job))
    env = {**os.environ, "MASTER": cluster.master_url, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and "RESULT 90" in proc.stdout, proc.stderr[-3000:]


def _daemons_in(where: Path) -> list[int]:
    """The Spark masters and workers running in ``where`` (their working directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if b"org.apache.spark.deploy." not in (entry / "cmdline").read_bytes():
                continue
            if Path(os.readlink(entry / "cwd")).is_relative_to(where) and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_two_starts_at_once_start_one_cluster_that_stop_stops(tmp_path: Path) -> None:
    """Two ``start-cluster.sh`` with one state directory (two terminals, a CI step run twice)
    both found no cluster running there and both started one; the second's state replaced
    the first's, and ``stop-cluster.sh`` left the first master and worker running."""
    state = tmp_path / "state"
    env = {**os.environ, "ADCLOUD_CLUSTER_STATE": str(state), "ADCLOUD_PYTHON": sys.executable}
    scripts = REPO_ROOT / "deploy" / "local"
    starts = [
        subprocess.Popen(
            [str(scripts / "start-cluster.sh"), "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        results = [(proc, *proc.communicate(timeout=180)) for proc in starts]
        codes = sorted(proc.returncode for proc, _, _ in results)
        said = " ".join(err for _, _, err in results)
        running = _daemons_in(state)
    finally:
        subprocess.run(
            [str(scripts / "stop-cluster.sh")],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
        left = _daemons_in(state)
        for pid in left:  # what the scripts could not stop, so that the test leaves nothing
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert codes == [0, 2], said
    assert f"a cluster recorded in {state} is still running; stop it first" in said
    assert len(running) == 2, running  # one master, one worker
    assert left == []


def test_a_bad_cluster_variable_is_named_before_anything_starts(tmp_path: Path) -> None:
    """``ADCLOUD_CLUSTER_CORES=two start-cluster.sh``: the error named ``--cores``, an option
    the user never typed, instead of the variable they set."""
    state = tmp_path / "state"
    scripts = REPO_ROOT / "deploy" / "local"
    for variable, value in (
        ("ADCLOUD_CLUSTER_CORES", "two"),
        ("ADCLOUD_CLUSTER_CORES", "0"),
        ("ADCLOUD_CLUSTER_MEMORY", "1.5g"),
        ("ADCLOUD_CLUSTER_MEMORY", "lots"),
    ):
        env = {
            **os.environ,
            "ADCLOUD_CLUSTER_STATE": str(state),
            "ADCLOUD_PYTHON": sys.executable,
            variable: value,
        }
        proc = subprocess.run(
            [str(scripts / "start-cluster.sh"), "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2, proc.stderr
        assert f"error: {variable}='{value}'" in proc.stderr
        assert not state.exists()


@pytest.mark.cluster
def test_a_start_killed_outright_leaves_what_it_launched_to_stop(tmp_path: Path) -> None:
    """``kill -9`` (the OOM killer, a CI step cancelled) of ``cluster start`` once its master
    runs: nothing recorded the master until all workers were up, so ``stop-cluster.sh`` said
    "nothing to stop" and the master ran on for ever, holding its ports."""
    state = tmp_path / "state"
    argv = ["cluster", "start", "--workers", "1", "--state-dir", str(state)]
    start = subprocess.Popen(
        [sys.executable, "-m", "adcloud.spark", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _daemons_in(state) and time.monotonic() < deadline and start.poll() is None:
            time.sleep(0.05)
        launched = _daemons_in(state)
        assert launched, "the start never launched a master"
        start.kill()
        start.wait(timeout=30)
        stop = subprocess.run(
            [sys.executable, "-m", "adcloud.spark", "cluster", "stop", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        deadline = time.monotonic() + 20
        while _daemons_in(state) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _daemons_in(state)
    finally:
        start.kill()
        start.wait(timeout=30)
        for pid in _daemons_in(state):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert stop.returncode == 0, stop.stderr
    assert left == [], stop.stderr
    assert not (state / "cluster.json").exists()
