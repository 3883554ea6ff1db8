#!/usr/bin/env bash
# Stop the cluster that deploy/local/start-cluster.sh started: workers (and their executors)
# and master get SIGTERM, then SIGKILL after 10 s. Does nothing when no cluster is recorded.
# Environment: ADCLOUD_CLUSTER_STATE (default out/local-cluster), ADCLOUD_PYTHON.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${ADCLOUD_PYTHON:-$root/.venv/bin/python}"
state_dir="${ADCLOUD_CLUSTER_STATE:-$root/out/local-cluster}"

if [[ ! -x "$python" ]]; then
    echo "error: $python not found; run 'make install' first (or set ADCLOUD_PYTHON)" >&2
    exit 1
fi

exec "$python" -m adcloud.spark cluster stop --state-dir "$state_dir"
