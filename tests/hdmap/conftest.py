"""Fixtures shared by the HD-map tests.

``loop_drive`` (session scope) is a 60 s synthetic drive once around the loop road: it
revisits its start (a loop closure), has a GPS outage from 20 s to 30 s, 1 m GPS noise
with a slowly varying bias and a drifting odometry scale. 16 beams x 512 columns and no
camera keep it cheap (about 15 s to generate); read it with
``adcloud.hdmap.drive.read_drive(str(loop_drive.bag))`` and its truth from
``loop_drive.truth``.
"""

from __future__ import annotations

import pytest

from adcloud.synth import DriveConfig, DriveResult
from tests.drives import shared_drive

LOOP_DRIVE = DriveConfig(seconds=60, seed=7, lidar_beams=16, lidar_columns=512, camera=False)


@pytest.fixture(scope="session")
def loop_drive(tmp_path_factory: pytest.TempPathFactory) -> DriveResult:
    """The 60 s loop drive of :data:`LOOP_DRIVE` (bag and truth directory)."""
    out = tmp_path_factory.mktemp("loop_drive") / "loop.bag"
    return shared_drive(LOOP_DRIVE, out, tmp_path_factory)
