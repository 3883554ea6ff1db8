"""The replay report on hand-made results: strict JSON, well-formed JUnit XML, any scenario
name, and a directory replaced as a whole or not at all."""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest

from adcloud.sim import (
    EvaluatorSpec,
    NodeSpec,
    ReplayJob,
    ReplayResults,
    ScenarioResult,
    SimError,
    read_results,
    write_report,
)
from adcloud.sim import report as report_module
from adcloud.sim.report import check_report_target, junit_xml
from adcloud.store import locate

_FILES = ["job.json", "junit.xml", "latency.png", "report.html", "results.jsonl"]

_JOB = ReplayJob(
    ("x.bag",),
    NodeSpec("node"),
    ("/i",),
    ("/o",),
    evaluators=(EvaluatorSpec.of("latency", max_ms=math.inf),),
)


def _result(name: str = "s", **changes: Any) -> ScenarioResult:
    result = ScenarioResult(
        scenario=name,
        uri="x.bag",
        start=0,
        end=1,
        passed=True,
        reason="",
        metrics={"frames.loss_rate": 0.0},
        evaluations=[
            {"name": "frames", "passed": True, "metrics": {"loss_rate": 0.0}, "reason": ""}
        ],
        input_count=1,
        output_counts={"/o": 1},
        latency_p50_ms=1.0,
        latency_p95_ms=2.0,
        latency_max_ms=3.0,
        startup_ms=4.0,
        wall_s=0.5,
        exit_code=0,
        stderr_tail="",
        adapter="pipe",
    )
    return replace(result, **changes)


def _strict(text: str) -> Any:
    """``json.loads`` refusing NaN and Infinity, as jq, browsers and Java do."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _files(url: str) -> dict[str, bytes]:
    store, root = locate(url)
    return {s.path.rsplit("/", 1)[1]: store.get(s.path) for s in store.list(root)}


def test_json_files_hold_no_nan_or_infinity(tmp_path: Path) -> None:
    """NaN metrics of the evaluations too (the frames evaluator's latency without any
    answered frame) and an infinite evaluator parameter are written as null."""
    frames = {"latency_p50_ms": math.nan, "throughput_fps": math.inf, "loss_rate": 1.0}
    result = _result(
        passed=False,
        metrics={"frames.latency_p50_ms": math.nan, "frames.loss_rate": 1.0},
        evaluations=[{"name": "frames", "passed": False, "metrics": frames, "reason": "loss"}],
        latency_p50_ms=math.nan,
        startup_ms=math.inf,
    )
    write_report(ReplayResults(_JOB, (result,), math.nan), str(tmp_path))
    (line,) = (tmp_path / "results.jsonl").read_text().splitlines()
    data = _strict(line)
    assert data["evaluations"][0]["metrics"] == {
        "latency_p50_ms": None,
        "throughput_fps": None,
        "loss_rate": 1.0,
    }
    assert data["metrics"]["frames.latency_p50_ms"] is None
    assert data["startup_ms"] is None
    job = _strict((tmp_path / "job.json").read_text())
    assert job["wall_s"] is None
    assert job["job"]["evaluators"] == [{"name": "latency", "params": {"max_ms": None}}]
    (back,) = read_results(str(tmp_path))  # null metrics are NaN again, as in the result
    assert math.isnan(back.evaluations[0]["metrics"]["latency_p50_ms"])
    assert math.isnan(back.evaluations[0]["metrics"]["throughput_fps"])
    assert back.evaluations[0]["metrics"]["loss_rate"] == 1.0


def test_junit_xml_is_well_formed_whatever_a_node_writes() -> None:
    """ANSI colours, a bell and a NUL in stderr, control characters in names and reasons:
    XML 1.0 forbids them all, and CI systems reject the whole file for one."""
    result = _result(
        "drive\x0b#0001",
        passed=False,
        reason="exit code 1: \x1b[31mERROR\x1b[0m model\x07 not found",
        metrics={"m\x01": 1.0},
        exit_code=1,
        stderr_tail="\x1b[1;31mERROR\x1b[0m\tcannot load\x00 weights\r\n\ud800",
    )
    suite = ET.fromstring(junit_xml([result], suite="adcloud\x1b.sim"))
    assert suite.get("name") == "adcloud\ufffd.sim"
    case = suite.find("testcase")
    assert case is not None
    assert case.get("name") == "drive\ufffd#0001"
    prop = case.find("properties/property")
    assert prop is not None and prop.get("name") == "m\ufffd"
    failure = case.find("failure")
    assert failure is not None
    assert failure.get("message") == "exit code 1: ERROR model\ufffd not found"
    assert failure.text is not None and "ERROR\tcannot load\ufffd weights" in failure.text
    err = case.find("system-err")
    assert err is not None and err.text == "ERROR\tcannot load\ufffd weights\n\ufffd"


def test_any_scenario_name_plots(tmp_path: Path) -> None:
    """Tick labels are not mathtext: a name with dollar signs is no formula to parse."""
    names = ["cost $\\alpha_$", "$", "a $b$ c", "\\$x"]
    results = tuple(_result(name) for name in names)
    write_report(ReplayResults(_JOB, results, 1.0), str(tmp_path))
    assert [r.scenario for r in read_results(str(tmp_path))] == names
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("scheme", ["file", "memory", "local"])
def test_a_report_failing_midway_leaves_the_earlier_one_whole(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plot fails after results.jsonl and junit.xml are written: the earlier report's
    files are all still there, unchanged, and nothing staged is left behind."""
    for name in list(os.environ):  # local://: this test's own tiered store
        if name.startswith("ADCLOUD_STORE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(tmp_path / "store"))
    url = {
        "file": f"file://{tmp_path}/report",
        "memory": f"memory://report-{uuid.uuid4().hex}/report",
        "local": "local:///sim/report",
    }[scheme]
    write_report(ReplayResults(_JOB, (_result("first"),), 1.0), url)
    before = _files(url)
    assert sorted(before) == _FILES

    def broken_plot(results: object) -> bytes:
        raise RuntimeError("the plot failed")

    real_plot = report_module._plot
    monkeypatch.setattr(report_module, "_plot", broken_plot)
    second = ReplayResults(_JOB, (_result("second", passed=False, reason="r"),), 2.0)
    with pytest.raises(RuntimeError, match="the plot failed"):
        write_report(second, url)
    assert _files(url) == before
    assert [r.scenario for r in read_results(url)] == ["first"]

    with pytest.raises(RuntimeError, match="the plot failed"):
        write_report(second, url + "/new")
    store, root = locate(url)
    assert not store.exists(root + "/new")  # a first report that fails leaves no directory

    monkeypatch.setattr(report_module, "_plot", real_plot)
    write_report(second, url)
    after = _files(url)
    assert sorted(after) == _FILES
    assert [r.scenario for r in read_results(url)] == ["second"]
    assert b"0 of 1 scenarios passed" in after["report.html"]


@pytest.mark.parametrize("name", ["results.jsonl", "victim.bag"])
def test_a_report_target_that_is_a_file_is_refused_before_the_job(
    tmp_path: Path, name: str
) -> None:
    """Named like a report file, it passed the check and the report failed once the job
    had run (``.../results.jsonl/_temporary/...: Not a directory``); named otherwise, it
    was called a directory holding files like itself."""
    target = tmp_path / name
    target.write_text("mine")
    says = rf"{re.escape(name)} is a file, not a directory a replay report can write into"
    with pytest.raises(SimError, match=says):
        check_report_target(str(target))
    with pytest.raises(SimError, match=says):
        write_report(ReplayResults(_JOB, (_result(),), 1.0), str(target))
    assert target.read_text() == "mine"


def test_a_directory_holding_other_files_is_not_replaced(tmp_path: Path) -> None:
    """Replacing a report removes the earlier one's files; a directory that holds other
    files as well (a mistyped --report) is refused before anything is written."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SimError, match=r"holds files a replay report did not write \(e\.g\. "):
        write_report(ReplayResults(_JOB, (_result(),), 1.0), str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_result_that_does_not_read_names_the_file_and_line(tmp_path: Path) -> None:
    write_report(ReplayResults(_JOB, (_result("a"), _result("b")), 1.0), str(tmp_path))
    path = tmp_path / "results.jsonl"
    first, second = path.read_text().splitlines()
    path.write_text(f"{first}\n{second[: len(second) // 2]}\n")  # cut short
    with pytest.raises(SimError, match=r"results\.jsonl line 2 is not a scenario result"):
        read_results(str(tmp_path))
    path.write_text(f'{first}\n{{"scenario": "c"}}\n')  # a hand-edited line
    with pytest.raises(SimError, match=r"results\.jsonl line 2 .*KeyError"):
        read_results(str(tmp_path))


def test_a_results_file_of_other_bytes_than_utf8_names_its_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 (a copy cut inside a character, another encoding) raised
    a bare UnicodeDecodeError without the file or line; and a line holding U+2028 (written
    by a tool that does not escape non-ASCII text) was split in two there."""
    write_report(ReplayResults(_JOB, (_result("a"), _result("b")), 1.0), str(tmp_path))
    path = tmp_path / "results.jsonl"
    first, second = path.read_bytes().splitlines()
    path.write_bytes(first + b"\n" + second.replace(b'"b"', b'"\xe9"') + b"\n")
    with pytest.raises(SimError, match=r"results\.jsonl line 2 is not a scenario result"):
        read_results(str(tmp_path))
    unescaped = json.dumps(_result("left\u2028right").to_dict(), ensure_ascii=False)
    path.write_bytes(first + b"\n" + unescaped.encode("utf-8") + b"\n")
    assert [r.scenario for r in read_results(str(tmp_path))] == ["a", "left\u2028right"]


def test_the_plot_of_thousands_of_scenarios_keeps_a_readable_size(tmp_path: Path) -> None:
    """The plot grew 0.4 inch per scenario: 2,000 windows made a 72,270 px wide PNG in
    ~40 s, and the 100,000 scenarios a plan may have some gigabytes, failing the whole
    report after the job; beyond 80 scenarios they are numbered, not named."""
    from PIL import Image  # noqa: PLC0415 - matplotlib's dependency

    many = tuple(_result(f"drive#{i:04d}") for i in range(2000))
    write_report(ReplayResults(_JOB, many, 1.0), str(tmp_path / "many"))
    with Image.open(tmp_path / "many/latency.png") as png:
        assert png.size[0] <= 0.4 * 80 * 90 + 3 * 90
    few = tuple(_result(f"drive#{i:04d}") for i in range(3))
    write_report(ReplayResults(_JOB, few, 1.0), str(tmp_path / "few"))
    with Image.open(tmp_path / "few/latency.png") as png:
        assert png.size[0] == 6 * 90
