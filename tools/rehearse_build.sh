#!/usr/bin/env bash
# Rehearses a GPU user's install end to end, on a machine without a GPU: in an environment of its
# own, the CUDA build of torch that GPU machines have (default torch 2.11.0 on Python 3.12, with its
# nvidia-* packages: CUDA 13.0 libraries, NCCL 2.28.9), then
#   1. builds and installs the whole extension with GOSSIP_EXT_CUDA=1, as a user does
#      (pip install --no-build-isolation .), so torch's own build tool compiles every source with
#      its C++ standard and flags, nvcc the .cu files, and links against torch's CUDA libraries and
#      the NCCL of the nvidia-nccl wheel;
#   2. imports it and checks that the CUDA build is what loaded: NcclTransport registered, the CUDA
#      kernels registered with the dispatcher, one libnccl in the process (torch's);
#   3. runs against that build the tests that exercise the compiled extension (pytest -m extension:
#      the ops, the engine, the transports, the bindings, one multi-rank run per transport; the
#      rest of the suite drives the same extension through Python and runs in tools/run_tests.sh
#      against the CPU build; tests/gpu skip, visibly: no GPU here).
# Stops at the first failing stage with its log. Needs nvcc (the CUDA toolkit) and prints SKIPPED
# without it. Measured in a fresh clone on 2 cores (2026-11-26): 68 s and 4.7 GB of disk for the
# environment (kept in build/cuda-rehearsal), 89 s for a first build (objects kept in build/temp),
# 33 s for the tests.
#
#   bash tools/rehearse_cuda_build.sh [pytest arguments]
#
# GOSSIP_REHEARSAL_TORCH and GOSSIP_REHEARSAL_PYTHON choose other versions; TORCH_CUDA_ARCH_LIST
# (default 9.0: H100, H200) the GPU architectures compiled.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

TORCH_VERSION=${GOSSIP_REHEARSAL_TORCH:-2.11.0}
PYTHON_VERSION=${GOSSIP_REHEARSAL_PYTHON:-3.12}
export PIP_ROOT_USER_ACTION=ignore

step() { printf '\n== rehearsal: %s\n' "$*"; }
failed() {
  tail -40 "$2"
  echo "tools/rehearse_cuda_build.sh: $1 failed (full log: $2)"
  exit 1
}

if ! command -v nvcc >/dev/null 2>&1; then
  echo "SKIPPED: nvcc not found; the CUDA build was not rehearsed"
  exit 0
fi

# The interpreter: one that pyenv installed, else one on PATH; each tried, since a pyenv shim on
# PATH may name a version it cannot run.
python_bin=""
candidates=()
if command -v pyenv >/dev/null 2>&1; then
  candidates+=($(ls -d "$(pyenv root)"/versions/"$PYTHON_VERSION".*/bin/python"$PYTHON_VERSION" \
    2>/dev/null | sort -rV))
fi
candidates+=("python$PYTHON_VERSION")
for candidate in "${candidates[@]}"; do
  if "$candidate" -c "import venv" >/dev/null 2>&1; then
    python_bin=$(command -v "$candidate")
    break
  fi
done
if [ -z "$python_bin" ]; then
  echo "tools/rehearse_cuda_build.sh: Python $PYTHON_VERSION not found (in pyenv or on PATH);" \
    "set GOSSIP_REHEARSAL_PYTHON to a version this machine has"
  exit 1
fi

# shellcheck source=tools/cuda_home.sh
source tools/cuda_home.sh

ROOT=build/cuda-rehearsal
VENV=$ROOT/venv-py$PYTHON_VERSION-torch$TORCH_VERSION
PY=$REPO/$VENV/bin/python
mkdir -p "$ROOT"

step "environment: torch $TORCH_VERSION (CUDA build) on $("$python_bin" --version 2>&1), $VENV"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' \
    or torch.version.cuda is None)" 2>/dev/null; then
  rm -rf "$VENV"
  "$python_bin" -m venv "$VENV"
fi
# The registry's torch of this version is the CUDA build: its nvidia-* packages come along. The
# rest is what the build and the extension's tests need (not the peers the comparison tests run).
"$PY" -m pip install --quiet "torch==$TORCH_VERSION" ninja "setuptools>=77" wheel pytest \
  pytest-timeout numpy >"$ROOT/environment.log" 2>&1 ||
  failed "installing the environment" "$ROOT/environment.log"
"$PY" - <<'EOF'
import sys, setuptools, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}), setuptools {setuptools.__version__}")
EOF

step "build and install (GOSSIP_EXT_CUDA=1, CUDA_HOME=$CUDA_HOME, pip install --no-build-isolation .)"
start=$SECONDS
GOSSIP_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -v --no-build-isolation --no-deps . \
  >"$ROOT/build.log" 2>&1 || failed "the CUDA build" "$ROOT/build.log"
echo "built in $((SECONDS - start)) s"

step "import the CUDA build and check what it registered"
# From outside the checkout, so that the installed copy is what Python finds.
(cd "$ROOT" && "$PY" "$REPO/tools/check_cuda_build.py" --not-under "$REPO/gossip_ext") \
  >"$ROOT/import.log" 2>&1 || failed "the import check" "$ROOT/import.log"
cat "$ROOT/import.log"

step "the extension's tests against the installed CUDA build (pytest -m extension)"
# From a folder outside the checkout, so that the installed package is the one imported.
cd "$ROOT"
"$PY" -m pytest "$REPO/tests" --rootdir "$REPO" -m extension -q -rs -p no:cacheprovider "$@"
