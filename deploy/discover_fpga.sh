#!/usr/bin/env bash
# Spark resource-discovery script for FPGAs (OpenCL ACCELERATOR devices): prints
# {"name": "fpga", "addresses": [...]}. Spark runs discovery scripts without arguments, so
# this is deploy/discover_opencl.sh with the resource name fixed; see that script.
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/discover_opencl.sh" fpga
