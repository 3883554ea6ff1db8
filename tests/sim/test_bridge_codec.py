"""The ROS bridge's own BinPipe reader/writer agrees with adcloud's codec."""

from __future__ import annotations

import importlib.util
import io
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
