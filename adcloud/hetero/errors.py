"""Errors of the heterogeneous-compute layer.

Every error :mod:`adcloud.hetero` raises is a :class:`HeteroError` (or the root package's
:class:`~adcloud.errors.MissingComponentError` when pyopencl or an OpenCL platform that a
setting demands is not installed).  OpenCL's own exceptions are wrapped where they enter,
with the device and kernel named.
"""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = ["DeviceNotFoundError", "HeteroError", "KernelBuildError"]


class HeteroError(AdcloudError):
    """A kernel could not run: bad input, a failed launch, a device that disappeared."""


class DeviceNotFoundError(HeteroError):
    """A device address (from Spark, a setting or an argument) names no OpenCL device here."""


class KernelBuildError(HeteroError):
    """An OpenCL program failed to compile, or its prebuilt (FPGA) binary is missing/unusable.

    The message carries the build log or the paths that were searched.
    """
