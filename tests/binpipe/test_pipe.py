"""pipe_blocks and the node SDK, through real external processes (no Spark needed)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from adcloud.binpipe.codec import (
    Block,
    BlockKind,
    Message,
    StreamWriter,
    encode_blocks,
    iter_records,
)
from adcloud.binpipe.decode import ConnectionInfo, meta_block
from adcloud.binpipe.errors import BagError, BinpipeError, PipeCommandError
from adcloud.binpipe.node import read_records, run_node
from adcloud.binpipe.pipe import pipe_blocks
from tests.processes import alive


def _records(n: int, size: int = 100) -> list[tuple[str, int, str, bytes]]:
    return [
        (f"/t{i % 3}", 1_600_000_000_000_000_000 + i, "std_msgs/msg/String", os.urandom(size))
        for i in range(n)
    ]


def _node(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def _decode(blocks: list[bytearray]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for raw in blocks:
        block = Block.parse(memoryview(raw))
        if block.kind == BlockKind.DATA:
            out.extend(
                tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in block
            )
    return out


def test_cat_round_trips_binary_records_exactly() -> None:
    recs = _records(5000, 300)
    blocks = list(encode_blocks(recs, block_bytes=64 * 1024))
    assert len(blocks) > 5
    out = list(pipe_blocks(blocks, "cat"))
    assert _decode(out) == recs


def test_python_node_transforms_and_passes_meta(tmp_path: Path) -> None:
    cmd = _node(
        tmp_path,
        """
        from adcloud.binpipe.node import run_node
        def fn(msg):
            if msg.topic == "/t0":
                return None
            return (msg.topic + "/out", msg.timestamp + 1, msg.msgtype, bytes(msg.data)[::-1])
        run_node(fn)
        """,
    )
    recs = _records(3000)
    meta = meta_block(
        [ConnectionInfo("/t1", "std_msgs/msg/String", "ros1msg", "string data", "x", "ros1")]
    )
    out = list(pipe_blocks([meta, *encode_blocks(recs)], cmd))
    assert Block.parse(memoryview(out[0])).kind == BlockKind.META
    expected = [(t + "/out", s + 1, m, d[::-1]) for t, s, m, d in recs if t != "/t0"]
    assert _decode(out) == expected


def test_large_output_does_not_deadlock(tmp_path: Path) -> None:
    # Each input record fans out into 64 KiB outputs: far more than any pipe buffer,
    # written while the input is still being fed.
    cmd = _node(
        tmp_path,
        """
        from adcloud.binpipe.node import run_node
        def fn(msg):
            return [(msg.topic, msg.timestamp, msg.msgtype, bytes(65536)) for _ in range(8)]
        run_node(fn)
        """,
    )
    recs = _records(400, 10)
    out = _decode(list(pipe_blocks(list(encode_blocks(recs, block_bytes=1024)), cmd, timeout=120)))
    assert len(out) == 400 * 8
    assert all(len(r[3]) == 65536 for r in out)  # type: ignore[arg-type]


def test_failing_command_reports_exit_code_and_stderr(tmp_path: Path) -> None:
    cmd = _node(
        tmp_path,
        """
        import sys
        sys.stderr.write("something broke: bad calibration\\n")
        sys.exit(3)
        """,
    )
    with pytest.raises(PipeCommandError) as info:
        list(pipe_blocks(list(encode_blocks(_records(10))), cmd))
    assert info.value.returncode == 3
    assert "bad calibration" in info.value.stderr_tail
    assert "exit code 3" in str(info.value)


def test_node_crashing_mid_stream_is_reported(tmp_path: Path) -> None:
    cmd = _node(
        tmp_path,
        """
        from adcloud.binpipe.node import run_node
        seen = 0
        def fn(msg):
            global seen
            seen += 1
            if seen == 50:
                raise RuntimeError("segfault-like crash at record 50")
            return msg
        run_node(fn, block_bytes=256)
        """,
    )
    with pytest.raises(PipeCommandError) as info:
        list(pipe_blocks(list(encode_blocks(_records(200), block_bytes=512)), cmd))
    assert info.value.returncode not in (0, None)
    assert "crash at record 50" in info.value.stderr_tail


def test_garbage_output_is_a_clear_error(tmp_path: Path) -> None:
    cmd = _node(
        tmp_path,
        """
        import sys
        sys.stdin.buffer.read()
        sys.stdout.write("hello, I am a text program\\n")
        """,
    )
    with pytest.raises(PipeCommandError) as info:
        list(pipe_blocks(list(encode_blocks(_records(10))), cmd))
    assert "not a BinPipe stream" in str(info.value)


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("cat >/dev/null", r"wrote nothing on stdout, where a BinPipe stream was expected \(exit"),
        ("cat >/dev/null; exit 3", r"exited without writing anything on stdout \(exit code 3\)"),
        ("cat >/dev/null; printf abc", r"wrote a malformed stream: truncated stream at offset 0"),
        ("cat >/dev/null; printf abc; exit 3", r"exited before finishing its output: truncated"),
    ],
)
def test_a_command_without_a_stream_on_stdout_says_what_it_wrote(script: str, says: str) -> None:
    with pytest.raises(PipeCommandError, match=says) as info:
        list(pipe_blocks(list(encode_blocks(_records(3))), ["sh", "-c", script]))
    assert str(info.value).count("sh -c") == 1  # the command is named once


def test_a_command_stopped_for_garbage_has_no_exit_code_of_ours() -> None:
    """Killed by the reader for writing garbage while still running, a command has no exit
    code of its own: the SIGKILL's -9 would read as a crash."""
    garbage = ["sh", "-c", "printf 'text, not a stream'; sleep 30"]
    with pytest.raises(PipeCommandError, match=r"\(still running: stopped\)") as info:
        list(pipe_blocks([], garbage))
    assert info.value.returncode is None and "exit code" not in str(info.value)


def test_a_command_that_closes_its_stdout_and_runs_on_is_not_said_to_have_exited() -> None:
    """A node that closed its stdout but kept running was reported as "exited without
    writing anything on stdout (still running: stopped)": it said both."""
    for script, says in (
        ("exec >&-; sleep 30", "closed its stdout without writing anything on it"),
        ("printf abc; exec >&-; sleep 30", "closed its stdout before finishing its output"),
    ):
        with pytest.raises(PipeCommandError) as info:
            list(pipe_blocks([], ["sh", "-c", script]))
        text = str(info.value)
        assert says in text and text.endswith("(still running: stopped)"), text
        assert "exited" not in text and info.value.returncode is None


def test_a_command_writing_garbage_without_reading_is_stopped_at_once() -> None:
    """A node that writes garbage and reads none of its input, still running: the feeder,
    blocked writing its stdin, was joined for 5 s before the node was stopped (6 s for a
    failure known after a few milliseconds)."""
    garbage = ["sh", "-c", "printf 'text, not a stream'; sleep 30"]
    blocks = list(encode_blocks(_records(400, size=64 * 1024)))  # ~25 MB: beyond any pipe
    started = time.monotonic()
    with pytest.raises(PipeCommandError, match=r"\(still running: stopped\)"):
        list(pipe_blocks(blocks, garbage))
    assert time.monotonic() - started < 4.5  # 1 s for it to exit by itself; 6 s before


def test_missing_command(tmp_path: Path) -> None:
    with pytest.raises(PipeCommandError, match="cannot start"):
        list(pipe_blocks([], str(tmp_path / "no-such-program")))


def test_a_missing_working_directory_is_named_not_the_command(tmp_path: Path) -> None:
    """``cat`` is on PATH: what is missing is the ``cwd``, and the error says so."""
    where = tmp_path / "no-such-dir"
    with pytest.raises(PipeCommandError) as info:
        list(pipe_blocks([], "cat", cwd=str(where)))
    assert f"its working directory {str(where)!r}: No such file or directory" in str(info.value)
    assert "PATH" not in str(info.value)


def test_timeout_kills_a_hanging_command() -> None:
    with pytest.raises(PipeCommandError, match="timed out"):
        list(pipe_blocks(list(encode_blocks(_records(10))), "sleep 30", timeout=1))


def test_timeout_kills_what_a_wrapper_script_started(tmp_path: Path) -> None:
    """A node behind a wrapper (``sh -c``, a launch script) whose child hangs: the timeout
    kills the child too, which holds the output pipe open, so the run ends on time."""
    pidfile = tmp_path / "child.pid"
    wrapper = f"sleep 60 & echo $! > {pidfile}; wait"
    began = time.monotonic()
    with pytest.raises(PipeCommandError, match="timed out"):
        list(pipe_blocks(list(encode_blocks(_records(10))), ["sh", "-c", wrapper], timeout=1))
    assert time.monotonic() - began < 15
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_helpers_left_holding_the_pipes_do_not_hold_up_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A command that wrote its END block and exited is done, though a helper it started
    still holds its stdout: one in its group is killed, one in a session of its own too
    (it carries the run's lifeline mark; logged), and neither makes the run wait for it
    (or time out).  A helper started without the mark is left running."""
    records = _records(50)
    sent = list(encode_blocks(records))
    began = time.monotonic()
    in_group = list(pipe_blocks(sent, ["sh", "-c", "sleep 60 & exec cat"], timeout=30))
    assert _decode(in_group) == records
    pidfile = tmp_path / "helper.pid"
    node = _node(
        tmp_path,
        f"""
        import os, subprocess, sys
        helper = subprocess.Popen(["sleep", "60"], start_new_session=True)
        kept = subprocess.Popen(
            ["env", "-u", "ADCLOUD_LIFELINE", "sleep", "61"], start_new_session=True
        )
        open({str(pidfile)!r}, "w").write(f"{{helper.pid}} {{kept.pid}}")
        sys.stdout.buffer.write(sys.stdin.buffer.read())
        """,
    )
    try:
        with caplog.at_level("WARNING", logger="adcloud._lifeline"):
            assert _decode(list(pipe_blocks(sent, node, timeout=30))) == records
        helper, kept = (int(pid) for pid in pidfile.read_text().split())
        deadline = time.monotonic() + 5
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(helper)
        assert alive(kept)
        assert any(f"killed 'sleep 60' (pid {helper})" in r.getMessage() for r in caplog.records)
    finally:
        if pidfile.exists():
            for pid in pidfile.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
    assert time.monotonic() - began < 20


def test_bytes_after_the_end_block_are_an_error() -> None:
    with pytest.raises(PipeCommandError, match="wrote bytes after its END block at offset"):
        list(pipe_blocks(list(encode_blocks(_records(5))), ["sh", "-c", "cat; printf x"]))


def test_a_command_that_does_not_read_all_its_input(tmp_path: Path) -> None:
    """Exiting 0 with a valid stream before reading all input is a command's right (as
    ``head``'s), unless the caller requires the input read (a replayed node must)."""
    canned = tmp_path / "canned.binpipe"
    with canned.open("wb") as out, StreamWriter(out) as writer:
        for record in _records(2):
            writer.write(record)
    big = list(encode_blocks(_records(3000, size=1000)))  # more than a pipe buffer holds
    command = ["sh", "-c", f"exec cat {canned}"]
    assert len(_decode(list(pipe_blocks(big, command)))) == 2
    with pytest.raises(PipeCommandError, match="stopped reading its input before its end"):
        list(pipe_blocks(big, command, require_all_input=True))


def test_a_killed_caller_takes_its_command_along(tmp_path: Path) -> None:
    """The process running ``pipe_blocks`` is SIGKILLed (a Spark task killed with its
    Python worker) while its command hangs without reading: the command, in a process
    group of its own, is killed too instead of running on."""
    pidfile = tmp_path / "command.pid"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from adcloud.binpipe.pipe import pipe_blocks\n"
            f"list(pipe_blocks([], ['sh', '-c', 'echo $$ > {pidfile}; exec sleep 60']))",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert caller.poll() is None, "the caller ended before its command started"
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        command = int(pidfile.read_text())
        assert alive(command)
        # the caller hands the command's group to its reaper just after starting it: a
        # caller killed within that instant is not what this checks (on a loaded machine the
        # command wrote its pid first and the kill came before the hand-over)
        time.sleep(0.5)
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while alive(command) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(command), "the command outlived the process that started it"
    finally:
        caller.kill()
        caller.wait()


def test_input_error_propagates_with_its_own_type() -> None:
    def broken_input():  # type: ignore[no-untyped-def]
        yield from encode_blocks(_records(10))
        raise BagError("drive.bag: chunk at offset 4096 is corrupt")

    with pytest.raises(BagError, match="offset 4096"):
        list(pipe_blocks(broken_input(), "cat"))


def test_run_node_in_process_and_read_records() -> None:
    src = io.BytesIO()
    with StreamWriter(src) as w:
        for r in _records(20):
            w.write(r)
    src.seek(0)
    dst = io.BytesIO()
    n = run_node(lambda m: (m.topic, m.timestamp, m.msgtype, b"!"), stdin=src, stdout=dst)
    assert n == 20
    dst.seek(0)
    got = list(read_records(dst))
    assert all(isinstance(m, Message) and bytes(m.data) == b"!" for m in got)
    assert [m[1] for m in got] == [r[1] for r in _records(20)]


@pytest.mark.parametrize(
    ("returned", "says"),
    [
        (lambda m: m.topic, r"returned str '/t0'"),
        (lambda m: bytes(m.data), r"returned bytes b"),
        (lambda m: {"topic": m.topic}, r"returned dict \{'topic'"),
        (lambda m: 7, r"returned int 7"),
        (lambda m: [m, "oops"], r"returned a list holding str 'oops'"),
    ],
)
def test_a_node_function_returning_no_record_is_named(returned: Any, says: str) -> None:
    """A str, bytes or dict is iterable, but no iterable of records: it would become a
    record per character or byte; say what was returned instead."""
    src = io.BytesIO()
    with StreamWriter(src) as w:
        for r in _records(3):
            w.write(r)
    src.seek(0)
    with pytest.raises(BinpipeError, match=says) as info:
        run_node(returned, stdin=src, stdout=io.BytesIO())
    assert "an iterable of records, or None" in str(info.value)


def test_node_without_end_block_is_truncated() -> None:
    src = io.BytesIO()
    w = StreamWriter(src)
    w.write(("a", 1, "b", b"c"))
    w.flush_block()  # no close(): the producer died
    with pytest.raises(BinpipeError, match="truncated"):
        list(iter_records(src.getvalue()))
