"""Device discovery, addresses, the selection policy, the process cache and FPGA binaries."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from adcloud.errors import ConfigError, MissingComponentError
from adcloud.hetero import (
    DeviceAddress,
    DeviceKind,
    DeviceNotFoundError,
    HeteroSettings,
    KernelBuildError,
    NumpyDevice,
    OpenCLDevice,
    discover,
    list_devices,
    open_device,
    select_device,
    transform_points,
    unregistered_icds,
)
from adcloud.hetero import devices as devices_module
from adcloud.hetero._kernels import PROGRAMS, program_source

REPO_ROOT = Path(__file__).resolve().parents[2]
DISCOVER = REPO_ROOT / "deploy" / "discover_opencl.sh"
DISCOVER_FPGA = REPO_ROOT / "deploy" / "discover_fpga.sh"

pytestmark = pytest.mark.opencl


# -- addresses and settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("0:0", DeviceAddress(0, 0)),
        ("1:3", DeviceAddress(1, 3)),
        ("0:0:1/2", DeviceAddress(0, 0, 1, 2)),
        (" 2:1:0/4 ", DeviceAddress(2, 1, 0, 4)),
    ],
)
def test_addresses_parse_and_print_back(text: str, parsed: DeviceAddress) -> None:
    assert DeviceAddress.parse(text) == parsed
    assert str(parsed) == text.strip()


@pytest.mark.parametrize("text", ["", "0", "a:b", "0:0:2/2", "0:0:1", "0:0:x/2", "0:0:0:0"])
def test_bad_addresses_are_refused(text: str) -> None:
    with pytest.raises(DeviceNotFoundError, match="not an OpenCL device address"):
        DeviceAddress.parse(text)


@pytest.mark.parametrize("text", ["-1:0", "0:-1", "-1:-1:0/2"])
def test_negative_indices_name_no_device(text: str) -> None:
    # Python would index from the end: "-1:0" opened the last platform's device 0
    with pytest.raises(DeviceNotFoundError, match="not an OpenCL device address"):
        open_device(text)


def test_settings_come_from_the_environment() -> None:
    settings = HeteroSettings.load(
        environ={
            "ADCLOUD_HETERO_DEVICE": "0:0",
            "ADCLOUD_HETERO_GPU_KINDS": "cpu,gpu",
            "ADCLOUD_HETERO_SPLIT": "2",
            "ADCLOUD_HETERO_NUMPY_FALLBACK": "no",
            "ADCLOUD_HETERO_BINARY_DIR": "/opt/fpga",
        }
    )
    assert settings.device == "0:0"
    assert settings.gpu_kinds == ("cpu", "gpu")
    assert settings.split == 2
    assert settings.numpy_fallback is False
    assert settings.binary_dir == Path("/opt/fpga")
    assert settings.kinds_for("fpga") == ("accelerator",)
    assert pickle.loads(pickle.dumps(settings)) == settings


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"backend": "cuda"}, "backend"),
        ({"prefer": ("gpu", "tpu")}, "prefer"),
        ({"split": -1}, "split"),
    ],
)
def test_bad_settings_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HeteroSettings(**overrides)  # type: ignore[arg-type]


def test_unknown_spark_resource_is_refused() -> None:
    with pytest.raises(ConfigError, match="'gpu' and 'fpga'"):
        discover("tpu")


# -- discovery --------------------------------------------------------------------------------


def test_devices_are_listed_with_kind_memory_and_compute_units() -> None:
    found = list_devices()
    assert found, "PoCL provides at least one CPU device"
    addresses = [d.address for d in found]
    assert len(set(addresses)) == len(addresses)
    for info in found:
        assert info.kind in (DeviceKind.GPU, DeviceKind.ACCELERATOR, DeviceKind.CPU)
        assert info.compute_units >= 1
        assert info.global_mem_bytes > 0
        assert info.max_work_group_size >= 1
        assert DeviceAddress.parse(info.address)
        assert json.loads(json.dumps(info.to_dict()))["address"] == info.address
    assert any(d.kind == DeviceKind.CPU for d in found)


def test_pocl_splits_into_sub_devices_with_their_own_addresses() -> None:
    whole = next(d for d in list_devices() if d.kind == DeviceKind.CPU)
    if whole.compute_units < 2:
        pytest.skip("a one-core machine has nothing to split")
    parts = [d for d in list_devices(split=2) if d.address.startswith(whole.address + ":")]
    assert [p.address for p in parts] == [f"{whole.address}:0/2", f"{whole.address}:1/2"]
    assert all(p.compute_units == whole.compute_units // 2 for p in parts)


def test_discovery_document_maps_resources_to_device_kinds() -> None:
    cpu = [d.address for d in list_devices() if d.kind == DeviceKind.CPU]
    gpus = [d.address for d in list_devices() if d.kind == DeviceKind.GPU]
    assert discover("gpu", HeteroSettings()) == {"name": "gpu", "addresses": gpus}
    standing_in = discover("gpu", HeteroSettings(gpu_kinds=("cpu",)))
    assert standing_in == {"name": "gpu", "addresses": cpu}
    assert discover("fpga", HeteroSettings(fpga_kinds=("cpu",)))["name"] == "fpga"


def _run_script(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(script), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_discovery_script_prints_spark_json(pocl_env: dict[str, str]) -> None:
    env = {**pocl_env, "ADCLOUD_PYTHON": sys.executable}
    assert os.access(DISCOVER, os.X_OK)
    assert os.access(DISCOVER_FPGA, os.X_OK)
    plain = _run_script(DISCOVER, env)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout) == discover("gpu", HeteroSettings())
    stand_in = _run_script(
        DISCOVER, {**env, "ADCLOUD_HETERO_GPU_KINDS": "cpu", "ADCLOUD_HETERO_SPLIT": "2"}
    )
    doc = json.loads(stand_in.stdout)
    assert doc["name"] == "gpu"
    assert doc["addresses"] == [
        d.address for d in list_devices(split=2) if d.kind == DeviceKind.CPU
    ]
    fpga = _run_script(DISCOVER_FPGA, {**env, "ADCLOUD_HETERO_FPGA_KINDS": "cpu"})
    assert json.loads(fpga.stdout) == discover("fpga", HeteroSettings(fpga_kinds=("cpu",)))
    bad = _run_script(DISCOVER, env, "tpu")
    assert bad.returncode == 1
    assert "'gpu' and 'fpga'" in bad.stderr
    # more parts than compute units: listed whole, and stderr (the worker's log) says why;
    # Spark only saw one address where it was configured for 4096
    too_many = _run_script(
        DISCOVER, {**env, "ADCLOUD_HETERO_GPU_KINDS": "cpu", "ADCLOUD_HETERO_SPLIT": "4096"}
    )
    assert too_many.returncode == 0, too_many.stderr
    whole = [d.address for d in list_devices() if d.kind == DeviceKind.CPU]
    assert json.loads(too_many.stdout)["addresses"] == whole
    assert f"{', '.join(whole)} cannot be split into 4096 equal sub-devices" in too_many.stderr


# -- selection ----------------------------------------------------------------------------------


def test_policy_prefers_gpu_then_accelerator_then_cpu(caplog: pytest.LogCaptureFixture) -> None:
    found = list_devices()
    with caplog.at_level(logging.DEBUG, logger="adcloud.hetero.devices"):
        chosen = select_device(HeteroSettings())
    for kind in ("gpu", "accelerator", "cpu"):
        of_kind = [d for d in found if d.kind.value == kind]
        if of_kind:
            assert chosen.info.address == of_kind[0].address
            break
    assert "picked by preference" in caplog.text
    cpu_first = select_device(HeteroSettings(prefer=("cpu",)))
    assert cpu_first.info.kind == DeviceKind.CPU


def test_explicit_device_setting_and_numpy_backend() -> None:
    address = list_devices()[0].address
    assert select_device(HeteroSettings(device=address)).info.address == address
    numpy = select_device(HeteroSettings(backend="numpy"))
    assert isinstance(numpy, NumpyDevice)
    assert numpy.info.kind == DeviceKind.NUMPY


def test_no_device_of_the_preferred_kinds_falls_back_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kinds = {d.kind.value for d in list_devices()}
    missing = [k for k in ("gpu", "accelerator", "cpu") if k not in kinds]
    if not missing:
        pytest.skip("every device kind is present")
    settings = HeteroSettings(prefer=(missing[0],))
    devices_module._CACHE.current().logged.discard(("fallback", "numpy"))
    with caplog.at_level(logging.WARNING, logger="adcloud.hetero.devices"):
        chosen = select_device(settings)
    assert isinstance(chosen, NumpyDevice)
    assert "NumPy reference" in caplog.text
    with pytest.raises(MissingComponentError, match="no usable OpenCL device"):
        select_device(HeteroSettings(prefer=(missing[0],), numpy_fallback=False))


def test_unknown_device_addresses_say_what_exists() -> None:
    with pytest.raises(DeviceNotFoundError, match="no OpenCL platform 9"):
        open_device("9:0")
    with pytest.raises(DeviceNotFoundError, match=r"has \d+ device"):
        open_device("0:99")
    with pytest.raises(DeviceNotFoundError, match="device number 99"):
        open_device("99")


def test_a_device_number_given_as_an_int_opens_that_device_or_says_none_is_there() -> None:
    # an int (or any other non-device) ran the NumPy reference without a word, and
    # align() then failed on its missing .info
    points = np.random.default_rng(0).normal(size=(10, 3))
    assert devices_module.as_device(0) is open_device("0")
    assert devices_module.as_device(np.int64(0)) is open_device("0")
    with pytest.raises(DeviceNotFoundError, match="device number 99"):
        transform_points(points, np.eye(4), device=99)  # type: ignore[arg-type]
    for bad in (1.5, True, object()):
        with pytest.raises(DeviceNotFoundError, match="device must be a ComputeDevice"):
            transform_points(points, np.eye(4), device=bad)  # type: ignore[arg-type]


def test_devices_are_cached_per_process() -> None:
    address = list_devices()[0].address
    first = open_device(address)
    assert isinstance(first, OpenCLDevice)
    assert open_device(address) is first
    assert first.program("transform") is first.program("transform")
    assert first.kernel("transform", "transform_points") is first.kernel(
        "transform", "transform_points"
    )


THREADS = textwrap.dedent(
    """
    from concurrent.futures import ThreadPoolExecutor
    import numpy as np
    from adcloud.hetero import GridSpec, hog_features, open_device, rasterize, voxel_downsample
    device = open_device("0:0")
    rng = np.random.default_rng(0)
    clouds = [rng.uniform(0, 50, (20_000 + 5_000 * i, 4)).astype(np.float32) for i in range(8)]
    images = [rng.integers(0, 255, (2, 32 + 8 * i, 48), dtype=np.uint8) for i in range(8)]

    def voxel(i):
        got = voxel_downsample(clouds[i], 1.0 + 0.1 * i, device=device)
        want = voxel_downsample(clouds[i], 1.0 + 0.1 * i, device="numpy")
        return np.array_equal(got.counts, want.counts)

    def raster(i):
        grid = GridSpec(0, 0, 0.5 + 0.1 * i, 100, 100)
        got = rasterize(clouds[i], grid, device=device)
        return np.array_equal(got.count, rasterize(clouds[i], grid, device="numpy").count)

    def features(i):
        want = hog_features(images[i], device="numpy")
        return np.allclose(hog_features(images[i], device=device), want, atol=1e-4)

    for kernel in (voxel, raster, features):
        for _ in range(3):
            with ThreadPoolExecutor(8) as pool:
                print(kernel.__name__, all(pool.map(kernel, range(8))), flush=True)
    """
)


def test_threads_can_share_a_device(pocl_env: dict[str, str]) -> None:
    # threads shared the device's kernel objects (arguments set, then launched) and its
    # named scratch buffers, which one thread reallocated while another's kernel used
    # them: wrong results and heap corruption that aborted the process
    proc = subprocess.run(
        [sys.executable, "-c", THREADS],
        env=pocl_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines.count("True") == 9 and "False" not in lines, proc.stdout


NO_PLATFORM = textwrap.dedent(
    """
    import logging, numpy as np
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from adcloud.hetero import opencl_status, select_device, transform_points, HeteroSettings
    from adcloud.errors import MissingComponentError
    print("STATUS", opencl_status() is not None)
    device = select_device()
    print("DEVICE", device.info.address)
    print("RESULT", transform_points(np.ones((2, 3)), np.eye(4), device=device).tolist())
    try:
        select_device(HeteroSettings(numpy_fallback=False))
    except MissingComponentError as err:
        print("STRICT", "pip install pyopencl" in str(err))
    """
)


def test_no_opencl_platform_falls_back_to_numpy_and_says_so(pocl_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_PLATFORM],
        env={**pocl_env, "OCL_ICD_VENDORS": "/nonexistent-opencl-vendors"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "STATUS True" in proc.stdout
    assert "DEVICE numpy" in proc.stdout
    assert "RESULT [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]" in proc.stdout
    assert "STRICT True" in proc.stdout
    assert "WARNING hetero: no OpenCL platform" in proc.stderr
    assert "NumPy reference" in proc.stderr


AFTER_FORK = textwrap.dedent(
    """
    import os, numpy as np
    from adcloud.hetero import HeteroError, open_device, transform_points
    points = np.arange(12, dtype=np.float32).reshape(4, 3)
    pid = os.fork()
    if pid == 0:  # like a Spark Python worker: OpenCL first used after the fork
        moved = transform_points(points, np.eye(4), device=open_device("0:0"))
        os._exit(0 if np.array_equal(moved, points) else 3)
    _, status = os.waitpid(pid, 0)
    print("LAZY CHILD", os.waitstatus_to_exitcode(status))
    parent = open_device("0:0")
    transform_points(points, np.eye(4), device=parent)
    pid = os.fork()
    if pid == 0:  # forked after the parent used OpenCL: refused, not hung
        try:
            open_device("0:0")
        except HeteroError as err:
            os._exit(0 if "do not survive fork" in str(err) else 4)
        os._exit(5)
    _, status = os.waitpid(pid, 0)
    print("LATE CHILD", os.waitstatus_to_exitcode(status))
    """
)


def test_opencl_is_initialised_lazily_and_never_across_a_fork(pocl_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", AFTER_FORK],
        env=pocl_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LAZY CHILD 0" in proc.stdout
    assert "LATE CHILD 0" in proc.stdout


def test_sub_device_addresses_open_sub_devices() -> None:
    cpu = next(d for d in list_devices() if d.kind == DeviceKind.CPU)
    if cpu.compute_units < 2:
        pytest.skip("a one-core machine has nothing to split")
    part = open_device(f"{cpu.address}:1/2")
    assert isinstance(part, OpenCLDevice)
    assert part.info.compute_units == cpu.compute_units // 2
    assert part.device.parent_device is not None
    points = np.random.default_rng(0).random((100, 3)).astype(np.float32)
    assert np.allclose(transform_points(points, np.eye(4), device=part), points)


# -- FPGA-style prebuilt binaries ---------------------------------------------------------------


def test_prebuilt_binaries_are_loaded_by_ip_id(tmp_path: Path, cpu_device: OpenCLDevice) -> None:
    """PoCL stands in for an FPGA: its own binaries go where an .aocx would."""
    binary = cpu_device.program("transform").binaries[0]
    (tmp_path / "ip-7").mkdir()
    (tmp_path / "ip-7" / "transform.bin").write_bytes(binary)
    settings = HeteroSettings(prebuilt_kinds=("cpu",), binary_dir=tmp_path, ip_id="ip-7")
    fpga_like = open_device(cpu_device.info.address, settings)
    assert fpga_like is not cpu_device
    assert isinstance(fpga_like, OpenCLDevice) and fpga_like.build.prebuilt
    points = np.random.default_rng(1).random((50, 3)).astype(np.float32)
    matrix = np.eye(4)
    matrix[:3, 3] = [1.0, 2.0, 3.0]
    assert np.allclose(
        transform_points(points, matrix, device=fpga_like), points + np.array([1, 2, 3])
    )
    with pytest.raises(KernelBuildError, match=r"ip-7/voxel\.aocx"):
        fpga_like.program("voxel")


def test_prebuilt_ip_id_defaults_to_yarns_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REQUESTED_FPGA_IP_ID", "matrix-multiply-v2")
    assert HeteroSettings().fpga_ip_id() == "matrix-multiply-v2"
    assert HeteroSettings(ip_id="explicit").fpga_ip_id() == "explicit"
    monkeypatch.delenv("REQUESTED_FPGA_IP_ID")
    assert HeteroSettings().fpga_ip_id() == "default"


def test_prebuilt_kinds_without_binary_dir_say_how_to_build(cpu_device: OpenCLDevice) -> None:
    device = open_device(cpu_device.info.address, HeteroSettings(prebuilt_kinds=("cpu",)))
    assert isinstance(device, OpenCLDevice)
    with pytest.raises(KernelBuildError, match="adcloud hetero kernels"):
        device.program("icp")


def test_every_program_source_is_self_contained_and_builds(cpu_device: OpenCLDevice) -> None:
    for name in PROGRAMS:
        source = program_source(name)
        assert "#define EMPTY_KEY" in source
        assert cpu_device.program(name) is not None


@pytest.mark.gpu
def test_gpu_and_cpu_devices_agree(gpu_device: OpenCLDevice, cpu_device: OpenCLDevice) -> None:
    """Where a GPU exists the same kernels give the same answers there (non-unified memory:
    buffers are copied, not wrapped)."""
    points = np.random.default_rng(2).normal(0, 20, (50_000, 4)).astype(np.float32)
    matrix = np.eye(4)
    matrix[:3, 3] = [1.0, 2.0, 3.0]
    np.testing.assert_allclose(
        transform_points(points, matrix, device=gpu_device),
        transform_points(points, matrix, device=cpu_device),
        atol=1e-4,
    )
    assert gpu_device.info.kind == DeviceKind.GPU


def test_unregistered_vendor_libraries_are_found_until_an_icd_names_them(tmp_path: Path) -> None:
    libs = tmp_path / "nvidia" / "lib64"
    libs.mkdir(parents=True)
    library = libs / "libnvidia-opencl.so.1"
    library.write_bytes(b"\x7fELF")
    (libs / "libcuda.so.1").write_bytes(b"\x7fELF")  # not an OpenCL driver: never reported
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    (vendors / "pocl.icd").write_text("libpocl.so.2\n")
    assert unregistered_icds([libs], vendors) == [library]
    assert unregistered_icds([tmp_path / "absent", libs], vendors) == [library]
    # registered by name (the loader's search path) or by full path: both count
    (vendors / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
    assert unregistered_icds([libs], vendors) == []
    (vendors / "nvidia.icd").write_text(f"{library}\n")
    assert unregistered_icds([libs], vendors) == []
    # OCL_ICD_VENDORS may name one file instead of a folder
    assert unregistered_icds([libs], vendors / "pocl.icd") == [library]
    assert unregistered_icds([libs], tmp_path / "no-such-registry") == [library]


def test_cli_devices_says_how_to_register_a_driver_it_cannot_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    from adcloud.hetero.command import add_parser  # noqa: PLC0415

    library = tmp_path / "libnvidia-opencl.so.1"
    library.write_bytes(b"\x7fELF")
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # read by the check, not the loader now
    # the default registry, emptied; OCL_ICD_VENDORS is left alone in the environment, where
    # it would change what a not-yet-initialised ICD loader lists for the rest of the process
    monkeypatch.delenv("OCL_ICD_VENDORS", raising=False)
    monkeypatch.setattr(devices_module, "_REGISTRY", str(vendors))
    parser = argparse.ArgumentParser(prog="adcloud")
    add_parser(parser.add_subparsers(dest="command", required=True))
    console = Console(record=True, width=300)
    args = parser.parse_args(["hetero", "devices", "--json"])
    assert args.func(args, console) == 0
    assert json.loads(console.export_text())["unregistered_icds"] == [str(library)]
    args = parser.parse_args(["hetero", "devices"])
    assert args.func(args, console) == 0
    text = console.export_text()
    assert f"{library} is here but no ICD file names it" in text
    assert f"echo {library} > {vendors}/nvidia.icd" in text


def _hide_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """List this machine's OpenCL devices without its GPUs, as on a machine whose GPU
    driver no ICD file registers (on one without a GPU this changes nothing)."""
    backend = devices_module.BACKENDS["opencl"]
    listed = backend.list_devices

    def without_gpus(split: int = 0) -> list[devices_module.DeviceInfo]:
        return [d for d in listed(split) if d.kind != DeviceKind.GPU]

    monkeypatch.setattr(backend, "list_devices", without_gpus)


def test_the_policy_warns_once_when_a_gpu_driver_is_unregistered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _hide_gpus(monkeypatch)
    (tmp_path / "libnvidia-opencl.so.1").write_bytes(b"\x7fELF")
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    monkeypatch.delenv("OCL_ICD_VENDORS", raising=False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setattr(devices_module, "_LIBRARY_DIRS", (str(tmp_path),))
    monkeypatch.setattr(devices_module, "_REGISTRY", str(vendors))
    monkeypatch.setattr(devices_module, "_CACHE", devices_module._Cache())  # a new process
    with caplog.at_level(logging.WARNING, logger="adcloud.hetero.devices"):
        chosen = select_device(HeteroSettings())
        select_device(HeteroSettings(prefer=("accelerator", "gpu", "cpu")))
    assert chosen.info.kind == DeviceKind.CPU  # PoCL: this machine has no registered GPU
    warned = [r.getMessage() for r in caplog.records if "no ICD file registers it" in r.message]
    assert len(warned) == 1
    assert f"echo {tmp_path / 'libnvidia-opencl.so.1'} > {vendors}/nvidia.icd" in warned[0]
    # a user who prefers the CPU is not told about GPUs; a registered driver is not reported
    monkeypatch.setattr(devices_module, "_CACHE", devices_module._Cache())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="adcloud.hetero.devices"):
        select_device(HeteroSettings(prefer=("cpu", "gpu")))
        monkeypatch.setattr(devices_module, "_CACHE", devices_module._Cache())
        (vendors / "nvidia.icd").write_text("libnvidia-opencl.so.1\n")
        select_device(HeteroSettings())
    assert not [r for r in caplog.records if "no ICD file registers it" in r.message]


def test_discovery_says_how_to_register_a_driver_when_it_finds_no_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adcloud.hetero import discovery  # noqa: PLC0415

    _hide_gpus(monkeypatch)
    library = tmp_path / "libnvidia-opencl.so.1"
    library.write_bytes(b"\x7fELF")
    vendors = tmp_path / "vendors"
    vendors.mkdir()
    monkeypatch.delenv("OCL_ICD_VENDORS", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    monkeypatch.setattr(devices_module, "_REGISTRY", str(vendors))
    assert discovery.main(["gpu"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"name": "gpu", "addresses": []}  # PoCL is a CPU: not listed
    assert f"{library} (a GPU driver's OpenCL library) is here unregistered" in err
    assert f"echo {library} > {vendors}/nvidia.icd" in err
    # registered (but absent from this machine's loader): nothing more to say
    (vendors / "nvidia.icd").write_text(f"{library}\n")
    assert discovery.main(["gpu"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["9:0", "0:99", "gpu0", "99", "0:0:0/4096"])
def test_a_bad_device_setting_names_the_setting_and_the_devices_here(value: str) -> None:
    """``ADCLOUD_HETERO_DEVICE=gpu0`` said only that 'gpu0' is not an address: neither the
    setting it came from nor which addresses would have worked."""
    with pytest.raises(DeviceNotFoundError) as caught:
        select_device(HeteroSettings(device=value))
    message = str(caught.value)
    assert message.startswith(f"hetero.device (ADCLOUD_HETERO_DEVICE) is {value!r}: ")
    for info in list_devices():
        assert info.describe() in message
    assert "numpy (NumPy reference)" in message


@pytest.mark.parametrize("address", ["7:0", "42"])
def test_a_bad_spark_address_names_the_resource_task_and_the_devices_here(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An address from a misconfigured discovery script failed without saying that Spark
    gave it, to which task, or what exists on the executor."""
    monkeypatch.setattr(devices_module, "spark_assignment", lambda names: ("gpu", [address], 3))
    with pytest.raises(DeviceNotFoundError) as caught:
        select_device(HeteroSettings())
    message = str(caught.value)
    assert f"Spark assigned gpu address {address!r} to the task of partition 3" in message
    assert "adcloud hetero devices --discover gpu" in message
    for info in list_devices():
        assert info.describe() in message


def test_a_bad_device_argument_lists_the_devices_here() -> None:
    points = np.zeros((3, 3))
    with pytest.raises(DeviceNotFoundError, match="no OpenCL platform 9") as caught:
        transform_points(points, np.eye(4), device="9:0")
    assert all(info.describe() in str(caught.value) for info in list_devices())
    assert "numpy (NumPy reference)" in str(caught.value)
