"""The replay job on Spark (local[2]), its DataFrame and its report."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from pyspark.sql import SparkSession

from adcloud.sim import (
    CutMode,
    EvaluatorSpec,
    NodeSpec,
    ReplayJob,
    ReplayTiming,
    ScenarioCut,
    ScenarioResult,
    SimError,
    plan_scenarios,
    read_results,
    run_replay,
    write_report,
)
from adcloud.synth import DriveResult

from .conftest import OBSTACLE_NODE


def _job(bags: tuple[str, ...], command: str, **timing: float) -> ReplayJob:
    return ReplayJob(
        bags=bags,
        node=NodeSpec(command),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        evaluators=(
            EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8),
            EvaluatorSpec.of("detections", topic="/obstacles"),
        ),
        cut=ScenarioCut(CutMode.WINDOW, window_s=1.0, warmup_s=0.3),
        timing=ReplayTiming(**timing),  # type: ignore[arg-type]
    )


def test_one_result_per_scenario(spark: SparkSession, drive: DriveResult, tmp_path: Path) -> None:
    results = run_replay(spark, _job((str(drive.bag),), OBSTACLE_NODE))
    assert [r.scenario for r in results.results] == ["drive#0000", "drive#0001", "drive#0002"]
    assert results.passed, [r.reason for r in results.failed]
    df = results.to_dataframe(spark)
    assert df.count() == 3
    row = df.orderBy("scenario").first()
    assert row is not None
    assert row["passed"] is True
    assert row["metrics"]["detections.recall"] == 1.0
    assert row["output_counts"]["/obstacles"] >= 9

    url = write_report(results, str(tmp_path / "report"))
    assert url.startswith("file://")
    back = read_results(str(tmp_path / "report"))
    assert back == list(results.results)
    lines = (tmp_path / "report" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert json.loads(lines[0])["scenario"] == "drive#0000"
    suite = ET.parse(tmp_path / "report" / "junit.xml").getroot()
    assert suite.get("tests") == "3"
    assert suite.get("failures") == "0"
    page = (tmp_path / "report" / "report.html").read_text()
    assert "3 of 3 scenarios passed" in page
    assert (tmp_path / "report" / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    job = json.loads((tmp_path / "report" / "job.json").read_text())
    assert job["report_version"] == 1
    assert job["job"]["node"]["command"] == OBSTACLE_NODE


def test_crashing_node_fails_scenarios_not_the_job(
    spark: SparkSession, drive: DriveResult, empty_bag: Path, bad_nodes: dict[str, str]
) -> None:
    job = _job((str(drive.bag), str(empty_bag)), bad_nodes["crash"], startup_timeout_s=1)
    results = run_replay(spark, job)
    assert len(results.results) == 4  # 3 windows + the empty bag
    assert not results.passed
    by_name = {r.scenario: r for r in results.results}
    assert by_name["empty"].reason.startswith("no messages")
    for name in ("drive#0000", "drive#0001", "drive#0002"):
        assert by_name[name].exit_code == 3
        assert "boom" in by_name[name].stderr_tail
    report = write_report(results, "memory://sim-report/run1")
    assert report == "memory://sim-report/run1"
    back = read_results("memory://sim-report/run1")
    assert sum(not r.passed for r in back) == 4
    assert math.isnan(back[0].latency_p50_ms)


def test_result_round_trips_through_json() -> None:
    result = ScenarioResult(
        scenario="s",
        uri="x.bag",
        start=1,
        end=2,
        passed=False,
        reason="r",
        metrics={"a.b": math.nan, "c.d": 1.5},
        evaluations=[],
        input_count=0,
        output_counts={},
        latency_p50_ms=math.nan,
        latency_p95_ms=1.0,
        latency_max_ms=2.0,
        startup_ms=math.nan,
        wall_s=0.1,
        exit_code=None,
        stderr_tail="",
        adapter="pipe",
    )
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    back = ScenarioResult.from_dict(data)
    assert math.isnan(back.metrics["a.b"])
    assert back.latency_p95_ms == 1.0


def test_no_scenario(spark: SparkSession, tmp_path: Path) -> None:
    (tmp_path / "x.bag").write_bytes(b"")
    with pytest.raises(SimError):
        run_replay(spark, _job((str(tmp_path / "missing.bag"),), OBSTACLE_NODE))


def test_infrastructure_failure_fails_the_task(
    spark: SparkSession, drive: DriveResult, tmp_path: Path
) -> None:
    """An unreadable bag is not a failed scenario: the task raises (Spark retries it)."""
    bag = tmp_path / "gone.bag"
    shutil.copy(drive.bag, bag)
    job = _job((str(bag),), OBSTACLE_NODE)
    scenarios = plan_scenarios(str(bag), job.cut)
    bag.write_bytes(b"#ROSBAG V2.0\n" + b"\0" * 64)  # truncated after planning
    with pytest.raises(Exception, match=r"(?s)gone\.bag"):
        run_replay(spark, job, scenarios)


def test_on_a_standalone_cluster(cluster_spark: SparkSession, drive: DriveResult) -> None:
    results = run_replay(cluster_spark, _job((str(drive.bag),), OBSTACLE_NODE))
    assert len(results.results) == 3
    assert results.passed, [r.reason for r in results.failed]
