"""The commands deploy/local/README.md shows run as written against a real standalone cluster."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adcloud.spark import StandaloneCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "deploy" / "local" / "README.md"

_JOB = """\
from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("readme-spark-submit").getOrCreate()
# a Python lambda: the executors must start the interpreter PYSPARK_PYTHON names
print("RESULT", spark.sparkContext.parallelize(range(10), 2).map(lambda x: x * 2).sum())
spark.stop()
"""


def _readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "deploy/local/README.md has no bash block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_spark_submit_line_runs_python_on_the_executors(
    cluster: StandaloneCluster, tmp_path: Path
) -> None:
    """The README's ``spark-submit`` line, run from the checkout as shown: the executors
    start Python in their own work directories, so a relative PYSPARK_PYTHON failed every
    task ("Cannot run program .venv/bin/python")."""
    (line,) = [c for c in _readme_commands() if "spark-submit" in c]
    job = tmp_path / "my_job.py"
    job.write_text(_JOB)
    command = line.replace("my_job.py", str(job))
    env = {**os.environ, "MASTER": cluster.master_url, "SPARK_LOCAL_IP": "127.0.0.1"}
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and "RESULT 90" in proc.stdout, proc.stderr[-3000:]
