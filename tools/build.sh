#!/usr/bin/env bash
# Builds gossip_ext in place and installs it in editable mode, reusing what an earlier build left:
# the first build compiles every source (1 min 08 s in a fresh clone on 2 cores, each file shown as
# ninja finishes it); a build with nothing changed takes seconds. The README's main-job command
# and the test command both start with it, so the second does not rebuild what the first built.
#
# Installs what is missing first: torch (the CPU build unless another is installed), ninja,
# setuptools and wheel, and, with --demo, what the demo plots with (matplotlib, tqdm) and the
# systems it compares gossip_ext with (torchft, decent-dp).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${GOSSIP_TORCH_VERSION:-2.13.0}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install "torch==$TORCH_VERSION"
fi
extras=(ninja "setuptools>=77" wheel)
# The demo (harness/, run from the checkout) plots (matplotlib; tqdm for the MLP demo's bars) and
# runs the systems users compare gossip_ext with (torchft, decent-dp): demo dependencies, never
# the library's.
[ "${1:-}" = "--demo" ] && extras+=(matplotlib tqdm torchft==0.2.0 decent-dp==0.2.3)
PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install --quiet "${extras[@]}"

# Sealed messages (csrc/transport/sealed) need OpenSSL's libcrypto and its headers: installed from
# Debian's packages where missing and apt-get can reach them. Without them the build still
# succeeds, with no sealed messages (python -m gossip_ext.info says so; tools/sources.py decides).
if [ ! -f /usr/include/openssl/evp.h ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libssl-dev; } ||
    echo "tools/build.sh: libssl-dev could not be installed: building without sealed messages"
fi

# Root installs in a container are the norm here: pip need not warn about them.
export PIP_ROOT_USER_ACTION=ignore
mkdir -p build
log=build/build.log
# Each compiled file, as ninja finishes it, from the build's full log.
progress() { tee "$log" | sed -n -E -u 's/^ *(\[[0-9]+\/[0-9]+\]) .* -c (\S+) -o .*/  \1 \2/p'; }
failed() {
  tail -40 "$log"
  echo "tools/build.sh: the build failed (full log: $log)"
  exit 1
}

here=$(pwd)
installed=$(cd / && "$PYTHON" -c "import gossip_ext, os; print(os.path.dirname(os.path.dirname(os.path.realpath(gossip_ext.__file__))))" 2>/dev/null || true)
if [ "$installed" = "$here" ]; then
  # Installed from this checkout already: ninja recompiles only what changed (objects in
  # build/temp/<configuration>, see setup.py), then the extension is linked again.
  echo "Building gossip_ext._C in place (only what changed)"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" setup.py build_ext --inplace 2>&1 | progress || failed
else
  # The first build: pip compiles in place while it installs.
  echo "Building and installing gossip_ext (editable): the first build, about a minute on 2 cores"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e . \
    2>&1 | progress || failed
fi
(cd / && "$PYTHON" -c "import gossip_ext; print('gossip_ext', gossip_ext.__version__, 'is ready')")
