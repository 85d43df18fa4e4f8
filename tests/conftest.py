"""Puts tests/ on sys.path so that test modules can ``from reference import ...`` whatever the
pytest import mode, and the repository root last, so that they can ``import harness`` (the
benchmark harness, never installed) while ``import gossip_ext`` still finds an installed copy
first (tools/rehearse_build.sh runs the tests against one from outside the checkout)."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)
