#!/usr/bin/env bash
# Builds the wheel of gossip_ext for the installed torch into dist/: named by a local version that
# says which torch and device it is bound to (gossip_ext-0.1.0+pt213cpu-...whl) and requiring
# that torch exactly (Requires-Dist: torch==2.13.0+cpu), since its compiled extension runs with no
# other. It reuses the objects of an earlier build of the same configuration (build/temp): after
# tools/build.sh it only links and packs.
#
# Installing it needs no compiler: `pip install dist/gossip_ext-0.1.0+pt213cpu-*.whl` beside that
# torch. docs/troubleshooting.md says how to build one per torch (the rehearsals' torches).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
rm -rf dist/gossip_ext-*.whl
# No build isolation: the wheel is compiled against this environment's torch; no dependencies:
# pip wheel would otherwise fetch a wheel of torch beside it.
"$PYTHON" -m pip wheel --quiet --no-build-isolation --no-deps . -w dist/
ls dist/gossip_ext-*.whl
