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


@pytest.mark.parametrize(
    "given", [["--master", "spark://127.0.0.1:1"], ["--master=local[2]"], ["--mast", "local[2]"]]
)
def test_a_master_given_to_the_job_is_refused_before_spark_starts(
    given: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``adcloud submit -- ingest ... --master URL``: the driver spark-submit starts runs on
    the submit line's master, so the job's own was ignored and the job ran elsewhere
    (local[*,4], with ``--master spark://...`` given) without a word."""
    from adcloud.cli import main  # noqa: PLC0415

    submit = ["submit", "--dry-run", "--master", "local[1]", "--"]
    assert main([*submit, "ingest", "a.bag", "--out", "o", *given]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "give the master to adcloud submit, before --" in " ".join(err.split())
    # the options that only begin like it are the job's own
    assert main([*submit, "hdmap", "build", "--bags", "a.bag", "--map", "m"]) == 0
    assert main([*submit, "sim", "run", "a.bag", "--node", "n", "--max-output-mb", "5"]) == 0


def test_under_plain_spark_submit_a_master_given_to_the_job_is_refused(
    shared_data: Path, tmp_path: Path
) -> None:
    """``spark-submit --master local[1] adcloud/cli.py ingest ... --master spark://...``: the
    job ran on local[1] and said nothing of the master it was given."""
    from adcloud.spark import spark_home  # noqa: PLC0415

    bag = shared_data / "02_husky_gps_imu_odom_ros1" / "robot_localization_test1.bag"
    cli = Path(__file__).resolve().parents[1] / "adcloud" / "cli.py"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    nobody = "spark://127.0.0.1:1"  # no master listens there
    job = ["ingest", str(bag), "--out", str(tmp_path / "out"), "-q", "--master", nobody]
    proc = subprocess.run(
        [str(spark_home() / "bin" / "spark-submit"), "--master", "local[1]", str(cli), *job],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    # spark-submit sends the Python driver's stderr to its stdout
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"error: --master {nobody}: this job runs under spark-submit" in said
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("into", ["pipes", "files"])
def test_a_submitted_jobs_errors_go_to_stderr_and_its_output_to_stdout(
    into: str, tmp_path: Path
) -> None:
    """spark-submit merges the stderr of the Python driver it starts into its stdout: the
    job's ``error:`` line (and warnings, progress bars) went to the stdout of ``adcloud
    submit``, mixed into its output (``-- bag info --json x.bag > x.json``), and ``2>``
    caught none of it.  ``> out 2> err`` are files the driver cannot open beside the JVM."""
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    missing = tmp_path / "missing.bag"
    argv = [adcloud, "submit", "--master", "local[1]", "--", "ingest", str(missing)]
    argv += ["--out", str(tmp_path / "o")]
    if into == "pipes":
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        with (tmp_path / "out").open("w") as stdout, (tmp_path / "err").open("w") as stderr:
            run = subprocess.run(argv, stdout=stdout, stderr=stderr, timeout=180, check=False)
        code = run.returncode
        out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert code == 2, out + err
    assert f"error: bag '{missing}' does not exist" in " ".join(err.split()), err
    assert out == ""
