#!/usr/bin/env bash
# The quick loop, for editing between commits: at most 5 minutes on the 2-core machine the tests
# run on. Builds what changed (tools/build.sh), builds and runs the C++ tests (ctest), then runs
# tools/quick_tests.txt: a pytest selection per line that together run every module of the
# library at least once (one multi-rank test per algorithm, the outer steps' grid, a fault case
# per kind, an elastic job, a sharded replica, SGP's and fairscale's classes). A selection that
# finds no test fails the loop. It is not the test command (tools/run_tests.sh), which CI runs:
# that one installs what is missing, adds the sanitizers, the rehearsals and every test.
#
#   bash tools/quick_check.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
start=$SECONDS

if ! "$PYTHON" -c "import pytest, pytest_timeout" 2>/dev/null; then
  "$PYTHON" -m pip install --quiet pytest pytest-timeout
fi
PYTHON="$PYTHON" bash tools/build.sh

printf '\n== ctest\n'
bash tools/install_gtest.sh  # GoogleTest, where a fresh clone's machine lacks it
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
  -DGOSSIP_CORE_OBJECTS="$("$PYTHON" tools/sources.py --object-dir)" >/dev/null
cmake --build build/cmake -j "$(nproc)" >/dev/null
ctest --test-dir build/cmake -j "$(nproc)" | tail -n 3

printf '\n== pytest, a selection a line of tools/quick_tests.txt\n'
while IFS= read -r line; do
  case "$line" in '#'* | '') continue ;; esac
  selection=${line%%|*}
  printf '%s\n' "$selection"
  # The selection is a path and pytest's own options (-k "..."), as one would type them.
  eval "\"\$PYTHON\" -m pytest -q --no-header -p no:cacheprovider $selection" | tail -n 1
done < tools/quick_tests.txt
printf '\nquick loop: %d min %02d s (budget 5 min)\n' $(((SECONDS - start) / 60)) $(((SECONDS - start) % 60))
