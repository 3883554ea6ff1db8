"""PySpark's Python worker daemon, without a traceback each time Spark closes an idle worker.

Spark runs this module (``spark.python.daemon.module``, set by
:func:`adcloud.spark.spark_conf`) instead of ``pyspark.daemon``; it is that daemon with one
change.  Since Spark 4.1 (SPARK-54344) a worker whose final flush fails re-raises the error,
and the daemon prints its traceback to stderr before the worker exits.  The flush also fails
in the normal course of things: when Spark closes a reused worker that sits idle (after a
minute without tasks, or when the application stops), that worker's last write finds the
socket closed.  Users then saw ``BrokenPipeError`` tracebacks at the end of every job.  Here
that error ends the worker quietly with a non-zero code, which makes the daemon close it
just as the upstream error does; a task in flight is failed and retried by Spark as before.
"""

from __future__ import annotations

from typing import Any

import pyspark.daemon as _daemon

_worker = _daemon.worker


def worker(sock: Any, authenticated: bool) -> int:
    """``pyspark.daemon.worker``, ending quietly when the JVM has closed the socket."""
    try:
        code: int = _worker(sock, authenticated)
    except BrokenPipeError:
        return 1
    return code


_daemon.worker = worker

if __name__ == "__main__":
    _daemon.manager()
