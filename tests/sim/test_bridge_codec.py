"""The ROS bridge's own BinPipe reader/writer agrees with adcloud's codec."""

from __future__ import annotations

import importlib.util
import io
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from adcloud.binpipe import encode_stream, iter_records

_BRIDGE = Path(__file__).resolve().parents[2] / "adcloud/sim/_ros1_bridge.py"


@pytest.fixture(scope="module")
def bridge() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adcloud_ros1_bridge", _BRIDGE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bridge_writes_what_adcloud_reads(bridge: ModuleType) -> None:
    out = io.BytesIO()
    writer = bridge.Writer(out)
    writer.write(bridge.META, [["/a", "pkg/msg/T", "ros1msg", "int32 x", "abc", "ros1"]])
    writer.write(bridge.META, [])
    writer.write(bridge.DATA, [["/a", 5, "pkg/msg/T", b"\x01\x00\x00\x00"], ["/é", -1, "t", b""]])
    writer.close()
    records = list(iter_records(out.getvalue(), include_meta=True))
    assert records[0] == ("/a", "pkg/msg/T", "ros1msg", "int32 x", "abc", "ros1")
    assert records[1][:3] == ("/a", 5, "pkg/msg/T")
    assert bytes(records[1][3]) == b"\x01\x00\x00\x00"
    assert records[2][:2] == ("/é", -1)


def test_bridge_reads_what_adcloud_writes(bridge: ModuleType) -> None:
    data = encode_stream([("/a", 1, "t", b"abc"), ("/b", 2, "u", b""), (None, 1.5)])
    blocks = list(bridge.read_stream(io.BytesIO(data)))
    assert blocks == [(0, [["/a", 1, "t", b"abc"], ["/b", 2, "u", b""], [None, 1.5]])]


def test_bridge_refuses_bad_streams(bridge: ModuleType) -> None:
    data = encode_stream([("/a", 1, "t", b"abc")])
    with pytest.raises(ValueError, match="not a BinPipe stream"):
        list(bridge.read_stream(io.BytesIO(b"hello world\n" * 4)))
    with pytest.raises(EOFError, match="truncated"):
        list(bridge.read_stream(io.BytesIO(data[:-8])))
    corrupt = bytearray(data)
    corrupt[20] ^= 0xFF  # inside the first block header
    with pytest.raises(ValueError, match="corrupt block header"):
        list(bridge.read_stream(io.BytesIO(bytes(corrupt))))


def test_type_names(bridge: ModuleType) -> None:
    assert bridge._ros1_type("sensor_msgs/msg/Imu") == "sensor_msgs/Imu"
    assert bridge._ros1_type("sensor_msgs/Imu") == "sensor_msgs/Imu"
    assert bridge._binpipe_type("sensor_msgs/Imu") == "sensor_msgs/msg/Imu"
    assert bridge._binpipe_type("sensor_msgs/msg/Imu") == "sensor_msgs/msg/Imu"


_SLOW_READER = """
import socket, sys, time
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sys.stdin.readline()  # read nothing from the socket until told
left = int(sys.argv[2])
while left:
    left -= len(conn.recv(65536))
print("read", flush=True)
sys.stdin.readline()
"""


def test_the_bridge_sees_a_message_still_on_its_way_to_the_node(bridge: ModuleType) -> None:
    """Synchronous replay took a node for idle while a cloud was still queued on the socket
    between them (no thread of either busy, no CPU used): the answer then came back stamped
    with the next cloud's time.  Bytes queued on a connection between the bridge and the
    node count as a message on its way; other connections (a listening socket's backlog,
    one to another process) do not."""
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    size = 4 << 20
    listener = socket.create_server(("127.0.0.1", 0))
    stranger = socket.create_connection(listener.getsockname())
    node = subprocess.Popen(
        [sys.executable, "-c", _SLOW_READER, str(listener.getsockname()[1]), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stranger_end, _ = listener.accept()  # accepted in the order they connected
        link, _ = listener.accept()
        stranger.sendall(b"x" * 1000)  # queued, but not on the way to the node
        assert not bridge._in_flight([str(node.pid)])
        link.setblocking(False)
        sent = 0
        while sent < size:
            try:
                sent += link.send(b"c" * min(1 << 20, size - sent))
            except BlockingIOError:
                break  # the node's receive buffer and ours are full: it reads nothing
        assert sent > 0
        assert bridge._in_flight([str(node.pid)])
        assert node.stdin is not None and node.stdout is not None
        link.setblocking(True)
        node.stdin.write("go\n")
        node.stdin.flush()
        link.sendall(b"c" * (size - sent))
        assert node.stdout.readline() == "read\n"
        assert not bridge._in_flight([str(node.pid)])
    finally:
        node.kill()
        node.wait()
        for sock in (listener, stranger, stranger_end):
            sock.close()


def test_settling_without_a_node_to_watch_ends_at_the_limit(bridge: ModuleType) -> None:
    """After the last input, without the node's process group to watch, the bridge waits
    until no answer came for the quiet period -- or the time limit, for a node that answers
    on a timer (it waited for ever)."""
    cond = threading.Condition()
    state = {"answers": 0}
    stop = threading.Event()

    def heartbeat() -> None:  # an answer every 20 ms, more often than the quiet period
        while not stop.wait(0.02):
            with cond:
                state["answers"] += 1
                cond.notify_all()

    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        started = time.monotonic()
        # quiet 0.5 s: a heartbeat late by that much would need the process stalled
        assert bridge._settle(cond, state, 0.5, None, 1.5) is True
        assert 1.4 < time.monotonic() - started < 4.0
    finally:
        stop.set()
        beat.join()
    # answers that stop: settled after one quiet period
    started = time.monotonic()
    assert bridge._settle(cond, state, 0.5, None, 30.0) is True
    assert time.monotonic() - started < 4.0
