"""Drives and misbehaving nodes shared by the sim tests (session scope), and a check that
no replay process (ROS master, rosout, the bridge, the reaper) outlives the tests."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from rosbags.rosbag1 import Writer

from adcloud.sim import Evaluation, ScenarioData
from adcloud.synth import DriveConfig, DriveResult
from tests.drives import shared_drive

#: A 3 s drive: 16-beam LiDAR at 10 Hz (29 clouds), no camera, no raster.
DRIVE = DriveConfig(seconds=3.0, seed=5, lidar_beams=16, camera=False, truth_raster=False)

#: The example pipe node, as a command.
OBSTACLE_NODE = f"{sys.executable} -m adcloud.sim.examples.obstacle_node"

_NODES = {
    # Exits with status 3 before reading anything, saying why on stderr.
    "crash.py": """
        import sys
        sys.stderr.write("boom: the detector crashed\\n")
        sys.exit(3)
    """,
    # Processes two clouds, then dies.
    "crash_later.py": """
        import os, sys
        from adcloud.binpipe.node import run_node
        seen = []
        def fn(msg):
            seen.append(msg)
            if len(seen) == 3:
                sys.stderr.write("dying after 2 messages\\n")
                sys.stderr.flush()
                os._exit(5)
            return ("/obstacles", msg.timestamp, "std_msgs/msg/String", b"\\0\\0\\0\\0")
        run_node(fn)
    """,
    # Never answers.
    "hang.py": """
        import time
        time.sleep(3600)
    """,
    # Writes text instead of a BinPipe stream.
    "garbage.py": """
        import sys
        sys.stdout.write("detections: 3 cars, 2 poles\\n" * 20)
        sys.stdout.flush()
        sys.stdin.buffer.read()
    """,
    # Republishes one input topic (argv[1]) as /estimate: a "localizer" for pose_error.
    "relay_pose.py": """
        import sys
        from adcloud.binpipe.node import run_node
        source = sys.argv[1]
        def fn(msg):
            if msg.topic == source:
                return ("/estimate", msg.timestamp, msg.msgtype, msg.data)
            return None
        run_node(fn)
    """,
    # Answers every message, after 0.2 s of CPU work each (a heavy detector).
    "slow.py": """
        import time
        from adcloud.binpipe.node import run_node
        def fn(msg):
            until = time.process_time() + 0.2
            while time.process_time() < until:
                pass
            return ("/obstacles", msg.timestamp, "std_msgs/msg/String", b"\\0\\0\\0\\0")
        run_node(fn)
    """,
    # Answers each message at once, stamped with the time of the next cloud (100 ms on):
    # an output from the future, as a node whose clock runs ahead writes.
    "stamps_ahead.py": """
        from adcloud.binpipe.node import run_node
        def fn(msg):
            return ("/obstacles", msg.timestamp + 100_000_000, "std_msgs/msg/String", b"\\0" * 4)
        run_node(fn)
    """,
    # Answers each message, printing a debug line on stdout first (into its stream).
    "prints.py": """
        from adcloud.binpipe.node import run_node
        def fn(msg):
            print("debug: got", msg.topic, flush=True)
            return ("/obstacles", msg.timestamp, "std_msgs/msg/String", b"\\0" * 4)
        run_node(fn)
    """,
    # A valid stream whose records are not messages.
    "not_messages.py": """
        from adcloud.binpipe.node import run_node
        run_node(lambda msg: (1, 2.5))
    """,
}


def _stat(pid: str) -> list[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent, ...)."""
    return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()


def _orphaned_replay_processes(since: int) -> dict[int, str]:
    """Processes of replay runs that outlived their owner: reparented to init, started
    after ``since`` (clock ticks after boot), and named by a run's temporary directory
    (``adcloud-ros1-``, in their arguments or environment) or the reaper's name."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat(entry.name)
            if fields[0] == b"Z" or int(fields[1]) != 1 or int(fields[19]) < since:
                continue
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if b"adcloud-ros1-" in cmdline + environ or b"adcloud-reaper" in cmdline:
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


@pytest.fixture(scope="package", autouse=True)
def _no_replay_process_outlives_the_tests() -> Iterator[None]:
    """After the sim tests, no process a replay started is left behind (a leak that only a
    race shows, such as a roscore stopped while it was still starting rosout)."""
    since = int(_stat("self")[19])
    yield
    deadline = time.monotonic() + 15  # a reaper's teardown takes up to ~3 s
    while (left := _orphaned_replay_processes(since)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(
            "replay processes outlived their owners (now killed): "
            + "; ".join(f"{pid} {cmd}" for pid, cmd in sorted(left.items()))
        )


@pytest.fixture(scope="session")
def drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """:data:`DRIVE` as a ROS 1 bag."""
    return shared_drive(DRIVE, tmp_path_factory.mktemp("sim-drive") / "drive.bag", tmp_path_factory)


@pytest.fixture(scope="session")
def mcap_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """:data:`DRIVE` as an MCAP bag (ROS 2 messages, CDR)."""
    config = replace(DRIVE, seconds=1.0, format="mcap")
    return shared_drive(config, tmp_path_factory.mktemp("sim-mcap") / "drive", tmp_path_factory)


@pytest.fixture(scope="session")
def empty_bag(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid ROS 1 bag without any message."""
    path = tmp_path_factory.mktemp("sim-empty") / "empty.bag"
    with Writer(path):
        pass
    return path


@pytest.fixture(scope="session")
def bad_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Command lines of misbehaving pipe nodes, by name (``crash``, ``hang``, ...)."""
    root = tmp_path_factory.mktemp("sim-nodes")
    out = {}
    for name, code in _NODES.items():
        path = root / name
        path.write_text(textwrap.dedent(code))
        out[name.removesuffix(".py")] = f"{sys.executable} {path}"
    return out


class CountAtLeast:
    """A user evaluator, defined in the tests only: at least ``n`` outputs in the scenario's
    time range."""

    truth_topics: tuple[str, ...] = ()

    def __init__(self, n: int) -> None:
        self.name = "count_at_least"
        self.n = n

    def evaluate(self, data: ScenarioData) -> Evaluation:
        count = len(data.in_range(data.outputs))
        return Evaluation(self.name, count >= self.n, {"count": float(count)})
