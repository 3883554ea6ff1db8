"""A reaper that kills a task's child processes when the process that started them dies.

External programs a task starts -- a ``pipe`` command, a replayed node, its roscore --
are in process groups or sessions of their own, so that a kill reaches everything they
started; but for the same reason nothing kills them when the Spark Python worker that
started them is SIGKILLed (a cancelled job, a lost executor, Spark's task reaper).  A
command that reads its stdin sees end of file then and stops; one that hangs or ignores
its input would run for ever.  A :class:`Lifeline` closes that gap.

Used by :func:`adcloud.binpipe.pipe.pipe_blocks` and the node adapters of
:mod:`adcloud.sim`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

__all__ = ["LIFELINE_VARIABLE", "Lifeline"]

#: The environment variable that marks the processes a :class:`Lifeline` guards (see
#: :meth:`Lifeline.environ`).
LIFELINE_VARIABLE = "ADCLOUD_LIFELINE"

log = logging.getLogger(__name__)


# The reaper: a shell that reads process groups ("g<pgid>") and processes ("p<pid>") to
# guard, one a line, from a pipe whose only writer is the adapter's process.  "done" means
# the adapter tore everything down itself; end of file without it means the adapter died
# (its executor was SIGKILLed, Spark killed its Python worker), so the reaper kills what
# it guards and removes the run's temporary directory ($1).  PR_SET_PDEATHSIG would not
# do: it follows the thread that forked, not the process, it is not inherited by the
# processes a node starts, and a SIGKILLed roscore cannot stop rosmaster and rosout,
# which roslaunch starts in sessions of their own.
#
# A process started but not yet guarded -- the owner was killed between its fork and the
# "g<pgid>" line -- is found by the mark its environment carries ($2, see
# Lifeline.environ); so is whatever it started meanwhile.  One grep over every
# /proc/PID/environ: -z reads the NUL-separated variables, -x -F match the whole entry.
_REAPER = r"""
tmp=$1
mark=$2
guarded=""
while IFS= read -r line; do
  case "$line" in
    done) exit 0 ;;
    g|p|g*[!0-9]*|p*[!0-9]*) ;;
    g*|p*) guarded="$guarded $line" ;;
  esac
done
marked() {
  [ -n "$mark" ] || return 0
  for environ in $(grep -l -a -z -x -F -e "$mark" /proc/[0-9]*/environ 2>/dev/null); do
    pid=${environ#/proc/}
    pid=${pid%/environ}
    [ "$pid" = "$$" ] || guarded="$guarded g$pid p$pid"
  done
}
marked
# The guarded processes' children, found before anything is signalled and again before
# SIGKILL (a roscore still starting up may start rosout meanwhile): roslaunch starts
# rosmaster and rosout in sessions of their own, and if roscore is SIGKILLed before it
# stopped them, nothing else would.  They get SIGKILL only: SIGINT is roscore's to send.
parents=" "
for entry in $guarded; do parents="$parents${entry#?} "; done
children=""
find_children() {
  for stat in /proc/[0-9]*/stat; do
    IFS= read -r fields < "$stat" 2>/dev/null || continue
    set -- ${fields##*) }
    case "$parents" in
      *" $2 "*) pid=${stat#/proc/}; children="$children g${pid%/stat} p${pid%/stat}" ;;
    esac
  done
}
find_children
send() {
  for entry in $guarded; do
    case "$entry" in
      g*) kill -s "$1" -- "-${entry#g}" 2>/dev/null ;;
      p*) kill -s "$1" "${entry#p}" 2>/dev/null ;;
    esac
  done
}
alive() {
  for entry in $guarded $children; do
    case "$entry" in
      g*) kill -s 0 -- "-${entry#g}" 2>/dev/null && return 0 ;;
      p*) kill -s 0 "${entry#p}" 2>/dev/null && return 0 ;;
    esac
  done
  return 1
}
# SIGINT first: roslaunch (roscore) then stops rosmaster and rosout; SIGKILL whatever is
# left after 3 s.
send INT
tries=0
while [ "$tries" -lt 30 ] && alive; do
  sleep 0.1
  tries=$((tries + 1))
done
find_children
marked
guarded="$guarded $children"
send KILL
[ -n "$tmp" ] && rm -rf -- "$tmp"
exit 0
"""


class Lifeline:
    """Kills a run's processes if the process running it dies before tearing them down.

    A scenario's node, roscore and bridge outlive a Spark Python worker that is killed
    (SIGKILL, or the SIGHUP PySpark's daemon sends its workers when the executor dies):
    they are in sessions of their own (the ROS processes) or blocked elsewhere than on
    their stdin.  A :class:`Lifeline` starts a small reaper in its own session that kills
    every guarded process and group -- and removes ``tmp`` -- as soon as this process
    goes away without calling :meth:`release`.  Processes started with
    :meth:`environ`'s environment are guarded from the moment they start, also if this
    process dies before it could pass their ids on.
    """

    def __init__(self, tmp: Path | None = None) -> None:
        # unique per lifeline: our pid tells owners apart, the random part runs apart
        self._mark = f"{LIFELINE_VARIABLE}={os.getpid()}-{secrets.token_hex(8)}"
        # Not with an outer lifeline's mark (this process may run under one): that one's
        # release or reaper would kill this reaper before it did its work.
        self._proc = subprocess.Popen(
            ["/bin/sh", "-c", _REAPER, "adcloud-reaper", str(tmp or ""), self._mark],
            env={k: v for k, v in os.environ.items() if k != LIFELINE_VARIABLE},
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self._groups: set[int] = set()

    @property
    def pid(self) -> int:
        """The reaper's process id."""
        return self._proc.pid

    def environ(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this lifeline's mark: a process started with it is killed with the rest.

        The mark closes the window between a process's start and :meth:`guard_group`: if
        this process is killed in it, the reaper still finds the new process (and what it
        started, which inherits the environment).  It replaces an outer lifeline's mark;
        that one still reaches this process, whose death sets this lifeline off.
        """
        name, _, value = self._mark.partition("=")
        return {**env, name: value}

    def _send(self, line: str) -> None:
        stdin = self._proc.stdin
        assert stdin is not None
        with self._lock, contextlib.suppress(OSError, ValueError):
            stdin.write(line.encode("ascii") + b"\n")
            stdin.flush()

    def guard_group(self, pgid: int) -> None:
        """Kill process group ``pgid`` (a leader started with its own session) on death."""
        self._groups.add(int(pgid))
        self._send(f"g{int(pgid)}")

    def guard_process(self, pid: int) -> None:
        """Kill process ``pid`` on death."""
        self._send(f"p{int(pid)}")

    def release(self) -> None:
        """Everything guarded is torn down: let the reaper exit without killing.

        What still carries :meth:`environ`'s mark is killed first: processes a guarded
        command started in sessions of their own (a daemonising helper), which no kill of
        its group reaches, would otherwise outlive the run.  Each is logged.
        """
        self._kill_strays()
        self._send("done")
        with contextlib.suppress(OSError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _kill_strays(self) -> None:
        mark = self._mark.encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry.name}/environ").read_bytes()
                if mark not in environ or mark not in environ.split(b"\0"):
                    continue
                stat = Path(f"/proc/{entry.name}/stat").read_bytes()
                cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:  # gone meanwhile, or another user's
                continue
            pid = int(entry.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            fields = stat.rsplit(b")", 1)[-1].split()
            if len(fields) > 2 and int(fields[2]) in self._groups:
                continue  # a guarded group's member, killed with it and not yet gone
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
            log.warning(
                "killed %r (pid %d): a process the run started left it running in a "
                "session of its own; to keep a helper running past the run, start it "
                "without %s in its environment (env -u %s ...)",
                shown[:200],
                pid,
                LIFELINE_VARIABLE,
                LIFELINE_VARIABLE,
            )
