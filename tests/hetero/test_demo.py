"""The hetero part of ``adcloud demo``: it runs on local Spark and writes what it says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pyspark.sql import SparkSession

from adcloud.hetero import read_features, run_demo

pytestmark = [pytest.mark.opencl, pytest.mark.spark]


def test_demo_writes_features_icp_and_raster(
    spark: SparkSession, shared_data: Path, tmp_path: Path
) -> None:
    demo = run_demo(spark, tmp_path, data_dir=shared_data, drive_seconds=3.0)
    text = "\n".join(demo.lines)
    assert "kernels run on" in text
    assert "camera images" in text and "images/s" in text
    assert "ICP of the real scan pair" in text and "converged in" in text
    assert set(demo.outputs) == {"features", "icp", "raster", "raster preview"}
    for path in demo.outputs.values():
        assert path.exists() and str(path).startswith(str(tmp_path / "hetero"))
    features = read_features(str(demo.outputs["features"]))
    assert sum(len(stamps) for stamps, _ in features.values()) == 30  # 3 s at 10 Hz
    icp = json.loads(demo.outputs["icp"].read_text())
    assert icp["translation_error_m"] < 0.03 and icp["rotation_error_deg"] < 0.3
    assert icp["converged"] is True and 0 < icp["fitness"] <= 1 and icp["inliers"] > 0
    with np.load(demo.outputs["raster"]) as raster:
        assert raster["count"].sum() > 100_000
    assert demo.outputs["raster preview"].read_bytes().startswith(b"\x89PNG")


def test_demo_without_the_scan_pair_says_so(spark: SparkSession, tmp_path: Path) -> None:
    demo = run_demo(spark, tmp_path, data_dir=tmp_path / "nothing-here", drive_seconds=1.0)
    assert any("ICP and raster skipped" in line for line in demo.lines)
    assert set(demo.outputs) == {"features"}


def test_a_rerun_with_another_drive_length_uses_a_drive_of_that_length(
    spark: SparkSession, tmp_path: Path
) -> None:
    # the second run reused the first run's drive.bag: 1 s of images for a 2 s drive
    for seconds, images in ((1.0, 10), (2.0, 20), (1.0, 10)):
        demo = run_demo(spark, tmp_path, data_dir=tmp_path / "nothing", drive_seconds=seconds)
        features = read_features(str(demo.outputs["features"]))
        assert sum(len(stamps) for stamps, _ in features.values()) == images
        assert any(f"features (HOG) of {images} camera images" in line for line in demo.lines)


def test_an_icp_that_does_not_converge_is_not_reported_as_a_result(
    spark: SparkSession, shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo printed "N iterations" and wrote icp.json without saying whether ICP had
    converged or only run out of iterations."""
    import adcloud.hetero.demo as demo_module  # noqa: PLC0415

    real = demo_module.align
    monkeypatch.setattr(
        demo_module, "align", lambda *args, **kwargs: real(*args, **kwargs, iterations=1)
    )
    demo = run_demo(spark, tmp_path, data_dir=shared_data, drive_seconds=1.0)
    line = next(line for line in demo.lines if "ICP of the real scan pair" in line)
    assert "did NOT converge: stopped after 1 iterations" in line
    assert json.loads(demo.outputs["icp"].read_text())["converged"] is False
