"""Heterogeneous compute: OpenCL kernels run from Spark executors on GPUs, FPGAs or CPUs.

- :mod:`~adcloud.hetero.devices` -- discovery (``adcloud hetero devices``, Spark's
  resource-discovery JSON), the device a task must use (:func:`select_device`: the
  address Spark assigned, else a policy, else the NumPy reference) and the per-process
  context/program cache;
- kernels, each with a NumPy reference (``device="numpy"``) and NumPy in / NumPy out:
  :func:`transform_points`, :func:`voxel_downsample`, :func:`nearest_neighbors`,
  :func:`estimate_normals`, :func:`normal_equations` and :func:`align` (point-to-plane
  ICP on a voxel-hash grid), :func:`rasterize`, :func:`hog_features`;
- :func:`map_partitions` -- run a kernel over an RDD's partitions on each task's device;
- :func:`extract_features` -- the image feature job (``adcloud hetero features``);
- :func:`yarn_submit_args` -- spark-submit options for YARN GPU/FPGA containers.

Raw OpenCL programs and buffers live in the private ``_kernels`` package.
"""

from __future__ import annotations

from adcloud.hetero.demo import HeteroDemo, run_demo
from adcloud.hetero.devices import (
    BACKENDS,
    NUMPY_ADDRESS,
    OPENCL_INSTALL_HINT,
    ComputeDevice,
    DeviceAddress,
    DeviceInfo,
    DeviceKind,
    HeteroSettings,
    NumpyDevice,
    OpenCLDevice,
    discover,
    list_devices,
    open_device,
    opencl_status,
    select_device,
    unregistered_icds,
)
from adcloud.hetero.errors import DeviceNotFoundError, HeteroError, KernelBuildError
from adcloud.hetero.feature_job import FeatureJobResult, extract_features, read_features
from adcloud.hetero.features import decode_image, hog_features, hog_size
from adcloud.hetero.icp import (
    Alignment,
    Matches,
    NormalEquations,
    PointGrid,
    align,
    apply_increment,
    build_grid,
    estimate_normals,
    nearest_neighbors,
    normal_equations,
)
from adcloud.hetero.raster import GridSpec, Raster, rasterize
from adcloud.hetero.rdd import PartitionResult, map_partitions
from adcloud.hetero.transform import transform_points
from adcloud.hetero.voxel import Voxels, voxel_downsample
from adcloud.hetero.yarn import yarn_submit_args

__all__ = [
    "BACKENDS",
    "NUMPY_ADDRESS",
    "OPENCL_INSTALL_HINT",
    "Alignment",
    "ComputeDevice",
    "DeviceAddress",
    "DeviceInfo",
    "DeviceKind",
    "DeviceNotFoundError",
    "FeatureJobResult",
    "GridSpec",
    "HeteroDemo",
    "HeteroError",
    "HeteroSettings",
    "KernelBuildError",
    "Matches",
    "NormalEquations",
    "NumpyDevice",
    "OpenCLDevice",
    "PartitionResult",
    "PointGrid",
    "Raster",
    "Voxels",
    "align",
    "apply_increment",
    "build_grid",
    "decode_image",
    "discover",
    "estimate_normals",
    "extract_features",
    "hog_features",
    "hog_size",
    "list_devices",
    "map_partitions",
    "nearest_neighbors",
    "normal_equations",
    "open_device",
    "opencl_status",
    "rasterize",
    "read_features",
    "run_demo",
    "select_device",
    "transform_points",
    "unregistered_icds",
    "voxel_downsample",
    "yarn_submit_args",
]
