"""Fixtures shared by the whole test suite.

Spark
    ``spark`` (session scope) is a ``local[2]`` SparkSession shared by every test of the run
    (UI off, 4 shuffle partitions) and stopped at the end.  ``cluster`` (session scope) is a
    real :class:`~adcloud.spark.StandaloneCluster`: a master and 2 workers x 1 core x 1 GiB on
    127.0.0.1.  ``cluster_spark`` (session scope) is a SparkSession whose 2 executors run on
    that cluster.

    A Python process can hold only one SparkContext, so the two sessions cannot coexist.
    The rule is: tests that use ``cluster_spark`` run after every test that uses ``spark``.
    Collection moves them there (keeping their relative order); creating ``cluster_spark``
    stops the ``local[2]`` session, and any test that would still receive the stopped
    ``spark`` after that (one that asks for both fixtures, or one that a plugin reordered
    after the switch) errors with a message saying so instead of failing obscurely.
    Session-scoped data built on ``spark`` (cached RDDs, DataFrames) is therefore gone for
    cluster tests: build cluster data from ``cluster_spark``.  ``cluster`` alone (e.g. for
    ``spark-submit`` in a subprocess) does not stop anything.

    Test modules are registered with PySpark's cloudpickle *by value*, so helper functions
    defined at module level in a test file can run inside Spark tasks (executors cannot
    import test modules).

Markers
    Tests that use ``spark`` are marked ``spark`` and tests that use ``cluster`` or
    ``cluster_spark`` are marked ``cluster`` automatically, so ``-m "not cluster"`` works.

Parallel runs
    ``make test`` runs the suite in two pytest-xdist worker processes (``-n 2 --dist
    loadgroup --no-loadscope-reorder``): each worker is one process with its own sessions,
    so "one session per run" holds per worker.  Every test is put in an ``xdist_group``:
    its file (module fixtures are built once), or ``cluster`` for every test that uses
    ``cluster`` or ``cluster_spark``.  That group is collected after every file that uses
    ``spark``, so the worker that takes it has run all those by then, and the cluster starts
    once; a few files that use no Spark session (mypy, the synthesis tests) come after it,
    for whichever worker is free.

Object storage
    ``s3_server`` (session scope) is a real S3-protocol server, moto's, in a subprocess on
    127.0.0.1; ``s3_bucket`` makes a new bucket on it and points s3fs at it through the
    environment (``AWS_ENDPOINT_URL`` and test credentials), so ``s3://`` URIs in the test
    reach it over HTTP as they would reach S3.

Data
    ``shared_data`` is the directory of real third-party recordings next to the checkout
    (``../shared/data``; ``ADCLOUD_SHARED_DATA`` overrides it).  A missing directory fails
    the test with instructions; it is never skipped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from adcloud.spark import StandaloneCluster

REPO_ROOT = Path(__file__).resolve().parents[1]

_LOCAL_FIXTURE = "spark"
_CLUSTER_FIXTURES = ("cluster", "cluster_spark")
_CLUSTER_SESSION_FIXTURE = "cluster_spark"
# Test JVMs live for seconds to minutes and run small jobs: the C1 compiler and the serial
# collector start them faster and ran small jobs faster too (measured on 2 busy cores:
# local[2] start 8.7-9.2 s -> 5.7-7.5 s, a 3M-row groupBy 5.1 s -> 2.5-3.5 s).
_TEST_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


class _SessionSwitch:
    """Records whether the ``local[2]`` session has given way to the cluster session."""

    switched = False


_PICKLED_BY_VALUE: set[str] = set()


def _register_by_value(module: ModuleType | None) -> None:
    if module is None or module.__name__ in _PICKLED_BY_VALUE:
        return
    from pyspark import cloudpickle  # noqa: PLC0415 - Spark loads only for tests that use it

    cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    _PICKLED_BY_VALUE.add(module.__name__)


def _uses_cluster(item: pytest.Item) -> int:
    """0: no cluster; 1: ``cluster`` alone; 2: ``cluster_spark`` (runs after the others)."""
    fixtures = getattr(item, "fixturenames", ())
    if _CLUSTER_SESSION_FIXTURE in fixtures:
        return 2
    return int(any(name in fixtures for name in _CLUSTER_FIXTURES))


def pytest_itemcollected(item: pytest.Item) -> None:
    fixtures = getattr(item, "fixturenames", ())
    if _LOCAL_FIXTURE in fixtures:
        item.add_marker(pytest.mark.spark)
    cluster = _uses_cluster(item)
    if cluster:
        item.add_marker(pytest.mark.cluster)
    # pytest-xdist's loadgroup: a file's tests stay together, the cluster's after `spark`'s
    group = "cluster" if cluster else item.nodeid.split("::", 1)[0]
    item.add_marker(pytest.mark.xdist_group(group))
    if _LOCAL_FIXTURE in fixtures or _CLUSTER_SESSION_FIXTURE in fixtures:
        _register_by_value(getattr(item, "module", None))


#: Files that run after the cluster's tests: they use neither Spark session, so they may
#: run in the worker that switched to the cluster, and they are CPU work that is not timed
#: (mypy, synthesis). With the cluster's tests (a minute) last, the other worker sat idle
#: for most of that minute; now whichever worker is free takes these.
_AFTER_THE_CLUSTER = ("tests/test_typing.py", "tests/synth/")


def _order(item: pytest.Item, fillers: set[str]) -> tuple[int, int]:
    """(0, 0): most tests; (1, 0): ``cluster`` alone; (2, 0): ``cluster_spark``; (3, i):
    :data:`_AFTER_THE_CLUSTER`, in its order (mypy, the longest, first: last, it kept one
    worker busy for 40 s after the other had finished)."""
    name = item.nodeid.split("::", 1)[0]
    if name in fillers:
        return 3, next(i for i, p in enumerate(_AFTER_THE_CLUSTER) if name.startswith(p))
    return _uses_cluster(item), 0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Stable: everything else keeps its order; cluster tests go after it, those of the
    # cluster session after those that use the cluster alone (see above), then the files of
    # _AFTER_THE_CLUSTER whose tests use no Spark session at all.
    files: dict[str, bool] = {}
    for item in items:
        name = item.nodeid.split("::", 1)[0]
        fixtures = getattr(item, "fixturenames", ())
        spark_free = _LOCAL_FIXTURE not in fixtures and not _uses_cluster(item)
        files[name] = files.get(name, True) and spark_free and name.startswith(_AFTER_THE_CLUSTER)
    fillers = {name for name, filler in files.items() if filler}
    items.sort(key=lambda item: _order(item, fillers))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """``--dist loadgroup`` schedules by the group xdist appends to each node id in the
    workers. Where none carries one the tests are dealt one by one, silently: a file's
    module fixtures are built in both workers and both start a cluster (the suite took twice
    as long that way before anyone noticed). Stop at once instead."""
    if node.config.getvalue("dist") != "loadgroup" or not ids or any("@" in i for i in ids):
        return
    pytest.exit(
        "pytest-xdist's --dist loadgroup did not group the tests (no node id carries its "
        f"group; pytest {pytest.__version__} with this pytest-xdist, see pytest-xdist#1386): "
        "install the versions pyproject.toml pins (bash scripts/install.sh), or run without -n",
        returncode=pytest.ExitCode.USAGE_ERROR,
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    fixtures = getattr(item, "fixturenames", ())
    if _LOCAL_FIXTURE not in fixtures:
        return
    if _CLUSTER_SESSION_FIXTURE in fixtures:
        pytest.fail(
            f"{item.nodeid} uses both `spark` (local[2]) and `cluster_spark`; only one "
            "SparkContext can exist per process: use one of them (see tests/conftest.py)",
            pytrace=False,
        )
    if _SessionSwitch.switched:
        pytest.fail(
            f"{item.nodeid} needs the local[2] `spark` session, which was stopped when "
            "`cluster_spark` started; cluster tests must run after every test that uses "
            "`spark` (see tests/conftest.py)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """The shared ``local[2]`` SparkSession (UI off, 4 shuffle partitions)."""
    from adcloud.spark import SparkSettings, get_session  # noqa: PLC0415

    settings = SparkSettings(
        master="local[2]",
        app_name="adcloud-tests",
        driver_memory="1g",
        executor_memory="1g",
        # the training tests' workers start with torch imported (see SparkSettings)
        worker_imports=("torch",),
    )
    session = get_session(
        settings,
        **{
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.driver.extraJavaOptions": _TEST_JVM_OPTS,
        },
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A running standalone cluster: 2 workers x 1 core x 1 GiB on 127.0.0.1.

    Its logs and work directories are under pytest's temporary directory (``spark-cluster*``).
    """
    from adcloud.spark import StandaloneCluster  # noqa: PLC0415

    with StandaloneCluster(
        2, cores=1, memory="1g", log_dir=tmp_path_factory.mktemp("spark-cluster")
    ) as running:
        yield running


@pytest.fixture(scope="session")
def cluster_spark(cluster: StandaloneCluster) -> Iterator[SparkSession]:
    """A SparkSession on ``cluster`` with both of its 1-core executors registered.

    Stops the ``local[2]`` session first (one SparkContext per process; see the module doc).
    """
    from pyspark import SparkContext  # noqa: PLC0415
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from adcloud.spark import SparkSettings, get_session, wait_for_executors  # noqa: PLC0415

    _SessionSwitch.switched = True
    local = SparkSession.getActiveSession()
    if local is not None:
        local.stop()
    if SparkContext._active_spark_context is not None:
        SparkContext._active_spark_context.stop()
    settings = SparkSettings(
        master=cluster.master_url,
        app_name="adcloud-tests-cluster",
        driver_memory="1g",
        executor_memory="512m",
    )
    session = get_session(
        settings,
        **cluster.session_conf(),
        **{
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "4",
            "spark.driver.extraJavaOptions": _TEST_JVM_OPTS,  # when no local session ran first
            "spark.executor.extraJavaOptions": _TEST_JVM_OPTS,
        },
    )
    wait_for_executors(session, cluster.workers)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint URL of a real S3-protocol server (moto's) running in a subprocess."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("s3-server") / "moto.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the S3 test server exited: {log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the S3 test server did not listen within 60 s ({log_path})")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``s3://NAME``: a new, empty bucket on ``s3_server``, which s3fs reaches through the
    environment during the test."""
    import s3fs  # noqa: PLC0415

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "adcloud-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "adcloud-test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()  # instances made for another endpoint
    name = f"adcloud-test-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(name)
    yield f"s3://{name}"
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The directory of real recordings shared with the project (``../shared/data``)."""
    path = Path(os.environ.get("ADCLOUD_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.fail(
            f"the shared test recordings are missing: {path} is not a directory. The suite "
            "reads real third-party bags from ../shared/data next to the checkout (see its "
            "README.md); put them there or set ADCLOUD_SHARED_DATA to their directory.",
            pytrace=False,
        )
    return path
