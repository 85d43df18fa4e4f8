"""The suite's per-test time limit (pytest-timeout, `timeout` in pyproject.toml): a test that runs
past it fails, saying so, and the ranks it started are killed with it, not left running to hold
up the rest of the suite. Run on a test file of its own, in a pytest of its own, with a 3 s limit
instead of the suite's 60 s."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SLOW_TEST = """
import os, sys, time
sys.path.insert(0, {tests!r})
from multiprocess import run_ranks

PIDS = {pids!r}


def sleep_forever(rank, world_size):
    with open(PIDS, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    time.sleep(600)


def test_ranks_that_never_finish():
    run_ranks(2, sleep_forever)
"""


# The ranks' server started before any test, outside the 3 s: its imports (torch, torch._dynamo)
# take seconds of their own, and the limit is the test body's.
CONFTEST = """
import sys
sys.path.insert(0, {tests!r})
from multiprocessing import forkserver
from multiprocess import forkserver_context


def pytest_configure(config):
    forkserver_context()
    forkserver.ensure_running()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed rank whose parent (the forkserver) has not reaped it yet is a zombie: dead.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_suite_limits_each_test_to_60_seconds(request):
    assert float(request.config.getini("timeout")) == 60.0


def test_a_test_past_the_limit_fails_saying_so_and_its_ranks_are_killed(tmp_path):
    pids = tmp_path / "pids"
    (tmp_path / "test_slow.py").write_text(SLOW_TEST.format(tests=str(TESTS), pids=str(pids)))
    (tmp_path / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS)))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "test_slow.py", "-q", "-p", "no:cacheprovider",
         "--timeout=3", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert "Timeout (>3.0s) from pytest-timeout" in done.stdout, done.stdout[-3000:]
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2, started
    assert not [pid for pid in started if _alive(pid)], started
