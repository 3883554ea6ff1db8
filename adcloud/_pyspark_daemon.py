"""PySpark's Python worker daemon, without a traceback each time Spark closes an idle worker.

Spark runs this module (``spark.python.daemon.module``, set by
:func:`adcloud.spark.spark_conf`) instead of ``pyspark.daemon``; it is that daemon with the
changes below.  Since Spark 4.1 (SPARK-54344) a worker whose final flush fails re-raises the
error, and the daemon prints its traceback to stderr before the worker exits.  The flush also
fails in the normal course of things: when Spark closes a reused worker that sits idle (after
a minute without tasks, or when the application stops), that worker's last write finds the
socket closed.  Users then saw ``BrokenPipeError`` tracebacks at the end of every job.  Here
that error ends the worker quietly with a non-zero code, which makes the daemon close it
just as the upstream error does; a task in flight is failed and retried by Spark as before.

It also loads PySpark from its installed package rather than from the ``pyspark.zip`` that
Spark puts first on the workers' ``PYTHONPATH``, when that zip is the one inside that very
package (``pip install pyspark``: the same files).  Python cannot cache bytecode for modules
imported from a zip, so every daemon, and every worker for what it imports after the fork,
compiled PySpark from source again: ~0.9 s of a core per executor start on 2 cores.  py4j's
zip beside it goes after the installed py4j when that is the same version (~70 ms a daemon).
A Spark distribution's own zips (``SPARK_HOME`` elsewhere) are left first, as Spark intends.

And it keeps the daemon's full garbage collection after every task cheap.  A reused worker
runs ``gc.collect()`` after each task, which walks every object the process holds: once a
task has imported torch (or Open3D, GTSAM, ...) that is ~180,000 objects and ~0.15 s of a
core per task on this kind of machine -- a third of the CPU time of a short training run
with evaluation went there.  Objects that live as long as the process (the modules and
what their import built) need not be walked again: after a task that imported modules,
the worker collects once and then freezes what is left (:func:`gc.freeze`), so later
collections walk only what tasks made since.  The daemon freezes its own objects before
it forks, as the ``gc`` documentation recommends, which also keeps the workers' collections
from writing to (and so copying) pages shared with the daemon.  A frozen object that
later becomes garbage in a reference cycle is not freed; one left when nothing was
imported is not frozen, so this bounds to what tasks that imported kept alive.

It kills only its own workers: the pid Spark asks it to kill is signalled only while it is
still the worker this daemon forked (see :class:`_OwnWorkersOnly`), never a process that got
the number after the worker ended.

Before it forks any worker the daemon imports the modules named in ``ADCLOUD_WORKER_IMPORTS``
(``SparkSettings.worker_imports``), so that each worker starts with them imported.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Any


def _installed_py4j_version(where: Path) -> str | None:
    """The version of the py4j package installed in ``where``, or None."""
    try:
        text = (where / "py4j" / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    # string operations, not ``re``: this module runs at every daemon start
    for line in text.splitlines():
        name, equals, value = line.partition("=")
        if equals and name.strip() == "__version__":
            return value.strip().strip("'\"")
    return None


def _prefer_installed_pyspark(path: list[str]) -> list[str]:
    """``path`` with ``<dir>/pyspark/python/lib/pyspark.zip`` moved to the end when ``<dir>``
    is on it too (the zip shipped inside the installed package), and the
    ``py4j-<version>-src.zip`` beside it too when ``<dir>`` also holds py4j ``<version>``."""
    here = {Path(p).resolve() for p in path if p}
    shipped = []
    for entry in path:
        zipped = Path(entry)
        name = zipped.name
        is_py4j = name.startswith("py4j-") and name.endswith("-src.zip")
        if (name != "pyspark.zip" and not is_py4j) or len(zipped.parents) < 4:
            continue
        package = zipped.parents[2]  # <dir>/pyspark
        site = package.parent
        if not (package / "__init__.py").is_file() or site.resolve() not in here:
            continue
        # py4j's bytecode is ~50 ms of every daemon start when imported from its zip; the
        # installed package of the same version holds the same files.
        version = name[len("py4j-") : -len("-src.zip")] if is_py4j else None
        if version is None or _installed_py4j_version(site) == version:
            shipped.append(entry)
    return [p for p in path if p not in shipped] + shipped


sys.path[:] = _prefer_installed_pyspark(sys.path)

import pyspark.daemon as _daemon  # noqa: E402 - after the path is set

_worker = _daemon.worker
_modules_frozen = 0  # len(sys.modules) at the last freeze


def _freeze_what_imports_built() -> None:
    """After a task that imported modules: collect, then freeze the survivors (see above)."""
    global _modules_frozen  # noqa: PLW0603 - one per worker process
    if len(sys.modules) != _modules_frozen:
        gc.collect()
        gc.freeze()
        _modules_frozen = len(sys.modules)


#: What :func:`_import_requested` imported (a task can read it through ``__main__``).
imported: list[str] = []


def _import_requested() -> None:
    """Import the modules of ``ADCLOUD_WORKER_IMPORTS`` (``adcloud.spark.WORKER_IMPORTS_ENV``);
    one that fails is reported on stderr (the executor's log), and the tasks that need it
    fail with their own import error as they would have."""
    for name in os.environ.get("ADCLOUD_WORKER_IMPORTS", "").replace(",", " ").split():
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as exc:  # reported here; the tasks that need it meet it again
            print(
                f"adcloud worker daemon: cannot import {name!r} before forking workers: "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )


def worker(sock: Any, authenticated: bool) -> int:
    """``pyspark.daemon.worker``, ending quietly when the JVM has closed the socket."""
    try:
        code: int = _worker(sock, authenticated)
    except BrokenPipeError:
        return 1
    _freeze_what_imports_built()
    return code


def _ppid_and_start(pid: int) -> tuple[int, int] | None:
    """Parent and start time (clock ticks after boot) of process ``pid``; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class _OwnWorkersOnly:
    """The ``os`` module as ``pyspark.daemon`` sees it, but its kill of a worker reaches only
    the worker this daemon forked under that pid.

    Spark asks the daemon to kill a worker by writing the worker's pid to it (a task killed
    or cancelled, an idle worker closed), and the daemon kills that pid.  Its workers are
    reaped the moment they exit (SIGCHLD ignored), so a worker that ended first no longer
    owns its pid: once the machine's pids wrap around (32768 on many Linux hosts, a few
    tens of minutes of a busy test run or nightly job) the kill lands on whatever process
    got the number since -- another session's Python worker, a ROS node, a shell (the
    likely cause of two jobs in two sessions failing at the same moment on CI with "Python
    worker exited unexpectedly (crashed)").  Here a pid is killed only while it is still the
    child this daemon forked: same parent, same start time.  Without ``/proc`` it kills as
    before.
    """

    def __init__(self) -> None:
        self._forked: dict[int, int] = {}  # pid -> start time
        self._checked = Path(f"/proc/{os.getpid()}/stat").exists()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fork(self) -> int:
        pid = os.fork()
        if pid > 0 and self._checked:
            found = _ppid_and_start(pid)
            if found is not None:
                self._forked[pid] = found[1]
            if len(self._forked) > 4096:  # workers that ended by themselves
                self._forked = {
                    p: t for p, t in self._forked.items() if _ppid_and_start(p) is not None
                }
        return pid

    def kill(self, pid: int, sig: int) -> None:
        if self._checked and pid > 0 and pid != os.getpid():
            started = self._forked.pop(pid, None)
            if started is None or _ppid_and_start(pid) != (os.getpid(), started):
                return  # that worker is gone; the pid is not ours to signal any more
        os.kill(pid, sig)


_daemon.worker = worker
_daemon.os = _OwnWorkersOnly()  # type: ignore[attr-defined,assignment]

if __name__ == "__main__":
    _import_requested()
    _freeze_what_imports_built()  # before the forks: the workers inherit it frozen
    _daemon.manager()
