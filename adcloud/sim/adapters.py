"""Node adapters: how a node under test is started, fed a scenario and read back.

Adapters are listed in a registry (:data:`ADAPTERS`, :func:`register_adapter`,
:func:`get_adapter`), all behind the :class:`NodeAdapter` protocol; a ``NodeSpec.adapter``
may also be an import path, ``package.module:attr``, imported where the node runs:

- ``pipe`` (:class:`PipeAdapter`): any program that reads one BinPipe stream on stdin and
  writes one on stdout (``docs/binpipe-format.md`` section 9.3; Python nodes use
  :func:`adcloud.binpipe.node.run_node`).  Each input message travels as its own block so
  the node sees it when it is due.
- ``ros1`` (:class:`Ros1Adapter`): a real ROS 1 node (a ``rosrun``/``roslaunch`` line or
  any executable).  Per run it starts a private ``roscore`` on a free port with its own
  ``ROS_HOME``/``ROS_LOG_DIR`` in a temporary directory, sets ``/use_sim_time``, starts the
  node and, as the pipe command, a bridge under the system Python with rospy
  (:mod:`adcloud.sim._ros1_bridge`) that publishes ``/clock`` and the input topics and
  writes the output topics back.  Every process is started in its own process group and
  the groups are torn down at the end, whatever happened.

Timing: ``rate=0`` replays as fast as possible, ``rate=r`` paces messages to recorded
time divided by ``r`` (1.0 = real time).  In synchronous mode (the default) the feeder
waits, after each message of a trigger topic, until the node has written an output or has
been *idle* for ``quiet_s`` (the first trigger message: ``startup_timeout_s``, for the
node's start-up; a node that writes a META block when it is ready ends that wait early).
Idle means the node's processes used less than a tenth of a core over the period and no
thread of theirs is waiting for a CPU at its end (read from ``/proc``): a node still
computing an answer -- on a slow or loaded machine, even one that got no CPU at all -- is
waited for, up to ``timeout_s``, so outputs do not depend on machine speed; a node that
answers nothing to some input costs one quiet period.  The ROS bridge waits the same way
on the node's process group, and after the last input, in either mode, until the node has
been idle for a quiet period: outputs still arriving then do not keep the replay going (a
node publishing on a wall-clock timer is never quiet, only idle between its messages).

Latency of an output = wall time it came back minus wall time the input with the same
timestamp (or, failing that, the latest earlier one) was written into the pipe, among
the inputs written before the output came back (an output stamped ahead of its input is
measured from the latest input written by then, never from a later one).  Pipe
nodes should stamp outputs with the timestamp of the input they answer; the ROS bridge
stamps outputs with the simulated clock, which in synchronous mode is the input's time.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import xmlrpc.client
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from adcloud._lifeline import Lifeline
from adcloud.binpipe.codec import Block, BlockKind, Message, encode_block
from adcloud.binpipe.decode import ConnectionInfo, meta_block
from adcloud.binpipe.errors import BinpipeError, PipeCommandError
from adcloud.binpipe.pipe import pipe_blocks
from adcloud.errors import MissingComponentError
from adcloud.sim._plugins import import_object
from adcloud.sim.errors import SimError

__all__ = [
    "ADAPTERS",
    "MAX_WAIT_S",
    "ROS_INSTALL_HINT",
    "SYSTEM_PYTHON",
    "NodeAdapter",
    "NodeRun",
    "NodeSpec",
    "PipeAdapter",
    "ReplayTiming",
    "Ros1Adapter",
    "check_ros",
    "drive_pipe",
    "get_adapter",
    "register_adapter",
]

log = logging.getLogger(__name__)

ROS_INSTALL_HINT = (
    "install ROS 1 from Debian: `sudo apt-get install -y --no-install-recommends ros-core "
    "python3-rospy python3-rosbag topic-tools rosbash` (scripts/install.sh does this)"
)
"""How to get the ROS 1 that the ``ros1`` adapter needs; part of every missing-ROS error."""

#: The interpreter that has rospy on Debian (not the virtual environment's).
SYSTEM_PYTHON = "/usr/bin/python3"
_BRIDGE = Path(__file__).with_name("_ros1_bridge.py")
_TAIL = 4000

#: The longest time limit or quiet period (s) a run may be given: the longest wait
#: ``threading`` accepts (about 292 years); a longer one, or ``inf``, overflows there.
MAX_WAIT_S = threading.TIMEOUT_MAX


@dataclass(frozen=True)
class NodeSpec:
    """The node under test: adapter name, command line, extra environment, directory.

    ``adapter`` is a registered name (:data:`ADAPTERS`) or ``package.module:attr``.
    ``command`` is split with :func:`shlex.split` when it is a string (no shell).
    """

    command: str | tuple[str, ...]
    adapter: str = "pipe"
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None

    @property
    def args(self) -> list[str]:
        """The command as an argument list; :class:`SimError` when a string does not split
        (an unclosed quote)."""
        if not isinstance(self.command, str):
            return list(self.command)
        try:
            return shlex.split(self.command)
        except ValueError as err:
            raise SimError(f"the node command {self.command!r} does not split: {err}") from err


@dataclass(frozen=True)
class ReplayTiming:
    """Pacing, synchronous mode and time limits of one node run (seconds).

    ``rate``: 0 = as fast as possible, else the factor on recorded time.
    ``trigger_topics``: input topics after which synchronous mode waits (empty: all
    inputs); each must be one of the job's input topics.  ``answer_topics``: output topics
    whose messages answer an input and so end its wait (empty: every output); name them
    when the node also publishes on a timer of its own, whose messages answer nothing.
    The limits and the quiet period are finite, at most :data:`MAX_WAIT_S`.
    """

    rate: float = 0.0
    sync: bool = True
    quiet_s: float = 0.25
    timeout_s: float = 300.0
    startup_timeout_s: float = 20.0
    trigger_topics: tuple[str, ...] = ()
    answer_topics: tuple[str, ...] = ()
    #: Pipe nodes: start the replay clock only when the node has written its first block
    #: (e.g. a META block announcing its outputs, written once it is loaded), waiting at
    #: most ``startup_timeout_s``.  The ROS bridge always signals readiness this way.
    wait_ready: bool = False
    #: The most output (MiB of message data on the output topics) one scenario's node
    #: may write: the replay holds a scenario's outputs in the executor's memory, and a
    #: node that floods them fails its scenario instead of taking the executor down.
    max_output_mb: float = 1024.0

    def validate(self) -> ReplayTiming:
        """Return ``self`` if usable, else raise :class:`SimError`."""
        if not (self.rate >= 0 and math.isfinite(self.rate)):
            raise SimError(f"rate must be >= 0 (0 = as fast as possible), not {self.rate}")
        if not 0 <= self.quiet_s <= MAX_WAIT_S:
            raise SimError(
                f"quiet_s must be >= 0 and at most {MAX_WAIT_S:.0f} (finite seconds of idle "
                f"node), not {self.quiet_s}"
            )
        for name in ("timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_WAIT_S:
                raise SimError(
                    f"{name} must be > 0 and at most {MAX_WAIT_S:.0f} (finite seconds), not {value}"
                )
        if not (self.max_output_mb > 0 and math.isfinite(self.max_output_mb)):
            raise SimError(f"max_output_mb must be a finite number > 0, not {self.max_output_mb}")
        return self


@dataclass
class NodeRun:
    """What a node did with one scenario.

    ``outputs`` hold owned bytes; ``received`` and ``sent`` are ``time.monotonic()``
    seconds; ``sent`` pairs each input's timestamp (ns) with when it was written.
    ``failure`` is None when the node ran and ended cleanly.  ``ignored`` counts the
    messages the node wrote on topics outside the output topics (dropped), by topic;
    ``published`` the topics outside them that a ROS node advertised, with their types
    (read from its private roscore's publisher list: the bridge does not subscribe to
    them, so they have no message count).
    """

    outputs: list[Message] = field(default_factory=list)
    received: list[float] = field(default_factory=list)
    sent: list[tuple[int, float]] = field(default_factory=list)
    output_connections: list[ConnectionInfo] = field(default_factory=list)
    exit_code: int | None = None
    failure: str | None = None
    stderr_tail: str = ""
    wall_s: float = 0.0
    ignored: dict[str, int] = field(default_factory=dict)
    published: dict[str, str] = field(default_factory=dict)


class NodeAdapter(Protocol):
    """Runs a node on one scenario's input messages and returns what came out."""

    def run(
        self,
        node: NodeSpec,
        inputs: Sequence[Message],
        connections: Sequence[ConnectionInfo],
        output_topics: Sequence[str],
        timing: ReplayTiming,
    ) -> NodeRun:
        """Feed ``inputs`` (time-ordered) to the node; ``connections`` describe their types.

        Node failures (crash, hang, garbage) come back as ``NodeRun.failure``; only
        infrastructure failures raise (:class:`SimError`, or the bag reader's error).
        """
        ...


class _Feed:
    """Feeds one message per block, pacing and (optionally) waiting for outputs."""

    def __init__(
        self,
        inputs: Sequence[Message],
        connections: Sequence[ConnectionInfo],
        timing: ReplayTiming,
        wait_for_outputs: bool,
        ready_signal: bool = False,
        ready_wait_s: float | None = None,
    ) -> None:
        self.inputs = inputs
        self.connections = connections
        self.timing = timing
        self.wait = wait_for_outputs and timing.sync
        self.triggers = set(timing.trigger_topics)
        self.cond = threading.Condition()
        self.outputs_seen = 0
        self.blocks_seen = 0
        self.sent: list[tuple[int, float]] = []
        self.stopped = False
        self.ready_signal = ready_signal
        #: How long to wait for the ready signal (default: the start-up limit).
        self.ready_wait_s = timing.startup_timeout_s if ready_wait_s is None else ready_wait_s
        #: The command's process id, once it runs (see :meth:`command_gone`).
        self.pid: int | None = None
        #: Whether the node is past its start-up (ready signal seen or first trigger sent).
        self.warm = False
        #: The node's CPU use (set once it runs; None: not watched).
        self.cpu: CpuWatch | None = None
        #: Whether the watched node is gone (exited, crashed): no answer is waited for.
        self.gone = False

    def _await_output(self, seen: int, patience: float) -> None:
        """Wait until an output arrives after ``seen`` outputs, or the node has been idle
        for ``patience`` s (see the module docstring), or ``timeout_s`` passed, or the
        node is gone.

        A node that died (crashed at start-up, killed at its time limit) answers nothing:
        waiting out the rest of a long patience (the start-up one) would hold up the
        replay's end -- its failure is reported only once the input side stops -- by up
        to ``startup_timeout_s``; nor is it waited for after each of the inputs left (a
        ROS node behind the bridge, which reads them all)."""
        give_up = time.monotonic() + self.timing.timeout_s
        while not self.gone:
            used = self.cpu.seconds() if self.cpu is not None else 0.0
            deadline = time.monotonic() + patience
            while True:
                with self.cond:
                    while self.outputs_seen == seen and not self.stopped:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.cond.wait(min(left, _ALIVE_CHECK_S))
                        if self.cpu is not None and time.monotonic() < deadline:
                            break  # look whether the node still runs, outside the lock
                    if self.outputs_seen != seen or self.stopped:
                        return
                if time.monotonic() >= deadline:
                    break
                if self.cpu is not None and not self.cpu.alive():
                    self.gone = True
                    return
            if self.cpu is None or time.monotonic() >= give_up:
                return
            if not self.cpu.alive():  # looks the members up again, as the check below needs
                self.gone = True
                return
            if self.cpu.seconds() - used < _BUSY_SHARE * patience and not self.cpu.running():
                return  # idle for a whole period: the node has nothing to say

    def output_arrived(self, n: int) -> None:
        """A DATA block came back with ``n`` answers (see ``ReplayTiming.answer_topics``;
        0: only messages that answer nothing)."""
        with self.cond:
            self.outputs_seen += n
            self.blocks_seen += 1
            self.cond.notify_all()

    def meta_arrived(self) -> None:
        """A META block came back: the node is ready or describes its outputs; not an
        answer (counting it would let the feeder run one message ahead of the node)."""
        with self.cond:
            self.blocks_seen += 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def command_gone(self) -> bool:
        """Whether the command (the pipe's process) has exited."""
        if self.pid is None:
            return False
        fields = _stat_fields(Path(f"/proc/{self.pid}"))
        return fields is None or fields[0] == b"Z"

    def blocks(self) -> Iterator[bytes]:
        yield meta_block(self.connections)
        if self.ready_signal:
            # The node side answers the META block with a block of its own once it is
            # ready (the ROS bridge: when the node subscribed); time starts then.  A
            # command that exits meanwhile (a bridge whose node never subscribed) is fed
            # nothing: its inputs were never sent to a node.
            deadline = time.monotonic() + self.ready_wait_s
            while True:
                with self.cond:
                    left = deadline - time.monotonic()
                    if self.blocks_seen or self.stopped or left <= 0:
                        break
                    self.cond.wait(min(left, _ALIVE_CHECK_S))
                if self.command_gone():
                    return
            self.warm = True
        wall0 = time.monotonic()
        t0 = self.inputs[0].timestamp if self.inputs else 0
        for msg in self.inputs:
            if self.stopped:
                return
            if self.timing.rate > 0:
                due = wall0 + (msg.timestamp - t0) / 1e9 / self.timing.rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            with self.cond:
                seen = self.outputs_seen
            block = encode_block([msg])
            if not self.gone:  # what a node that is gone never saw does not count as sent
                self.sent.append((msg.timestamp, time.monotonic()))
            yield block
            if self.wait and (not self.triggers or msg.topic in self.triggers):
                # The first trigger waits through the node's start-up; later ones for
                # one quiet period of an idle node.
                patience = self.timing.quiet_s if self.warm else self.timing.startup_timeout_s
                self.warm = True
                self._await_output(seen, patience)


#: A node using at least this share of one core during a quiet period is still busy.
_BUSY_SHARE = 0.1
#: How often (s) a long wait for an answer looks whether the node still runs.
_ALIVE_CHECK_S = 0.5
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """CPU time (user + system, s) used so far by process ``pid`` and its waited-for
    children, or with ``group`` by the live processes of process group ``pid`` (a ROS node
    and what it started), read from ``/proc``.

    A group's members are looked up once and again on :meth:`refresh`: reading a few stat
    files per input costs microseconds, scanning all of ``/proc`` milliseconds."""

    def __init__(self, pid: int, *, group: bool = False) -> None:
        self.pid = pid
        self.group = group
        self.members = [pid]
        self.refresh()

    def refresh(self) -> None:
        """Look the group's members up again (new children, exited ones)."""
        if not self.group:
            return
        members = []
        for path in Path("/proc").iterdir():
            fields = _stat_fields(path) if path.name.isdigit() else None
            if fields is not None and int(fields[2]) == self.pid:
                members.append(int(path.name))
        self.members = members

    def seconds(self) -> float:
        total = 0
        for pid in self.members:
            fields = _stat_fields(Path(f"/proc/{pid}"))
            if fields is not None:
                # utime, stime, cutime, cstime (fields 14-17 of proc(5))
                total += sum(int(v) for v in fields[11:15])
        return total * _TICK_S

    def alive(self) -> bool:
        """Whether a watched process still runs (exists and is no zombie); a group's
        members are looked up again."""
        self.refresh()
        for pid in self.members:
            fields = _stat_fields(Path(f"/proc/{pid}"))
            if fields is not None and fields[0] != b"Z":
                return True
        return False

    def running(self) -> bool:
        """Whether a thread of the watched processes is running or waiting for a CPU (state
        R) or for the disk (D): on a loaded machine a node that is computing may get no CPU
        time for a whole quiet period, and must not look idle."""
        for pid in self.members:
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            for task in tasks:
                fields = _stat_fields(task)
                if fields is not None and fields[0] in (b"R", b"D"):
                    return True
        return False


def _stat_fields(path: Path) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name; None if it is gone."""
    try:
        return (path / "stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _as_output(rec: tuple[object, ...]) -> Message:
    if (
        len(rec) == 4
        and isinstance(rec[0], str)
        and isinstance(rec[1], int)
        and isinstance(rec[2], str)
        and isinstance(rec[3], memoryview | bytes | bytearray)
    ):
        return Message(rec[0], rec[1], rec[2], bytes(rec[3]))
    shown = repr(rec)[:120]
    raise BinpipeError(f"an output record is not a message (topic, time, type, data): {shown}")


def _output_meta(rec: tuple[object, ...]) -> ConnectionInfo | None:
    if len(rec) == 6 and all(isinstance(v, str) for v in rec):
        return ConnectionInfo(*rec)  # type: ignore[arg-type]
    return None


def drive_pipe(
    command: Sequence[str],
    inputs: Sequence[Message],
    connections: Sequence[ConnectionInfo],
    output_topics: Sequence[str],
    timing: ReplayTiming,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    wait_for_outputs: bool = True,
    ready_signal: bool = False,
    ready_wait_s: float | None = None,
    watch_group: int | None = None,
    lifeline: Lifeline | None = None,
) -> NodeRun:
    """Run ``command`` as a pipe node on ``inputs``; the core of both adapters.

    Synchronous waits watch the CPU use of ``command``'s process, or of process group
    ``watch_group`` when given (the ROS node behind the bridge).  ``lifeline`` guards
    ``command``'s process group once it runs.

    Outputs on topics outside ``output_topics`` (when it is not empty) are dropped.
    With ``ready_signal`` the first data message waits until the command has written a
    block, for at most ``ready_wait_s`` (default ``timing.startup_timeout_s``; nothing is
    sent when the command exits meanwhile; see :class:`Ros1Adapter`).  A node that fails
    -- exit code, timeout, a malformed stream, non-message records -- gives a
    :class:`NodeRun` with ``failure`` set; errors of the input side propagate.
    """
    feed = _Feed(inputs, connections, timing, wait_for_outputs, ready_signal, ready_wait_s)
    run = NodeRun()
    wanted = set(output_topics)
    answers = set(timing.answer_topics)
    started = time.monotonic()
    if watch_group is not None:
        feed.cpu = CpuWatch(watch_group, group=True)

    def watch(pid: int) -> None:
        # pipe_blocks starts the command as the leader of its own process group (and
        # guards it with ``lifeline``): watch the group, so a node behind a wrapper
        # script counts with its children
        feed.pid = pid
        if feed.cpu is None:
            feed.cpu = CpuWatch(pid, group=True)

    def finished(code: int, stderr_tail: str) -> None:
        run.stderr_tail = stderr_tail[-_TAIL:]  # a passing node's warnings matter too

    outputs = pipe_blocks(
        feed.blocks(),
        list(command),
        env=env,
        cwd=cwd,
        timeout=timing.timeout_s,
        on_start=watch,
        on_exit=finished,
        lifeline=lifeline,
        require_all_input=True,  # a node that stops reading has not been replayed
    )
    limit = timing.max_output_mb * 2**20
    held = 0  # bytes of output message data kept
    try:
        for raw in outputs:
            block = Block.parse(memoryview(raw))
            now = time.monotonic()
            if block.kind == BlockKind.META:
                for rec in block:
                    info = _output_meta(rec)
                    if info is not None and (not wanted or info.topic in wanted):
                        run.output_connections.append(info)
                feed.meta_arrived()
                continue
            count = answered = 0
            for rec in block:
                msg = _as_output(rec)
                if wanted and msg.topic not in wanted:
                    run.ignored[msg.topic] = run.ignored.get(msg.topic, 0) + 1
                    continue
                run.outputs.append(msg)
                run.received.append(now)
                held += len(msg.data)
                count += 1
                answered += msg.topic in answers
            if held > limit:
                if isinstance(outputs, Generator):
                    outputs.close()  # kills the node
                run.failure = (
                    f"node wrote more than {timing.max_output_mb:g} MiB of output messages "
                    f"({len(run.outputs):,} messages): stopped; raise the limit "
                    "(--max-output-mb, ReplayTiming.max_output_mb) if that much is expected"
                )
                run.outputs.clear()  # what the scenario is judged on is gone with it
                run.received.clear()
                break
            # a block of other topics' messages only (a timer's) answers no input
            feed.output_arrived(answered if answers else max(count, 1))
        else:
            run.exit_code = 0
    except PipeCommandError as err:
        run.failure = str(err).split("; stderr tail:", 1)[0] + _text_on_stdout(str(err))
        run.exit_code = err.returncode
        run.stderr_tail = err.stderr_tail[-_TAIL:]
    except BinpipeError as err:
        if isinstance(outputs, Generator):
            outputs.close()  # kills the node
        run.failure = f"node wrote garbage: {err}"
        run.exit_code = None
    finally:
        feed.stop()
    run.sent = feed.sent
    run.wall_s = time.monotonic() - started
    return run


#: A block that does not start with a block's magic, as the stream reader tells it.
_BAD_BLOCK = re.compile(r"corrupt stream at offset \d+: block magic (b'(?:[^'\\]|\\.)*')")


def _text_on_stdout(failure: str) -> str:
    """A hint when the bytes where a node's next output block should start are text: a
    ``print()`` or a log handler on stdout, the usual way a pipe node breaks its stream
    once it has started it (the stream reader tells only the bad magic)."""
    found = _BAD_BLOCK.search(failure)
    if found is None:
        return ""
    magic = ast.literal_eval(found[1])
    if not magic or not all(32 <= b < 127 or b in b"\t\r\n" for b in magic):
        return ""
    return (
        f"; the node wrote text on stdout ({magic.decode()!r}...), where its BinPipe output "
        "goes: print and log to stderr (print(..., file=sys.stderr), logging's default)"
    )


def _own_python_first(extra: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The environment a pipe node adds: ``PATH`` with the directory of the Python running
    this task first (a node's ``python``/``python3`` is then the one that has adcloud and the
    job's packages -- on a cluster executors run the virtual environment's Python by its path,
    without it on ``PATH``, and ``python -m ...`` found the system one), then ``extra``."""
    here = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    parts = [p for p in path.split(os.pathsep) if p and p != here]
    return {"PATH": os.pathsep.join([here, *parts]), **dict(extra)}


class PipeAdapter:
    """``pipe``: the node is a program speaking BinPipe on stdin/stdout.  Its ``PATH`` starts
    with the directory of the task's Python, so ``python -m ...`` runs that one."""

    name = "pipe"

    def run(
        self,
        node: NodeSpec,
        inputs: Sequence[Message],
        connections: Sequence[ConnectionInfo],
        output_topics: Sequence[str],
        timing: ReplayTiming,
    ) -> NodeRun:
        """Run the node once over ``inputs`` (see :class:`NodeAdapter`)."""
        lifeline = Lifeline()
        try:
            return drive_pipe(
                node.args,
                inputs,
                connections,
                output_topics,
                timing,
                env=_own_python_first(node.env),
                cwd=node.cwd,
                ready_signal=timing.wait_ready,
                lifeline=lifeline,
            )
        finally:
            lifeline.release()


#: How long the ROS bridge may take to start (rospy) before its start-up wait begins.
_BRIDGE_START_S = 30.0
#: The least time (s) a run's roscore is given to start, whatever the node's start-up limit.
_MASTER_START_S = 30.0
#: How many free ports a run tries for its roscore before giving up.
_MASTER_ATTEMPTS = 3


class _PortTakenError(Exception):
    """Another ROS master took the port picked for a run's roscore."""


def _parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (None when it is gone)."""
    fields = _stat_fields(Path(f"/proc/{pid}"))
    return None if fields is None else int(fields[1])


@functools.cache
def _env_resets_signals() -> bool:
    """Whether ``env --default-signal`` works here (coreutils 8.31 and later)."""
    try:
        probe = subprocess.run(
            ["env", "--default-signal=INT", "true"], capture_output=True, check=False
        )
    except OSError:
        return False
    return probe.returncode == 0


def _stoppable(args: Sequence[str]) -> list[str]:
    """``args``, started so that SIGINT stops it.

    A process started with SIGINT ignored -- a job a shell ran in the background -- passes
    that on to every program it starts, and a roscore that ignores SIGINT can only be
    killed, leaving rosmaster and rosout to be killed one by one, 3 s later.
    ``env --default-signal=INT`` resets it (Python cannot without ``preexec_fn``, which is
    unsafe in a threaded process).
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and _env_resets_signals():
        return ["env", "--default-signal=INT", *args]
    return list(args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ros_env(tmp: Path, port: int, extra: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The environment of every ROS process of one run: private master, home and logs.

    The virtual environment's Python settings are removed: ROS runs the system Python.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "ROS_MASTER_URI")
    }
    path = env.get("PATH", "/usr/bin:/bin")
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in path.split(os.pathsep) if p != venv_bin)
    env.update(
        {
            "ROS_MASTER_URI": f"http://127.0.0.1:{port}",
            "ROS_HOME": str(tmp / "home"),
            "ROS_LOG_DIR": str(tmp / "log"),
            "ROS_HOSTNAME": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(dict(extra))
    return env


def _children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``."""
    found = []
    for path in Path("/proc").iterdir():
        fields = _stat_fields(path) if path.name.isdigit() else None
        if fields is not None and fields[0] != b"Z" and int(fields[1]) == pid:
            found.append(int(path.name))
    return found


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGINT the process group (ROS's clean shutdown), then SIGKILL what is left.

    roslaunch starts rosmaster and rosout in sessions of their own: when roscore does not
    stop them within ``grace_s`` and is SIGKILLed, they are SIGKILLed too -- those it had
    when it was told to stop, and those it started since (a roscore still starting up).
    """
    children = _children(proc.pid)
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5.0)):
        if sig == signal.SIGKILL:
            children += _children(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; group members it left behind still get the signal.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if sig == signal.SIGINT:
            return  # a clean exit: roslaunch stopped its children itself
        break
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-_TAIL:].decode("utf-8", errors="replace")


def check_ros() -> None:
    """Raise :class:`MissingComponentError` with the install hint if ROS 1 is missing."""
    if shutil.which("roscore") is None:
        raise MissingComponentError(
            f"ROS 1 is not installed (no `roscore` on PATH); {ROS_INSTALL_HINT}"
        )
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import rospy, rosgraph_msgs.msg"],
        capture_output=True,
        check=False,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
    )
    if probe.returncode != 0:
        raise MissingComponentError(
            f"rospy is not importable by {SYSTEM_PYTHON}; {ROS_INSTALL_HINT}"
        )


def _as_node_failure(failure: str, bridge: Sequence[str], node: Sequence[str]) -> str:
    """A failure :func:`drive_pipe` reported for the ROS bridge (``command '<bridge's
    command line>' timed out after ...``), told of the node under test: the time limit is
    the node's; anything else is said to be the bridge's, without its command line."""
    reason = failure.removeprefix(f"command {shlex.join(bridge)!r} ")
    if reason.startswith("timed out"):
        return f"node {shlex.join(node)!r} {reason}"
    return f"the ROS bridge to node {shlex.join(node)!r} {reason}"


#: Topics every ROS node publishes (its log), and rosout's own.
_ROS_LOG_TOPICS = ("/rosout", "/rosout_agg")


def _published_elsewhere(master_uri: str, output_topics: Sequence[str]) -> dict[str, str]:
    """``{topic: type}`` of what the nodes on the private master at ``master_uri`` publish
    outside ``output_topics`` -- not the bridge's ``/clock`` and inputs, nor the log: a
    node answering on another topic than ``--outputs`` says nothing the bridge reads.
    Empty when the master cannot tell (it is gone)."""
    master = xmlrpc.client.ServerProxy(master_uri)
    try:
        state: Any = master.getSystemState("/adcloud")
        types: Any = master.getTopicTypes("/adcloud")
        publishers: list[tuple[str, list[str]]] = [(t, list(n)) for t, n in state[2][0]]
        kinds = {str(topic): str(kind) for topic, kind in types[2]}
    except (OSError, xmlrpc.client.Error, IndexError, TypeError, ValueError):
        return {}
    outputs = {"/" + t.lstrip("/") for t in output_topics}
    return {
        topic: kinds.get(topic, "?")
        for topic, nodes in sorted(publishers)
        if topic not in outputs
        and topic not in _ROS_LOG_TOPICS
        and any(not n.startswith("/adcloud_bridge") and n != "/rosout" for n in nodes)
    }


class Ros1Adapter:
    """``ros1``: a real ROS 1 node on a private roscore, fed through the rospy bridge.

    Failures name the node's command line, and ``exit_code`` is the node's own: None when
    it was still running when the run ended (and so was stopped), never the bridge's."""

    name = "ros1"

    def __init__(self, output_wait_s: float = 2.0) -> None:
        #: How long the bridge waits for the node to advertise each output topic before
        #: it starts publishing (nodes like ``topic_tools/relay`` advertise only later).
        self.output_wait_s = output_wait_s

    def _start_master(
        self, env: dict[str, str], tmp: Path, port: int, timeout: float, lifeline: Lifeline
    ) -> subprocess.Popen[bytes]:
        with (tmp / "roscore.log").open("wb") as logf:
            core = subprocess.Popen(
                _stoppable(["roscore", "-p", str(port)]),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        lifeline.guard_group(core.pid)
        master = xmlrpc.client.ServerProxy(env["ROS_MASTER_URI"])
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = master.getPid("/adcloud")
                if isinstance(reply, list) and len(reply) > 2 and reply[0] == 1:
                    # The port was free when picked; another run's roscore may have taken
                    # it since.  Its master answers too: only ours is roscore's child.
                    if _parent_pid(int(reply[2])) != core.pid:
                        _stop_group(core)
                        raise _PortTakenError(port)
                    break
            except OSError:
                pass
            if core.poll() is not None or time.monotonic() > deadline:
                tail = _tail(tmp / "roscore.log")
                _stop_group(core)
                if "already running" in tail:
                    raise _PortTakenError(port)
                raise SimError(f"roscore on port {port} did not start: {tail[-1000:]}")
            time.sleep(0.1)
        master.setParam("/adcloud", "/use_sim_time", True)
        return core

    def run(
        self,
        node: NodeSpec,
        inputs: Sequence[Message],
        connections: Sequence[ConnectionInfo],
        output_topics: Sequence[str],
        timing: ReplayTiming,
    ) -> NodeRun:
        """Run the node once over ``inputs`` on a private roscore (see :class:`NodeAdapter`)."""
        check_ros()
        foreign = sorted({c.topic for c in connections if c.serialization != "ros1"})
        if foreign:
            # the scenario's bag, not the infrastructure: failing the task would fail the
            # whole job (the ROS 1 bags' results with it) after retries that cannot help
            return NodeRun(
                failure=f"the ros1 adapter replays ROS 1 messages; {', '.join(foreign)} "
                "are not ROS 1 serialized (ROS 2 bags need a ROS 2 adapter)"
            )
        program = node.args[0]
        if node.cwd is not None and not Path(node.cwd).is_dir():
            return NodeRun(
                failure=f"cannot start {shlex.join(node.args)!r}: its working directory "
                f"{node.cwd!r} is no directory"
            )
        # a bare name is looked up on PATH; a relative path (./my_node) is started in
        # the node's working directory
        here = Path(node.cwd) if node.cwd is not None else Path()
        if not ((here / program).is_file() if os.sep in program else shutil.which(program)):
            return NodeRun(failure=f"cannot start {shlex.join(node.args)!r}: no such program")
        tmp = Path(tempfile.mkdtemp(prefix="adcloud-ros1-"))
        procs: list[subprocess.Popen[bytes]] = []
        lifeline = Lifeline(tmp)
        try:
            for attempt in range(_MASTER_ATTEMPTS):
                port = _free_port()
                env = lifeline.environ(_ros_env(tmp, port, node.env))
                try:
                    # the master is infrastructure: the node's start-up limit (a few
                    # seconds for a fast node) is no limit for it on a loaded executor,
                    # where missing it failed the task and, after retries, the job
                    core = self._start_master(
                        env, tmp, port, max(timing.startup_timeout_s, _MASTER_START_S), lifeline
                    )
                except _PortTakenError:
                    log.info("port %d was taken by another ROS master; picking another", port)
                    if attempt + 1 == _MASTER_ATTEMPTS:
                        raise SimError(
                            f"roscore found another ROS master on each of {_MASTER_ATTEMPTS} "
                            "free ports it picked; is something starting masters in a loop?"
                        ) from None
                    continue
                procs.append(core)
                break
            node_log = tmp / "node.log"
            with node_log.open("wb") as logf:
                try:
                    node_proc = subprocess.Popen(
                        _stoppable(node.args),
                        env=env,
                        cwd=node.cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                except OSError as err:
                    return NodeRun(
                        failure=f"cannot start {shlex.join(node.args)!r}: {err.strerror}"
                    )
            lifeline.guard_group(node_proc.pid)
            procs.append(node_proc)
            bridge = [
                SYSTEM_PYTHON,
                str(_BRIDGE),
                "--inputs",
                ",".join(sorted({c.topic for c in connections})),
                "--outputs",
                ",".join(output_topics),
                "--triggers",
                ",".join(timing.trigger_topics),
                "--answers",
                ",".join(timing.answer_topics),
                "--quiet",
                str(timing.quiet_s),
                "--startup-timeout",
                str(timing.startup_timeout_s),
                "--output-wait",
                str(self.output_wait_s),
            ]
            bridge += ["--node-pgid", str(node_proc.pid)]
            if timing.sync:
                bridge += ["--sync", "--max-wait", str(timing.timeout_s)]
            run = drive_pipe(
                bridge,
                inputs,
                connections,
                output_topics,
                timing,
                env=env,
                ready_signal=True,
                # the bridge gives up on a node that does not subscribe by itself, after
                # startup_timeout_s counted from its own start: the feeder waits for that
                ready_wait_s=timing.startup_timeout_s + _BRIDGE_START_S,
                watch_group=node_proc.pid,
                lifeline=lifeline,
            )
            run.published = _published_elsewhere(env["ROS_MASTER_URI"], output_topics)
            code = node_proc.poll()
            if code is not None and code != 0:
                # The node died on its own: that is the scenario's failure, in its own last
                # words; what the bridge then reported (its input cut short) is noise.
                if run.failure:
                    log.debug("bridge, after the node exited: %s", run.failure)
                tail = _tail(node_log)
                last = next((ln for ln in reversed(tail.splitlines()) if ln.strip()), "")
                run.failure = f"node {shlex.join(node.args)!r} exited with code {code}" + (
                    f": {last.strip()[:200]}" if last else ""
                )
                run.exit_code = code
                run.stderr_tail = tail
            elif code == 0 and run.failure is None:
                # a ROS node runs until it is stopped: one that ended by itself did not
                # see the rest of the replay
                run.failure = (
                    f"node {shlex.join(node.args)!r} exited (code 0) before the replay ended"
                )
                run.exit_code = 0
                run.stderr_tail = _tail(node_log)
            elif run.failure is not None:
                # the node still runs (stopped below: no exit code of its own) or ended
                # with 0; the bridge's exit code is not the node's
                run.exit_code = code
                # the bridge says what went wrong in its own last words ("no node
                # subscribed to ..."): that, not its command line, is the reason
                said = [
                    line.removeprefix("adcloud bridge: ").strip()
                    for line in run.stderr_tail.splitlines()
                    if line.startswith("adcloud bridge: ")
                ]
                if said:
                    run.failure = said[-1][:300]
                else:
                    run.failure = _as_node_failure(run.failure, bridge, node.args)
                run.stderr_tail = (
                    f"--- bridge ---\n{run.stderr_tail}\n--- node ---\n{_tail(node_log)}"
                )[-_TAIL:]
            else:
                run.exit_code = code if code is not None else 0
                run.stderr_tail = _tail(node_log)
            return run
        finally:
            for proc in reversed(procs):
                _stop_group(proc)
            shutil.rmtree(tmp, ignore_errors=True)
            lifeline.release()


#: The adapter registry: name -> factory.  Add your own with :func:`register_adapter`.
ADAPTERS: dict[str, Callable[[], NodeAdapter]] = {"pipe": PipeAdapter, "ros1": Ros1Adapter}


def register_adapter(name: str, factory: Callable[[], NodeAdapter]) -> None:
    """Make ``factory()`` the adapter for ``NodeSpec(adapter=name)`` in this process.

    :func:`~adcloud.sim.replay.run_replay` sends the factory its job uses to the executors
    with cloudpickle: register a class or a module-level function.
    """
    ADAPTERS[name] = factory


def get_adapter(name: str) -> NodeAdapter:
    """A new adapter for ``name`` (registered, or ``package.module:attr``); raises
    :class:`SimError` listing the known ones."""
    factory = ADAPTERS.get(name)
    if factory is None and ":" in name:
        factory = import_object(name, "node adapter")
    if factory is None:
        raise SimError(
            f"unknown node adapter {name!r}; known: {', '.join(sorted(ADAPTERS))}, "
            "or your own as package.module:attr"
        )
    return factory()
