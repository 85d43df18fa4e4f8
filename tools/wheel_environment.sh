#!/usr/bin/env bash
# Makes build/wheel-venv: a new virtual environment where a user installs gossip_ext's wheel
# beside the torch it needs, as pip does it, dependencies resolved: the wheel built by
# tools/build_wheel.sh, then torch from the registry. tests/test_wheel.py runs the quickstart and
# examples/train.py there, with no compiler on PATH (GOSSIP_EXT_WHEEL_VENV names it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
venv=build/wheel-venv

PYTHON="$PYTHON" bash tools/build_wheel.sh
rm -rf "$venv"
"$PYTHON" -m venv "$venv"
# The wheel alone, as a user types it: pip installs the torch it requires (torch==2.13.0+cpu)
# beside it.
"$venv/bin/python" -m pip install --quiet dist/gossip_ext-*.whl
"$venv/bin/python" -m pip list 2>/dev/null | grep -E "^(gossip_ext|gossip-ext|torch) "
