# mypy: ignore-errors
# (runs under the system Python with rospy, outside the typed package; see the docstring)
"""A LiDAR obstacle detector as a ROS 1 node (rospy, system Python, no numpy).

Subscribes to ``~input`` (default ``/lidar/points``, ``sensor_msgs/PointCloud2`` with a
per-point ``label`` field) and publishes ``geometry_msgs/PoseArray`` on ``~output``
(default ``/obstacles``): centroids of connected groups of obstacle-labelled points
(poles, signs, vehicles) on a 1 m grid, as :mod:`adcloud.sim.obstacles` defines them, in
the cloud's frame and stamped with the cloud's stamp.  Debian's ROS base has no
``sensor_msgs``/``geometry_msgs`` Python packages, so the node reads and writes the ROS 1
serialization itself.  Run it under the ``ros1`` adapter::

    adcloud sim run drive.bag --adapter ros1 \\
        --node "/usr/bin/python3 adcloud/sim/examples/obstacle_ros_node.py" \\
        --inputs /lidar/points --outputs /obstacles

``_crash_after:=N`` makes it exit with status 3 after N clouds, ``_busy_s:=S`` makes it
compute for S seconds of CPU time more per cloud, as a heavy detector on a slow machine
would, and ``_heartbeat_hz:=H`` makes it publish its latest detections again H times a
second of wall-clock time on ``~heartbeat`` (default ``/obstacles/latest``), as a node
with a ``WallTimer`` does, replay or not (all used by the tests).
"""

import math
import struct
import sys
import threading
import time

POSE_ARRAY_MD5 = "916c28c5764443f268b296bb671b9d97"
POSE_ARRAY_DEF = (
    "std_msgs/Header header\ngeometry_msgs/Pose[] poses\n" + "=" * 80 + "\nMSG: std_msgs/Header\n"
    "uint32 seq\ntime stamp\nstring frame_id\n" + "=" * 80 + "\nMSG: geometry_msgs/Pose\n"
    "geometry_msgs/Point position\ngeometry_msgs/Quaternion orientation\n"
    + "=" * 80
    + "\nMSG: geometry_msgs/Point\nfloat64 x\nfloat64 y\nfloat64 z\n"
    + "=" * 80
    + "\nMSG: geometry_msgs/Quaternion\nfloat64 x\nfloat64 y\nfloat64 z\nfloat64 w\n"
)
OBSTACLE_CLASSES = (7, 8, 10)
_FMT = {1: "b", 2: "B", 3: "h", 4: "H", 5: "i", 6: "I", 7: "f", 8: "d"}


def _string(buf, pos):
    (n,) = struct.unpack_from("<I", buf, pos)
    return buf[pos + 4 : pos + 4 + n].decode("utf-8"), pos + 4 + n


def parse_cloud(buf):
    """``(stamp_sec, stamp_nsec, frame_id, points)`` of a ROS 1 PointCloud2; points are
    ``(x, y, z, label)`` tuples."""
    _seq, sec, nsec = struct.unpack_from("<III", buf, 0)
    frame, pos = _string(buf, 12)
    height, width, nfields = struct.unpack_from("<III", buf, pos)
    pos += 12
    fields = {}
    for _ in range(nfields):
        name, pos = _string(buf, pos)
        offset, datatype, _count = struct.unpack_from("<IBI", buf, pos)
        pos += 9
        fields[name] = (offset, _FMT[datatype])
    _bigendian, point_step, _row_step, size = struct.unpack_from("<BIII", buf, pos)
    pos += 13
    data = buf[pos : pos + size]
    n = width * height
    xo, yo, zo = fields["x"][0], fields["y"][0], fields["z"][0]
    lo, lf = fields.get("label", (None, None))
    points = []
    for i in range(n):
        base = i * point_step
        label = struct.unpack_from("<" + lf, data, base + lo)[0] if lo is not None else -1
        if label in OBSTACLE_CLASSES:
            x, y, z = (struct.unpack_from("<f", data, base + o)[0] for o in (xo, yo, zo))
            points.append((x, y, z, label))
    return sec, nsec, frame, points


def cluster(points, cell_m=1.0, min_points=5, max_range_m=40.0):
    """Centroids of 8-connected grid-cell groups of at least ``min_points`` points."""
    cells = {}
    for x, y, z, _label in points:
        if math.hypot(x, y) <= max_range_m:
            cells.setdefault((math.floor(x / cell_m), math.floor(y / cell_m)), []).append((x, y, z))
    seen, out = set(), []
    for start in cells:
        if start in seen:
            continue
        seen.add(start)
        stack, members = [start], []
        while stack:
            a, b = stack.pop()
            members.extend(cells[(a, b)])
            for da in (-1, 0, 1):
                for db in (-1, 0, 1):
                    nb = (a + da, b + db)
                    if nb in cells and nb not in seen:
                        seen.add(nb)
                        stack.append(nb)
        if len(members) >= min_points:
            n = len(members)
            out.append(tuple(sum(p[k] for p in members) / n for k in range(3)))
    return sorted(out)


def pose_array(seq, sec, nsec, frame, centroids):
    """ROS 1 serialization of a ``geometry_msgs/PoseArray``."""
    frame_b = frame.encode("utf-8")
    parts = [struct.pack("<III", seq, sec, nsec), struct.pack("<I", len(frame_b)), frame_b]
    parts.append(struct.pack("<I", len(centroids)))
    for x, y, z in centroids:
        parts.append(struct.pack("<7d", x, y, z, 0.0, 0.0, 0.0, 1.0))
    return b"".join(parts)


def main():
    """Run the node until shut down."""
    import genpy  # noqa: PLC0415 - system Python with rospy only
    import rospy  # noqa: PLC0415

    class PoseArrayRaw(genpy.Message):
        _type, _md5sum, _full_text, _has_header = (
            "geometry_msgs/PoseArray",
            POSE_ARRAY_MD5,
            POSE_ARRAY_DEF,
            False,
        )
        __slots__ = ("_buff",)

        def __init__(self, buff=b""):
            self._buff = buff

        def serialize(self, buff):
            buff.write(self._buff)

    rospy.init_node("obstacle_detector")
    out_topic = rospy.get_param("~output", "/obstacles")
    max_range = float(rospy.get_param("~max_range", 40.0))
    crash_after = int(rospy.get_param("~crash_after", 0))
    busy_s = float(rospy.get_param("~busy_s", 0.0))
    heartbeat_hz = float(rospy.get_param("~heartbeat_hz", 0.0))
    pub = rospy.Publisher(out_topic, PoseArrayRaw, queue_size=100)
    state = {"n": 0, "last": None}

    def on_cloud(msg):
        sec, nsec, frame, points = parse_cloud(msg._buff)
        centroids = cluster(points, max_range_m=max_range)
        spent = time.process_time() + busy_s
        while time.process_time() < spent:
            pass
        answer = pose_array(state["n"], sec, nsec, frame, centroids)
        pub.publish(PoseArrayRaw(answer))
        state["n"] += 1
        state["last"] = answer
        if crash_after and state["n"] >= crash_after:
            rospy.logerr("crashing on purpose after %d clouds", state["n"])
            sys.stderr.flush()
            import os  # noqa: PLC0415

            os._exit(3)

    if heartbeat_hz > 0:
        beat = rospy.Publisher(
            rospy.get_param("~heartbeat", "/obstacles/latest"), PoseArrayRaw, queue_size=10
        )

        def republish():
            # wall-clock time, not the replay's /clock (rospy.Timer would follow that)
            while not rospy.is_shutdown():
                last = state["last"]
                if last is not None:
                    beat.publish(PoseArrayRaw(last))
                time.sleep(1.0 / heartbeat_hz)

        threading.Thread(target=republish, daemon=True).start()

    rospy.Subscriber(rospy.get_param("~input", "/lidar/points"), rospy.AnyMsg, on_cloud)
    rospy.spin()
    return 0


if __name__ == "__main__":
    sys.exit(main())
