"""A killed replay process takes its nodes, roscore and temporary files with it.

Each test runs the adapter in a child Python process, waits until the processes it starts
are up, SIGKILLs the child -- what happens to a Spark Python worker when its executor is
killed -- and checks that nothing it started is left running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from adcloud._lifeline import Lifeline
from adcloud.sim.adapters import _stop_group, _stoppable


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (new sessions included: parents still link them)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _wait_until(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def _describe(pids: list[int]) -> str:
    """Each process's pid, state, parent and command line, for a failure message."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            state, ppid = fields[0].decode(), fields[1].decode()
            lines.append(f"{pid} [{state}, parent {ppid}] {cmdline.decode(errors='replace')}")
    return "; ".join(lines)


def _spawn(code: str, tmp_path: Path) -> subprocess.Popen[bytes]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.Popen([sys.executable, str(script)], start_new_session=True)


def _kill_and_check(child: subprocess.Popen[bytes], started: set[int], reaper: int) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 15
    while survivors := [p for p in started if _alive(p)]:
        if time.monotonic() > deadline:
            pytest.fail("still running 15 s after their owner was killed: " + _describe(survivors))
        time.sleep(0.05)
    _wait_until(lambda: not _alive(reaper), 5, "the reaper to exit")


def test_killing_the_owner_kills_guarded_groups_and_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "scratch").write_text("left by a node")
    ready = tmp_path / "ready"
    child = _spawn(
        f"""
        import subprocess, time
        from pathlib import Path
        from adcloud._lifeline import Lifeline
        line = Lifeline(Path({str(run_dir)!r}))
        # a group leader with a child of its own, as roscore has rosmaster and rosout
        group = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], start_new_session=True)
        plain = subprocess.Popen(["sleep", "600"])
        line.guard_group(group.pid)
        line.guard_process(plain.pid)
        Path({str(ready)!r}).write_text(str(line.pid))
        time.sleep(600)
        """,
        tmp_path,
    )
    try:
        _wait_until(ready.exists, 30, "the child to start its processes")
        _wait_until(lambda: len(_descendants(child.pid)) >= 4, 10, "the grandchild sleep")
        reaper = int(ready.read_text())
        started = _descendants(child.pid)
        assert reaper in started and len(started) >= 4  # reaper, sh, 2 x sleep
        _kill_and_check(child, started, reaper)
        assert not run_dir.exists()
    finally:
        if child.poll() is None:
            child.kill()


def test_a_process_killed_before_it_guards_what_it_started_takes_it_along(
    tmp_path: Path,
) -> None:
    """The owner dies between starting a command and passing on its id: the environment's
    mark finds it (and its child).  A process carrying a longer mark that merely starts with
    this one, and one carrying another lifeline's, are left alone."""
    ready = tmp_path / "ready"
    marker = f"6000.{os.getpid()}5"
    child = _spawn(
        f"""
        import os, subprocess, time
        from pathlib import Path
        from adcloud._lifeline import LIFELINE_VARIABLE, Lifeline
        line = Lifeline()
        env = line.environ(os.environ)
        # never guarded: the owner is "killed" before guard_group
        subprocess.Popen(
            ["sh", "-c", "sleep {marker} & wait"], env=env, start_new_session=True
        )
        mark = env[LIFELINE_VARIABLE]
        Path({str(ready)!r}).write_text(f"{{line.pid}} {{mark}}")
        time.sleep(600)
        """,
        tmp_path,
    )
    bystanders: list[subprocess.Popen[bytes]] = []
    try:
        _wait_until(lambda: ready.exists() and _marker_processes(marker), 30, "the command")
        reaper_text, mark = ready.read_text().split()
        other = Lifeline()
        other_mark = other.environ({})["ADCLOUD_LIFELINE"]
        other.release()
        for value in (mark + "0", other_mark):
            bystanders.append(
                subprocess.Popen(
                    ["sleep", "600"],
                    env={**os.environ, "ADCLOUD_LIFELINE": value},
                    start_new_session=True,
                )
            )
        started = _descendants(child.pid)
        assert _marker_processes(marker) <= started
        _kill_and_check(child, started, int(reaper_text))
        assert not _marker_processes(marker)
        assert all(b.poll() is None for b in bystanders)
    finally:
        if child.poll() is None:
            child.kill()
        for pid in _marker_processes(marker):
            os.kill(pid, signal.SIGKILL)
        for b in bystanders:
            b.kill()
            b.wait()


def test_release_kills_what_a_command_left_in_a_session_of_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A command that daemonises a helper (setsid) and exits: no kill of its group reaches
    the helper, the mark in its environment does.  A member of the guarded group that is
    still dying is killed without a warning."""
    helper_marker, member_marker = f"6000.{os.getpid()}6", f"6001.{os.getpid()}6"
    line = Lifeline()
    leader = subprocess.Popen(
        ["sh", "-c", f"setsid sleep {helper_marker} & sleep {member_marker}"],
        env=line.environ(os.environ),
        start_new_session=True,
    )

    def sleeps(marker: str) -> set[int]:
        return _marker_processes(marker) - {leader.pid}

    try:
        line.guard_group(leader.pid)
        _wait_until(lambda: sleeps(helper_marker) and sleeps(member_marker), 10, "the sleeps")
        (helper,) = sleeps(helper_marker)
        with caplog.at_level("WARNING", logger="adcloud._lifeline"):
            line.release()
        _wait_until(lambda: not _alive(helper), 5, "the daemonised helper to be killed")
        # the group's member too, but only the stray is reported
        _wait_until(lambda: not sleeps(member_marker), 5, "the group's sleep")
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 1 and f"(pid {helper})" in warned[0], warned
        assert f"sleep {helper_marker}'" in warned[0]
    finally:
        leader.kill()
        leader.wait()
        for pid in sleeps(helper_marker) | sleeps(member_marker):
            os.kill(pid, signal.SIGKILL)


def test_a_lifeline_under_another_keeps_its_reaper_when_the_outer_one_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that runs under an outer lifeline's mark (a pipe command that replays a
    node) starts a lifeline of its own: its reaper carried the outer mark, so the outer
    release killed it as a stray, and the inner run's node was left unguarded."""
    outer = Lifeline()
    ((name, value),) = outer.environ({}).items()
    monkeypatch.setenv(name, value)
    inner = Lifeline()
    try:
        outer.release()
        time.sleep(0.2)
        assert _alive(inner.pid)
    finally:
        inner.release()


def test_release_leaves_everything_to_its_owner(tmp_path: Path) -> None:
    line = Lifeline(tmp_path)
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        line.guard_group(sleeper.pid)
        line.release()
        assert not _alive(line.pid)
        time.sleep(0.2)
        assert sleeper.poll() is None  # released: the owner stops it, not the reaper
        assert tmp_path.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


_JOB = """
import sys, time
from adcloud.sim import NodeSpec, ReplayJob, ReplayTiming, plan_scenarios, run_scenario
job = ReplayJob(
    bags=({bag!r},),
    node=NodeSpec({command!r}, adapter={adapter!r}),
    input_topics=("/lidar/points",),
    output_topics=("/obstacles",),
    timing=ReplayTiming(timeout_s=600, startup_timeout_s=600),
).validate()
(scenario,) = plan_scenarios(list(job.bags), job.cut)
run_scenario(scenario, job)
"""


def _marker_processes(marker: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.add(int(entry.name))
            except OSError:
                continue
    return {p for p in found if _alive(p)}


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "behind-two-shells"])
def test_a_killed_pipe_replay_takes_its_node_along(
    tmp_path: Path, drive: object, wrapped: bool
) -> None:
    """A node that never reads its input (so never sees end of file) dies with its owner,
    also when it runs behind launch scripts (its grandparent is what the adapter started)."""
    bag = drive.bag  # type: ignore[attr-defined]
    marker = f"6000.{os.getpid()}{int(wrapped)}"  # a sleep nobody else runs
    command = f"sleep {marker}"
    if wrapped:
        command = f"sh -c \"sh -c 'sleep {marker}; true'; true\""
    child = _spawn(_JOB.format(bag=str(bag), command=command, adapter="pipe"), tmp_path)
    try:
        _wait_until(lambda: _marker_processes(marker), 60, "the pipe node to start")
        started = _descendants(child.pid)
        reapers = [
            p for p in started if b"adcloud-reaper" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(reapers) == 1
        _kill_and_check(child, started, reapers[0])
        assert not _marker_processes(marker)
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.ros
@pytest.mark.skipif(shutil.which("roscore") is None, reason="ROS 1 (roscore) is not installed")
def test_a_killed_ros1_replay_takes_roscore_and_the_node_along(
    tmp_path: Path, drive: object
) -> None:
    bag = drive.bag  # type: ignore[attr-defined]
    marker = f"6000.{os.getpid()}2"
    command = f"sleep {marker}"
    child = _spawn(_JOB.format(bag=str(bag), command=command, adapter="ros1"), tmp_path)
    try:
        _wait_until(lambda: _marker_processes(marker), 60, "the ROS node to start")

        def ros_up() -> bool:
            names = set()
            for pid in _descendants(child.pid):
                try:
                    names.add(Path(f"/proc/{pid}/cmdline").read_bytes())
                except OSError:
                    continue
            return any(b"rosmaster" in n for n in names) and any(
                b"_ros1_bridge" in n for n in names
            )

        _wait_until(ros_up, 60, "rosmaster and the bridge")
        started = _descendants(child.pid)
        reapers = [
            p for p in started if b"adcloud-reaper" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        assert len(reapers) == 1
        # the reaper's argument is the run's temporary directory
        tmp_dir = Path(Path(f"/proc/{reapers[0]}/cmdline").read_bytes().split(b"\0")[4].decode())
        assert tmp_dir.name.startswith("adcloud-ros1-") and tmp_dir.exists()
        _kill_and_check(child, started, reapers[0])
        assert not _marker_processes(marker)
        assert not tmp_dir.exists()
    finally:
        if child.poll() is None:
            child.kill()


# A group leader that does not stop on SIGINT and starts children in sessions of their own:
# roscore under load, whose rosmaster and rosout survive it when it is SIGKILLed.  It starts
# a second child when told to stop, as a roscore still starting up starts rosout; that
# child's command line holds the marker too (the marker and a 1).
_STUBBORN_LEADER = """
import os, signal, subprocess, time
def starting_up(*_):
    subprocess.Popen(["sleep", os.environ["MARKER"] + "1"], start_new_session=True)
signal.signal(signal.SIGINT, starting_up)
subprocess.Popen(["sleep", os.environ["MARKER"]], start_new_session=True)
while True:
    time.sleep(600)
"""  # the marker comes in the environment: only the children's command lines show it


def _stubborn_leader(marker: str) -> subprocess.Popen[bytes]:
    leader = subprocess.Popen(
        [sys.executable, "-c", _STUBBORN_LEADER],
        env={**os.environ, "MARKER": marker},
        start_new_session=True,
    )
    _wait_until(lambda: _marker_processes(marker), 30, "the leader's child")
    return leader


def test_the_reaper_kills_children_a_killed_leader_left_in_sessions_of_their_own(
    tmp_path: Path,
) -> None:
    marker = f"6000.{os.getpid()}3"
    ready = tmp_path / "ready"
    child = _spawn(
        f"""
        import os, subprocess, sys, time
        from pathlib import Path
        from adcloud._lifeline import Lifeline
        line = Lifeline()
        leader = subprocess.Popen(
            [sys.executable, "-c", {_STUBBORN_LEADER!r}],
            env={{**os.environ, "MARKER": {marker!r}}},
            start_new_session=True,
        )
        line.guard_group(leader.pid)
        Path({str(ready)!r}).write_text(str(line.pid))
        time.sleep(600)
        """,
        tmp_path,
    )
    try:
        _wait_until(lambda: ready.exists() and _marker_processes(marker), 30, "the leader")
        (grandchild,) = _marker_processes(marker)
        started = _descendants(child.pid)
        assert grandchild in started
        _kill_and_check(child, started, int(ready.read_text()))
        # and the child the leader started once the reaper began to stop it
        _wait_until(lambda: not _marker_processes(marker), 5, "the late child to exit")
    finally:
        if child.poll() is None:
            child.kill()
        for pid in _marker_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_stopping_a_leader_that_ignores_sigint_kills_its_children_too() -> None:
    marker = f"6000.{os.getpid()}4"
    leader = _stubborn_leader(marker)
    try:
        _stop_group(leader, grace_s=0.5)
        assert leader.poll() == -signal.SIGKILL
        _wait_until(lambda: not _marker_processes(marker), 5, "the leader's child to exit")
    finally:
        leader.kill()
        for pid in _marker_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_leader_that_stops_on_sigint_keeps_the_clean_path() -> None:
    # _stoppable: SIGINT is ignored when the tests run as a shell's background job
    group = subprocess.Popen(_stoppable(["sh", "-c", "sleep 600 & wait"]), start_new_session=True)
    _wait_until(lambda: len(_descendants(group.pid)) >= 1, 10, "the group's sleep")
    _stop_group(group)
    assert group.returncode is not None and group.returncode != -signal.SIGKILL


def test_ros_processes_stop_on_sigint_even_where_it_is_ignored(tmp_path: Path) -> None:
    """Started by a process that ignores SIGINT, a program still gets the default action."""
    out = tmp_path / "sigign"
    code = f"""
        import signal, subprocess
        from adcloud.sim.adapters import _stoppable
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        args = ["grep", "SigIgn", "/proc/self/status"]
        with open({str(out)!r}, "w") as f:
            subprocess.run(args, stdout=f, check=True)
            subprocess.run(_stoppable(args), stdout=f, check=True)
        """
    child = _spawn(code, tmp_path)
    assert child.wait(timeout=60) == 0
    plain, stoppable = (int(line.split()[1], 16) for line in out.read_text().splitlines())
    sigint = 1 << (signal.SIGINT - 1)
    assert plain & sigint  # inherited: what roscore would get without the reset
    assert not stoppable & sigint
