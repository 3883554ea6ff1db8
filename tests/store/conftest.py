"""Fixtures of the store tests.

Every test here runs with ``ADCLOUD_STORE_ROOT`` pointing into its own temporary directory
(and every other ``ADCLOUD_STORE_*`` variable cleared), so no test ever touches the user's
real tiers or ``/dev/shm``.  ``run_worker`` starts ``tests/store/_worker.py`` as a real
separate process with the same environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from adcloud.store import LocalStore, StoreServer

WORKER = Path(__file__).with_name("_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's private store root (``ADCLOUD_STORE_ROOT``)."""
    for name in list(os.environ):
        if name.startswith("ADCLOUD_STORE_"):
            monkeypatch.delenv(name)
    root = tmp_path / "store"
    monkeypatch.setenv("ADCLOUD_STORE_ROOT", str(root))
    return root


@pytest.fixture
def local_store(store_root: Path) -> Iterator[LocalStore]:
    """A local tiered store with default capacities below ``store_root``."""
    store = LocalStore("local://")
    yield store
    store.close()


@pytest.fixture
def served(store_root: Path) -> Iterator[tuple[StoreServer, str]]:
    """A running ``StoreServer`` (port chosen by the OS) over a local store, and its token."""
    store = LocalStore("local://")
    token = "test-token-0123456789"
    server = StoreServer(store, port=0, token=token).start()
    yield server, token
    server.shutdown()
    store.close()


def worker_env(**extra: str) -> dict[str, str]:
    """The environment for a worker process (the test's store root included)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def start_worker(*args: str, **env: str) -> subprocess.Popen[str]:
    """Start ``_worker.py ARGS`` as a separate process (stdout piped, line-buffered text)."""
    return subprocess.Popen(
        [sys.executable, "-u", str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(**env),
    )


def wait_for_line(proc: subprocess.Popen[str], expected: str, timeout: float = 30.0) -> None:
    """Block until the worker prints ``expected`` on a line of its own (or fail)."""
    import selectors  # noqa: PLC0415
    import time  # noqa: PLC0415

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if sel.select(timeout=0.1):
            line = proc.stdout.readline()
            if not line:
                break
            if line.strip() == expected:
                return
    err = proc.stderr.read() if proc.poll() is not None and proc.stderr else ""
    raise AssertionError(f"worker never printed {expected!r} (exit {proc.poll()}): {err[-2000:]}")


def kill_worker(proc: subprocess.Popen[str]) -> None:
    """SIGKILL a worker (a crash: nothing of it runs after) and close its pipes."""
    import signal  # noqa: PLC0415

    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def catalog_rows(store_root: Path, table: str) -> int:
    """How many rows ``table`` of the store's catalog holds (read beside the store)."""
    import sqlite3  # noqa: PLC0415

    with sqlite3.connect(store_root / "catalog.sqlite") as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


#: Opens a LocalStore on the test's store root with settings overridden.
MakeStore = Callable[..., LocalStore]


@pytest.fixture
def make_store(store_root: Path) -> Iterator[MakeStore]:
    """Open local stores on ``store_root`` with overrides; all are closed afterwards."""
    opened: list[LocalStore] = []

    def make(**overrides: object) -> LocalStore:
        overrides.setdefault("background", False)
        store = LocalStore("local://", **overrides)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
