"""OpenCL C programs and the thin pyopencl code that launches them (private).

Each program is a ``.cl`` file next to this module; :func:`program_source` prepends
``common.cl`` so that one self-contained source can also be compiled offline for FPGAs
(``aoc``/``v++``).  :func:`build_program` compiles it for a device, or loads the prebuilt
binary ``<binary_dir>/<ip_id>/<program>.{aocx,xclbin,bin}`` for kinds that cannot compile
at run time.  The helpers below wrap NumPy arrays in buffers (without copies on devices
that share host memory), launch kernels and turn OpenCL errors into
:class:`~adcloud.hetero.errors.HeteroError` naming the device and kernel.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyopencl as cl
from numpy.typing import NDArray

from adcloud.hetero.errors import HeteroError, KernelBuildError

if TYPE_CHECKING:
    from adcloud.hetero.devices import OpenCLDevice

log = logging.getLogger(__name__)

PROGRAMS = ("transform", "voxel", "icp", "raster", "features")
"""Every program this package ships (``<name>.cl``)."""

BINARY_SUFFIXES = (".aocx", ".xclbin", ".bin")
"""Prebuilt binary file suffixes tried in order: Intel FPGA, Xilinx, generic."""


@functools.cache
def program_source(name: str) -> str:
    """The self-contained OpenCL C source of program ``name`` (``common.cl`` + ``name.cl``)."""
    if name not in PROGRAMS:
        raise HeteroError(f"no OpenCL program {name!r}; known: {', '.join(PROGRAMS)}")
    folder = resources.files(__package__)
    common = (folder / "common.cl").read_text()
    body = (folder / f"{name}.cl").read_text()
    return f'{common}\n#line 1 "{name}.cl"\n{body}'


def binary_candidates(binary_dir: Path, ip_id: str, name: str) -> list[Path]:
    """Where the prebuilt binary of program ``name`` for FPGA IP ``ip_id`` may be."""
    return [binary_dir / ip_id / f"{name}{suffix}" for suffix in BINARY_SUFFIXES]


def build_program(device: OpenCLDevice, name: str) -> cl.Program:
    """Compile program ``name`` for ``device``, or load its prebuilt binary."""
    if device.build.prebuilt:
        return _load_binary(device, name)
    options = ["-cl-std=CL1.2", *device.build.options.split()]
    try:
        program: cl.Program = cl.Program(device.context, program_source(name)).build(
            options=options
        )
    except cl.Error as err:
        msg = f"OpenCL program {name} failed to build on {device.info.describe()}: {err}"
        raise KernelBuildError(msg) from err
    log.debug("built OpenCL program %s for %s", name, device.info.describe())
    return program


def _load_binary(device: OpenCLDevice, name: str) -> cl.Program:
    build = device.build
    if build.binary_dir is None:
        msg = (
            f"{device.info.describe()} loads prebuilt binaries (hetero.prebuilt_kinds) but "
            "hetero.binary_dir is not set (ADCLOUD_HETERO_BINARY_DIR); compile the sources "
            "from `adcloud hetero kernels --out DIR` with the vendor's offline compiler into "
            f"DIR/<ip_id>/<program>{{{','.join(BINARY_SUFFIXES)}}}"
        )
        raise KernelBuildError(msg)
    candidates = binary_candidates(build.binary_dir, build.ip_id, name)
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        msg = (
            f"no prebuilt binary of OpenCL program {name} for FPGA IP {build.ip_id!r} on "
            f"{device.info.describe()}: looked for {', '.join(str(p) for p in candidates)}"
        )
        raise KernelBuildError(msg)
    try:
        program = cl.Program(device.context, [device.device], [found.read_bytes()])
        program.build(options=device.build.options.split())
    except cl.Error as err:
        msg = f"prebuilt binary {found} does not load on {device.info.describe()}: {err}"
        raise KernelBuildError(msg) from err
    log.info("loaded prebuilt OpenCL program %s from %s", name, found)
    return program


@contextlib.contextmanager
def launching(device: OpenCLDevice, what: str) -> Iterator[None]:
    """Turn OpenCL errors raised inside the block into :class:`HeteroError`."""
    try:
        yield
    except cl.Error as err:
        msg = f"OpenCL {what} failed on {device.info.describe()}: {err}"
        raise HeteroError(msg) from err


def allocate(
    device: OpenCLDevice,
    flags: int,
    nbytes: int,
    what: str,
    hostbuf: NDArray[Any] | None = None,
) -> cl.Buffer:
    """A device buffer of ``nbytes`` (at least 1) bytes, or :class:`HeteroError` naming
    ``what`` needed it, the device and its largest allocation, and how to get under it.

    Drivers refuse a buffer larger than ``CL_DEVICE_MAX_MEM_ALLOC_SIZE`` (a quarter of a
    GPU's memory, often less) with a bare ``INVALID_BUFFER_SIZE``, and a kernel's input
    grows with what one call is given (a batch of images, a cloud).
    """
    size = max(int(nbytes), 1)
    limit = device.info.max_alloc_bytes
    advice = (
        "give one call less data (fewer points per cloud, fewer images per batch: "
        "--batch of `adcloud hetero features`) or run on a device with more memory"
    )
    if limit and size > limit:
        msg = (
            f"{what} needs an OpenCL buffer of {_mib(size)}, more than the {_mib(limit)} "
            f"that {device.info.describe()} can allocate at once; {advice}"
        )
        raise HeteroError(msg)
    try:
        if hostbuf is None:
            return cl.Buffer(device.context, flags, size)
        return cl.Buffer(device.context, flags, hostbuf=hostbuf)
    except cl.Error as err:
        msg = (
            f"cannot allocate {_mib(size)} for {what} on {device.info.describe()}: {err}; {advice}"
        )
        raise HeteroError(msg) from err


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def to_device(device: OpenCLDevice, array: NDArray[Any], what: str = "an input") -> cl.Buffer:
    """A read-only buffer holding ``array`` (C-contiguous, non-empty).

    On devices that share host memory the buffer wraps the array itself
    (``CL_MEM_USE_HOST_PTR``): no copy, and the caller must keep ``array`` alive and
    unchanged until the kernels that read it have finished.
    """
    if not array.flags.c_contiguous or array.nbytes == 0:
        raise HeteroError("internal: device buffers need a non-empty C-contiguous array")
    placement = (
        cl.mem_flags.USE_HOST_PTR if device.info.unified_memory else cl.mem_flags.COPY_HOST_PTR
    )
    flags: int = cl.mem_flags.READ_ONLY | placement
    return allocate(device, flags, array.nbytes, what, hostbuf=array)


def scratch(device: OpenCLDevice, nbytes: int, what: str = "a kernel's output") -> cl.Buffer:
    """An uninitialised read-write device buffer of ``nbytes`` (at least 1) bytes."""
    return allocate(device, cl.mem_flags.READ_WRITE, nbytes, what)


def filled(device: OpenCLDevice, value: np.generic, count: int) -> cl.Buffer:
    """A device buffer of ``count`` copies of the scalar ``value`` (its dtype sets the size)."""
    buffer = scratch(device, count * value.itemsize)
    if count:
        pattern = np.array([value])
        cl.enqueue_fill_buffer(device.queue, buffer, pattern, 0, count * value.itemsize)
    return buffer


def from_device(
    device: OpenCLDevice, buffer: cl.Buffer, shape: tuple[int, ...], dtype: Any
) -> NDArray[Any]:
    """Copy ``buffer`` into a new host array of ``shape``/``dtype`` (waits for the queue)."""
    out = np.empty(shape, dtype=dtype)
    if out.nbytes:
        cl.enqueue_copy(device.queue, out, buffer, is_blocking=True)
    return out


class Output:
    """A new host array that a kernel writes, and the buffer it writes through.

    On devices that share host memory the buffer wraps the array (no copy back);
    :meth:`result` waits for the queue and returns the array.
    """

    def __init__(
        self, device: OpenCLDevice, shape: tuple[int, ...], dtype: Any, what: str = "a result"
    ) -> None:
        self.device = device
        self.array: NDArray[Any] = np.empty(shape, dtype=dtype)
        self.zero_copy = device.info.unified_memory and self.array.nbytes > 0
        if self.zero_copy:
            flags = cl.mem_flags.WRITE_ONLY | cl.mem_flags.USE_HOST_PTR
            self.buffer = allocate(device, flags, self.array.nbytes, what, self.array)
        else:
            self.buffer = scratch(device, self.array.nbytes, what)

    def result(self) -> NDArray[Any]:
        """The array with the kernel's results (blocks until they are there)."""
        if not self.array.nbytes:
            return self.array
        queue = self.device.queue
        with launching(self.device, "reading results"):
            if not self.zero_copy:
                cl.enqueue_copy(queue, self.array, self.buffer, is_blocking=True)
                return self.array
            mapped, _ = cl.enqueue_map_buffer(
                queue, self.buffer, cl.map_flags.READ, 0, self.array.shape, self.array.dtype,
                is_blocking=True,
            )  # fmt: skip
            if mapped.__array_interface__["data"][0] != self.array.ctypes.data:
                np.copyto(self.array, mapped)  # the driver kept its own copy after all
            mapped.base.release(queue)
            queue.finish()
        return self.array


class Bands(NamedTuple):
    """How a binned reduction splits its work: ``n`` points into ``chunks`` of ``chunk``
    (one work-item each, in input order), and its outputs into ``number`` bands of ``size``
    consecutive outputs (one work-item each; ``size`` a power of two, ``1 << shift``, so
    a point's band is a shift, not a division)."""

    chunks: int
    chunk: int
    size: int
    shift: int
    number: int

    @classmethod
    def plan(cls, device: OpenCLDevice, n: int, outputs: int, max_size: int) -> Bands:
        """At most four chunks and at least four bands per compute unit (for balance), bands
        of at most ``max_size`` outputs (their accumulators stay in cache)."""
        units = device.info.compute_units
        chunks = max(1, min(4 * units, -(-n // 4096)))
        size = 1 << (max(1, -(-outputs // (4 * units))) - 1).bit_length()
        while size > max(1, max_size):
            size //= 2
        return cls(chunks, -(-n // chunks), size, size.bit_length() - 1, -(-outputs // size))


def default_local_size(device: OpenCLDevice) -> int:
    """Work-group size for element-wise kernels: small on CPUs (PoCL runs a work-group as
    one vectorized loop), larger on GPUs."""
    return 64 if device.info.kind == "cpu" else 256


def launch(
    device: OpenCLDevice,
    program: str,
    name: str,
    global_size: int,
    local_size: int | None,
    *args: Any,
) -> None:
    """Enqueue kernel ``name`` of ``program`` over ``global_size`` work-items.

    ``local_size`` None picks :func:`default_local_size`.  The global size is rounded up to
    a multiple of the local size (kernels check their bounds).  Scalars must be NumPy
    scalars of the kernel's argument types.
    """
    if global_size <= 0:
        return
    kernel = device.kernel(program, name)
    if local_size is None:
        local_size = min(default_local_size(device), device.info.max_work_group_size)
    global_size = -(-global_size // local_size) * local_size
    _check_range(device, program, name, global_size)
    with launching(device, f"kernel {program}.{name}"):
        kernel.set_args(*args)
        cl.enqueue_nd_range_kernel(device.queue, kernel, (global_size,), (local_size,))


def launch_3d(
    device: OpenCLDevice,
    program: str,
    name: str,
    global_size: tuple[int, int, int],
    *args: Any,
) -> None:
    """Enqueue kernel ``name`` over a 3-D range (fastest axis first), rounded up to whole
    work-groups of (32, 1, 1); kernels check their bounds."""
    if min(global_size) <= 0:
        return
    kernel = device.kernel(program, name)
    local = (min(32, device.info.max_work_group_size), 1, 1)
    padded = (-(-global_size[0] // local[0]) * local[0], global_size[1], global_size[2])
    _check_range(device, program, name, padded[0] * padded[1] * padded[2])
    with launching(device, f"kernel {program}.{name}"):
        kernel.set_args(*args)
        cl.enqueue_nd_range_kernel(device.queue, kernel, padded, local)


_MAX_ITEMS = 2**31 - 1  # the kernels index work-items and elements with 32-bit ints


def _check_range(device: OpenCLDevice, program: str, name: str, items: int) -> None:
    """Refuse a launch of more work-items than the kernels' ``int`` indices count."""
    if items > _MAX_ITEMS:
        msg = (
            f"kernel {program}.{name} on {device.info.describe()}: {items:,} work-items, more "
            f"than the kernels' 32-bit indices count ({_MAX_ITEMS:,}); give one call less "
            "data (fewer points per cloud, fewer images per batch)"
        )
        raise HeteroError(msg)
