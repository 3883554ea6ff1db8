"""An output directory a Spark job fills and the driver commits, on any fsspec filesystem.

Tasks write into the job's own staging directory, ``<out>/_temporary/<job id>/``; once
every task has succeeded the driver moves the files into place (:meth:`JobOutput.commit`),
after removing what an earlier job left there (with ``overwrite``).  So a failed job
(:meth:`JobOutput.abort`) leaves the directory as it was -- an earlier output still whole,
nothing half-written -- and a job may even read the output it replaces.  Retried,
speculative or killed task attempts write files of their own names in the staging
directory and never touch the output.  Like Hadoop's ``FileOutputCommitter``, but the old
output stays until the new one is complete.

Used by :meth:`adcloud.binpipe.BinPipeRDD.save` and the image feature job of
:mod:`adcloud.hetero`.
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from adcloud.errors import AdcloudError

__all__ = ["TEMPORARY", "JobOutput"]

TEMPORARY = "_temporary"


class JobOutput:
    """The output directory ``root`` of filesystem ``fs`` (``uri`` names it in messages).

    Refuses, raising ``error``, a ``root`` that is a file, a directory that is not empty
    unless ``overwrite``, and with ``overwrite`` one holding an entry ``ours`` does not
    recognise (a mistyped output path must not wipe other data); ``what`` names the writer
    in those messages and ``hint`` tells how to overwrite.  Leftovers of a crashed job
    (``_temporary``) are ignored.  ``fs`` needs ``exists``, ``isfile``, ``ls``,
    ``makedirs``, ``rm`` and ``mv`` as fsspec filesystems have them.
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
        self.existed = bool(fs.exists(root))
        if self.existed and fs.isfile(root):
            # ls() of a file lists the file itself: it would pass for a directory's entry
            raise error(
                f"{uri} is a file, not a directory {what} can write into; remove it or "
                "choose another directory"
            )
        self.entries = [
            e
            for e in (fs.ls(root, detail=False) if self.existed else [])
            if posixpath.basename(e.rstrip("/")) != TEMPORARY
        ]
        if self.entries:
            if not overwrite:
                raise error(
                    f"{uri} already exists and is not empty; {hint}, or choose a new directory"
                )
            foreign = [e for e in self.entries if not ours(posixpath.basename(e.rstrip("/")))]
            if foreign:
                raise error(
                    f"{uri} holds files {what} did not write (e.g. "
                    f"{posixpath.basename(foreign[0].rstrip('/'))}); refusing to replace it: "
                    "choose an empty or new directory"
                )
        self.job = uuid.uuid4().hex
        #: Where the tasks write (a path of ``fs``).
        self.staging = posixpath.join(root, TEMPORARY, self.job)

    def start(self) -> None:
        """Make the staging directory (before the tasks run)."""
        self.fs.makedirs(self.staging, exist_ok=True)

    def abort(self) -> None:
        """The job failed: drop what it staged; the output is as it was."""
        with contextlib.suppress(OSError):
            self.fs.rm(self.staging, recursive=True)
            if not self.existed:
                self.fs.rm(self.root, recursive=True)
            elif not self.fs.ls(posixpath.join(self.root, TEMPORARY), detail=False):
                self.fs.rm(posixpath.join(self.root, TEMPORARY), recursive=True)

    def commit(self, files: Sequence[tuple[str, str]], *, first: Sequence[str] = ()) -> None:
        """Replace the earlier output by ``files``: ``(staged path, name in the output)``.

        The earlier entries named in ``first`` (a completion marker, a manifest that
        readers start from) go before the others, so that a reader never takes a mix of
        two outputs for a complete one; the caller writes them anew last.
        """
        order = {name: i for i, name in enumerate(first)}
        for entry in sorted(
            self.entries, key=lambda e: order.get(posixpath.basename(e.rstrip("/")), len(order))
        ):
            self.fs.rm(entry, recursive=True)
        move_all(self.fs, [(src, posixpath.join(self.root, name)) for src, name in files])
        with contextlib.suppress(FileNotFoundError):  # object stores: gone with its files
            self.fs.rm(posixpath.join(self.root, TEMPORARY), recursive=True)


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
