#!/usr/bin/env bash
# Spark resource-discovery script for OpenCL devices (GPUs, or FPGAs with `fpga`).
#
#   deploy/discover_opencl.sh [gpu|fpga]        (default gpu; Spark runs it without arguments)
#
# Prints Spark's ResourceInformation JSON, e.g. {"name": "gpu", "addresses": ["0:0", "0:1"]}.
# Addresses are adcloud device addresses ("P:D" = OpenCL platform P, device D; "P:D:S/N" =
# sub-device S of N): a Spark task that is given one opens exactly that device
# (adcloud.hetero.select_device). Use it as
#   spark.executor.resource.gpu.discoveryScript / spark.worker.resource.gpu.discoveryScript.
#
# Which OpenCL device kinds stand behind each resource, and splitting, come from the
# environment (adcloud.hetero.HeteroSettings):
#   ADCLOUD_HETERO_GPU_KINDS   kinds listed for `gpu`  (default gpu; `cpu` lets PoCL stand in)
#   ADCLOUD_HETERO_FPGA_KINDS  kinds listed for `fpga` (default accelerator)
#   ADCLOUD_HETERO_SPLIT       offer every device as N equal sub-devices (0: whole devices)
#   ADCLOUD_PYTHON             interpreter with adcloud and pyopencl (default: the checkout's
#                              .venv, else the container's /opt/adcloud/venv, else python3)
# Exit status 1, with the reason on stderr, when pyopencl is missing.
set -euo pipefail

resource="${1:-gpu}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${ADCLOUD_PYTHON:-}"
if [[ -z "$python" ]]; then
    for candidate in "$root/.venv/bin/python" /opt/adcloud/venv/bin/python; do
        if [[ -x "$candidate" ]]; then
            python="$candidate"
            break
        fi
    done
fi
exec "${python:-python3}" -m adcloud.hetero.discovery "$resource"
