#!/usr/bin/env bash
# Rehearses a user's install end to end against another torch than the one the test command builds
# in place (the CPU build of torch 2.13), in an environment of its own: the registry's torch of the
# version asked for (its CUDA build, with its nvidia-* packages) on the Python asked for, then
#   1. builds and installs the whole extension as a user does (pip install --no-build-isolation
#      --no-deps .), so torch's own build tool compiles every source with that torch's headers, C++
#      standard and flags; a CUDA build also compiles the .cu files with nvcc and links torch's CUDA
#      libraries and the NCCL of the nvidia-nccl wheel;
#   2. imports the installed copy, which refuses to load unless it was built against the running
#      torch (gossip_ext/_torch_check.py), and checks what it registered: in a CUDA build,
#      NcclTransport, the CUDA kernels and one libnccl in the process, torch's
#      (tools/check_cuda_build.py); in a CPU build, no NcclTransport;
#   3. runs against that build a smoke test of its ABI, the tests of tools/rehearsal_tests.txt in
#      one pytest command: a test of every public name of gossip_ext._C and of every op it
#      registers with torch, one multi-rank run per transport, and the check that the list still
#      names every binding and op of this build (tests/test_rehearsal_selection.py); the whole
#      suite runs once, in tools/run_tests.sh, against the test command's own build; tests/gpu
#      skip, visibly: no GPU here.
# Stops at the first failing step with its log.
#
# The test command runs two rehearsals:
#   - a GPU user's CUDA build, without a GPU (the defaults): torch 2.11.0 on Python 3.12, CUDA 13.0,
#     NCCL 2.28.9, GOSSIP_REHEARSAL_CUDA=1. Needs nvcc (the CUDA toolkit) and prints SKIPPED without.
#   - the newest torch, 2.15.0 on Python 3.12, built for the CPU (GOSSIP_REHEARSAL_CUDA=0). Its
#     registry build is CUDA 13.2's and the nvcc here is 13.0's: torch only warns of that minor
#     mismatch, but it is not what a GPU user of torch 2.15 builds with, and a second CUDA build
#     would cost the test command about 90 s more for what the first rehearsal covers already (the
#     CUDA sources against torch's CUDA). Built for the CPU it checks what changes with torch's
#     release: the sources compile against its headers, and the extension's tests pass with its
#     ABI.
# Measured on 2 cores (2026-11-26, other work holding a load of about 1.5), nothing cached: the two
# environments installed side by side in 52 s (4.6 and 5.3 GB of disk); torch 2.11's CUDA build
# took 97 s, torch 2.15's CPU build 70 s (first builds; their objects are kept in build/temp).
# Their tests were then all of `pytest -m extension` (70 s and 84 s), now the selection above.
#
#   bash tools/rehearse_build.sh [pytest arguments]
#   bash tools/rehearse_build.sh --environment    # only installs the environment
#
# GOSSIP_REHEARSAL_TORCH (default 2.11.0), GOSSIP_REHEARSAL_PYTHON (default 3.12) and
# GOSSIP_REHEARSAL_CUDA (1, the default: a CUDA build; 0: a CPU build) choose what is rehearsed;
# TORCH_CUDA_ARCH_LIST (default 9.0: H100, H200) the GPU architectures a CUDA build compiles.
# Everything goes under build/rehearsal: one environment per Python and torch
# (venv-py3.12-torch2.11.0), one folder of logs per rehearsal (py3.12-torch2.11.0-cuda).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

TORCH_VERSION=${GOSSIP_REHEARSAL_TORCH:-2.11.0}
PYTHON_VERSION=${GOSSIP_REHEARSAL_PYTHON:-3.12}
CUDA=${GOSSIP_REHEARSAL_CUDA:-1}
export PIP_ROOT_USER_ACTION=ignore

case "$CUDA" in
  1) kind=cuda ;;
  0) kind=cpu ;;
  *)
    echo "tools/rehearse_build.sh: GOSSIP_REHEARSAL_CUDA must be 0 or 1, got '$CUDA'"
    exit 1
    ;;
esac
environment_only=0
if [ "${1:-}" = "--environment" ]; then
  environment_only=1
  shift
fi

step() { printf '\n== rehearsal (torch %s, %s build): %s\n' "$TORCH_VERSION" "$kind" "$*"; }
failed() {
  tail -40 "$2"
  echo "tools/rehearse_build.sh: $1 failed (full log: $2)"
  exit 1
}

if [ "$kind" = cuda ] && ! command -v nvcc >/dev/null 2>&1; then
  echo "SKIPPED: nvcc not found; the CUDA build against torch $TORCH_VERSION was not rehearsed"
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
  echo "tools/rehearse_build.sh: Python $PYTHON_VERSION not found (in pyenv or on PATH);" \
    "set GOSSIP_REHEARSAL_PYTHON to a version this machine has"
  exit 1
fi

ROOT=build/rehearsal
VENV=$ROOT/venv-py$PYTHON_VERSION-torch$TORCH_VERSION
LOGS=$REPO/$ROOT/py$PYTHON_VERSION-torch$TORCH_VERSION-$kind
PY=$REPO/$VENV/bin/python
mkdir -p "$LOGS"

step "environment: $("$python_bin" --version 2>&1), the registry's torch $TORCH_VERSION, $VENV"
start=$SECONDS
# The registry's torch of this version is the CUDA build: its nvidia-* packages come along. The
# rest is what the build and the extension's tests need (not the peers the comparison tests run).
requirements=("torch==$TORCH_VERSION" ninja "setuptools>=77" wheel pytest pytest-timeout numpy)
# Written once they are all installed: a later run (the test command installs the environments
# first, side by side, then runs each rehearsal) goes straight on.
stamp=$VENV/rehearsal-installed
if [ "$(cat "$stamp" 2>/dev/null)" = "${requirements[*]}" ]; then
  echo "installed by an earlier run: ${requirements[*]}"
else
  rm -f "$stamp"
  if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' \
      or torch.version.cuda is None)" 2>/dev/null; then
    rm -rf "$VENV"
    "$python_bin" -m venv "$VENV"
  fi
  # --no-compile: installing is CPU-bound here, and byte-compiling every module of torch took 25 s
  # of a 63 s install on 2 cores; the tests import a fraction of them, compiled as first imported.
  # PIP_CONSTRAINT=/dev/null: the environment is this rehearsal's own and its torch is pinned here,
  # so a machine-wide constraints file (pip's global `constraint`, which caps torch on some
  # machines) does not apply to it.
  PIP_CONSTRAINT=/dev/null "$PY" -m pip install --quiet --no-compile "${requirements[@]}" \
    >"$LOGS/environment.log" 2>&1 || failed "installing the environment" "$LOGS/environment.log"
  "$PY" - <<'PYTHON'
import sys, setuptools, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}), setuptools {setuptools.__version__}")
PYTHON
  echo "${requirements[*]}" >"$stamp"
fi
echo "took $((SECONDS - start)) s"
[ "$environment_only" = 1 ] && exit 0

if [ "$kind" = cuda ]; then
  # shellcheck source=tools/cuda_home.sh
  source tools/cuda_home.sh
  step "build and install (GOSSIP_EXT_CUDA=1, CUDA_HOME=$CUDA_HOME, pip install --no-build-isolation --no-deps .)"
else
  step "build and install (GOSSIP_EXT_CUDA=0, pip install --no-build-isolation --no-deps .)"
fi
start=$SECONDS
GOSSIP_EXT_CUDA=$CUDA TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip install -v --no-build-isolation --no-deps . \
  >"$LOGS/build.log" 2>&1 || failed "the $kind build" "$LOGS/build.log"
echo "took $((SECONDS - start)) s"

step "import the installed build and check what it registered"
# From outside the checkout, so that the installed copy is what Python finds.
if [ "$kind" = cuda ]; then
  (cd "$LOGS" && "$PY" "$REPO/tools/check_cuda_build.py" --not-under "$REPO/gossip_ext") \
    >"$LOGS/import.log" 2>&1 || failed "the import check" "$LOGS/import.log"
else
  (cd "$LOGS" && "$PY" - "$REPO/gossip_ext" <<'PYTHON'
import os, sys, torch, gossip_ext
from gossip_ext._torch_check import _C

where = os.path.realpath(_C.__file__)
print(f"gossip_ext {gossip_ext.__version__}: {where}")
print(f"  built against torch {_C.built_with_torch()}, running torch {torch.__version__}")
print(f"  CPU kernels: {_C.cpu_kernels_isa()}")
if where.startswith(os.path.realpath(sys.argv[1]) + os.sep):
    sys.exit(f"imported {where} from the checkout, not the installed copy")
if hasattr(_C, "NcclTransport"):
    sys.exit(f"{where} is a CUDA build (it has NcclTransport), not the CPU build asked for")
PYTHON
  ) >"$LOGS/import.log" 2>&1 || failed "the import check" "$LOGS/import.log"
fi
cat "$LOGS/import.log"

step "the ABI's smoke tests against the installed $kind build (tools/rehearsal_tests.txt)"
start=$SECONDS
# A node id a line, before its "|"; a line that selects nothing fails pytest ("not found").
selection=()
while IFS= read -r line; do
  case "$line" in '#'* | '') continue ;; esac
  read -r node _ <<<"${line%%|*}"
  selection+=("$REPO/$node")
done <"$REPO/tools/rehearsal_tests.txt"
# From a folder outside the checkout, so that the installed package is the one imported.
cd "$LOGS"
status=0
"$PY" -m pytest "${selection[@]}" --rootdir "$REPO" -q -rs -p no:cacheprovider "$@" ||
  status=$?
echo "took $((SECONDS - start)) s"
exit $status
