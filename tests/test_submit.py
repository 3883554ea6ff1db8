"""``adcloud submit``: the spark-submit it runs, and the driver that starts, end with it.

Each test submits a real job to ``local[1]`` -- ``store serve``, which runs until it is
stopped -- and finds every process of the run by a mark in its environment, which the
driver JVM and the Python driver it starts inherit.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.processes import alive

_MARK = "ADCLOUD_TEST_SUBMIT"


def _marked(mark: str) -> list[int]:
    """The running processes whose environment holds ``_MARK=mark``."""
    entry = f"{_MARK}={mark}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if entry in (proc / "environ").read_bytes().split(b"\0") and alive(int(proc.name)):
                found.append(int(proc.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def submitted(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A running ``adcloud submit -- store serve`` whose Python driver has started, and
    its mark; whatever of the run is left at the end is killed."""
    mark = uuid.uuid4().hex
    env = {**os.environ, _MARK: mark, "ADCLOUD_STORE_ROOT": str(tmp_path / "store")}
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    job = ["store", "serve", "--port", "0"]
    proc = subprocess.Popen(
        [adcloud, "submit", "--master", "local[1]", "--", *job],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # until the driver serves (it has said so): stopped earlier, it would end by itself
        # on its first write to a JVM already gone
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        said = ""
        while "serving" not in said and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
                if not line:
                    break
                said += line
        run = _marked(mark)
        jvm = [pid for pid in run if b"org.apache.spark.deploy.SparkSubmit" in _cmdline(pid)]
        driver = [pid for pid in run if b"cli.py\0store\0serve\0" in _cmdline(pid)]
        if not (jvm and driver):
            proc.kill()
            pytest.fail(f"the submitted driver never started: {proc.communicate()[1][-2000:]}")
        yield proc, mark
    finally:
        for pid in [proc.pid, *_marked(mark)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _left(mark: str, seconds: float) -> list[bytes]:
    """The command lines of the run's processes still there after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [_cmdline(pid)[:200] for pid in _marked(mark)]


def test_a_killed_submit_takes_its_driver_with_it(
    submitted: tuple[subprocess.Popen[str], str],
) -> None:
    """``kill -9`` of ``adcloud submit`` (a cancelled CI job or Airflow task): the driver
    JVM and the Python driver would run on with no parent, holding the cluster's cores."""
    proc, mark = submitted
    proc.kill()
    proc.wait()
    assert _left(mark, 30) == []


@pytest.mark.parametrize(
    ("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)]
)
def test_a_signal_reaches_the_job_and_its_status_comes_back(
    submitted: tuple[subprocess.Popen[str], str], sig: signal.Signals, status: int
) -> None:
    """SIGTERM (a scheduler), SIGINT (Ctrl-C), SIGHUP (a closed terminal) to ``adcloud
    submit`` go on to spark-submit's whole process group, and the command ends with the
    job's status; nothing of the run is left."""
    proc, mark = submitted
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err[-2000:]
    assert _left(mark, 30) == []


def test_a_job_that_is_no_adcloud_command_is_refused_before_spark_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A misspelt job cost a driver JVM's start to be told, and a dry run printed (exit 0) a
    line that fails; ``submit`` as the job ran spark-submit inside the driver."""
    from adcloud.cli import main  # noqa: PLC0415

    submit = ["submit", "--dry-run", "--master", "local[2]", "--"]
    for job, said in (
        (["ingets", "a.bag"], "error: the job after --: 'ingets' is not an adcloud command ("),
        (["-v", "submit", "--", "ingest", "a.bag"], "not submit itself"),
    ):
        assert main([*submit, *job]) == 2
        out, err = capsys.readouterr()
        assert out == "" and said in err, err
    assert main([*submit, "-v", "ingest", "a.bag", "--out", "o"]) == 0
    assert capsys.readouterr().out.split()[-5:] == ["-v", "ingest", "a.bag", "--out", "o"]
