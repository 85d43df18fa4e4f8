"""An elastic job as tests launch one: a membership service (python -m gossip_ext.membership) and
workers started each on its own (tests/elastic_worker.py), as a user starts them."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"
STEPS = 30
TIMEOUT_S = 10.0  # each worker's timeout: how long a stalled peer is waited for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A membership service and the workers of one job, in ``out``."""

    def __init__(self, out: Path):
        out.mkdir(exist_ok=True)
        self.out = out
        self.port = free_port()
        self.service = subprocess.Popen(
            [sys.executable, "-m", "gossip_ext.membership", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.service.stdout.readline()
        assert "membership service on" in line, line
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.out / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        self.workers[name] = subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
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
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
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
