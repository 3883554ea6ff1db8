"""Local scratch directories of a driver that a killed driver does not leave behind for ever.

``tempfile`` removes a directory when its ``with`` block ends, but a driver killed outright
(``kill -9``, the OOM killer, a lost session) never gets there: an HD-map build's local
staging or a training run's sample files -- gigabytes -- stayed in ``/tmp`` until a reboot.
:func:`scratch_dir` makes the directory with an owner file beside it (``<dir>.owner``:
host, boot, process id and start time, as :mod:`adcloud._commit` writes for staging), and
every later call with the same prefix removes the directories whose owner is gone.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from adcloud._commit import _owner_gone, _this_owner

__all__ = ["make_scratch", "remove_scratch", "scratch_dir", "sweep_scratch"]

_OWNER = ".owner"

log = logging.getLogger(__name__)


def make_scratch(prefix: str, where: str | Path | None = None) -> Path:
    """A new directory ``<where>/<prefix>XXXX`` (``where``: the temporary directory), owned by
    this process; directories of that prefix there whose owner is gone are removed first."""
    parent = Path(where) if where is not None else Path(tempfile.gettempdir())
    _sweep(parent, prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        Path(str(path) + _OWNER).write_text(json.dumps(_this_owner()))
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def remove_scratch(path: str | Path) -> None:
    """Remove a directory :func:`make_scratch` made, and its owner file."""
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        Path(str(path) + _OWNER).unlink()


@contextlib.contextmanager
def scratch_dir(prefix: str, where: str | Path | None = None) -> Iterator[Path]:
    """:func:`make_scratch` for a ``with`` block; removed at its end, whatever happened."""
    path = make_scratch(prefix, where)
    try:
        yield path
    finally:
        remove_scratch(path)


def sweep_scratch(prefix: str, where: str | Path | None = None) -> None:
    """Remove the directories of ``prefix`` in ``where`` (the temporary directory) whose
    owner is gone, as :func:`make_scratch` does first: for a job that makes such a
    directory only in some of its modes, so that a killed run's goes with the next run
    whatever its mode."""
    _sweep(Path(where) if where is not None else Path(tempfile.gettempdir()), prefix)


def _sweep(parent: Path, prefix: str) -> None:
    for owner_file in parent.glob(f"{glob.escape(prefix)}*{_OWNER}"):
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            continue  # being written, or not ours to judge
        if not isinstance(owner, dict) or not _owner_gone(owner):
            continue
        path = Path(str(owner_file).removesuffix(_OWNER))
        log.info("removing %s: the process that made it was killed", path)
        remove_scratch(path)
