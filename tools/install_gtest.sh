#!/usr/bin/env bash
# Installs what the C++ tests build with, where it is missing: GoogleTest from Debian's packages
# (libgtest-dev), with cmake and ninja. The test command (tools/run_tests.sh) and the quick loop
# (tools/quick_check.sh) both start their C++ stage with it, so either works on a fresh clone.
set -euo pipefail
[ -f /usr/include/gtest/gtest.h ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq libgtest-dev cmake ninja-build
