"""The README's main job, python -m harness.demo, on a short run of a few systems: its first line
says which network it runs on, the emulated 100 Mbit/s cluster by default where one can be built."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from harness import demo, netns
from harness.compare import systems

ROOT = Path(__file__).resolve().parent.parent  # as a user runs it: from the repository root


def test_the_demo_compares_systems_names_the_fastest_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    systems = ["alone", "ddp", "sgp_bf16"]
    rows = demo.main(
        ["--systems", *systems, "--steps", "24", "--eval-every", "6", "--plot", str(plot)]
        + ["--bandwidth", "loopback"]
    )
    out = capsys.readouterr().out
    assert out.startswith("2 workers on loopback (--bandwidth loopback)")
    assert list(rows) == systems
    # DDP runs half the steps: its final held-out loss is the target the others race to.
    assert rows["ddp"]["history"]["step"] == [6, 12]
    for name in systems:
        if name != "ddp":
            assert rows[name]["history"]["step"] == [6, 12, 18, 24]
        assert math.isfinite(rows[name]["final_bpb"])
        assert f"| {name} |" in out
    assert "fastest to DDP's final held-out loss" in out
    assert "communication-free bound" in out
    assert plot.stat().st_size > 10_000


def _row(times, bpbs, step_ms, steps):
    history = {"step": steps, "time": times, "heldout_bpb": bpbs}
    return {"step_ms": step_ms, "final_bpb": bpbs[-1], "history": history}


def test_the_demo_weighs_gossip_ext_s_best_against_the_bound_and_the_best_peer():
    # DDP: 100 steps at 500 ms, its final 3.0 at 50 s; alone 100 ms a step, the bound 10 s.
    rows = {
        "alone": _row([10.0, 20.0], [3.5, 3.2], 100, [100, 200]),
        "ddp": _row([25.0, 50.0], [3.4, 3.0], 500, [50, 100]),
        "decent_dp": _row([20.0, 40.0], [3.3, 2.95], 200, [100, 200]),
        "overlap_sgp_int8": _row([6.0, 12.0], [3.1, 2.9], 60, [100, 200]),
    }
    assert demo.verdict(rows) == [
        "fastest to DDP's final held-out loss (3.000 bits per byte): overlap_sgp_int8, in 12.0 s "
        "of training",
        "gossip_ext's best, overlap_sgp_int8: 12.0 s, 1.20x the communication-free bound (10.0 s) "
        "and 0.30x the best peer's (decent_dp, 40.0 s)",
    ]
    rows["overlap_sgp_int8"] = _row([6.0, 12.0], [3.1, 3.05], 60, [100, 200])
    assert demo.verdict(rows)[1] == "gossip_ext's modes: none reached it"


def test_the_demo_runs_on_the_emulated_network_by_default_where_it_can(monkeypatch):
    monkeypatch.setattr(demo.netns, "unavailable", lambda: None)
    rate, line = demo.network(demo.parse_args([]))
    assert rate == 1e8
    assert line == (
        "2 workers, each behind its own 100 Mbit/s NIC (an emulated cluster: network namespaces "
        "and tc); --bandwidth loopback to skip"
    )
    assert demo.network(demo.parse_args(["--bandwidth", "1gbit"]))[0] == 1e9
    rate, line = demo.network(demo.parse_args(["--bandwidth", "loopback"]))
    assert rate is None and line.startswith("2 workers on loopback (--bandwidth loopback)")
    # Elsewhere: loopback, and the one line says why and how to get the network.
    monkeypatch.setattr(demo.netns, "unavailable", lambda: "the emulated cluster needs root")
    rate, line = demo.network(demo.parse_args([]))
    assert rate is None
    assert line.startswith("2 workers on loopback, where a message is a memory copy (the emulated")
    assert line.endswith("run it as root on Linux with iproute2 (ip, tc)")
    rate, line = demo.network(demo.parse_args(["--workers", "1"]))
    assert rate is None and "(one worker has no network to cross)" in line


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


def test_the_demo_runs_a_few_systems_by_default_and_any_on_request(capsys):
    assert demo.parse_args([]).systems == list(demo.SYSTEMS)
    assert set(demo.SYSTEMS) <= set(systems.ALL)
    assert {"alone", "ddp", "overlap_sgp_bf16"} <= set(demo.SYSTEMS)
    # --systems all: every system that fits the sync period. The Streaming DiLoCos sync 4
    # fragments in a period, each over tau + 1 steps: not at H = 4.
    streaming = [s for s in systems.ALL if "streaming" in s]
    every = [s for s in systems.ALL if s not in streaming]
    assert demo.parse_args(["--systems", "all"]).systems == every
    assert demo.parse_args(["--systems", "all", "--sync-every", "16"]).systems == list(systems.ALL)
    assert (
        "streaming_diloco_t2_int8"
        not in demo.parse_args(["--systems", "all", "--sync-every", "8"]).systems
    )
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
    # Its first line names the network it ran on: the emulated cluster where one can be built.
    first = done.stdout.splitlines()[0]
    if netns.unavailable() is None:
        assert first.startswith("2 workers, each behind its own 100 Mbit/s NIC"), first
        assert "100 Mbit/s NICs\n| system |" in done.stdout
    else:
        assert first.startswith("2 workers on loopback, where a message is a memory copy"), first
