"""The hetero part of ``adcloud demo``: devices, image features on a drive, ICP and a raster.

:func:`run_demo` runs on any machine: it lists the OpenCL devices, generates a short
synthetic drive with a camera (:mod:`adcloud.synth`), runs the image feature job on it
through Spark, aligns the real scan pair beside the checkout
(``../shared/data/04_gicp_scan_pair_with_reference_tf``, when present) with point-to-plane
ICP, rasterizes the aligned clouds into a 10 cm height grid and writes everything under
``out``.  It returns the lines to print; it prints nothing itself.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from adcloud.config import settings_dict
from adcloud.hetero._ply import read_ply
from adcloud.hetero.devices import HeteroSettings, list_devices, opencl_status, select_device
from adcloud.hetero.feature_job import extract_features
from adcloud.hetero.icp import align
from adcloud.hetero.raster import GridSpec, rasterize
from adcloud.hetero.transform import transform_points

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["HeteroDemo", "run_demo"]

log = logging.getLogger(__name__)

SCAN_PAIR = "04_gicp_scan_pair_with_reference_tf"


@dataclass
class HeteroDemo:
    """What :func:`run_demo` did: ``lines`` to print and the ``outputs`` it wrote."""

    lines: list[str] = field(default_factory=list)
    outputs: dict[str, Path] = field(default_factory=dict)


def _height_preview(path: Path, max_z: np.ndarray, grid: GridSpec) -> Path:
    """A PNG of the max-height layer in map coordinates (metres), empty cells blank."""
    import matplotlib  # noqa: PLC0415 - heavy; only the demo draws

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    extent = (
        grid.origin_x,
        grid.origin_x + grid.width * grid.cell_size,
        grid.origin_y,
        grid.origin_y + grid.height * grid.cell_size,
    )
    values = np.where(np.isfinite(max_z), max_z, np.nan)
    finite = values[np.isfinite(values)]
    low, high = np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0)
    aspect = grid.height / max(grid.width, 1)
    fig, ax = plt.subplots(figsize=(7, min(10.0, 5.5 * aspect + 1.0)))
    image = ax.imshow(values, origin="lower", extent=extent, cmap="viridis", vmin=low, vmax=high)
    fig.colorbar(image, ax=ax, label="max height (m)", shrink=0.7)
    ax.set_xlabel("x (m)")
    ax.set_ylabel("y (m)")
    ax.set_title(f"aligned scan pair, {grid.cell_size * 100:.0f} cm cells")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rotation_error_deg(delta: np.ndarray) -> float:
    cos = (np.trace(delta[:3, :3]) - 1) / 2
    return float(np.degrees(np.arccos(np.clip(cos, -1.0, 1.0))))


def run_demo(
    spark: SparkSession,
    out: str | Path,
    *,
    data_dir: str | Path | None = None,
    settings: HeteroSettings | None = None,
    drive_seconds: float = 6.0,
    bag: str | Path | None = None,
) -> HeteroDemo:
    """Run the hetero demo into ``out/hetero`` (see the module docstring).

    ``bag`` is a drive with camera images to extract features from; without it a
    ``drive_seconds`` synthetic drive is generated as ``out/hetero/drive-<seconds>s.bag``
    (and reused by a re-run with the same ``drive_seconds``).

    ``data_dir`` is the shared recordings directory (default: ``../shared/data`` beside the
    checkout); the ICP and raster steps are skipped, and say so, when the scan pair is not
    there.
    """
    from adcloud.synth import DriveConfig, generate_drive  # noqa: PLC0415 - heavy

    settings = HeteroSettings.load() if settings is None else settings
    root = Path(out).resolve() / "hetero"
    root.mkdir(parents=True, exist_ok=True)
    demo = HeteroDemo()
    say = demo.lines.append

    problem = opencl_status()
    devices = list_devices() if problem is None else []
    for info in devices:
        say(
            f"OpenCL device {info.address}: {info.name} ({info.kind.value}, "
            f"{info.compute_units} compute units, {info.global_mem_bytes / 2**30:.1f} GiB)"
        )
    if problem is not None:
        say(f"no OpenCL: {problem}")
    device = select_device(settings)
    say(f"kernels run on {device.info.describe()}")

    if bag is None:
        # named by its length: a re-run with another drive_seconds must not reuse this one
        bag = root / f"drive-{drive_seconds:g}s.bag"
        if not bag.exists():
            config = DriveConfig(seconds=drive_seconds, seed=7, lidar=False, camera_hz=10.0)
            generate_drive(config, bag)
    features = extract_features(
        spark, [str(bag)], str(root / "features"), settings=settings, overwrite=True
    )
    say(
        f"image features (HOG) of {features.images} camera images in {features.partitions} "
        f"Spark partitions: {features.images_per_second:.0f} images/s "
        f"on {', '.join(sorted(features.devices)) or '-'}"
    )
    demo.outputs["features"] = Path(features.out)

    data = (
        Path(data_dir)
        if data_dir is not None
        else Path(__file__).resolve().parents[3] / "shared" / "data"
    )
    pair = data / SCAN_PAIR
    if not (pair / "small_gicp_source.ply").is_file():
        say(f"scan pair not found under {pair}: ICP and raster skipped")
    else:
        source, _ = read_ply(pair / "small_gicp_source.ply")
        target, _ = read_ply(pair / "small_gicp_target.ply")
        reference = np.loadtxt(pair / "small_gicp_T_target_source.txt")
        started = time.perf_counter()
        result = align(source, target, device=device)
        seconds = time.perf_counter() - started
        delta = np.linalg.inv(reference) @ result.transform
        error_m = float(np.linalg.norm(delta[:3, 3]))
        error_deg = _rotation_error_deg(delta)
        # an ICP stopped by its iteration limit is not a result to present as one
        outcome = (
            f"converged in {result.iterations} iterations"
            if result.converged
            else f"did NOT converge: stopped after {result.iterations} iterations"
        )
        say(
            f"ICP of the real scan pair ({len(source):,} + {len(target):,} points): "
            f"{outcome} in {seconds * 1e3:.0f} ms, rmse {result.rmse * 100:.1f} cm, "
            f"{error_m * 100:.1f} cm / {error_deg:.2f} deg from the reference"
        )
        if not result.converged:
            log.warning("hetero demo: ICP of the scan pair did not converge")
        icp_file = root / "icp.json"
        icp_file.write_text(
            json.dumps(
                {
                    "transform": result.transform.tolist(),
                    "reference": reference.tolist(),
                    "translation_error_m": error_m,
                    "rotation_error_deg": error_deg,
                    "iterations": result.iterations,
                    "converged": result.converged,
                    "rmse_m": result.rmse,
                    "inliers": result.inliers,
                    "fitness": result.fitness,
                    "device": result.device,
                    "hetero": settings_dict(settings),
                },
                indent=2,
            )
            + "\n"
        )
        demo.outputs["icp"] = icp_file
        moved = transform_points(source, result.transform, device=device)
        cloud = np.concatenate([np.column_stack([moved, source[:, 3]]), target], axis=0).astype(
            np.float32
        )
        grid = GridSpec.covering(cloud, 0.1)
        raster = rasterize(cloud, grid, device=device)
        raster_file = root / "raster.npz"
        np.savez_compressed(
            raster_file,
            **{
                name: getattr(raster, name)
                for name in ("count", "mean_z", "min_z", "max_z", "mean_intensity")
            },
            origin=np.array([grid.origin_x, grid.origin_y]),
            cell_size=np.array(grid.cell_size),
        )
        png = _height_preview(root / "raster_height.png", raster.max_z, grid)
        occupied = int((raster.count > 0).sum())
        say(
            f"raster of the aligned pair: {grid.height} x {grid.width} cells of 10 cm, "
            f"{occupied:,} occupied (count, mean/min/max height, mean intensity)"
        )
        demo.outputs["raster"] = raster_file
        demo.outputs["raster preview"] = png
    return demo
