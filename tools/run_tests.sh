#!/usr/bin/env bash
# Runs every test of gossip_ext on a fresh machine: installs what is missing (torch, ninja, pytest,
# torchft and decent-dp, GoogleTest), builds the extension and the C++ tests, then runs ctest
# (plain, then under ASan+UBSan and TSan: tools/run_sanitizers.sh), rehearses a GPU user's CUDA
# build where nvcc is present (tools/rehearse_cuda_build.sh: torch 2.11's CUDA build on Python
# 3.12, the test suite against it) and runs pytest. Exits non-zero if anything fails. CPU only; the
# GPU tests skip visibly where no GPU is present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # root in a container is the norm where this runs
TORCH_VERSION=${GOSSIP_TORCH_VERSION:-2.13.0}

step() { printf '\n== %s\n' "$*"; }

step "Python dependencies"
if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi
# pytest, and the systems the comparison runs beside gossip_ext (benchmark and test dependencies
# only: tests/test_compare_systems.py).
"$PYTHON" -m pip install --quiet pytest torchft==0.2.0 decent-dp==0.2.3

step "GoogleTest"
if [ ! -f /usr/include/gtest/gtest.h ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libgtest-dev cmake ninja-build
fi

step "Build the extension (gossip_ext._C; reused when up to date)"
PYTHON="$PYTHON" bash tools/build.sh --demo

step "Build and run the C++ tests (ctest; they link the objects the extension's build compiled)"
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
  -DGOSSIP_CORE_OBJECTS="$("$PYTHON" tools/sources.py --object-dir)" >/dev/null
cmake --build build/cmake -j "$(nproc)"
ctest --test-dir build/cmake --output-on-failure -j "$(nproc)"

step "C++ tests under sanitizers (ASan+UBSan: all; TSan: in-process transport)"
bash tools/run_sanitizers.sh

step "Rehearse a GPU user's build without a GPU (torch 2.11 CUDA build, Python 3.12; needs nvcc)"
bash tools/rehearse_cuda_build.sh

step "Python tests (pytest)"
"$PYTHON" -m pytest tests -q
