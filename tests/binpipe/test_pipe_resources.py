"""pipe_blocks leaves nothing behind and judges its command's input reading exactly:
file descriptors, processes and lifelines on every way out, input left unread however
small (no Spark needed)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest

from adcloud.binpipe.codec import encode_blocks
from adcloud.binpipe.errors import PipeCommandError
from adcloud.binpipe.pipe import pipe_blocks
from tests.processes import alive


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _blocks(n: int = 10) -> list[bytes]:
    return list(encode_blocks([("/t", i, "std_msgs/msg/String", b"x" * 50) for i in range(n)]))


#: A command that writes a valid, empty stream without reading its input.
_IGNORES_INPUT = [
    sys.executable,
    "-c",
    "import sys; from adcloud.binpipe.codec import encode_stream; "
    "sys.stdout.buffer.write(encode_stream([]))",
]


def _settled(before: set[str]) -> set[str]:
    """Descriptors open now that were not before, once the threads of a run have ended."""
    deadline = time.monotonic() + 5
    while (extra := _fds() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def test_a_failed_run_closes_the_command_pipes_while_its_error_is_held() -> None:
    """The error keeps the generator's frame (and so the Popen) alive through its
    traceback: the pipes were closed only when the error was dropped, one pair per
    failed task in a long-lived executor, each with a ResourceWarning."""
    before = _fds()
    errors = []
    for _ in range(3):
        with pytest.raises(PipeCommandError) as info:
            list(pipe_blocks(_blocks(), ["sh", "-c", "echo garbage; echo oops >&2; exit 3"]))
        errors.append(info.value)
    assert "exit code 3" in str(errors[0]) and "oops" in errors[0].stderr_tail
    assert not _settled(before)


def test_a_generator_closed_early_and_a_finished_run_close_their_pipes() -> None:
    before = _fds()
    outputs = pipe_blocks(_blocks(3000), "cat")
    next(outputs)
    outputs.close()
    assert len(list(pipe_blocks(_blocks(), "cat"))) == 1
    assert not _settled(before)


def test_on_start_failing_stops_the_command_and_closes_its_pipes(tmp_path: Path) -> None:
    """A callback that raises (the sim's CPU watch on a command already gone) left the
    command running on its open stdin and its pipes and lifeline open."""
    before = _fds()
    pids: list[int] = []

    def watch(pid: int) -> None:
        pids.append(pid)
        raise RuntimeError("cannot watch")

    with pytest.raises(RuntimeError, match="cannot watch"):
        list(pipe_blocks(_blocks(), ["sleep", "60"], on_start=watch))
    (pid,) = pids
    assert not alive(pid)
    assert not _settled(before)


def test_a_command_that_ignores_a_small_input_has_not_read_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Input that fits in the pipe never meets a broken pipe: a command that exits 0 with
    a valid stream without reading it passed as one that had read everything."""
    small = _blocks(5)
    with pytest.raises(PipeCommandError, match="stopped reading its input before its end"):
        list(pipe_blocks(small, _IGNORES_INPUT, require_all_input=True))
    with caplog.at_level(logging.INFO, logger="adcloud.binpipe.pipe"):
        assert list(pipe_blocks(small, _IGNORES_INPUT)) == []
    assert any("stopped reading its input early" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("n", [0, 5, 3000])
def test_a_command_that_reads_all_its_input_passes_the_check(n: int) -> None:
    sent = _blocks(n)
    out = list(pipe_blocks(sent, "cat", require_all_input=True))
    assert b"".join(out) == b"".join(sent)
