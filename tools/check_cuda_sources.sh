#!/usr/bin/env bash
# Compiles every source of a CUDA build that a CPU build leaves out (csrc/**/*.cu, and the .cpp
# files under cuda/ and nccl/ folders) with nvcc against the headers of the CUDA build of torch
# and of NCCL, so the GPU code cannot rot on machines without a GPU. The CPU wheel of torch lacks
# some CUDA headers (c10/cuda/impl/cuda_cmake_macros.h), so the headers come from the CUDA wheels
# in the registry (torch, nvidia-nccl-cu13): downloaded once into build/cuda-headers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${GOSSIP_TORCH_VERSION:-2.13.0}
HEADERS=build/cuda-headers/torch-$TORCH_VERSION
NCCL_HEADERS=build/cuda-headers/nccl

if ! command -v nvcc >/dev/null 2>&1; then
  echo "SKIPPED: nvcc not found, CUDA sources not compiled"
  exit 0
fi

if [ ! -f "$HEADERS/torch/include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  tmp=$(mktemp -d)
  # The plain registry (no local wheel folder) serves the CUDA build of torch.
  PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --quiet --no-deps \
    --only-binary=:all: "torch==$TORCH_VERSION" -d "$tmp"
  mkdir -p "$HEADERS"
  "$PYTHON" -m zipfile -e "$tmp"/torch-*.whl "$tmp/unpacked" >/dev/null
  mv "$tmp/unpacked/torch/include" "$HEADERS/torch-include.tmp"
  mkdir -p "$HEADERS/torch" && mv "$HEADERS/torch-include.tmp" "$HEADERS/torch/include"
  rm -rf "$tmp"
fi

if [ ! -f "$NCCL_HEADERS/nccl.h" ]; then
  tmp=$(mktemp -d)
  PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --quiet --no-deps \
    --only-binary=:all: nvidia-nccl-cu13 -d "$tmp"
  "$PYTHON" -m zipfile -e "$tmp"/nvidia_nccl_cu13-*.whl "$tmp/unpacked" >/dev/null
  mkdir -p "$NCCL_HEADERS"
  cp -r "$tmp"/unpacked/nvidia/nccl/include/. "$NCCL_HEADERS/"
  rm -rf "$tmp"
fi

PY_INCLUDE=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
out=$(mktemp -d)
status=0
while IFS= read -r source; do
  echo "nvcc -c $source"
  if ! nvcc -std=c++20 -arch=sm_90 -O3 -c "$source" -o "$out/$(basename "$source").o" \
      -Icsrc -I"$HEADERS/torch/include" -I"$HEADERS/torch/include/torch/csrc/api/include" \
      -I"$NCCL_HEADERS" -I"$PY_INCLUDE" -Xcompiler -fPIC -DGOSSIP_WITH_CUDA=1; then
    status=1
  fi
done < <(find csrc \( -name '*.cu' -o -path '*/cuda/*.cpp' -o -path '*/nccl/*.cpp' \) | sort)
rm -rf "$out"
[ "$status" -eq 0 ] && echo "CUDA and NCCL sources compiled"
exit "$status"
