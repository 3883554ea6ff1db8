"""Spark sessions and the real standalone cluster (:mod:`adcloud.spark`).

Executors are identified from inside tasks by walking ``/proc`` from the Python worker up to
its ``CoarseGrainedExecutorBackend`` JVM, whose command line carries ``--executor-id``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from py4j.protocol import Py4JJavaError
from pyspark.sql import SparkSession

from adcloud.errors import ConfigError, MissingComponentError
from adcloud.spark import (
    JAVA_INSTALL_HINT,
    WORKER_IMPORTS_ENV,
    SparkClusterError,
    SparkSettings,
    StandaloneCluster,
    check_master,
    class_archive_options,
    find_java,
    get_session,
    spark_conf,
    spark_home,
)
from tests.processes import alive, children

REPO_ROOT = Path(__file__).resolve().parents[1]


def executor_of_this_task(_: object = None) -> tuple[str, int, int, str]:
    """(executor id, executor JVM pid, Python worker pid, Python executable) of a task."""
    time.sleep(0.3)  # long enough that the scheduler hands tasks to every free core
    pid = os.getpid()
    while pid > 1:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"org.apache.spark.executor.CoarseGrainedExecutorBackend" in argv:
            executor_id = argv[argv.index(b"--executor-id") + 1].decode()
            return executor_id, pid, os.getpid(), sys.executable
        pid = parent_pid(pid)
    return "driver", 0, os.getpid(), sys.executable


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def python_env(**extra: str) -> dict[str, str]:
    """This environment without adcloud/Spark overrides that would leak into a subprocess."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ADCLOUD_SPARK_", "PYSPARK_", "SPARK_"))
    }
    env.update(extra)
    return env


# -- settings ----------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    settings = SparkSettings.load(environ={})
    assert settings == SparkSettings()
    assert settings.master == "local[*,4]"
    assert settings.app_name == "adcloud"
    assert settings.log_level == "WARN"
    assert settings.conf_pairs() == {}


def test_settings_environment_override() -> None:
    settings = SparkSettings.load(
        environ={
            "ADCLOUD_SPARK_MASTER": "spark://127.0.0.1:7077",
            "ADCLOUD_SPARK_EXECUTOR_MEMORY": "3g",
            "ADCLOUD_SPARK_CONF": "spark.ui.enabled=false, spark.sql.shuffle.partitions=7",
        }
    )
    assert settings.master == "spark://127.0.0.1:7077"
    assert settings.executor_memory == "3g"
    assert settings.conf_pairs() == {
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "7",
    }
    explicit = SparkSettings.load(environ={"ADCLOUD_SPARK_MASTER": "local[3]"}, master="local[1]")
    assert explicit.master == "local[1]"


def test_worker_imports_reach_the_daemon_through_the_executor_environment() -> None:
    settings = SparkSettings.load(environ={"ADCLOUD_SPARK_WORKER_IMPORTS": "torch, numpy"})
    assert settings.worker_imports == ("torch", "numpy")
    conf = spark_conf(settings)
    assert conf[f"spark.executorEnv.{WORKER_IMPORTS_ENV}"] == "torch,numpy"
    assert not any(k.startswith("spark.executorEnv.") for k in spark_conf(SparkSettings()))
    with pytest.raises(ConfigError, match=r"spark\.worker_imports: 'torch numpy' is not a module"):
        SparkSettings(worker_imports=("torch numpy",))


def test_the_daemon_imports_what_it_is_asked_to_and_reports_what_it_cannot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys  # noqa: PLC0415

    from adcloud import _pyspark_daemon  # noqa: PLC0415

    monkeypatch.setattr(_pyspark_daemon, "imported", [])
    monkeypatch.delitem(sys.modules, "wave", raising=False)
    monkeypatch.setenv(WORKER_IMPORTS_ENV, "wave,adcloud_no_such_module")
    _pyspark_daemon._import_requested()
    assert _pyspark_daemon.imported == ["wave"] and "wave" in sys.modules
    err = capsys.readouterr().err
    assert "cannot import 'adcloud_no_such_module' before forking workers" in err
    assert "ModuleNotFoundError" in err


def _imported_before_fork(_: int) -> list[str]:
    import sys  # noqa: PLC0415

    daemon = sys.modules["__main__"]  # the forked daemon: python -m adcloud._pyspark_daemon
    assert daemon.__spec__ is not None and daemon.__spec__.name == "adcloud._pyspark_daemon"
    return list(daemon.imported)


def test_a_session_s_worker_imports_are_imported_before_the_workers_fork(
    spark: SparkSession,
) -> None:
    """The test session asks for torch (tests/conftest.py): its daemon imported it before
    forking the worker that runs the task."""
    assert spark.sparkContext.parallelize([0], 1).map(_imported_before_fork).collect() == [
        ["torch"]
    ]


def test_settings_conf_entry_without_equals_sign_is_an_error() -> None:
    settings = SparkSettings(conf=("spark.ui.enabled",))
    with pytest.raises(ConfigError, match=r"spark\.conf.*key=value"):
        settings.conf_pairs()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ADCLOUD_SPARK_DRIVER_MEMORY", "lots"),
        ("ADCLOUD_SPARK_DRIVER_MEMORY", "1.5g"),
        ("ADCLOUD_SPARK_EXECUTOR_MEMORY", "0"),
        ("ADCLOUD_SPARK_EXECUTOR_MEMORY", ""),
        ("ADCLOUD_SPARK_LOG_LEVEL", "loud"),
    ],
)
def test_a_memory_or_log_level_spark_cannot_take_is_refused_before_a_jvm_starts(
    variable: str, value: str
) -> None:
    """Found by Spark only once a JVM ran: a Java stack trace and "Java gateway process
    exited" for a memory size, a Py4J traceback from setLogLevel for a log level."""
    field = variable.removeprefix("ADCLOUD_SPARK_").lower()
    with pytest.raises(ConfigError, match=rf"spark\.{field}: {value!r} is not .*{variable}"):
        SparkSettings.load(environ={variable: value})
    taken = SparkSettings.load(
        environ={
            "ADCLOUD_SPARK_DRIVER_MEMORY": "1400M",
            "ADCLOUD_SPARK_EXECUTOR_MEMORY": "2gb",
            "ADCLOUD_SPARK_LOG_LEVEL": "info",
        }
    )
    assert (taken.driver_memory, taken.executor_memory, taken.log_level) == ("1400M", "2gb", "info")


def test_get_session_rejects_a_non_spark_key() -> None:
    with pytest.raises(ConfigError, match="not a Spark configuration key"):
        get_session(SparkSettings(master="local[1]"), master="local[1]")


# -- java --------------------------------------------------------------------------------------


def test_spark_conf_quiets_the_driver_unless_told_otherwise() -> None:
    settings = SparkSettings()
    opts = spark_conf(settings)["spark.driver.extraJavaOptions"].split()
    prop = Path(opts[0].removeprefix("-Dlog4j2.configurationFile="))
    assert prop.is_file() and "rootLogger.level = warn" in prop.read_text()
    own = spark_conf(settings, {"spark.driver.extraJavaOptions": "-Xss4m"})
    # the user's options replace adcloud's, and keep only the class archive beside them
    assert own["spark.driver.extraJavaOptions"].split() == ["-Xss4m", *class_archive_options()]


@pytest.mark.parametrize(
    ("memory", "region"),
    [("1400m", True), ("1g", True), ("7G", True), ("512", True), ("8g", False), ("64g", False)],
)
def test_small_heaps_get_g1_regions_that_hold_sparks_cache_chunks(
    memory: str, region: bool
) -> None:
    """Below 8 GiB of heap the JVMs get 4 MiB G1 regions (1 MiB cache chunks would be
    humongous objects), above it G1's own choice; the user's own options always win."""
    conf = spark_conf(SparkSettings(driver_memory=memory, executor_memory=memory))
    for role in ("driver", "executor"):
        opts = conf.get(f"spark.{role}.extraJavaOptions", "").split()
        assert ("-XX:G1HeapRegionSize=4m" in opts) is region, (role, opts)
    own = spark_conf(
        SparkSettings(executor_memory=memory), {"spark.executor.extraJavaOptions": "-Xss4m"}
    )
    assert own["spark.executor.extraJavaOptions"] == "-Xss4m"


@pytest.mark.parametrize(
    ("master", "quick"),
    [
        ("local[*,4]", True),
        ("local", True),
        ("local[2]", True),
        ("local-cluster[2,1,1024]", False),
        ("spark://127.0.0.1:7077", False),
        ("yarn", False),
    ],
)
def test_a_local_sessions_jvm_compiles_with_c1_alone(master: str, quick: bool) -> None:
    """A local session is one JVM, mostly short-lived: C1 alone (C2's compiling of Spark's
    start-up code cost as much CPU as the rest of a short session); a cluster's JVMs keep
    both compilers, and a user's own options are theirs."""
    conf = spark_conf(SparkSettings(master=master))
    assert ("-XX:TieredStopAtLevel=1" in conf["spark.driver.extraJavaOptions"].split()) is quick
    assert "Tiered" not in conf.get("spark.executor.extraJavaOptions", "")
    own = spark_conf(SparkSettings(master=master), {"spark.driver.extraJavaOptions": "-Xss4m"})
    assert "Tiered" not in own["spark.driver.extraJavaOptions"]


CACHE_OVER_CAPACITY = """
import sys
import numpy as np
from pyspark import StorageLevel
from adcloud.spark import SparkSettings, get_session
extra = dict(arg.split("=", 1) for arg in sys.argv[1:])
spark = get_session(
    SparkSettings(master="local[1]", app_name="heap", driver_memory="1400m"),
    **{"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", **extra},
)
sc = spark.sparkContext
n = 120  # x 8 MiB: 960 MiB cached twice, against 660 MiB of storage memory
first = sc.parallelize(range(n), n).map(lambda i: np.random.default_rng(i).random(1 << 20))
first = first.persist(StorageLevel.MEMORY_AND_DISK)
second = first.map(lambda a: a * 2).persist(StorageLevel.MEMORY_AND_DISK)
ratio = second.map(lambda a: a.sum()).sum() / first.map(lambda a: a.sum()).sum()
print(f"ratio {ratio:.6f}")
spark.stop()
"""


def test_a_cache_larger_than_storage_memory_spills_instead_of_exhausting_the_heap(
    tmp_path: Path,
) -> None:
    """Two cached stages of 8 MiB arrays, each larger than a 1400 MiB heap's storage memory:
    with adcloud's JVM options Spark evicts blocks to disk and the job finishes.  (With G1's
    own 1 MiB regions on JDK 17 the same job dies of ``OutOfMemoryError: Java heap space``
    before Spark evicts anything, as a 1-core 1400 MiB executor did on a 32-beam map build.)
    """
    script = tmp_path / "cache.py"
    script.write_text(CACHE_OVER_CAPACITY)
    proc = subprocess.run(
        [sys.executable, str(script), f"spark.local.dir={tmp_path}"],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert "ratio 2.000000" in proc.stdout, tail
    assert "OutOfMemoryError" not in proc.stderr, tail


def _segfault_in_native_code(i: int) -> int:
    os.kill(os.getpid(), signal.SIGSEGV)  # as a native library's bad read ends the process
    return i


def test_a_worker_killed_by_a_native_crash_fails_its_task_with_the_python_traceback(
    spark: SparkSession,
) -> None:
    """A segfault in a worker (a native library's bug) is reported with where Python was:
    adcloud turns on Spark's faulthandler for Python workers, a user's setting wins."""
    assert spark_conf(SparkSettings())["spark.python.worker.faulthandler.enabled"] == "true"
    own = {"spark.python.worker.faulthandler.enabled": "false"}
    assert spark_conf(SparkSettings(), own)["spark.python.worker.faulthandler.enabled"] == "false"
    with pytest.raises(Py4JJavaError, match="exited unexpectedly") as err:
        spark.sparkContext.parallelize([1], 1).map(_segfault_in_native_code).collect()
    said = str(err.value)
    assert "Segmentation fault" in said and "_segfault_in_native_code" in said, said[-3000:]
    # the session goes on: the daemon forks a new worker for the next task
    assert spark.sparkContext.parallelize([1, 2], 1).map(lambda x: x + 1).sum() == 5


def test_the_worker_daemon_ends_quietly_when_spark_closed_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pyspark.daemon  # noqa: PLC0415

    from adcloud import _pyspark_daemon  # noqa: PLC0415

    assert spark_conf(SparkSettings())["spark.python.daemon.module"] == "adcloud._pyspark_daemon"
    assert pyspark.daemon.worker is _pyspark_daemon.worker  # what the daemon's manager calls

    def closed(sock: object, authenticated: bool) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    froze: list[bool] = []
    monkeypatch.setattr(_pyspark_daemon, "_freeze_what_imports_built", lambda: froze.append(True))
    monkeypatch.setattr(_pyspark_daemon, "_worker", closed)
    assert _pyspark_daemon.worker(None, True) == 1  # the worker ends, no traceback
    assert froze == []
    monkeypatch.setattr(_pyspark_daemon, "_worker", lambda sock, authenticated: 0)
    assert _pyspark_daemon.worker(None, True) == 0  # reused as before
    assert froze == [True]  # after a finished task (see the next test)

    def broken(sock: object, authenticated: bool) -> int:
        raise ValueError("a real bug")

    monkeypatch.setattr(_pyspark_daemon, "_worker", broken)
    with pytest.raises(ValueError, match="a real bug"):
        _pyspark_daemon.worker(None, True)


def _worker_gc(module: str) -> tuple[int, int, int, bool]:
    """In a Python worker: (pid, objects frozen, objects the full collection after this task
    will walk, whether garbage in a reference cycle made now is still freed)."""
    import gc  # noqa: PLC0415
    import importlib  # noqa: PLC0415
    import os  # noqa: PLC0415
    import weakref  # noqa: PLC0415

    importlib.import_module(module)

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # type: ignore[attr-defined]
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    return os.getpid(), gc.get_freeze_count(), len(gc.get_objects()), gone() is None


def test_python_workers_freeze_what_imports_built_so_collections_stay_cheap(
    spark: SparkSession,
) -> None:
    """The daemon's full collection after every task walked every object a worker holds:
    ~180,000 once torch was imported, ~0.15 s of a core per task.  After a task that
    imported something the worker freezes what survived, so the next collections walk only
    what later tasks made; cyclic garbage made later is still freed."""
    sc = spark.sparkContext
    first = sc.parallelize(["torch", "torch"], 2).map(_worker_gc).collect()
    after = sc.parallelize(["json", "json"], 2).map(_worker_gc).collect()
    frozen = {pid: count for pid, count, _, _ in after}
    assert all(freed for *_, freed in first + after)
    for pid, *_ in first:
        if pid in frozen:  # the same reused worker ran a task of both jobs
            assert frozen[pid] > 100_000  # torch's objects, frozen after the first task
    walked_after = [walked for pid, _, walked, _ in after if frozen[pid] > 100_000]
    assert walked_after and max(walked_after) < 20_000, after


@pytest.mark.parametrize(
    ("module", "stranger_survives"),
    [("pyspark.daemon", False), ("adcloud._pyspark_daemon", True)],
)
def test_the_daemon_kills_its_own_workers_only(module: str, stranger_survives: bool) -> None:
    """Spark asks the daemon to kill a worker by writing its pid (a cancelled task, an idle
    worker closed). PySpark's own daemon kills whatever process has that pid -- after the
    worker ended and the machine's pids wrapped around, another session's worker; adcloud's
    kills only a worker it forked and that is still running."""
    daemon = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=python_env(SPARK_REUSE_WORKER="1"),
    )
    stranger = subprocess.Popen(["sleep", "60"])
    assert daemon.stdin is not None and daemon.stdout is not None
    try:
        (port,) = struct.unpack(">i", daemon.stdout.read(4))
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            (worker,) = struct.unpack(">i", sock.recv(4, socket.MSG_WAITALL))  # forked for us
            assert alive(worker) and worker in children(daemon.pid)
            # the stranger's pid first, then the worker's: once the worker is gone, the
            # daemon has handled both
            daemon.stdin.write(struct.pack(">ii", stranger.pid, worker))
            daemon.stdin.flush()
            while sock.recv(4096):
                pass
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
        if not stranger_survives:  # killed before the worker was; reaped here
            stranger.wait(timeout=10)
        assert (stranger.poll() is None) is stranger_survives
    finally:
        daemon.stdin.close()  # the daemon's signal to exit
        daemon.wait(timeout=30)
        stranger.kill()
        stranger.wait()


def _sleep_in_a_worker(path: str) -> int:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)
    return 0


def test_a_cancelled_tasks_worker_is_killed_through_the_daemon(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Spark kills the Python worker of a cancelled task through the daemon, which kills
    the worker it forked (the pid check of the test above lets its own workers through)."""
    sc = spark.sparkContext
    marker = tmp_path / "pid"
    failed: list[BaseException] = []

    def run() -> None:
        sc.setJobGroup("adcloud-cancel-test", "a task that sleeps", interruptOnCancel=True)
        try:
            sc.parallelize([str(marker)], 1).map(_sleep_in_a_worker).collect()
        except Py4JJavaError as err:
            failed.append(err)

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the pid is written
    worker = int(marker.read_text())
    assert alive(worker)
    sc.cancelJobGroup("adcloud-cancel-test")
    job.join(timeout=60)
    assert failed and "cancel" in str(failed[0]).lower()
    deadline = time.monotonic() + 30
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


def test_the_daemon_loads_the_installed_pyspark_instead_of_its_zipped_copy(
    tmp_path: Path,
) -> None:
    from adcloud._pyspark_daemon import _prefer_installed_pyspark  # noqa: PLC0415

    site = tmp_path / "site"
    lib = site / "pyspark" / "python" / "lib"
    lib.mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    shipped, py4j = str(lib / "pyspark.zip"), str(lib / "py4j-0.10.9.9-src.zip")
    # pip's pyspark: the zip inside the installed package goes after it
    assert _prefer_installed_pyspark([shipped, py4j, str(site)]) == [py4j, str(site), shipped]
    # py4j's zip goes after the installed py4j only when that is the same version
    (site / "py4j").mkdir()
    (site / "py4j" / "version.py").write_text("__version__ = '0.10.9.8'\n")
    assert _prefer_installed_pyspark([shipped, py4j, str(site)]) == [py4j, str(site), shipped]
    (site / "py4j" / "version.py").write_text("__version__ = '0.10.9.9'\n")
    assert _prefer_installed_pyspark([shipped, py4j, str(site)]) == [str(site), shipped, py4j]
    # a Spark distribution elsewhere keeps its zip first, as Spark intends
    other = tmp_path / "spark-4.0.0" / "python" / "lib" / "pyspark.zip"
    assert _prefer_installed_pyspark([str(other), str(site)]) == [str(other), str(site)]
    # the installed package is not on the path: nothing moves
    assert _prefer_installed_pyspark([shipped, py4j]) == [shipped, py4j]


def test_python_workers_import_pyspark_with_cached_bytecode(spark: SparkSession) -> None:
    import pyspark  # noqa: PLC0415

    def where(_: int) -> str:
        import py4j  # noqa: PLC0415
        import pyspark  # noqa: PLC0415

        return f"{pyspark.__file__} {py4j.__file__}"

    import py4j  # noqa: PLC0415

    files = set(spark.sparkContext.parallelize(range(2), 2).map(where).collect())
    # not .../pyspark.zip/pyspark/__init__.py nor .../py4j-*-src.zip/py4j/__init__.py
    assert files == {f"{pyspark.__file__} {py4j.__file__}"}, files


def test_a_fresh_local_session_starts_without_chatter() -> None:
    """A newcomer's first job: Spark's start-up notices (default log4j profile, host name
    resolving to loopback, no native Hadoop) do not reach the terminal; the job runs."""
    code = (
        "from adcloud.spark import get_session\n"
        "print(get_session().sparkContext.parallelize(range(100), 2).sum())\n"
    )
    unset = ("SPARK_LOCAL_IP", "ADCLOUD_SPARK_CONF")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["ADCLOUD_SPARK_MASTER"] = "local[1]"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "4950"
    for chatter in (
        "default log4j profile",
        "loopback address",
        "NativeCodeLoader",
        "Traceback",
        "spark.executor.memory",  # adcloud's own default is not worth a warning
    ):
        assert chatter not in done.stderr, done.stderr


def test_an_executor_memory_a_local_master_ignores_is_pointed_out() -> None:
    from adcloud.spark import _ignored_executor_memory  # noqa: PLC0415

    said = _ignored_executor_memory("local[2]", "6g")
    assert said is not None and "spark.executor.memory=6g has no effect" in said
    assert "--driver-memory" in said
    assert _ignored_executor_memory("local", "6g") is not None
    assert _ignored_executor_memory("local[*,4]", "1g") is None  # adcloud's default
    assert _ignored_executor_memory("local[2]", None) is None
    for cluster in ("local-cluster[2,1,1024]", "spark://127.0.0.1:7077", "yarn"):
        assert _ignored_executor_memory(cluster, "6g") is None


def test_the_default_local_master_retries_a_failed_task_as_a_cluster_does(
    tmp_path: Path,
) -> None:
    """Infrastructure failures are retried by Spark on the embedded default too: a task that
    fails once is tried again and the job succeeds."""
    marker = tmp_path / "failed-once"
    code = textwrap.dedent(
        f"""
        import os
        from adcloud.spark import get_session

        def flaky(i):
            if i == 7 and not os.path.exists({str(marker)!r}):
                open({str(marker)!r}, "w").close()
                raise RuntimeError("a passing infrastructure failure")
            return i

        sc = get_session().sparkContext
        print(sc.master)
        print(sc.parallelize(range(100), 2).map(flaky).sum())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["local[*,4]", "4950"]
    assert marker.exists() and "a passing infrastructure failure" in done.stderr


SUBMITTED_JOB = """
import json
from adcloud.spark import get_session
spark = get_session(**{"spark.sql.shuffle.partitions": "7"})
conf = spark.sparkContext.getConf()
keys = ["spark.executor.memory", "spark.executor.extraJavaOptions", "spark.sql.shuffle.partitions"]
print("CONF " + json.dumps({key: conf.get(key) for key in keys}))
print("NAME " + spark.sparkContext.appName)
spark.stop()
"""


def test_under_spark_submit_the_submit_line_wins_over_adcloud_defaults(tmp_path: Path) -> None:
    job = tmp_path / "job.py"
    job.write_text(SUBMITTED_JOB)
    done = subprocess.run(
        [
            str(spark_home() / "bin" / "spark-submit"),
            *("--master", "local[2]", "--conf", "spark.executor.memory=3g"),
            *("--conf", "spark.executor.extraJavaOptions=-Xss4m"),
            *("--conf", "spark.sql.shuffle.partitions=3"),
            *("--name", "nightly-map"),
            str(job),
        ],
        env=python_env(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("CONF "))
    conf = json.loads(line.removeprefix("CONF "))
    # adcloud's default executor memory (1g) and JVM options no longer replace the user's
    assert conf["spark.executor.memory"] == "3g"
    assert conf["spark.executor.extraJavaOptions"].split()[-1] == "-Xss4m"
    assert "G1HeapRegionSize" not in conf["spark.executor.extraJavaOptions"]
    # what the program itself asks for still wins, as in Spark
    assert conf["spark.sql.shuffle.partitions"] == "7"
    # the submit line's application name, not adcloud's default (the Spark UI, the master's
    # and the history server's list of applications showed every submitted job as "adcloud")
    assert "NAME nightly-map" in done.stdout.splitlines()


def test_find_java_reports_java_17_or_newer() -> None:
    java, major = find_java()
    assert java.name == "java"
    assert major >= 17


def test_too_old_java_is_a_missing_component(tmp_path: Path) -> None:
    fake = tmp_path / "java"
    fake.write_text("#!/bin/sh\necho 'openjdk version \"11.0.20\" 2023-07-18' >&2\n")
    fake.chmod(0o755)
    with pytest.raises(MissingComponentError, match="is Java 11") as info:
        find_java(environ={"PATH": str(tmp_path)})
    assert "openjdk-17-jre-headless" in str(info.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PATH": "/nonexistent"}, "no `java` is on PATH"),
        ({"PATH": "/nonexistent", "JAVA_HOME": "/nonexistent/jdk"}, "has no executable bin/java"),
    ],
)
def test_get_session_without_java_raises_missing_component(
    env: dict[str, str], message: str
) -> None:
    code = textwrap.dedent(
        """
        from adcloud.errors import MissingComponentError
        from adcloud.spark import SparkSettings, get_session
        try:
            get_session(SparkSettings(master="local[1]"))
        except MissingComponentError as err:
            print("MISSING:", err)
        else:
            print("NO ERROR")
        """
    )
    clean = {k: v for k, v in python_env().items() if k not in ("PATH", "JAVA_HOME")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("MISSING:"), proc.stdout + proc.stderr
    assert message in proc.stdout
    assert JAVA_INSTALL_HINT in proc.stdout


# -- local session ------------------------------------------------------------------------------


def test_spark_home_is_the_bundled_spark() -> None:
    home = spark_home()
    assert (home / "bin" / "spark-class").is_file()
    assert (home / "jars").is_dir()


def test_local_session_runs_a_job(spark: SparkSession) -> None:
    sc = spark.sparkContext
    assert sc.master == "local[2]"
    assert sc.getConf().get("spark.sql.execution.arrow.pyspark.enabled") == "true"
    assert sc.getConf().get("spark.ui.enabled") == "false"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "4"
    squares = sc.parallelize(range(1000), 4).map(lambda x: x * x)
    assert squares.sum() == sum(x * x for x in range(1000))
    # Python workers run the interpreter (and so the venv) of the driver.
    executables = set(sc.parallelize(range(4), 4).map(lambda _: sys.executable).collect())
    assert executables == {sys.executable}


def test_get_session_returns_the_active_session(spark: SparkSession) -> None:
    assert get_session(SparkSettings(master="local[2]")) is spark


def test_get_session_refuses_a_second_master(spark: SparkSession) -> None:
    with pytest.raises(ConfigError, match=r"'local\[2\]' is already active"):
        get_session(SparkSettings(master="local[1]"))


def test_a_master_on_loopback_gets_a_driver_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Executors on this machine's loopback reach the driver there; other masters, and the
    user's own choice of the driver's address, are left alone."""
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.delenv("SPARK_LOCAL_HOSTNAME", raising=False)
    here = (
        "local[2]",
        "local-cluster[2,1,1024]",
        "spark://127.0.0.1:7077",
        "spark://localhost:7077",
        "spark://127.0.0.1:7077,127.0.0.1:7078",
        "spark://[::1]:7077",
    )
    for master in here:
        assert spark_conf(SparkSettings(master=master))["spark.driver.host"] == "127.0.0.1"
    elsewhere = (
        "spark://10.0.0.5:7077",
        "spark://master.example.com:7077",
        "spark://127.0.0.1:7077,10.0.0.5:7077",
        "yarn",
        "k8s://https://127.0.0.1:6443",
    )
    for master in elsewhere:
        assert "spark.driver.host" not in spark_conf(SparkSettings(master=master)), master
    loopback = SparkSettings(master="spark://127.0.0.1:7077")
    assert spark_conf(loopback, {"spark.driver.host": "vm"})["spark.driver.host"] == "vm"
    own = SparkSettings(master="spark://127.0.0.1:7077", conf=("spark.driver.host=vm",))
    assert spark_conf(own)["spark.driver.host"] == "vm"
    monkeypatch.setenv("SPARK_LOCAL_IP", "192.0.2.7")  # Spark's own default, kept
    assert spark_conf(loopback)["spark.driver.host"] == "192.0.2.7"
    monkeypatch.setenv("SPARK_LOCAL_HOSTNAME", "vm")
    assert "spark.driver.host" not in spark_conf(loopback)


# -- standalone cluster -----------------------------------------------------------------------


def test_cluster_reports_its_workers_alive(cluster: StandaloneCluster) -> None:
    status = cluster.status()
    assert status["status"] == "ALIVE"
    assert status["url"] == cluster.master_url
    workers = [w for w in status["workers"] if w["state"] == "ALIVE"]
    assert len(workers) == 2
    assert {w["cores"] for w in workers} == {1}
    assert {w["memory"] for w in workers} == {1024}
    assert {w["host"] for w in workers} == {"127.0.0.1"}


def test_a_session_on_a_loopback_cluster_keeps_its_driver_there(
    cluster: StandaloneCluster,
) -> None:
    """A driver for ``spark://127.0.0.1:PORT`` took its host name's address: where that
    resolves to loopback, Spark warned ("resolves to a loopback address ... Set
    SPARK_LOCAL_IP") and bound the driver to another interface's address instead. No job
    runs: the cluster's cores may be another session's."""
    code = (
        "from adcloud.spark import get_session\n"
        "session = get_session(**{'spark.ui.enabled': 'false'})\n"
        "print(session.sparkContext.getConf().get('spark.driver.host'))\n"
        "session.stop()\n"
    )
    unset = ("SPARK_LOCAL_IP", "SPARK_LOCAL_HOSTNAME", "ADCLOUD_SPARK_CONF")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["ADCLOUD_SPARK_MASTER"] = cluster.master_url
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "127.0.0.1"
    assert "loopback address" not in done.stderr, done.stderr


def test_cluster_job_runs_on_two_executors(
    cluster_spark: SparkSession, cluster: StandaloneCluster
) -> None:
    sc = cluster_spark.sparkContext
    assert sc.master == cluster.master_url
    seen = sc.parallelize(range(8), 8).map(executor_of_this_task).collect()
    executor_ids = {s[0] for s in seen}
    jvm_pids = {s[1] for s in seen}
    assert len(executor_ids) == 2, seen
    assert len(jvm_pids) == 2, seen
    assert {s[3] for s in seen} == {sys.executable}
    # The executors are children of the cluster's worker JVMs, one per worker.
    workers = {w.pid for w in cluster.worker_infos}
    assert {parent_pid(pid) for pid in jvm_pids} == workers
    # Every JVM of the cluster started from the class archive (adcloud._jvm_archive).
    archive = class_archive_options()[0].removeprefix("-XX:SharedArchiveFile=")
    for pid in [*jvm_pids, *cluster.pids]:
        assert archive in Path(f"/proc/{pid}/maps").read_text(), pid


GPU_DISCOVERY = """#!/bin/sh
echo '{"name": "gpu", "addresses": ["0", "1"]}'
"""

DRIVER = """
import json, os, sys, time
from pathlib import Path
from pyspark import TaskContext
from adcloud.spark import get_session, wait_for_executors

from pyspark import cloudpickle

sys.path.insert(0, sys.argv[1])
import test_spark  # noqa: E402
from test_spark import executor_of_this_task  # noqa: E402

cloudpickle.register_pickle_by_value(test_spark)  # executors cannot import the test module

def probe(index):
    identity = executor_of_this_task()
    return (*identity, TaskContext.get().resources()["gpu"].addresses)

spark = get_session()  # everything from ADCLOUD_SPARK_* in the environment
wait_for_executors(spark, 1)
sc = spark.sparkContext
result = {
    "master": sc.master,
    "app_name": sc.appName,
    "shuffle_partitions": spark.conf.get("spark.sql.shuffle.partitions"),
    "tasks": sc.parallelize(range(4), 4).map(probe).collect(),
}
print(json.dumps(result), flush=True)
sys.stdin.read()  # the application (and its executor) lives until the test closes stdin
os._exit(0)
"""


@pytest.fixture(scope="module")
def gpu_cluster_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 1-worker cluster offering 2 "gpu"s and a running application driven from a subprocess.

    The driver subprocess is configured only through ``ADCLOUD_SPARK_*`` variables and keeps
    its application (and so its executor) running until the fixture ends.  Yields the
    cluster, the driver process and what the driver printed.
    """
    base = tmp_path_factory.mktemp("gpu-cluster")
    script = base / "discover-gpus.sh"
    script.write_text(GPU_DISCOVERY)
    script.chmod(0o755)
    with StandaloneCluster(
        1, cores=2, memory="1g", resources={"gpu": (2, script)}, log_dir=base / "logs"
    ) as cluster:
        conf = {
            **cluster.session_conf(),
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "5",
            "spark.executor.cores": "2",
            "spark.executor.resource.gpu.amount": "2",
            "spark.executor.resource.gpu.discoveryScript": str(script),
            "spark.task.resource.gpu.amount": "1",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }
        env = python_env(
            ADCLOUD_SPARK_MASTER=cluster.master_url,
            ADCLOUD_SPARK_APP_NAME="from-the-environment",
            ADCLOUD_SPARK_DRIVER_MEMORY="512m",
            ADCLOUD_SPARK_EXECUTOR_MEMORY="512m",
            ADCLOUD_SPARK_CONF=",".join(f"{k}={v}" for k, v in conf.items()),
        )
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(Path(__file__).parent)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(base / "driver.log").open("wb"),
            text=True,
        )
        try:
            line = driver.stdout.readline() if driver.stdout else ""
            if not line:
                driver.wait(timeout=30)
                log = (base / "driver.log").read_text()[-3000:]
                pytest.fail(f"driver exited with {driver.returncode}:\n{log}")
            yield {"cluster": cluster, "driver": driver, "result": json.loads(line)}
        finally:
            driver.kill()
            driver.wait(timeout=30)


@pytest.mark.spark
@pytest.mark.cluster
def test_environment_settings_reach_a_real_session(gpu_cluster_app: dict[str, Any]) -> None:
    result = gpu_cluster_app["result"]
    assert result["master"] == gpu_cluster_app["cluster"].master_url
    assert result["app_name"] == "from-the-environment"
    assert result["shuffle_partitions"] == "5"


@pytest.mark.spark
@pytest.mark.cluster
def test_worker_resources_reach_tasks(gpu_cluster_app: dict[str, Any]) -> None:
    cluster: StandaloneCluster = gpu_cluster_app["cluster"]
    (worker,) = cluster.status()["workers"]
    assert worker["resources"]["gpu"]["addresses"] == ["0", "1"]
    tasks = gpu_cluster_app["result"]["tasks"]
    assert len(tasks) == 4
    for task in tasks:
        assert task[0] != "driver"
        assert len(task[4]) == 1
        assert task[4][0] in {"0", "1"}


@pytest.mark.spark
@pytest.mark.cluster
def test_stop_with_a_running_application_leaves_no_process(
    gpu_cluster_app: dict[str, Any],
) -> None:
    cluster: StandaloneCluster = gpu_cluster_app["cluster"]
    tasks = gpu_cluster_app["result"]["tasks"]
    executors = {t[1] for t in tasks}
    python_workers = {t[2] for t in tasks}
    daemons = list(cluster.pids)
    assert all(alive(pid) for pid in [*daemons, *executors])
    started = time.monotonic()
    cluster.stop()
    assert time.monotonic() - started < 15
    assert [p for p in [*daemons, *executors, *python_workers] if alive(p)] == []
    assert cluster.pids == []
    cluster.stop()  # idempotent


@pytest.mark.cluster
def test_cluster_dies_with_a_killed_parent(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import json, sys, time
        from adcloud.spark import StandaloneCluster
        cluster = StandaloneCluster(1, log_dir=sys.argv[1]).start()
        print(json.dumps(cluster.pids), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        env=python_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        pids = json.loads(line)
        assert len(pids) == 2
        assert all(alive(pid) for pid in pids)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
    assert wait_gone(pids, timeout=20) == []


@pytest.mark.cluster
def test_a_cluster_start_stopped_half_way_stops_what_it_launched(tmp_path: Path) -> None:
    """SIGTERM to ``start-cluster.sh`` while the workers come up: the master and workers it
    already launched are stopped, not left running with nothing recording them."""
    env = python_env(ADCLOUD_CLUSTER_STATE=str(tmp_path / "state"), ADCLOUD_PYTHON=sys.executable)
    start = subprocess.Popen(
        [str(REPO_ROOT / "deploy" / "local" / "start-cluster.sh"), "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    launched: set[int] = set()
    deadline = time.monotonic() + 60
    while len(launched) < 2 and time.monotonic() < deadline and start.poll() is None:
        launched |= set(children(start.pid))  # the master, then the first worker
        time.sleep(0.05)
    assert len(launched) >= 2, "the start never launched a master and a worker"
    start.terminate()
    _, err = start.communicate(timeout=60)
    assert start.returncode == 130, err
    assert wait_gone(sorted(launched), timeout=20) == []


@pytest.mark.cluster
def test_deploy_scripts_start_and_stop_a_cluster(tmp_path: Path) -> None:
    env = python_env(ADCLOUD_CLUSTER_STATE=str(tmp_path / "state"), ADCLOUD_PYTHON=sys.executable)
    start = subprocess.run(
        [str(REPO_ROOT / "deploy" / "local" / "start-cluster.sh"), "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert start.returncode == 0, start.stderr
    master_url = start.stdout.strip()
    assert master_url.startswith("spark://127.0.0.1:")
    state = tmp_path / "state"
    assert (state / "master-url").read_text().strip() == master_url
    pids = [int(p) for p in (state / "pids").read_text().split()]
    try:
        assert len(pids) == 3
        handle = StandaloneCluster.from_state(state)
        alive_workers = [w for w in handle.status()["workers"] if w["state"] == "ALIVE"]
        assert len(alive_workers) == 2
        again = subprocess.run(
            [str(REPO_ROOT / "deploy" / "local" / "start-cluster.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert again.returncode != 0
        assert "still running" in again.stderr
    finally:
        stop = subprocess.run(
            [str(REPO_ROOT / "deploy" / "local" / "stop-cluster.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert stop.returncode == 0, stop.stderr
    assert wait_gone(pids, timeout=5) == []
    assert not (state / "cluster.json").exists()
    # Stopping again is harmless.
    assert (
        subprocess.run(
            [str(REPO_ROOT / "deploy" / "local" / "stop-cluster.sh")], env=env, check=False
        ).returncode
        == 0
    )
    # the status of a stopped cluster says so (it named a missing file "not readable")
    status = subprocess.run(
        [sys.executable, "-m", "adcloud.spark", "cluster", "status", "--state-dir", str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 2
    assert f"no cluster recorded in {state}: none was started there, or it was stopped" in (
        status.stderr
    )


def test_missing_discovery_script_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not executable"):
        StandaloneCluster(1, resources={"gpu": (1, tmp_path / "missing.sh")})


@pytest.mark.parametrize("memory", ["lots", "0", "1.5g", ""])
def test_a_worker_memory_spark_cannot_read_is_refused_before_anything_starts(
    tmp_path: Path, memory: str
) -> None:
    """Found only once the master ran: the worker exited with Spark's usage text."""
    with pytest.raises(ConfigError, match=f"worker memory {memory!r} is not a JVM memory size"):
        StandaloneCluster(1, memory=memory, log_dir=tmp_path)
    assert not any(tmp_path.iterdir())
    StandaloneCluster(1, memory="512M", log_dir=tmp_path)  # Spark's notation, either case


@pytest.mark.cluster
def test_failed_start_reports_the_log_tail_and_cleans_up(tmp_path: Path) -> None:
    cluster = StandaloneCluster(1, daemon_memory="lots", log_dir=tmp_path, start_timeout=60)
    with pytest.raises(SparkClusterError, match="exited with status") as info:
        cluster.start()
    assert "master.log" in str(info.value)
    assert "Invalid maximum heap size" in str(info.value)
    assert cluster.pids == []


@pytest.mark.parametrize(
    ("option", "value"),
    [("--timeout", "nan"), ("--timeout", "-5"), ("--workers", "0"), ("--cores", "1.5")],
)
def test_cluster_start_numbers_are_checked_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    """``--timeout nan`` waited for ever; ``-5`` started the JVMs and then timed out."""
    from adcloud.spark import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as stop:
        main(["cluster", "start", "--state-dir", str(tmp_path / "state"), option, value])
    assert stop.value.code == 2 and f"argument {option}" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


SPACED_CHECKOUT = """
import sys
import adcloud.spark
from pyspark import TaskContext
from adcloud.spark import SparkSettings, StandaloneCluster, class_archive_options, get_session
assert " " in adcloud.spark.__file__, adcloud.spark.__file__
print("archive", class_archive_options(), flush=True)
with StandaloneCluster(1, resources={"gpu": (1, sys.argv[1])}, log_dir=sys.argv[2]) as cluster:
    spark = get_session(
        SparkSettings(master=cluster.master_url, driver_memory="512m", executor_memory="512m"),
        **cluster.session_conf(),
        **{
            "spark.ui.enabled": "false",
            "spark.executor.resource.gpu.amount": "1",
            "spark.task.resource.gpu.amount": "1",
        },
    )
    rdd = spark.sparkContext.parallelize([0], 1)
    print("gpus", rdd.map(lambda _: TaskContext.get().resources()["gpu"].addresses).collect())
    spark.stop()
"""


@pytest.mark.spark
@pytest.mark.cluster
def test_a_checkout_and_scripts_under_a_path_with_a_space_run_spark(tmp_path: Path) -> None:
    """A checkout in "~/My Projects" broke every session: the driver's JVM options name
    adcloud's log4j2 file (and the class archive), and Spark splits an option string at
    spaces ("Could not find or load main class Projects...."); a worker's discovery script
    there kept the worker from starting."""
    spaced = tmp_path / "My Projects"
    spaced.mkdir()
    (spaced / "adcloud").symlink_to(REPO_ROOT, target_is_directory=True)
    script = spaced / "discover gpus.sh"
    script.write_text('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["7"]}\'\n')
    script.chmod(0o755)
    archives = spaced / "jvm archives"
    archives.mkdir()
    for built in _built_archives():  # linked, not copied: ~190 MB
        (archives / built.name).symlink_to(built)
    env = python_env(PYTHONPATH=str(spaced / "adcloud"), ADCLOUD_JVM_ARCHIVE_DIR=str(archives))
    done = subprocess.run(
        [sys.executable, "-c", SPACED_CHECKOUT, str(script), str(spaced / "cluster logs")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpus [['7']]" in done.stdout, done.stdout
    if _built_archives():  # and the archive itself is mapped from there
        assert "jvm archives" in done.stdout.splitlines()[0]


def _built_archives() -> list[Path]:
    from adcloud import _jvm_archive  # noqa: PLC0415

    return sorted(_jvm_archive.archive_dir().glob("*.jsa"))


def test_a_master_at_an_ipv6_address_is_reached() -> None:
    """``spark://[::1]:7077`` was looked up with its brackets and always "cannot reach"."""
    try:
        server = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as err:  # a kernel without IPv6
        pytest.skip(f"no IPv6 loopback here: {err}")
    with server:
        port = server.getsockname()[1]
        check_master(f"spark://[::1]:{port}")
    with pytest.raises(SparkClusterError, match=r"cannot reach the Spark master spark://\[::1\]"):
        check_master(f"spark://[::1]:{port}", timeout=1)


def test_the_masters_spark_takes_are_taken_and_no_others() -> None:
    """Spark reads ``local[*, 4]`` (spaces around the comma) and refuses Mesos (gone in
    Spark 4) and a ``local-cluster`` without its three numbers, with a stack trace after a
    JVM started: the check had it the other way round."""
    for master in ("local", "local[*]", "local[2]", "local[*, 4]", "local-cluster[2, 1, 1024]"):
        check_master(master, reach=False)
    for master in ("mesos://127.0.0.1:5050", "local-cluster[2]", "local-cluster[,]", "local[2,]"):
        with pytest.raises(ConfigError, match="is not one Spark takes"):
            check_master(master, reach=False)


def test_a_master_in_spark_conf_is_refused_with_where_to_set_it() -> None:
    """``ADCLOUD_SPARK_CONF=spark.master=local[1]`` replaced the master after the other one
    was checked, and a later session then said it ran on a "different master"."""
    settings = SparkSettings.load(environ={"ADCLOUD_SPARK_CONF": "spark.master=local[1]"})
    with pytest.raises(ConfigError, match=r"set the master with --master or ADCLOUD_SPARK_MASTER"):
        settings.conf_pairs()
    assert SparkSettings(conf=("spark.ui.enabled=false",)).conf_pairs() == {
        "spark.ui.enabled": "false"
    }


def test_the_status_of_a_cluster_whose_master_was_killed_says_so(tmp_path: Path) -> None:
    """``cluster status`` after ``kill -9`` of the master said only that the web UI does not
    answer, as of a master still starting."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    cluster = StandaloneCluster(1, log_dir=tmp_path)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        cluster.webui_port = free.getsockname()[1]
    cluster.master_pid = gone.pid
    with pytest.raises(SparkClusterError, match=rf"the master \(pid {gone.pid}\) is no longer"):
        cluster.status()


def test_a_recorded_pid_now_another_clusters_daemon_is_left_alone(tmp_path: Path) -> None:
    """A state directory left by a crash or a reboot records pids that may since be another
    cluster's master or worker: ``cluster start`` there refused ("still running") and
    ``cluster stop`` killed the other cluster's daemon.  Only a daemon on the recorded port
    is this cluster's."""
    daemon = ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "7177"]
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *daemon])
    try:
        state = tmp_path / "state"
        cluster = StandaloneCluster(1, log_dir=tmp_path / "logs")
        # the pid recorded, but the daemon that has it now listens on another port
        cluster.master_pid, cluster.master_port, cluster.webui_port = stand_in.pid, 7077, 8080
        cluster.write_state(state)
        stop = subprocess.run(
            [sys.executable, "-m", "adcloud.spark", "cluster", "stop", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert stop.returncode == 0, stop.stderr
        assert stand_in.poll() is None, "the other cluster's daemon was stopped"
        assert not (state / "cluster.json").exists()
        cluster.write_state(state)
        assert not StandaloneCluster.from_state(state).running()
        cluster.master_port = 7177
        cluster.write_state(state)
        assert StandaloneCluster.from_state(state).running()
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_bad_spark_conf_entry_names_the_variable() -> None:
    """``ADCLOUD_SPARK_CONF=spark.executor.extraJavaOptions=-Da=1,-Db`` (a value with a
    comma) said only that ``-Db`` is no key=value, not which variable holds it."""
    settings = SparkSettings.load(
        environ={"ADCLOUD_SPARK_CONF": "spark.executor.extraJavaOptions=-Da=1,-Db"}
    )
    with pytest.raises(ConfigError, match=r"entry '-Db' .*ADCLOUD_SPARK_CONF.*settings file"):
        settings.conf_pairs()
    # no command reads a settings file's spark section: the way a command can take such a
    # value is named too
    with pytest.raises(ConfigError, match=r"with adcloud submit --conf 'KEY=VALUE' -- COMMAND"):
        settings.conf_pairs()


def test_a_spark_conf_entry_that_is_no_spark_property_is_refused() -> None:
    """``extraJavaOptions=-Da=1,-Db=2`` split into ``-Db=2``, a key=value that Spark only
    warns about and drops: the option silently lost half its value."""
    settings = SparkSettings.load(
        environ={"ADCLOUD_SPARK_CONF": "spark.executor.extraJavaOptions=-Da=1,-Db=2"}
    )
    with pytest.raises(ConfigError, match=r"entry '-Db=2' is no Spark property.*split"):
        settings.conf_pairs()
    fine = SparkSettings.load(
        environ={"ADCLOUD_SPARK_CONF": "spark.hadoop.fs.s3a.fast.upload=true, spark.ui.port=0"}
    )
    assert fine.conf_pairs() == {"spark.hadoop.fs.s3a.fast.upload": "true", "spark.ui.port": "0"}


def test_a_damaged_cluster_state_file_says_how_to_get_past_it(tmp_path: Path) -> None:
    """A ``cluster.json`` cut short (a full disk) blocked start and stop alike with "not a
    readable cluster state file", and nothing said what to do."""
    (tmp_path / "cluster.json").write_text('{"version": 1, "master_p')
    with pytest.raises(SparkClusterError) as err:
        StandaloneCluster.from_state(tmp_path)
    text = str(err.value)
    assert text.startswith(f"{tmp_path / 'cluster.json'}: not a readable cluster state file")
    assert f"remove {tmp_path / 'cluster.json'} and start again" in text


@pytest.mark.parametrize("action", ["start", "stop"])
def test_a_state_dir_that_cannot_be_used_is_one_error_line(tmp_path: Path, action: str) -> None:
    """``cluster start --state-dir F`` where F is a file (or under one) ended in a
    FileExistsError traceback; the error names the directory and what to give instead."""
    where = tmp_path / "state"
    if action == "start":
        where.write_text("not a directory\n")
    else:  # a directory is there, but its lock file cannot be opened
        where.mkdir()
        (where / "cluster.lock").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "adcloud.spark", "cluster", action, "--state-dir", str(where)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: --state-dir {where}: cannot use it to record")
    assert "give a directory this user can create and write" in proc.stderr
