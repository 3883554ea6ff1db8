"""A real-time camera detector as a BinPipe pipe node, for perception replay.

Reads ``sensor_msgs/Image`` frames of any number of camera topics and answers each frame
it processes with a ``geometry_msgs/PoseArray`` on ``--output`` (default ``/detections``)
stamped with the frame's timestamp: the centroid (column, row, 0) of the frame's
brightest pixels, a stand-in for a detector.  ``--work-ms`` adds a fixed processing cost
per frame.  Like real-time detectors it never queues: a reader thread keeps only the
newest frame of each topic, so frames that arrive while the detector is busy are dropped
-- which is what the ``frames`` evaluator's loss rate measures when the replay is paced
at the cameras' frame rate.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from adcloud.binpipe.codec import BlockKind, Message, StreamReader, StreamWriter
from adcloud.binpipe.decode import ConnectionInfo, MessageDecoder, standard_typestore
from adcloud.sim.examples.obstacle_node import ros1_header

__all__ = ["main"]

_POSE_ARRAY = "geometry_msgs/msg/PoseArray"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the node on stdin/stdout; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--output", default="/detections")
    p.add_argument("--work-ms", type=float, default=0.0, help="extra cost per frame (ms)")
    args = p.parse_args(argv)
    store = standard_typestore("ros1")
    t = store.types
    definition, md5sum = store.generate_msgdef(_POSE_ARRAY)
    decoder = MessageDecoder()
    sink = sys.stdout.buffer
    writer = StreamWriter(sink)
    writer.write_meta([(args.output, _POSE_ARRAY, "ros1msg", definition, md5sum, "ros1")])
    sink.flush()
    latest: dict[str, Message] = {}
    cond = threading.Condition()
    errors: list[Exception] = []
    done = threading.Event()

    def read() -> None:
        try:
            for block in StreamReader(sys.stdin.buffer, name="stdin"):
                with cond:
                    if block.kind == BlockKind.META:
                        for rec in block:
                            decoder.add(ConnectionInfo.from_record(rec, "a META block on stdin"))
                        continue
                    for msg in block.messages():
                        latest[msg.topic] = Message(
                            msg.topic, msg.timestamp, msg.msgtype, bytes(msg.data)
                        )
                    cond.notify_all()
        except Exception as err:  # reported by the main thread
            errors.append(err)
        with cond:
            done.set()
            cond.notify_all()

    threading.Thread(target=read, daemon=True).start()
    while True:
        with cond:
            cond.wait_for(lambda: bool(latest) or done.is_set())
            if not latest:
                break
            topic = min(latest, key=lambda k: latest[k].timestamp)
            msg = latest.pop(topic)
        image = decoder.decode(msg)
        pixels = np.asarray(image.data, dtype=np.uint8)
        if args.work_ms:
            time.sleep(args.work_ms / 1000)
        bright = np.flatnonzero(pixels >= pixels.max())
        col = float(np.mean(bright % max(image.step, 1))) if len(bright) else 0.0
        row = float(np.mean(bright // max(image.step, 1))) if len(bright) else 0.0
        pose = t["geometry_msgs/msg/Pose"](
            position=t["geometry_msgs/msg/Point"](x=col, y=row, z=0.0),
            orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
        )
        out = t[_POSE_ARRAY](header=ros1_header(image.header, t), poses=[pose])
        writer.write(
            (args.output, msg.timestamp, _POSE_ARRAY, store.serialize_ros1(out, _POSE_ARRAY))
        )
        writer.flush_block()
        sink.flush()
    if errors:
        raise errors[0]
    writer.close()
    sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
