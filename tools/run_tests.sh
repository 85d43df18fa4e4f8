#!/usr/bin/env bash
# Runs every test of gossip_ext on a fresh machine: installs what is missing (torch, ninja, pytest
# and pytest-timeout, torchft and decent-dp, GoogleTest), builds the extension, then the C++ tests
# from the extension's own objects, runs ctest (plain, then under ASan+UBSan and TSan:
# tools/run_sanitizers.sh), rehearses two users' installs against other torches, each in an
# environment of its own (tools/rehearse_build.sh, the extension's tests against each build): a GPU
# user's CUDA build against torch 2.11 where nvcc is present, and a CPU build against the newest
# torch, 2.15, both on Python 3.12; then runs pytest, the whole suite, against the CPU build of
# torch 2.13. Exits non-zero if anything fails, and prints how long each stage took and the 20
# slowest tests. CPU only; the GPU tests skip visibly where no GPU is present.
#
# Installs into the Python environment that PYTHON (default python3) runs: a virtual environment
# keeps it apart from the system's (python3 -m venv .venv && . .venv/bin/activate first).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # root in a container is the norm where this runs
TORCH_VERSION=${GOSSIP_TORCH_VERSION:-2.13.0}

# stage BUDGET NAME: starts a stage, which should take at most BUDGET seconds on the 2-core
# machine the tests run on (the budgets sum to 25 minutes, the whole command's); the previous
# stage's time goes to the summary printed at the end, beside its budget. A stage over its budget
# is named there, and does not fail the run: the budget tells a change that made the suite slower.
stages=()
over=()
stage_name=""
stage_budget=0
stage_start=$SECONDS
run_start=$SECONDS
budget_total=0
minutes() { printf '%2d min %02d s' $(($1 / 60)) $(($1 % 60)); }
end_stage() {
  [ -n "$stage_name" ] || return 0
  local took=$((SECONDS - stage_start)) mark=""
  if [ "$took" -gt "$stage_budget" ]; then
    mark="  OVER"
    over+=("$stage_name")
  fi
  stages+=("$(printf '%-78s %s  (budget %s)%s' "$stage_name" "$(minutes "$took")" \
    "$(minutes "$stage_budget")" "$mark")")
  stage_name=""
}
stage() {
  end_stage
  stage_budget=$1
  stage_name=$2
  budget_total=$((budget_total + stage_budget))
  stage_start=$SECONDS
  printf '\n== %s\n' "$stage_name"
}
summary() {
  local status=$?
  end_stage
  printf '\n== Time per stage\n'
  printf '%s\n' "${stages[@]}"
  printf '%-78s %s  (budget %s)\n' "all" "$(minutes $((SECONDS - run_start)))" \
    "$(minutes "$budget_total")"
  if [ ${#over[@]} -gt 0 ]; then
    printf 'over budget: %s\n' "$(IFS=';'; echo "${over[*]}")"
  else
    echo "every stage within its budget"
  fi
  # pytest's own closing line stays the last line of the run.
  [ -s build/pytest.log ] && tail -n 1 build/pytest.log
  return $status
}
trap summary EXIT
mkdir -p build
rm -f build/pytest.log

stage 45 "Python dependencies"
if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi
# pytest with its per-test time limit, and the systems the comparison runs beside gossip_ext
# (benchmark and test dependencies only: tests/test_compare_systems.py).
"$PYTHON" -m pip install --quiet pytest pytest-timeout torchft==0.2.0 decent-dp==0.2.3

stage 15 "GoogleTest"
bash tools/install_gtest.sh

stage 90 "Build the extension (gossip_ext._C; reused when up to date)"
PYTHON="$PYTHON" bash tools/build.sh --demo

stage 60 "Build and run the C++ tests (ctest; linked from the extension's objects)"
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
  -DGOSSIP_CORE_OBJECTS="$("$PYTHON" tools/sources.py --object-dir)" >/dev/null
cmake --build build/cmake -j "$(nproc)"
ctest --test-dir build/cmake --output-on-failure -j "$(nproc)"

stage 180 "C++ tests under ASan+UBSan (all of ctest)"
bash tools/run_sanitizers.sh asan

stage 90 "C++ tests under TSan (the threaded transports: ctest -L inproc)"
bash tools/run_sanitizers.sh tsan

# The rehearsals (tools/rehearse_build.sh): what each builds against.
cuda_rehearsal=(GOSSIP_REHEARSAL_TORCH=2.11.0 GOSSIP_REHEARSAL_PYTHON=3.12 GOSSIP_REHEARSAL_CUDA=1)
newest_rehearsal=(GOSSIP_REHEARSAL_TORCH=2.15.0 GOSSIP_REHEARSAL_PYTHON=3.12 GOSSIP_REHEARSAL_CUDA=0)

stage 60 "Rehearsal environments: torch 2.11 and 2.15 (10 GB of disk), side by side"
# Installing one is CPU-bound (unpacking and writing its files; the downloads do not hold it up)
# and pip uses one core: the two install at once on two cores. Each keeps its log; both are
# waited for, and shown, before a failure stops the run.
mkdir -p build/rehearsal
env "${cuda_rehearsal[@]}" bash tools/rehearse_build.sh --environment \
  >build/rehearsal/environment-cuda.log 2>&1 &
cuda_environment=$!
env "${newest_rehearsal[@]}" bash tools/rehearse_build.sh --environment \
  >build/rehearsal/environment-newest.log 2>&1 &
newest_environment=$!
environments=0
wait "$cuda_environment" || environments=$?
cat build/rehearsal/environment-cuda.log
wait "$newest_environment" || environments=$?
cat build/rehearsal/environment-newest.log
if [ "$environments" -ne 0 ]; then
  echo "tools/run_tests.sh: a rehearsal's environment did not install (its log is above)"
  exit 1
fi

stage 150 "Rehearsal: torch 2.11's CUDA build without a GPU (build, pytest -m extension)"
env "${cuda_rehearsal[@]}" bash tools/rehearse_build.sh

stage 120 "Rehearsal: the newest torch, 2.15, a CPU build (build, pytest -m extension)"
env "${newest_rehearsal[@]}" bash tools/rehearse_build.sh

stage 690 "Python tests (pytest; the 20 slowest listed at the end)"
# Every test's time stays in build/pytest-times.xml (JUnit's format), to see where the suite's
# time goes beyond the slowest 20.
"$PYTHON" -m pytest tests -q --durations=20 --junitxml=build/pytest-times.xml | tee build/pytest.log
