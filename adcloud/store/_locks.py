"""Locks that exclude both the threads of this process and every other process.

Each lock slot pairs a :class:`threading.Lock` (one thread of this process at a time) with
``flock`` on a small file of its own (one process at a time).  ``flock`` rather than POSIX
record locks (``lockf``): record locks belong to the whole process, so with several threads
per process the kernel's deadlock detector sees cycles that do not exist and fails a wait
with ``EDEADLK``.  The kernel drops a process's locks when it dies, so a SIGKILLed holder
never wedges the store.

Deadlock freedom is by ordering: take several slots only through one :meth:`LockFile.hold`
call (ascending order), and never wait for one lock family while holding the other in the
opposite order (the local store takes under-store stripes before the space lock, if both).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LockFile"]


class LockFile:
    """``slots`` independent exclusive locks, files ``<path>.<slot>`` (``<path>`` for one slot).

    Safe across ``fork``: a child opens its own descriptors and gets fresh thread locks on
    first use.
    """

    def __init__(self, path: Path, slots: int = 1) -> None:
        self._path = path
        self._slots = slots
        self._pid = -1
        self._fds: dict[int, int] = {}
        self._thread_locks: list[threading.Lock] = []
        self._guard = threading.Lock()

    def _fd(self, slot: int) -> int:
        fd = self._fds.get(slot)
        if fd is None:
            with self._guard:
                fd = self._fds.get(slot)
                if fd is None:
                    path = self._path if self._slots == 1 else Path(f"{self._path}.{slot:02d}")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                    self._fds[slot] = fd
        return fd

    def _ensure(self) -> None:
        pid = os.getpid()
        if self._pid != pid:
            with self._guard:
                if self._pid != pid:
                    self._fds = {}  # the parent's descriptors are not ours to lock with
                    self._thread_locks = [threading.Lock() for _ in range(self._slots)]
                    self._pid = pid

    @contextlib.contextmanager
    def hold(self, *slots: int) -> Iterator[None]:
        """Hold the given slots (all of them when none is given) exclusively."""
        self._ensure()
        wanted = sorted({s % self._slots for s in slots}) if slots else list(range(self._slots))
        taken: list[int] = []
        try:
            for slot in wanted:
                self._thread_locks[slot].acquire()
                try:
                    fcntl.flock(self._fd(slot), fcntl.LOCK_EX)
                except BaseException:
                    self._thread_locks[slot].release()
                    raise
                taken.append(slot)
            yield
        finally:
            for slot in reversed(taken):
                try:
                    fcntl.flock(self._fds[slot], fcntl.LOCK_UN)
                finally:
                    self._thread_locks[slot].release()

    def close(self) -> None:
        """Close this process's lock files (no slot may be held)."""
        with self._guard:
            if self._pid == os.getpid():
                for fd in self._fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fds = {}
            self._pid = -1
