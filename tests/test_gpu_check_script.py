"""tools/gpu_check.sh as it behaves on a machine without a GPU: it prints what it found, marks
every later stage skipped in its closing table, and leaves the summary, instead of building or
hanging. (On a GPU machine every stage runs, even after one fails; that run is the script's real
use.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STAGES = ["found", "build", "import", "kernels", "nccl_round", "tests", "memcheck"]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU machine gpu_check.sh runs for real"
)


def _run(tmp_path, *args):
    env = dict(os.environ, RESULTS_DIR=str(tmp_path), PYTHON=sys.executable)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_without_a_gpu_it_reports_what_it_found_and_skips_the_rest(tmp_path):
    result = _run(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert f"torch {torch.__version__}" in out
    assert "Python headers:" in out and "setuptools" in out
    assert "== build" not in out, "it built without a GPU"
    summary = (tmp_path / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "stage" not in line]
    assert [row.split("|")[1].strip() for row in rows] == STAGES
    assert "FAILED" in rows[0]
    assert all("SKIPPED (found failed)" in row for row in rows[1:])
    assert f"torch {torch.__version__}" in summary, "the summary says what was found"
    assert summary.splitlines()[-1] in out, "the table closes the output"
    assert "gpu_check: a stage failed" in out
    assert len(list(tmp_path.iterdir())) <= 8


def test_an_argument_is_a_usage_error(tmp_path):
    result = _run(tmp_path, "tests")
    assert result.returncode == 2
    assert "usage:" in result.stderr
