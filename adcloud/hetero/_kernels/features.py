"""Launch code of ``features.cl``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero._kernels import Output, launch, launch_3d, to_device
from adcloud.hetero.errors import HeteroError

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice

#: The most pixels one launch takes: ``hog_gray`` indexes a batch's pixels with an int.
MAX_PIXELS = 2**31 - 1


def hog(
    device: OpenCLDevice,
    images: NDArray[np.uint8],
    weights: tuple[float, float, float],
    cell: int,
    bins: int,
) -> NDArray[np.float32]:
    """HOG descriptors (B, D) of uint8 images (B, H, W) or (B, H, W, C>=3), C-order; a
    batch of more than :data:`MAX_PIXELS` pixels in parts that each fit."""
    count, height, width = images.shape[:3]
    if count * height * width > MAX_PIXELS:
        per_part = MAX_PIXELS // (height * width)
        if per_part == 0:
            msg = (
                f"an image of {height}x{width} has more pixels than the OpenCL HOG kernels "
                f"index ({MAX_PIXELS:,}): compute its features on the CPU (device='numpy')"
            )
            raise HeteroError(msg)
        parts = [
            hog(device, images[i : i + per_part], weights, cell, bins)
            for i in range(0, count, per_part)
        ]
        return np.concatenate(parts)
    channels = 1 if images.ndim == 3 else images.shape[3]
    cells_y, cells_x = height // cell, width // cell
    blocks = count * max(cells_y - 1, 0) * max(cells_x - 1, 0)
    size = 4 * bins * max(cells_y - 1, 0) * max(cells_x - 1, 0)
    out = Output(device, (count, size), np.float32, f"the HOG descriptors of {count} images")
    if blocks == 0:
        return out.array
    pixels = count * height * width
    src = to_device(device, images, f"{count} images of {height}x{width}")
    gray = device.scratch("features.gray", pixels * 4)
    rows, cols = cells_y * cell, cells_x * cell
    votes = device.scratch("features.votes", count * rows * cols * 8)
    lower = device.scratch("features.lower", count * rows * cols)
    hist = device.scratch("features.hist", count * cells_y * cells_x * bins * 4)
    launch(
        device, "features", "hog_gray", pixels, None,
        src, np.int32(pixels), np.int32(channels), *(np.float32(w) for w in weights), gray,
    )  # fmt: skip
    launch_3d(
        device, "features", "hog_votes", (cols, rows, count),
        gray, np.int32(count), np.int32(height), np.int32(width), np.int32(rows),
        np.int32(cols), np.int32(bins), votes, lower,
    )  # fmt: skip
    launch(
        device, "features", "hog_cells", count * cells_y * cells_x, None,
        votes, lower, np.int32(count), np.int32(cell), np.int32(bins), np.int32(cells_y),
        np.int32(cells_x), hist,
    )  # fmt: skip
    launch(
        device, "features", "hog_blocks", blocks, None,
        hist, np.int32(count), np.int32(bins), np.int32(cells_y), np.int32(cells_x), out.buffer,
    )  # fmt: skip
    return out.result()
