"""The ``adcloud`` command line: help texts, bag info, ingest, submit, error reporting."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from rosbags.rosbag1 import Reader

from adcloud.binpipe import BinPipeRDD
from adcloud.cli import build_parser, main
from tests.processes import alive, children

HUSKY = "02_husky_gps_imu_odom_ros1/robot_localization_test1.bag"
LUMINAR = "01_embag_luminar_ros1/embag_test.bag"


def _subcommands(parser: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                out.extend(_subcommands(sub, (*prefix, name)))
    return out


@pytest.mark.parametrize("command", _subcommands(build_parser()), ids=" ".join)
def test_every_command_has_help(
    command: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: adcloud" in text
    assert len(text.splitlines()) >= 4


def test_console_script_is_installed() -> None:
    exe = Path(sys.executable).with_name("adcloud")
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert "ingest" in result.stdout and "bag" in result.stdout


def test_bag_info_text_and_json(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bag", "info", str(shared_data / HUSKY)]) == 0
    text = capsys.readouterr().out
    for expected in ("/imu/data", "sensor_msgs/msg/Imu", "11,865", "bz2", "395."):
        assert expected in text
    assert main(["bag", "info", "--json", str(shared_data / LUMINAR)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["message_count"] == 15
    assert data[0]["chunk_count"] == 6
    # the text's Hz column is each topic's own rate, as in the JSON: 11.1 Hz for the
    # LiDAR, not its 5 sweeps over the whole bag's 7.6 s
    assert main(["bag", "info", str(shared_data / LUMINAR)]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()}
    for topic in data[0]["topics"]:
        assert rows[topic["topic"]] == f"{topic['frequency']:.1f}", topic
    assert rows["/luminar_pointcloud"] == "11.1"


def test_bag_info_missing_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bag", "info", str(tmp_path / "nope.bag")]) == 2
    out = capsys.readouterr().err
    assert "nope.bag" in out and "does not exist" in out


def test_bag_info_reports_every_bag_it_can_read(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "night"
    folder.mkdir()
    shutil.copy(shared_data / LUMINAR, folder / "a.bag")
    (folder / "b.bag").write_bytes(b"not a bag at all")  # a copy still being written
    assert main(["bag", "info", str(folder)]) == 2
    said = capsys.readouterr()
    out, err = " ".join(said.out.split()), " ".join(said.err.split())
    assert "b.bag" in err and "error:" in err and "/luminar_pointcloud" in out
    assert "1 of 2 bags could not be read" in out
    assert main(["bag", "info", "--json", str(folder)]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data[0]["message_count"] == 15 and data[1]["uri"].endswith("b.bag")
    assert "error" in data[1]


def test_errors_keep_square_brackets_in_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rich would take "[night]" for a style tag and drop it from the message.
    missing = tmp_path / "run[night].bag"
    assert main(["bag", "info", str(missing)]) == 2
    out = capsys.readouterr().err.replace("\n", "")
    assert "run[night].bag" in out
    assert "error:" in out


def test_ingest_then_load(
    spark: Any, shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", spark.sparkContext.master)
    out = tmp_path / "ingest"
    code = main(
        ["ingest", str(shared_data / HUSKY), "--out", str(out), "--topics", "/fix", "--quiet"]
    )
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == 989
    assert BinPipeRDD.load(spark, str(out)).count() == 989


def test_ingest_says_what_a_selection_misses(
    spark: Any,
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", spark.sparkContext.master)
    monkeypatch.setenv("COLUMNS", "400")
    bag = str(shared_data / HUSKY)
    out = tmp_path / "out"
    # a typo: no such topic at all is an error that lists the bag's topics; nothing written
    assert main(["ingest", bag, "--out", str(out), "--topics", "fix", "--quiet"]) == 2
    said = capsys.readouterr().err
    assert "--topics fix: no such topic in the bag(s); they have /fix, " in said
    assert not out.exists()
    # one of two missing: a warning, and the other is ingested
    assert main(["ingest", bag, "--out", str(out), "--topics", "/fix,/nope", "--quiet"]) == 0
    assert "warning: --topics /nope: no such topic" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["records"] == 989
    # a time range past the end names the bag's span
    late = ["--start", "2000000000.0", "--topics", "/fix", "--quiet"]
    assert main(["ingest", bag, "--out", str(tmp_path / "late"), *late]) == 2
    said = capsys.readouterr().err
    assert "no message of /fix lies in the time range given" in said
    assert "the bags' messages span 1432235" in said and not (tmp_path / "late").exists()
    # two bags, one with the topic: the summary counts the bag read, of the two given
    luminar = str(shared_data / LUMINAR)
    two = ["--topics", "/fix", "--out", str(tmp_path / "two")]
    assert main(["ingest", bag, luminar, *two]) == 0
    assert "ingested 989 messages from 1 of 2 bags into" in capsys.readouterr().out
    # the manifest lists both bags given, and the filters (it listed only the bag read)
    source = json.loads((tmp_path / "two" / "manifest.json").read_text())["source"]
    assert [b["uri"] for b in source["bags"]] == [bag, luminar]
    assert [b["partitions"] > 0 for b in source["bags"]] == [True, False]
    assert source["topic_filter"] == ["/fix"] and source["time_source"] == "record"


def test_ingest_refuses_an_existing_output_before_spark_starts(
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import adcloud.cli as cli  # noqa: PLC0415

    def no_spark(args: Any) -> None:
        raise AssertionError("Spark started for an ingest that cannot write")

    monkeypatch.setattr(cli, "_session", no_spark)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["ingest", str(shared_data / HUSKY), "--out", str(out), "--quiet"]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["ingest", str(shared_data / HUSKY), "--out", str(out), "--overwrite"]) == 2
    assert "refusing to replace it" in capsys.readouterr().err


def test_ingest_of_a_corrupt_bag_names_the_file(
    spark: Any,
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", spark.sparkContext.master)
    bag = tmp_path / "broken.bag"
    shutil.copy(shared_data / HUSKY, bag)
    data = bytearray(bag.read_bytes())
    data[200_000:200_400] = bytes(400)  # zero a stretch inside a compressed chunk
    bag.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main(["ingest", str(bag), "--out", str(out), "--quiet"]) == 2
    text = capsys.readouterr().err
    assert "broken.bag" in text
    assert not (out / "_SUCCESS").exists()


def test_a_failing_spark_job_prints_one_line_per_attempt_not_tracebacks(
    shared_data: Path, tmp_path: Path
) -> None:
    """Spark logs a failed task's Python traceback twice per attempt (hundreds of lines for
    four attempts); adcloud's log profile keeps one line each, the error ends the output,
    the progress bar stays where the job stopped, and -v adds the whole traceback."""
    bag = tmp_path / "broken.bag"
    data = bytearray((shared_data / HUSKY).read_bytes())
    data[200_000:200_400] = bytes(400)  # zero a stretch inside a compressed chunk
    bag.write_bytes(bytes(data))
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    env = {**os.environ, "ADCLOUD_SPARK_MASTER": "local[2,4]"}
    runs = {
        flags: subprocess.run(
            [adcloud, *flags, "ingest", str(bag), "--out", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=300,
        )
        for flags in ((), ("-v",))
    }
    quiet, verbose = runs[()], runs[("-v",)]
    assert quiet.returncode == 2, quiet.stderr
    lines = quiet.stderr.splitlines()
    assert lines[-1].startswith("error (in a Spark task): ")
    assert str(bag) in lines[-1] and "offset" in lines[-1]
    assert "Traceback" not in quiet.stderr and "\tat " not in quiet.stderr
    lost = [line for line in lines if "Lost task" in line]
    assert lost and all("BagError: " in line for line in lost), lost
    assert len(lines) < 30, quiet.stderr
    assert "partitions: 100%" not in quiet.stderr
    assert verbose.returncode == 2
    assert "Traceback (most recent call last)" in verbose.stderr
    assert "error (in a Spark task): " in verbose.stderr
    assert not (tmp_path / "out" / "_SUCCESS").exists()


def test_sigterm_while_the_spark_jvm_starts_leaves_no_jvm_behind(
    shared_data: Path, tmp_path: Path
) -> None:
    """Interrupted while PySpark waits for the driver JVM to say its port, the JVM would
    run on with no parent for ever; the signal waits until it has started, and then the
    command stops it as usual."""
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    proc = subprocess.Popen(
        [adcloud, "ingest", str(shared_data / HUSKY), "--out", str(tmp_path / "out"), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    jvm = None
    while jvm is None and time.monotonic() < deadline and proc.poll() is None:
        for child in children(proc.pid):  # spark-submit, which execs the driver JVM
            with contextlib.suppress(OSError):
                if b"SparkSubmit" in Path(f"/proc/{child}/cmdline").read_bytes():
                    jvm = child
        time.sleep(0.01)
    assert jvm is not None, "the Spark JVM never started"
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    deadline = time.monotonic() + 30
    while alive(jvm) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(jvm), "the Spark JVM outlived the command"
    assert not (tmp_path / "out").exists()


def test_bag_reindex_refuses_a_url_for_its_output(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "t.bag"
    shutil.copy(shared_data / HUSKY, copy)
    assert main(["bag", "reindex", str(copy), f"file://{copy}", "--overwrite"]) == 2
    assert "OUT is a local .bag path, not a URL" in capsys.readouterr().err
    assert copy.read_bytes() == (shared_data / HUSKY).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bag"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_bag_reindex_says_a_directory_is_not_its_output(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], overwrite: bool
) -> None:
    """``ri/`` was "ri exists" (the slash dropped), and with --overwrite a directory."""
    (tmp_path / "ri").mkdir()
    (tmp_path / "ri" / "kept.txt").write_text("x")
    argv = ["bag", "reindex", str(shared_data / HUSKY), f"{tmp_path / 'ri'}/"]
    assert main(argv + ["--overwrite"] * overwrite) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'ri'}/ is a directory" in err
    assert f"e.g. {tmp_path / 'ri' / Path(HUSKY).name}" in err
    assert (tmp_path / "ri" / "kept.txt").read_text() == "x"


def test_a_master_that_is_not_there_is_one_line_at_once(shared_data: Path, tmp_path: Path) -> None:
    """Spark would retry an unreachable master for a minute and end in a stack trace."""
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    bag = str(shared_data / HUSKY)
    for argv, says in (
        (["ingest", bag, "--master", "spark://127.0.0.1:1"], "cannot reach the Spark master"),
        (["ingest", bag, "--master", "foo://bar"], "'foo://bar' is not one Spark takes"),
        (["submit", "--master", "spark://127.0.0.1:1", "--", "ingest", bag], "cannot reach"),
    ):
        began = time.monotonic()
        done = subprocess.run(
            [adcloud, *argv, "--out", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert time.monotonic() - began < 30
    assert not (tmp_path / "out").exists()


def _dry_run(capsys: pytest.CaptureFixture[str], *confs: str) -> tuple[str, list[str]]:
    """The line ``adcloud submit --dry-run`` prints for an ingest job, and its ``--conf``s."""
    argv = ["submit", "--dry-run", "--master", "spark://127.0.0.1:7077"]
    for conf in confs:
        argv += ["--conf", conf]
    assert main([*argv, "--", "ingest", "a.bag", "--out", "o"]) == 0
    line = capsys.readouterr().out.replace("\n", "")
    args = shlex.split(line)  # quoted, so the printed line can be pasted into a shell
    return line, [args[i + 1] for i, a in enumerate(args) if a == "--conf"]


def test_submit_dry_run_builds_spark_submit_line(capsys: pytest.CaptureFixture[str]) -> None:
    line, confs = _dry_run(capsys, "spark.executor.memory=2g")
    # the Python the run gives the driver and executors goes with the line as printed
    words = shlex.split(line)
    assert (
        f"PYSPARK_DRIVER_PYTHON={os.environ.get('PYSPARK_DRIVER_PYTHON', sys.executable)}"
        in (words[:3])
    )
    assert "SPARK_LOCAL_IP=127.0.0.1" in words[:3] or "SPARK_LOCAL_IP" in os.environ
    assert "bin/spark-submit --master spark://127.0.0.1:7077" in line
    assert "--conf spark.executor.memory=2g" in line
    assert line.rstrip().endswith("adcloud/cli.py ingest a.bag --out o")
    # the driver JVM spark-submit starts gets adcloud's memory and JVM options
    assert "spark.driver.memory=2g" in confs
    java = next(c for c in confs if c.startswith("spark.driver.extraJavaOptions="))
    assert "-Dlog4j2.configurationFile=" in java and "-XX:G1HeapRegionSize=4m" in java


def test_submit_passes_the_jobs_own_separators(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["submit", "--dry-run", "--master", "local[2]", "--", "sim", "run", "d.bag"]
    assert main([*argv, "--node", "x", "--", "--flag"]) == 0
    line = capsys.readouterr().out.replace("\n", "")
    assert line.rstrip().endswith("cli.py sim run d.bag --node x -- --flag")


def test_verbose_submit_makes_the_job_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    """``adcloud -v submit -- ingest ...`` ran the job without -v: no traceback of it."""
    argv = ["submit", "--dry-run", "--master", "local[2]", "--", "ingest", "d.bag"]
    assert main(["-vv", *argv, "--out", "o"]) == 0
    assert (
        capsys.readouterr()
        .out.replace("\n", "")
        .rstrip()
        .endswith("cli.py -vv ingest d.bag --out o")
    )
    assert main(["-v", *argv[:-2], "-v", "ingest", "d.bag", "--out", "o"]) == 0
    assert (
        capsys.readouterr()
        .out.replace("\n", "")
        .rstrip()
        .endswith("cli.py -v ingest d.bag --out o")
    )


def test_submit_keeps_the_users_own_driver_settings(capsys: pytest.CaptureFixture[str]) -> None:
    _, confs = _dry_run(capsys, "spark.driver.memory=9g", "spark.driver.extraJavaOptions=-Xss4m")
    assert [c for c in confs if c.startswith("spark.driver.")] == [
        "spark.driver.memory=9g",
        "spark.driver.extraJavaOptions=-Xss4m",
    ]


def test_submit_puts_the_environments_spark_settings_on_the_submit_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ADCLOUD_SPARK_CONF`` and ``ADCLOUD_SPARK_DRIVER_MEMORY`` were left to the submitted
    driver, which applies them after its JVM started (a driver class path is read at the
    start) and, in YARN's cluster mode, runs in a container the environment does not reach;
    on YARN the driver got 2g whatever the variable said.  A --conf of the user wins."""
    monkeypatch.setenv(
        "ADCLOUD_SPARK_CONF", "spark.driver.extraClassPath=/opt/x.jar,spark.log.level=ERROR"
    )
    monkeypatch.setenv("ADCLOUD_SPARK_DRIVER_MEMORY", "6g")
    _, confs = _dry_run(capsys, "spark.log.level=INFO")
    assert "spark.driver.extraClassPath=/opt/x.jar" in confs
    assert [c for c in confs if c.startswith("spark.log.level=")] == ["spark.log.level=INFO"]
    assert "spark.driver.memory=6g" in confs
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    (tmp_path / "yarn-site.xml").write_text("<configuration/>")
    argv = ["submit", "--dry-run", "--master", "yarn", "--", "ingest", "a.bag", "--out", "o"]
    assert main(argv) == 0
    words = shlex.split(capsys.readouterr().out.replace("\n", ""))
    assert words[words.index("--driver-memory") + 1] == "6g"
    confs = [words[i + 1] for i, a in enumerate(words) if a == "--conf"]
    assert "spark.driver.extraClassPath=/opt/x.jar" in confs
    assert "spark.log.level=ERROR" in confs and "spark.log.level=WARN" not in confs


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--gpus-per-executor", "1"], "--gpus-per-executor: for --master yarn only"),
        (["--executors", "4", "--queue", "mapping"], "--queue, --executors: for --master yarn"),
        # the YARN default given by name is as ignored as any other value
        (["--queue", "simulation"], "--queue: for --master yarn only"),
        (["--conf", "notkv"], "--conf takes KEY=VALUE, got 'notkv'"),
        # spark-submit's --master (always given) wins over it
        (["--conf", "spark.master=local[2]"], "--conf spark.master=local[2]: give the master"),
    ],
)
def test_submit_refuses_what_would_be_ignored(
    options: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["submit", "--dry-run", "--master", "spark://127.0.0.1:7077", *options]
    assert main([*argv, "--", "ingest", "a.bag", "--out", "o"]) == 2
    assert says in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    ("master", "says"),
    [
        ("foo", "'foo' is not one Spark takes"),
        ("local[0]", "'local[0]' is not one Spark takes"),
        ("spark://127.0.0.1", "'127.0.0.1' is not HOST:PORT (a standalone master listens on 7077"),
        ("spark://h1:7077,h2", "'h2' is not HOST:PORT"),
        ("k8s://", "'k8s://' names no Kubernetes API server"),
        ("yarn", "--master yarn needs the cluster's Hadoop configuration: set HADOOP_CONF_DIR"),
        # Spark 4 has no Mesos support and refuses these with a stack trace
        ("mesos://127.0.0.1:5050", "'mesos://127.0.0.1:5050' is not one Spark takes"),
        ("local-cluster[2]", "'local-cluster[2]' is not one Spark takes"),
        # Spark reads no path after the port; the hint said spark://127.0.0.1:7077/:7077
        ("spark://127.0.0.1:7077/", "(nothing may follow the port: spark://127.0.0.1:7077)"),
    ],
)
def test_submit_checks_the_master_before_printing_or_running(
    master: str, says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run printed a line spark-submit refuses (exit 0); a run without Hadoop's
    configuration started a JVM to end in a stack trace; a master without a port was
    reported unreachable, with advice to start one."""
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    monkeypatch.delenv("YARN_CONF_DIR", raising=False)
    for dry in (["--dry-run"], []):
        argv = ["submit", *dry, "--master", master, "--", "ingest", "a.bag", "--out", "o"]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert says in " ".join(captured.err.split()) and captured.out == ""


def test_submit_takes_the_master_every_command_takes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ADCLOUD_SPARK_MASTER`` chooses the master of ``submit`` as of every other command
    (it ran on local[*,4] instead, without a word); ``--master`` wins over it."""
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", "spark://127.0.0.1:7077")
    job = ["--", "ingest", "a.bag", "--out", "o"]
    assert main(["submit", "--dry-run", *job]) == 0
    assert "--master spark://127.0.0.1:7077" in capsys.readouterr().out
    assert main(["submit", "--dry-run", "--master", "local[2]", *job]) == 0
    assert "--master 'local[2]'" in capsys.readouterr().out
    monkeypatch.delenv("ADCLOUD_SPARK_MASTER")
    assert main(["submit", "--dry-run", *job]) == 0
    assert "--master 'local[*,4]'" in capsys.readouterr().out
    # on YARN the driver runs in a container (cluster mode) or here (client mode)
    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    assert main(["submit", "--dry-run", "--master", "yarn", *job]) == 2  # an empty directory
    assert "has no yarn-site.xml" in " ".join(capsys.readouterr().err.split())
    (tmp_path / "yarn-site.xml").write_text("<configuration/>")
    for mode, driver in (("cluster", "/opt/adcloud/venv/bin/python"), ("client", sys.executable)):
        argv = ["submit", "--dry-run", "--master", "yarn", "--deploy-mode", mode, *job]
        assert main(argv) == 0
        line = capsys.readouterr().out.replace("\n", "")
        assert f"spark.pyspark.driver.python={driver}" in shlex.split(line)
        assert "--queue simulation" in line


def test_submit_runs_the_job_through_spark_submit(shared_data: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("adcloud")
    out = tmp_path / "submitted"
    result = subprocess.run(
        [
            str(exe),
            "submit",
            "--master",
            "local[1]",
            "--",
            "ingest",
            str(shared_data / LUMINAR),
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ingested 15 messages" in result.stdout
    for chatter in ("default log4j profile", "loopback address", "INFO SparkContext"):
        assert chatter not in result.stderr, result.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["records"] == 15


def test_ingest_reindexes_an_unindexed_bag(
    spark: Any,
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", spark.sparkContext.master)
    bag = tmp_path / "killed.bag"
    data = bytearray((shared_data / LUMINAR).read_bytes())
    # index_pos is the first field of the bag header record: zero it, as a killed
    # recorder leaves it (the header record starts at byte 13, after the magic line)
    pos = data.index(b"index_pos=") + len(b"index_pos=")
    data[pos : pos + 8] = bytes(8)
    bag.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert main(["ingest", str(bag), "--out", str(out), "--quiet"]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "adcloud bag reindex BAG COPY.bag" in said and "--reindex-dir DIR" in said
    # the command the message names writes a copy that reads back, message for message
    copy = tmp_path / "copy.bag"
    assert main(["bag", "reindex", str(bag), str(copy)]) == 0
    assert "wrote" in capsys.readouterr().out
    with Reader(shared_data / LUMINAR) as src:
        want = [(c.topic, t, bytes(raw)) for c, t, raw in src.messages()]
    with Reader(copy) as got:
        assert [(c.topic, t, bytes(raw)) for c, t, raw in got.messages()] == want
    assert copy.stat().st_mode & 0o777 == bag.stat().st_mode & 0o777  # as the umask allows
    assert main(["bag", "reindex", str(bag), str(copy)]) == 2  # no silent overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert bag.read_bytes() == bytes(data)  # the source is never touched
    code = main(
        [
            "ingest",
            str(bag),
            "--out",
            str(out),
            "--quiet",
            "--reindex-dir",
            str(tmp_path / "reindexed"),
        ]
    )
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["records"] == 15
    [entry] = manifest["source"]["bags"]  # the copy read, and the bag it stands for
    assert entry["reindexed_from"] == str(bag) and entry["uri"].startswith(
        str(tmp_path / "reindexed")
    )
    assert bag.read_bytes() == bytes(data)  # the source is untouched


def test_demo_runs_end_to_end(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ADCLOUD_SPARK_MASTER", spark.sparkContext.master)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert main(["demo", "--out", str(tmp_path / "demo"), "--seconds", "2", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "outputs" in text and str(tmp_path / "demo" / "ingest") in text.replace("\n", "")
    manifest = json.loads((tmp_path / "demo" / "ingest" / "manifest.json").read_text())
    assert manifest["records"] > 16806  # the synthetic drive plus the shared recordings
    assert (tmp_path / "demo" / "synth" / "drive.bag").stat().st_size > 0
    results = (tmp_path / "demo" / "sim" / "results.jsonl").read_text().splitlines()
    assert results and all(json.loads(line)["passed"] for line in results)
    assert (tmp_path / "demo" / "sim" / "report.html").exists()
    assert list((tmp_path / "demo" / "hdmap").glob("versions/*/report/summary.html"))
    assert (tmp_path / "demo" / "train" / "model" / "model.pt2").stat().st_size > 0
    # the model scored on the map's 30 s drive, which it never saw
    scored = json.loads((tmp_path / "demo" / "train" / "eval.json").read_text())
    other = tmp_path / "demo" / "hdmap-drive" / "drive.bag"
    with Reader(other) as recorded:  # one sample per recorded sweep
        sweeps = sum(c.msgcount for c in recorded.connections if c.topic == "/lidar/points")
    assert scored["bags"] == [
        {"uri": str(other), "samples": sweeps, "scores": scored["bags"][0]["scores"]}
    ]
    assert sweeps > 250  # 30 s of 10 Hz sweeps
    assert f"mIoU {scored['scores']['miou']:.3f}" in text
    # the training checkpoints and every other scratch directory went with the run
    assert [p.name for p in scratch.iterdir() if p.name.startswith(("adcloud", "hdmap"))] == []


def test_errors_go_to_stderr_and_a_closed_pipe_is_no_error(tmp_path: Path) -> None:
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    missing = subprocess.run(
        [adcloud, "bag", "info", str(tmp_path / "nope.bag")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2 and missing.stdout == ""  # stdout stays the output
    assert "nope.bag" in missing.stderr
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(8 << 20))
    env = {**os.environ, "ADCLOUD_STORE_ROOT": str(tmp_path / "store")}
    subprocess.run([adcloud, "store", "put", str(big), "local:///big.bin"], env=env, check=True)
    # `adcloud store cat URL | head -c 10`: the reader goes away early, as with cat
    done = subprocess.run(
        f"{shlex.quote(adcloud)} store cat local:///big.bin | head -c 10 > /dev/null",
        shell=True,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_sigterm_unwinds_like_ctrl_c(tmp_path: Path) -> None:
    adcloud = str(Path(sys.executable).with_name("adcloud"))
    out = tmp_path / "long.bag"
    proc = subprocess.Popen(
        [adcloud, "synth", "--seconds", "120", "--no-camera", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)  # until it has started writing
    time.sleep(1.0)
    proc.terminate()
    assert proc.wait(timeout=60) == 143, proc.stderr.read() if proc.stderr else ""
    assert not out.exists() and not (tmp_path / "long.bag.truth").exists()


class _Parser:
    """``build_parser()`` whose commands all run ``func``."""

    def __init__(self, func: Any) -> None:
        self.func = func

    def parse_args(self, argv: Any) -> Any:
        args = build_parser().parse_args(argv)
        args.func = self.func
        return args


@pytest.mark.parametrize("stop", ["SIGTERM", "Ctrl-C"])
def test_a_stop_that_breaks_a_spark_call_exits_as_stopped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stop: str
) -> None:
    """SIGTERM or Ctrl-C inside ``rdd.collect()``: PySpark's clean-up then calls the broken
    gateway and py4j raises ``Py4JNetworkError`` while the interrupt is handled.  The
    command was stopped (143/130), not crashed (1 with a traceback); a gateway error
    without an interrupt behind it is still raised."""
    from py4j.protocol import Py4JNetworkError  # noqa: PLC0415

    from adcloud import cli  # noqa: PLC0415

    def collect(args: Any, console: Any) -> int:
        try:
            raise cli._Terminated if stop == "SIGTERM" else KeyboardInterrupt
        finally:
            raise Py4JNetworkError("Answer from Java side is empty")

    monkeypatch.setattr(cli, "build_parser", lambda: _Parser(collect))
    assert cli.main(["store", "ls", "local:///x"]) == (143 if stop == "SIGTERM" else 130)
    assert "Traceback" not in capsys.readouterr().err

    def broken(args: Any, console: Any) -> int:
        raise Py4JNetworkError("Answer from Java side is empty")

    monkeypatch.setattr(cli, "build_parser", lambda: _Parser(broken))
    with pytest.raises(Py4JNetworkError):
        cli.main(["store", "ls", "local:///x"])


def test_a_driver_jvm_gone_with_the_signal_leaves_the_exit_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to the whole process group (a scheduler's timeout) ends the driver JVM too:
    stopping the SparkContext afterwards finds no gateway, and the command still exits 143
    without a traceback."""
    from adcloud import cli  # noqa: PLC0415

    class Gone:
        stopped = 0

        def stop(self) -> None:
            Gone.stopped += 1
            raise ConnectionRefusedError(111, "Connection refused")

    contexts = iter([None, Gone()])  # none before the command, one it started
    monkeypatch.setattr(cli, "_active_spark", lambda: next(contexts))

    def training(args: Any, console: Any) -> int:
        raise cli._Terminated

    monkeypatch.setattr(cli, "build_parser", lambda: _Parser(training))
    assert cli.main(["store", "ls", "local:///x"]) == 143
    assert Gone.stopped == 1
    assert "Traceback" not in capsys.readouterr().err


def test_what_py4j_logs_of_an_interrupted_command_is_not_shown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C mid-job: py4j logs the interrupted call (root logger) and the connection it
    fails to shut down (``py4j.clientserver``) with tracebacks; the command says it was
    stopped itself. Other py4j errors still show."""
    import logging  # noqa: PLC0415

    from adcloud import cli  # noqa: PLC0415

    def interrupted(args: Any, console: Any) -> int:
        logging.exception("KeyboardInterrupt while sending command.")
        client = logging.getLogger("py4j.clientserver")
        client.error("Exception occurred while shutting down connection")
        client.error("Answer from Java side is empty")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", lambda: _Parser(interrupted))
    with caplog.at_level(logging.INFO):
        assert cli.main(["store", "ls", "local:///x"]) == 130
    assert [r.getMessage() for r in caplog.records] == ["Answer from Java side is empty"]


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--start", "inf", "not a time"),  # was an OverflowError traceback
        ("--start", "1e400", "not a time"),
        ("--start", "1e9", "not a time"),  # no dot: was read as seconds
        ("--start", "1_5", "not a time"),
        ("--end", "99999999999999999999999", "beyond the time a bag can hold"),
        ("--end", "1e11.", "not a time"),
        ("--partition-mb", "nan", "give a size in MiB, 0 or more"),  # was a traceback
        ("--partition-mb", "-1", "give a size in MiB, 0 or more"),  # was taken
        ("--partitions-per-bag", "0", "0: give 1 or more"),  # was found after Spark started
        ("--topics", ",", "',' names no topic"),  # selected nothing: an empty save
        ("--topics", " ", "' ' names no topic"),
    ],
)
def test_ingest_numbers_are_checked_as_they_are_parsed(
    option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["ingest", "a.bag", "--out", "o", option, value])
    assert stop.value.code == 2
    assert says in capsys.readouterr().err


def test_ingest_time_bounds_read_as_documented() -> None:
    def bounds(*argv: str) -> tuple[int | None, int | None]:
        args = build_parser().parse_args(["ingest", "a.bag", "--out", "o", *argv])
        return args.start, args.end

    assert bounds("--start", "1700000000000000001") == (1700000000000000001, None)
    assert bounds("--start", "1700000000.5", "--end=-2.") == (1700000000500000000, -2 * 10**9)
    assert bounds("--end", ".25") == (None, 250000000)
    # the README's example: seconds with an exponent (was "not a time")
    assert bounds("--start", "1.5e9", "--end", "1.7E+9") == (15 * 10**17, 17 * 10**17)
    assert bounds("--start", "1700000000.123456789") == (1700000000123456789, None)


def test_submit_without_a_job_is_an_error_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """It said so on stdout: ``adcloud submit --dry-run > run.sh`` wrote the message into the
    script to run."""
    for job in ([], ["--"]):
        assert main(["submit", "--dry-run", "--master", "local[2]", *job]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("error: nothing to submit: give the job after --")


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--executors", "0", "argument --executors: 0: give 1 or more containers"),
        ("--gpus-per-executor", "-1", "argument --gpus-per-executor: -1: give 0 or more"),
        ("--fpgas-per-executor", "-1", "argument --fpgas-per-executor: -1: give 0 or more"),
        ("--tasks-per-device", "0", "argument --tasks-per-device: 0: give 1 or more"),
    ],
)
def test_submit_yarn_counts_are_checked_as_they_are_parsed(
    option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was found later, as "device counts must be >= 0, executors and tasks_per_device
    >= 1", naming neither the option nor the value."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["submit", "--master", "yarn", option, value, "--", "ingest"])
    assert stop.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--seconds", "nan"], "argument --seconds: 'nan': give a finite number of seconds"),
        (["--seconds", "0"], "argument --seconds: '0': give a number of seconds > 0"),
        (["--out", "s3://b/demo"], "argument --out: s3://b/demo: the demo can only be written"),
    ],
)
def test_demo_options_are_checked_as_they_are_parsed(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--seconds nan`` made the output directory and then failed; ``--out s3://b/demo``
    ran the demo into ./s3:/b/demo."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["demo", *argv])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_demo_with_a_missing_bag_fails_before_it_makes_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``adcloud demo --bag missing.bag`` made the synthetic drive and started Spark before
    it failed (~10 s); it fails first, and nothing is written."""
    out = tmp_path / "demo"
    missing = tmp_path / "missing.bag"
    assert main(["demo", "--out", str(out), "--bag", str(missing), "--quiet"]) == 2
    assert str(missing) in " ".join(capsys.readouterr().err.split())
    assert not out.exists()


def test_help_states_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "exit status:" in text
    for status in ("  0 ", "  1 ", "  2 ", "  130 ", "  141 "):
        assert status in text


def test_local_path_takes_a_file_url_as_its_path() -> None:
    from adcloud._argtypes import local_path  # noqa: PLC0415

    parse = local_path("it")
    assert parse("out/x.bag") == "out/x.bag"
    assert parse("file:///tmp/x y.bag") == "/tmp/x y.bag"
    assert parse("FILE:///tmp/x.bag") == "/tmp/x.bag"
    # the shell leaves the ~ of --out=~/x: it was written below ./~ of the working directory
    assert parse("~/x.bag") == str(Path.home() / "x.bag")


def test_verbose_shows_the_traceback_of_an_error_raised_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``adcloud -v COMMAND shows tracebacks`` (the epilog): it did for errors raised in
    Spark tasks and for OSErrors, but not for adcloud's own errors raised in the driver,
    where it is most wanted. Without -v there is one error line, with it the same line
    after the traceback."""
    missing = tmp_path / "missing.bag"
    assert main(["bag", "info", str(missing)]) == 2
    quiet = capsys.readouterr().err
    assert "Traceback" not in quiet and quiet.startswith("error: ") and str(missing) in quiet
    assert main(["-v", "bag", "info", str(missing)]) == 2
    verbose = capsys.readouterr().err
    assert "Traceback (most recent call last)" in verbose
    assert verbose.splitlines()[-1] == quiet.splitlines()[-1]
