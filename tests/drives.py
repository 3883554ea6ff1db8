"""Synthetic drives that several test modules read, made once per test run.

The 60 s loop drive of the HD-map tests, the training drives and the replay drive are
session fixtures of modules that pytest-xdist may give to either worker, and each worker used
to synthesize its own copy (up to a minute of a core each). :func:`shared_drive` makes a drive
once per run, in a directory both workers share (the parent of their base temporary
directories; under a plain run, the base temporary directory), under a lock per drive so the
second worker to ask waits for the first instead of making it again. Every caller gets its own
copy at the path it asks for, so a test that edits its bag cannot change what another reads.

A drive is the same for the same :class:`~adcloud.synth.DriveConfig` and bag name
(tests/synth checks that synthesis is deterministic), so those two are the key.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from adcloud.synth import DriveConfig, DriveResult, generate_drive, truth_dir_for

_DONE = "result.json"


def _cache_root(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    # xdist gives each worker <run>/popen-gw<N>; the run's directory is theirs to share
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return root / "shared-drives"


def _copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)


def shared_drive(config: DriveConfig, out: Path, factory: pytest.TempPathFactory) -> DriveResult:
    """``generate_drive(config, out)``, synthesized at most once per test run."""
    key = hashlib.sha256(f"{config!r} {out.name}".encode()).hexdigest()[:16]
    root = _cache_root(factory)
    root.mkdir(exist_ok=True)
    made = root / key
    with (root / f"{key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (made / _DONE).is_file():
            shutil.rmtree(made, ignore_errors=True)  # what a failed attempt left
            made.mkdir()
            result = generate_drive(config, made / out.name)
            (made / _DONE).write_text(json.dumps(dataclasses.asdict(result), default=str))
    record = json.loads((made / _DONE).read_text())
    _copy(made / out.name, out)
    _copy(truth_dir_for(made / out.name), truth_dir_for(out))
    record.update(bag=out, truth=truth_dir_for(out))
    return DriveResult(**record)
