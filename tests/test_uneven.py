"""The heterogeneous cluster's harness: what its measures give on records made by hand, and a
real run whose slow worker steps at the pace asked for while the others keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from multiprocess import run_ranks  # noqa: F401  (the forkserver's preload, as other tests)

from harness.compare import runner, systems, worker
from harness.compare import uneven_report as measure
from harness.compare.uneven import UnevenRun
from harness.tasks.byte_lm import ByteLMConfig


def _record(rank, step_s, steps, evaluations, slow=False):
    return {
        "rank": rank,
        "slow": slow,
        "step_times": [step_s * (i + 1) for i in range(steps)],
        "evaluations": evaluations,
    }


def test_quality_at_a_time_is_the_mean_of_each_worker_s_latest_evaluation():
    records = [
        _record(0, 0.1, 20, [(1.0, 10, 4.0), (2.0, 20, 2.0)]),
        _record(1, 0.2, 10, [(1.5, 5, 3.0)]),
    ]
    # At 1.0 s worker 1 has no evaluation yet: the curve starts when both have one.
    assert measure.curve(records) == [(1.5, 3.5), (2.0, 2.5)]
    assert measure.time_to(records, 3.5) == 1.5
    assert measure.time_to(records, 3.0) == pytest.approx(1.75)  # halfway from 3.5 to 2.5
    assert measure.time_to(records, 2.5) == 2.0
    assert measure.time_to(records, 2.0) is None
    assert measure.final(records) == 2.5


def test_goodput_counts_the_steps_taken_against_those_the_workers_could_take_alone():
    alone = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.2}
    # Lockstep at the slow worker's pace: 2 / 3.5 of what they could do alone.
    lockstep = [_record(r, 0.2, 10, [], slow=r == 3) for r in range(4)]
    assert measure.goodput(lockstep, alone) == pytest.approx(4 * 10 / (3 * 20 + 10))
    # Each at its own pace: every step counts.
    own = [_record(r, 0.1, 20, []) for r in range(3)] + [_record(3, 0.2, 10, [], slow=True)]
    assert measure.goodput(own, alone) == pytest.approx(1.0)
    assert measure.step_ms(own, slow=True) == pytest.approx(200.0)
    assert measure.step_ms(own, slow=False) == pytest.approx(100.0)


def test_a_repeated_system_is_reported_by_the_median_of_its_runs():
    def run(crossing):  # one worker's run whose loss crosses 3.0 at ``crossing`` seconds
        return [_record(0, 0.1, 50, [(crossing - 1.0, 10, 4.0), (crossing, 20, 3.0)])]

    never = [_record(0, 0.1, 50, [(1.0, 10, 4.0), (5.0, 50, 3.5)])]
    result = {"records": run(2.0), "repeats": [run(4.0), run(3.0)]}
    assert measure.median_time_to(result, 3.0) == 3.0
    assert measure.median_final(result) == 3.0
    assert measure.label("async_sgp", result) == "async_sgp (median of 3 runs)"
    # A run that never reached the target counts as the latest: one of three leaves the median
    # at the slower of the others; two of three, none.
    assert measure.median_time_to({"records": never, "repeats": [run(2.0), run(4.0)]}, 3.0) == 4.0
    assert measure.median_time_to({"records": never, "repeats": [never, run(2.0)]}, 3.0) is None
    # A system run once is its run.
    assert measure.median_time_to({"records": run(2.0)}, 3.0) == 2.0
    assert measure.label("ddp", {"records": run(2.0)}) == "ddp"
    alone = {0: 0.1}
    slower = [_record(0, 0.2, 25, [])]
    goodputs = {"records": slower, "repeats": [run(2.0), slower]}
    assert measure.median_goodput(goodputs, alone) == pytest.approx(0.5)


def test_alone_s_step_time_is_taken_while_every_worker_still_steps():
    # Worker 1 sped up once worker 0 had finished and left it the machine.
    records = [_record(0, 0.1, 10, []), _record(1, 0.1, 10, [])]
    records[1]["step_times"] += [1.0 + 0.05 * i for i in range(1, 11)]
    assert measure.alone_step_seconds(records) == pytest.approx({0: 0.1, 1: 0.1})


TINY = ByteLMConfig(layers=1, width=32, heads=2, context=16)


@pytest.mark.parametrize("system", ["alone", "async_sgp_int8"])
def test_the_slow_worker_steps_at_the_pace_asked_and_the_others_keep_theirs(system):
    run = worker.RunConfig(
        system=system,
        recipe=systems.Recipe(steps=12, warmup=2),
        model=TINY,
        batch_size=4,
        eval_every=6,
        eval_windows=4,
    )
    result = runner.run_local(
        UnevenRun(run, slow_rank=1, slowdown=9.0),
        workers=2,
        start_method="forkserver",
        target="harness.compare.uneven:train",
    )
    fast, slow = result["records"]
    assert slow["slow"] and not fast["slow"]
    assert slow["extra_ms"] == pytest.approx(8 * slow["compute_ms"])
    # The slow worker's steps took its compute and eight times it more (a tiny model's step is
    # mostly the optimizer and Python, which the calibration leaves out); the fast one did not
    # wait out those sleeps.
    sleeps = 12 * slow["extra_ms"] / 1000
    assert slow["step_times"][-1] > sleeps
    assert fast["step_times"][-1] < slow["step_times"][-1] - 0.8 * sleeps, (fast, slow)
    assert [e[1] for e in fast["evaluations"]] == [6, 12]
    assert all(0 < bpb < 9 for _, _, bpb in fast["evaluations"] + slow["evaluations"])


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_staller_stops_a_process_and_never_leaves_it_stopped():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    staller = subprocess.Popen(
        [sys.executable, "-m", "harness.compare.staller", str(sleeper.pid), "0.9", "1"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        deadline = time.monotonic() + 10
        while _state(sleeper.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(sleeper.pid) == "T"  # stopped
        staller.terminate()  # while it holds the sleeper stopped: it continues it on its way out
        staller.wait(timeout=10)
        assert _state(sleeper.pid) != "T"
    finally:
        staller.kill()
        sleeper.kill()
        sleeper.wait()


def test_the_asynchronous_engine_s_goals_are_read_from_the_medians():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import heterogeneous

    def crossing(seconds):  # a run whose loss crosses 3.0 at ``seconds``
        return {"records": [_record(0, 0.1, 50, [(seconds - 1.0, 10, 4.0), (seconds, 20, 3.0)])]}

    rows = {
        "uniform": {
            "alone": crossing(10.0),
            "overlap_sgp_int8": crossing(12.0),
            "async_sgp_int8": crossing(11.0),
        },
        # The workers alone take 1.5x; AsyncSGP 16 / 11 = 1.45x, within 1.05 * 1.5x.
        "slow": {"alone": crossing(15.0), "async_sgp_int8": crossing(16.0)},
        "slow_nic": {"async_sgp_int8": crossing(14.0)},  # 1.27x: over 1.17x
    }
    said = heterogeneous.engine_goals(rows, 3.0)
    assert said == [
        "Uniform cluster, async_sgp_int8 at most overlap_sgp_int8's time: 11.0 s against 12.0 s, "
        "met.",
        "One worker at half speed, async_sgp_int8's ratio at most 1.05x the workers alone's "
        "(1.50x): 1.45x, met.",
        "Behind the slow link, async_sgp_int8 at most 1.17x its uniform time: 1.27x, missed.",
    ]
    # A cluster not run says nothing.
    assert heterogeneous.engine_goals({"uniform": rows["uniform"]}, 3.0) == said[:1]
