"""The baseline pose recovery has to beat: KISS-ICP LiDAR odometry.

KISS-ICP (Vizzo et al., RA-L 2023) registers every sweep onto a local voxel map with
point-to-point ICP, an adaptive threshold and constant-velocity de-skewing. It uses the
LiDAR alone -- no odometry, IMU, GPS or loop closure -- so its trajectory drifts; the
accuracy benchmarks report its ATE next to :func:`adcloud.hdmap.poses.estimate_trajectory`'s
on the same drive.

:func:`kiss_icp_trajectory` feeds :class:`~adcloud.hdmap.model.Scan` objects (per-point
``dt`` as the de-skew timestamps) through ``kiss_icp.kiss_icp.KissICP`` and returns the
``base_link`` trajectory (through the LiDAR mount) at the sweep stamps, starting at the
identity: compare it with :func:`~adcloud.hdmap.trajectory.absolute_trajectory_error`, which
aligns it rigidly first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from adcloud.errors import MissingComponentError
from adcloud.hdmap.errors import DriveDataError
from adcloud.hdmap.model import Scan
from adcloud.hdmap.trajectory import Trajectory

__all__ = ["kiss_icp_trajectory"]

log = logging.getLogger(__name__)

KISS_ICP_INSTALL_HINT = "pip install kiss-icp==1.3.0"


def kiss_icp_trajectory(
    scans: Sequence[Scan],
    *,
    mount: NDArray[np.float64] | None = None,
    max_range_m: float = 100.0,
    min_range_m: float = 2.0,
    voxel_size_m: float | None = None,
    deskew: bool = True,
) -> Trajectory:
    """KISS-ICP odometry of ``scans`` (increasing stamps, one sensor frame) as ``base_link``
    poses at the sweep stamps.

    ``mount`` is the 4x4 ``base_link <- sensor`` transform (identity: the sensor's own
    trajectory); ``max_range_m`` / ``min_range_m`` crop the points; ``voxel_size_m`` is
    KISS-ICP's map voxel (default: ``max_range_m / 100``, its own rule); ``deskew`` uses the
    per-point ``dt`` as KISS-ICP's timestamps (sweeps are stamped at their end).
    """
    try:
        from kiss_icp.config import KISSConfig  # noqa: PLC0415 - optional dependency
        from kiss_icp.kiss_icp import KissICP  # noqa: PLC0415
    except ImportError as err:
        raise MissingComponentError(
            f"the KISS-ICP baseline needs kiss-icp: {KISS_ICP_INSTALL_HINT}"
        ) from err
    if len(scans) < 2:
        raise DriveDataError(f"KISS-ICP baseline: needs at least 2 sweeps, got {len(scans)}")
    stamps = np.array([s.stamp for s in scans], np.int64)
    if np.any(np.diff(stamps) <= 0):
        bad = int(np.flatnonzero(np.diff(stamps) <= 0)[0]) + 1
        raise DriveDataError(
            f"KISS-ICP baseline: sweep {bad} (stamp {int(stamps[bad])} ns) does not come after "
            "the one before it; sort the sweeps by stamp"
        )
    config = KISSConfig()
    config.data.max_range = max_range_m
    config.data.min_range = min_range_m
    config.data.deskew = deskew
    config.mapping.voxel_size = voxel_size_m if voxel_size_m is not None else max_range_m / 100
    odometry = KissICP(config)
    lidar = np.zeros((len(scans), 4, 4))
    for i, scan in enumerate(scans):
        points = np.asarray(scan.xyz, np.float64)
        keep = np.isfinite(points).all(axis=1)
        times = np.asarray(scan.dt, np.float64)[keep] if deskew else np.zeros(int(keep.sum()))
        odometry.register_frame(points[keep], times)
        lidar[i] = odometry.last_pose
    m = np.eye(4) if mount is None else np.asarray(mount, np.float64)
    base = m @ lidar @ np.linalg.inv(m)
    log.info("KISS-ICP baseline: %d sweeps", len(scans))
    return Trajectory(stamps, base)
