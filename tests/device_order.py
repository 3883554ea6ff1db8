"""Whether this process's default compute device sums in a fixed order (for tests that
compare two runs bit for bit)."""

from __future__ import annotations

from adcloud.hetero.devices import DeviceKind, OpenCLDevice, select_device


def sums_in_any_order() -> bool:
    """True on GPUs, whose voxel kernels sum with float atomics in whatever order
    work-items finish; CPU devices and NumPy add every voxel's points in input order."""
    device = select_device()
    return isinstance(device, OpenCLDevice) and device.info.kind != DeviceKind.CPU
