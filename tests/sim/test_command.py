"""``adcloud sim run``: argument parsing and a run on the test session."""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from rich.console import Console

from adcloud.sim import (
    EVALUATORS,
    CutMode,
    EvaluatorSpec,
    SimError,
    command,
    register_evaluator,
)
from adcloud.synth import DriveResult

from .conftest import OBSTACLE_NODE, CountAtLeast


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="adcloud")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_job_from_arguments() -> None:
    args = _parse(
        [
            "sim",
            "run",
            "a.bag",
            "b.bag",
            "--node",
            "relay /a /b",
            "--adapter",
            "ros1",
            "--inputs",
            "/a, /c",
            "--outputs",
            "/b",
            "--eval",
            "rate:topic=/b,min_hz=5",
            "--cut",
            "window",
            "--window",
            "2",
            "--warmup",
            "0.5",
            "--rate",
            "1",
            "--no-sync",
            "--answers",
            "/b",
        ]
    )
    job = command.job_from_args(args)
    assert job.bags == ("a.bag", "b.bag")
    assert job.node.adapter == "ros1"
    assert job.input_topics == ("/a", "/c")
    assert job.evaluators == (EvaluatorSpec.of("rate", topic="/b", min_hz=5),)
    assert job.cut.mode is CutMode.WINDOW
    assert job.cut.window_s == 2.0
    assert job.timing.rate == 1.0
    assert not job.timing.sync
    assert job.timing.answer_topics == ("/b",)
    assert args.func is command.run


def test_help_lists_the_registered_evaluators_and_explains_the_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    register_evaluator("count_at_least", CountAtLeast)
    try:
        with pytest.raises(SystemExit):
            _parse(["sim", "run", "--help"])
    finally:
        del EVALUATORS["count_at_least"]
    text = " ".join(capsys.readouterr().out.split())
    for name in ("rate", "latency", "detections", "pose_error", "frames", "count_at_least"):
        assert f"{name}," in text, name
    assert "--cut {bag,window,file} how bags become scenarios" in text
    assert "(default: empty = all inputs)" in text
    # a pipe node slower to start than --startup-timeout is waited for, not failed: the
    # help called it a "node start-up limit"
    assert "start-up limit" not in text
    assert "a pipe node slower to start is not failed for it" in text
    assert "--outputs OUTPUTS output topics, comma-separated (default: every topic" in text


def test_adapter_by_import_path() -> None:
    base = ["sim", "run", "a.bag", "--node", "x", "--inputs", "/a", "--adapter"]
    args = _parse([*base, "adcloud.sim.adapters:PipeAdapter"])
    assert command.job_from_args(args).node.adapter == "adcloud.sim.adapters:PipeAdapter"
    args = _parse([*base, "ros7"])
    with pytest.raises(SimError, match="unknown node adapter 'ros7'"):
        command.job_from_args(args)


def test_a_node_command_with_an_unclosed_quote_is_refused() -> None:
    """``--node "python -m det --name 'x"`` raised shlex's bare ValueError: a traceback."""
    args = _parse(["sim", "run", "a.bag", "--node", "python -m det --name 'x", "--inputs", "/a"])
    with pytest.raises(SimError, match=r"the node command .* does not split: No closing quotation"):
        command.job_from_args(args)


def test_bad_topic_is_refused() -> None:
    args = _parse(["sim", "run", "a.bag", "--node", "x", "--inputs", "not a topic"])
    with pytest.raises(SimError, match="bad topic name"):
        command.job_from_args(args)


def test_run_prints_a_table_and_writes_the_report(
    spark: SparkSession, drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command, "_session", lambda master: spark)
    args = _parse(
        [
            "sim",
            "run",
            str(drive.bag),
            "--node",
            OBSTACLE_NODE + " --max-range 10",
            "--inputs",
            "/lidar/points",
            "--outputs",
            "/obstacles",
            "--eval",
            "detections:topic=/obstacles,min_recall=0.95",
            "--report",
            str(tmp_path / "rep"),
        ]
    )
    out = io.StringIO()
    code = args.func(args, Console(file=out, width=200))
    assert code == 1  # the short-sighted detector misses obstacles
    text = out.getvalue()
    assert "FAIL" in text
    assert "0 of 1 scenarios passed" in text
    assert (tmp_path / "rep" / "report.html").exists()
    assert "full reasons, exit codes and stderr of the failed scenarios: " in text
    assert "rep/results.jsonl" in text


def test_a_report_directory_holding_other_files_is_refused_before_the_job(
    drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_spark(master: str | None) -> None:
        raise AssertionError("the job ran, though its report could not be written")

    monkeypatch.setattr(command, "_session", no_spark)
    report = tmp_path / "rep"
    report.mkdir()
    (report / "notes.txt").write_text("mine")
    args = _parse(
        [
            "sim",
            "run",
            str(drive.bag),
            "--node",
            OBSTACLE_NODE,
            "--inputs",
            "/lidar/points",
            "--report",
            str(report),
        ]
    )
    with pytest.raises(SimError, match=r"notes\.txt\); refusing to replace it"):
        args.func(args, Console(file=io.StringIO()))
    assert (report / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--window", "0"], "argument --window: '0': give a number of seconds > 0"),
        (["--warmup", "-1"], "argument --warmup: '-1': give a number of seconds >= 0"),
    ],
)
def test_window_options_are_checked_as_given(
    drive: DriveResult, option: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "run", str(drive.bag), "--node", "cat", "--inputs", "/lidar/points"]
    with pytest.raises(SystemExit) as info:
        _parse([*argv, "--cut", "window", *option])
    assert info.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--timeout", "inf"], "argument --timeout: 'inf': give a finite number of seconds"),
        (["--timeout", "0"], "argument --timeout: '0': give a number of seconds > 0"),
        (
            ["--startup-timeout", "1e12"],
            "argument --startup-timeout: '1e12': give a number of seconds of at most 9223372036",
        ),
        (["--quiet-period", "inf"], "argument --quiet-period: 'inf': give a finite number of"),
        (["--quiet", "1e12"], "argument --quiet-period: '1e12': give a number of seconds of at"),
    ],
)
def test_time_limits_are_finite_as_given(
    drive: DriveResult, option: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An infinite limit crashed the task with an OverflowError (a traceback, exit 1 as if a
    scenario failed) or went unenforced: refused when parsed, as --window is."""
    argv = ["sim", "run", str(drive.bag), "--node", "cat", "--inputs", "/lidar/points"]
    with pytest.raises(SystemExit) as info:
        _parse([*argv, *option])
    assert info.value.code == 2 and says in capsys.readouterr().err
    cameras = ["sim", "cameras", str(drive.bag), "--node", "cat", "--cameras", "/a"]
    if option[0] == "--timeout":
        with pytest.raises(SystemExit) as info:
            _parse([*cameras, *option])
        assert info.value.code == 2 and says in capsys.readouterr().err


def _no_session(master: str | None) -> None:
    raise AssertionError("Spark started for a sweep that cannot run")


@pytest.mark.parametrize(
    ("cameras", "counts", "says"),
    [
        ("/a,/b,/a", [], "--cameras names a topic twice: /a,/b,/a"),
        ("/a,/b", ["--counts", "1,3"], "--counts 3: more cameras than the 2 topic(s) --cameras"),
    ],
)
def test_cameras_refuses_topics_and_counts_before_spark_starts(
    cameras: str, counts: list[str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep found these only after a Spark session had started (5 to 12 s)."""
    monkeypatch.setattr(command, "_session", _no_session)
    args = _parse(["sim", "cameras", "b.bag", "--node", "n", "--cameras", cameras, *counts])
    with pytest.raises(SimError, match=re.escape(says)):
        args.func(args, Console(file=io.StringIO()))


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--counts", "0"], "argument --counts: --counts takes camera counts of 1 or more"),
        (["--counts", ","], "argument --counts: --counts takes camera counts of 1 or more"),
        (["--rate", "0"], "argument --rate: '0': give a replay speed > 0"),
        (["--rate", "nan"], "argument --rate: 'nan': give a finite replay speed"),
        (["--require", "-1"], "argument --require: -1: give 0 or more cameras"),
        (["--report", "memory://sweep"], "argument --report: memory://sweep: memory:// lives"),
    ],
)
def test_cameras_numbers_are_checked_as_they_are_parsed(
    option: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate 0`` replayed as fast as possible and said the detector sustained its count
    "at 0x their frame rate"; ``--counts 0`` and an empty one failed after Spark started."""
    with pytest.raises(SystemExit) as info:
        _parse(["sim", "cameras", "b.bag", "--node", "n", "--cameras", "/a", *option])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_a_report_in_memory_is_refused_as_it_is_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    """A memory:// report was written, and said to be there, in a store that ended with the
    command."""
    with pytest.raises(SystemExit) as info:
        _parse(["sim", "run", "b.bag", "--node", "n", "--inputs", "/a", "--report", "memory://r"])
    assert info.value.code == 2
    assert "argument --report: memory://r: memory:// lives inside one process" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["a.bag"],
            "--scenarios s.json names the bags it replays; give no bags with it (not a.bag)",
        ),
        (
            ["--cut", "window"],
            "--scenarios s.json cuts the bags as it lists; --cut window does not",
        ),
    ],
)
def test_bags_or_a_cut_beside_a_scenario_file_are_refused(extra: list[str], says: str) -> None:
    """Bags and ``--cut window`` given with ``--scenarios`` were silently ignored."""
    args = _parse(
        ["sim", "run", "--node", "cat", "--inputs", "/a", "--scenarios", "s.json", *extra]
    )
    with pytest.raises(SimError, match=re.escape(says)):
        command.job_from_args(args)
    args = _parse(["sim", "run", "--node", "cat", "--inputs", "/a", "--scenarios", "s.json"])
    assert command.job_from_args(args).cut.mode is CutMode.FILE


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--window", "5"], "--window cut bags into windows: give --cut window with it"),
        (["--warmup", "1"], "--warmup cut bags into windows: give --cut window with it"),
        (
            ["--cut", "bag", "--window", "5", "--warmup", "1"],
            "--window and --warmup cut bags into windows: give --cut window with them",
        ),
        (["--scenarios", "s.json", "--window", "5"], "(the cut is file)"),
    ],
)
def test_window_options_without_a_window_cut_are_refused(extra: list[str], says: str) -> None:
    """``--window 5`` without ``--cut window`` replayed each bag whole, without a word."""
    bags = [] if "--scenarios" in extra else ["a.bag"]
    args = _parse(["sim", "run", *bags, "--node", "cat", "--inputs", "/a", *extra])
    with pytest.raises(SimError, match=re.escape(says)):
        command.job_from_args(args)
    args = _parse(["sim", "run", "a.bag", "--node", "cat", "--inputs", "/a", "--cut", "window"])
    cut = command.job_from_args(args).cut
    assert (cut.window_s, cut.warmup_s) == (10.0, 0.0)
