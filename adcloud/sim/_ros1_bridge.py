# mypy: ignore-errors
# (runs under the system Python with rospy, outside the typed package; see the docstring)
"""The ROS side of the ``ros1`` adapter: BinPipe on stdin/stdout <-> topics of a roscore.

Runs under the system Python with rospy (``/usr/bin/python3``); it imports nothing from
adcloud or the virtual environment, so it carries its own small reader and writer of the
BinPipe format (``docs/binpipe-format.md``).  Input: one stream whose first META block
describes the input connections and whose DATA records are messages.  For each message it
publishes ``/clock`` at the message's time, then the message's serialized bytes on its
topic; in synchronous mode (``--sync``), after a trigger topic, it waits until an output
(one on the ``--answers`` topics, when they are named) arrives or the node has been idle
for ``--quiet`` seconds: while the node's process group
(``--node-pgid``) keeps using CPU it is still answering, however slow the machine, so the
wait goes on (see :mod:`adcloud.sim.adapters`).  Every message received on an output topic
is written back stamped with the simulated clock, preceded by a META record with its
definition -- but those the bridge published itself (a topic that is input and output).
No answer is lost to a connection still coming up or still carrying it: the first input
waits until the nodes publishing an output topic have the bridge's connection (their bus
information, ``getBusInfo``), and the end until all they wrote to the bridge by their bus
statistics (``getBusStats``) has come through.
After the last input it waits until the node has been idle for ``--quiet`` seconds, in
either mode: what a node publishes on a wall-clock timer then does not keep it waiting.
Exit status: 0 after END and that final wait, non-zero (no END written) on any error.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import threading
import time
import xmlrpc.client
import zlib

_MAGIC = b"\x89ADBP\r\n\x1a"
_HEAD = struct.Struct("<4sHHIIQIIII")
DATA, META, END = 0, 1, 2
NONE, BYTES, STR, INT, FLOAT = 0, 1, 2, 3, 4


def _pad8(n):
    return (n + 7) & ~7


def _read(src, n):
    buf = src.read(n)
    if len(buf) != n:
        raise EOFError(f"truncated input: {len(buf)} of {n} bytes")
    return buf


def read_stream(src):
    """Yield ``(kind, records)`` per block; checks magic, header CRCs and END's count."""
    head = _read(src, 16)
    if head[:8] != _MAGIC or zlib.crc32(head[:12]) != struct.unpack_from("<I", head, 12)[0]:
        raise ValueError("input is not a BinPipe stream")
    count = 0
    while True:
        hdr = _read(src, 40)
        magic, kind, _flags, nrec, nfld, plen, _tc, _pc, _res, crc = _HEAD.unpack(hdr)
        if magic != b"BPBK" or zlib.crc32(hdr[:36]) != crc:
            raise ValueError("corrupt block header")
        body = _read(src, 8 * nfld + _pad8(4 * nrec) + _pad8(nfld) + _pad8(plen))
        ends = struct.unpack_from(f"<{nfld}Q", body, 0)
        rends = struct.unpack_from(f"<{nrec}I", body, 8 * nfld)
        types = body[8 * nfld + _pad8(4 * nrec) :][:nfld]
        payload = memoryview(body)[8 * nfld + _pad8(4 * nrec) + _pad8(nfld) :]
        fields, start = [], 0
        for end, typ in zip(ends, types, strict=True):
            raw = payload[start:end]
            start = end
            if typ == STR:
                fields.append(bytes(raw).decode("utf-8"))
            elif typ == INT:
                fields.append(struct.unpack("<q", raw)[0])
            elif typ == FLOAT:
                fields.append(struct.unpack("<d", raw)[0])
            else:
                fields.append(bytes(raw) if typ == BYTES else None)
        records, first = [], 0
        for last in rends:
            records.append(fields[first:last])
            first = last
        if kind == END:
            if records != [[count]]:
                raise ValueError(f"END declares {records}, the stream held {count} records")
            return
        count += nrec
        yield kind, records


def encode_block(kind, records):
    """One block of records whose fields are str, int or bytes."""
    ends, rends, types, parts, size = [], [], bytearray(), [], 0
    for rec in records:
        for value in rec:
            if isinstance(value, str):
                raw, typ = value.encode("utf-8"), STR
            elif isinstance(value, int):
                raw, typ = struct.pack("<q", value), INT
            else:
                raw, typ = bytes(value), BYTES
            parts.append(raw)
            types.append(typ)
            size += len(raw)
            ends.append(size)
        rends.append(len(ends))
    tables = (
        struct.pack(f"<{len(ends)}Q", *ends)
        + struct.pack(f"<{len(rends)}I", *rends).ljust(_pad8(4 * len(rends)), b"\0")
        + bytes(types).ljust(_pad8(len(types)), b"\0")
    )
    payload = b"".join(parts).ljust(_pad8(size), b"\0")
    head = _HEAD.pack(b"BPBK", kind, 0, len(rends), len(ends), size, zlib.crc32(tables), 0, 0, 0)
    head = head[:36] + struct.pack("<I", zlib.crc32(head[:36]))
    return head + tables + payload


class Writer:
    """Thread-safe BinPipe stream writer on a binary file."""

    def __init__(self, out):
        self.out, self.count, self.lock, self.closed = out, 0, threading.Lock(), False
        head = _MAGIC + struct.pack("<HH", 1, 0)
        self._emit(head + struct.pack("<I", zlib.crc32(head)))

    def _emit(self, data):
        self.out.write(data)
        self.out.flush()

    def write(self, kind, records):
        """Write one block; nothing once the stream is closed (a node publishing on a
        timer answers after the end too: the stream ends with END)."""
        with self.lock:
            if self.closed:
                return
            self._emit(encode_block(kind, records))
            self.count += len(records)

    def close(self):
        with self.lock:
            self._emit(encode_block(END, [[self.count]]))
            self.closed = True


def _ros1_type(msgtype):
    """``sensor_msgs/msg/Imu`` (ROS 2 style names, as rosbags gives them) -> ``sensor_msgs/Imu``."""
    pkg, _, name = msgtype.rpartition("/")
    return f"{pkg.split('/')[0]}/{name}" if pkg else msgtype


def _binpipe_type(msgtype):
    """``sensor_msgs/Imu`` -> ``sensor_msgs/msg/Imu``: the names BinPipe records carry."""
    pkg, _, name = msgtype.partition("/")
    return f"{pkg}/msg/{name}" if name and "/" not in name else msgtype


def _raw_class(msgtype, md5sum, definition):
    """A rospy message class whose instances publish already serialized bytes."""
    import genpy  # noqa: PLC0415 - system Python only

    class Raw(genpy.Message):
        _type, _md5sum, _full_text, _has_header = msgtype, md5sum, definition, False
        __slots__ = ("_buff",)

        def __init__(self, buff=b""):
            self._buff = buff

        def serialize(self, buff):
            buff.write(self._buff)

        def deserialize(self, str_):
            self._buff = str_
            return self

    return Raw


#: A node using at least this share of one core during a quiet period is still busy.
_BUSY_SHARE = 0.1
#: Thread states of a node that is not idle: running or waiting for a CPU, waiting for disk.
_BUSY_STATES = (b"R", b"D")
#: How long the bridge waits, the interpreter lock released, before it takes an idle node
#: for one: an output this process has read but not yet handed on finishes meanwhile.
_SETTLE_S = 0.02
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:  # noqa: PTH123 - hot path, plain open
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


class _GroupCpu:
    """CPU seconds used by the live processes of process group ``pgid``; members are
    looked up again on ``refresh`` (scanning /proc costs milliseconds).  Kept apart from
    ``adcloud.sim.adapters.CpuWatch`` because this script imports nothing from adcloud."""

    def __init__(self, pgid):
        self.pgid = pgid
        self.members = []
        self.refresh()

    def refresh(self):
        found = []
        for name in os.listdir("/proc"):  # noqa: PTH208
            fields = _stat(name) if name.isdigit() else None
            if fields is not None and int(fields[2]) == self.pgid:
                found.append(name)
        self.members = found

    def seconds(self):
        total = 0
        for name in self.members:
            fields = _stat(name)
            if fields is not None:
                total += sum(int(v) for v in fields[11:15])
        return total * _TICK_S

    def alive(self):
        """Whether a member found by the last ``refresh`` still runs (is no zombie)."""
        return any((f := _stat(name)) is not None and f[0] != b"Z" for name in self.members)

    def running(self):
        """Whether a thread of the group is running or waiting for a CPU (state R) or for
        the disk (D): a node computing on a loaded machine may get no CPU time for a whole
        quiet period."""
        for name in self.members:
            try:
                tasks = os.listdir(f"/proc/{name}/task")  # noqa: PTH208
            except OSError:
                continue
            for tid in tasks:
                fields = _stat(f"{name}/task/{tid}")
                if fields is not None and fields[0] in _BUSY_STATES:
                    return True
        return False


def _socket_inodes(pids):
    """The inodes of the sockets processes ``pids`` hold open."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")  # noqa: PTH208
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")  # noqa: PTH115 - hot path
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(target[8:-1])
    return found


def _tcp_connections(inodes):
    """``{(local, remote): (sent, received)}``: the established TCP connections of the
    sockets ``inodes``, with the bytes each has queued -- sent but not yet taken by the other
    end's kernel, received but not yet read."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb") as f:  # noqa: PTH123
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # state 01: established (a listening socket's queue fields mean its backlog)
            if len(fields) > 9 and fields[3] == b"01" and fields[9].decode() in inodes:
                sent, received = fields[4].split(b":")
                found[(fields[1], fields[2])] = (int(sent, 16), int(received, 16))
    return found


def _in_flight(node_pids):
    """Whether bytes are queued on a connection between this bridge and the node: a message
    on its way is in neither one's CPU time nor thread states (a sender whose last segment
    waits for an acknowledgement, a reader blocked for the rest of a cloud)."""
    ours = _tcp_connections(_socket_inodes(["self"]))
    theirs = _tcp_connections(_socket_inodes(node_pids))
    for (local, remote), queued in ours.items():
        other = theirs.get((remote, local))
        if other is not None and (any(queued) or any(other)):
            return True
    return False


def _sending():
    """Whether another thread of this bridge is running or waiting for a CPU: rospy
    publishers with a queue send from threads of their own, so a message published a moment
    ago may not have reached the node yet, and the node is idle only because of that."""
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):  # noqa: PTH208
        if int(tid) != me:
            fields = _stat(f"self/task/{tid}")
            if fields is not None and fields[0] in _BUSY_STATES:
                return True
    return False


def _idle(node):
    """Whether ``node`` (a ``_GroupCpu``) and this bridge are both idle now: no thread of
    either running, and no message on its way between them."""
    if node.running() or _sending():
        return False
    return not _in_flight(node.members)


def _answer_after(state, seen):
    """Whether an answer came after the first ``seen`` (a predicate for ``_await``)."""
    return lambda: state["answers"] != seen


def _await(cond, arrived, quiet, node, limit):
    """Wait until ``arrived()`` holds (checked under ``cond``: an answer came), or the node
    (a ``_GroupCpu``, or None: not watched) has been idle -- below ``_BUSY_SHARE`` of a
    core -- for ``quiet`` s, or ``limit`` s passed.  A node with a thread waiting for a CPU
    is not idle, nor is one that a message is still on its way to.  Returns False when the
    node is gone (it exited or crashed: nothing more will come), else True."""
    give_up = time.monotonic() + limit
    while True:
        used = node.seconds() if node else 0.0
        with cond:
            if cond.wait_for(arrived, quiet):
                return True
        if node is None or time.monotonic() >= give_up:
            return True
        node.refresh()
        if not node.alive():
            return False
        if node.seconds() - used >= _BUSY_SHARE * quiet or not _idle(node):
            continue
        # A thread of this bridge that read an output while this one held the interpreter
        # lock waits for the lock, in no busy state: release it a moment, then look again.
        with cond:
            if cond.wait_for(arrived, _SETTLE_S):
                return True
        if _idle(node):
            return True


def _settle(cond, state, quiet, node, limit):
    """After the last input: wait until the node (a ``_GroupCpu``) has been idle for
    ``quiet`` s -- whether or not outputs still arrive -- or ``limit`` s passed.  A node
    answering its inputs computes; one that publishes on a wall-clock timer (a heartbeat,
    its latest state at a fixed rate) is idle between its messages but never quiet, so
    waiting for its outputs to stop would last until the time limit.  Without a node to
    watch: until no answer arrived for ``quiet`` s, or ``limit`` s passed (answers on a
    timer would otherwise keep it waiting for ever).  Returns False when the node is gone."""
    if node is not None:
        return _await(cond, lambda: False, quiet, node, limit)  # no message ends it
    give_up = time.monotonic() + limit
    while time.monotonic() < give_up:
        with cond:
            seen = state["answers"]
        _await(cond, _answer_after(state, seen), quiet, None, limit)
        with cond:
            if state["answers"] == seen:
                return True
    return True


def _wait(pred, timeout, alive=None):
    """Poll ``pred`` until it holds (True) or ``timeout`` s pass (False); with ``alive``,
    also stop (False) once ``alive()`` says the node is gone, checked every 0.2 s (it
    scans /proc)."""
    deadline = time.monotonic() + timeout
    polls = 0
    while not pred():
        if time.monotonic() > deadline:
            return False
        polls += 1
        if alive is not None and polls % 20 == 0 and not alive():
            return pred()
        time.sleep(0.01)
    return True


#: How often (s) the bridge asks the master and the node whether an output is wired up.
_POLL_S = 0.05


def _publishers(master, topic, me):
    """The nodes other than this bridge that publish ``topic``, by the master."""
    pubs, _subs, _srvs = master.getSystemState()
    return next((sorted(set(nodes) - {me}) for name, nodes in pubs if name == topic), [])


def _sends_to(master, publisher, topic, me):
    """Whether node ``publisher`` sends ``topic`` to ``me``: a connection in its own bus
    information.  rospy counts a subscriber's connection once the publisher node agreed to
    it by XML-RPC, before the TCP connection is up and before the publisher has it: what
    the node publishes meanwhile is sent to nobody.  True when the node cannot tell (it is
    gone, or has no bus information): there is nothing to wait for then."""
    import rosgraph.masterapi  # noqa: PLC0415 - system Python only

    try:
        uri = master.lookupNode(publisher)
        code, _msg, links = xmlrpc.client.ServerProxy(uri).getBusInfo(me)
    except (OSError, xmlrpc.client.Error, rosgraph.masterapi.Error, ValueError):
        return True
    if code != 1:
        return True
    return any(
        len(link) > 4 and link[1] == me and link[2] != "i" and link[4] == topic for link in links
    )


def _sent_to(master, publisher, topic, me):
    """How many messages on ``topic`` node ``publisher`` has written to this bridge, by its
    own bus statistics; None when it cannot tell (it is gone, or keeps no statistics)."""
    import rosgraph.masterapi  # noqa: PLC0415 - system Python only

    try:
        node = xmlrpc.client.ServerProxy(master.lookupNode(publisher))
        code, _msg, links = node.getBusInfo(me)
        stats_code, _msg, stats = node.getBusStats(me)
        ours = {
            link[0]
            for link in links
            if len(link) > 4 and link[1] == me and link[2] != "i" and link[4] == topic
        }
        if code != 1 or stats_code != 1:
            return None
        # publishStats: [topic, (bytes,) [[connection id, bytes, messages, connected]*]]*
        return sum(
            conn[2]
            for entry in stats[0]
            if entry[0] == topic
            for conn in entry[-1]
            if conn[0] in ours
        )
    except (
        OSError,
        xmlrpc.client.Error,
        rosgraph.masterapi.Error,
        LookupError,
        TypeError,
        ValueError,
    ):
        return None


def _drain(master, received, me, limit):
    """Wait, up to ``limit`` s, until every message the nodes say they wrote to this bridge
    has come through ``received`` (``{topic: count}``, a callable): an answer the node
    sent at the end may still be in a socket or in a thread of this bridge waiting for the
    interpreter lock, where neither the node's threads nor ours look busy.  Returns the
    topics still short."""
    give_up = time.monotonic() + limit
    while True:
        short = []
        for topic, count in received().items():
            sent = [_sent_to(master, n, topic, me) for n in _publishers(master, topic, me)]
            if None not in sent and sum(sent) > count:
                short.append(topic)
        if not short or time.monotonic() >= give_up:
            return short
        time.sleep(_POLL_S)


def _wire_outputs(master, topics, me, advertise_s, connect_s, alive):
    """Wait until every node publishing one of ``topics`` sends it to this bridge: each
    topic ``advertise_s`` s to be advertised (a node may advertise only when it first
    answers: nothing to wait for then), one that is, up to ``connect_s`` s in all for its
    connections (slow on a loaded machine).  Returns the topics not connected in time."""
    start = time.monotonic()
    late = []
    for topic in topics:
        while True:
            now = time.monotonic()
            publishers = _publishers(master, topic, me)
            if not publishers and now >= start + advertise_s:
                break
            if publishers and all(_sends_to(master, n, topic, me) for n in publishers):
                break
            if alive is not None and not alive():
                return []  # the node is gone: nothing more will connect
            if now >= start + max(advertise_s, connect_s):
                late.append(topic)
                break
            time.sleep(_POLL_S)
    return late


def _group_alive(pgid):
    """Whether a process of group ``pgid`` still runs (one that has exited but is not yet
    reaped, a zombie, does not count)."""
    for name in os.listdir("/proc"):  # noqa: PTH208
        fields = _stat(name) if name.isdigit() else None
        if fields is not None and int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--inputs", default="")
    p.add_argument("--outputs", default="")
    p.add_argument("--triggers", default="")
    p.add_argument("--answers", default="")
    p.add_argument("--quiet", type=float, default=0.25)
    p.add_argument("--startup-timeout", type=float, default=20.0)
    p.add_argument("--output-wait", type=float, default=2.0)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--node-pgid", type=int, default=0)
    p.add_argument("--max-wait", type=float, default=300.0)
    args = p.parse_args()
    # rospy logs to stdout; stdout is the stream, so keep it private and point fd 1 at stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    src = os.fdopen(os.dup(0), "rb", buffering=1 << 20)

    import rosgraph  # noqa: PLC0415 - system Python only
    import rospy  # noqa: PLC0415
    from rosgraph_msgs.msg import Clock  # noqa: PLC0415

    rospy.init_node("adcloud_bridge", anonymous=True, disable_signals=True)
    writer = Writer(out)
    clock_pub = rospy.Publisher("/clock", Clock, queue_size=10)
    # outputs: messages received; answers: those on the answer topics (all outputs when
    # none are named), the only ones that end a synchronous wait
    state = {"now": 0, "outputs": 0, "answers": 0}
    split = [t for t in args.outputs.split(",") if t]
    answers = {t for t in args.answers.split(",") if t}
    # messages received from the nodes, by resolved output topic
    received = {rospy.resolve_name(t): 0 for t in split}
    cond = threading.Condition()
    described = set()

    me = rospy.get_name()

    def on_output(msg, topic):
        header = getattr(msg, "_connection_header", None) or {}
        if header.get("callerid") == me:
            return  # an input this bridge published on an output topic (/tf both ways)
        with cond:
            now = state["now"]
        msgtype = _binpipe_type(header.get("type", ""))
        if topic not in described:
            described.add(topic)
            meta = [topic, msgtype, "ros1msg"]
            meta += [header.get("message_definition", ""), header.get("md5sum", ""), "ros1"]
            writer.write(META, [meta])
        writer.write(DATA, [[topic, now, msgtype, msg._buff]])
        with cond:
            state["outputs"] += 1
            state["answers"] += not answers or topic in answers
            received[rospy.resolve_name(topic)] += 1
            cond.notify_all()

    # no Nagle delay on the outputs: an answer held back by it looks like no answer
    subs = [
        rospy.Subscriber(t, rospy.AnyMsg, on_output, callback_args=t, tcp_nodelay=True)
        for t in split
    ]
    # the node's CPU decides when it is idle in synchronous mode; its process group also
    # tells, in either mode, whether it is still there to subscribe at all
    node = _GroupCpu(args.node_pgid) if args.node_pgid and args.sync else None
    triggers = {t for t in args.triggers.split(",") if t}
    pubs = {}
    started = False
    # A node that exited or crashed midway answers nothing: the rest of the input is read
    # but neither published nor waited for (a quiet period per input, for nothing); the
    # adapter then reports the node's exit.
    gone = False
    for kind, records in read_stream(src):
        if kind == META:
            for topic, msgtype, _fmt, definition, md5sum, _ser in records:
                if topic not in pubs:
                    cls = _raw_class(_ros1_type(msgtype), md5sum or "*", definition)
                    pubs[topic] = (rospy.Publisher(topic, cls, queue_size=1000), cls)
            if not started:
                # Wait until the node is wired up, then answer with an empty META block:
                # the feeder starts the replay clock on it.
                started = True
                alive = (lambda: _group_alive(args.node_pgid)) if args.node_pgid else None
                for topic, (pub, _cls) in pubs.items():
                    if not _wait(
                        lambda p=pub: p.get_num_connections() > 0, args.startup_timeout, alive
                    ):
                        if alive is not None and not alive():
                            raise SystemExit(
                                f"adcloud bridge: the node exited before it subscribed to {topic}"
                            )
                        raise SystemExit(
                            f"adcloud bridge: no node subscribed to {topic} "
                            f"within {args.startup_timeout} s"
                        )
                late = _wire_outputs(
                    rosgraph.Master(me),
                    [rospy.resolve_name(t) for t in split],
                    me,
                    args.output_wait,
                    args.startup_timeout,
                    alive,
                )
                if late:
                    rospy.logwarn(
                        "the node's %s did not connect to the bridge within "
                        "%s s; what it publishes there before they do is lost",
                        ", ".join(late),
                        args.startup_timeout,
                    )
                _wait(lambda: clock_pub.get_num_connections() > 0, args.output_wait)
                writer.write(META, [])
            continue
        for topic, stamp, _msgtype, data in records:
            if topic not in pubs:
                raise SystemExit(f"adcloud bridge: no META record describes topic {topic}")
            if gone:
                continue
            with cond:
                state["now"] = stamp
                seen = state["answers"]
            clock_pub.publish(Clock(clock=rospy.Time(stamp // 10**9, stamp % 10**9)))
            pub, cls = pubs[topic]
            pub.publish(cls(data))
            if args.sync and (not triggers or topic in triggers):
                answered = _answer_after(state, seen)
                gone = not _await(cond, answered, args.quiet, node, args.max_wait)
    # The last outputs: wait until the node has been idle for one quiet period (watched
    # in either mode here: after the last input only the node's CPU tells an answer still
    # coming from a message its timer sends).
    if not gone:
        watch = node or (_GroupCpu(args.node_pgid) if args.node_pgid else None)
        gone = not _settle(cond, state, max(args.quiet, 0.05), watch, args.max_wait)
    if not gone:

        def counts():
            with cond:
                return dict(received)

        short = _drain(rosgraph.Master(me), counts, me, args.startup_timeout)
        if short:
            rospy.logwarn(
                "the node's last messages on %s did not reach the bridge within %s s",
                ", ".join(short),
                args.startup_timeout,
            )
    for sub in subs:
        sub.unregister()
    writer.close()
    rospy.signal_shutdown("end of input")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (EOFError, ValueError) as err:
        sys.stderr.write(f"adcloud bridge: bad input: {err}\n")
        sys.exit(2)
