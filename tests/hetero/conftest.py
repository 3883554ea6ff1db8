"""Fixtures of the hetero tests: OpenCL devices, the real scan pair, small image bags.

``device`` is parametrized over every OpenCL device of this machine (PoCL's CPU device
everywhere; GPUs and FPGAs where present), so each kernel test is a conformance test run
against every backend and compared with the NumPy reference.  A machine without OpenCL
fails these tests with the install hint instead of skipping them: pyopencl and PoCL are
dependencies of the project.  ``gpu_device`` skips where no GPU exists (marker ``gpu``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from adcloud.hetero import DeviceKind, list_devices, open_device, opencl_status
from adcloud.hetero._ply import read_ply
from adcloud.hetero.devices import ComputeDevice

SCAN_PAIR = "04_gicp_scan_pair_with_reference_tf"
T0 = 1_700_000_000_000_000_000


def _device_addresses() -> list[str]:
    if opencl_status() is not None:
        return ["missing-opencl"]
    return [d.address for d in list_devices()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _device_addresses(), indirect=True)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> ComputeDevice:
    """An OpenCL device of this machine (one test per device)."""
    address = str(request.param)
    if address == "missing-opencl":
        pytest.fail(f"OpenCL is not usable here: {opencl_status()}", pytrace=False)
    return open_device(address)


@pytest.fixture(scope="session")
def cpu_device() -> ComputeDevice:
    """The first OpenCL CPU device (PoCL); fails with the install hint when absent."""
    problem = opencl_status()
    if problem is not None:
        pytest.fail(f"OpenCL is not usable here: {problem}", pytrace=False)
    for info in list_devices():
        if info.kind == DeviceKind.CPU:
            return open_device(info.address)
    pytest.fail("no OpenCL CPU device: pip install pocl-binary-distribution", pytrace=False)


@pytest.fixture(scope="session")
def gpu_device() -> ComputeDevice:
    """The first OpenCL GPU; the test is skipped on machines without one."""
    if opencl_status() is None:
        for info in list_devices():
            if info.kind == DeviceKind.GPU:
                return open_device(info.address)
    pytest.skip("no OpenCL GPU on this machine")


@pytest.fixture(scope="session")
def scan_pair(shared_data: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source (N, 4), target (M, 4) x y z intensity, reference 4x4 target<-source)."""
    folder = shared_data / SCAN_PAIR
    source, _ = read_ply(folder / "small_gicp_source.ply")
    target, _ = read_ply(folder / "small_gicp_target.ply")
    return source, target, np.loadtxt(folder / "small_gicp_T_target_source.txt")


def write_image_bag(
    path: Path,
    images: Sequence[np.ndarray],
    *,
    topic: str = "/camera/image_raw",
    encoding: str | Sequence[str] = "rgb8",
    pad: int = 0,
    chunk_threshold: int = 256 * 1024,
    extra_topic: bool = True,
) -> Path:
    """A ROS 1 bag of ``sensor_msgs/Image`` messages, 100 ms apart (plus a String topic).

    ``images`` are (H, W) for mono8 or (H, W, 3) in the encoding's channel order
    (``encoding``: one for all, or one per image); ``pad`` bytes of padding end every row
    (``step > width * channels``).
    """
    # imported here so that the kernel tests run where rosbags is not installed (a GPU box)
    from rosbags.rosbag1 import Writer  # noqa: PLC0415
    from rosbags.typesys import Stores, get_typestore  # noqa: PLC0415

    ROS1 = get_typestore(Stores.ROS1_NOETIC)  # noqa: N806 - the typestore's usual name
    types = ROS1.types
    writer = Writer(path)
    writer.chunk_threshold = chunk_threshold
    with writer:
        conn = writer.add_connection(topic, "sensor_msgs/msg/Image", typestore=ROS1)
        other = (
            writer.add_connection("/status", "std_msgs/msg/String", typestore=ROS1)
            if extra_topic
            else None
        )
        for i, image in enumerate(images):
            stamp = T0 + i * 100_000_000
            height, width = image.shape[:2]
            channels = 1 if image.ndim == 2 else image.shape[2]
            rows = image.reshape(height, width * channels)
            if pad:
                rows = np.concatenate([rows, np.full((height, pad), 7, np.uint8)], axis=1)
            sec, nsec = divmod(stamp, 1_000_000_000)
            header = types["std_msgs/msg/Header"](
                seq=i,
                stamp=types["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec),
                frame_id="cam",
            )
            msg = types["sensor_msgs/msg/Image"](
                header=header,
                height=height,
                width=width,
                encoding=encoding if isinstance(encoding, str) else encoding[i],
                is_bigendian=0,
                step=width * channels + pad,
                data=np.ascontiguousarray(rows).reshape(-1),
            )
            writer.write(conn, stamp, bytes(ROS1.serialize_ros1(msg, "sensor_msgs/msg/Image")))
            if other is not None and i % 3 == 0:
                status = types["std_msgs/msg/String"](data=f"frame {i}")
                writer.write(
                    other, stamp + 1, bytes(ROS1.serialize_ros1(status, "std_msgs/msg/String"))
                )
    return path


def smooth_images(
    count: int, height: int, width: int, *, seed: int = 0, color: bool = True
) -> np.ndarray:
    """Images with structure (gradients, blobs, edges) plus noise, uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(count):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        base = 120 + 80 * np.sin(x / rng.uniform(3, 12) + y / rng.uniform(5, 20))
        base += 60 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * (width / 6) ** 2))
        base += rng.normal(0, 6, base.shape)
        image = np.stack([base, base * 0.8 + 20, 255 - base], axis=-1) if color else base
        out.append(np.clip(image, 0, 255).astype(np.uint8))
    return np.stack(out)


@pytest.fixture(scope="session")
def pocl_env() -> dict[str, str]:
    """This environment without settings that would leak into a subprocess."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ADCLOUD_SPARK_", "ADCLOUD_HETERO_", "PYSPARK_", "SPARK_"))
    }
