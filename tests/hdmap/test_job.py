"""The map job's wiring, without a whole build: stage settings derived from ``hdmap``, the
sign candidates the job ships to the sign stage, and the error of a drive without sweeps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import SparkSession

from adcloud.hdmap.config import HdmapSettings
from adcloud.hdmap.drive import DriveData
from adcloud.hdmap.errors import DriveDataError
from adcloud.hdmap.job import AlignedScan, StageSettings, _poses, _sign_points
from adcloud.hdmap.model import Extrinsics, GpsFixes, ImuSamples, OdomSamples
from adcloud.hdmap.signs import SignSettings


def test_point_cloud_tiles_follow_the_grid_tile_size(tmp_path: Path) -> None:
    """Point-cloud and grid tiles of one size: the job drops moving objects from the
    point-cloud map only then. ``hdmap.tile_m`` sets both unless the cloud's is given."""
    settings = HdmapSettings(tile_m=30.0)
    derived = StageSettings.from_settings(settings)
    assert derived.grid.tile_size == pytest.approx(30.0)
    assert derived.cloud.tile_size == derived.grid.tile_size
    assert StageSettings.load(settings, environ={}).cloud.tile_size == pytest.approx(30.0)
    config = tmp_path / "build.yaml"
    config.write_text("hdmap_cloud:\n  voxel_size: 0.2\n")
    loaded = StageSettings.load(settings, file=config, environ={}).cloud
    assert loaded.tile_size == pytest.approx(30.0) and loaded.voxel_size == 0.2
    # what the user gives explicitly is kept, even the default value
    config.write_text("hdmap_cloud:\n  tile_size: 20\n")
    assert StageSettings.load(settings, file=config, environ={}).cloud.tile_size == 20.0
    env = {"ADCLOUD_HDMAP_CLOUD_TILE_SIZE": "25"}
    assert StageSettings.load(settings, environ=env).cloud.tile_size == 25.0


def _aligned(intensity: list[float], z: float = 3.0) -> AlignedScan:
    n = len(intensity)
    xyz = np.column_stack([np.arange(n, dtype=np.float64), np.zeros(n), np.full(n, z)])
    return AlignedScan("d", 0, xyz, np.array(intensity, np.float32), np.array([0.0, 0.0, 1.9]))


@pytest.mark.spark
def test_sign_candidates_follow_the_sign_stage_threshold(spark: SparkSession) -> None:
    scans = spark.sparkContext.parallelize(
        [_aligned([90.0, 115.0, 145.0, 200.0]), _aligned([255.0], z=0.2)], 2
    )
    xyz, intensity = _sign_points(scans, SignSettings(min_intensity=120.0))
    # down to 10 below the threshold, and never on the road (0.2 m: 1.7 m below the sensor)
    assert sorted(intensity.tolist()) == [115.0, 145.0, 200.0]
    assert xyz.shape == (3, 3) and xyz.dtype == np.float64 and intensity.dtype == np.float32
    _, default = _sign_points(scans, SignSettings())
    assert default.tolist() == [200.0]  # from 150 at the default 160
    empty = spark.sparkContext.parallelize([_aligned([10.0])], 1)
    xyz, intensity = _sign_points(empty, SignSettings())
    assert xyz.shape == (0, 3) and intensity.shape == (0,)


@pytest.mark.spark
def test_a_drive_without_sweeps_names_the_lidar_topic(spark: SparkSession) -> None:
    t = np.array([0, 10**9], np.int64)
    drive = DriveData(
        name="d",
        uri="file:///bags/d.bag",
        extrinsics=Extrinsics(),
        imu=ImuSamples("imu", t, np.zeros((2, 3)), np.zeros((2, 3))),
        odom=OdomSamples(t, np.zeros(2), np.zeros(2)),
        gps=GpsFixes("gps", t, np.zeros((2, 3)), np.ones((2, 3))),
        origin=(48.0, 11.0, 500.0),
    )
    no_scans = spark.sparkContext.parallelize([], 1)
    with pytest.raises(DriveDataError, match=r"d\.bag: no LiDAR sweeps on topic '/velo/points'"):
        _poses(
            no_scans,
            {"d": drive},
            StageSettings(),
            "",
            lambda _: None,
            lidar_topic="/velo/points",
        )
