"""Binary-safe piping of BinPipe streams through an external process.

Spark's ``RDD.pipe`` writes text lines; :func:`pipe_blocks` writes one BinPipe stream
to the command's stdin from a feeder thread while the calling thread reads the
command's stdout as a BinPipe stream, so neither side can deadlock on a full pipe
buffer however large the output.  Standard error is drained by a third thread that
keeps only its tail.  Any failure -- non-zero exit, a malformed output stream, a
timeout -- raises :class:`~adcloud.binpipe.errors.PipeCommandError` with the exit
code and the stderr tail.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO

from adcloud._lifeline import Lifeline
from adcloud.binpipe.codec import (
    DEFAULT_MAX_BLOCK_BYTES,
    Block,
    StreamReader,
    encode_end_block,
    stream_header,
    write_all,
)
from adcloud.binpipe.errors import BinpipeError, PipeCommandError

__all__ = ["pipe_blocks"]

log = logging.getLogger(__name__)

_STDERR_TAIL_BYTES = 8192


def _args(command: str | Sequence[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else list(command)


#: Linux pipes hold 64 KiB by default; a block is ~1 MiB, so grow them (up to the
#: unprivileged limit, /proc/sys/fs/pipe-max-size) to move a block in a few syscalls.
_PIPE_BYTES = 1 << 20


def _grow_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (OSError, AttributeError):
        log.debug("could not enlarge pipe %d; using the default size", fd)


class _Feeder(threading.Thread):
    """Writes the input stream to the process; remembers why it stopped."""

    def __init__(self, blocks: Iterable[bytes | bytearray | memoryview], sink: IO[bytes]) -> None:
        super().__init__(name="binpipe-feeder", daemon=True)
        self._blocks = blocks
        self._sink = sink
        self.error: BaseException | None = None
        self.broken_pipe = False
        self.records = 0

    def run(self) -> None:
        try:
            write_all(self._sink, stream_header())
            for raw in self._blocks:
                view = memoryview(raw)
                # Header check only: the blocks were validated when they were made,
                # and re-hashing every payload here would halve the pipe's throughput.
                header = Block.read_header(view)
                if len(view) != header.block_size:
                    raise BinpipeError(
                        f"an RDD element of {len(view)} bytes is not one whole block "
                        f"({header.block_size} bytes)"
                    )
                self.records += header.n_records
                write_all(self._sink, view)
            write_all(self._sink, encode_end_block(self.records))
        except BrokenPipeError:
            self.broken_pipe = True
        except BaseException as err:  # reported by the reading side
            self.error = err
        finally:
            try:
                self._sink.close()
            except BrokenPipeError:
                self.broken_pipe = True
            except OSError:
                pass


class _TailReader(threading.Thread):
    """Drains a stream, keeping its last bytes."""

    def __init__(self, source: IO[bytes]) -> None:
        super().__init__(name="binpipe-stderr", daemon=True)
        self._source = source
        self._tail: collections.deque[bytes] = collections.deque()
        self._size = 0

    def run(self) -> None:
        try:
            while chunk := self._source.read(65536):
                self._tail.append(chunk)
                self._size += len(chunk)
                while self._size - len(self._tail[0]) > _STDERR_TAIL_BYTES:
                    self._size -= len(self._tail.popleft())
        finally:
            # Closed here, not by the caller: a helper the command left behind may hold
            # stderr open after the run, and the read must not lose its file under it.
            with contextlib.suppress(OSError):
                self._source.close()

    @property
    def text(self) -> str:
        data = b"".join(self._tail)[-_STDERR_TAIL_BYTES:]
        return data.decode("utf-8", errors="replace")


#: Seconds to wait, once the command has exited, for the threads feeding its stdin and
#: draining its stderr: only a process it left holding them open keeps them longer.
_AFTER_EXIT_S = 2.0


def _trailing_bytes(stdout: IO[bytes]) -> bool:
    """Whether anything follows the END block on ``stdout``, without waiting for it."""
    fd = stdout.fileno()
    os.set_blocking(fd, False)
    try:
        return bool(os.read(fd, 1))
    except BlockingIOError:
        return False  # open elsewhere, nothing written: a helper left behind holds it
    finally:
        os.set_blocking(fd, True)


def _unread_bytes(fd: int) -> int:
    """Bytes written into the pipe whose read end is ``fd`` that nobody has read yet."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, sys.byteorder, signed=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the command's process group: the command and whatever it started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def pipe_blocks(
    blocks: Iterable[bytes | bytearray | memoryview],
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    on_start: Callable[[int], None] | None = None,
    on_exit: Callable[[int, str], None] | None = None,
    lifeline: Lifeline | None = None,
    require_all_input: bool = False,
) -> Iterator[bytearray]:
    """Send ``blocks`` through ``command`` and yield the blocks it writes back.

    ``command`` is split with :func:`shlex.split` when it is a string (no shell, as
    in ``RDD.pipe``).  ``env`` adds to the inherited environment.  ``timeout`` bounds
    the whole run in seconds; on expiry the process is killed.  The yielded blocks
    are fresh buffers the caller owns.  Closing the generator early kills the process.
    The command runs in a process group of its own (its id is the command's process id);
    every kill is of the whole group, so a wrapper script takes its children along.
    ``on_start`` is called with the process id once the command runs, before the first
    block is sent; ``on_exit`` with the exit code and the tail of its stderr once it has
    finished successfully (failures raise :class:`PipeCommandError`, which carries both).
    The group is guarded by ``lifeline`` (by a :class:`~adcloud._lifeline.Lifeline` of its
    own when none is given): if this process dies mid-run -- a Spark task killed with its
    Python worker, a lost executor -- the command is killed too instead of running on.
    Once the command has written its END block and exited, what is left of its group is
    killed, and (when the lifeline is released) so is what it started in sessions of its
    own, unless started without ``ADCLOUD_LIFELINE`` in its environment.  A command that
    exits 0 without reading all of its input is logged, or, with ``require_all_input``, a
    failure.
    """
    args = _args(command)
    shown = shlex.join(args)
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    own_lifeline = lifeline is None
    guard = Lifeline() if lifeline is None else lifeline
    # The command's stdin is a pipe of our own, and its read end stays open here too: once
    # the command has exited, what is left unread in it tells whether the command read its
    # whole input, however small (a write the command never read fails only when the pipe
    # is full).  It is closed as soon as the command is gone, so the feeder then stops.
    probe, stdin_fd = os.pipe()
    try:
        proc = subprocess.Popen(
            args,
            stdin=probe,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=guard.environ(full_env),  # guarded from its start, before guard_group
            cwd=cwd,
            bufsize=0,
            # its own process group, so that a kill reaches what it started as well: a
            # wrapper script's hung child would otherwise hold stdout open for ever
            process_group=0,
        )
    except OSError as err:
        os.close(probe)
        os.close(stdin_fd)
        if own_lifeline:
            guard.release()
        # Popen names the working directory when it is that which failed (missing, not a
        # directory, not searchable): then the command and PATH are not to blame
        hint = (
            f"its working directory {cwd!r}: {err.strerror}"
            if cwd is not None and err.filename == os.fspath(cwd)
            else f"{err.strerror}; check the command and PATH"
        )
        raise PipeCommandError(
            f"cannot start {shown!r}: {hint}",
            command=shown,
            returncode=None,
            stderr_tail="",
        ) from err
    assert proc.stdout is not None and proc.stderr is not None
    sink = os.fdopen(stdin_fd, "wb", buffering=0)  # the feeder closes it
    feeder = _Feeder(blocks, sink)
    stderr = _TailReader(proc.stderr)
    timed_out = threading.Event()
    watchdog: threading.Timer | None = None
    stopped_running = threading.Event()  # killed below while still running: no exit code

    def close_probe() -> None:
        nonlocal probe
        if probe >= 0:
            os.close(probe)
            probe = -1

    def failure(reason: str, cause: BaseException | None = None) -> PipeCommandError:
        running = proc.poll() is None or stopped_running.is_set()
        _kill_group(proc)
        proc.wait()
        close_probe()
        stderr.join(timeout=_AFTER_EXIT_S)
        code = None if running else proc.returncode  # our SIGKILL is not its exit code
        if timed_out.is_set():
            reason = f"timed out after {timeout} s"
            code = None
        tail = stderr.text
        msg = f"command {shown!r} {reason}"
        if code is not None:
            msg += f" (exit code {code})"
        elif running and not timed_out.is_set():
            msg += " (still running: stopped)"
        if tail:
            msg += f"; stderr tail:\n{tail}"
        err = PipeCommandError(msg, command=shown, returncode=code, stderr_tail=tail)
        err.__cause__ = cause
        return err

    started = time.monotonic()
    completed = False
    try:
        guard.guard_group(proc.pid)
        for fd in (stdin_fd, proc.stdout.fileno()):
            _grow_pipe(fd)
        if on_start is not None:
            on_start(proc.pid)
        feeder.start()
        stderr.start()
        if timeout is not None:

            def expire() -> None:
                timed_out.set()
                _kill_group(proc)

            watchdog = threading.Timer(timeout, expire)
            watchdog.daemon = True
            watchdog.start()

        reader = StreamReader(
            proc.stdout,
            max_block_bytes=max_block_bytes,
            name=f"output of {shown!r}",
            check_trailing=False,  # below, without waiting on helpers holding stdout
        )
        try:
            for block in reader:
                raw = block.raw.obj
                assert isinstance(raw, bytearray)
                yield raw
        except BinpipeError as err:
            # A node that died mid-stream shows up here as a truncated stream;
            # report the exit code rather than the symptom when there is one.
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
            if proc.poll() is None:
                # still running after writing garbage: stopped now, so that a feeder
                # blocked on the stdin it does not read ends at once, not in 5 s
                stopped_running.set()
                _kill_group(proc)
                proc.wait()
            close_probe()
            feeder.join(timeout=5)
            if feeder.error is not None:
                # The input itself failed (e.g. a corrupt bag): that is the cause.
                raise feeder.error from None
            # stopped above, still running: the -9 is ours, not an exit of the command's
            code = None if stopped_running.is_set() else proc.returncode
            detail = str(err).removeprefix(f"output of {shown!r}: ")
            if detail.startswith("empty input at offset 0"):
                reason = (
                    "closed its stdout without writing anything on it"
                    if stopped_running.is_set()
                    else "exited without writing anything on stdout"
                    if code
                    else "wrote nothing on stdout, where a BinPipe stream was expected"
                )
            elif stopped_running.is_set():
                reason = f"closed its stdout before finishing its output: {detail}"
            elif code:
                reason = f"exited before finishing its output: {detail}"
            else:
                reason = f"wrote a malformed stream: {detail}"
            raise failure(reason, err) from err
        code = proc.wait()
        unread = _unread_bytes(probe)
        close_probe()
        # The END block came and the command exited; a process it left behind (a
        # helper, in its group or in a session of its own) may still hold its stdin,
        # stdout or stderr open, so nothing below waits for their end of file.
        trailing = _trailing_bytes(proc.stdout)
        _kill_group(proc)  # what is left of its group goes with it
        feeder.join(timeout=_AFTER_EXIT_S)
        stderr.join(timeout=_AFTER_EXIT_S)
        if feeder.error is not None:
            raise feeder.error
        if timed_out.is_set():
            raise failure("timed out")
        if code != 0:
            raise failure("failed")
        if trailing:
            raise failure(f"wrote bytes after its END block at offset {reader.offset}")
        if unread or feeder.broken_pipe or feeder.is_alive():
            if require_all_input:
                raise failure("stopped reading its input before its end")
            # The command closed its stdin early yet exited 0 with a valid stream:
            # that is its right (e.g. `head`), but it is worth a log line.
            log.info("command %r stopped reading its input early", shown)
        completed = True
        if on_exit is not None:
            on_exit(code, stderr.text)
        elapsed = time.monotonic() - started
        log.debug("piped %d records through %r in %.2f s", feeder.records, shown, elapsed)
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if not completed:
            _kill_group(proc)
            proc.wait()
        close_probe()
        if feeder.ident is None:  # never started: its end of stdin is still ours
            sink.close()
        if stderr.ident is None:
            proc.stderr.close()
        proc.stdout.close()
        if own_lifeline:
            guard.release()
