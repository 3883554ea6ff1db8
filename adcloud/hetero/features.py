"""Image features: gradients and HOG-style histograms of oriented gradients, batched.

For every image: grey levels (``0.299 R + 0.587 G + 0.114 B`` on the 0..255 scale, or the
single channel), central-difference gradients with clamped edges, gradient magnitudes voted
into ``bins`` unsigned orientation bins over [0, 180) degrees per ``cell x cell`` pixel cell
(each vote split linearly between the two nearest bin centres), then 2x2-cell blocks
(stride one cell) normalised with L2-Hys (L2, clip at 0.2, L2 again; eps 1e-5).  Pixels
beyond the last whole cell are ignored.  The descriptor of an image with ``cy x cx`` cells
has ``(cy - 1) * (cx - 1) * 4 * bins`` values, ordered (block row, block column, cell row
in block, cell column in block, bin); images smaller than 2x2 cells give an empty one.

:func:`decode_image` turns a ``sensor_msgs/Image`` (8-bit encodings) into an array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from adcloud.hetero.devices import ComputeDevice, OpenCLDevice, as_device
from adcloud.hetero.errors import HeteroError

__all__ = ["IMAGE_ENCODINGS", "decode_image", "hog_features", "hog_size"]

_LUMA = (0.299, 0.587, 0.114)
_MAX_BINS = 32
_EPS = np.float32(1e-5)
_CLIP = np.float32(0.2)

IMAGE_ENCODINGS = {"mono8": 1, "8UC1": 1, "rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "8UC3": 3}
"""``sensor_msgs/Image`` encodings :func:`decode_image` reads, with their channel counts."""


def hog_size(height: int, width: int, *, cell: int = 8, bins: int = 9) -> int:
    """Length of the descriptor of a ``height x width`` image."""
    cells_y, cells_x = height // cell, width // cell
    return max(cells_y - 1, 0) * max(cells_x - 1, 0) * 4 * bins


def decode_image(
    height: int, width: int, encoding: str, step: int, data: NDArray[Any] | bytes | memoryview
) -> NDArray[np.uint8]:
    """The pixels of a ``sensor_msgs/Image`` as (H, W) or (H, W, 3) uint8, channels R G B.

    Handles row padding (``step``, bytes per row), BGR order and drops alpha.  Other
    encodings raise :class:`HeteroError` naming the encoding; so do a ``height``, ``width`` or
    ``step`` below 1 and a ``step`` shorter than a row of pixels, naming the field.  Returns
    a view of ``data`` when no reordering is needed.
    """
    channels = IMAGE_ENCODINGS.get(encoding)
    if channels is None:
        known = ", ".join(sorted(IMAGE_ENCODINGS))
        raise HeteroError(f"image encoding {encoding!r} is not supported (supported: {known})")
    for name, value in (("height", height), ("width", width), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            unit = "bytes" if name == "step" else "pixels"
            raise HeteroError(f"image {name} must be a positive number of {unit}, got {value!r}")
    if isinstance(data, np.ndarray):  # any shape: the message's bytes, row after row
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, np.uint8)
    if step < width * channels:
        raise HeteroError(
            f"image step {step} is shorter than a row of {width} x {channels} {encoding} "
            f"pixels ({width * channels} bytes)"
        )
    if raw.size < height * step:
        raise HeteroError(
            f"image data of {raw.size} bytes does not hold {height} rows of step {step} "
            f"for {width} x {channels} {encoding} pixels"
        )
    rows = raw[: height * step].reshape(height, step)[:, : width * channels]
    pixels = rows.reshape(height, width, channels) if channels > 1 else rows
    if encoding.startswith("bgr"):
        pixels = pixels[:, :, 2::-1]
    elif channels == 4:
        pixels = pixels[:, :, :3]
    return pixels


def _check(images: NDArray[Any], cell: int, bins: int) -> tuple[NDArray[np.uint8], bool]:
    """Images as a (B, H, W) or (B, H, W, C>=3) batch, and whether one image was given."""
    array = np.asarray(images)
    if array.dtype != np.uint8:
        raise HeteroError(f"images must be uint8, got {array.dtype}")
    if not (1 <= bins <= _MAX_BINS) or cell < 1:
        raise HeteroError(f"need 1 <= bins <= {_MAX_BINS} and cell >= 1 (got {bins}, {cell})")
    single = array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))
    if single:
        array = array[None]
    if array.ndim not in (3, 4) or (array.ndim == 4 and array.shape[3] < 3):
        raise HeteroError(
            f"images must be (H, W), (H, W, 3), (B, H, W) or (B, H, W, 3); got {array.shape}"
        )
    return array, single


def hog_features(
    images: NDArray[Any],
    *,
    cell: int = 8,
    bins: int = 9,
    device: ComputeDevice | str | None = None,
) -> NDArray[np.float32]:
    """HOG descriptors of uint8 images: one (H, W) or (H, W, 3) image -> (D,), a batch
    (B, H, W) or (B, H, W, 3) -> (B, D) float32.

    Colour images are R G B (:func:`decode_image` reorders BGR and drops alpha).  All images of a
    batch share one size; see the module docstring for the descriptor's layout.
    """
    array, single = _check(images, cell, bins)
    if array.ndim == 4:
        array = array[..., :3]
    dev = as_device(device)
    if isinstance(dev, OpenCLDevice) and array.shape[0] > 0:
        from adcloud.hetero._kernels import features as kernels  # noqa: PLC0415

        out = kernels.hog(dev, np.ascontiguousarray(array), _LUMA, cell, bins)
    else:
        out = _hog_numpy(array, cell, bins)
    return out[0] if single else out


def _hog_numpy(images: NDArray[np.uint8], cell: int, bins: int) -> NDArray[np.float32]:
    """The NumPy reference (float32 arithmetic, as the kernels)."""
    count, height, width = images.shape[:3]
    cells_y, cells_x = height // cell, width // cell
    size = hog_size(height, width, cell=cell, bins=bins)
    if size == 0 or count == 0:
        return np.zeros((count, size), np.float32)
    if images.ndim == 4:
        w = np.array(_LUMA, np.float32)
        gray = images[..., 0] * w[0] + images[..., 1] * w[1] + images[..., 2] * w[2]
    else:
        gray = images.astype(np.float32)
    gray = gray.astype(np.float32)
    padded = np.pad(gray, ((0, 0), (1, 1), (1, 1)), mode="edge")
    gx = padded[:, 1:-1, 2:] - padded[:, 1:-1, :-2]
    gy = padded[:, 2:, 1:-1] - padded[:, :-2, 1:-1]
    h, w_ = cells_y * cell, cells_x * cell
    gx, gy = gx[:, :h, :w_], gy[:, :h, :w_]
    magnitude = np.sqrt(gx * gx + gy * gy)
    angle = np.arctan2(gy, gx).astype(np.float32)
    angle = np.where(angle < 0, angle + np.float32(np.pi), angle)
    position = angle * np.float32(bins / np.pi) - np.float32(0.5)
    lower = np.floor(position)
    frac = position - lower
    b0 = lower.astype(np.int64) % bins
    b1 = (b0 + 1) % bins
    ys = np.arange(h) // cell
    xs = np.arange(w_) // cell
    cell_index = (ys[:, None] * cells_x + xs[None, :])[None] + (
        np.arange(count)[:, None, None] * cells_y * cells_x
    )
    total = count * cells_y * cells_x * bins
    votes = np.bincount(
        (cell_index * bins + b0).ravel(), weights=(magnitude * (1 - frac)).ravel(), minlength=total
    ) + np.bincount(
        (cell_index * bins + b1).ravel(), weights=(magnitude * frac).ravel(), minlength=total
    )
    hist = votes.astype(np.float32).reshape(count, cells_y, cells_x, bins)
    block = np.stack(
        [hist[:, :-1, :-1], hist[:, :-1, 1:], hist[:, 1:, :-1], hist[:, 1:, 1:]], axis=3
    ).reshape(count, cells_y - 1, cells_x - 1, 4 * bins)
    block = block / np.sqrt((block * block).sum(axis=-1, keepdims=True) + _EPS * _EPS)
    block = np.minimum(block, _CLIP)
    block = block / np.sqrt((block * block).sum(axis=-1, keepdims=True) + _EPS * _EPS)
    out: NDArray[np.float32] = block.reshape(count, -1).astype(np.float32)
    return out
