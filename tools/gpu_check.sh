#!/usr/bin/env bash
# Everything that needs a GPU, in one command: builds the CUDA extension in place, runs the GPU
# tests, the GPU kernel benchmark and the one-GPU NCCL round benchmark. About 5 minutes on an
# H100 or H200 (the build is most of it). Whoever has a GPU runs exactly this:
#
#   bash tools/gpu_check.sh [RESULTS_DIR]
#
# Logs and tables go to RESULTS_DIR (default: $OUT if set, else build/gpu-check): tests.log,
# kernels.md and nccl_round.md, ready to paste into benchmarks/RESULTS.md. Exits non-zero if the
# build or a test fails; a benchmark failure is reported and fails it too.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RESULTS_DIR=${1:-${OUT:-build/gpu-check}}
mkdir -p "$RESULTS_DIR"
PYTHON=${PYTHON:-python3}
status=0

step() { printf '\n== %s\n' "$*"; }

step "Build the CUDA extension in place (sm_90)"
if ! GOSSIP_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PYTHON" setup.py build_ext --inplace >"$RESULTS_DIR/build.log" 2>&1; then
  tail -50 "$RESULTS_DIR/build.log"
  echo "gpu_check: the CUDA build failed (log: $RESULTS_DIR/build.log)"
  exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import torch, gossip_ext._C as C; assert torch.cuda.is_available(); \
assert hasattr(C, 'NcclTransport'), 'not a CUDA build'; print('GPU:', torch.cuda.get_device_name())"

step "GPU tests (tests/gpu)"
"$PYTHON" -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$RESULTS_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "Kernel benchmark on the GPU"
"$PYTHON" benchmarks/kernels.py --device cuda --dtypes float32 bfloat16 float16 --no-record \
  2>&1 | tee "$RESULTS_DIR/kernels.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "NCCL round on one GPU"
"$PYTHON" benchmarks/nccl_round.py --no-record 2>&1 | tee "$RESULTS_DIR/nccl_round.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

[ "$status" -eq 0 ] && echo "gpu_check: passed" || echo "gpu_check: FAILED"
exit "$status"
