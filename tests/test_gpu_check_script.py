"""tools/gpu_check.sh as it behaves on a machine without a GPU: it prints what it found, then stops
at that first stage with the stage's log, instead of building or hanging. (On a GPU machine it
goes on to build and test; that run is the script's real use.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine gpu_check.sh runs for real"
)


def _run(tmp_path, *args):
    env = dict(os.environ, RESULTS_DIR=str(tmp_path), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_without_a_gpu_it_reports_what_it_found_and_stops_at_the_first_stage(tmp_path):
    result = _run(tmp_path, "tests")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert f"torch {torch.__version__}" in out
    assert "Python headers:" in out and "setuptools" in out
    assert "gpu_check: FAILED at found" in out
    assert "== build" not in out, "it went on past a failed stage"
    assert (tmp_path / "found.log").is_file()


def test_an_unknown_command_is_a_usage_error(tmp_path):
    result = _run(tmp_path, "everything")
    assert result.returncode == 2
    assert "usage:" in result.stderr
