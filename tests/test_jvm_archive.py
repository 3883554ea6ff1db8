"""The JVM class archive that Spark's JVMs start from (:mod:`adcloud._jvm_archive`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from adcloud import _jvm_archive
from adcloud.errors import MissingComponentError
from adcloud.spark import SparkSettings, class_archive_options, find_java, spark_conf, spark_home


def mapped_files(pid: int) -> set[str]:
    """The files a process has mapped into memory."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {fields[5] for fields in (line.split(maxsplit=5) for line in lines) if len(fields) == 6}


def the_archive() -> Path:
    java, _ = find_java()
    return _jvm_archive.archive_path(java, spark_home())


def test_the_install_built_the_archive_of_this_java_and_spark() -> None:
    path = the_archive()
    assert path.is_file(), f"{path} is missing: scripts/install.sh builds it"
    assert class_archive_options()[0] == f"-XX:SharedArchiveFile={path}"


def test_the_driver_jvm_maps_its_classes_from_the_archive(spark: SparkSession) -> None:
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    assert str(the_archive()) in mapped_files(int(pid))


def fake_install(root: Path) -> tuple[Path, Path]:
    """A JDK launcher with its libjvm.so, and a Spark home with one jar."""
    java = root / "jdk" / "bin" / "java"
    (root / "jdk" / "lib" / "server").mkdir(parents=True)
    java.parent.mkdir(parents=True)
    java.write_bytes(b"launcher")
    (root / "jdk" / "lib" / "server" / "libjvm.so").write_bytes(b"jvm 17.0.1")
    (root / "spark" / "jars").mkdir(parents=True)
    (root / "spark" / "jars" / "spark-core.jar").write_bytes(b"classes")
    return java, root / "spark"


def test_only_the_archive_of_this_jvm_and_these_jars_is_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_jvm_archive.ENV_DIR, str(tmp_path / "archives"))
    java, home = fake_install(tmp_path)
    assert _jvm_archive.java_options(java, home) == []  # not built
    built = _jvm_archive.archive_path(java, home)
    built.parent.mkdir()
    built.write_bytes(b"archive")
    assert _jvm_archive.java_options(java, home)[0] == f"-XX:SharedArchiveFile={built}"
    (home / "jars" / "spark-core.jar").write_bytes(b"classes of another release")
    assert _jvm_archive.java_options(java, home) == []
    (home / "jars" / "spark-core.jar").write_bytes(b"classes")
    os.utime(home / "jars" / "spark-core.jar", ns=(0, 0))  # same bytes, but not the same file
    assert _jvm_archive.java_options(java, home) == []
    assert _jvm_archive.java_options(tmp_path / "no-jdk" / "java", home) == []


def test_spark_conf_maps_the_archive_for_the_jvms_of_this_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("adcloud.spark.class_archive_options", lambda: ["-XX:SharedArchiveFile=a"])

    def jvm_options(master: str, **conf: str) -> tuple[str, str]:
        merged = spark_conf(SparkSettings(master=master, executor_memory="1g"), conf)
        return merged["spark.driver.extraJavaOptions"], merged["spark.executor.extraJavaOptions"]

    driver, executor = jvm_options("local[2]")
    assert "-XX:SharedArchiveFile=a" in driver.split()
    assert "SharedArchiveFile" not in executor  # local mode has no executor JVM
    for master in ("spark://127.0.0.1:7077", "spark://localhost:7077", "local-cluster[2,1,1024]"):
        assert "-XX:SharedArchiveFile=a" in jvm_options(master)[1].split(), master
    assert "SharedArchiveFile" not in jvm_options("spark://node7.fleet:7077")[1]
    # a user's own options keep the archive beside them, unless they choose class sharing
    own = jvm_options("local[2]", **{"spark.driver.extraJavaOptions": "-Xss4m"})[0]
    assert own == "-Xss4m -XX:SharedArchiveFile=a"
    for theirs in ("-Xshare:off", "-XX:SharedArchiveFile=mine.jsa"):
        assert jvm_options("local[2]", **{"spark.driver.extraJavaOptions": theirs})[0] == theirs
    light = "-XX:+UseSerialGC"
    executor = jvm_options("spark://127.0.0.1:7077", **{"spark.executor.extraJavaOptions": light})
    assert executor[1] == f"{light} -XX:SharedArchiveFile=a"


def run_java(*options: str, first: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``SparkSubmit --version`` on Spark's class path (after ``first``, if given)."""
    java, _ = find_java()
    classpath = f"{spark_home() / 'conf'}:{spark_home() / 'jars'}/*"
    if first is not None:
        classpath = f"{first}:{classpath}"
    return subprocess.run(
        [str(java), *options, "-cp", classpath, "org.apache.spark.deploy.SparkSubmit", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_damaged_or_mismatched_archive_only_costs_the_speed_up(tmp_path: Path) -> None:
    damaged = tmp_path / "spark-damaged.jsa"
    damaged.write_bytes(b"\0" * 4096)
    quiet = list(_jvm_archive._QUIET)
    for archive, first in (
        (damaged, None),
        (the_archive(), tmp_path),  # another class path in front of Spark's: HotSpot refuses it
    ):
        done = run_java(f"-XX:SharedArchiveFile={archive}", *quiet, first=first)
        assert done.returncode == 0, done.stderr
        assert "version" in done.stdout + done.stderr
        said = done.stdout + done.stderr
        assert "[warning]" not in said and "shared archive" not in said, said


def test_a_failed_build_says_so_and_leaves_no_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Java that reports version 17 but cannot start a JVM: the training run fails.
    jdk = tmp_path / "jdk"
    (jdk / "bin").mkdir(parents=True)
    java = jdk / "bin" / "java"
    launches = tmp_path / "launches"
    java.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -version ]; then echo \'openjdk version "17.0.9"\' >&2; exit 0; fi\n'
        f"echo launched >> {launches}\n"
        "echo 'Error: could not create the Java Virtual Machine' >&2; exit 1\n"
    )
    java.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(jdk))
    archives = tmp_path / "archives"
    monkeypatch.setenv(_jvm_archive.ENV_DIR, str(archives))
    with pytest.raises(MissingComponentError, match="could not build the JVM class archive") as err:
        _jvm_archive.build_archive(timeout=300)
    path = _jvm_archive.archive_path(java, spark_home())
    assert str(path) in str(err.value)
    assert "Spark still works without it" in str(err.value)
    # no archive, only the note of why, so the next install does not spend a minute again
    assert [p.name for p in archives.iterdir()] == [path.with_suffix(".failed").name]
    assert "could not create the Java Virtual Machine" in path.with_suffix(".failed").read_text()
    tries = launches.read_text().count("launched")
    with pytest.raises(MissingComponentError, match=r"could not be built .* before .*--force"):
        _jvm_archive.build_archive(timeout=300)
    assert launches.read_text().count("launched") == tries  # no JVM started
    with pytest.raises(MissingComponentError, match="could not build the JVM class archive"):
        _jvm_archive.build_archive(force=True, timeout=300)
    assert launches.read_text().count("launched") > tries


def test_an_unwritable_archive_directory_is_named_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(_jvm_archive.ENV_DIR, str(blocked / "jvm"))
    with pytest.raises(MissingComponentError, match="cannot write the JVM class archive") as err:
        _jvm_archive.build_archive()
    assert str(blocked / "jvm") in str(err.value) and _jvm_archive.ENV_DIR in str(err.value)
