"""The replay job on Spark (local[2]), its DataFrame and its report."""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from pyspark.sql import SparkSession

from adcloud.binpipe import ConnectionInfo, Message
from adcloud.sim import (
    ADAPTERS,
    EVALUATORS,
    CutMode,
    Evaluation,
    EvaluatorSpec,
    NodeRun,
    NodeSpec,
    PipeAdapter,
    ReplayJob,
    ReplayResults,
    ReplayTiming,
    ScenarioCut,
    ScenarioData,
    ScenarioResult,
    SimError,
    plan_scenarios,
    read_results,
    register_adapter,
    register_evaluator,
    run_replay,
    write_report,
)
from adcloud.sim import report as report_module
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


class CountAtLeast:
    """A user evaluator defined in this test module (conftest modules cannot be imported on
    the executors under the name the driver gives them): at least ``n`` outputs."""

    truth_topics: tuple[str, ...] = ()

    def __init__(self, n: int) -> None:
        self.name = "count_at_least"
        self.n = n

    def evaluate(self, data: ScenarioData) -> Evaluation:
        count = len(data.in_range(data.outputs))
        return Evaluation(self.name, count >= self.n, {"count": float(count)})


class _EveryOtherPipe(PipeAdapter):
    """A user adapter, defined only here: a pipe node fed every other input."""

    def run(
        self,
        node: NodeSpec,
        inputs: Sequence[Message],
        connections: Sequence[ConnectionInfo],
        output_topics: Sequence[str],
        timing: ReplayTiming,
    ) -> NodeRun:
        return super().run(node, inputs[::2], connections, output_topics, timing)


def test_registered_evaluator_and_adapter_run_on_the_executors(
    spark: SparkSession, drive: DriveResult
) -> None:
    """Spark tasks start with the built-in registries: the driver's registrations travel
    with the job."""
    register_evaluator("count_at_least", CountAtLeast)
    register_adapter("every_other", _EveryOtherPipe)
    try:
        job = ReplayJob(
            bags=(str(drive.bag),),
            node=NodeSpec(OBSTACLE_NODE, adapter="every_other"),
            input_topics=("/lidar/points",),
            output_topics=("/obstacles",),
            evaluators=(EvaluatorSpec.of("count_at_least", n=15),),
        )
        (result,) = run_replay(spark, job).results
    finally:
        del EVALUATORS["count_at_least"]
        del ADAPTERS["every_other"]
    assert result.passed, result.reason
    assert result.adapter == "every_other"
    assert result.output_counts == {"/obstacles": 15}  # 29 clouds, every other one fed
    assert result.metrics == {"count_at_least.count": 15.0}


def test_import_path_names_resolve_on_the_executors(
    spark: SparkSession, drive: DriveResult
) -> None:
    job = ReplayJob(
        bags=(str(drive.bag),),
        node=NodeSpec(OBSTACLE_NODE, adapter="adcloud.sim.adapters:PipeAdapter"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        evaluators=(
            EvaluatorSpec.of("adcloud.sim.evaluators:RateEvaluator", topic="/obstacles", min_hz=8),
        ),
    )
    (result,) = run_replay(spark, job).results
    assert result.passed, result.reason
    assert result.metrics["rate.rate_hz[/obstacles]"] > 8


def test_unpicklable_registration_is_refused_on_the_driver(
    spark: SparkSession, drive: DriveResult
) -> None:
    lock = threading.Lock()

    def locked(n: int) -> CountAtLeast:
        with lock:
            return CountAtLeast(n)

    register_evaluator("locked", locked)
    try:
        job = replace(
            _job((str(drive.bag),), OBSTACLE_NODE), evaluators=(EvaluatorSpec.of("locked", n=1),)
        )
        with pytest.raises(SimError, match=r"'locked' .* cannot be sent to the executors"):
            run_replay(spark, job)
    finally:
        del EVALUATORS["locked"]


def test_results_jsonl_holds_results_only_as_documented(tmp_path: Path) -> None:
    result = ScenarioResult.from_dict(
        {
            "scenario": "s",
            "uri": "x.bag",
            "start": 0,
            "end": 1,
            "passed": True,
            "reason": "",
            "metrics": {},
            "evaluations": [],
            "input_count": 1,
            "output_counts": {"/o": 1},
            "latency_p50_ms": None,
            "latency_p95_ms": None,
            "latency_max_ms": None,
            "startup_ms": None,
            "wall_s": 0.5,
            "exit_code": 0,
            "stderr_tail": "",
            "adapter": "pipe",
        }
    )
    job = ReplayJob(("x.bag",), NodeSpec("node"), ("/i",), ("/o",))
    write_report(ReplayResults(job, (result, result), 1.0), str(tmp_path))
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [ScenarioResult.from_dict(json.loads(line)) for line in lines] == [result, result]
    meta = json.loads((tmp_path / "job.json").read_text())
    assert meta["report_version"] == report_module.REPORT_VERSION
    doc = " ".join((report_module.__doc__ or "").split())
    assert '"format"' not in doc
    assert "its format version is ``report_version`` in ``job.json``" in doc


def test_the_job_written_with_a_report_hides_credentials_of_the_node_environment() -> None:
    """``job.json`` goes with the report (shared, archived by CI): it held the node's whole
    environment, an ``AWS_SECRET_ACCESS_KEY`` or a model registry token included."""
    env = {
        "AWS_SECRET_ACCESS_KEY": "abc/xyz",
        "REGISTRY_TOKEN": "t0k3n",
        "DB_PASSWORD": "pw",
        "MODEL_PATH": "/models/det.onnx",
    }
    job = ReplayJob(
        bags=("d.bag",),
        node=NodeSpec("python -m det", env=tuple(env.items())),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
    )
    written = dict(json.loads(json.dumps(job.to_dict()))["node"]["env"])
    assert written == {
        "AWS_SECRET_ACCESS_KEY": "<hidden>",
        "REGISTRY_TOKEN": "<hidden>",
        "DB_PASSWORD": "<hidden>",
        "MODEL_PATH": "/models/det.onnx",
    }
    assert job.node.env == tuple(env.items())  # the run itself gets them all
