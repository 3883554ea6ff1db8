"""HOG image features on every OpenCL device against the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from adcloud.hetero import HeteroError, decode_image, hog_features, hog_size
from adcloud.hetero.devices import ComputeDevice

from .conftest import smooth_images

pytestmark = pytest.mark.opencl


@pytest.mark.parametrize("color", [True, False])
def test_batches_match_the_reference(device: ComputeDevice, color: bool) -> None:
    images = smooth_images(12, 96, 128, seed=1, color=color)
    got = hog_features(images, device=device)
    want = hog_features(images, device="numpy")
    assert got.shape == want.shape == (12, hog_size(96, 128))
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_descriptor_properties() -> None:
    image = smooth_images(1, 64, 64, seed=2)[0]
    feature = hog_features(image, device="numpy")
    assert feature.shape == (7 * 7 * 36,)
    blocks = feature.reshape(-1, 36)
    np.testing.assert_allclose(np.linalg.norm(blocks, axis=1), 1.0, atol=1e-3)
    flat = np.full((64, 64), 128, np.uint8)
    assert not hog_features(flat, device="numpy").any()  # no gradient, no votes


def test_vertical_edge_votes_into_the_horizontal_gradient_bin() -> None:
    image = np.zeros((16, 16), np.uint8)
    image[:, 8:] = 200
    hist = hog_features(image, bins=9, device="numpy").reshape(4, 9)
    # gradient along +x: 0 degrees, split between the bins centred at 10 and 170 degrees
    assert hist[:, [0, 8]].sum() > 0.99 * hist.sum()


@pytest.mark.parametrize("shape", [(7, 30), (15, 15), (16, 16), (17, 33)])
def test_small_and_odd_sizes(device: ComputeDevice, shape: tuple[int, int]) -> None:
    images = smooth_images(3, *shape, seed=3, color=False)
    got = hog_features(images, device=device)
    assert got.shape == (3, hog_size(*shape))
    np.testing.assert_allclose(got, hog_features(images, device="numpy"), atol=2e-5)


def test_options_and_errors(device: ComputeDevice) -> None:
    images = smooth_images(2, 48, 48, seed=4)
    got = hog_features(images, cell=6, bins=12, device=device)
    np.testing.assert_allclose(
        got, hog_features(images, cell=6, bins=12, device="numpy"), atol=2e-5
    )
    assert hog_features(np.empty((0, 32, 32), np.uint8), device=device).shape == (0, 324)
    with pytest.raises(HeteroError, match="uint8"):
        hog_features(images.astype(np.float32), device=device)
    with pytest.raises(HeteroError, match="bins"):
        hog_features(images, bins=64, device=device)


def test_decode_image_encodings() -> None:
    rgb = smooth_images(1, 5, 4, seed=5)[0]
    assert np.array_equal(decode_image(5, 4, "rgb8", 12, rgb.tobytes()), rgb)
    bgr = rgb[:, :, ::-1]
    assert np.array_equal(decode_image(5, 4, "bgr8", 12, np.ascontiguousarray(bgr).tobytes()), rgb)
    rgba = np.concatenate([rgb, np.full((5, 4, 1), 255, np.uint8)], axis=2)
    assert np.array_equal(decode_image(5, 4, "rgba8", 16, rgba.tobytes()), rgb)
    padded = np.concatenate([rgb.reshape(5, 12), np.zeros((5, 4), np.uint8)], axis=1)
    assert np.array_equal(decode_image(5, 4, "rgb8", 16, padded.tobytes()), rgb)
    mono = rgb[:, :, 0].copy()
    assert np.array_equal(decode_image(5, 4, "mono8", 4, mono.tobytes()), mono)
    with pytest.raises(HeteroError, match="32FC1"):
        decode_image(5, 4, "32FC1", 16, bytes(80))
    with pytest.raises(HeteroError, match="does not hold"):
        decode_image(5, 4, "rgb8", 12, bytes(10))


@pytest.mark.parametrize(
    ("height", "width", "step", "field"),
    [
        (-2, 4, 12, "height"),
        (0, 4, 12, "height"),
        (2, -4, 12, "width"),
        (2, 0, 0, "width"),
        (2, 4, 0, "step"),
        (2, 4, -12, "step"),
        (2, 4, 11, "step 11 is shorter than a row"),
        (2.0, 4, 12, "height"),
    ],
)
def test_decode_image_names_a_bad_size_field(
    height: int, width: int, step: int, field: str
) -> None:
    # negative and zero sizes gave empty or garbage arrays, or a raw ValueError from reshape
    with pytest.raises(HeteroError, match=f"image {field}"):
        decode_image(height, width, "rgb8", step, bytes(100))


def test_decode_image_reads_the_bytes_of_an_array_of_any_shape() -> None:
    rgb = smooth_images(1, 2, 4, seed=6)[0]
    padded = np.zeros((3, 12), np.uint8)  # one row more than the image has
    padded[:2] = rgb.reshape(2, 12)
    assert np.array_equal(decode_image(2, 4, "rgb8", 12, padded), rgb)


def test_a_batch_over_the_kernels_pixel_index_runs_in_parts(
    cpu_device: ComputeDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gray kernel indexes a batch's pixels with an int: a batch of more than 2**31
    pixels (a thousand 1920x1200 frames) failed with NumPy's OverflowError. It runs in
    parts that fit -- here a limit of three 48x64 images -- with the same descriptors."""
    from adcloud.hetero._kernels import features as kernels  # noqa: PLC0415

    images = smooth_images(7, 48, 64, seed=6)
    whole = hog_features(images, device=cpu_device)
    launches: list[int] = []
    hog = kernels.hog

    def counted(device: object, batch: np.ndarray, *args: object) -> np.ndarray:
        launches.append(len(batch))
        return hog(device, batch, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "hog", counted)
    monkeypatch.setattr(kernels, "MAX_PIXELS", 3 * 48 * 64 + 5)
    parts = hog_features(images, device=cpu_device)
    assert launches == [7, 3, 3, 1]
    np.testing.assert_array_equal(parts, whole)
    np.testing.assert_allclose(parts, hog_features(images, device="numpy"), atol=2e-5)
    monkeypatch.setattr(kernels, "MAX_PIXELS", 48 * 64 - 1)
    with pytest.raises(HeteroError, match="an image of 48x64 has more pixels than the OpenCL"):
        hog_features(images, device=cpu_device)
