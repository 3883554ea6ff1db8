"""spark-submit options for adcloud jobs on YARN with GPU and FPGA containers.

Spark asks YARN for ``yarn.io/gpu`` / ``yarn.io/fpga`` when an application sets
``spark.executor.resource.gpu.amount`` / ``spark.executor.resource.fpga.amount`` (Spark maps
the two names itself: ``spark.yarn.resourceGpuDeviceName``/``...FpgaDeviceName``).  YARN
does not tell Spark which devices a container got, so every executor runs a discovery
script -- ``deploy/discover_opencl.sh`` / ``deploy/discover_fpga.sh``, installed at
``/opt/adcloud/deploy/`` in the container image of ``deploy/yarn/Dockerfile`` -- whose
addresses then reach tasks through ``TaskContext.resources()``.  FPGA containers also get
``REQUESTED_FPGA_IP_ID``, which YARN's FPGA plugin uses to program the device and
:class:`~adcloud.hetero.devices.HeteroSettings` to find the prebuilt kernels.

See ``deploy/yarn/README.md`` for the cluster side.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

from adcloud.errors import ConfigError

__all__ = [
    "CONTAINER_DISCOVERY_SCRIPTS",
    "CONTAINER_PYTHON",
    "YARN_RESOURCE_TYPES",
    "yarn_submit_args",
]

CONTAINER_DISCOVERY_SCRIPTS = {
    "gpu": "/opt/adcloud/deploy/discover_opencl.sh",
    "fpga": "/opt/adcloud/deploy/discover_fpga.sh",
}
"""Where the container image puts the discovery scripts, per Spark resource name."""

CONTAINER_PYTHON = "/opt/adcloud/venv/bin/python"
"""The interpreter (with adcloud installed) in the container image."""

YARN_RESOURCE_TYPES = {"gpu": "yarn.io/gpu", "fpga": "yarn.io/fpga"}
"""The YARN resource type Spark requests for each Spark resource name."""

_MEMORY = re.compile(r"^\d+[kmgt]?$", re.IGNORECASE)
_AMOUNT_DECIMALS = 15


def _task_amount(tasks_per_device: int) -> str:
    """Spark's per-task amount for ``tasks_per_device`` tasks sharing one device.

    1/n rounded *down* to 15 decimals: Spark fits ``floor(1 / amount)`` tasks on a device
    (and counts amounts in units of 1e-16), so an amount rounded up (``0.166667`` for 6)
    fits one task fewer than asked and leaves a core idle.
    """
    if tasks_per_device == 1:
        return "1"
    digits = 10**_AMOUNT_DECIMALS // tasks_per_device
    return f"0.{digits:0{_AMOUNT_DECIMALS}d}".rstrip("0")


def yarn_submit_args(
    queue: str,
    gpus_per_executor: int = 0,
    fpgas_per_executor: int = 0,
    *,
    executors: int = 2,
    executor_cores: int | None = None,
    executor_memory: str = "4g",
    driver_memory: str = "2g",
    deploy_mode: str = "cluster",
    tasks_per_device: int = 1,
    discovery_scripts: Mapping[str, str] | None = None,
    fpga_ip_id: str | None = None,
    fpga_binaries: str | None = None,
    docker_image: str | None = None,
    python: str = CONTAINER_PYTHON,
    conf: Mapping[str, str] | None = None,
) -> list[str]:
    """The spark-submit options (from ``--master yarn`` up to the application file).

    ``queue``: the YARN queue (``simulation``, ``training``, ``mapping`` in
    ``deploy/yarn/capacity-scheduler.xml``).  ``gpus_per_executor``/``fpgas_per_executor``:
    devices per executor container; ``tasks_per_device`` tasks share each device, and
    ``executor_cores`` defaults to devices x ``tasks_per_device`` (at least 1), the devices
    being the fewer of GPUs and FPGAs when both are asked for (each task then holds a share
    of a GPU *and* of an FPGA).
    ``discovery_scripts`` overrides :data:`CONTAINER_DISCOVERY_SCRIPTS`.  ``fpga_ip_id``
    (required with FPGAs) names the FPGA image; ``fpga_binaries`` is an archive (any URL
    YARN can localize) holding ``<ip_id>/<program>.aocx`` files, unpacked as ``./fpga`` in
    every container and used as ``ADCLOUD_HETERO_BINARY_DIR``.  ``python`` is the
    containers' Python, the driver's too in cluster mode (in client mode the driver runs
    here, on this process's Python).  ``docker_image`` runs the
    application master and GPU executors in that image (YARN's Docker runtime); FPGA jobs run
    natively (YARN's FPGA plugin does not support Docker), so they switch the runtime back
    to ``default``.  ``conf`` adds Spark settings last.  Raises
    :class:`~adcloud.errors.ConfigError` for impossible combinations.
    """
    if not queue or not re.fullmatch(r"[\w.-]+", queue):
        raise ConfigError(f"YARN queue {queue!r} is not a queue name")
    if deploy_mode not in ("cluster", "client"):
        raise ConfigError(f"deploy mode must be cluster or client, got {deploy_mode!r}")
    if min(gpus_per_executor, fpgas_per_executor) < 0 or executors < 1 or tasks_per_device < 1:
        raise ConfigError("device counts must be >= 0, executors and tasks_per_device >= 1")
    for name, value in (("executor_memory", executor_memory), ("driver_memory", driver_memory)):
        if not _MEMORY.match(value):
            raise ConfigError(f"{name} {value!r} is not a JVM memory size like 4g or 512m")
    # every task holds a share of each requested resource, so the scarcest one sets how
    # many tasks an executor runs at once
    devices = min((n for n in (gpus_per_executor, fpgas_per_executor) if n), default=0)
    cores = executor_cores if executor_cores is not None else max(1, devices * tasks_per_device)
    if cores < 1:
        raise ConfigError("executor_cores must be >= 1")
    if fpgas_per_executor and not fpga_ip_id:
        raise ConfigError("FPGA executors need fpga_ip_id (the FPGA image to program)")
    if fpgas_per_executor and docker_image:
        raise ConfigError(
            "YARN's FPGA plugin does not support Docker containers: FPGA executors run on the "
            "node itself (install adcloud under /opt/adcloud there), so pass no docker_image"
        )
    scripts = {**CONTAINER_DISCOVERY_SCRIPTS, **(discovery_scripts or {})}
    args = [
        "--master", "yarn",
        "--deploy-mode", deploy_mode,
        "--queue", queue,
        "--num-executors", str(executors),
        "--executor-cores", str(cores),
        "--executor-memory", executor_memory,
        "--driver-memory", driver_memory,
    ]  # fmt: skip
    if fpgas_per_executor and fpga_binaries:
        args += ["--archives", f"{fpga_binaries}#fpga"]
    settings: dict[str, str] = {
        "spark.pyspark.python": python,
        # in client mode the driver runs here, with this machine's Python, not the containers'
        "spark.pyspark.driver.python": python if deploy_mode == "cluster" else sys.executable,
    }
    for name, amount in (("gpu", gpus_per_executor), ("fpga", fpgas_per_executor)):
        if not amount:
            continue
        settings[f"spark.executor.resource.{name}.amount"] = str(amount)
        settings[f"spark.executor.resource.{name}.discoveryScript"] = scripts[name]
        settings[f"spark.task.resource.{name}.amount"] = _task_amount(tasks_per_device)
    if fpgas_per_executor:
        assert fpga_ip_id is not None
        settings["spark.executorEnv.REQUESTED_FPGA_IP_ID"] = fpga_ip_id
        for prefix in ("spark.yarn.appMasterEnv", "spark.executorEnv"):
            settings[f"{prefix}.YARN_CONTAINER_RUNTIME_TYPE"] = "default"
        if fpga_binaries:
            settings["spark.executorEnv.ADCLOUD_HETERO_BINARY_DIR"] = "./fpga"
    if docker_image:
        for prefix in ("spark.yarn.appMasterEnv", "spark.executorEnv"):
            settings[f"{prefix}.YARN_CONTAINER_RUNTIME_TYPE"] = "docker"
            settings[f"{prefix}.YARN_CONTAINER_RUNTIME_DOCKER_IMAGE"] = docker_image
    settings.update(conf or {})
    for key, value in settings.items():
        args += ["--conf", f"{key}={value}"]
    return args
