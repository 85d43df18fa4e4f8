"""A finished worker exits 0 whether or not it called leave() or destroy_process_group(): the
library's threads and process groups are let go of before the interpreter finalizes, and an
elastic worker that returns from its script leaves as leave() does (the others go on without a
timeout). The workers exit as a script does (tests/exiting_processes.py): an abort at exit, a
stuck thread or a late error would show as an exit status other than 0.

How many: an abort of 1 worker exit in 8 passes five elastic jobs' 20 clean exits (one job per
exit mode) with probability (7/8)^20 < 7%, and the static jobs' 32 with (7/8)^32 < 1.4%.
GOSSIP_EXIT_JOBS=10 runs ten elastic jobs, 40 exits: (7/8)^40 < 0.5%, for a change to how a
worker exits."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import STEPS, TIMEOUT_S, Job  # noqa: E402
from exiting_processes import Parent  # noqa: E402

ELASTIC_JOBS = int(os.environ.get("GOSSIP_EXIT_JOBS", "5"))
STATIC_JOBS = 4  # of each kind: with and without destroy_process_group()
WORKERS = 4
MEMBER_STEPS = STEPS + 20  # the first workers' (_elastic_job)
# The modes whose threads differ: the engine's rounds on the caller's thread, its progress
# thread (overlap), the outer steps' collectives, and Streaming DiLoCo's fragments in flight.
EXIT_MODES = ["sync", "overlap", "diloco_int8", "streaming_int8", "compressed"]


@pytest.fixture(scope="module")
def parent():
    parent = Parent()
    yield parent
    parent.close()


def _elastic_job(parent: Parent, out: Path, mode: str) -> dict[str, int | None]:
    """Four workers, one SIGKILLed after step 10, a replacement started once a survivor passed
    step 12; no worker calls leave(). Returns each worker's exit status.

    The first workers run MEMBER_STEPS, past the replacement's STEPS: it must be in the job
    before they finish (a run saw them take the 18 steps after step 12 in 1.6 s while the
    replacement, forked on a loaded machine, registered later and waited out its timeout for
    members that had gone). The replacement, done first, leaves as a script's return does."""
    job = Job(out, launch=parent.start)
    try:
        for name in ("w0", "w1", "w2", "w3"):
            kill = ["--kill-at", "10"] if name == "w3" else []
            pace = ["--step-seconds", "0.05", "--steps", str(MEMBER_STEPS)]
            job.start(name, "--mode", mode, "--min-workers", "2", *pace, *kill)
        job.wait_for_step("w0", 12)
        job.start("w4", "--mode", mode, "--step-seconds", "0.05")
        job.wait()
        for name in ("w0", "w1", "w2", "w4"):
            result = job.result(name)
            assert result["error"] is None, (name, result["error"], job.log(name))
            # At or past the job's last step: a worker that joins or notices a change late goes
            # on from the most advanced member's count (tests/test_elastic.py bounds the jump).
            assert result["final_step"] >= STEPS, (name, result["final_step"])
            times = [s["time"] for s in result["steps"]]
            # No one waited out the timeout: not for the killed worker (its heartbeat stopped),
            # nor for the first to finish (it left as leave() leaves).
            gaps = [b - a for a, b in zip(times, times[1:])]
            assert max(gaps, default=0.0) < TIMEOUT_S / 2, (name, gaps)
        statuses = {name: process.returncode for name, process in job.workers.items()}
        for name, status in statuses.items():
            expected = -signal.SIGKILL if name == "w3" else 0
            assert status == expected, (mode, name, status, job.log(name))
        return statuses
    finally:
        job.close()


@pytest.mark.parametrize("job", range(ELASTIC_JOBS))
def test_elastic_workers_that_return_without_leave_exit_0(parent, tmp_path, job):
    _elastic_job(parent, tmp_path, EXIT_MODES[job % len(EXIT_MODES)])


def _static_job_exits_0(parent, tmp_path: Path, argv: list[str], mode: str) -> None:
    """Runs WORKERS static workers with ``argv``; each ends its work with a finite model and its
    interpreter exits 0."""
    workers = [
        parent.start("static_worker", [*argv, "--rank", str(rank)], tmp_path / f"rank{rank}.log")
        for rank in range(WORKERS)
    ]
    for rank, worker in enumerate(workers):
        status = worker.wait(timeout=50)
        log = (tmp_path / f"rank{rank}.log").read_text()[-3000:]
        assert (tmp_path / f"rank{rank}.done").read_text() == "finite=True\n", (mode, rank, log)
        assert status == 0, (mode, rank, status, log)


@pytest.mark.parametrize("job", range(STATIC_JOBS))
@pytest.mark.parametrize("destroy", [True, False], ids=["destroy_process_group", "no_destroy"])
def test_static_workers_exit_0_with_and_without_destroy_process_group(
    parent, tmp_path, destroy, job
):
    mode = EXIT_MODES[job % len(EXIT_MODES)]
    argv = ["--init-file", str(tmp_path / "init"), "--out", str(tmp_path)]
    argv += ["--world-size", str(WORKERS), "--mode", mode, *(["--destroy"] if destroy else [])]
    _static_job_exits_0(parent, tmp_path, argv, mode)


@pytest.mark.parametrize("destroy", [True, False], ids=["destroy_process_group", "no_destroy"])
def test_asynchronous_workers_exit_0_when_one_finishes_long_before_the_others(
    parent, tmp_path, destroy
):
    # AsyncSGP: rank 0 takes 3 steps and its interpreter exits while the others take 40, with no
    # barrier. Its engine, dropped when main() returns, says it left before its connections
    # close and ends its threads (a thread inside gloo when the interpreter finalizes aborts
    # it), so the others, which send to it and hear from it, go on without an error.
    argv = ["--init-file", str(tmp_path / "init"), "--out", str(tmp_path), "--mode", "async"]
    argv += ["--world-size", str(WORKERS), "--steps", "40", "--rank0-steps", "3"]
    argv += ["--destroy"] if destroy else []
    _static_job_exits_0(parent, tmp_path, argv, "async")
