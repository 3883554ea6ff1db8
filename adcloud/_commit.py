"""An output directory a Spark job fills and the driver commits, on any fsspec filesystem.

Tasks write into the job's own staging directory, ``<out>/_temporary/<job id>/``; once
every task has succeeded the driver moves the files into place (:meth:`JobOutput.commit`),
after removing what an earlier job left there (with ``overwrite``).  So a failed job
(:meth:`JobOutput.abort`) leaves the directory as it was -- an earlier output still whole,
nothing half-written -- and a job may even read the output it replaces.  Retried,
speculative or killed task attempts write files of their own names in the staging
directory and never touch the output.  Like Hadoop's ``FileOutputCommitter``, but the old
output stays until the new one is complete.

Each staging directory has an owner file beside it (``<job id>.owner``: host, boot, process
id and start time of the driver).  A driver killed outright (``kill -9``, a lost machine)
cannot remove its staging; the next job into the same output on the same host does, once
the owner is gone -- otherwise a killed ingest's gigabytes of staged parts stayed for ever.
A driver killed *while committing* has already removed part of the earlier output, so its
staging is not dropped but moved into place: before the commit removes anything it writes
what it is about to do (``<job id>.commit``), and the next job finishes that commit first.
A commit moves every file of the new output, its completion marker last, so that finished
commit leaves a whole output.  A job takes over a dead job's leftovers by renaming its owner
file to a claim (``<job id>.claim-<its own id>``), which only one job wins, so two jobs never
finish one commit together; a claim whose job died in turn is taken over the same way.  A
job writes its owner file before it makes its staging directory, so a staging directory
without one (a task of a failed job still writing after its abort) is nobody's and goes too.

Used by :meth:`adcloud.binpipe.BinPipeRDD.save` and the image feature job of
:mod:`adcloud.hetero`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
import socket
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adcloud.errors import AdcloudError

__all__ = ["TEMPORARY", "JobOutput", "interrupted_commit", "process_umask"]

TEMPORARY = "_temporary"
_OWNER = ".owner"
_COMMITTING = ".commit"
_CLAIM = ".claim-"
#: A job's id: the name of its staging directory.
_JOB = re.compile(r"[0-9a-f]{32}")

log = logging.getLogger(__name__)


def _process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), or "" if it is not running:
    a pid alone may since name another process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:  # noqa: PTH123 - a hot, tiny read
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return fields[19].decode() if len(fields) > 19 and fields[0] not in (b"Z", b"X") else ""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:  # noqa: PTH123
            return boot.read().strip()
    except OSError:
        return ""


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only be read by
    setting it, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _this_owner() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot": _boot_id(),
        "pid": pid,
        "start": _process_start(pid),
    }


def _owner_gone(owner: dict[str, Any]) -> bool:
    """Whether the driver an owner file names is known to be gone: only a driver on this host
    can be checked (one of this boot that no longer runs, or any of an earlier boot)."""
    if owner.get("host") != socket.gethostname() or not owner.get("boot"):
        return False
    if owner["boot"] != _boot_id():
        return True
    pid = owner.get("pid")
    return not isinstance(pid, int) or _process_start(pid) != owner.get("start")


class JobOutput:
    """The output directory ``root`` of filesystem ``fs`` (``uri`` names it in messages).

    Refuses, raising ``error``, a ``root`` that is a file, a directory that is not empty
    unless ``overwrite``, and with ``overwrite`` one holding an entry ``ours`` does not
    recognise (a mistyped output path must not wipe other data); ``what`` names the writer
    in those messages and ``hint`` tells how to overwrite.  Leftovers of a crashed job
    (``_temporary``) are ignored.  ``fs`` needs ``exists``, ``isfile``, ``ls``,
    ``makedirs``, ``rm``, ``mv``, ``pipe_file`` and ``cat_file`` as fsspec filesystems have
    them.
    """

    def __init__(
        self,
        fs: Any,
        root: str,
        uri: str,
        *,
        overwrite: bool,
        ours: Callable[[str], bool],
        error: type[AdcloudError],
        what: str,
        hint: str = "pass overwrite=True to replace it",
    ) -> None:
        self.fs = fs
        self.root = root
        self.uri = uri
        self._overwrite, self._ours, self._error, self._what = overwrite, ours, error, what
        self.existed = bool(fs.exists(root))
        if self.existed and fs.isfile(root):
            # ls() of a file lists the file itself: it would pass for a directory's entry
            raise error(
                f"{uri} is a file, not a directory {what} can write into; remove it or "
                "choose another directory"
            )
        self._hint = hint
        self.entries = self._replaceable(self._listed()) if self.existed else []
        self._check(self.entries)
        self.job = uuid.uuid4().hex
        #: Where the tasks write (a path of ``fs``).
        self.staging = posixpath.join(root, TEMPORARY, self.job)
        self._owner = self.staging + _OWNER

    def _check(self, entries: list[str]) -> None:
        """Refuse to replace ``entries`` without ``overwrite``, or ones that are not ours."""
        if not entries:
            return
        if not self._overwrite:
            raise self._error(
                f"{self.uri} already exists and is not empty; {self._hint}, or choose a new "
                "directory"
            )
        foreign = [e for e in entries if not self._ours(posixpath.basename(e.rstrip("/")))]
        if foreign:
            raise self._error(
                f"{self.uri} holds files {self._what} did not write (e.g. "
                f"{posixpath.basename(foreign[0].rstrip('/'))}); refusing to replace it: "
                "choose an empty or new directory"
            )

    def _replaceable(self, entries: list[str]) -> list[str]:
        """Of the output's ``entries``, those a commit replaces (all; a subclass may keep
        some it does not write)."""
        return entries

    def _listed(self) -> list[str]:
        """The output's entries now, but the staging of jobs (``_temporary``)."""
        try:
            found = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [e for e in found if posixpath.basename(e.rstrip("/")) != TEMPORARY]

    def start(self) -> None:
        """Make the staging directory (before the tasks run), after finishing or removing
        what drivers killed on this host left (see the module doc).  What such a commit
        finished is checked as the output was: refused without ``overwrite``, before any
        work is done."""
        temporary = posixpath.join(self.root, TEMPORARY)
        self.fs.makedirs(temporary, exist_ok=True)
        # The owner file first: a staging directory without one (a task of a failed job
        # that wrote on after its abort) is nobody's, and the sweep removes it.
        self.fs.pipe_file(self._owner, json.dumps(_this_owner()).encode())
        try:
            self._sweep_dead()
            now = self._replaceable(self._listed())
            if sorted(now) != sorted(self.entries):
                self._check(now)
                self.entries = now
            self.fs.makedirs(self.staging, exist_ok=True)
        except BaseException:
            self.abort()
            raise

    def _sweep_dead(self) -> None:
        temporary = posixpath.join(self.root, TEMPORARY)
        try:
            found = [p.rstrip("/") for p in self.fs.ls(temporary, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return
        names = {posixpath.basename(p) for p in found}
        for path in found:
            job = self._dead_job(temporary, posixpath.basename(path))
            if job is None:
                continue
            # Claimed by a rename, which only one job wins: two jobs finishing one commit
            # at once would each remove what the other had moved into place.
            claim = posixpath.join(temporary, f"{job}{_CLAIM}{self.job}")
            try:
                self.fs.mv(path, claim)
            except OSError:
                continue  # another job claimed it first
            self._take_over(posixpath.join(temporary, job), claim)
        for name in names:
            if (
                _JOB.fullmatch(name)
                and name != self.job
                and not any(other != name and other.startswith(name + ".") for other in names)
            ):
                log.info("%s: removing a staging directory no job owns (%s)", self.uri, name)
                with contextlib.suppress(OSError):
                    self.fs.rm(posixpath.join(temporary, name), recursive=True)

    def _dead_job(self, temporary: str, name: str) -> str | None:
        """The job whose leftovers the file ``name`` of ``_temporary`` hands to this one:
        its owner file, if the owner is gone; a claim on it by a job that is gone."""
        if name.endswith(_OWNER) and _CLAIM not in name:
            job, owner_file = name.removesuffix(_OWNER), posixpath.join(temporary, name)
        elif _CLAIM in name:
            job, _, claimer = name.partition(_CLAIM)
            if claimer == self.job:
                return None
            owner_file = posixpath.join(temporary, claimer + _OWNER)
        else:
            return None
        if job == self.job:
            return None
        try:
            owner = json.loads(self.fs.cat_file(owner_file))
        except FileNotFoundError:
            # a claimer's owner file goes when it ends (having finished the claim) or is
            # swept: the claim is left over; an owner file itself was listed, so it is
            # being removed by the job that ends
            return job if _CLAIM in name else None
        except (OSError, ValueError):
            return None  # being written, or not ours to judge
        return job if isinstance(owner, dict) and _owner_gone(owner) else None

    def _take_over(self, staging: str, claim: str) -> None:
        """Finish the commit a killed job left (``<staging>.commit``), or drop its staging."""
        plan = self._commit_plan(staging + _COMMITTING)
        if plan is not None:
            log.warning(
                "%s: a job was killed while committing its output; finishing that commit "
                "(%d files) before this job starts",
                self.uri,
                len(plan["moves"]),
            )
            self._finish(plan["remove"], [(s, t) for s, t in plan["moves"]], resumed=True)
        else:
            log.info("%s: removing the staging of a killed job (%s)", self.uri, staging)
        with contextlib.suppress(OSError):
            self.fs.rm(staging, recursive=True)
        for leftover in (staging + _COMMITTING, claim):
            with contextlib.suppress(OSError):
                self.fs.rm(leftover)

    def _commit_plan(self, path: str) -> dict[str, Any] | None:
        """The commit record at ``path``, or None: no commit was started (a record cut
        short by the kill was written before anything was removed, so none was either)."""
        try:
            plan = json.loads(self.fs.cat_file(path))
        except (OSError, ValueError):
            return None
        if (
            not isinstance(plan, dict)
            or not isinstance(plan.get("remove"), list)
            or not isinstance(plan.get("moves"), list)
            or not all(isinstance(m, list) and len(m) == 2 for m in plan["moves"])
        ):
            return None
        return plan

    def abort(self) -> None:
        """The job failed: drop what it staged; the output is as it was.  Only this job's
        staging goes: another job may be writing or have committed there meanwhile."""
        with contextlib.suppress(OSError):
            self.fs.rm(self.staging, recursive=True)
        with contextlib.suppress(OSError):
            self.fs.rm(self._owner)
        self._tidy()
        with contextlib.suppress(OSError):  # a directory this job made, holding nothing
            if not self.existed and not self.fs.ls(self.root, detail=False):
                self.fs.rm(self.root, recursive=True)

    def _tidy(self) -> None:
        """Remove ``_temporary`` once no job stages in it."""
        temporary = posixpath.join(self.root, TEMPORARY)
        with contextlib.suppress(OSError):
            if not self.fs.ls(temporary, detail=False):
                self.fs.rm(temporary, recursive=True)

    def commit(self, files: Sequence[tuple[str, str]], *, first: Sequence[str] = ()) -> None:
        """Replace the earlier output by ``files``: ``(staged path, name in the output)``.

        The earlier entries named in ``first`` (a completion marker, a manifest that
        readers start from) go before the others, so that a reader never takes a mix of
        two outputs for a complete one; the new ones, staged like the rest, come last in
        ``files``.  A driver killed meanwhile leaves a commit the next job finishes.

        What another job committed there while this one ran is checked as the start
        checked the output: replaced with ``overwrite`` (if its entries are ``ours``),
        else this job's output is dropped and ``error`` raised -- never silently lost.
        """
        now = self._replaceable(self._listed())
        if sorted(now) != sorted(self.entries):
            foreign = [e for e in now if not self._ours(posixpath.basename(e.rstrip("/")))]
            if (now and not self._overwrite) or foreign:
                self.abort()
                raise self._error(
                    f"{self.uri}: another job wrote into it while this one ran; this job's "
                    "output was not committed (the other's is kept): run it again"
                    + ("" if self._overwrite else " with overwrite to replace that output")
                )
        order = {name: i for i, name in enumerate(first)}
        remove = sorted(now, key=lambda e: order.get(posixpath.basename(e.rstrip("/")), len(order)))
        moves = [(src, posixpath.join(self.root, name)) for src, name in files]
        # written before anything is removed: a driver killed from here on leaves the next
        # job a commit to finish, not an output half gone (see the module doc)
        record = self.staging + _COMMITTING
        self.fs.pipe_file(record, json.dumps({"remove": remove, "moves": moves}).encode())
        self._finish(remove, moves)
        with contextlib.suppress(FileNotFoundError):  # object stores: gone with its files
            self.fs.rm(self.staging, recursive=True)
        for done in (record, self._owner):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(done)
        self._tidy()

    def _finish(
        self, remove: Sequence[str], moves: Sequence[tuple[str, str]], *, resumed: bool = False
    ) -> None:
        """Remove the earlier entries ``remove`` (in order), then make the ``moves``.
        ``resumed`` after a kill, it goes on where that one stopped: once a file has moved,
        every earlier entry is gone already, and only the files still staged move."""
        left = [m for m in moves if self.fs.exists(m[0])] if resumed else list(moves)
        if len(left) == len(moves):
            for entry in remove:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(entry, recursive=True)
        move_all(self.fs, left)


def interrupted_commit(fs: Any, root: str) -> str | None:
    """The commit record a job killed while committing into ``root`` left (a path of
    ``fs``), or None: readers say so, rather than only that the output is incomplete."""
    try:
        found = fs.ls(posixpath.join(root, TEMPORARY), detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return next((p for p in found if p.endswith(_COMMITTING)), None)


def move_all(fs: Any, pairs: Sequence[tuple[str, str]]) -> None:
    """Move each ``(source, target)`` file: renames on a local filesystem, and on an object
    store one batch (copies there are server-side, and s3fs/gcsfs send a batch's requests
    concurrently, as the tasks moving their own files would)."""
    if not pairs:
        return
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    if "file" in protocols or len(pairs) == 1:
        for source, target in pairs:
            fs.mv(source, target)
        return
    fs.mv([s for s, _ in pairs], [t for _, t in pairs])
