"""``adcloud._scratch``: a killed driver's local scratch directories go with the next one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from adcloud._scratch import make_scratch, remove_scratch, scratch_dir

_KILLED = """
import os, signal, sys
from adcloud._scratch import make_scratch
path = make_scratch("adcloud-t-", sys.argv[1])
(path / "samples.bin").write_bytes(b"x" * 1000)
print(path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_owner_s_scratch_goes_with_the_next_one(tmp_path: Path) -> None:
    """A driver killed with ``kill -9`` left its scratch directory (GBs of samples) in /tmp
    until a reboot; the next scratch directory of that prefix removes it, and leaves a live
    owner's, another prefix's and a directory without an owner file alone."""
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert killed.returncode == -9
    left = Path(killed.stdout.strip())
    assert (left / "samples.bin").exists()
    live = make_scratch("adcloud-t-", tmp_path)
    other = make_scratch("adcloud-u-", tmp_path)
    unowned = tmp_path / "adcloud-t-byhand"
    unowned.mkdir()
    with scratch_dir("adcloud-t-", tmp_path) as scratch:
        assert scratch.is_dir() and Path(f"{scratch}.owner").is_file()
        assert not left.exists() and not Path(f"{left}.owner").exists()
        assert live.is_dir() and other.is_dir() and unowned.is_dir()
    assert not scratch.exists() and not Path(f"{scratch}.owner").exists()
    remove_scratch(live)
    remove_scratch(other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adcloud-t-byhand"]
