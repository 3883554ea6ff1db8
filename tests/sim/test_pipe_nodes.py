"""Pipe nodes that end the replay early (a node must read all of its input); timing
settings that cannot be meant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from adcloud.binpipe.codec import Message
from adcloud.binpipe.decode import ConnectionInfo
from adcloud.sim import NodeSpec, ReplayJob, ReplayTiming, SimError, plan_scenarios, run_scenario
from adcloud.sim.adapters import PipeAdapter
from adcloud.synth import DriveResult

_QUITTER = """
import sys
from adcloud.binpipe.codec import BlockKind, StreamReader, StreamWriter
writer = StreamWriter(sys.stdout.buffer)
seen = 0
for block in StreamReader(sys.stdin.buffer):
    if block.kind == BlockKind.DATA:
        seen += block.n_records
    if seen >= 5:
        break  # gives up quietly, with a valid (empty) output stream
writer.close()
sys.stdout.flush()
"""


def test_a_pipe_node_that_stops_reading_and_exits_0_fails(
    drive: DriveResult, tmp_path: Path
) -> None:
    node = tmp_path / "quitter.py"
    node.write_text(_QUITTER)
    job = ReplayJob(
        bags=(str(drive.bag),),
        node=NodeSpec(f"{sys.executable} {node}"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
        # it never answers: the first input waits out the start-up limit (20 s by default)
        timing=ReplayTiming(startup_timeout_s=1),
    ).validate()
    (scenario,) = plan_scenarios(list(job.bags), job.cut)
    result = run_scenario(scenario, job)
    assert not result.passed
    assert "stopped reading its input before its end (exit code 0)" in result.reason


@pytest.mark.parametrize(
    ("timing", "says"),
    [
        ({"rate": float("nan")}, "rate must be >= 0"),
        ({"rate": float("inf")}, "rate must be >= 0"),
        ({"rate": -1.0}, "rate must be >= 0"),
        ({"quiet_s": float("nan")}, "quiet_s must be >= 0"),
        ({"timeout_s": float("nan")}, "timeout_s must be > 0"),
        # a thread cannot wait that long: the limit would overflow in the task, not hold
        ({"timeout_s": float("inf")}, r"timeout_s must be > 0 and at most 9223372036 .*inf"),
        ({"startup_timeout_s": 1e12}, r"startup_timeout_s must be > 0 and at most 9223372036"),
        ({"quiet_s": float("inf")}, r"quiet_s must be >= 0 and at most 9223372036"),
    ],
)
def test_replay_timing_refuses_what_it_cannot_mean(timing: dict[str, float], says: str) -> None:
    with pytest.raises(SimError, match=says):
        ReplayTiming(**timing).validate()  # type: ignore[arg-type]


def test_python_in_a_node_command_is_the_task_s_python(
    drive: DriveResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Executors on a cluster run the virtual environment's Python by its path, without its
    directory on PATH: the README's ``--node "python -m adcloud.sim.examples.obstacle_node"``
    then started the system Python, which has no adcloud, and every scenario failed."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    job = ReplayJob(
        bags=(str(drive.bag),),
        node=NodeSpec("python -m adcloud.sim.examples.obstacle_node"),
        input_topics=("/lidar/points",),
        output_topics=("/obstacles",),
    ).validate()
    (scenario,) = plan_scenarios(list(job.bags), job.cut)
    result = run_scenario(scenario, job)
    assert result.passed, (result.reason, result.stderr_tail)
    assert result.output_counts == {"/obstacles": 29}


# Per input: a status message at once, then the answer after 0.1 s of CPU, saying whether
# the next input was already waiting on stdin then (the feeder sent it before the answer).
_STATUS_FIRST = """
import select, sys, time
from adcloud.binpipe.codec import BlockKind, StreamReader, StreamWriter, as_message
writer = StreamWriter(sys.stdout.buffer)
for block in StreamReader(sys.stdin.buffer):
    if block.kind != BlockKind.DATA:
        continue
    for rec in block:
        stamp = as_message(rec).timestamp
        writer.write(("/status", stamp, "std_msgs/msg/String", b"working"))
        writer.flush_block()
        sys.stdout.flush()
        spent = time.process_time() + 0.1
        while time.process_time() < spent:
            pass
        waiting = bool(select.select([sys.stdin], [], [], 0)[0])
        writer.write(("/obstacles", stamp, "std_msgs/msg/String", b"late" if waiting else b"ok"))
        writer.flush_block()
        sys.stdout.flush()
writer.close()
"""


def test_only_the_answer_topics_end_a_synchronous_wait(tmp_path: Path) -> None:
    """A node that writes a status message before each answer: with every output ending
    the wait, the next input is sent while the node still computes; with the answer topic
    named, only after its answer."""
    node = tmp_path / "status_first.py"
    node.write_text(_STATUS_FIRST)
    inputs = [Message("/in", 10**9 * (i + 1), "std_msgs/msg/String", b"x") for i in range(8)]
    connections = [ConnectionInfo("/in", "std_msgs/msg/String", "", "", "", "ros1")]
    outputs = ("/status", "/obstacles")

    def answers(timing: ReplayTiming) -> list[bytes]:
        run = PipeAdapter().run(
            NodeSpec(f"{sys.executable} {node}"), inputs, connections, outputs, timing
        )
        assert run.failure is None, (run.failure, run.stderr_tail)
        return [bytes(m.data) for m in run.outputs if m.topic == "/obstacles"]

    named = answers(ReplayTiming(answer_topics=("/obstacles",), quiet_s=5.0))
    assert named == [b"ok"] * 8
    # every input but the last (after which the stream's end is sent) was early
    assert answers(ReplayTiming(quiet_s=5.0))[:-1] == [b"late"] * 7
