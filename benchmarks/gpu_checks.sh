#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md, on a CUDA machine that has torch but no Spark, no
# Java and no ROS (and perhaps no network).  Prepare on a machine with the project installed
# (from the repository root, with ../shared/data beside it):
#
#   bash benchmarks/gpu_checks.sh prepare
#
# which writes the training samples (work/gpu/samples.npz, ~35 MB), copies the real scan pair
# (work/gpu/data) and downloads the wheels the GPU image lacks (.whl: pyopencl and its needs,
# isal, rosbags and its needs for the torchrun trainers; CPython 3.12, x86_64).  Carry `.whl`
# and `work/gpu` to the GPU machine; ``work/`` and ``.whl/`` are git-ignored.
#
# then on the GPU machine (OUT: where the logs go; default work/gpu/out):
#
#   bash benchmarks/gpu_checks.sh          # the benchmarks (1 and 2 below; ~3 min on an H100)
#   bash benchmarks/gpu_checks.sh hetero   # only 1
#   bash benchmarks/gpu_checks.sh train    # only 2 (TRAIN_RUNS=camera_seg:full: one task/preset)
#   bash benchmarks/gpu_checks.sh tests    # the kernel tests on the GPU (3 below)
#   bash benchmarks/gpu_checks.sh allreduce  # sync=allreduce under torchrun on the GPU (4)
#
# 1. OpenCL: the adcloud.hetero kernels on the GPU against their NumPy reference
#    (bench_hetero.py --no-job).  pyopencl's wheel brings the ICD loader; where the system
#    registers no NVIDIA ICD, the driver's libnvidia-opencl is registered in a private folder.
# 2. CUDA: lidar_seg and camera_seg training and export on the GPU against the same on the CPU
#    (bench_train_gpu.py run).
# 3. The kernel tests of tests/hetero, parametrized over every OpenCL device, on the GPU and
#    on PoCL's CPU device where the machine registers one (the NumPy reference is the truth;
#    tests that need PoCL fail where it is missing), with the OpenCL compiler's output shown.
# 4. CUDA: lidar_seg trained with sync=allreduce under torchrun (bench_train_gpu.py
#    allreduce): 1 trainer (NCCL) against one process, 2 trainers sharing the GPU (gloo on
#    CUDA tensors) against the same 2 trainers on the CPU.
set -uo pipefail

if [ "${1:-}" = prepare ]; then
  set -e
  .venv/bin/python benchmarks/bench_train_gpu.py prepare --out work/gpu/samples.npz
  mkdir -p work/gpu/data
  cp -r "${ADCLOUD_SHARED_DATA:-../shared/data}/04_gicp_scan_pair_with_reference_tf" work/gpu/data/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    pyopencl pytools siphash24 platformdirs isal \
    rosbags==0.11.9 apsw==3.54.1.0 ruamel.yaml==0.19.1 backports.zstd==1.8.0 lz4==4.4.5 \
    mcap==1.6.0 zstandard==0.25.0
  du -sh work/gpu .whl
  exit 0
fi

OUT=${OUT:-work/gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi -L || true
  "$PY" -V
  "$PY" -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "numpy", numpy.__version__)'
  nproc
} 2>&1 | tee "$OUT/machine.txt"

WHEELS=${WHEELS:-.whl}  # wheels of what the machine lacks (WHEELS=none: install nothing)
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/adcloud-site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/adcloud-site:$PWD
else
  export PYTHONPATH=$PWD
fi
[ -d work/gpu/data ] && export ADCLOUD_SHARED_DATA=$PWD/work/gpu/data

if ! grep -qs nvidia /etc/OpenCL/vendors/*.icd; then
  lib=$(ldconfig -p | awk '/libnvidia-opencl.so.1/ {print $NF; exit}')
  [ -z "$lib" ] && lib=$(find / -xdev -name 'libnvidia-opencl.so.1' 2>/dev/null | head -1)
  if [ -n "$lib" ]; then
    # OCL_ICD_VENDORS replaces the system folder: keep what it registers (PoCL) beside NVIDIA
    mkdir -p /tmp/adcloud-icd && cp /etc/OpenCL/vendors/*.icd /tmp/adcloud-icd/ 2>/dev/null
    echo "$lib" >/tmp/adcloud-icd/nvidia.icd
    export OCL_ICD_VENDORS=/tmp/adcloud-icd
    echo "registered the NVIDIA OpenCL ICD: $lib" | tee -a "$OUT/machine.txt"
  else
    echo "no libnvidia-opencl.so.1 on this machine: no OpenCL GPU" | tee -a "$OUT/machine.txt"
  fi
fi

if [ "${1:-bench}" = tests ]; then
  PYOPENCL_COMPILER_OUTPUT=1 timeout "${TESTS_TIMEOUT:-400}" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
    tests/hetero/test_transform.py tests/hetero/test_voxel.py tests/hetero/test_raster.py \
    tests/hetero/test_icp.py tests/hetero/test_features.py tests/hetero/test_lattice.py \
    tests/hetero/test_devices.py 2>&1 | tee "$OUT/tests.txt"
  echo "pytest exit: $?" | tee -a "$OUT/tests.txt"
  exit 0
fi

if [ "${1:-bench}" = allreduce ]; then
  timeout "${ALLREDUCE_TIMEOUT:-300}" "$PY" benchmarks/bench_train_gpu.py allreduce \
    --samples work/gpu/samples.npz --steps "${ALLREDUCE_STEPS:-100}" 2>&1 | tee "$OUT/allreduce.txt"
  echo "allreduce exit: $?" | tee -a "$OUT/allreduce.txt"
  exit 0
fi

if [ "${1:-bench}" != train ]; then
  timeout "${HETERO_TIMEOUT:-240}" "$PY" benchmarks/bench_hetero.py --no-job --repeat "${HETERO_REPEAT:-3}" 2>&1 \
    | tee "$OUT/hetero.txt"
  echo "bench_hetero exit: $?" | tee -a "$OUT/hetero.txt"
fi

[ "${1:-bench}" = hetero ] && exit 0
timeout 300 "$PY" benchmarks/bench_train_gpu.py run --samples work/gpu/samples.npz \
  --steps "${TRAIN_STEPS:-300}" ${TRAIN_RUNS:+--runs "$TRAIN_RUNS"} --json "$OUT/train_gpu.json" 2>&1 | tee "$OUT/train.txt"
echo "bench_train_gpu exit: $?" | tee -a "$OUT/train.txt"
