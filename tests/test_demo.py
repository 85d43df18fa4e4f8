"""The README's main job, python -m harness.demo, on a short run of a few systems."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness import demo
from harness.compare import systems

ROOT = Path(__file__).resolve().parent.parent  # as a user runs it: from the repository root


def test_the_demo_compares_systems_names_the_fastest_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    systems = ["alone", "ddp", "sgp_bf16"]
    rows = demo.main(
        ["--systems", *systems, "--steps", "24", "--eval-every", "6", "--plot", str(plot)]
    )
    out = capsys.readouterr().out
    assert list(rows) == systems
    # DDP runs half the steps: its final held-out loss is the target the others race to.
    assert rows["ddp"]["history"]["step"] == [6, 12]
    for name in systems:
        if name != "ddp":
            assert rows[name]["history"]["step"] == [6, 12, 18, 24]
        assert math.isfinite(rows[name]["final_bpb"])
        assert f"| {name} |" in out
    assert "fastest to DDP's final held-out loss" in out
    assert plot.stat().st_size > 10_000


def test_the_demo_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--systems", "allreduce"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--workers", "0"])
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--bandwidth", "fast"])
    assert "--bandwidth" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "20"])
    assert "--steps must be > 20 (twice the warmup), got 20" in capsys.readouterr().err


def test_the_demo_runs_by_default_every_system_that_fits_its_sync_period(capsys):
    # The Streaming DiLoCos sync 4 fragments in a period, each over tau + 1 steps: not at H = 4.
    streaming = [s for s in systems.ALL if "streaming" in s]
    assert demo.parse_args([]).systems == [s for s in systems.ALL if s not in streaming]
    assert demo.parse_args(["--sync-every", "16"]).systems == list(systems.ALL)
    assert "streaming_diloco_t2_int8" not in demo.parse_args(["--sync-every", "8"]).systems
    with pytest.raises(SystemExit):
        demo.parse_args(["--systems", "ddp", "streaming_diloco_t2_int8"])
    assert "streaming_diloco_t2_int8 syncs 4 fragments" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--sync-every", "0"])
    assert "--sync-every must be >= 1, got 0" in capsys.readouterr().err


def test_the_demo_as_a_user_runs_it_prints_no_warning(tmp_path):
    command = [sys.executable, "-m", "harness.demo", "--systems", "sgp", "--steps", "24"]
    command += ["--plot", str(tmp_path / "demo.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr and "leaked" not in done.stderr, done.stderr
    assert "| sgp |" in done.stdout
