"""Spark sessions and a real Spark standalone cluster on the loopback interface.

:func:`get_session` is the one way adcloud code gets a :class:`~pyspark.sql.SparkSession`:
it checks that Java 17+ is installed (Spark 4 needs it) before a JVM is started, makes the
executors run the driver's Python (``PYSPARK_PYTHON``) and applies :class:`SparkSettings`.

:class:`StandaloneCluster` starts a real Spark standalone master and ``N`` workers as child
processes on ``127.0.0.1`` (the ``spark-class`` launcher of the Spark home that the ``pyspark``
wheel bundles), so multi-executor behaviour and resource scheduling
(``spark.*.resource.gpu.*``, the same settings YARN uses) are exercised for real on one
machine.  ``python -m adcloud.spark cluster start|stop`` drives it from the shell
(``deploy/local/start-cluster.sh`` wraps that).

Only one SparkContext can be active per Python process: :func:`get_session` refuses to hand
out a session for another master while one is active instead of silently returning the wrong
one.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import fcntl
import functools
import ipaddress
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import pyspark
from pyspark import SparkContext
from pyspark.sql import SparkSession

from adcloud import _jvm_archive
from adcloud._argtypes import number, whole_number
from adcloud.config import load_settings
from adcloud.errors import AdcloudError, ConfigError, MissingComponentError

__all__ = [
    "JAVA_INSTALL_HINT",
    "SparkClusterError",
    "SparkSettings",
    "StandaloneCluster",
    "WorkerInfo",
    "class_archive_options",
    "find_java",
    "get_session",
    "spark_conf",
    "spark_home",
    "wait_for_executors",
]

logger = logging.getLogger(__name__)

JAVA_INSTALL_HINT = (
    "install Java 17 or newer, e.g. `sudo apt-get install -y openjdk-17-jre-headless` on "
    "Debian/Ubuntu, or point JAVA_HOME at a Java 17+ installation"
)
"""How to get the Java runtime that Spark 4 needs; part of every missing-Java error."""

_MIN_JAVA = 17
# Spark's daemons and its command launcher are long-lived but light JVMs: the C1 compiler
# and the serial collector halve their start-up time on a 2-core machine (measured:
# master 4.5-5.5 s -> 1.8-2.4 s) at no cost that matters for a scheduler.
_LIGHT_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_LOOPBACK = "127.0.0.1"
#: The environment variable that carries :attr:`SparkSettings.worker_imports` to the Python
#: worker daemon (:mod:`adcloud._pyspark_daemon`).
WORKER_IMPORTS_ENV = "ADCLOUD_WORKER_IMPORTS"
_LOG4J2 = Path(__file__).with_name("spark_log4j2.properties")
# Spark caches and unrolls blocks in 1 MiB chunks.  For heaps under 8 GiB G1 picks 1-2 MiB
# regions, where a 1 MiB array is "humongous" and holds a region of its own (two, at 1 MiB),
# so a cache Spark counts as 600 MiB fills ~1.2 GiB of heap and the JVM runs out before
# Spark evicts anything -- measured: a 1-core 1400 MiB executor died over and over on a
# 32-beam map build and finishes with 4 MiB regions, where the chunks are ordinary objects.
_G1_REGION = "-XX:G1HeapRegionSize=4m"
_G1_REGION_BELOW = 8 << 30
_MEMORY_UNITS = {"": 1 << 20, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_STATE_FILE = "cluster.json"
_LOCK_FILE = "cluster.lock"
# What Spark reads as a memory size (JavaUtils.byteStringAs; no unit: MiB) and the levels
# SparkContext.setLogLevel takes.
_JVM_MEMORY = re.compile(r"\s*(\d+)(?:[kmgtp]b?)?\s*", re.IGNORECASE)
_LOG_LEVELS = ("ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN")
# Where a Spark setting whose value holds a comma can be given: the commands read no settings
# file's spark section, and adcloud submit passes its --conf values whole.
_COMMA_VALUE_HINT = (
    "with adcloud submit --conf 'KEY=VALUE' -- COMMAND ... (any master, local ones too), or "
    "in the spark section of a settings file read by SparkSettings.load(file=...)"
)


class SparkClusterError(AdcloudError):
    """A standalone Spark cluster failed to start, register its workers or stop.

    The message carries the tail of the failing process's log.
    """


@dataclass(frozen=True)
class SparkSettings:
    """How :func:`get_session` builds a session (settings section ``spark``).

    Every field can be overridden with ``ADCLOUD_SPARK_<FIELD>``, e.g.
    ``ADCLOUD_SPARK_MASTER=spark://127.0.0.1:7077``.  ``conf`` holds extra Spark
    configuration as ``"key=value"`` strings; from the environment it is a comma-separated
    list, so values that contain commas must come from a settings file instead.
    Memory sizes use the JVM notation (``512m``, ``2g``); ``driver_memory`` only takes effect
    when the driver JVM is started, i.e. for the first session of a Python process.
    """

    #: All local cores; a failed task is tried up to 4 times, as ``spark.task.maxFailures``
    #: does on a cluster (a plain ``local[*]`` fails the job at a task's first failure).
    master: str = "local[*,4]"
    app_name: str = "adcloud"
    driver_memory: str = "2g"
    executor_memory: str = "1g"
    conf: tuple[str, ...] = ()
    log_level: str = "WARN"
    #: Modules the Python worker daemon imports before it forks the workers, so each new
    #: worker starts with them imported (``torch`` costs every new worker ~2.5 s of a core;
    #: a worker idle for a minute is closed, and the next task forks a new one).  For
    #: sessions whose tasks all use them, e.g. ``("torch",)`` for training; a module that
    #: fails to import there is reported in the executor's log and imported by the tasks
    #: as usual.  From the environment: ``ADCLOUD_SPARK_WORKER_IMPORTS=torch,numpy``.
    worker_imports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Checked here, before a JVM starts: Spark itself refuses a bad memory size with a
        # Java stack trace and "Java gateway process exited", and a bad log level only once
        # the session is up, with a Py4J traceback.
        for name in ("driver_memory", "executor_memory"):
            value = getattr(self, name)
            size = _JVM_MEMORY.fullmatch(value)
            if size is None or not int(size[1]):
                msg = (
                    f"spark.{name}: {value!r} is not a JVM memory size such as 512m or 2g "
                    f"(ADCLOUD_SPARK_{name.upper()})"
                )
                raise ConfigError(msg)
        for name in self.worker_imports:
            if not all(part.isidentifier() for part in name.split(".")):
                msg = (
                    f"spark.worker_imports: {name!r} is not a module name such as torch or "
                    "adcloud.train.job (ADCLOUD_SPARK_WORKER_IMPORTS: comma-separated)"
                )
                raise ConfigError(msg)
        if self.log_level.upper() not in _LOG_LEVELS:
            msg = (
                f"spark.log_level: {self.log_level!r} is not a log level Spark takes: "
                f"{', '.join(_LOG_LEVELS)} (ADCLOUD_SPARK_LOG_LEVEL)"
            )
            raise ConfigError(msg)

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> SparkSettings:
        """Defaults, then the ``spark`` section of ``file``, ``ADCLOUD_SPARK_*``, ``overrides``."""
        return load_settings(cls, "spark", file=file, environ=environ, **overrides)

    def importing(self, *modules: str) -> SparkSettings:
        """These settings with ``modules`` added to :attr:`worker_imports` (for a command
        whose tasks import them, e.g. training and ``torch``)."""
        extra = tuple(m for m in modules if m not in self.worker_imports)
        return dataclasses.replace(self, worker_imports=(*self.worker_imports, *extra))

    def conf_pairs(self) -> dict[str, str]:
        """``conf`` as a mapping; raises :class:`ConfigError` for an entry without ``=``."""
        pairs: dict[str, str] = {}
        for entry in self.conf:
            key, sep, value = entry.partition("=")
            if not sep or not key.strip():
                # ADCLOUD_SPARK_CONF is split at every comma: a value holding one breaks up
                msg = (
                    f"spark.conf: entry {entry!r} is not of the form key=value "
                    "(ADCLOUD_SPARK_CONF: comma-separated key=value entries; give a value "
                    f"that holds a comma {_COMMA_VALUE_HINT})"
                )
                raise ConfigError(msg)
            if not key.strip().startswith("spark."):
                # Spark ignores such a key with a warning nobody reads: mostly the tail of
                # a value that held a comma (extraJavaOptions=-Da=1,-Db=2)
                msg = (
                    f"spark.conf: entry {entry!r} is no Spark property (their keys start with "
                    "'spark.'); if it belongs to the entry before it, ADCLOUD_SPARK_CONF split "
                    f"that value at a comma: give a value that holds a comma {_COMMA_VALUE_HINT}"
                )
                raise ConfigError(msg)
            if key.strip() == "spark.master":
                # the master is checked (and a cluster found) from settings.master; one given
                # here would replace it unchecked
                msg = (
                    f"spark.conf: entry {entry!r}: set the master with --master or "
                    "ADCLOUD_SPARK_MASTER (the spark section's master), not in spark.conf"
                )
                raise ConfigError(msg)
            pairs[key.strip()] = value.strip()
        return pairs


def spark_home() -> Path:
    """The Spark home bundled in the ``pyspark`` package (has ``bin/spark-class``, ``jars/``)."""
    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").is_file():
        msg = (
            f"{home} has no bin/spark-class: the pyspark installation is incomplete; "
            "reinstall it with `pip install --force-reinstall pyspark`"
        )
        raise MissingComponentError(msg)
    return home


def find_java(environ: Mapping[str, str] | None = None) -> tuple[Path, int]:
    """The ``java`` executable Spark will use (``$JAVA_HOME/bin/java``, else ``PATH``) and
    its major version.

    Raises :class:`MissingComponentError` with :data:`JAVA_INSTALL_HINT` when there is none
    or it is older than Java 17.
    """
    env = os.environ if environ is None else environ
    java_home = env.get("JAVA_HOME", "")
    if java_home:
        java = Path(java_home) / "bin" / "java"
        if not os.access(java, os.X_OK):
            msg = f"JAVA_HOME={java_home} has no executable bin/java; {JAVA_INSTALL_HINT}"
            raise MissingComponentError(msg)
    else:
        found = shutil.which("java", path=env.get("PATH", ""))
        if found is None:
            msg = f"Spark needs Java {_MIN_JAVA}+ but no `java` is on PATH; {JAVA_INSTALL_HINT}"
            raise MissingComponentError(msg)
        java = Path(found)
    major = _java_major(str(java))
    if major < _MIN_JAVA:
        msg = f"Spark needs Java {_MIN_JAVA}+ but {java} is Java {major}; {JAVA_INSTALL_HINT}"
        raise MissingComponentError(msg)
    return java, major


@functools.cache
def _java_major(java: str) -> int:
    """Major version reported by ``java -version`` (``1.8.0`` -> 8, ``17.0.15`` -> 17)."""
    try:
        proc = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        msg = f"cannot run {java} -version ({err}); {JAVA_INSTALL_HINT}"
        raise MissingComponentError(msg) from err
    text = proc.stderr + proc.stdout
    match = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if proc.returncode != 0 or match is None:
        msg = f"{java} -version failed or printed no version: {text.strip()[-300:]!r}"
        raise MissingComponentError(f"{msg}; {JAVA_INSTALL_HINT}")
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    return major


def spark_conf(
    settings: SparkSettings, conf: Mapping[str, str | int | float | bool] | None = None
) -> dict[str, str]:
    """The Spark configuration :func:`get_session` starts a session with: adcloud's
    defaults, then ``settings.conf``, then ``conf``."""
    merged: dict[str, str] = {
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.python.worker.reuse": "true",
        # JVM <-> Python worker traffic over a Unix socket instead of loopback TCP:
        # measured ~40% less fixed cost per task on 2 cores (tasks are many and short).
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.driver.memory": settings.driver_memory,
        "spark.executor.memory": settings.executor_memory,
    }
    if settings.worker_imports:  # read by adcloud._pyspark_daemon
        merged[f"spark.executorEnv.{WORKER_IMPORTS_ENV}"] = ",".join(settings.worker_imports)
    merged.update(settings.conf_pairs())
    merged.update({key: _conf_value(value) for key, value in (conf or {}).items()})
    # Quiet start-up (see the properties file), G1 regions that fit Spark's cache chunks (see
    # _G1_REGION) and, for a local session's one JVM, C1 alone (see _QUICK_JIT); a user's own
    # JVM options win.
    local = settings.master.startswith("local") and not settings.master.startswith("local-")
    merged.setdefault(
        "spark.driver.extraJavaOptions",
        " ".join(
            [
                shlex.quote(f"-Dlog4j2.configurationFile={_LOG4J2}"),
                *_heap_options(merged["spark.driver.memory"]),
                *([_QUICK_JIT] if local else []),
            ]
        ),
    )
    executor = _heap_options(merged["spark.executor.memory"])
    if executor:
        merged.setdefault("spark.executor.extraJavaOptions", " ".join(executor))
    # The class archive (adcloud._jvm_archive), added to the user's options too (it only
    # changes how fast a JVM starts): the driver starts on this machine, and the executors
    # do when the master is local or on loopback.
    archive = class_archive_options()
    roles = ("driver", "executor") if _executors_here(settings.master) else ("driver",)
    for role in roles:
        key = f"spark.{role}.extraJavaOptions"
        options = _with_archive(merged.get(key, ""), archive)
        if options:
            merged[key] = options
    # PySpark's daemon without a traceback whenever an idle worker is closed (see the module).
    merged.setdefault("spark.python.daemon.module", "adcloud._pyspark_daemon")
    # A Python worker that dies of a signal (a native library's segfault or abort: GTSAM,
    # Open3D, torch) fails its task with the worker's Python traceback instead of only
    # "Python worker exited unexpectedly (crashed)"; costs a small file per task.
    merged.setdefault("spark.python.worker.faulthandler.enabled", "true")
    # Executors on this machine's loopback reach the driver there.  Left to itself the driver
    # takes its host name's address -- on many hosts a loopback one, which Spark then trades
    # for another interface's, with a warning -- and binds to it (spark.driver.bindAddress
    # follows spark.driver.host), where a sandbox or a firewall may keep the executors out.
    # A conf key, not only SPARK_LOCAL_IP: that reaches a driver JVM only when it starts,
    # and a process's first session may have started it for another master.  The user's
    # choice wins: spark.driver.host, else SPARK_LOCAL_IP or SPARK_LOCAL_HOSTNAME, which
    # Spark derives it from.
    if _on_loopback(settings.master) and not os.environ.get("SPARK_LOCAL_HOSTNAME"):
        merged.setdefault("spark.driver.host", os.environ.get("SPARK_LOCAL_IP") or _LOOPBACK)
    return merged


def class_archive_options() -> list[str]:
    """JVM options that map the class archive ``scripts/install.sh`` built for this Java and
    this Spark (:mod:`adcloud._jvm_archive`): faster start-up of any Spark JVM on this
    machine. None when there is no archive for them, or no usable Java."""
    try:
        java, _ = find_java()
        return _jvm_archive.java_options(java, spark_home())
    except MissingComponentError:
        return []


#: JIT option of a local session's JVM. Local sessions are mostly short (a command, a
#: notebook, a test) and C2, the optimising compiler, spent about as much CPU compiling
#: Spark's start-up code as the session used otherwise: a session and two small jobs took
#: 21 s of CPU on 2 cores with it and 11 s with C1 alone (12.4 -> 9 s of wall time). The
#: JVM's part of adcloud's work is scheduling and moving bytes, which C1's code does well.
_QUICK_JIT = "-XX:TieredStopAtLevel=1"


def _with_archive(options: str, archive: Sequence[str]) -> str:
    """``options`` with the class archive's, unless they choose class sharing themselves."""
    own = ("SharedArchiveFile", "ArchiveClassesAtExit", "-Xshare")
    if not archive or any(word in options for word in own):
        return options
    return " ".join([options, *archive]).strip()


def _executors_here(master: str) -> bool:
    """Whether ``master``'s executors are JVMs on this machine (local mode runs none)."""
    if master.startswith("local-cluster"):
        return True
    match = re.fullmatch(r"spark://([^:/]+)(:\d+)?/?", master)
    return match is not None and match.group(1) in (_LOOPBACK, "localhost")


def _on_loopback(master: str) -> bool:
    """Whether all of ``master`` is on this machine's loopback interface: local mode, or a
    standalone master (every one, if there are several) at a loopback address."""
    if master.startswith("local"):
        return True
    if not master.startswith("spark://"):
        return False
    for hostport in master.removeprefix("spark://").rstrip("/").split(","):
        host = hostport.rpartition(":")[0] or hostport
        if host.strip("[]") != "localhost":
            try:
                if not ipaddress.ip_address(host.strip("[]")).is_loopback:
                    return False
            except ValueError:  # another host's name
                return False
    return True


def _heap_options(memory: str) -> list[str]:
    """JVM options for a heap of ``memory`` (Spark's notation: ``1400m``, ``2g``; no unit is
    MiB): the G1 region size below 8 GiB, none above (or for a size it cannot read)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", memory.lower())
    if match is None:
        return []
    size = int(match.group(1)) * _MEMORY_UNITS[match.group(2)]
    return [_G1_REGION] if size < _G1_REGION_BELOW else []


#: Master URL schemes Spark takes (``spark://`` standalone, possibly several hosts).  Spark 4
#: dropped Mesos: its spark-submit refuses ``mesos://`` with a stack trace.
_MASTER_SCHEMES = ("local", "spark://", "yarn", "k8s://")
#: The local masters, as Spark's SparkMasterRegex reads them (spaces around the commas too).
_LOCAL_MASTER = re.compile(
    r"local(\[(\*|[1-9][0-9]*)(\s*,\s*[1-9][0-9]*)?\])?"
    r"|local-cluster\[\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*,\s*[1-9][0-9]*\s*\]"
)


def local_cores(master: str) -> int | None:
    """How many task cores a ``local[...]`` or ``local-cluster[...]`` master runs (``local``:
    1, ``local[*]``: this machine's), or None for any other master: those have executors."""
    if not _LOCAL_MASTER.fullmatch(master):
        return None
    if master.startswith("local-cluster"):
        workers, cores, *_ = (int(v) for v in master[len("local-cluster[") : -1].split(","))
        return workers * cores
    if master == "local":
        return 1
    given = master[len("local[") :].split(",", maxsplit=1)[0].rstrip("]")
    return (os.cpu_count() or 1) if given == "*" else int(given)


def _check_hadoop_conf() -> None:
    """Raise :class:`ConfigError` unless ``HADOOP_CONF_DIR`` (or ``YARN_CONF_DIR``) names a
    directory with the ``yarn-site.xml`` spark-submit finds the ResourceManager by."""
    name = "HADOOP_CONF_DIR" if os.environ.get("HADOOP_CONF_DIR") else "YARN_CONF_DIR"
    where = os.environ.get(name)
    hint = "(see deploy/yarn/README.md)"
    if not where:
        raise ConfigError(
            "--master yarn needs the cluster's Hadoop configuration: set HADOOP_CONF_DIR (or "
            f"YARN_CONF_DIR) to the directory holding its core-site.xml and yarn-site.xml {hint}"
        )
    if not (Path(where) / "yarn-site.xml").is_file():
        what = "has no yarn-site.xml" if Path(where).is_dir() else "is no directory"
        raise ConfigError(
            f"--master yarn: {name}={where} {what}; set it to the directory holding the "
            f"cluster's core-site.xml and yarn-site.xml {hint}"
        )


def check_master(master: str, timeout: float = 3.0, *, reach: bool = True) -> None:
    """Raise :class:`ConfigError` for a master URL Spark does not take (or ``yarn`` without
    the Hadoop configuration spark-submit needs), and -- with ``reach`` -- a
    :class:`SparkClusterError` when no master of a ``spark://`` URL accepts a connection:
    Spark itself would retry for a minute, or start a JVM, and end in a Java stack trace."""
    where = "(set --master or ADCLOUD_SPARK_MASTER)"
    if not master.startswith(_MASTER_SCHEMES) or (
        master.startswith("local") and not _LOCAL_MASTER.fullmatch(master)
    ):
        raise ConfigError(
            f"Spark master {master!r} is not one Spark takes: local[*], local[N], "
            f"local[N,MAX_FAILURES], spark://HOST:PORT, yarn or k8s://URL {where}"
        )
    if master == "yarn":
        _check_hadoop_conf()
    if master.startswith("k8s://") and not master.removeprefix("k8s://").strip():
        raise ConfigError(
            f"Spark master {master!r} names no Kubernetes API server: "
            f"k8s://https://HOST:PORT {where}"
        )
    if not master.startswith("spark://"):
        return
    hostports = master.removeprefix("spark://").split(",")
    for hostport in hostports:
        host, colon, port = hostport.rpartition(":")
        if not colon or not host or not port.isdigit():
            # Spark takes no path after the port (spark://HOST:7077/ is an invalid URL)
            plain = hostport.split("/", 1)[0]
            hint = (
                f"nothing may follow the port: spark://{plain}"
                if re.fullmatch(r".+:[0-9]+", plain)
                else f"a standalone master listens on 7077 by default: "
                f"spark://{plain or 'HOST'}:7077"
            )
            raise ConfigError(
                f"Spark master {master!r}: {hostport!r} is not HOST:PORT ({hint}) {where}"
            )
    if not reach:
        return
    problems = []
    for hostport in hostports:
        host, _, port = hostport.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: spark://[::1]:7077
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return
        except OSError as err:
            problems.append(f"{hostport}: {err.strerror or err}")
    raise SparkClusterError(
        f"cannot reach the Spark master {master} ({'; '.join(problems)}); start one "
        "(deploy/local/start-cluster.sh on this machine) or check --master / "
        "ADCLOUD_SPARK_MASTER"
    )


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the driver JVM starts, and deliver them after.

    Interrupted half-way, PySpark removes the file the JVM is about to write its port
    into, and the JVM, which only watches for its parent's end once it has written it,
    runs on for ever with no parent.  Started, it is stopped as usual (``session.stop()``
    in a ``finally``, or the end of this process).  Only the main thread has handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in held}
    for sig in held:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(caught):
            signal.raise_signal(signum)  # to the handler it would have gone to


def get_session(
    settings: SparkSettings | None = None, **conf: str | int | float | bool
) -> SparkSession:
    """Build (or return the active) SparkSession for ``settings`` plus Spark ``conf``.

    ``settings`` defaults to :meth:`SparkSettings.load` (defaults + ``ADCLOUD_SPARK_*``).
    ``conf`` keys are Spark configuration keys (``**{"spark.ui.enabled": "false"}``) and win
    over ``settings.conf``.  Arrow transfers and Python worker reuse are switched on, and
    ``PYSPARK_PYTHON``/``PYSPARK_DRIVER_PYTHON`` default to this interpreter so executors
    import the same environment.  While a session for the same master is active it is
    returned as it is: static settings (memory, ``conf``) apply only to a new session.

    Raises :class:`MissingComponentError` when Java 17+ is missing (checked before any JVM
    starts) and :class:`ConfigError` when a session for a different master is already active
    in this process (stop it first: only one SparkContext can live in a Python process).
    """
    settings = SparkSettings.load() if settings is None else settings
    for key in conf:
        if "." not in key:
            msg = (
                f"get_session(): {key!r} is not a Spark configuration key; pass Spark keys as "
                f'**{{"spark.x": ...}} and adcloud settings through SparkSettings'
            )
            raise ConfigError(msg)
    # Under spark-submit the cluster manager's master (and deploy mode) come from the
    # submit command line; the Python driver must not override them.
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if under_submit and SparkContext._active_spark_context is None:
        merged = _under_submit(settings, conf)
    else:
        merged = spark_conf(settings, conf)
    active = SparkContext._active_spark_context
    if active is not None:
        if active.master != settings.master and not under_submit:
            msg = (
                f"a SparkSession for master {active.master!r} is already active in this "
                f"process; stop it (session.stop()) before asking for {settings.master!r}"
            )
            raise ConfigError(msg)
        logger.debug("reusing the active SparkSession for %s", active.master)
        return SparkSession.builder.getOrCreate()

    if not under_submit:
        check_master(settings.master)
    find_java()
    if merged.get("spark.driver.host") == _LOOPBACK and not under_submit:
        # Everything runs on this machine's loopback (spark_conf): so do the driver's other
        # services, and Spark does not warn that the host name resolves to it.
        os.environ.setdefault("SPARK_LOCAL_IP", _LOOPBACK)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LAUNCHER_OPTS", _LIGHT_JVM_OPTS)  # the command builder only
    builder = SparkSession.builder.appName(settings.app_name)
    if not under_submit:
        builder = builder.master(settings.master)
    for key, value in merged.items():
        builder = builder.config(key, value)
    started = time.monotonic()
    with _signals_held():
        session = builder.getOrCreate()
    session.sparkContext.setLogLevel(settings.log_level)
    unused = _ignored_executor_memory(
        str(session.sparkContext.master),
        session.sparkContext.getConf().get("spark.executor.memory"),
    )
    if unused:
        logger.warning("%s", unused)
    logger.info(
        "SparkSession %s on %s started in %.1f s",
        settings.app_name,
        settings.master,
        time.monotonic() - started,
    )
    return session


def _ignored_executor_memory(master: str, executor_memory: str | None) -> str | None:
    """What to tell a user who gave a local master an executor memory: Spark ignores it
    there (the tasks run in the driver's JVM), so the job would not get the memory asked
    for; None when there is nothing to say (another master, or adcloud's default)."""
    local = master == "local" or master.startswith("local[")
    if not local or executor_memory in (None, SparkSettings.executor_memory):
        return None
    return (
        f"spark.executor.memory={executor_memory} has no effect with master {master}: its tasks "
        "run inside the driver's JVM. Give the driver the memory instead (--driver-memory, "
        "spark.driver.memory or ADCLOUD_SPARK_DRIVER_MEMORY), or use a cluster master "
        "(local-cluster[...], spark://...)"
    )


def _under_submit(
    settings: SparkSettings, conf: Mapping[str, str | int | float | bool]
) -> dict[str, str]:
    """:func:`spark_conf` for a driver that spark-submit started: what the submit command
    line set (``--executor-memory``, ``--conf``...) wins over adcloud's defaults and
    settings -- the session would otherwise set them back -- and ``conf`` (the program's
    own) wins over both, as in Spark. The master is the submitted one, and so is the
    application's name where the submit line gave one (``--name``, ``--conf
    spark.app.name=``): without, spark-submit names it after the application file."""
    from pyspark import SparkConf  # noqa: PLC0415

    SparkContext._ensure_initialized()  # attach to spark-submit's JVM
    submitted = dict(SparkConf().getAll())
    settings = dataclasses.replace(settings, master=submitted.get("spark.master", settings.master))
    ours = spark_conf(settings, conf)
    kept = {key: submitted[key] for key in ours if key in submitted and key not in conf}
    name = submitted.get("spark.app.name")
    if name and name != Path(sys.argv[0]).name and "spark.app.name" not in conf:
        kept["spark.app.name"] = name
    return spark_conf(settings, {**kept, **conf})


def _conf_value(value: str | int | float | bool) -> str:
    """Spark's spelling of a configuration value (booleans in lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def wait_for_executors(session: SparkSession, count: int, timeout: float = 60.0) -> None:
    """Block until ``count`` executors (not counting the driver) have registered.

    Useful on a cluster, where executors start after the session; raises
    :class:`SparkClusterError` after ``timeout`` seconds.
    """
    tracker = session.sparkContext.statusTracker()
    deadline = time.monotonic() + timeout
    while True:
        seen = len(tracker.getExecutorInfos()) - 1  # the driver is listed too
        if seen >= count:
            return
        if time.monotonic() > deadline:
            msg = f"only {seen} of {count} executors registered within {timeout:.0f} s"
            raise SparkClusterError(msg)
        time.sleep(0.1)


@dataclass(frozen=True)
class WorkerInfo:
    """One worker of a :class:`StandaloneCluster`: its process id, ports and directories."""

    pid: int
    port: int
    webui_port: int
    work_dir: Path
    log_file: Path


class StandaloneCluster:
    """A real Spark standalone master and ``workers`` workers on 127.0.0.1.

    Each worker offers ``cores`` cores and ``memory`` (JVM notation) to applications and,
    with ``resources={"gpu": (2, "/path/discover.sh")}``, custom resources found by a Spark
    resource-discovery script.  All ports are picked free at start.  Logs and worker work
    directories go under ``log_dir`` (a new temporary directory when not given; it is kept
    after :meth:`stop` so the logs can be read).  The master and worker JVMs get
    ``daemon_memory`` of heap and ``daemon_java_opts`` (fast start-up by default);
    ``start_timeout`` bounds the wait for the master and every worker to report ALIVE.

    The processes are children of this Python process: :meth:`stop` (or leaving the ``with``
    block, or interpreter exit) terminates them and everything they started, and unless
    ``detach`` is set they also receive SIGTERM when the thread that started them dies, so a
    killed test run leaves no JVMs behind.  ``detach=True`` is for clusters that outlive this
    process (``python -m adcloud.spark cluster start``); stop those with
    :meth:`from_state` + :meth:`stop`.  With ``state_dir``, :meth:`start` records each
    process there as it launches it (``cluster.json`` and ``pids``; ``master-url`` once all
    are up), so that a start killed half-way -- ``kill -9``, the OOM killer -- leaves what it
    launched for :meth:`from_state` to stop; a start that fails removes the record.
    """

    def __init__(
        self,
        workers: int = 2,
        *,
        cores: int = 1,
        memory: str = "1g",
        resources: Mapping[str, tuple[int, str | os.PathLike[str]]] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        daemon_memory: str = "256m",
        daemon_java_opts: str = _LIGHT_JVM_OPTS,
        start_timeout: float = 60.0,
        detach: bool = False,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if workers < 1 or cores < 1:
            msg = f"a cluster needs at least one worker and one core (got {workers}, {cores})"
            raise ConfigError(msg)
        if not re.fullmatch(r"[1-9][0-9]*[kmgt]?", str(memory).lower()):
            # a worker that cannot read it exits with Spark's usage text once the master runs
            msg = f"worker memory {memory!r} is not a JVM memory size such as 512m or 2g"
            raise ConfigError(msg)
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.resources = dict(resources or {})
        self._worker_opts()  # refuse bad resource options before anything starts
        self.daemon_memory = daemon_memory
        self.daemon_java_opts = daemon_java_opts
        self.start_timeout = start_timeout
        self.detach = detach
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.master_port = 0
        self.webui_port = 0
        self.master_pid = 0
        self.worker_infos: list[WorkerInfo] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    # -- public surface -------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        """``spark://127.0.0.1:PORT``, the URL applications connect to."""
        self._require_started()
        return f"spark://{_LOOPBACK}:{self.master_port}"

    @property
    def webui_url(self) -> str:
        """The master's web UI; ``{webui_url}/json/`` is its machine-readable status."""
        self._require_started()
        return f"http://{_LOOPBACK}:{self.webui_port}"

    @property
    def pids(self) -> list[int]:
        """Process ids of the master and the workers (the JVMs themselves)."""
        return ([self.master_pid] if self.master_pid else []) + [w.pid for w in self.worker_infos]

    def session_conf(self) -> dict[str, str]:
        """Spark configuration for an application on this cluster.

        The driver binds to loopback, takes every core and waits until all of them have
        registered before it schedules the first stage, so work spreads over all executors.
        """
        return {
            "spark.driver.host": _LOOPBACK,
            "spark.driver.bindAddress": _LOOPBACK,
            "spark.cores.max": str(self.workers * self.cores),
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": f"{int(self.start_timeout)}s",
        }

    def status(self) -> dict[str, Any]:
        """The master's ``/json/`` status document (workers, their state, applications)."""
        doc = _fetch_json(f"{self.webui_url}/json/")
        if doc is None:
            msg = f"the master web UI at {self.webui_url} does not answer"
            if self.master_pid and not _alive(self.master_pid):
                msg += (
                    f": the master (pid {self.master_pid}) is no longer running (killed or "
                    "crashed); stop the cluster and start it again"
                )
            raise SparkClusterError(msg + self._log_tails())
        return doc

    def start(self) -> Self:
        """Start the master, then the workers, and wait until all workers are ALIVE."""
        if self.master_pid:
            msg = f"cluster already started at {self.master_url}"
            raise SparkClusterError(msg)
        find_java()
        home = spark_home()
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="adcloud-spark-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.detach:
            atexit.register(self.stop)
        started = time.monotonic()
        deadline = started + self.start_timeout
        try:
            self.master_port, self.webui_port = _free_ports(2)
            master = self._spawn(
                home,
                "master",
                [
                    "org.apache.spark.deploy.master.Master",
                    "--host",
                    _LOOPBACK,
                    "--port",
                    str(self.master_port),
                    "--webui-port",
                    str(self.webui_port),
                ],
                {},
            )
            self.master_pid = master.pid
            self._record()
            # Workers started before the master listens back off for 5-15 s; wait for it.
            self._wait(deadline, self._is_own_master, "the master to answer")
            worker_env = {"SPARK_WORKER_OPTS": self._worker_opts()}
            for index in range(self.workers):
                port, webui = _free_ports(2)
                work_dir = self.log_dir / f"worker-{index}"
                work_dir.mkdir(exist_ok=True)
                proc = self._spawn(
                    home,
                    f"worker-{index}",
                    [
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        _LOOPBACK,
                        "--port",
                        str(port),
                        "--webui-port",
                        str(webui),
                        "--cores",
                        str(self.cores),
                        "--memory",
                        self.memory,
                        "--work-dir",
                        str(work_dir),
                        f"spark://{_LOOPBACK}:{self.master_port}",
                    ],
                    worker_env,
                )
                self.worker_infos.append(
                    WorkerInfo(
                        proc.pid, port, webui, work_dir, self.log_dir / f"worker-{index}.log"
                    )
                )
                self._record()
            # Count rather than match ports: Spark moves to the next port if one was taken.
            self._wait(
                deadline,
                lambda doc: _alive_workers(doc) >= self.workers,
                f"{self.workers} workers to register as ALIVE",
            )
            if self.state_dir is not None:
                self.write_state(self.state_dir)
        except BaseException:
            try:
                self.stop()
            except SparkClusterError:
                pass  # the start error is the one to see; the record stays for a later stop
            else:
                if self.state_dir is not None:
                    _remove_state(self.state_dir)
            raise
        logger.info(
            "standalone cluster %s with %d x %d cores up in %.1f s (logs in %s)",
            self.master_url,
            self.workers,
            self.cores,
            time.monotonic() - started,
            self.log_dir,
        )
        return self

    def stop(self, grace: float = 10.0) -> None:
        """Terminate the workers, their executors and the master; kill what outlives ``grace``.

        Idempotent.  Raises :class:`SparkClusterError` if a process survives SIGKILL.
        """
        if not self.pids:
            return
        atexit.unregister(self.stop)
        # Collect the whole tree first: executors and Python daemons are grandchildren.
        tree = self._running_daemons()
        tree.extend(_descendants(tree))
        for pid in tree:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            # An executor launched while the worker was being told to stop is caught here.
            late = [c for c in _descendants(p for p in tree if _alive(p)) if c not in tree]
            for pid in late:
                _signal(pid, signal.SIGTERM)
            tree.extend(late)
            self._reap()
            time.sleep(0.1)
        for pid in tree:
            if _alive(pid):
                logger.warning("pid %d did not stop within %.0f s; killing it", pid, grace)
                _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            self._reap()
            time.sleep(0.05)
        self._reap()
        survivors = [pid for pid in tree if _alive(pid)]
        self.master_pid = 0
        self.worker_infos = []
        self._procs = []
        if survivors:
            msg = f"processes {survivors} survived SIGKILL"
            raise SparkClusterError(msg)
        logger.info("standalone cluster stopped (%d processes)", len(tree))

    def write_state(self, state_dir: str | os.PathLike[str]) -> Path:
        """Record master URL, ports and pids in ``state_dir`` for :meth:`from_state`.

        Writes ``cluster.json``, plus ``master-url`` and ``pids`` (one per line) for shell use.
        """
        path = self._write_processes(Path(state_dir))
        _atomic_write(Path(state_dir) / "master-url", self.master_url + "\n")
        return path

    def _write_processes(self, directory: Path) -> Path:
        """Write ``cluster.json`` and ``pids`` (not ``master-url``: that says the cluster is
        up) into ``directory``."""
        self._require_started()
        assert self.log_dir is not None
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "version": 1,
            "master_url": self.master_url,
            "master_port": self.master_port,
            "webui_port": self.webui_port,
            "master_pid": self.master_pid,
            "log_dir": str(self.log_dir),
            "workers": [
                {
                    "pid": w.pid,
                    "port": w.port,
                    "webui_port": w.webui_port,
                    "work_dir": str(w.work_dir),
                    "log_file": str(w.log_file),
                }
                for w in self.worker_infos
            ],
        }
        path = directory / _STATE_FILE
        _atomic_write(path, json.dumps(state, indent=2) + "\n")
        _atomic_write(directory / "pids", "".join(f"{pid}\n" for pid in self.pids))
        return path

    def _record(self) -> None:
        """Record the processes launched so far in :attr:`state_dir`, if any."""
        if self.state_dir is not None:
            self._write_processes(self.state_dir)

    def running(self) -> bool:
        """Whether any of the recorded master and workers still runs."""
        return bool(self._running_daemons())

    @classmethod
    def from_state(cls, state_dir: str | os.PathLike[str]) -> StandaloneCluster:
        """A handle on a cluster recorded by :meth:`write_state`, e.g. to :meth:`stop` it."""
        path = Path(state_dir) / _STATE_FILE
        try:
            state = json.loads(path.read_text())
            workers = [
                WorkerInfo(
                    int(w["pid"]),
                    int(w["port"]),
                    int(w["webui_port"]),
                    Path(w["work_dir"]),
                    Path(w["log_file"]),
                )
                for w in state["workers"]
            ]
            cluster = cls(max(len(workers), 1), log_dir=state["log_dir"], detach=True)
            cluster.master_port = int(state["master_port"])
            cluster.webui_port = int(state["webui_port"])
            cluster.master_pid = int(state["master_pid"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            msg = (
                f"{path}: not a readable cluster state file: {err}; if no cluster of it "
                "runs (`pgrep -af org.apache.spark.deploy` lists Spark's daemons), remove "
                f"{path} and start again"
            )
            raise SparkClusterError(msg) from err
        cluster.worker_infos = workers
        return cluster

    def __enter__(self) -> Self:
        return self if self.master_pid else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.master_url if self.master_pid else "not started"
        return f"StandaloneCluster({self.workers} x {self.cores} cores, {self.memory}, {where})"

    # -- internals ------------------------------------------------------------------------

    def _running_daemons(self) -> list[int]:
        """The pids of the master and workers that still run as this cluster's: a pid
        recorded before a crash or a reboot may since be another cluster's daemon, whose
        command line names other ports."""
        own = [(self.master_pid, self.master_port), *((w.pid, w.port) for w in self.worker_infos)]
        return [pid for pid, port in own if pid and _is_spark_daemon(pid, port)]

    def _require_started(self) -> None:
        if not self.master_pid:
            msg = "the cluster is not running; call start() or use it as a context manager"
            raise SparkClusterError(msg)

    def _worker_opts(self) -> str:
        opts = [os.environ.get("SPARK_WORKER_OPTS", "")]
        for name, (amount, script) in sorted(self.resources.items()):
            script_path = Path(script).resolve()
            if not os.access(script_path, os.X_OK):
                msg = f"resource {name!r}: discovery script {script_path} is not executable"
                raise ConfigError(msg)
            opts.append(f"-Dspark.worker.resource.{name}.amount={int(amount)}")
            opts.append(
                shlex.quote(f"-Dspark.worker.resource.{name}.discoveryScript={script_path}")
            )
        return " ".join(o for o in opts if o)

    def _spawn(
        self, home: Path, name: str, args: list[str], extra_env: Mapping[str, str]
    ) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        env = dict(os.environ)
        env.update(
            {
                "SPARK_HOME": str(home),
                "SPARK_LOCAL_IP": _LOOPBACK,
                "SPARK_DAEMON_MEMORY": self.daemon_memory,
                # with the class archive: a master or worker up in ~2.5 s instead of ~4 s here
                "SPARK_DAEMON_JAVA_OPTS": _with_archive(
                    " ".join(
                        o
                        for o in (env.get("SPARK_DAEMON_JAVA_OPTS", ""), self.daemon_java_opts)
                        if o
                    ),
                    class_archive_options(),
                ),
                "SPARK_LAUNCHER_OPTS": env.get("SPARK_LAUNCHER_OPTS", _LIGHT_JVM_OPTS),
                "PYSPARK_PYTHON": env.get("PYSPARK_PYTHON", sys.executable),
            }
        )
        env.update(extra_env)
        command = [str(home / "bin" / "spark-class"), *args]
        setpriv = shutil.which("setpriv")
        if not self.detach and setpriv is not None:
            # The JVM gets SIGTERM when the starting thread dies, even by SIGKILL.
            command = [setpriv, "--pdeathsig", "TERM", "--", *command]
        log_file = self.log_dir / f"{name}.log"
        with log_file.open("ab") as log:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.log_dir,
                start_new_session=True,
            )
        self._procs.append(proc)
        logger.debug("started %s (pid %d): %s", name, proc.pid, " ".join(command))
        return proc

    def _wait(self, deadline: float, ready: Callable[[dict[str, Any]], bool], what: str) -> None:
        """Poll the master's JSON status until ``ready(doc)`` or a process exits."""
        url = f"http://{_LOOPBACK}:{self.webui_port}/json/"
        while True:
            for proc in self._procs:
                code = proc.poll()
                if code is not None:
                    msg = f"a cluster process exited with status {code} while waiting for {what}"
                    raise SparkClusterError(msg + self._log_tails())
            doc = _fetch_json(url)
            if doc is not None and ready(doc):
                return
            if time.monotonic() > deadline:
                msg = f"timed out after {self.start_timeout:.0f} s waiting for {what}"
                raise SparkClusterError(msg + self._log_tails())
            time.sleep(0.1)

    def _is_own_master(self, doc: Mapping[str, Any]) -> bool:
        """Whether the web UI that answers belongs to the master started here."""
        expected = f"spark://{_LOOPBACK}:{self.master_port}"
        if doc.get("url") != expected:
            msg = (
                f"the web UI on port {self.webui_port} reports master {doc.get('url')!r}, not "
                f"{expected}: a port picked as free was taken meanwhile; start again"
            )
            raise SparkClusterError(msg + self._log_tails())
        return True

    def _log_tails(self, lines: int = 15) -> str:
        if self.log_dir is None:
            return ""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"\n--- {log} (last {len(tail)} lines) ---\n" + "\n".join(tail))
        return "".join(parts)

    def _reap(self) -> None:
        for proc in self._procs:
            proc.poll()


def _fetch_json(url: str) -> dict[str, Any] | None:
    """The JSON document at ``url``, or None while the server does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            doc = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _alive_workers(doc: Mapping[str, Any]) -> int:
    return sum(1 for w in doc.get("workers", []) if w.get("state") == "ALIVE")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on loopback right now."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((_LOOPBACK, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from ``/proc/PID/stat``, or None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _descendants(roots: Iterable[int]) -> list[int]:
    """All descendants of the processes ``roots`` (zombies included), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    found: list[int] = []
    stack = [child for root in roots for child in children.get(root, [])]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _is_spark_daemon(pid: int, port: int | None = None) -> bool:
    """Whether ``pid`` is still a Spark master/worker -- with ``port``, one started on that
    port (guards against reused pids)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    if not any(arg.startswith(b"org.apache.spark.deploy.") for arg in argv):
        return False
    if port is not None and not any(
        arg == b"--port" and value == str(port).encode() for arg, value in itertools.pairwise(argv)
    ):
        return False
    return _alive(pid)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _remove_state(state_dir: Path) -> None:
    """Remove the record of a cluster from ``state_dir`` (its logs stay)."""
    for name in (_STATE_FILE, "master-url", "pids"):
        (state_dir / name).unlink(missing_ok=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# -- command line: python -m adcloud.spark cluster start|stop|status ---------------------------


def _parse_resource(text: str) -> tuple[str, tuple[int, str]]:
    name, _, rest = text.partition("=")
    amount, _, script = rest.partition(":")
    if not name or not amount.isdigit() or not script:
        msg = f"--resource {text!r}: expected NAME=AMOUNT:DISCOVERY_SCRIPT"
        raise argparse.ArgumentTypeError(msg)
    return name, (int(amount), script)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m adcloud.spark cluster start|stop|status``: a cluster that outlives the shell.

    ``start`` prints the master URL and writes it, the pids and ``cluster.json`` to
    ``--state-dir``; ``stop`` stops the cluster recorded there.
    """
    parser = argparse.ArgumentParser(prog="python -m adcloud.spark")
    sub = parser.add_subparsers(dest="group", required=True)
    cluster = sub.add_parser("cluster", help="a Spark standalone cluster on 127.0.0.1")
    actions = cluster.add_subparsers(dest="action", required=True)
    start = actions.add_parser("start", help="start a master and workers, detached")
    start.add_argument(
        "--workers", type=whole_number(1, "workers"), default=2, help="worker JVMs (default 2)"
    )
    start.add_argument(
        "--cores", type=whole_number(1, "cores"), default=1, help="cores per worker (default 1)"
    )
    start.add_argument(
        "--memory", default="1g", help="memory per worker, JVM notation (default 1g)"
    )
    start.add_argument(
        "--resource",
        action="append",
        default=[],
        type=_parse_resource,
        help="per-worker resource NAME=AMOUNT:DISCOVERY_SCRIPT (repeatable)",
    )
    start.add_argument(
        "--timeout",
        type=number("number of seconds"),
        default=60.0,
        help="seconds to wait for the master and every worker to register (default 60)",
    )
    stop = actions.add_parser("stop", help="stop the cluster recorded in --state-dir")
    status = actions.add_parser(
        "status", help="print the master's status (workers, applications) as JSON"
    )
    for action in (start, stop, status):
        action.add_argument(
            "--state-dir",
            type=Path,
            required=True,
            help="directory of the cluster's master-url, pids, cluster.json and logs",
        )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    state_dir: Path = args.state_dir
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so a start stopped half-way stops what it launched
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.action == "start":
            with _state_lock(state_dir, create=True):
                recorded = (state_dir / _STATE_FILE).exists()
                if recorded and StandaloneCluster.from_state(state_dir).running():
                    msg = f"a cluster recorded in {state_dir} is still running; stop it first"
                    raise SparkClusterError(msg)
                started = StandaloneCluster(
                    args.workers,
                    cores=args.cores,
                    memory=args.memory,
                    resources=dict(args.resource),
                    log_dir=state_dir / "logs",
                    start_timeout=args.timeout,
                    detach=True,
                    state_dir=state_dir,
                ).start()
            sys.stdout.write(started.master_url + "\n")
        elif args.action == "stop":
            with _state_lock(state_dir, create=False):
                if not (state_dir / _STATE_FILE).exists():
                    logger.info("no cluster recorded in %s; nothing to stop", state_dir)
                    return 0
                StandaloneCluster.from_state(state_dir).stop()
                _remove_state(state_dir)
        else:
            if not (state_dir / _STATE_FILE).exists():
                raise SparkClusterError(
                    f"no cluster recorded in {state_dir}: none was started there, or it was "
                    "stopped (start one: deploy/local/start-cluster.sh)"
                )
            doc = StandaloneCluster.from_state(state_dir).status()
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    except AdcloudError as err:  # bad input or a cluster that cannot be had: as adcloud's CLI
        sys.stderr.write(f"error: {err}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: what had started is stopped\n")
        return 130
    return 0


@contextlib.contextmanager
def _state_lock(state_dir: Path, *, create: bool) -> Iterator[None]:
    """Hold ``state_dir``'s lock: one start or stop of the cluster recorded there at a time.

    Two starts at once both found no cluster running there; the second's state replaced
    the first's, whose master and workers then ran on with nothing left to stop them.  The
    lock is an ``flock``, which the kernel releases when its holder dies.  Without
    ``create`` a missing ``state_dir`` is left missing (nothing to lock).
    """
    if not create and not state_dir.is_dir():
        yield
        return
    try:
        if create:
            state_dir.mkdir(parents=True, exist_ok=True)
        handle = (state_dir / _LOCK_FILE).open("a")
    except OSError as err:
        # a file in the way, a parent that cannot be created, another user's directory
        msg = (
            f"--state-dir {state_dir}: cannot use it to record the cluster "
            f"({err.strerror or err}: {err.filename}); give a directory this user can create "
            "and write (deploy/local's scripts: ADCLOUD_CLUSTER_STATE)"
        )
        raise SparkClusterError(msg) from err
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
