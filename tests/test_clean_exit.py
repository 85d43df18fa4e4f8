"""A finished worker exits 0 whether or not it called destroy_process_group(): the library's
threads and process groups are let go of before the interpreter finalizes. The workers exit as a
script does (tests/exiting_processes.py): an abort at exit, a stuck thread or a late error would
show as an exit status other than 0. An elastic worker that returns from its script leaves as
leave() does, the others going on without a timeout: tests/test_elastic.py's survivors test
ends each of its jobs (one per mode, a SIGKILL and a replacement each) that way.

How many: an abort of 1 worker exit in 8 passes the static jobs' 32 clean exits with probability
(7/8)^32 < 1.4%, and the elastic jobs' 32 (eight modes, four exits each) as rarely."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from exiting_processes import Parent  # noqa: E402

STATIC_JOBS = 4  # of each kind: with and without destroy_process_group()
WORKERS = 4
# The modes whose threads differ: the engine's rounds on the caller's thread, its progress
# thread (overlap), the outer steps' collectives, and Streaming DiLoCo's fragments in flight.
EXIT_MODES = ["sync", "overlap", "diloco_int8", "streaming_int8", "compressed"]


@pytest.fixture(scope="module")
def parent():
    parent = Parent()
    yield parent
    parent.close()


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
