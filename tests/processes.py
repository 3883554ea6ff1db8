"""Processes as ``/proc`` shows them, for tests that check what a run leaves behind."""

from __future__ import annotations

from pathlib import Path


def _fields(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (zombies waiting to be reaped count as gone)."""
    try:
        return _fields(pid)[0] not in "ZX"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_fields(entry.name)[1]) == pid:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out
