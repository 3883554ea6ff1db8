"""Writers of small test bags (ROS 1, rosbag2, MCAP) with rosbags' writers and the mcap writer.

Every bag holds the same synthetic drive: a few topics of standard types, some with a
``std_msgs/Header`` whose stamp lags the record time by a known amount, record times
that sometimes step backwards (as a recorder's arrival order does), and repeated record
times within a topic.  :func:`drive` is the message list; the ``write_*`` functions
store it in each format.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from mcap.writer import CompressionType
from mcap.writer import Writer as McapWriter
from rosbags.rosbag1 import Writer as Ros1Writer
from rosbags.rosbag2 import StoragePlugin
from rosbags.rosbag2 import Writer as Ros2Writer
from rosbags.rosbag2.enums import CompressionFormat, CompressionMode
from rosbags.typesys import Stores, get_typestore
from rosbags.typesys.store import Typestore

ROS1 = get_typestore(Stores.ROS1_NOETIC)
ROS2 = get_typestore(Stores.ROS2_HUMBLE)

#: (topic, type) of the synthetic drive.
TOPICS = (
    ("/imu", "sensor_msgs/msg/Imu"),
    ("/pose", "geometry_msgs/msg/PoseStamped"),
    ("/status", "std_msgs/msg/String"),
    ("/count", "std_msgs/msg/Int32"),
)
HEADER_TOPICS = {"/imu", "/pose"}
#: Header stamps lag record time by this many ns.
LAG_NS = 7_000_000
T0 = 1_700_000_000_000_000_000


@dataclass(frozen=True)
class DriveMessage:
    """One message of the synthetic drive: topic, type, record time and header stamp (ns)."""

    topic: str
    msgtype: str
    time: int
    stamp: int
    value: int


def drive(n: int = 400) -> list[DriveMessage]:
    """``n`` messages round-robin over :data:`TOPICS`, 10 ms apart, in write order.

    Every 9th record time steps back 25 ms (out-of-order arrival); every 13th repeats
    the previous record time of the same topic (a tie within a connection).
    """
    out: list[DriveMessage] = []
    last: dict[str, int] = {}
    for i in range(n):
        topic, msgtype = TOPICS[i % len(TOPICS)]
        time = T0 + i * 10_000_000
        if i % 9 == 8:
            time -= 25_000_000
        if i % 13 == 12 and topic in last:
            time = last[topic]
        last[topic] = time
        out.append(DriveMessage(topic, msgtype, time, time - LAG_NS, i))
    return out


def _msg(store: Typestore, m: DriveMessage, ros1: bool) -> Any:
    types = store.types
    sec, nsec = divmod(m.stamp, 1_000_000_000)
    stamp = types["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec)
    if ros1:
        header = types["std_msgs/msg/Header"](seq=m.value, stamp=stamp, frame_id="base_link")
    else:
        header = types["std_msgs/msg/Header"](stamp=stamp, frame_id="base_link")
    vec = types["geometry_msgs/msg/Vector3"]
    quat = types["geometry_msgs/msg/Quaternion"]
    if m.msgtype == "sensor_msgs/msg/Imu":
        cov = np.zeros(9, dtype=np.float64)
        return types[m.msgtype](
            header=header,
            orientation=quat(x=0.0, y=0.0, z=0.0, w=1.0),
            orientation_covariance=cov,
            angular_velocity=vec(x=0.1, y=0.2, z=float(m.value)),
            angular_velocity_covariance=cov,
            linear_acceleration=vec(x=0.0, y=0.0, z=9.81),
            linear_acceleration_covariance=cov,
        )
    if m.msgtype == "geometry_msgs/msg/PoseStamped":
        pose = types["geometry_msgs/msg/Pose"](
            position=types["geometry_msgs/msg/Point"](x=float(m.value), y=1.0, z=0.0),
            orientation=quat(x=0.0, y=0.0, z=0.0, w=1.0),
        )
        return types[m.msgtype](header=header, pose=pose)
    if m.msgtype == "std_msgs/msg/String":
        return types[m.msgtype](data=f"status {m.value} " + "x" * (m.value % 50))
    return types[m.msgtype](data=m.value)


def serialize_ros1(m: DriveMessage) -> bytes:
    """The ROS 1 serialization of a drive message."""
    return bytes(ROS1.serialize_ros1(_msg(ROS1, m, True), m.msgtype))


def serialize_cdr(m: DriveMessage) -> bytes:
    """The CDR (little-endian) serialization of a drive message."""
    return bytes(ROS2.serialize_cdr(_msg(ROS2, m, False), m.msgtype))


def write_ros1(
    path: Path, *, compression: str = "none", chunk_threshold: int = 4096, n: int = 400
) -> Path:
    """A ROS 1 bag of the drive with chunks of about ``chunk_threshold`` bytes."""
    writer = Ros1Writer(path)
    if compression != "none":
        writer.set_compression(Ros1Writer.CompressionFormat[compression.upper()])
    writer.chunk_threshold = chunk_threshold
    with writer:
        conns = {t: writer.add_connection(t, typ, typestore=ROS1) for t, typ in TOPICS}
        for m in drive(n):
            writer.write(conns[m.topic], m.time, serialize_ros1(m))
    return path


def write_ros2(
    path: Path, *, storage: str = "sqlite3", compression_mode: str = "none", n: int = 400
) -> Path:
    """A rosbag2 directory of the drive (sqlite3 or MCAP storage, version 9)."""
    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    writer = Ros2Writer(path, version=9, storage_plugin=plugin)
    if compression_mode != "none":
        writer.set_compression(CompressionMode[compression_mode.upper()], CompressionFormat.ZSTD)
    with writer:
        conns = {t: writer.add_connection(t, typ, typestore=ROS2) for t, typ in TOPICS}
        for m in drive(n):
            writer.write(conns[m.topic], m.time, serialize_cdr(m))
    return path


def write_mcap(
    path: Path, *, compression: str = "zstd", chunk_size: int = 4096, n: int = 400
) -> Path:
    """A bare MCAP file of the drive (ros2msg schemas, CDR) with chunks of ~``chunk_size``."""
    with path.open("wb") as out:
        writer = McapWriter(
            out, chunk_size=chunk_size, compression=CompressionType[compression.upper()]
        )
        writer.start(profile="ros2", library="adcloud-tests")
        channels = {}
        for topic, typ in TOPICS:
            msgdef, _ = ROS2.generate_msgdef(typ, ros_version=2)
            schema = writer.register_schema(name=typ, encoding="ros2msg", data=msgdef.encode())
            channels[topic] = writer.register_channel(
                topic=topic, message_encoding="cdr", schema_id=schema
            )
        for seq, m in enumerate(drive(n)):
            writer.add_message(
                channel_id=channels[m.topic],
                log_time=m.time,
                publish_time=m.time,
                sequence=seq,
                data=serialize_cdr(m),
            )
        writer.finish()  # type: ignore[no-untyped-call]
    return path


def ros1_layout(path: Path) -> tuple[int, list[int]]:
    """``index_pos`` and sorted chunk positions of a ROS 1 bag (parsed independently)."""
    data = path.read_bytes()
    (index_pos,) = struct.unpack_from("<Q", data, data.index(b"index_pos=") + 10)
    region = data[index_pos:]
    chunk_pos = sorted(
        struct.unpack_from("<Q", region, m.end())[0] for m in re.finditer(b"chunk_pos=", region)
    )
    return index_pos, chunk_pos


def sparse_shift(src: Path, dst: Path, shift: int) -> Path:
    """Copy a ROS 1 bag, inserting a hole of ``shift`` bytes before its first chunk.

    ``index_pos`` and every ``chunk_pos`` are patched, so the copy is a valid bag
    whose chunks and index lie ``shift`` bytes further on; with a sparse file the
    hole costs no disk space.
    """
    data = src.read_bytes()
    index_pos, chunks = ros1_layout(src)
    first = chunks[0]
    head = bytearray(data[:first])
    at = head.index(b"index_pos=") + 10
    head[at : at + 8] = struct.pack("<Q", index_pos + shift)
    body = bytearray(data[first:])
    rel_index = index_pos - first
    for m in list(re.finditer(b"chunk_pos=", bytes(body[rel_index:]))):
        at = rel_index + m.end()
        (pos,) = struct.unpack_from("<Q", body, at)
        body[at : at + 8] = struct.pack("<Q", pos + shift)
    with dst.open("wb") as out:
        out.write(head)
        out.seek(first + shift)
        out.write(body)
    return dst


def ros1_record(fields: dict[str, bytes], data: bytes) -> bytes:
    """One ROS 1 record (header fields in order, then data), written independently."""
    header = b"".join(
        struct.pack("<I", len(k) + 1 + len(v)) + k.encode() + b"=" + v for k, v in fields.items()
    )
    return struct.pack("<I", len(header)) + header + struct.pack("<I", len(data)) + data


def ros1_chunk_content(path: Path, chunk_pos: int) -> bytes:
    """The stored data of the CHUNK record at ``chunk_pos`` (uncompressed bags: the content)."""
    data = path.read_bytes()
    (hlen,) = struct.unpack_from("<I", data, chunk_pos)
    (dlen,) = struct.unpack_from("<I", data, chunk_pos + 4 + hlen)
    start = chunk_pos + 4 + hlen + 4
    return data[start : start + dlen]


def ros1_chunk_payloads(path: Path) -> list[list[bytes]]:
    """Message payloads of each chunk of an uncompressed ROS 1 bag, in file order."""
    out = []
    for pos in ros1_layout(path)[1]:
        content = ros1_chunk_content(path, pos)
        at, payloads = 0, []
        while at < len(content):
            (hlen,) = struct.unpack_from("<I", content, at)
            header = content[at + 4 : at + 4 + hlen]
            (dlen,) = struct.unpack_from("<I", content, at + 4 + hlen)
            body = content[at + 8 + hlen : at + 8 + hlen + dlen]
            if b"op=\x02" in header:
                payloads.append(body)
            at += 8 + hlen + dlen
        out.append(payloads)
    return out


def write_ros2_split(path: Path, *, n: int = 400, parts: int = 2) -> Path:
    """A rosbag2 sqlite3 directory whose drive is split over ``parts`` files by time.

    rosbags' writer does not split; each part is written as its own bag and the
    storage files are gathered under one ``metadata.yaml``, as ``ros2 bag record
    --max-bag-size`` lays them out.
    """
    msgs = sorted(drive(n), key=lambda m: m.time)  # stable: ties keep write order
    cut = [len(msgs) * i // parts for i in range(parts + 1)]
    infos = []
    path.mkdir()
    for i in range(parts):
        sub = path.parent / f".{path.name}_part{i}"
        writer = Ros2Writer(sub, version=9)
        with writer:
            conns = {t: writer.add_connection(t, typ, typestore=ROS2) for t, typ in TOPICS}
            # Each file covers a disjoint time range, like a size-split recording.
            for m in msgs[cut[i] : cut[i + 1]]:
                writer.write(conns[m.topic], m.time, serialize_cdr(m))
        name = f"{path.name}_{i}.db3"
        (sub / f"{sub.name}.db3").rename(path / name)
        infos.append((name, yaml.safe_load((sub / "metadata.yaml").read_text())))
        (sub / "metadata.yaml").unlink()
        sub.rmdir()
    meta = infos[0][1]
    info = meta["rosbag2_bagfile_information"]
    allinfo = [x[1]["rosbag2_bagfile_information"] for x in infos]
    info["relative_file_paths"] = [name for name, _ in infos]
    info["files"] = [f for x in allinfo for f in x["files"]]
    for f, (name, _) in zip(info["files"], infos, strict=True):
        f["path"] = name
    info["message_count"] = sum(x["message_count"] for x in allinfo)
    start = min(x["starting_time"]["nanoseconds_since_epoch"] for x in allinfo)
    stop = max(
        x["starting_time"]["nanoseconds_since_epoch"] + x["duration"]["nanoseconds"]
        for x in allinfo
    )
    info["starting_time"]["nanoseconds_since_epoch"] = start
    info["duration"]["nanoseconds"] = stop - start
    for j, topic in enumerate(info["topics_with_message_count"]):
        topic["message_count"] = sum(
            x["topics_with_message_count"][j]["message_count"] for x in allinfo
        )
    (path / "metadata.yaml").write_text(yaml.safe_dump(meta))
    return path
