#!/usr/bin/env bash
# Everything that needs a GPU, in one command of at most 8 minutes on a 16-core GPU machine with
# no network, torch's CUDA build, nvcc and the nvidia-nccl wheel preinstalled: it installs nothing.
#
#   bash tools/gpu_check.sh
#
# Stages, each run even when an earlier one failed, each under its own time limit and all within
# GPU_CHECK_SECONDS (default 470):
#   found       versions, Python headers, the GPU
#   build       the CUDA build in place (GOSSIP_EXT_CUDA=1, the present GPU's architecture)
#   import      tools/check_cuda_build.py: the CUDA ops registered, NcclTransport, one libnccl
#   kernels     benchmarks/kernels.py on the GPU, alone: 25M and 100M elements, fp32 and bf16
#   nccl_round  benchmarks/nccl_round.py: a gossip round through NCCL beside a bare NCCL
#               send/receive of the same bytes, alone
#   tests       pytest tests/gpu, a file at a time, each test under a limit: a file that crashes
#               or hangs still leaves its failures, with their tracebacks, in the log. Of the
#               kernel tests only the cases that memcheck leaves out: memcheck runs the others
#   memcheck    the kernel tests (tests/gpu/test_cuda_kernels.py, less the cases too large or
#               timed for it) under compute-sanitizer memcheck, beside the tests: a failed
#               assertion fails it as a memory error does; neither stage times anything
# The benchmarks run before the tests, so that a test that hangs cannot take their time, and a
# crash anywhere prints the Python stack of every thread (PYTHONFAULTHANDLER).
# It ends with one table (stage, result, seconds) and exits non-zero if any stage failed.
# RESULTS_DIR ($OUT if set, else build/gpu-check) holds 8 files: summary.md (what was found and
# the table), build.log (found, build, import), tests.log, memcheck.log, kernels.log,
# nccl_round.log, and kernels.md and nccl_round.md, the benchmarks' sections of
# benchmarks/RESULTS.md, naming the GPU, ready to paste.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ $# -ne 0 ]; then
  echo "usage: $0 (no arguments: it runs every stage; RESULTS_DIR, GPU_CHECK_SECONDS)" >&2
  exit 2
fi
RESULTS_DIR=${RESULTS_DIR:-${OUT:-build/gpu-check}}
mkdir -p "$RESULTS_DIR"
rm -f "$RESULTS_DIR"/{summary.md,build.log,tests.log,memcheck.log,kernels.log,nccl_round.log,kernels.md,nccl_round.md}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# shellcheck source=tools/cuda_home.sh
source tools/cuda_home.sh
export PYTHON CUDA_HOME
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-470}))
rows=()
failed=0

# limit_for SECONDS: the stage's own limit, or what is left of the whole check if that is less.
limit_for() {
  local left=$((deadline - SECONDS - 5))
  echo $(($1 < left ? $1 : left))
}

# finish NAME STATUS SECONDS LIMIT: one row of the table.
finish() {
  local result=passed
  if [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; then
    result="TIMED OUT (limit $4 s)"
  elif [ "$2" -ne 0 ]; then
    result="FAILED (exit $2)"
  fi
  [ "$result" = passed ] || failed=1
  rows+=("$(printf '| %-10s | %-22s | %4d |' "$1" "$result" "$3")")
  printf '== %s: %s in %d s\n' "$1" "$result" "$3"
}

# stage NAME SECONDS LOG COMMAND...: runs COMMAND under a time limit, its output shown and
# appended to RESULTS_DIR/LOG.
stage() {
  local name=$1 limit log=$RESULTS_DIR/$3 start=$SECONDS
  limit=$(limit_for "$2")
  shift 3
  if [ "$limit" -lt 10 ]; then
    rows+=("$(printf '| %-10s | %-22s | %4d |' "$name" "SKIPPED (out of time)" 0)")
    failed=1
    return
  fi
  printf '\n== %s (limit %d s)\n' "$name" "$limit" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  finish "$name" "${PIPESTATUS[0]}" $((SECONDS - start)) "$limit"
}

found() {
  echo "CUDA_HOME=${CUDA_HOME:-unset}; nvcc: $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1)"
  echo "compute-sanitizer: $(command -v compute-sanitizer || echo "${CUDA_HOME:-}/bin/compute-sanitizer")"
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
    "$PYTHON" setup.py build_ext --inplace
}
# The kernel tests that memcheck leaves out: too large for it to run in time (several grid-stride
# passes, 2,097,155 elements), or timing the host. The tests stage runs these, memcheck the rest.
NOT_UNDER_MEMCHECK="several_grid_stride or return_at_once or 2097155"
export NOT_UNDER_MEMCHECK

# tests/gpu a file at a time, each test under pytest-timeout's limit where it is installed; the
# kernel tests (their cases that memcheck does not run) last, after every file of the engine's.
# Exits non-zero if any file failed.
gpu_tests() {
  local status=0 file
  for file in $(ls tests/gpu/test_*.py | grep -v test_cuda_kernels); do
    echo "-- $file"
    "$PYTHON" -m pytest "$file" -q -rfEs --tb=short -p no:cacheprovider $PYTEST_LIMIT ||
      status=1
  done
  echo "-- tests/gpu/test_cuda_kernels.py -k '$NOT_UNDER_MEMCHECK' (memcheck runs the others)"
  "$PYTHON" -m pytest tests/gpu/test_cuda_kernels.py -q -rfEs --tb=short -p no:cacheprovider \
    $PYTEST_LIMIT -k "$NOT_UNDER_MEMCHECK" || status=1
  return $status
}
export -f found build gpu_tests

PYTEST_LIMIT=""
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PYTEST_LIMIT=--timeout=90
export PYTEST_LIMIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

stage found 30 build.log bash -c found
cp "$RESULTS_DIR/build.log" "$RESULTS_DIR/found.txt"
if [ "$failed" -ne 0 ]; then
  # No usable GPU or CUDA build of torch: nothing after this could run.
  for name in build import kernels nccl_round tests memcheck; do
    rows+=("$(printf '| %-10s | %-22s | %4d |' "$name" "SKIPPED (found failed)" 0)")
  done
  deadline=$SECONDS
fi
if [ "$failed" -eq 0 ]; then
  stage build 180 build.log bash -c build
  stage import 30 build.log "$PYTHON" tools/check_cuda_build.py

  GOSSIP_EXT_RESULTS=$RESULTS_DIR/kernels.md stage kernels 150 kernels.log \
    "$PYTHON" benchmarks/kernels.py --device cuda --sizes 2.5e7 1e8 --dtypes float32 bfloat16 \
    --min-run-time 0.2 --rounds 3
  GOSSIP_EXT_RESULTS=$RESULTS_DIR/nccl_round.md stage nccl_round 60 nccl_round.log \
    "$PYTHON" benchmarks/nccl_round.py --params 2.5e7 1e8

  # memcheck beside the tests: it runs each kernel far slower, so it leaves out the sizes that take
  # several grid-stride passes and the tests that time the host (the tests stage runs those).
  memcheck_start=$SECONDS
  memcheck_limit=$(limit_for 200)
  sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-}/bin/compute-sanitizer")
  (
    printf '\n== memcheck (limit %d s)\n' "$memcheck_limit"
    timeout --kill-after=10 "$memcheck_limit" "$sanitizer" --tool memcheck --error-exitcode 99 \
      "$PYTHON" -m pytest tests/gpu/test_cuda_kernels.py -q -p no:cacheprovider \
      -k "not ($NOT_UNDER_MEMCHECK)"
  ) >"$RESULTS_DIR/memcheck.log" 2>&1 &
  memcheck_pid=$!
  stage tests 250 tests.log bash -c gpu_tests
  wait "$memcheck_pid"
  memcheck_status=$?
  tail -n 5 "$RESULTS_DIR/memcheck.log"
  finish memcheck "$memcheck_status" $((SECONDS - memcheck_start)) "$memcheck_limit"
fi

{
  echo "# tools/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M') UTC, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
  echo '```'
  cat "$RESULTS_DIR/found.txt"
  echo '```'
  echo
  echo "| stage      | result                 | s    |"
  echo "|------------|------------------------|------|"
  printf '%s\n' "${rows[@]}"
} >"$RESULTS_DIR/summary.md"
rm -f "$RESULTS_DIR/found.txt"
printf '\n'
tail -n $((${#rows[@]} + 2)) "$RESULTS_DIR/summary.md"
[ "$failed" -eq 0 ] && echo "gpu_check: every stage passed" || echo "gpu_check: a stage failed"
exit "$failed"
