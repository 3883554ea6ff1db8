"""``adcloud._commit``: an output directory a job fills in staging and the driver commits."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fsspec
import pytest

from adcloud._commit import JobOutput
from adcloud.errors import AdcloudError


class RefusedError(AdcloudError):
    pass


@pytest.fixture
def fs() -> Iterator[Any]:
    memory = fsspec.filesystem("memory")
    yield memory
    if memory.exists("/out"):
        memory.rm("/out", recursive=True)


def _output(fs: Any, overwrite: bool = True) -> JobOutput:
    return JobOutput(
        fs,
        "/out",
        "memory://out",
        overwrite=overwrite,
        ours=lambda name: name.startswith("part-") or name in ("DONE", "index.json"),
        error=RefusedError,
        what="this job",
    )


def _tree(fs: Any) -> dict[str, bytes]:
    return {p.removeprefix("/out/"): fs.cat_file(p) for p in fs.find("/out")}


def test_the_old_output_goes_marker_first_and_the_new_one_comes_whole(fs: Any) -> None:
    for name, data in {
        "part-0": b"old0",
        "part-1": b"old1",
        "index.json": b"{}",
        "DONE": b"",
    }.items():
        fs.pipe(f"/out/{name}", data)
    output = _output(fs)
    output.start()
    staged = [f"{output.staging}/part-0-attempt2", f"{output.staging}/part-1-attempt1"]
    for path in staged:
        fs.pipe(path, b"new")
    removed: list[str] = []
    rm = fs.rm

    def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
        removed.append(str(path).rsplit("/", 1)[-1])
        return rm(path, *args, **kwargs)

    fs.rm = spy
    try:
        output.commit(list(zip(staged, ["part-0", "part-1"], strict=True)), first=("DONE",))
    finally:
        del fs.rm
    assert removed[0] == "DONE"  # a reader never takes the mix for a complete output
    assert _tree(fs) == {"part-0": b"new", "part-1": b"new"}  # the caller writes DONE last


def test_a_failed_job_leaves_the_output_as_it_was(fs: Any) -> None:
    fs.pipe("/out/part-0", b"old")
    output = _output(fs)
    output.start()
    fs.pipe(f"{output.staging}/part-0-x", b"half")
    output.abort()
    assert _tree(fs) == {"part-0": b"old"}
    fresh = JobOutput(
        fs, "/fresh", "memory://fresh", overwrite=False, ours=bool, error=RefusedError, what="it"
    )
    fresh.start()
    fresh.abort()
    assert not fs.exists("/fresh")  # a directory the job made goes with it


def test_what_is_not_ours_is_never_replaced(fs: Any) -> None:
    fs.pipe("/out/part-0", b"old")
    with pytest.raises(RefusedError, match="already exists and is not empty; pass overwrite=True"):
        _output(fs, overwrite=False)
    fs.pipe("/out/notes.txt", b"mine")
    with pytest.raises(RefusedError, match=r"files this job did not write \(e\.g\. notes\.txt\)"):
        _output(fs)
    fs.rm("/out/notes.txt")
    fs.pipe("/out/_temporary/crashed/part-0-y", b"left by a killed driver")
    _output(fs)  # a crashed job's staging is no reason to refuse


def test_a_file_where_the_directory_should_be_is_refused_as_a_file(fs: Any) -> None:
    """ls() of a file lists the file itself: it passed for an entry of the job's own (or
    was called a foreign file named like itself), and staging under it failed later."""
    fs.pipe("/out", b"a file")
    for overwrite in (True, False):
        with pytest.raises(
            RefusedError,
            match=r"^memory://out is a file, not a directory this job can write into; "
            "remove it or choose another directory$",
        ):
            _output(fs, overwrite=overwrite)
    assert fs.cat_file("/out") == b"a file"


def test_a_job_that_fails_beside_another_leaves_the_other_s_output(fs: Any) -> None:
    """Two jobs write a new directory: the first commits, the second fails. Its abort
    removed the whole directory it had found missing, and the first job's output with it."""
    failing, done = _output(fs, overwrite=False), _output(fs, overwrite=False)
    failing.start()
    done.start()
    fs.pipe(f"{failing.staging}/part-0-x", b"half")
    fs.pipe(f"{done.staging}/part-0-y", b"whole")
    done.commit([(f"{done.staging}/part-0-y", "part-0")])
    fs.pipe(f"{failing.staging}/part-1-x", b"half")  # its tasks write on, then it fails
    failing.abort()
    assert _tree(fs) == {"part-0": b"whole"}


@pytest.mark.parametrize("overwrite", [False, True])
def test_what_another_job_committed_meanwhile_is_never_lost_silently(
    fs: Any, overwrite: bool
) -> None:
    """Two jobs start on one output and both commit. Without overwrite the second found the
    first's output already there only because it looked at the start: it is refused (its
    staging dropped, the first's output kept). With overwrite the last to commit replaces
    the output whole -- the first's commit removed the second's staging, and the second
    then deleted the first's files by its old listing and failed moving its own."""
    fs.pipe("/out/part-0", b"old") if overwrite else None
    first, second = _output(fs, overwrite), _output(fs, overwrite)
    for job, data in ((first, b"first"), (second, b"second")):
        job.start()
        fs.pipe(f"{job.staging}/part-0-a", data)
        fs.pipe(f"{job.staging}/part-1-a", data)
    moves = [(f"{first.staging}/part-{i}-a", f"part-{i}") for i in (0, 1)]
    first.commit(moves, first=("part-0",))
    kept = {k: v for k, v in _tree(fs).items() if not k.startswith("_temporary/")}
    assert kept == {"part-0": b"first", "part-1": b"first"}
    assert fs.exists(second.staging)  # the first job's commit left the second's staging
    moves = [(f"{second.staging}/part-{i}-a", f"part-{i}") for i in (0, 1)]
    if overwrite:
        second.commit(moves)
        assert _tree(fs) == {"part-0": b"second", "part-1": b"second"}
    else:
        with pytest.raises(RefusedError, match="another job wrote into it while this one ran"):
            second.commit(moves)
        assert _tree(fs) == {"part-0": b"first", "part-1": b"first"}


def test_the_staging_of_a_killed_driver_goes_with_the_next_job(fs: Any) -> None:
    """A driver killed outright (kill -9) cannot remove its staging: a killed ingest's staged
    parts stayed for ever.  The next job on the host removes it once its owner is gone, and
    leaves the staging of a live job, or of one on another host, alone."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    dead = subprocess.Popen(["true"])
    dead.wait()
    jobs = {}
    for name in ("killed", "running", "elsewhere"):
        jobs[name] = _output(fs)
        jobs[name].start()
        fs.pipe(f"{jobs[name].staging}/part-0-attempt1", b"staged")
    owner = f"{jobs['killed'].staging}.owner"
    fs.pipe(owner, json.dumps({**json.loads(fs.cat_file(owner)), "pid": dead.pid}).encode())
    other = f"{jobs['elsewhere'].staging}.owner"
    moved = {**json.loads(fs.cat_file(other)), "host": "another-host", "pid": dead.pid}
    fs.pipe(other, json.dumps(moved).encode())
    _output(fs).start()
    assert not fs.exists(jobs["killed"].staging) and not fs.exists(owner)
    assert fs.cat_file(f"{jobs['running'].staging}/part-0-attempt1") == b"staged"
    assert fs.cat_file(f"{jobs['elsewhere'].staging}/part-0-attempt1") == b"staged"
    # and a job that ends removes its owner file with its staging
    jobs["running"].abort()
    assert not fs.exists(f"{jobs['running'].staging}.owner")


_KILLED_MID_COMMIT = """
import os, signal, sys
import fsspec
from adcloud._commit import JobOutput
from adcloud.errors import AdcloudError

root, phase = sys.argv[1], sys.argv[2]
fs = fsspec.filesystem("file")
output = JobOutput(fs, root, root, overwrite=True, ours=lambda name: True,
                   error=AdcloudError, what="a test job")
output.start()
for name in ("part-0", "part-1", "part-2", "DONE"):
    fs.pipe_file(f"{output.staging}/{name}-staged", b"new " + name.encode())
real = getattr(fs, phase)
calls = []

def dies_on_the_second(*args, **kwargs):
    calls.append(args)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

setattr(fs, phase, dies_on_the_second)
names = ("part-0", "part-1", "part-2", "DONE")
output.commit([(f"{output.staging}/{n}-staged", n) for n in names], first=("DONE",))
"""


@pytest.mark.parametrize("phase", ["rm", "mv"])
def test_a_driver_killed_while_committing_loses_neither_output(tmp_path: Any, phase: str) -> None:
    """A driver SIGKILLed inside the commit -- while it removes the earlier output, or while it
    moves the new one in -- had removed earlier files the next job then dropped the staged
    copies of: both outputs lost.  The next job into the directory finishes the commit."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    out = tmp_path / "out"
    out.mkdir()
    for name in ("part-0", "part-1", "part-2", "DONE"):
        (out / name).write_bytes(b"old " + name.encode())
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_COMMIT, str(out), phase], check=False
    )
    assert killed.returncode == -9
    local = fsspec.filesystem("file")
    half = sorted(p.name for p in out.iterdir())
    assert "_temporary" in half and half != ["DONE", "_temporary", "part-0", "part-1", "part-2"]
    JobOutput(
        local,
        str(out),
        str(out),
        overwrite=True,
        ours=lambda name: True,
        error=RefusedError,
        what="the next job",
    ).start()
    found = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert found == {n: b"new " + n.encode() for n in ("part-0", "part-1", "part-2", "DONE")}
    staging = out / "_temporary"
    assert [p.name for p in staging.iterdir()] != []  # the next job's own staging and owner
    assert not any(p.name.endswith(".commit") for p in staging.iterdir())


def _killed_mid_commit(root: Any, moved: int) -> None:
    """An output at ``root`` (local) whose driver was killed after the commit record, the
    removal of the old files and ``moved`` moves: the rest is still staged."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    local = fsspec.filesystem("file")
    local.makedirs(str(root), exist_ok=True)
    for name in ("part-0", "part-1", "DONE"):
        local.pipe_file(f"{root}/{name}", b"old")
    job = JobOutput(
        local, str(root), str(root), overwrite=True, ours=bool, error=RefusedError, what="it"
    )
    job.start()
    moves = []
    for name in ("part-0", "part-1", "DONE"):
        local.pipe_file(f"{job.staging}/{name}-staged", b"new")
        moves.append((f"{job.staging}/{name}-staged", f"{root}/{name}"))
    record = {"remove": [f"{root}/DONE", f"{root}/part-0", f"{root}/part-1"], "moves": moves}
    local.pipe_file(f"{job.staging}.commit", json.dumps(record).encode())
    for entry in record["remove"]:
        local.rm(entry)
    for move in moves[:moved]:
        local.mv(*move)
    dead = subprocess.Popen(["true"])
    dead.wait()
    owner = f"{job.staging}.owner"
    local.pipe_file(
        owner, json.dumps({**json.loads(local.cat_file(owner)), "pid": dead.pid}).encode()
    )


def test_two_jobs_never_finish_one_killed_commit_together(tmp_path: Any) -> None:
    """Two jobs started into an output whose driver was killed mid-commit both finished that
    commit: the slower one, having seen every file still staged, removed the "old" entries
    after the faster had moved the new ones in (a save lost for good).  The first to claim
    the commit finishes it; the other leaves it alone."""
    out = tmp_path / "out"
    _killed_mid_commit(out, moved=0)

    def job(fs: Any) -> JobOutput:
        return JobOutput(
            fs, str(out), str(out), overwrite=True, ours=bool, error=RefusedError, what="it"
        )

    slower_fs = fsspec.filesystem("file", skip_instance_cache=True)
    faster = job(fsspec.filesystem("file", skip_instance_cache=True))
    real_rm = slower_fs.rm

    def rm(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not faster_ran and "_temporary" not in str(path):
            # the slower job decided what to remove; the faster one runs meanwhile
            faster_ran.append(True)
            faster.start()
        return real_rm(path, *args, **kwargs)

    faster_ran: list[bool] = []
    slower_fs.rm = rm
    slower = job(slower_fs)
    slower.start()
    assert faster_ran
    found = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert found == {"part-0": b"new", "part-1": b"new", "DONE": b"new"}
    faster.abort()
    slower.abort()
    assert sorted(p.name for p in out.iterdir()) == ["DONE", "part-0", "part-1"]


def test_a_finished_commit_is_checked_as_the_output_was(tmp_path: Any) -> None:
    """An output a killed commit left holding only ``_temporary`` passed for empty: a job
    without overwrite ran to its end, then the finished commit made it fail, its work lost,
    saying another job had written meanwhile.  It is refused at its start."""
    out = tmp_path / "out"
    _killed_mid_commit(out, moved=0)
    assert [p.name for p in out.iterdir()] == ["_temporary"]
    local = fsspec.filesystem("file")
    job = JobOutput(
        local, str(out), str(out), overwrite=False, ours=bool, error=RefusedError, what="it"
    )
    with pytest.raises(RefusedError, match="already exists and is not empty"):
        job.start()
    found = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert found == {"part-0": b"new", "part-1": b"new", "DONE": b"new"}
    assert not (out / "_temporary").exists()


def test_a_staging_directory_nobody_owns_goes_with_the_next_job(fs: Any) -> None:
    """A task still starting when its job failed wrote its part after the abort had
    removed the staging and its owner file: a directory no sweep looked at, for ever."""
    failed = _output(fs)
    failed.start()
    failed.abort()
    fs.pipe(f"{failed.staging}/part-3-late", b"x" * 100)  # the late task (auto-made dirs)
    running = _output(fs)
    running.start()
    fs.pipe(f"{running.staging}/part-0-attempt1", b"live")
    _output(fs).start()
    assert not fs.exists(failed.staging)
    assert fs.cat_file(f"{running.staging}/part-0-attempt1") == b"live"
