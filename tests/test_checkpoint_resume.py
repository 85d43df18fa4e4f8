"""Checkpoint and resume under torchrun: save at step k on every rank, kill every process, restart
from the files, and the trajectory from step k on equals an uninterrupted run's, bit for bit.

Three launches of tests/checkpoint_worker.py at world size 4 (gloo, CPU), each training three
models side by side: synchronous SGP, overlap SGP, and synchronous SGP with per-rank mixing weights
(so that the push-sum weight is not 1 and the checkpoint must restore it):
    reference   STEPS steps without interruption
    killed      checkpoints after step SAVE_AT on every rank; then torchrun and every worker are
                killed with SIGKILL
    resumed     a fresh torchrun that loads the checkpoints and runs steps SAVE_AT + 1 to STEPS

The comparison is exact, not to a tolerance: both runs do the same floating-point operations in
the same order on the same data (one intra-op thread, received messages summed in the schedule's
fixed in-peer order, gloo only moves bytes), so nothing can round differently.

What a checkpoint does to the training it interrupts: ``state_dict()`` first absorbs the round
started at step k (``sync_comms``).
    synchronous   the forward of step k + 1 would absorb that round anyway, and nothing in
                  between touches the parameters: checkpointing leaves the trajectory unchanged,
                  so the reference does not checkpoint at all.
    overlap       the round would have been absorbed by step k + 1's ``transfer_params()``, after
                  step k + 1's optimizer update (the kept share is w * z_current); absorbed at the
                  checkpoint, it lands before that update instead. A checkpoint at step k thus
                  changes the overlap trajectory from step k + 1 on (by about 1e-2 here, far above
                  rounding), whether or not the run is then killed. The reference is therefore
                  the run a user who checkpoints gets: it saves at step k too and goes on.
                  Resuming then continues it exactly, and both runs save the same checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

WORLD_SIZE = 4
STEPS = 12
# Odd: the default graph at n = 4 alternates two peers, so a resume that forgot the gossip
# round (restarting at round 0) would gossip with the wrong peer.
SAVE_AT = 5
MODES = ("sync", "overlap", "weighted")
WORKER = Path(__file__).resolve().with_name("checkpoint_worker.py")
# Hard wall-clock limit on the three launches together (each takes 15-30 s on two loaded cores).
DEADLINE_S = 300.0


@dataclass
class _Launch:
    """One torchrun and the folder its workers write to."""

    process: subprocess.Popen
    out: Path

    @property
    def log(self) -> str:
        return (self.out / "torchrun.log").read_text()[-6000:]

    def worker_pids(self) -> list[int]:
        """Its workers still alive (torchrun starts each in its own session, so killing
        torchrun's process group would not reach them)."""
        pids = []
        for path in self.out.glob("pid-rank*"):
            pid = int(path.read_text())
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue
            # The pid may have been reused since: only our own worker, and not a zombie.
            if str(WORKER) in cmdline and str(self.out) in cmdline and state != "Z":
                pids.append(pid)
        return pids

    def kill_all(self) -> None:
        """SIGKILL torchrun and every worker, and wait until they are gone."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        end = time.monotonic() + 30.0
        while self.worker_pids() and time.monotonic() < end:
            time.sleep(0.1)

    def wait(self, deadline: float) -> None:
        try:
            self.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"torchrun writing to {self.out} ran past the deadline:\n{self.log}")
        assert self.process.returncode == 0, (
            f"torchrun exited with {self.process.returncode}:\n{self.log}"
        )


def _torchrun(out: Path, *worker_args: str) -> _Launch:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={WORLD_SIZE}", str(WORKER), "--out", str(out)]
    command += ["--steps", str(STEPS), *worker_args]
    with open(out / "torchrun.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return _Launch(process, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoint_resume")
    dirs = {name: root / name for name in ("reference", "killed", "resumed")}
    deadline = time.monotonic() + DEADLINE_S
    launches = []
    try:
        # The reference and the run to be killed are independent: run them side by side.
        reference = _torchrun(
            dirs["reference"], "--save-at", str(SAVE_AT), "--save-modes", "overlap"
        )
        launches.append(reference)
        killed = _torchrun(dirs["killed"], "--save-at", str(SAVE_AT), "--wait-for-kill")
        launches.append(killed)
        saved = [dirs["killed"] / f"saved-rank{r}" for r in range(WORLD_SIZE)]
        while not all(p.exists() for p in saved):
            if killed.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run to be killed never checkpointed:\n{killed.log}")
            time.sleep(0.1)
        killed.kill_all()
        assert killed.process.returncode == -signal.SIGKILL
        assert not killed.worker_pids(), "a worker survived SIGKILL"
        # Killed before the end: no worker got as far as writing its log.
        assert not list(dirs["killed"].glob("*-rank*.pt")), "the run finished before the kill"

        resumed = _torchrun(dirs["resumed"], "--resume-from", str(dirs["killed"] / "ckpt"))
        launches.append(resumed)
        reference.wait(deadline)
        resumed.wait(deadline)
    finally:
        for launch in launches:
            if launch.process.poll() is None:
                launch.kill_all()
    return dirs


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


# The first test carries the three launches (torchrun and four workers each, every one importing
# torch, the killed run's and the reference's side by side, then the resumed run's).
_LAUNCHES = "three torchrun launches of four workers: a reference, a run killed whole, its resume"


@pytest.mark.parametrize(
    "mode", [pytest.param(MODES[0], marks=pytest.mark.slow(_LAUNCHES)), *MODES[1:]]
)
def test_resume_after_killing_every_rank_continues_the_uninterrupted_trajectory(runs, mode):
    for rank in range(WORLD_SIZE):
        reference = _load(runs["reference"] / f"{mode}-rank{rank}.pt")
        resumed = _load(runs["resumed"] / f"{mode}-rank{rank}.pt")
        assert reference["steps"] == list(range(1, STEPS + 1))
        assert resumed["steps"] == list(range(SAVE_AT + 1, STEPS + 1))
        expected = reference["params"][SAVE_AT:]
        for step, want, got in zip(resumed["steps"], expected, resumed["params"]):
            assert torch.equal(got, want), (
                f"{mode}, rank {rank}, step {step}: max difference {(got - want).abs().max()}"
            )
        # The last round too, absorbed by sync_comms() after the last step.
        assert torch.equal(resumed["final"], reference["final"]), (mode, rank)
        # Not vacuous: every step moves the parameters.
        assert (reference["params"].diff(dim=0).abs().amax(dim=1) > 0).all(), (mode, rank)
    # ...and the ranks really differ (each trains its own task), so gossip has work to do.
    params = [_load(runs["reference"] / f"{mode}-rank{r}.pt")["params"] for r in range(WORLD_SIZE)]
    assert not torch.equal(params[0][SAVE_AT], params[1][SAVE_AT])


def test_a_killed_overlap_run_saved_the_same_checkpoint_as_the_uninterrupted_one(runs):
    for rank in range(WORLD_SIZE):
        reference = _load(runs["reference"] / "ckpt" / f"overlap-rank{rank}.pt")
        killed = _load(runs["killed"] / "ckpt" / f"overlap-rank{rank}.pt")
        assert reference["step"] == killed["step"] == SAVE_AT
        assert reference["model"].keys() == killed["model"].keys()
        for key, value in reference["model"].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, killed["model"][key]), (rank, key)
            else:
                assert value == killed["model"][key], (rank, key)
        extra = reference["model"]["_extra_state"]
        assert extra["gossip_round"] == SAVE_AT and extra["gossip_world_size"] == WORLD_SIZE


def test_the_weighted_checkpoint_carries_a_push_sum_weight_other_than_one(runs):
    # Otherwise the weighted mode would not test that resuming restores the weight.
    weights = [
        _load(runs["killed"] / "ckpt" / f"weighted-rank{r}.pt")["model"]["_extra_state"][
            "ps_weight"
        ]
        for r in range(WORLD_SIZE)
    ]
    assert all(w != 1.0 for w in weights), weights
