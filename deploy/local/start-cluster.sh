#!/usr/bin/env bash
# Start a real Spark standalone cluster on 127.0.0.1: one master and N_WORKERS workers.
#
#   deploy/local/start-cluster.sh [N_WORKERS]      (default 2)
#
# Prints the master URL (spark://127.0.0.1:PORT) and records it, the pids, the ports and the
# log directory in the state directory; stop the cluster with deploy/local/stop-cluster.sh.
# Environment: ADCLOUD_CLUSTER_STATE (state directory, default out/local-cluster),
# ADCLOUD_CLUSTER_CORES (cores per worker, default 1), ADCLOUD_CLUSTER_MEMORY (memory per
# worker, default 1g), ADCLOUD_PYTHON (default .venv/bin/python).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${ADCLOUD_PYTHON:-$root/.venv/bin/python}"
state_dir="${ADCLOUD_CLUSTER_STATE:-$root/out/local-cluster}"
workers="${1:-2}"
cores="${ADCLOUD_CLUSTER_CORES:-1}"
memory="${ADCLOUD_CLUSTER_MEMORY:-1g}"

if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 [N_WORKERS]  (N_WORKERS: a positive integer, got '$workers')" >&2
    exit 2
fi
# Checked here, so that the error names the variable (python's names only --cores / --memory)
if ! [[ "$cores" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: ADCLOUD_CLUSTER_CORES='$cores': give the cores each worker offers, a positive integer" >&2
    exit 2
fi
if ! [[ "$memory" =~ ^[1-9][0-9]*[kKmMgGtT]?$ ]]; then
    echo "error: ADCLOUD_CLUSTER_MEMORY='$memory': give the memory each worker offers in JVM notation, e.g. 512m or 2g" >&2
    exit 2
fi
if [[ ! -x "$python" ]]; then
    echo "error: $python not found; run 'make install' first (or set ADCLOUD_PYTHON)" >&2
    exit 1
fi

exec "$python" -m adcloud.spark cluster start \
    --workers "$workers" \
    --cores "$cores" \
    --memory "$memory" \
    --state-dir "$state_dir"
