"""A class-data-sharing (CDS) archive of the classes a Spark JVM loads, so it starts sooner.

A Spark driver loads, verifies and links some fifteen thousand classes from the ~280 jars of
its home before a session is ready and in its first jobs: on 2 cores ~9 s to a session and
~6 s more in the first jobs, nearly all of it class loading. HotSpot (JDK 13+) can instead
map those classes ready-made from a *dynamic archive* written at the exit of an earlier JVM
(``-XX:ArchiveClassesAtExit``); measured here with the archive this module builds: a session
in 5.4-6.0 s instead of 9.0 s, the first jobs in 3.6 s instead of 6.3 s.

``scripts/install.sh`` builds the archive once (``python -m adcloud._jvm_archive``: a short
local session that runs RDD, DataFrame, Arrow and Parquet work, then dumps what it loaded);
:func:`adcloud.spark.spark_conf` then starts Spark JVMs on this machine with it. The archive is
named by a fingerprint of the JVM and of Spark's jars, so a Java or pyspark upgrade never maps
a stale archive: the options are simply left out until the install builds the new one. The
JVM checks the archive itself as well (it refuses one whose class path or jars changed and
runs as it would without); its notices about that are switched off, since nothing is lost.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["archive_dir", "archive_path", "build_archive", "java_options"]

ENV_DIR = "ADCLOUD_JVM_ARCHIVE_DIR"
"""Where archives live; default ``<sys.prefix>/share/adcloud/jvm`` (the venv)."""

_PREFIX = "spark-"
_SUFFIX = ".jsa"
# Beside where an archive would be: why building it failed for this JVM and these jars, so
# that every later install does not spend its minute failing again (``--force`` retries).
_FAILED = ".failed"
# A mismatched archive (another class path, a changed jar) only costs the speed-up; the
# JVM's warnings about it would land in every job's output.
_QUIET = ("-Xshare:auto", "-Xlog:cds=off", "-Xlog:cds+dynamic=off")


def archive_dir() -> Path:
    """The directory that holds this installation's archives."""
    given = os.environ.get(ENV_DIR)
    return Path(given) if given else Path(sys.prefix) / "share" / "adcloud" / "jvm"


def _fingerprint(java: Path, home: Path) -> str:
    """What the archive depends on: the JVM build (its launcher and ``libjvm.so``) and every
    jar of the Spark home (name, size, modification time -- what HotSpot validates too)."""
    digest = hashlib.sha256()
    real = java.resolve()
    jvm_files = [real, *sorted(real.parent.parent.glob("lib/server/libjvm.so"))]
    for path in [*jvm_files, *sorted((home / "jars").glob("*.jar"))]:
        st = path.stat()
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def archive_path(java: Path, home: Path) -> Path:
    """Where the archive for this JVM and this Spark home is (or would be) kept."""
    return archive_dir() / f"{_PREFIX}{_fingerprint(java, home)}{_SUFFIX}"


def java_options(java: Path, home: Path) -> list[str]:
    """JVM options that map the archive of this JVM and Spark home, each quoted for an option
    string of Spark's; none when it was not built (or was built for another Java or another
    pyspark)."""
    try:
        path = archive_path(java, home)
    except OSError:  # a JVM or Spark home that cannot be read: Spark will say so itself
        return []
    if not path.is_file():
        return []
    # quoted as Spark's option strings (extraJavaOptions, SPARK_DAEMON_JAVA_OPTS) read
    # them back: an installation under "My Projects" would split the path in two
    return [shlex.quote(f"-XX:SharedArchiveFile={path}"), *_QUIET]


def _exercise(dump_to: Path, work: Path) -> None:
    """The archive's training run: a local session doing the kinds of work adcloud's jobs
    do, in this process, with the driver JVM dumping its classes to ``dump_to`` at exit."""
    import pandas as pd  # noqa: PLC0415
    from pyspark import SparkContext  # noqa: PLC0415

    from adcloud.spark import SparkSettings, get_session, spark_conf  # noqa: PLC0415

    settings = SparkSettings.load(master="local[2]")
    driver = spark_conf(settings)["spark.driver.extraJavaOptions"]
    spark = get_session(
        settings,
        **{
            "spark.driver.extraJavaOptions": (
                f"{driver} {shlex.quote(f'-XX:ArchiveClassesAtExit={dump_to}')}"
            ),
            "spark.ui.showConsoleProgress": "false",
        },
    )
    sc = spark.sparkContext
    pairs = sc.parallelize(range(2000), 4).map(lambda i: (i % 7, bytes(i % 256)))
    pairs.cache().reduceByKey(lambda a, b: a + b).count()
    pairs.groupByKey(3).mapValues(lambda values: sum(1 for _ in values)).collect()
    pairs.combineByKey(len, lambda n, v: n + len(v), lambda a, b: a + b).collectAsMap()
    sc.broadcast(list(range(100))).value  # noqa: B018
    sc.parallelize([b"x" * 4096] * 8, 2).mapPartitions(lambda it: [sum(map(len, it))]).sum()
    frame = spark.createDataFrame(pd.DataFrame({"k": [i % 5 for i in range(500)], "v": 1.0}))
    frame.groupBy("k").sum("v").toPandas()
    frame.write.mode("overwrite").parquet(str(work / "frame.parquet"))
    spark.read.parquet(str(work / "frame.parquet")).filter("k > 1").count()
    frame.rdd.map(lambda row: row.k).distinct().count()
    sc.binaryFiles(str(work / "frame.parquet")).keys().count()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    spark.stop()
    if proc is not None:
        # The JVM exits (and writes the archive) when its stdin closes; wait for the dump.
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=600)


def build_archive(*, force: bool = False, timeout: float = 900.0) -> Path:
    """Build the archive for the JVM and Spark home adcloud uses, unless it exists; returns
    its path. Archives of other JVMs or Spark homes in the same directory are removed. The
    archive appears whole or not at all (written beside it, then renamed)."""
    from adcloud.errors import MissingComponentError  # noqa: PLC0415
    from adcloud.spark import find_java, spark_home  # noqa: PLC0415

    java, _ = find_java()
    home = spark_home()
    path = archive_path(java, home)
    if path.is_file() and not force:
        return path
    failed_before = path.with_suffix(_FAILED)
    if failed_before.is_file() and not force:
        msg = (
            f"the JVM class archive {path} could not be built for this Java and Spark before "
            f"(why: {failed_before}); Spark works without it, only slower to start. Run "
            "`python -m adcloud._jvm_archive --force` to try again"
        )
        raise MissingComponentError(msg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        building = tempfile.TemporaryDirectory(prefix=".build-", dir=path.parent)
    except OSError as err:
        msg = (
            f"cannot write the JVM class archive into {path.parent} ({err.strerror}); set "
            f"{ENV_DIR} to a writable directory"
        )
        raise MissingComponentError(msg) from err
    # Built beside its final name (then renamed), by a process that finds no archive to map.
    with building as tmp:
        dump = Path(tmp) / path.name
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "adcloud._jvm_archive", "--exercise", str(dump)],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=tmp,
                env={**os.environ, ENV_DIR: tmp},
            )
            failed = (proc.stderr or proc.stdout).strip() if proc.returncode != 0 else ""
        except subprocess.TimeoutExpired:
            failed = f"the training run took longer than {timeout:.0f} s"
        if failed or not dump.is_file():
            msg = (
                f"could not build the JVM class archive {path}: "
                f"{failed[-2000:] or 'the JVM wrote no archive'}; Spark still works without "
                "it, only slower to start"
            )
            failed_before.write_text(msg + "\n", encoding="utf-8")
            raise MissingComponentError(msg)
        dump.replace(path)
    failed_before.unlink(missing_ok=True)
    for stale in [*path.parent.glob(f"{_PREFIX}*{_SUFFIX}"), *path.parent.glob(f"*{_FAILED}")]:
        if stale != path:
            stale.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m adcloud._jvm_archive [--force]``: build the archive (install.sh does)."""
    parser = argparse.ArgumentParser(
        prog="python -m adcloud._jvm_archive",
        description="Build the class-data-sharing archive that lets Spark JVMs start faster.",
    )
    parser.add_argument("--force", action="store_true", help="build it even if it exists")
    parser.add_argument(
        "--check", action="store_true", help="exit 0 if it is built, 1 if not; build nothing"
    )
    parser.add_argument("--exercise", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.exercise is not None:
        with tempfile.TemporaryDirectory(prefix="adcloud-jvm-work-") as work:
            _exercise(args.exercise, Path(work))
        return 0
    from adcloud.errors import AdcloudError  # noqa: PLC0415
    from adcloud.spark import class_archive_options  # noqa: PLC0415

    if args.check:
        return 0 if class_archive_options() else 1
    started = time.monotonic()
    try:
        path = build_archive(force=args.force)
    except AdcloudError as err:
        sys.stderr.write(f"warning: {err}\n")
        return 1
    size = path.stat().st_size / 2**20
    sys.stdout.write(f"{path} ({size:.0f} MiB, {time.monotonic() - started:.0f} s)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
