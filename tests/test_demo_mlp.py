"""The quick MLP demo, python -m harness.demo_mlp, on a short run."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness import demo_mlp as demo

ROOT = Path(__file__).resolve().parent.parent  # as a user runs it: from the repository root


def test_demo_trains_every_mode_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    results = demo.main(
        ["--workers", "2", "--steps", "80", "--quiet", "--plot", str(plot), "--log-every", "20"]
    )
    assert list(results) == list(demo.MODES)
    for mode, r in results.items():
        # Ten classes: chance is 0.1. Every mode must really learn.
        assert r["accuracy"] > 0.5, (mode, r["accuracy"])
        assert r["history"]["step"] == [0, 20, 40, 60, 79]
    param_bytes = sum(p.numel() * 4 for p in demo.make_model().parameters())
    # Two workers, one peer per round, lazy mixing: one float32 message of the parameters a step.
    assert results["sgp"]["bytes_per_step"] == param_bytes
    assert results["ddp"]["bytes_per_step"] == pytest.approx(param_bytes)  # 2 (n-1)/n = 1
    assert results["ddp"]["consensus"] == 0.0
    # Two workers with weights 1/2: synchronous gossip is exact averaging.
    assert results["sgp"]["consensus"] < 1e-6
    # The consensus panel: the exact distance before each step's round, which local steps make
    # positive, and the running estimate the gossip modes log from the first logged step on.
    for mode in ("sgp", "overlap", "dpsgd"):
        h = results[mode]["history"]
        assert all(c > 0 for c in h["consensus"][1:]), (mode, h["consensus"])
        assert math.isnan(h["estimate"][0]) and all(e > 0 for e in h["estimate"][1:]), mode
    assert all(math.isnan(e) for e in results["ddp"]["history"]["estimate"])
    assert results["ddp"]["history"]["consensus"] == [0.0] * 5
    assert plot.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "consensus" in out and "estimate" in out and str(plot) in out


def test_demo_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--modes", "sgp,allreduce"])
    assert "allreduce" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--workers", "0"])
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def test_the_demo_as_a_user_runs_it_prints_no_warning(tmp_path):
    # With its progress bars (no --quiet) and in a process of its own, whose exit is where the
    # multiprocessing resource tracker reports what the workers left behind.
    command = [sys.executable, "-m", "harness.demo_mlp", "--workers", "2"]
    command += ["--steps", "40"]
    command += ["--modes", "sgp", "--plot", str(tmp_path / "demo.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "leaked" not in done.stderr, done.stderr
    assert "sgp" in done.stderr  # the bar was drawn
