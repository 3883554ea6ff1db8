"""Copies of synthetic drive bags with a sensor's recording spoiled, as field recordings
come."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rosbags.rosbag1 import Reader, Writer
from rosbags.typesys import Stores, get_typestore


def without_fix(bag: Path, out: Path) -> Path:
    """A copy of ``bag`` whose GPS receiver never had a fix: every ``/gps/fix`` message with
    status NO_FIX (-1), as a receiver under a roof or without an antenna records."""
    store = get_typestore(Stores.ROS1_NOETIC)
    with Reader(bag) as reader, Writer(out) as writer:
        conns = {
            c.id: writer.add_connection(
                c.topic,
                c.msgtype,
                msgdef=c.msgdef.data,
                md5sum=c.digest,
                callerid=c.ext.callerid,  # type: ignore[union-attr]
                latching=c.ext.latching,  # type: ignore[union-attr]
            )
            for c in reader.connections
        }
        for c, t, data in reader.messages():
            if c.topic == "/gps/fix":
                msg: Any = store.deserialize_ros1(data, c.msgtype)
                msg.status.status = -1
                writer.write(conns[c.id], t, store.serialize_ros1(msg, c.msgtype))
            else:
                writer.write(conns[c.id], t, data)
    return out
