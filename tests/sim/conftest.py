"""Drives and misbehaving nodes shared by the sim tests (session scope)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from rosbags.rosbag1 import Writer

from adcloud.sim import Evaluation, ScenarioData
from adcloud.synth import DriveConfig, DriveResult, generate_drive

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
    # A valid stream whose records are not messages.
    "not_messages.py": """
        from adcloud.binpipe.node import run_node
        run_node(lambda msg: (1, 2.5))
    """,
}


@pytest.fixture(scope="session")
def drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """:data:`DRIVE` as a ROS 1 bag."""
    return generate_drive(DRIVE, tmp_path_factory.mktemp("sim-drive") / "drive.bag")


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
