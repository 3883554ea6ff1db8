"""Launch code of ``raster.cl`` (both strategies)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyopencl as cl
from numpy.typing import NDArray

from adcloud.hetero._kernels import Bands, Output, filled, from_device, launch, to_device

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice


def rasterize(
    device: OpenCLDevice,
    points: NDArray[np.float32],
    values: NDArray[np.float32] | None,
    value_column: int | None,
    origin: tuple[float, float],
    cell_size: float,
    shape: tuple[int, int],
    strategy: str,
) -> dict[str, NDArray[Any]]:
    """The raster layers (``height x width``) of ``points`` (N, C>=3 float32, C-order).

    Intensity comes from ``values`` (N,) when given, else from column ``value_column`` of
    ``points`` when not None, else is absent (its layer is all NaN).
    """
    n, stride = points.shape
    height, width = shape
    cells = height * width
    src = to_device(device, points, f"{n:,} points")
    if values is not None:
        vbuf, vstride, voffset, with_values = to_device(device, values), 1, 0, 1
    elif value_column is not None:
        vbuf, vstride, voffset, with_values = src, stride, value_column, 1
    else:
        vbuf, vstride, voffset, with_values = src, stride, 0, 0
    common: list[Any] = [
        src, np.int32(stride), np.int32(n), vbuf, np.int32(vstride), np.int32(voffset),
        np.int32(with_values),
    ]  # fmt: skip
    geometry: list[Any] = [
        np.float32(origin[0]), np.float32(origin[1]), np.float32(1.0) / np.float32(cell_size),
        np.int32(width), np.int32(height),
    ]  # fmt: skip
    if strategy == "atomic":
        count = filled(device, np.int32(0), cells)
        sum_z = filled(device, np.float32(0), cells)
        sum_v = filled(device, np.float32(0), cells)
        min_z = filled(device, np.float32(np.inf), cells)
        max_z = filled(device, np.float32(-np.inf), cells)
        mean_z, mean_v = Output(device, shape, np.float32), Output(device, shape, np.float32)
        launch(
            device, "raster", "raster_atomic", n, None,
            *common, *geometry, count, sum_z, sum_v, min_z, max_z,
        )  # fmt: skip
        launch(
            device, "raster", "raster_finalize_atomic", cells, None,
            np.int32(cells), count, sum_z, sum_v, min_z, max_z, mean_z.buffer, mean_v.buffer,
        )  # fmt: skip
        out = {
            "count": from_device(device, count, shape, np.int32),
            "mean_z": mean_z.result(),
            "min_z": from_device(device, min_z, shape, np.float32),
            "max_z": from_device(device, max_z, shape, np.float32),
            "mean_intensity": mean_v.result(),
        }
        return _without_values(out, with_values)
    # Bands of accumulators (20 bytes a cell) that fit in local memory and in L2.
    limit = min(4096, device.info.local_mem_bytes // 64)
    chunks, chunk, band_cells, band_shift, bands = Bands.plan(device, n, cells, limit)
    cell = device.scratch("raster.cell", n * 4)
    hist = device.scratch("raster.hist", chunks * bands * 4)
    band_start = device.scratch("raster.band_start", (bands + 1) * 4)
    rec_cell = device.scratch("raster.rec_cell", n * 4)
    rec = device.scratch("raster.rec", n * 8)
    layers = {
        "count": Output(device, shape, np.int32),
        "mean_z": Output(device, shape, np.float32),
        "min_z": Output(device, shape, np.float32),
        "max_z": Output(device, shape, np.float32),
        "mean_intensity": Output(device, shape, np.float32),
    }
    bins: list[Any] = [np.int32(chunk), np.int32(band_shift), np.int32(bands)]
    launch(device, "raster", "raster_cells", n, None, *common, *geometry, cell)
    launch(
        device, "raster", "raster_bin_count", chunks, 1,
        np.int32(n), np.int32(chunk), np.int32(band_shift), np.int32(bands), cell, hist,
    )  # fmt: skip
    launch(
        device, "raster", "raster_bin_offsets", 1, 1,
        np.int32(chunks), np.int32(bands), hist, band_start,
    )  # fmt: skip
    launch(
        device, "raster", "raster_bin_scatter", chunks, 1,
        *common, *bins, cell, hist, rec_cell, rec,
    )  # fmt: skip
    launch(
        device, "raster", "raster_bin_accumulate", bands, 1,
        np.int32(band_cells), np.int32(cells), band_start, rec_cell, rec,
        cl.LocalMemory(band_cells * 20), *(layer.buffer for layer in layers.values()),
    )  # fmt: skip
    return _without_values({name: layer.result() for name, layer in layers.items()}, with_values)


def _without_values(layers: dict[str, NDArray[Any]], with_values: int) -> dict[str, NDArray[Any]]:
    """Without intensity the layer is NaN everywhere (the kernels leave zeros)."""
    if not with_values:
        layers["mean_intensity"].fill(np.nan)
    return layers
