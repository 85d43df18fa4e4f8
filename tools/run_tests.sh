#!/usr/bin/env bash
# Runs every test of gossip_ext on a fresh machine: installs what is missing (torch, ninja, pytest
# and pytest-timeout, torchft and decent-dp, pytorch-lightning, GoogleTest), builds the extension
# and its wheel (installed, with the torch it requires, in a new environment where
# tests/test_wheel.py runs it: tools/wheel_environment.sh), then the C++ tests from the
# extension's own objects, runs ctest (plain, then under ASan+UBSan and TSan:
# tools/run_sanitizers.sh), rehearses two users' installs against other torches, each in an
# environment of its own (tools/rehearse_build.sh, a smoke test of the ABI against each build:
# tools/rehearsal_tests.txt): a GPU user's CUDA build against torch 2.11 where nvcc is present, and
# a CPU build against the newest torch, 2.15, both on Python 3.12; then runs pytest, the whole
# suite, against the CPU build of torch 2.13, and lists where its time went (tools/slowest_tests.py:
# the 20 slowest tests, those over 15 s without a slow mark, the marked ones' total). Exits
# non-zero if anything fails or a stage's CPU time passes CPU_LIMIT_PERCENT of its budget, and
# prints each stage's wall and CPU time beside its budget. CPU only; the GPU tests skip visibly
# where no GPU is present.
#
# Installs into the Python environment that PYTHON (default python3) runs: a virtual environment
# keeps it apart from the system's (python3 -m venv .venv && . .venv/bin/activate first).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore  # root in a container is the norm where this runs
TORCH_VERSION=${GOSSIP_TORCH_VERSION:-2.13.0}

# A stage whose CPU time (user+system of every process it ran) passes this percentage of its CPU
# budget fails the command, after the summary. CPU time is what load from other work inflates
# least. Each stage has a CPU budget of its own beside its wall budget: on 2 cores a stage that
# keeps both busy (a parallel build) spends up to twice its wall time in CPU, one that waits (the
# tests' timeouts and kills) less than its wall time; each is a full run's CPU figure with a
# quarter's headroom (docs/testing.md).
CPU_LIMIT_PERCENT=150
PYTEST_TIMES=build/pytest-times.xml  # every test's time (JUnit), read by tools/slowest_tests.py

# stage BUDGET CPU_BUDGET NAME: starts a stage, which should take at most BUDGET seconds on the
# 2-core machine the tests run on (what the stage took in the last quiet run, docs/testing.md, and
# for pytest the suite's aim, 13 minutes) and CPU_BUDGET seconds of CPU. The previous stage's wall
# and CPU time go to the summary printed at the end, beside its budgets. A stage over its budget in
# wall time is named there and does not fail the run (load from other work stretches it); one over
# CPU_LIMIT_PERCENT of its CPU budget fails the run, named after the summary (pytest with its 10
# slowest tests).
stages=()
over=()
cpu_over=()
stage_name=""
stage_budget=0
stage_cpu_budget=0
stage_start=$SECONDS
stage_cpu_start=0
run_start=$SECONDS
budget_total=0
pytest_stage=""
times_file=$(mktemp)
minutes() { printf '%2d min %02d s' $(($1 / 60)) $(($1 % 60)); }
# children_cpu_ms: sets children_cpu to the user+system milliseconds of every child process this
# shell has waited for, and of their own waited-for children (bash's `times`, second line). Run
# in this shell, never in $(...): a subshell starts its own count at zero.
children_cpu=0
children_cpu_ms() {
  local user system value minutes seconds total=0
  times >"$times_file"
  { read -r _ _ && read -r user system; } <"$times_file"
  for value in "$user" "$system"; do  # "1m2.345s"
    minutes=${value%%m*}
    seconds=${value#*m}
    seconds=${seconds%s}
    total=$((total + (10#$minutes * 60 + 10#${seconds%.*}) * 1000 + 10#${seconds#*.}))
  done
  children_cpu=$total
}
end_stage() {
  [ -n "$stage_name" ] || return 0
  children_cpu_ms
  local took=$((SECONDS - stage_start)) cpu_ms=$((children_cpu - stage_cpu_start)) mark=""
  local cpu_s=$(((children_cpu - stage_cpu_start + 500) / 1000))
  if [ "$took" -gt "$stage_budget" ]; then
    mark="  OVER"
    over+=("$stage_name")
  fi
  if [ "$cpu_ms" -gt $((stage_cpu_budget * 10 * CPU_LIMIT_PERCENT)) ]; then
    mark="$mark  CPU OVER ${CPU_LIMIT_PERCENT}%"
    cpu_over+=("$stage_name|$cpu_s|$stage_cpu_budget")
  fi
  stages+=("$(printf '%-66s %s, cpu %s  (budgets %s, cpu %s)%s' "$stage_name" "$(minutes "$took")" \
    "$(minutes "$cpu_s")" "$(minutes "$stage_budget")" "$(minutes "$stage_cpu_budget")" \
    "$mark")")
  stage_name=""
}
stage() {
  end_stage
  stage_budget=$1
  stage_cpu_budget=$2
  stage_name=$3
  budget_total=$((budget_total + stage_budget))
  stage_start=$SECONDS
  children_cpu_ms
  stage_cpu_start=$children_cpu
  printf '\n== %s\n' "$stage_name"
}
summary() {
  local status=$?
  end_stage
  children_cpu_ms
  printf '\n== Time per stage (wall, cpu: user+system of what it ran)\n'
  printf '%s\n' "${stages[@]}"
  printf '%-66s %s, cpu %s  (budget %s)\n' "all" "$(minutes $((SECONDS - run_start)))" \
    "$(minutes $(((children_cpu + 500) / 1000)))" "$(minutes "$budget_total")"
  if [ ${#over[@]} -gt 0 ]; then
    printf 'over budget: %s\n' "$(IFS=';'; echo "${over[*]}")"
  else
    echo "every stage within its budget"
  fi
  # pytest's own closing line stays the last line of a run that CPU time does not fail.
  [ -s build/pytest.log ] && tail -n 1 build/pytest.log
  local entry name cpu_s
  for entry in "${cpu_over[@]}"; do  # name|cpu seconds|budget
    name=${entry%%|*}
    cpu_s=${entry#*|}
    printf 'FAILED: "%s" took %s of CPU, over %d%% of its CPU budget of %s\n' "$name" \
      "$(minutes "${cpu_s%|*}")" "$CPU_LIMIT_PERCENT" "$(minutes "${entry##*|}")"
    if [ "$name" = "$pytest_stage" ] && [ -s "$PYTEST_TIMES" ]; then
      "$PYTHON" tools/slowest_tests.py "$PYTEST_TIMES" --slowest-only --top 10 || true
    fi
  done
  rm -f "$times_file"
  [ ${#cpu_over[@]} -eq 0 ] || [ "$status" -ne 0 ] || status=1
  exit "$status"
}

# `source tools/run_tests.sh` defines the stages' machinery above and runs nothing (how
# tests/test_stage_budgets.py checks the summary); `bash tools/run_tests.sh` runs every stage.
(return 0 2>/dev/null) && return 0

trap summary EXIT
mkdir -p build
rm -f build/pytest.log "$PYTEST_TIMES"

stage 45 240 "Python dependencies"
if ! "$PYTHON" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi
# pytest with its per-test time limit, the systems the comparison runs beside gossip_ext
# (benchmark and test dependencies only: tests/test_compare_systems.py), and the Lightning extra
# (gossip_ext[lightning]: tests/test_lightning.py).
"$PYTHON" -m pip install --quiet pytest pytest-timeout torchft==0.2.0 decent-dp==0.2.3 \
  pytorch-lightning==2.6.6 mypy==2.4.1

stage 15 120 "GoogleTest"
bash tools/install_gtest.sh

stage 120 270 "Build the extension (gossip_ext._C; reused when up to date)"
PYTHON="$PYTHON" bash tools/build.sh --demo

stage 45 60 "Types: every engine held to its declared interface (mypy; pyproject.toml says which)"
"$PYTHON" -m mypy

stage 75 150 "The wheel, installed with the torch it requires in a new environment (tests/test_wheel.py)"
PYTHON="$PYTHON" bash tools/wheel_environment.sh

stage 100 230 "Build and run the C++ tests (ctest; linked from the extension's objects)"
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
  -DGOSSIP_CORE_OBJECTS="$("$PYTHON" tools/sources.py --object-dir)" >/dev/null
cmake --build build/cmake -j "$(nproc)"
ctest --test-dir build/cmake --output-on-failure -j "$(nproc)"

stage 255 615 "C++ tests under ASan+UBSan (all of ctest)"
bash tools/run_sanitizers.sh asan

stage 105 245 "C++ tests under TSan (the threaded transports: ctest -L inproc)"
bash tools/run_sanitizers.sh tsan

# The rehearsals (tools/rehearse_build.sh): what each builds against.
cuda_rehearsal=(GOSSIP_REHEARSAL_TORCH=2.11.0 GOSSIP_REHEARSAL_PYTHON=3.12 GOSSIP_REHEARSAL_CUDA=1)
newest_rehearsal=(GOSSIP_REHEARSAL_TORCH=2.15.0 GOSSIP_REHEARSAL_PYTHON=3.12 GOSSIP_REHEARSAL_CUDA=0)

stage 90 185 "Rehearsal environments: torch 2.11 and 2.15 (10 GB of disk), side by side"
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

stage 225 480 "Rehearsal: torch 2.11's CUDA build without a GPU (build, the ABI's smoke tests)"
env "${cuda_rehearsal[@]}" bash tools/rehearse_build.sh

stage 165 330 "Rehearsal: the newest torch, 2.15, a CPU build (build, the ABI's smoke tests)"
env "${newest_rehearsal[@]}" bash tools/rehearse_build.sh

pytest_stage="Python tests (pytest, the whole suite)"
stage 780 1110 "$pytest_stage"
# Every test's time stays in $PYTEST_TIMES (JUnit's format, with each slow mark's reason and the
# commit: tests/conftest.py); tools/slowest_tests.py --write-docs makes docs/testing.md's table
# of it.
pytest_status=0
GOSSIP_EXT_WHEEL_VENV=build/wheel-venv "$PYTHON" -m pytest tests -q --junitxml="$PYTEST_TIMES" \
  | tee build/pytest.log || pytest_status=$?
end_stage  # pytest's own time and CPU time, without the report below
printf '%s\n' "${stages[-1]}"
printf '\n== Where the time of pytest went (tools/slowest_tests.py %s)\n' "$PYTEST_TIMES"
"$PYTHON" tools/slowest_tests.py "$PYTEST_TIMES" --top 20 || true
exit "$pytest_status"
