"""The ros1 adapter with a real roscore: the example rospy node, topic_tools/relay, failures."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import xmlrpc.client
from dataclasses import replace
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest

from adcloud.sim import (
    EvaluatorSpec,
    NodeSpec,
    ReplayJob,
    ReplayTiming,
    adapters,
    plan_scenarios,
    run_scenario,
)
from adcloud.sim.adapters import SYSTEM_PYTHON
from adcloud.sim.report import junit_xml
from adcloud.synth import DriveResult

pytestmark = [
    pytest.mark.ros,
    pytest.mark.skipif(shutil.which("roscore") is None, reason="ROS 1 (roscore) is not installed"),
]

_EXAMPLE = Path(__file__).resolve().parents[2] / "adcloud/sim/examples/obstacle_ros_node.py"
ROS_NODE = f"{SYSTEM_PYTHON} {_EXAMPLE}"
RELAY = "/usr/lib/topic_tools/relay"


def _job(
    bag: Path, command: str, outputs: tuple[str, ...], *evals: EvaluatorSpec, **timing: float
) -> ReplayJob:
    return ReplayJob(
        bags=(str(bag),),
        node=NodeSpec(command, adapter="ros1"),
        input_topics=("/lidar/points",),
        output_topics=outputs,
        evaluators=evals,
        timing=ReplayTiming(**timing),  # type: ignore[arg-type]
    ).validate()


def _run(job: ReplayJob) -> object:
    (scenario,) = plan_scenarios(list(job.bags), job.cut)
    return run_scenario(scenario, job)


class _Recorder:
    """Records every process the adapter starts (roscore, node, bridge)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        real = subprocess.Popen
        recorder = self

        class Popen(real):  # type: ignore[valid-type,misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                recorder.procs.append(self)

        monkeypatch.setattr(adapters.subprocess, "Popen", Popen)

    def all_gone(self) -> bool:
        """Every recorded process has exited and its process group is empty."""
        for proc in self.procs:
            if proc.poll() is None:
                return False
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                return False
            return False
        return True


DETECT = (
    EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8),
    EvaluatorSpec.of("detections", topic="/obstacles", min_precision=0.95, min_recall=0.95),
)


def test_rospy_example_node(drive: DriveResult, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = _Recorder(monkeypatch)
    result = _run(_job(drive.bag, ROS_NODE, ("/obstacles",), *DETECT))
    assert result.passed, (result.reason, result.stderr_tail)
    assert result.output_counts == {"/obstacles": 29}
    assert result.metrics["detections.recall"] == 1.0
    assert result.adapter == "ros1"
    assert len(recorder.procs) >= 3  # roscore, the node and the bridge
    assert recorder.all_gone()  # roscore and node torn down, process groups included


def test_same_results_at_real_time_and_as_fast_as_possible(drive: DriveResult) -> None:
    fast = _run(_job(drive.bag, ROS_NODE, ("/obstacles",), *DETECT, rate=0.0))
    paced = _run(_job(drive.bag, ROS_NODE, ("/obstacles",), *DETECT, rate=1.0))
    assert fast.output_counts == paced.output_counts == {"/obstacles": 29}
    for key in ("detections.precision", "detections.recall", "detections.truth_objects"):
        assert fast.metrics[key] == paced.metrics[key]


def test_a_node_slower_than_the_quiet_period_is_waited_for(drive: DriveResult) -> None:
    """Synchronous mode waits for a node that is still computing (0.15 s of CPU per cloud,
    five times the quiet period): every output keeps the time of the cloud it answers, at
    both replay rates, as on a fast machine."""
    slow = f"{ROS_NODE} _busy_s:=0.15"
    fast = _run(_job(drive.bag, ROS_NODE, ("/obstacles",), *DETECT, rate=0.0))
    for rate in (0.0, 1.0):
        result = _run(_job(drive.bag, slow, ("/obstacles",), *DETECT, rate=rate, quiet_s=0.03))
        assert result.passed, (result.reason, result.stderr_tail)
        assert result.output_counts == {"/obstacles": 29}
        for key in ("detections.precision", "detections.recall"):
            assert result.metrics[key] == fast.metrics[key] == 1.0


def test_a_node_publishing_on_a_wall_clock_timer_ends_with_the_input(drive: DriveResult) -> None:
    """A node that also republishes its latest detections ten times a wall-clock second is
    never quiet: the replay used to wait for its outputs to stop until the time limit and
    fail every scenario. It ends when the node is idle after the last input, with every
    answer kept; in synchronous mode, with the answer topic named, a timer's message does
    not end an input's wait before its answer (which would then be stamped later)."""
    beating = f"{ROS_NODE} _heartbeat_hz:=10"
    outputs = ("/obstacles", "/obstacles/latest")
    without_waits = _run(_job(drive.bag, beating, outputs, sync=False, timeout_s=60))
    synced = _run(
        replace(
            _job(drive.bag, beating, outputs, *DETECT, timeout_s=60),
            timing=ReplayTiming(answer_topics=("/obstacles",), timeout_s=60),
        )
    )
    for result in (without_waits, synced):
        assert result.passed, (result.reason, result.stderr_tail)
        assert result.output_counts["/obstacles"] == 29
        assert result.output_counts["/obstacles/latest"] > 0
    for key in ("detections.precision", "detections.recall"):
        assert synced.metrics[key] == 1.0


@pytest.mark.skipif(not Path(RELAY).exists(), reason="topic_tools is not installed")
def test_relay_node_nobody_here_wrote(drive: DriveResult) -> None:
    job = _job(
        drive.bag,
        f"{RELAY} /lidar/points /relayed",
        ("/relayed",),
        EvaluatorSpec.of("rate", topic="/relayed", min_hz=8),
    )
    result = _run(job)
    assert result.passed, (result.reason, result.stderr_tail)
    # relay advertises its output when the first message arrives, so that one is lost.
    assert result.output_counts["/relayed"] in (28, 29)


@pytest.mark.skipif(not Path(RELAY).exists(), reason="topic_tools is not installed")
def test_a_node_publishing_on_another_topic_is_told_which(drive: DriveResult) -> None:
    """A node answering on /relayed while --outputs says /obstacles was reported only as
    "0.00 Hz": the reason names the topics it published, read from the private roscore."""
    job = _job(
        drive.bag,
        f"{RELAY} /lidar/points /relayed",
        ("/obstacles",),
        EvaluatorSpec.of("rate", topic="/obstacles", min_hz=8),
        quiet_s=0.05,
    )
    result = _run(job)
    assert not result.passed
    assert result.reason.startswith("rate: /obstacles at 0.00 Hz < 8 Hz; ")
    assert "published on /relayed (sensor_msgs/PointCloud2)" in result.reason
    assert "output topics (/obstacles)" in result.reason
    # the bridge's own topics and the log are not the node's answers
    for topic in ("/clock", "/lidar/points", "/rosout"):
        assert f"{topic} (" not in result.reason


@pytest.mark.skipif(not Path(RELAY).exists(), reason="topic_tools is not installed")
def test_an_input_topic_that_is_also_an_output_gives_the_nodes_messages_only(
    drive: DriveResult,
) -> None:
    """A topic both fed and answered on (/tf in, /tf out): the bridge subscribed to its own
    publications and wrote every input back as an output of the node -- which also ended
    each synchronous wait before the node had answered."""
    job = _job(drive.bag, f"{RELAY} /lidar/points /relayed", ("/lidar/points", "/relayed"))
    result = _run(job)
    assert result.passed, (result.reason, result.stderr_tail)
    assert "/lidar/points" not in result.output_counts
    assert result.output_counts["/relayed"] in (28, 29)


def test_node_crash_is_a_failed_scenario(drive: DriveResult) -> None:
    result = _run(
        _job(drive.bag, ROS_NODE + " _crash_after:=3", ("/obstacles",), *DETECT, quiet_s=0.05)
    )
    assert not result.passed
    assert result.exit_code == 3
    assert "crashing on purpose" in result.stderr_tail
    assert "exited with code 3" in result.reason


def test_node_that_never_subscribes(drive: DriveResult, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(
        drive.bag,
        f"{sys.executable} -c 'import time; time.sleep(60)'",
        ("/obstacles",),
        startup_timeout_s=2,
    )
    recorder = _Recorder(monkeypatch)
    result = _run(job)
    assert not result.passed
    assert "no node subscribed to /lidar/points" in result.stderr_tail
    assert result.reason == "no node subscribed to /lidar/points within 2.0 s"
    assert result.exit_code is None  # the node was still running: stopped, not the bridge's 1
    assert recorder.all_gone()


def test_a_start_up_limit_shorter_than_roscores_start_fails_the_node_not_the_job(
    drive: DriveResult,
) -> None:
    """The node's start-up limit was roscore's too: roscore takes longer than 0.3 s to
    answer, so the run raised (a failed task, and after retries a failed job) instead of
    failing the node that did not subscribe in time."""
    job = _job(
        drive.bag,
        f"{sys.executable} -c 'import time; time.sleep(60)'",
        ("/obstacles",),
        startup_timeout_s=0.3,
    )
    result = _run(job)
    assert not result.passed
    assert result.reason == "no node subscribed to /lidar/points within 0.3 s"


def test_a_node_over_the_time_limit_is_named_and_has_no_exit_code(drive: DriveResult) -> None:
    """The reason named the bridge's command line (``command "/usr/bin/python3
    .../_ros1_bridge.py --inputs ..." timed out``) and exit_code was the bridge's; JUnit
    showed "exit code: 1" for a node that was stopped."""
    node = f"{sys.executable} -c 'import time; time.sleep(60)'"
    job = _job(drive.bag, node, ("/obstacles",), startup_timeout_s=60.0, timeout_s=3.0)
    result = _run(job)
    assert not result.passed
    assert result.reason == f"node {node!r} timed out after 3.0 s"
    assert result.exit_code is None
    failure = ET.fromstring(junit_xml([result])).find("testcase/failure")
    assert failure is not None and "exit code: None" in (failure.text or "")


def test_a_node_that_exits_0_before_subscribing_has_its_own_exit_code(
    drive: DriveResult,
) -> None:
    job = _job(drive.bag, "bash -c 'exit 0'", ("/obstacles",), startup_timeout_s=120.0)
    result = _run(job)
    assert not result.passed
    assert result.reason == "the node exited before it subscribed to /lidar/points"
    assert result.exit_code == 0  # the node's, not the bridge's 1


_QUITTER = """
import os, rospy
rospy.init_node("quitter")
seen = []
def got(msg):
    seen.append(msg)
    if len(seen) == 3:
        os._exit(0)  # gives up quietly, mid-replay
rospy.Subscriber("/lidar/points", rospy.AnyMsg, got)
rospy.spin()
"""


def test_a_node_that_exits_0_midway_fails(drive: DriveResult, tmp_path: Path) -> None:
    """The replay used to go on feeding the dead node, a quiet period (bridge and feeder
    each) per input left: 29 of 29 inputs sent, for nothing."""
    node = tmp_path / "quitter.py"
    node.write_text(_QUITTER)
    result = _run(_job(drive.bag, f"{SYSTEM_PYTHON} {node}", ("/obstacles",), quiet_s=0.5))
    assert not result.passed and result.exit_code == 0
    said = re.fullmatch(
        r"node '.*quitter.py' exited \(code 0\) before the replay ended "
        r"\((\d+) of 29 inputs sent, 0 outputs received\)",
        result.reason,
    )
    assert said is not None, result.reason
    assert int(said[1]) <= 4


def test_a_node_that_dies_before_subscribing_fails_at_once(drive: DriveResult) -> None:
    # a startup timeout far longer than the run may take: the bridge sees the node's
    # process group gone and stops waiting for it to subscribe
    job = _job(
        drive.bag,
        "bash -c 'echo no licence for this detector >&2; exit 7'",
        ("/obstacles",),
        startup_timeout_s=120,
    )
    started = time.monotonic()
    result = _run(job)
    assert time.monotonic() - started < 60
    assert not result.passed and result.exit_code == 7
    assert result.reason.endswith("exited with code 7: no licence for this detector")


def test_missing_node_program(drive: DriveResult, tmp_path: Path) -> None:
    result = _run(_job(drive.bag, str(tmp_path / "nope"), ("/obstacles",)))
    assert not result.passed
    assert "cannot start" in result.reason


@pytest.mark.skipif(not Path(RELAY).exists(), reason="topic_tools is not installed")
def test_a_relative_node_program_is_found_in_the_nodes_directory(
    drive: DriveResult, tmp_path: Path
) -> None:
    """``./relay.sh`` with ``cwd`` was looked for in the task's working directory and
    refused as "no such program", where the pipe adapter starts it."""
    script = tmp_path / "relay.sh"
    script.write_text(f"#!/bin/sh\nexec {RELAY} /lidar/points /relayed\n")
    script.chmod(0o755)
    job = _job(drive.bag, "./relay.sh", ("/relayed",))
    job = replace(job, node=replace(job.node, cwd=str(tmp_path)))
    result = _run(job)
    assert result.passed, (result.reason, result.stderr_tail)
    assert result.output_counts["/relayed"] in (28, 29)
    gone = replace(job, node=replace(job.node, cwd=str(tmp_path / "gone")))
    result = _run(gone)
    assert not result.passed
    assert result.reason == (
        f"cannot start './relay.sh': its working directory {str(tmp_path / 'gone')!r} "
        "is no directory"
    )


def _own_roscore(tmp_path: Path) -> tuple[int, subprocess.Popen[bytes], Any]:
    """A roscore of the test's own on a free port: (port, process, master proxy).  Another
    process may take the port first (a node's or a launcher's XML-RPC server of a test
    running beside this one, answering faults): roscore then fails, and another port is
    tried."""
    for _ in range(3):
        port = adapters._free_port()
        env = adapters._ros_env(tmp_path, port, ())
        proc = subprocess.Popen(
            ["roscore", "-p", str(port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        master = xmlrpc.client.ServerProxy(env["ROS_MASTER_URI"])
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if master.getPid("/test")[0] == 1:
                    return port, proc, master
            except (OSError, xmlrpc.client.Fault):
                pass  # not up yet, or not a master at all
            time.sleep(0.1)
        adapters._stop_group(proc)
    pytest.fail("no roscore of the test's own started on 3 free ports")


def test_a_port_another_master_took_is_given_up_for_another(
    drive: DriveResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port picked for a run's roscore can be taken before roscore binds it (another
    run on the same host): the run must notice the foreign master, leave it alone, and
    use a master of its own."""
    port, other, master = _own_roscore(tmp_path)
    try:
        picks = iter([port])  # the first pick collides, later ones are free
        real = adapters._free_port
        monkeypatch.setattr(adapters, "_free_port", lambda: next(picks, 0) or real())
        result = _run(_job(drive.bag, ROS_NODE, ("/obstacles",), *DETECT))
        assert result.passed, (result.reason, result.stderr_tail)
        assert result.output_counts == {"/obstacles": 29}
        assert other.poll() is None  # the other run's master is untouched
        # ... and saw nothing of it: the run sets /use_sim_time on its own master
        assert master.hasParam("/test", "/use_sim_time")[2] is False
    finally:
        adapters._stop_group(other)


def test_a_ros2_bag_is_a_failed_scenario_not_a_failed_job(mcap_drive: DriveResult) -> None:
    """A ROS 2 bag among the job's bags raised on the executor: the task failed, and with it
    the whole job and the results of every ROS 1 bag, after retries that could not help."""
    result = _run(_job(mcap_drive.bag, f"{RELAY} /lidar/points /relayed", ("/relayed",)))
    assert not result.passed
    assert result.reason == (
        "the ros1 adapter replays ROS 1 messages; /lidar/points are not ROS 1 serialized "
        "(ROS 2 bags need a ROS 2 adapter)"
    )
    assert result.exit_code is None


_LATE_PUBLISHER = """
import runpy, sys, time
from rospy.impl import tcpros_pubsub
accept = tcpros_pubsub.TCPROSHandler.topic_connection_handler
def late(self, sock, client_addr, header):
    time.sleep(1.5)  # a loaded machine: the subscriber's connection comes up late
    return accept(self, sock, client_addr, header)
tcpros_pubsub.TCPROSHandler.topic_connection_handler = late
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_first_answer_is_not_lost_to_a_connection_still_coming_up(
    drive: DriveResult, tmp_path: Path
) -> None:
    """rospy counts a subscriber's connection as soon as the publisher node agreed to it,
    before the TCP connection is up: the bridge fed the first cloud while the node's
    publisher had nobody to send its answer to, and 28 of 29 answers came back (on a loaded
    machine only, where the connection takes long to come up)."""
    node = tmp_path / "late_publisher.py"
    node.write_text(_LATE_PUBLISHER)
    result = _run(_job(drive.bag, f"{SYSTEM_PYTHON} {node} {_EXAMPLE}", ("/obstacles",), *DETECT))
    assert result.passed, (result.reason, result.stderr_tail)
    assert result.output_counts == {"/obstacles": 29}
