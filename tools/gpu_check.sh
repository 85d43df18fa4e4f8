#!/usr/bin/env bash
# Everything that needs a GPU, as it runs on a GPU machine with no network and torch's CUDA build,
# nvcc and the nvidia-nccl wheel preinstalled: it installs nothing. Two commands, each within
# 10 minutes on 16 cores (the build is most of the first):
#
#   bash tools/gpu_check.sh tests        # what it found; the CUDA build in place; the GPU tests
#   bash tools/gpu_check.sh benchmarks   # the GPU kernel benchmark; the one-GPU NCCL round
#
# With no argument it runs both. It prints what it found first (versions, Python headers, GPU),
# then each stage; it stops at the first stage that fails and prints the end of that stage's log.
# Every stage and every test has a time limit. Logs and tables go to RESULTS_DIR ($OUT if set,
# else build/gpu-check): kernels.md and nccl_round.md are ready for benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHAT=${1:-all}
case $WHAT in
  tests | benchmarks | all) ;;
  *)
    echo "usage: $0 [tests|benchmarks|all]" >&2
    exit 2
    ;;
esac
RESULTS_DIR=${RESULTS_DIR:-${OUT:-build/gpu-check}}
mkdir -p "$RESULTS_DIR"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# shellcheck source=tools/cuda_home.sh
source tools/cuda_home.sh

# stage NAME SECONDS COMMAND...: runs COMMAND (a shell function through bash -c) under a time limit, its output shown and kept in
# RESULTS_DIR/NAME.log; a failure ends the check with the log's end.
stage() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  printf '\n== %s (limit %d s)\n' "$name" "$limit"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RESULTS_DIR/$name.log"
  local status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then
    [ "$status" -eq 124 ] && echo "gpu_check: $name ran past its $limit s limit"
    echo "---- end of $RESULTS_DIR/$name.log"
    tail -60 "$RESULTS_DIR/$name.log"
    echo "gpu_check: FAILED at $name (exit $status)"
    exit 1
  fi
  printf '== %s: passed in %d s\n' "$name" $((SECONDS - start))
}

found() {
  echo "CUDA_HOME=${CUDA_HOME:-unset}; nvcc: $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1)"
  nproc | sed 's/^/cores: /'
  "$PYTHON" - <<'EOF'
import os, sys, sysconfig
print(f"python {sys.version.split()[0]} at {sys.executable}")
headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
print(f"Python headers: {headers} {'present' if os.path.exists(headers) else 'MISSING'}")
import setuptools, torch
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except (AttributeError, RuntimeError):
    nccl = "none (a CPU build of torch)"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"setuptools {setuptools.__version__}")
try:
    import pytest_timeout  # noqa: F401
    print("pytest-timeout: present")
except ImportError:
    print("pytest-timeout: missing (tests are limited per stage only)")
assert torch.version.cuda, "torch is a CPU build"
assert torch.cuda.is_available(), "torch sees no GPU"
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
          f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
assert os.path.exists(headers), "no Python headers: an extension cannot be compiled"
EOF
}

build() {
  # The architecture of the GPU present, unless TORCH_CUDA_ARCH_LIST says otherwise.
  local arch
  arch=${TORCH_CUDA_ARCH_LIST:-$("$PYTHON" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}
  echo "GOSSIP_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch setup.py build_ext --inplace"
  GOSSIP_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PYTHON" setup.py build_ext --inplace && "$PYTHON" tools/check_cuda_build.py
}

export PYTHON CUDA_HOME
export -f found build
pytest_limit=()
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && pytest_limit=(--timeout=120)

if [ "$WHAT" = tests ] || [ "$WHAT" = all ]; then
  stage found 60 bash -c found
  stage build 300 bash -c build
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  stage tests 230 "$PYTHON" -m pytest tests/gpu -q -rs -p no:cacheprovider "${pytest_limit[@]}"
fi
if [ "$WHAT" = benchmarks ] || [ "$WHAT" = all ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  stage kernels 280 "$PYTHON" benchmarks/kernels.py --device cuda \
    --dtypes float32 bfloat16 float16 --no-record
  cp "$RESULTS_DIR/kernels.log" "$RESULTS_DIR/kernels.md"
  stage nccl_round 280 "$PYTHON" benchmarks/nccl_round.py --no-record
  cp "$RESULTS_DIR/nccl_round.log" "$RESULTS_DIR/nccl_round.md"
fi
echo "gpu_check: $WHAT passed"
