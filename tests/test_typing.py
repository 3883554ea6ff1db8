"""The package passes ``mypy --strict`` with the settings in pyproject.toml.

``make test`` runs mypy here rather than before pytest: from a cold cache it takes ~1.5 min
of one core, which the other tests then share the second core with (``make lint`` runs it
on its own as well).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_package_passes_mypy_strict() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
