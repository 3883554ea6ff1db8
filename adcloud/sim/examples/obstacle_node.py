"""A LiDAR obstacle detector as a BinPipe pipe node.

Reads ``sensor_msgs/PointCloud2`` messages on ``--input`` (default ``/lidar/points``),
finds obstacles with the labelled-point clustering of :mod:`adcloud.sim.obstacles`, and
writes one ``geometry_msgs/PoseArray`` per cloud on ``--output`` (default ``/obstacles``):
obstacle centroids in the cloud's frame, stamped with the cloud's timestamp (so the
replay measures latency from that cloud).  Message definitions arrive in META blocks;
the node announces its own output type in a META block before its first output (and
so tells the replay that it is ready).  Run it as a replay node::

    adcloud sim run drive.bag --node "python -m adcloud.sim.examples.obstacle_node" \\
        --inputs /lidar/points --outputs /obstacles
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from adcloud.binpipe.codec import BlockKind, StreamReader, StreamWriter
from adcloud.binpipe.decode import ConnectionInfo, MessageDecoder, standard_typestore
from adcloud.sim.obstacles import cloud_points, cluster_obstacles

__all__ = ["detect", "main", "ros1_header"]

_POSE_ARRAY = "geometry_msgs/msg/PoseArray"


def detect(cloud: object, *, max_range_m: float = 40.0, min_points: int = 5) -> np.ndarray:
    """Obstacle centroids ``(k, 3)`` in metres, cloud frame, of one decoded cloud."""
    xyz, labels = cloud_points(cloud)
    return cluster_obstacles(xyz, labels, max_range_m=max_range_m, min_points=min_points)


def ros1_header(header: Any, types: Mapping[str, Any]) -> Any:
    """``header`` of an input message (ROS 1, or ROS 2 without ``seq``: a ROS 2 or MCAP
    bag) as the ROS 1 ``std_msgs/Header`` of ``types``, which the node's ROS 1 outputs
    carry."""
    stamp = types["builtin_interfaces/msg/Time"](
        sec=int(header.stamp.sec), nanosec=int(header.stamp.nanosec)
    )
    return types["std_msgs/msg/Header"](
        seq=int(getattr(header, "seq", 0)), stamp=stamp, frame_id=str(header.frame_id)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the node on stdin/stdout; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--input", default="/lidar/points")
    p.add_argument("--output", default="/obstacles")
    p.add_argument("--max-range", type=float, default=40.0, help="metres (default 40)")
    p.add_argument("--min-points", type=int, default=5)
    args = p.parse_args(argv)
    store = standard_typestore("ros1")
    t = store.types
    definition, md5sum = store.generate_msgdef(_POSE_ARRAY)
    decoder = MessageDecoder()
    sink = sys.stdout.buffer
    writer = StreamWriter(sink)
    writer.write_meta([(args.output, _POSE_ARRAY, "ros1msg", definition, md5sum, "ros1")])
    for block in StreamReader(sys.stdin.buffer, name="stdin"):
        if block.kind == BlockKind.META:
            for rec in block:
                decoder.add(ConnectionInfo.from_record(rec, "a META block on stdin"))
            continue
        for msg in block.messages():
            if msg.topic != args.input:
                continue
            cloud = decoder.decode(msg)
            found = detect(cloud, max_range_m=args.max_range, min_points=args.min_points)
            poses = [
                t["geometry_msgs/msg/Pose"](
                    position=t["geometry_msgs/msg/Point"](x=float(x), y=float(y), z=float(z)),
                    orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
                )
                for x, y, z in found
            ]
            out = t[_POSE_ARRAY](header=ros1_header(cloud.header, t), poses=poses)
            writer.write(
                (args.output, msg.timestamp, _POSE_ARRAY, store.serialize_ros1(out, _POSE_ARRAY))
            )
        # One flush per input block: the replay sends one message per block and waits.
        writer.flush_block()
        sink.flush()
    writer.close()
    sink.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
