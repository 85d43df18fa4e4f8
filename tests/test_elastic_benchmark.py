"""benchmarks/elastic.py's measures, on timelines whose answers are worked out by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import elastic  # noqa: E402


def _survivor(stall_after: int, stall_s: float, steps: int = 200) -> dict:
    # A step every 0.1 s; step ``stall_after + 1`` takes ``stall_s`` more.
    times = [0.1 * i + (stall_s if i > stall_after else 0.0) for i in range(steps)]
    return {"steps": [[i, t] for i, t in enumerate(times)], "heldout_bpb": 3.0}


def test_back_and_lost_after_a_kill_and_a_join():
    args = elastic.parse_args(["--no-record", "--fail-at", "50", "--replace-at", "90"])
    joiner = {
        "steps": [[130, 14.5], [131, 14.6]],
        "heldout_bpb": 3.3,
        "timeline": {"imported": 11.0, "loaded": 14.0, "joined": 14.3, "first_step": 130},
    }
    run = {
        "failure": "kill",
        "events": {"go": 0.0, "failed": 5.05, "replaced": 10.0},
        "workers": {"w0": _survivor(50, 1.0), "w1": _survivor(50, 1.0), "replacement": joiner},
    }
    f = elastic.measure(run, args)
    # Step 51 ends at 6.1 instead of 5.1: the block of steps 50-54 takes 1.4 s, not 0.4 s, and
    # ends at 6.4, 1.35 s after the kill; one second lost.
    assert f["back_s"] == pytest.approx(1.35)
    assert f["lost_after_failure_s"] == pytest.approx(1.0)
    assert f["lost_after_join_s"] == pytest.approx(0.0, abs=1e-9)
    assert f["joiner_trains_s"] == pytest.approx(4.5)
    assert f["joiner_joining_s"] == pytest.approx(0.5)
    assert f["worker_steps"] == 200 + 200 + 2
    assert f["final_bpb"] == pytest.approx(3.1)
    assert f["step_ms"] == pytest.approx(1000 * (2 * (20.9 / 199) + 0.1) / 3)


def test_an_uninterrupted_run_is_measured_at_the_same_steps():
    args = elastic.parse_args(["--no-record", "--fail-at", "50", "--replace-at", "90"])
    run = {"failure": None, "events": {"go": 0.0}, "workers": {"w0": _survivor(300, 0.0)}}
    f = elastic.measure(run, args)
    assert f["lost_after_failure_s"] == pytest.approx(0.0, abs=1e-9)
    assert f["lost_after_join_s"] == pytest.approx(0.0, abs=1e-9)
    assert "joiner_trains_s" not in f


def test_runs_saved_by_separate_commands_are_reported_as_one_table(tmp_path, capsys):
    # One command ran gossip_ext, another torchft, with the same settings: one table of both,
    # saying so, each system's own row.
    settings = vars(elastic.parse_args(["--no-record", "--fail-at", "50", "--replace-at", "90"]))
    settings = {k: v for k, v in settings.items() if k not in ("from_rows", "no_record")}
    paths = []
    for system in ("gossip", "torchft"):
        run = {
            "system": system,
            "seed": 0,
            "failure": None,
            "workers_started": 8,
            "events": {"go": 0.0},
            "workers": {"w0": _survivor(300, 0.0)},
        }
        path = tmp_path / f"{system}.json"
        saved = {"settings": settings | {"systems": [system]}, "runs": [run], "command": system}
        path.write_text(json.dumps(saved))
        paths.append(str(path))
    assert elastic.main(["--from-rows", *paths, "--no-record"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The rows come from 2 runs of the benchmark")
    assert "| gossip | uninterrupted" in out and "| torchft | uninterrupted" in out
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps({"settings": settings | {"systems": ["torchft"], "steps": 100}, "runs": []})
    )
    with pytest.raises(SystemExit, match="other settings"):
        elastic.main(["--from-rows", paths[0], str(other), "--no-record"])
