"""Inputs larger than a device can hold fail with a HeteroError that says what to do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from adcloud.hetero import (
    GridSpec,
    HeteroError,
    align,
    hog_features,
    rasterize,
    transform_points,
    voxel_downsample,
)
from adcloud.hetero._kernels import launch
from adcloud.hetero.devices import ComputeDevice, OpenCLDevice


def _with_max_alloc(device: ComputeDevice, nbytes: int) -> OpenCLDevice:
    """``device`` as if its driver allowed buffers of at most ``nbytes``."""
    assert isinstance(device, OpenCLDevice)
    info = dataclasses.replace(device.info, max_alloc_bytes=nbytes)
    return OpenCLDevice(info, device.device, device.build)


def test_inputs_beyond_the_largest_allocation_say_what_needed_it_and_what_to_do(
    cpu_device: ComputeDevice,
) -> None:
    """A batch or cloud larger than CL_DEVICE_MAX_MEM_ALLOC_SIZE (a quarter of a GPU's
    memory) failed with pyopencl's bare ``create_buffer failed: INVALID_BUFFER_SIZE``."""
    small = _with_max_alloc(cpu_device, 2**20)
    rng = np.random.default_rng(0)
    cloud = rng.uniform(0, 10, (100_000, 3)).astype(np.float32)
    calls = [
        ("8 images", lambda: hog_features(np.zeros((8, 240, 320, 3), np.uint8), device=small)),
        ("100,000 points", lambda: voxel_downsample(cloud, 0.1, device=small)),
        ("100,000 points", lambda: transform_points(cloud, np.eye(4), device=small)),
        (
            "100,000 points",
            lambda: rasterize(
                cloud, GridSpec(0, 0, 0.1, 100, 100), strategy="binned", device=small
            ),
        ),
        ("points", lambda: align(cloud, cloud, voxel_size=0, device=small)),
    ]
    for what, call in calls:
        with pytest.raises(HeteroError, match="can allocate at once") as caught:
            call()
        message = str(caught.value)
        assert what in message
        assert small.info.describe() in message and "1.0 MiB" in message
        assert "give one call less data" in message
    # the same calls fit a device with room for them
    assert hog_features(np.zeros((2, 32, 32), np.uint8), device=small).shape == (2, 324)


def test_a_buffer_the_driver_refuses_is_a_hetero_error(cpu_device: ComputeDevice) -> None:
    """Where the device reports more than its driver allocates, the driver's refusal is
    wrapped too (named, with the device), and the name's old buffer is not kept."""
    roomy = _with_max_alloc(cpu_device, 2**62)
    roomy.scratch("limits.test", 64)
    with pytest.raises(HeteroError, match=r"cannot allocate .* for scratch limits\.test on 0:"):
        roomy.scratch("limits.test", 2**61)


def test_launches_beyond_32_bit_indices_are_refused(cpu_device: ComputeDevice) -> None:
    assert isinstance(cpu_device, OpenCLDevice)
    with pytest.raises(HeteroError, match=r"transform\.transform_points .* 32-bit indices"):
        launch(cpu_device, "transform", "transform_points", 2**31, None)
