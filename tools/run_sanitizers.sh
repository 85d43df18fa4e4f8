#!/usr/bin/env bash
# Builds gossip_core and the C++ tests with sanitizers and runs them with ctest:
#   asan  build/asan, AddressSanitizer + UndefinedBehaviorSanitizer: the whole suite
#   tsan  build/tsan, ThreadSanitizer: the in-process transport tests (ctest label `inproc`),
#         and only those are built
# Both compile at -O1 with line tables (CMakeLists.txt, GOSSIP_SANITIZE).
# Any finding fails its test, so the script exits non-zero. The sanitizer runtime options are set
# on the tests by CMakeLists.txt (GOSSIP_SANITIZE): plain `ctest` in either folder runs the same.
#
#   bash tools/run_sanitizers.sh            # both
#   bash tools/run_sanitizers.sh asan       # or just one
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
JOBS=$(nproc)
TORCH_CMAKE=$("$PYTHON" -c 'import torch; print(torch.utils.cmake_prefix_path)')

# sanitize DIR GOSSIP_SANITIZE TARGET [ctest arguments...]
sanitize() {
  local dir=$1 sanitizers=$2 target=$3
  shift 3
  local start=$SECONDS
  printf '\n== %s: GOSSIP_SANITIZE=%s\n' "$dir" "$sanitizers"
  # A unity build: the core's sources compiled a few to a translation unit, so torch's headers
  # are parsed 5 times instead of once a source (the ASan+UBSan core: 107 s of CPU against 306 s
  # on the 2-core machine). What a sanitizer checks is the code run, which is the same; each
  # source still compiles alone in the extension's build.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_CMAKE" \
    -DCMAKE_BUILD_TYPE=Release -DGOSSIP_SANITIZE="$sanitizers" -DCMAKE_UNITY_BUILD=ON >/dev/null
  cmake --build "$dir" -j "$JOBS" --target "$target"
  # --no-tests=error: a label that matches nothing must fail, not pass.
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j "$JOBS" "$@"
  printf '== %s: done in %d s\n' "$dir" $((SECONDS - start))
}

targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(asan tsan)
for name in "${targets[@]}"; do
  case $name in
    asan) sanitize build/asan "address;undefined" all ;;
    tsan) sanitize build/tsan thread inproc_tests -L inproc ;;
    *)
      echo "usage: $0 [asan] [tsan]" >&2
      exit 2
      ;;
  esac
done
