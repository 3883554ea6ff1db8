"""deploy/yarn: the files parse and agree with each other, the discovery scripts and Spark.

No Hadoop can be installed here, so nothing talks to a ResourceManager.  The submit line is
checked by the real ``spark-submit``: run with ``--verbose`` and a YARN configuration whose
ResourceManager does not exist, it prints how it parsed the options (the Spark
configuration it will submit) before it tries to connect; the test stops it there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from adcloud.errors import ConfigError
from adcloud.hetero import yarn_submit_args
from adcloud.hetero.yarn import CONTAINER_DISCOVERY_SCRIPTS, CONTAINER_PYTHON, YARN_RESOURCE_TYPES
from adcloud.spark import spark_home

REPO_ROOT = Path(__file__).resolve().parents[2]
YARN = REPO_ROOT / "deploy" / "yarn"
QUEUES = ("simulation", "training", "mapping")


def properties(path: Path) -> dict[str, str]:
    root = ET.parse(path).getroot()
    assert root.tag == "configuration"
    found = {}
    for prop in root.findall("property"):
        name, value = prop.findtext("name"), prop.findtext("value")
        assert name and value is not None, ET.tostring(prop)
        assert name not in found, f"{path.name}: {name} twice"
        found[name.strip()] = value.strip()
    return found


def spark_defaults() -> dict[str, str]:
    out = {}
    for line in (YARN / "spark-defaults.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split(None, 1)
            out[key] = value.strip()
    return out


def test_resource_types_are_yarns_gpu_and_fpga() -> None:
    types = properties(YARN / "resource-types.xml")["yarn.resource-types"].split(",")
    assert sorted(types) == sorted(YARN_RESOURCE_TYPES.values())
    plugins = properties(YARN / "yarn-site.xml")["yarn.nodemanager.resource-plugins"].split(",")
    assert sorted(plugins) == sorted(types)


def test_yarn_site_enables_isolation_and_the_capacity_scheduler() -> None:
    site = properties(YARN / "yarn-site.xml")
    assert site["yarn.nodemanager.container-executor.class"].endswith("LinuxContainerExecutor")
    assert site["yarn.nodemanager.linux-container-executor.cgroups.mount"] == "true"
    assert site["yarn.resourcemanager.scheduler.class"].endswith("capacity.CapacityScheduler")
    assert site["yarn.resourcemanager.scheduler.monitor.enable"] == "true"  # preemption
    assert "docker" in site["yarn.nodemanager.runtime.linux.allowed-runtimes"].split(",")
    assert site["yarn.nodemanager.resource-plugins.fpga.vendor-plugin.class"].endswith(
        "IntelFpgaOpenclPlugin"
    )


def test_queues_add_up_and_can_borrow_idle_capacity() -> None:
    conf = properties(YARN / "capacity-scheduler.xml")
    assert conf["yarn.scheduler.capacity.resource-calculator"].endswith(
        "DominantResourceCalculator"
    )
    queues = conf["yarn.scheduler.capacity.root.queues"].split(",")
    assert sorted(queues) == sorted(QUEUES)
    capacities = {q: float(conf[f"yarn.scheduler.capacity.root.{q}.capacity"]) for q in queues}
    assert sum(capacities.values()) == pytest.approx(100.0)
    for queue, capacity in capacities.items():
        maximum = float(conf[f"yarn.scheduler.capacity.root.{queue}.maximum-capacity"])
        assert capacity < maximum <= 100.0
        # a single user's job may really use the borrowed share
        factor = float(conf[f"yarn.scheduler.capacity.root.{queue}.user-limit-factor"])
        assert factor * capacity >= maximum
        assert conf[f"yarn.scheduler.capacity.root.{queue}.state"] == "RUNNING"
    for key in conf:
        match = re.match(r"yarn\.scheduler\.capacity\.root\.(\w+)\.", key)
        assert match is None or match.group(1) in queues, key


def test_spark_defaults_agree_with_the_image_and_the_scripts() -> None:
    defaults = spark_defaults()
    assert defaults["spark.master"] == "yarn"
    assert defaults["spark.yarn.queue"] in QUEUES
    assert defaults["spark.pyspark.python"] == CONTAINER_PYTHON
    for name, script in CONTAINER_DISCOVERY_SCRIPTS.items():
        assert defaults[f"spark.executor.resource.{name}.discoveryScript"] == script
        local = REPO_ROOT / "deploy" / Path(script).name
        assert os.access(local, os.X_OK), local
    assert defaults["spark.yarn.resourceGpuDeviceName"] == YARN_RESOURCE_TYPES["gpu"]
    assert defaults["spark.yarn.resourceFpgaDeviceName"] == YARN_RESOURCE_TYPES["fpga"]
    image = defaults["spark.executorEnv.YARN_CONTAINER_RUNTIME_DOCKER_IMAGE"]
    assert image == defaults["spark.yarn.appMasterEnv.YARN_CONTAINER_RUNTIME_DOCKER_IMAGE"]


def test_the_image_has_opencl_ros_adcloud_and_the_scripts_where_spark_looks() -> None:
    text = (YARN / "Dockerfile").read_text()
    assert "COPY deploy /opt/adcloud/deploy" in text
    assert f"ADCLOUD_PYTHON={CONTAINER_PYTHON}" in text
    assert "python3 -m venv /opt/adcloud/venv" in text
    for package in ("ocl-icd-libopencl1", "ros-core", "python3-rosbag", "openjdk-17-jre-headless"):
        assert package in text
    assert "nvidia.icd" in text and "pocl-binary-distribution" in text
    assert "torch==2.13.0" in text


def test_the_readme_says_what_is_not_tested() -> None:
    text = (YARN / "README.md").read_text()
    assert "No Hadoop distribution can be installed" in text
    for name in ("resource-types.xml", "yarn-site.xml", "capacity-scheduler.xml", "Dockerfile"):
        assert name in text


def pairs(args: list[str]) -> dict[str, str]:
    out = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag == "--conf":
            key, _, val = value.partition("=")
            out[key] = val
        else:
            out[flag] = value
    return out


def test_gpu_submit_arguments() -> None:
    args = yarn_submit_args("training", gpus_per_executor=2, executors=4, tasks_per_device=2)
    got = pairs(args)
    assert args[:2] == ["--master", "yarn"]
    assert got["--deploy-mode"] == "cluster"
    assert got["--queue"] == "training"
    assert got["--num-executors"] == "4"
    assert got["--executor-cores"] == "4"
    assert got["spark.executor.resource.gpu.amount"] == "2"
    assert got["spark.task.resource.gpu.amount"] == "0.5"
    assert got["spark.executor.resource.gpu.discoveryScript"] == CONTAINER_DISCOVERY_SCRIPTS["gpu"]
    assert got["spark.pyspark.python"] == CONTAINER_PYTHON
    assert not any("fpga" in a for a in args)


def test_fpga_submit_arguments() -> None:
    args = yarn_submit_args(
        "mapping",
        fpgas_per_executor=1,
        fpga_ip_id="adcloud-icp-v1",
        fpga_binaries="hdfs:///fpga/kernels.tgz",
        conf={"spark.executor.memoryOverhead": "1g"},
    )
    got = pairs(args)
    assert got["spark.executor.resource.fpga.amount"] == "1"
    assert got["spark.task.resource.fpga.amount"] == "1"
    assert (
        got["spark.executor.resource.fpga.discoveryScript"] == CONTAINER_DISCOVERY_SCRIPTS["fpga"]
    )
    assert got["spark.executorEnv.REQUESTED_FPGA_IP_ID"] == "adcloud-icp-v1"
    assert got["spark.executorEnv.YARN_CONTAINER_RUNTIME_TYPE"] == "default"
    assert got["--archives"] == "hdfs:///fpga/kernels.tgz#fpga"
    assert got["spark.executorEnv.ADCLOUD_HETERO_BINARY_DIR"] == "./fpga"
    assert got["spark.executor.memoryOverhead"] == "1g"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queue": "bad queue"}, "queue name"),
        ({"queue": "q", "deploy_mode": "both"}, "deploy mode"),
        ({"queue": "q", "gpus_per_executor": -1}, "device counts"),
        ({"queue": "q", "executor_memory": "lots"}, "JVM memory"),
        ({"queue": "q", "fpgas_per_executor": 1}, "fpga_ip_id"),
        ({"queue": "q", "fpgas_per_executor": 1, "fpga_ip_id": "x", "docker_image": "i"}, "Docker"),
    ],
)
def test_impossible_submissions_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        yarn_submit_args(**kwargs)  # type: ignore[arg-type]


def spark_submit_parse(args: list[str], tmp_path: Path) -> dict[str, str]:
    """The Spark configuration ``spark-submit`` derives from ``args`` (see the module doc)."""
    conf_dir = tmp_path / "yarn-conf"
    conf_dir.mkdir()
    (conf_dir / "yarn-site.xml").write_text(
        "<configuration><property><name>yarn.resourcemanager.address</name>"
        "<value>127.0.0.1:1</value></property></configuration>"
    )
    app = tmp_path / "job.py"
    app.write_text("print('never runs')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_"))}
    env.update(
        SPARK_HOME=str(spark_home()),
        YARN_CONF_DIR=str(conf_dir),
        SPARK_CONF_DIR=str(YARN),  # deploy/yarn/spark-defaults.conf is read as on a client
        SPARK_LOCAL_IP="127.0.0.1",
    )
    command = [str(spark_home() / "bin" / "spark-submit"), "--verbose", *args, str(app), "x"]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    deadline = time.monotonic() + 90
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Classpath elements:") or time.monotonic() > deadline:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    text = "\n".join(lines)
    assert "Main class:\norg.apache.spark.deploy.yarn.YarnClusterApplication" in text, text[-3000:]
    section = text.split("Spark config:\n", 1)[1].split("Classpath elements:", 1)[0]
    return dict(m.groups() for m in re.finditer(r"^\(([^,]+),(.*)\)$", section, flags=re.MULTILINE))


@pytest.mark.skipif(sys.platform != "linux", reason="spark-submit runs on Linux here")
def test_spark_submit_accepts_the_yarn_submit_line(tmp_path: Path) -> None:
    args = yarn_submit_args("simulation", gpus_per_executor=1, executors=3, tasks_per_device=2)
    conf = spark_submit_parse(args, tmp_path)
    assert conf["spark.master"] == "yarn"
    assert conf["spark.submit.deployMode"] == "cluster"
    assert conf["spark.yarn.queue"] == "simulation"
    assert conf["spark.executor.instances"] == "3"
    assert conf["spark.executor.cores"] == "2"
    assert conf["spark.executor.resource.gpu.amount"] == "1"
    assert conf["spark.task.resource.gpu.amount"] == "0.5"
    assert conf["spark.executor.resource.gpu.discoveryScript"] == CONTAINER_DISCOVERY_SCRIPTS["gpu"]
    assert conf["spark.yarn.isPython"] == "true"
    # spark-defaults.conf from deploy/yarn was read as well
    assert conf["spark.yarn.resourceGpuDeviceName"] == "yarn.io/gpu"
    assert conf["spark.executorEnv.YARN_CONTAINER_RUNTIME_TYPE"] == "docker"


def test_the_submit_default_queue_is_a_shipped_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adcloud.cli import main  # noqa: PLC0415

    monkeypatch.setenv("HADOOP_CONF_DIR", str(tmp_path))
    (tmp_path / "yarn-site.xml").write_text("<configuration/>")
    assert main(["submit", "--dry-run", "--master", "yarn", "--", "ingest", "a.bag"]) == 0
    words = capsys.readouterr().out.replace("\n", "").split()
    assert words[words.index("--queue") + 1] in QUEUES  # a queue capacity-scheduler.xml defines


def _spark_task_slots(spark: SparkSession, args: list[str]) -> int:
    """How many tasks at once Spark's own ResourceProfile lets one executor of ``args`` run."""
    got = pairs(args)
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    resource = jvm.org.apache.spark.resource
    executor = resource.ExecutorResourceRequests().cores(int(got["--executor-cores"]))
    task = resource.TaskResourceRequests().cpus(1)
    for name in ("gpu", "fpga"):
        if f"spark.executor.resource.{name}.amount" in got:
            amount = int(got[f"spark.executor.resource.{name}.amount"])
            executor = executor.resource(name, amount, "/discover.sh", "")
            task = task.resource(name, float(got[f"spark.task.resource.{name}.amount"]))
    profile = resource.ResourceProfileBuilder().require(executor).require(task).build()
    return int(profile.maxTasksPerExecutor(spark.sparkContext._jsc.sc().conf()))


@pytest.mark.parametrize(
    ("gpus", "fpgas", "tasks_per_device"),
    [(1, 0, 6), (1, 0, 11), (2, 0, 13), (1, 0, 3), (0, 1, 7), (1, 1, 1), (2, 1, 2)],
)
def test_every_executor_core_gets_a_device_share_in_spark(
    spark: SparkSession, gpus: int, fpgas: int, tasks_per_device: int
) -> None:
    # 1/6 was written as 0.166667, of which Spark fits only 5 on a device; and a task of a
    # GPU + FPGA executor holds both, so 1 GPU + 1 FPGA run 1 task at a time, not 2
    args = yarn_submit_args(
        "mapping",
        gpus,
        fpgas,
        tasks_per_device=tasks_per_device,
        fpga_ip_id="adcloud-icp-v1" if fpgas else None,
    )
    cores = int(pairs(args)["--executor-cores"])
    assert cores == min(n for n in (gpus, fpgas) if n) * tasks_per_device
    assert _spark_task_slots(spark, args) == cores
