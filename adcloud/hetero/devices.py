"""OpenCL devices: discovery, the selection policy and the per-process context cache.

Addresses
    A device is named by an *address* that is the same string everywhere: in
    ``adcloud hetero devices``, in the Spark resource-discovery JSON that
    ``deploy/discover_opencl.sh`` prints, in ``TaskContext.resources()`` inside a task and in
    the ``ADCLOUD_HETERO_DEVICE`` setting.

    - ``"P:D"`` -- device ``D`` (index into ``platform.get_devices()``) of OpenCL platform
      ``P`` (index into ``cl.get_platforms()``).  Indices are stable on one machine: the ICD
      loader enumerates vendors in a fixed order.
    - ``"P:D:S/N"`` -- sub-device ``S`` of device ``P:D`` split *equally* into ``N`` parts
      (``clCreateSubDevices`` with ``CL_DEVICE_PARTITION_EQUALLY``, ``compute_units // N``
      compute units each).  PoCL supports this, so one CPU device can honestly be offered to
      Spark as ``N`` schedulable devices that really run on disjoint compute units.
    - ``"K"`` (a bare integer, as Spark's stock ``getGpusResources.sh`` prints) -- the
      ``K``-th device of the kinds mapped to the Spark resource (``gpu`` or ``fpga``).
    - ``"numpy"`` -- the NumPy reference kernels (no OpenCL).

Selection (:func:`select_device`)
    1. an explicit ``address`` argument;
    2. inside a Spark task, the first address Spark assigned for one of
       :attr:`HeteroSettings.resources` (``gpu``, ``fpga``) -- the task opens exactly that
       device;
    3. :attr:`HeteroSettings.device`;
    4. the policy: the first device of the first kind in :attr:`HeteroSettings.prefer`
       (GPU, then ACCELERATOR, then CPU);
    5. with no OpenCL platform at all, the NumPy reference (a WARNING naming what to install),
       or :class:`~adcloud.errors.MissingComponentError` when
       :attr:`HeteroSettings.numpy_fallback` is off.

    Every choice is logged (INFO the first time in a process, DEBUG afterwards).

Process cache
    Contexts, queues and compiled programs are created lazily, on first use, in the process
    that uses them (never in a parent that later forks: PySpark's worker daemon forks its
    workers) and cached per process.  A cache inherited through ``fork`` is abandoned, not
    released, because OpenCL handles are not valid in a forked child.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from adcloud.config import load_settings
from adcloud.errors import AdcloudError, ConfigError, MissingComponentError
from adcloud.hetero.errors import DeviceNotFoundError, HeteroError

if TYPE_CHECKING:
    import pyopencl as cl

__all__ = [
    "BACKENDS",
    "NUMPY_ADDRESS",
    "OPENCL_INSTALL_HINT",
    "ComputeDevice",
    "DeviceAddress",
    "DeviceBackend",
    "DeviceInfo",
    "DeviceKind",
    "HeteroSettings",
    "NumpyDevice",
    "OpenCLDevice",
    "as_device",
    "discover",
    "icd_registration",
    "list_devices",
    "open_device",
    "opencl_status",
    "resolve_device",
    "select_device",
    "spark_assignment",
    "unregistered_icds",
]

log = logging.getLogger(__name__)

OPENCL_INSTALL_HINT = (
    "pip install pyopencl pocl-binary-distribution (PoCL runs the kernels on the CPU); "
    "for GPUs and FPGAs also install the vendor's OpenCL ICD (NVIDIA driver, Intel FPGA "
    "runtime, Xilinx XRT)"
)
"""How to get a working OpenCL stack; part of every missing-OpenCL message."""

NUMPY_ADDRESS = "numpy"
"""The address of the NumPy reference backend."""

_SPARK_RESOURCES = ("gpu", "fpga")
_YARN_IP_ENV = "REQUESTED_FPGA_IP_ID"


class DeviceKind(enum.StrEnum):
    """What a device is; FPGAs report themselves to OpenCL as ``ACCELERATOR``."""

    GPU = "gpu"
    ACCELERATOR = "accelerator"
    CPU = "cpu"
    NUMPY = "numpy"


_KINDS = {k.value for k in DeviceKind if k is not DeviceKind.NUMPY}


@dataclass(frozen=True)
class DeviceAddress:
    """A parsed ``"P:D"`` or ``"P:D:S/N"`` address (see the module docstring)."""

    platform: int
    device: int
    part: int | None = None
    parts: int | None = None

    @classmethod
    def parse(cls, text: str) -> DeviceAddress:
        """Parse ``"P:D"`` / ``"P:D:S/N"``; raises :class:`DeviceNotFoundError` otherwise."""
        pieces = text.strip().split(":")
        try:
            platform, device = int(pieces[0]), int(pieces[1]) if len(pieces) > 1 else 0
            if min(platform, device) < 0:  # a negative index would count from the end
                raise ValueError(pieces)
            if len(pieces) == 2:
                return cls(platform, device)
            if len(pieces) == 3:
                part, _, parts = pieces[2].partition("/")
                address = cls(platform, device, int(part), int(parts))
                if not 0 <= int(part) < int(parts):
                    raise ValueError(part)
                return address
        except ValueError:
            pass
        msg = (
            f"{text!r} is not an OpenCL device address: expected 'P:D' (platform and device "
            "index), 'P:D:S/N' (sub-device S of N), a bare device number or 'numpy'"
        )
        raise DeviceNotFoundError(msg)

    def __str__(self) -> str:
        base = f"{self.platform}:{self.device}"
        return base if self.part is None else f"{base}:{self.part}/{self.parts}"


@dataclass(frozen=True)
class DeviceInfo:
    """What one device offers, as OpenCL reports it.

    ``global_mem_bytes``/``local_mem_bytes``/``max_alloc_bytes`` are bytes;
    ``unified_memory`` says the device works on host memory (CPUs, integrated GPUs), so
    buffers can wrap NumPy arrays without copies.
    """

    address: str
    kind: DeviceKind
    name: str
    platform: str
    vendor: str
    version: str
    driver_version: str
    compute_units: int
    global_mem_bytes: int
    local_mem_bytes: int
    max_alloc_bytes: int
    max_work_group_size: int
    unified_memory: bool
    extensions: tuple[str, ...] = ()

    @property
    def int64_atomics(self) -> bool:
        """Whether 64-bit global atomics (``cl_khr_int64_base_atomics``) are available."""
        return "cl_khr_int64_base_atomics" in self.extensions

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``kind`` as its string value, extensions as a list)."""
        return {
            "address": self.address,
            "kind": self.kind.value,
            "name": self.name,
            "platform": self.platform,
            "vendor": self.vendor,
            "version": self.version,
            "driver_version": self.driver_version,
            "compute_units": self.compute_units,
            "global_mem_bytes": self.global_mem_bytes,
            "local_mem_bytes": self.local_mem_bytes,
            "max_alloc_bytes": self.max_alloc_bytes,
            "max_work_group_size": self.max_work_group_size,
            "unified_memory": self.unified_memory,
            "extensions": list(self.extensions),
        }

    def describe(self) -> str:
        """One line for logs: address, name, kind and compute units."""
        return f"{self.address} ({self.name}, {self.kind.value}, {self.compute_units} CU)"


NUMPY_DEVICE_INFO = DeviceInfo(
    address=NUMPY_ADDRESS,
    kind=DeviceKind.NUMPY,
    name="NumPy reference kernels",
    platform=f"NumPy {np.__version__}",
    vendor="NumPy",
    version="",
    driver_version="",
    compute_units=1,
    global_mem_bytes=0,
    local_mem_bytes=0,
    max_alloc_bytes=0,
    max_work_group_size=1,
    unified_memory=True,
)


@dataclass(frozen=True)
class HeteroSettings:
    """How devices are discovered and chosen (settings section ``hetero``).

    Every field can be overridden with ``ADCLOUD_HETERO_<FIELD>``, e.g.
    ``ADCLOUD_HETERO_DEVICE=0:1`` or ``ADCLOUD_HETERO_GPU_KINDS=cpu``.

    - ``backend``: ``auto`` (OpenCL when a platform exists, else NumPy), ``opencl`` or
      ``numpy``.
    - ``device``: an address to use outside Spark-assigned resources (empty: the policy).
    - ``prefer``: device kinds in order of preference for the policy.
    - ``resources``: Spark resource names whose task addresses name the device.
    - ``numpy_fallback``: fall back to the NumPy reference (logged) when no OpenCL platform
      exists; off: raise :class:`~adcloud.errors.MissingComponentError`.
    - ``gpu_kinds`` / ``fpga_kinds``: OpenCL device kinds the discovery script reports for
      Spark's ``gpu`` / ``fpga`` resources (``cpu`` lets PoCL stand in on a laptop).
    - ``split``: discovery offers every device as this many equal sub-devices (0: whole).
    - ``prebuilt_kinds``: kinds that load prebuilt program binaries instead of compiling
      OpenCL C (FPGAs cannot compile at run time).
    - ``binary_dir``: where prebuilt binaries live: ``<binary_dir>/<ip_id>/<program>.aocx``
      (Intel), ``.xclbin`` (Xilinx) or ``.bin``.
    - ``ip_id``: the FPGA IP id, as YARN's FPGA plugin names it; empty: the container's
      ``REQUESTED_FPGA_IP_ID``, else ``default``.
    - ``build_options``: extra OpenCL C compiler options for source builds.
    """

    backend: str = "auto"
    device: str = ""
    prefer: tuple[str, ...] = ("gpu", "accelerator", "cpu")
    resources: tuple[str, ...] = _SPARK_RESOURCES
    numpy_fallback: bool = True
    gpu_kinds: tuple[str, ...] = ("gpu",)
    fpga_kinds: tuple[str, ...] = ("accelerator",)
    split: int = 0
    prebuilt_kinds: tuple[str, ...] = ("accelerator",)
    binary_dir: Path | None = None
    ip_id: str = ""
    build_options: str = ""

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "opencl", "numpy"):
            msg = f"hetero.backend: {self.backend!r} is not one of auto, opencl, numpy"
            raise ConfigError(msg)
        for name in ("prefer", "gpu_kinds", "fpga_kinds", "prebuilt_kinds"):
            bad = [k for k in getattr(self, name) if k not in _KINDS]
            if bad:
                msg = f"hetero.{name}: {bad} not among the device kinds {sorted(_KINDS)}"
                raise ConfigError(msg)
        if self.split < 0:
            raise ConfigError(f"hetero.split must be >= 0, got {self.split}")

    @classmethod
    def load(
        cls,
        *,
        file: str | Path | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> HeteroSettings:
        """Defaults, then the ``hetero`` section of ``file``, ``ADCLOUD_HETERO_*``, overrides."""
        return load_settings(cls, "hetero", file=file, environ=environ, **overrides)

    def kinds_for(self, resource: str) -> tuple[str, ...]:
        """OpenCL device kinds that stand behind Spark resource ``resource``."""
        if resource == "gpu":
            return self.gpu_kinds
        if resource == "fpga":
            return self.fpga_kinds
        msg = f"unknown Spark resource {resource!r}: adcloud discovers 'gpu' and 'fpga'"
        raise ConfigError(msg)

    def fpga_ip_id(self) -> str:
        """The IP id whose prebuilt binaries FPGA devices load."""
        return self.ip_id or os.environ.get(_YARN_IP_ENV, "") or "default"


# -- devices ------------------------------------------------------------------------------------


@runtime_checkable
class ComputeDevice(Protocol):
    """A device kernels run on: an OpenCL device or the NumPy reference."""

    @property
    def info(self) -> DeviceInfo:
        """What the device is."""
        ...


class NumpyDevice:
    """The NumPy reference kernels, for machines without any OpenCL platform."""

    @property
    def info(self) -> DeviceInfo:
        """:data:`NUMPY_DEVICE_INFO`."""
        return NUMPY_DEVICE_INFO

    def __repr__(self) -> str:
        return "NumpyDevice()"


@dataclass(frozen=True)
class _BuildConfig:
    """How an :class:`OpenCLDevice` gets its programs (part of the cache key)."""

    prebuilt: bool
    binary_dir: Path | None
    ip_id: str
    options: str


class OpenCLDevice:
    """An open OpenCL device: its context, one in-order queue, compiled programs and kernels.

    Create through :func:`open_device`/:func:`select_device` (cached per process), not
    directly.  Threads may share it: programs are built once per process (under a lock),
    while kernel objects -- whose arguments are set before each launch -- and scratch
    buffers are each thread's own, so concurrent calls neither overwrite each other's
    arguments nor free a buffer another thread's kernel is using.
    """

    def __init__(self, info: DeviceInfo, device: cl.Device, build: _BuildConfig) -> None:
        import pyopencl as cl  # noqa: PLC0415 - optional dependency, imported on use

        self._info = info
        self.device = device
        self.build = build
        self.context = cl.Context([device])
        self.queue = cl.CommandQueue(self.context, device)
        self._programs: dict[str, cl.Program] = {}
        self._build_lock = threading.Lock()
        self._local = threading.local()  # .kernels and .scratch of the calling thread
        self.pid = os.getpid()

    @property
    def info(self) -> DeviceInfo:
        """What the device is."""
        return self._info

    def program(self, name: str) -> cl.Program:
        """The compiled (or prebuilt, for FPGAs) program ``name``, built once per process."""
        program = self._programs.get(name)
        if program is None:
            from adcloud.hetero._kernels import build_program  # noqa: PLC0415 - cycle

            with self._build_lock:  # threads that ask at once wait for one build
                program = self._programs.get(name)
                if program is None:
                    program = build_program(self, name)
                    self._programs[name] = program
        return program

    def _thread_cache(self, what: str) -> dict[Any, Any]:
        cache: dict[Any, Any] | None = getattr(self._local, what, None)
        if cache is None:
            cache = {}
            setattr(self._local, what, cache)
        return cache

    def kernel(self, program: str, name: str) -> cl.Kernel:
        """Kernel ``name`` of program ``program`` (one cached object per kernel and thread)."""
        kernels = self._thread_cache("kernels")
        key = (program, name)
        kernel = kernels.get(key)
        if kernel is None:
            import pyopencl as cl  # noqa: PLC0415

            kernel = cl.Kernel(self.program(program), name)
            kernels[key] = kernel
        return kernel

    def scratch(self, name: str, nbytes: int) -> cl.Buffer:
        """A device buffer of at least ``nbytes`` bytes kept under ``name`` for reuse.

        Kernels' intermediate buffers live here so that repeated calls neither allocate nor
        fault in fresh memory.  Contents are undefined; a buffer is only valid until the
        calling thread's next request for the same name (kernel calls are synchronous).
        """
        import pyopencl as cl  # noqa: PLC0415

        from adcloud.hetero._kernels import allocate  # noqa: PLC0415 - cycle

        buffers = self._thread_cache("scratch")
        buffer = buffers.get(name)
        if buffer is None or buffer.size < nbytes:
            buffers.pop(name, None)  # a failed allocation must not leave the old one in use
            buffer = allocate(self, cl.mem_flags.READ_WRITE, nbytes, f"scratch {name}")
            buffers[name] = buffer
        return buffer

    def __repr__(self) -> str:
        return f"OpenCLDevice({self._info.describe()})"


# -- backends -----------------------------------------------------------------------------------


class DeviceBackend(Protocol):
    """A family of devices: how to list them and open one by address."""

    name: str
    install_hint: str

    def unavailable(self) -> str | None:
        """Why the backend cannot be used here, or None when it can."""
        ...

    def list_devices(self, split: int = 0) -> list[DeviceInfo]:
        """Every device (each split into ``split`` sub-devices where possible)."""
        ...

    def open(self, address: str, settings: HeteroSettings) -> ComputeDevice:
        """The device at ``address`` (cached per process)."""
        ...


class _NumpyBackend:
    name = "numpy"
    install_hint = "numpy (always installed)"

    def unavailable(self) -> str | None:
        return None

    def list_devices(self, split: int = 0) -> list[DeviceInfo]:
        return [NUMPY_DEVICE_INFO]

    def open(self, address: str, settings: HeteroSettings) -> ComputeDevice:
        return NumpyDevice()


_OPENCL_PID: list[int] = []  # the process that first touched the OpenCL runtime


def _import_cl() -> Any:
    """pyopencl, or :class:`MissingComponentError` with the install hint.

    Raises :class:`HeteroError` in a process forked after its parent used OpenCL: ICDs
    (PoCL's thread pool, GPU drivers) do not survive ``fork`` and would hang or crash.
    """
    try:
        import pyopencl as cl  # noqa: PLC0415
    except ImportError as err:
        msg = f"OpenCL kernels need pyopencl, which is not installed: {OPENCL_INSTALL_HINT}"
        raise MissingComponentError(msg) from err
    if not _OPENCL_PID:
        _OPENCL_PID.append(os.getpid())
    elif _OPENCL_PID[0] != os.getpid():
        msg = (
            f"process {os.getpid()} was forked from process {_OPENCL_PID[0]} after that one "
            "had used OpenCL; OpenCL runtimes do not survive fork. Use OpenCL only in the "
            "forked processes (as Spark's Python workers do) or start them with 'spawn'"
        )
        raise HeteroError(msg)
    return cl


def _platforms(cl: Any) -> list[Any]:
    """``cl.get_platforms()``, with "no platform" (the ICD loader's error) as an empty list."""
    try:
        return list(cl.get_platforms())
    except cl.Error as err:
        log.debug("cl.get_platforms() failed: %s", err)
        return []


def _kind_of(cl: Any, device_type: int) -> DeviceKind:
    if device_type & cl.device_type.GPU:
        return DeviceKind.GPU
    if device_type & cl.device_type.ACCELERATOR:
        return DeviceKind.ACCELERATOR
    return DeviceKind.CPU


def _describe(cl: Any, address: str, platform: Any, device: Any) -> DeviceInfo:
    try:
        unified = bool(device.host_unified_memory)
    except cl.Error:  # removed in OpenCL 2.0 headers on some drivers
        unified = bool(device.type & cl.device_type.CPU)
    return DeviceInfo(
        address=address,
        kind=_kind_of(cl, device.type),
        name=device.name.strip(),
        platform=platform.name.strip(),
        vendor=device.vendor.strip(),
        version=device.version.strip(),
        driver_version=device.driver_version.strip(),
        compute_units=int(device.max_compute_units),
        global_mem_bytes=int(device.global_mem_size),
        local_mem_bytes=int(device.local_mem_size),
        max_alloc_bytes=int(device.max_mem_alloc_size),
        max_work_group_size=int(device.max_work_group_size),
        unified_memory=unified,
        extensions=tuple(sorted(device.extensions.split())),
    )


def _sub_devices(cl: Any, device: Any, parts: int) -> list[Any] | None:
    """``device`` split equally into ``parts`` sub-devices, or None where it cannot be."""
    units = int(device.max_compute_units) // parts
    if parts < 2 or units < 1:
        return None
    try:
        if cl.device_partition_property.EQUALLY not in device.partition_properties:
            return None
        subs = device.create_sub_devices([cl.device_partition_property.EQUALLY, units])
    except cl.Error as err:
        log.debug("cannot split %s into %d: %s", device.name, parts, err)
        return None
    return list(subs)[:parts] if len(subs) >= parts else None


class _OpenCLBackend:
    name = "opencl"
    install_hint = OPENCL_INSTALL_HINT

    def unavailable(self) -> str | None:
        try:
            cl = _import_cl()
        except MissingComponentError as err:
            return str(err)
        if not _platforms(cl):
            return (
                "no OpenCL platform is installed (the ICD loader found none); "
                f"{OPENCL_INSTALL_HINT}"
            )
        return None

    def list_devices(self, split: int = 0) -> list[DeviceInfo]:
        cl = _import_cl()
        found: list[DeviceInfo] = []
        for p_index, platform in enumerate(_platforms(cl)):
            try:
                devices = platform.get_devices()
            except cl.Error as err:  # a platform with no devices raises DEVICE_NOT_FOUND
                log.debug("platform %s lists no devices: %s", platform.name, err)
                continue
            for d_index, device in enumerate(devices):
                subs = _sub_devices(cl, device, split) if split else None
                if subs is None:
                    if split:
                        log.info(
                            "%s cannot be split into %d sub-devices; offering it whole",
                            device.name.strip(),
                            split,
                        )
                    found.append(_describe(cl, f"{p_index}:{d_index}", platform, device))
                    continue
                for s_index, sub in enumerate(subs):
                    address = str(DeviceAddress(p_index, d_index, s_index, split))
                    found.append(_describe(cl, address, platform, sub))
        return found

    def open(self, address: str, settings: HeteroSettings) -> ComputeDevice:
        parsed = DeviceAddress.parse(address)
        kind_prebuilt = settings.prebuilt_kinds
        cache = _CACHE.current()
        with cache.lock:
            cl = _import_cl()
            platforms = _platforms(cl)
            if parsed.platform >= len(platforms):
                msg = (
                    f"device {address}: there is no OpenCL platform {parsed.platform} here "
                    f"({len(platforms)} platform(s)); run `adcloud hetero devices`"
                )
                raise DeviceNotFoundError(msg)
            platform = platforms[parsed.platform]
            try:
                devices = platform.get_devices()
            except cl.Error:
                devices = []
            if parsed.device >= len(devices):
                msg = (
                    f"device {address}: platform {parsed.platform} ({platform.name.strip()}) "
                    f"has {len(devices)} device(s); run `adcloud hetero devices`"
                )
                raise DeviceNotFoundError(msg)
            device = devices[parsed.device]
            kind = _kind_of(cl, device.type)
            build = _BuildConfig(
                prebuilt=kind.value in kind_prebuilt,
                binary_dir=settings.binary_dir,
                ip_id=settings.fpga_ip_id(),
                options=settings.build_options,
            )
            key = (str(parsed), build)
            cached = cache.devices.get(key)
            if cached is not None:
                return cached
            if parsed.part is not None:
                assert parsed.parts is not None
                subs = _sub_devices(cl, device, parsed.parts)
                if subs is None:
                    msg = (
                        f"device {address}: {device.name.strip()} cannot be split into "
                        f"{parsed.parts} equal sub-devices"
                    )
                    raise DeviceNotFoundError(msg)
                device = subs[parsed.part]
            info = _describe(cl, str(parsed), platform, device)
            try:
                opened = OpenCLDevice(info, device, build)
            except cl.Error as err:
                msg = f"cannot open an OpenCL context on {info.describe()}: {err}"
                raise HeteroError(msg) from err
            cache.devices[key] = opened
            return opened


BACKENDS: dict[str, DeviceBackend] = {"opencl": _OpenCLBackend(), "numpy": _NumpyBackend()}
"""The device backends by name (``HeteroSettings.backend`` picks one; ``auto`` tries both)."""


# -- the per-process cache ------------------------------------------------------------------------


@dataclass
class _ProcessCache:
    pid: int = field(default_factory=os.getpid)
    devices: dict[tuple[str, _BuildConfig], OpenCLDevice] = field(default_factory=dict)
    # (address as asked, settings) -> device, and settings -> the policy's device: repeated
    # calls skip enumerating platforms and devices.
    requests: dict[tuple[str, HeteroSettings], ComputeDevice] = field(default_factory=dict)
    policy: dict[HeteroSettings, ComputeDevice] = field(default_factory=dict)
    logged: set[tuple[str, str]] = field(default_factory=set)
    lock: threading.RLock = field(default_factory=threading.RLock)


class _Cache:
    """The process's cache, replaced (never released) after a fork."""

    def __init__(self) -> None:
        self._cache = _ProcessCache()
        self._abandoned: list[_ProcessCache] = []

    def current(self) -> _ProcessCache:
        if self._cache.pid != os.getpid():
            # OpenCL objects made by the parent are not valid here; releasing them could
            # crash or hang the driver, so they are kept unreachable-but-alive instead.
            self._abandoned.append(self._cache)
            self._cache = _ProcessCache()
        return self._cache


_CACHE = _Cache()


def _log_choice(source: str, info: DeviceInfo, detail: str) -> None:
    cache = _CACHE.current()
    key = (source, info.address)
    level = logging.DEBUG if key in cache.logged else logging.INFO
    cache.logged.add(key)
    log.log(level, "hetero: running kernels on %s, %s", info.describe(), detail)


# -- public functions -----------------------------------------------------------------------------


def opencl_status() -> str | None:
    """None when OpenCL kernels can run here, else why not (with the install hint)."""
    return BACKENDS["opencl"].unavailable()


# The OpenCL libraries of GPU drivers, which the ICD loader finds only through a registration
# file: GPU containers often mount the driver's libraries without writing that file.
_VENDOR_LIBRARIES = ("libnvidia-opencl.so.1", "libamdocl64.so", "libigdrcl.so")
_LIBRARY_DIRS = (
    "/usr/local/nvidia/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/opt/rocm/lib",
)
_REGISTRY = "/etc/OpenCL/vendors"


def unregistered_icds(
    library_dirs: Sequence[str | Path] | None = None, registry: str | Path | None = None
) -> list[Path]:
    """GPU vendors' OpenCL libraries present on this machine that no ICD registration names.

    The ICD loader lists only the platforms named by the ``*.icd`` files of ``registry``
    (default: ``OCL_ICD_VENDORS`` -- a folder or one file -- else ``/etc/OpenCL/vendors``).
    A driver library in ``library_dirs`` (default: ``LD_LIBRARY_PATH`` and the usual system
    folders) that none of them names is a GPU the kernels cannot see until it is registered:
    ``echo PATH > /etc/OpenCL/vendors/NAME.icd``.
    """
    if library_dirs is None:
        extra = os.environ.get("LD_LIBRARY_PATH", "")
        library_dirs = [d for d in extra.split(os.pathsep) if d] + list(_LIBRARY_DIRS)
    if registry is None:
        registry = os.environ.get("OCL_ICD_VENDORS") or _REGISTRY
    where = Path(registry)
    files = sorted(where.glob("*.icd")) if where.is_dir() else [where] if where.is_file() else []
    named = set()
    for icd in files:
        try:
            named.add(Path(icd.read_text(encoding="utf-8", errors="replace").strip()).name)
        except OSError:
            continue
    found: dict[str, Path] = {}
    for folder in library_dirs:
        for name in _VENDOR_LIBRARIES:
            path = Path(folder) / name
            if name not in named and name not in found and path.exists():
                found[name] = path
    return list(found.values())


def icd_registration(library: Path) -> str:
    """The shell line that registers a vendor's OpenCL ``library`` with the ICD loader: a
    file in the folder ``OCL_ICD_VENDORS`` names, else in ``/etc/OpenCL/vendors``."""
    vendor = library.name.removeprefix("lib").split("-")[0].split(".")[0]
    folder = os.environ.get("OCL_ICD_VENDORS") or ""
    if not (folder and Path(folder).is_dir()):
        folder = _REGISTRY
    return f"echo {library} > {folder}/{vendor}.icd"


def list_devices(*, split: int = 0, include_numpy: bool = False) -> list[DeviceInfo]:
    """Every OpenCL device on this machine, in address order.

    ``split`` offers each device as that many equal sub-devices where the driver allows it.
    An empty list means no OpenCL platform is installed; a missing pyopencl raises
    :class:`~adcloud.errors.MissingComponentError`.  ``include_numpy`` appends the NumPy
    reference backend.
    """
    found = BACKENDS["opencl"].list_devices(split)
    if include_numpy:
        found.append(NUMPY_DEVICE_INFO)
    return found


def discover(resource: str, settings: HeteroSettings | None = None) -> dict[str, Any]:
    """Spark's resource-discovery document for ``resource`` (``gpu`` or ``fpga``).

    ``{"name": "gpu", "addresses": ["0:0", ...]}``: the addresses of the devices whose kind
    is in :meth:`HeteroSettings.kinds_for` (GPUs for ``gpu``, ACCELERATORs for ``fpga``),
    split into :attr:`HeteroSettings.split` sub-devices when set.
    """
    settings = HeteroSettings.load() if settings is None else settings
    kinds = settings.kinds_for(resource)
    addresses = [d.address for d in list_devices(split=settings.split) if d.kind.value in kinds]
    return {"name": resource, "addresses": addresses}


def _resolve_index(index: int, resource: str | None, settings: HeteroSettings) -> str:
    """A bare device number: the ``index``-th device of the resource's kinds."""
    kinds = settings.kinds_for(resource) if resource in _SPARK_RESOURCES else tuple(_KINDS)
    matching = [d.address for d in list_devices() if d.kind.value in kinds]
    if index >= len(matching):
        numbered = ", ".join(f"{i} = {a}" for i, a in enumerate(matching)) or "none"
        msg = (
            f"device number {index} (resource {resource or '-'}): only {len(matching)} "
            f"device(s) of kinds {', '.join(sorted(kinds))} here ({numbered})"
        )
        raise DeviceNotFoundError(msg)
    return matching[index]


def _devices_here() -> str:
    """The devices an address may name on this machine, for error messages."""
    try:
        found = list_devices() if opencl_status() is None else []
    except AdcloudError as err:  # pyopencl missing: only the reference is there
        log.debug("cannot list OpenCL devices: %s", err)
        found = []
    return "; ".join([*(d.describe() for d in found), f"{NUMPY_ADDRESS} (NumPy reference)"])


def _open_for(address: str, settings: HeteroSettings, source: str | None) -> ComputeDevice:
    """:func:`open_device`, with a :class:`DeviceNotFoundError` that names where the address
    came from (``source``; None: the caller's argument) and the devices that exist here."""
    try:
        return open_device(address, settings)
    except DeviceNotFoundError as err:
        where = f"{source}: " if source else ""
        msg = f"{where}{err}. Devices here: {_devices_here()}"
        raise DeviceNotFoundError(msg) from err


def resolve_device(address: str, settings: HeteroSettings | None = None) -> str:
    """The canonical address (``P:D``, ``P:D:S/N`` or ``numpy``) that ``address`` names."""
    settings = HeteroSettings() if settings is None else settings
    text = address.strip()
    if text == NUMPY_ADDRESS:
        return text
    if text.isdigit():
        return _resolve_index(int(text), None, settings)
    return str(DeviceAddress.parse(text))


def open_device(address: str, settings: HeteroSettings | None = None) -> ComputeDevice:
    """The device at ``address``, opened once per process and cached.

    Raises :class:`DeviceNotFoundError` for an address that names no device here and
    :class:`~adcloud.errors.MissingComponentError` when pyopencl is missing.
    """
    settings = HeteroSettings() if settings is None else settings
    cache = _CACHE.current()
    known = cache.requests.get((address, settings))
    if known is not None:
        return known
    canonical = resolve_device(address, settings)
    backend = BACKENDS["numpy" if canonical == NUMPY_ADDRESS else "opencl"]
    device = backend.open(canonical, settings)
    cache.requests[(address, settings)] = device
    return device


def spark_assignment(names: Sequence[str]) -> tuple[str, list[str], int] | None:
    """(resource name, addresses, partition id) Spark assigned to the running task, or None
    outside a Spark task or without resources of the given ``names``."""
    if "pyspark" not in sys.modules:  # not inside Spark: do not pay for importing it
        return None
    from pyspark import TaskContext  # noqa: PLC0415

    context = TaskContext.get()
    if context is None:
        return None
    resources = context.resources()
    for name in names:
        info = resources.get(name)
        if info is not None and info.addresses:
            return name, list(info.addresses), int(context.partitionId())
    return None


def select_device(
    settings: HeteroSettings | None = None, *, address: str | None = None
) -> ComputeDevice:
    """The device this process (or Spark task) should run kernels on; see the module doc.

    ``settings`` defaults to :meth:`HeteroSettings.load` (defaults + ``ADCLOUD_HETERO_*``).
    """
    settings = HeteroSettings.load() if settings is None else settings
    if address is not None:
        device = _open_for(address, settings, None)
        _log_choice("argument", device.info, "as asked by the caller")
        return device
    if settings.backend == "numpy":
        device = open_device(NUMPY_ADDRESS, settings)
        _log_choice("setting", device.info, "as hetero.backend=numpy asks")
        return device
    assigned = spark_assignment(settings.resources)
    if assigned is not None:
        resource, addresses, partition = assigned
        wanted = addresses[0]
        source = (
            f"Spark assigned {resource} address {wanted!r} to the task of partition "
            f"{partition} (check spark.*.resource.{resource}.discoveryScript and its "
            f"addresses: `adcloud hetero devices --discover {resource}`)"
        )
        try:
            if wanted.isdigit():
                wanted = _resolve_index(int(wanted), resource, settings)
        except DeviceNotFoundError as err:
            raise DeviceNotFoundError(f"{source}: {err}. Devices here: {_devices_here()}") from err
        device = _open_for(wanted, settings, source)
        more = f" (of {addresses})" if len(addresses) > 1 else ""
        _log_choice(
            f"spark:{resource}",
            device.info,
            f"assigned by Spark as {resource} address {addresses[0]}{more} "
            f"to the task of partition {partition}",
        )
        return device
    if settings.device:
        source = f"hetero.device (ADCLOUD_HETERO_DEVICE) is {settings.device!r}"
        device = _open_for(settings.device, settings, source)
        _log_choice("setting", device.info, "from hetero.device")
        return device
    chosen = _CACHE.current().policy.get(settings)
    if chosen is not None:
        _log_choice("policy", chosen.info, "picked by preference (cached)")
        return chosen
    problem = opencl_status()
    if problem is None:
        devices = list_devices()
        for kind in settings.prefer:
            for info in devices:
                if info.kind.value == kind:
                    device = open_device(info.address, settings)
                    _CACHE.current().policy[settings] = device
                    _log_choice(
                        "policy",
                        device.info,
                        f"picked by preference {', '.join(settings.prefer)}",
                    )
                    _warn_unregistered(settings, device.info.kind)
                    return device
        problem = (
            f"no OpenCL device of the kinds {', '.join(settings.prefer)} "
            f"(found: {', '.join(d.describe() for d in devices) or 'none'})"
        )
    if settings.backend == "opencl" or not settings.numpy_fallback:
        raise MissingComponentError(f"no usable OpenCL device: {problem}")
    _warn_unregistered(settings, DeviceKind.NUMPY)
    cache = _CACHE.current()
    if ("fallback", NUMPY_ADDRESS) not in cache.logged:
        cache.logged.add(("fallback", NUMPY_ADDRESS))
        log.warning("hetero: %s; running the NumPy reference kernels instead", problem)
    device = open_device(NUMPY_ADDRESS, settings)
    cache.policy[settings] = device
    return device


def _warn_unregistered(settings: HeteroSettings, chosen: DeviceKind) -> None:
    """Warn once per process when the policy settles below a GPU it prefers while a GPU
    driver's OpenCL library sits unregistered (:func:`unregistered_icds`): the kernels would
    otherwise run on the CPU of a GPU machine without a word."""
    prefer = list(settings.prefer)
    if "gpu" not in prefer or chosen == DeviceKind.GPU:
        return
    if chosen.value in prefer and prefer.index(chosen.value) < prefer.index("gpu"):
        return  # the user prefers this kind to GPUs
    cache = _CACHE.current()
    if ("unregistered", "") in cache.logged:
        return
    cache.logged.add(("unregistered", ""))
    for path in unregistered_icds():
        log.warning(
            "hetero: %s is a GPU driver's OpenCL library, but no ICD file registers it, so "
            "its GPUs are not used; register it: %s",
            path,
            icd_registration(path),
        )


def as_device(device: ComputeDevice | str | None) -> ComputeDevice:
    """``device`` itself, the device at an address string (or a bare device number), or
    :func:`select_device`; raises :class:`DeviceNotFoundError` for anything else."""
    if device is None:
        return select_device()
    if isinstance(device, int | np.integer) and not isinstance(device, bool):
        # a device number, as "0" is: it ran the NumPy reference, as any non-device did
        return _open_for(str(int(device)), HeteroSettings(), None)
    if isinstance(device, str):
        return _open_for(device, HeteroSettings(), None)
    if not isinstance(device, ComputeDevice):
        raise DeviceNotFoundError(
            f"device must be a ComputeDevice, an address ('P:D', 'P:D:S/N', a device number "
            f"or 'numpy') or None, got {device!r}"
        )
    return device
