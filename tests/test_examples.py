"""The training scripts of examples/, launched as the guides launch them (docs/algorithms.md,
docs/elastic.md), so that they cannot rot: under torchrun, and an elastic job's workers each on
its own."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from elastic_job import Job
from multiprocess import run_ranks
from torchrun import failure_report, torchrun

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHANCE = 0.25  # four classes


def _accuracy(output: str) -> float:
    return float(re.search(r"accuracy (\d\.\d+)", output).group(1))


def test_train_py_under_torchrun_learns_and_reports(tmp_path):
    done = torchrun(2, EXAMPLES / "train.py", "--mode", "sgp", "--steps", "100", cwd=tmp_path,
                    timeout=300)  # fmt: skip
    assert done.returncode == 0, failure_report(done)
    assert "relative consensus distance" in done.stdout, done.stdout
    assert _accuracy(done.stdout) > 2 * CHANCE, done.stdout


def _train_py(rank: int, world_size: int, argv: list[str]) -> str:
    """examples/train.py's training in a rank of this suite's own process group (what its main()
    does after torchrun's set-up), its printed report returned."""
    sys.path.insert(0, str(EXAMPLES))
    import train

    torch.set_num_threads(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train.train(train.parse_args(argv), torch.device("cpu"))
    return printed.getvalue()


# The headline's modes, as the README and docs/algorithms.md name them.
HEADLINE_MODES = [
    ["--mode", "overlap", "--message-dtype", "int8"],
    ["--mode", "overlap", "--message-dtype", "float8"],
    ["--mode", "diloco", "--message-dtype", "int8"],
    ["--mode", "streaming"],
    ["--mode", "sparseloco"],
]


@pytest.mark.parametrize("mode", HEADLINE_MODES, ids=lambda mode: "-".join(mode[1::2]))
def test_train_py_runs_every_mode_the_headline_names(mode):
    output = run_ranks(2, _train_py, [*mode, "--steps", "100"])[0]
    assert f"mode={mode[1]}" in output, output
    assert "relative consensus distance" in output, output
    assert _accuracy(output) > 2 * CHANCE, output


@pytest.mark.slow(
    "four workers as a user starts them, each a fresh interpreter importing torch, 400 steps "
    "paced at 20 ms so that the replacement joins while they train"
)
def test_elastic_train_py_goes_on_after_a_kill_and_takes_in_a_replacement(tmp_path):
    job = Job(tmp_path)  # the membership service; its close() ends every worker left

    def start(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        job.workers[name] = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "elastic_train.py"), "--membership",
             f"127.0.0.1:{job.port}", "--steps", "400", "--step-seconds", "0.02",
             "--log-interval", "100", "--timeout", "20"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        return job.workers[name]

    try:
        for name in ("a", "b", "c"):
            start(name)
        deadline = time.monotonic() + 120
        while "step 100 " not in job.log("a"):
            assert time.monotonic() < deadline, job.log("a")
            time.sleep(0.1)
        job.workers["c"].kill()
        start("d")  # a replacement, from a live member's state
        for name in ("a", "b", "d"):
            assert job.workers[name].wait(timeout=120) == 0, job.log(name)
            log = job.log(name)
            assert "finished step 400" in log, log
            assert _accuracy(log) > 2 * CHANCE, log
        joined_at = int(re.search(r"from step (\d+)", job.log("d")).group(1))
        assert joined_at >= 100, job.log("d")  # the donor's step count, not 0
        changes = re.findall(r"left \[([\d, ]*)\], joined \[([\d, ]*)\]", job.log("a"))
        assert any(left for left, _ in changes) and any(joined for _, joined in changes), changes
    finally:
        job.close()
