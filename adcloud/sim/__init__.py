"""Replay simulation: recorded drives fed to a node under test on many executors at once.

- :mod:`~adcloud.sim.scenario` -- cutting bags into scenarios (whole bags, windows with
  warm-up, scenario files);
- :mod:`~adcloud.sim.adapters` -- node adapters (``pipe``: BinPipe on stdin/stdout;
  ``ros1``: a real ROS 1 node on a private roscore, through a rospy bridge);
- :mod:`~adcloud.sim.evaluators` -- what makes a scenario pass (rate, latency, detections
  and poses against the truth in the bag); user-extensible;
- :mod:`~adcloud.sim.replay` -- the Spark job (:func:`run_replay`) and one scenario
  without Spark (:func:`run_scenario`);
- :mod:`~adcloud.sim.perception` -- camera streams at frame rate into a detector
  (frame loss, throughput, latency) and how many cameras it sustains;
- :mod:`~adcloud.sim.report` -- ``results.jsonl``, JUnit XML and an HTML summary;
- :mod:`~adcloud.sim.command` -- ``adcloud sim run``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adcloud._lazy import lazy_exports

if TYPE_CHECKING:
    from adcloud.sim.adapters import (
        ADAPTERS,
        ROS_INSTALL_HINT,
        NodeAdapter,
        NodeRun,
        NodeSpec,
        PipeAdapter,
        ReplayTiming,
        Ros1Adapter,
        get_adapter,
        register_adapter,
    )
    from adcloud.sim.errors import SimError
    from adcloud.sim.evaluators import (
        EVALUATORS,
        Evaluation,
        Evaluator,
        EvaluatorSpec,
        ScenarioData,
        build_evaluator,
        parse_evaluator,
        register_evaluator,
    )
    from adcloud.sim.perception import CameraLoad, CameraSweep, camera_replay_job, camera_sweep
    from adcloud.sim.replay import (
        ReplayJob,
        ReplayResults,
        ScenarioResult,
        run_replay,
        run_scenario,
    )
    from adcloud.sim.report import read_results, write_report
    from adcloud.sim.scenario import (
        CutMode,
        Scenario,
        ScenarioCut,
        plan_scenarios,
        read_scenario_file,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "adapters": (
            "ADAPTERS",
            "ROS_INSTALL_HINT",
            "NodeAdapter",
            "NodeRun",
            "NodeSpec",
            "PipeAdapter",
            "ReplayTiming",
            "Ros1Adapter",
            "get_adapter",
            "register_adapter",
        ),
        "errors": ("SimError",),
        "evaluators": (
            "EVALUATORS",
            "Evaluation",
            "Evaluator",
            "EvaluatorSpec",
            "ScenarioData",
            "build_evaluator",
            "parse_evaluator",
            "register_evaluator",
        ),
        "perception": ("CameraLoad", "CameraSweep", "camera_replay_job", "camera_sweep"),
        "replay": ("ReplayJob", "ReplayResults", "ScenarioResult", "run_replay", "run_scenario"),
        "report": ("read_results", "write_report"),
        "scenario": (
            "CutMode",
            "Scenario",
            "ScenarioCut",
            "plan_scenarios",
            "read_scenario_file",
        ),
    },
)

__all__ = [
    "ADAPTERS",
    "EVALUATORS",
    "ROS_INSTALL_HINT",
    "CameraLoad",
    "CameraSweep",
    "CutMode",
    "Evaluation",
    "Evaluator",
    "EvaluatorSpec",
    "NodeAdapter",
    "NodeRun",
    "NodeSpec",
    "PipeAdapter",
    "ReplayJob",
    "ReplayResults",
    "ReplayTiming",
    "Ros1Adapter",
    "Scenario",
    "ScenarioCut",
    "ScenarioData",
    "ScenarioResult",
    "SimError",
    "build_evaluator",
    "camera_replay_job",
    "camera_sweep",
    "get_adapter",
    "parse_evaluator",
    "plan_scenarios",
    "read_results",
    "read_scenario_file",
    "register_adapter",
    "register_evaluator",
    "run_replay",
    "run_scenario",
    "write_report",
]
