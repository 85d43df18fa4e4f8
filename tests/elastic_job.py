"""An elastic job as tests launch one: a membership service (python -m gossip_ext.membership) and
workers started each on its own (tests/membership_worker.py), as a user starts them.

Each worker is a process of its own, with no launcher between the workers: they meet only through
the membership service, and the tests kill, stop and resume them by signal. The service and
the workers are forked from the tests' forkserver (tests/multiprocess.py), which imported torch
and gossip_ext once, rather than started as fresh interpreters: with seven workers and two
services a test, the imports were a third of the elastic tests' time on two cores."""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiprocess import forkserver_context

STEPS = 30
TIMEOUT_S = 10.0  # each worker's timeout: how long a stalled peer is waited for
# The membership's timings of the tests' jobs (Elastic(heartbeat_s=..., silent_s=...)), as the
# workers' arguments: the defaults. Five beats confirm a SIGKILLed neighbour (0.5 s); a silence
# of 0.8 s removed live workers, whose threads a loaded 2-core machine (load average 5 to 7, the
# suite beside other work) did not run for that long, three times in one run of this suite's
# elastic tests, and 1.5 s once in many: the silence cannot be shorter here.
HEARTBEAT_S = 0.1
SILENT_S = 1.5
TIMINGS = ("--heartbeat-s", str(HEARTBEAT_S), "--silent-s", str(SILENT_S))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_main(module: str, argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """A forked process's body: ``module``'s main() with argv as its command line and ``env``
    added to its environment (the forkserver's, not the test's), its output to log_path."""
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [module, *argv]
    sys.exit(importlib.import_module(module).main())


class ForkedProcess:
    """``python -m MODULE ARGV...`` forked from the forkserver, with the part of subprocess.Popen's
    interface the tests use: returncode (negative: the signal that ended it), poll, wait,
    send_signal, kill."""

    def __init__(
        self, module: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        log_path.touch()  # there to be read at once
        # Daemonic: one the tests left running ends with them instead of holding up their exit.
        self._process = forkserver_context().Process(
            target=_run_main, args=(module, argv, str(log_path), env or {}), daemon=True
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self._process.kill()


class Job:
    """A membership service and the workers of one job, in ``out``. Workers are forked from the
    forkserver, or by ``launch`` (tests/exiting_processes.py's, for processes that must exit as a
    script does)."""

    def __init__(
        self,
        out: Path,
        launch=ForkedProcess,
        env: dict[str, str] | None = None,
        timings: tuple[str, ...] = TIMINGS,
    ):
        out.mkdir(exist_ok=True)
        self.out = out
        self.port = free_port()
        # The service's and every forked worker's (a job secret: GOSSIP_EXT_JOB_SECRET_FILE).
        self.env = env or {}
        self.service = ForkedProcess(
            "gossip_ext.membership", ["--port", str(self.port)], out / "service.log", self.env
        )
        self._launch = launch
        self.timings = timings  # every worker's (a sharded replica keeps the defaults: none)
        self.workers: dict[str, ForkedProcess | subprocess.Popen] = {}
        end = time.monotonic() + 30.0
        while "membership service on" not in (out / "service.log").read_text():
            if time.monotonic() > end or self.service.poll() is not None:
                self.close()
                pytest.fail(f"no membership service:\n{(out / 'service.log').read_text()}")
            time.sleep(0.02)

    def start(self, name: str, *args: str, script: str = "membership_worker") -> ForkedProcess:
        """Starts worker ``name``: tests/``script``.py with the job's arguments and ``args``."""
        self.workers[name] = self._launch(
            # Named apart from benchmarks/elastic_worker.py, which test_elastic_benchmark.py puts
            # first on sys.path: a worker imports its module by name.
            script,
            [
                "--membership",
                f"127.0.0.1:{self.port}",
                "--out",
                str(self.out),
                "--name",
                name,
                "--steps",
                str(STEPS),
                "--timeout",
                str(TIMEOUT_S),
                *self.timings,
                *args,
            ],
            self.out / f"{name}.log",
            **({"env": self.env} if self.env else {}),
        )
        return self.workers[name]

    def wait(self, deadline_s: float = 120.0) -> None:
        end = time.monotonic() + deadline_s
        for name, process in self.workers.items():
            try:
                process.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still running after {deadline_s} s:\n{self.log(name)}")

    def result(self, name: str) -> dict:
        path = self.out / f"{name}.pkl"
        assert path.exists(), f"{name} wrote no result:\n{self.log(name)}"
        with open(path, "rb") as f:
            return pickle.load(f)

    def wait_for_step(self, name: str, step: int, deadline_s: float = 60.0) -> dict:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            path = self.out / f"{name}.pkl"
            if path.exists():
                result = self.result(name)
                if result["steps"] and result["steps"][-1]["step"] >= step:
                    return result
            time.sleep(0.05)
        pytest.fail(f"{name} did not reach step {step}:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.out / f"{name}.log").read_text()[-4000:]

    def close(self) -> None:
        for process in [*self.workers.values(), self.service]:
            if process.poll() is None:
                process.kill()
                process.wait()
