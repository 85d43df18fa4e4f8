"""One worker of a run on a cluster whose workers do not all compute at the same pace: the
comparison's task and systems (``worker``, ``systems``), with one worker made slower, or stalled
now and then, and every worker on its own clock.

The slow worker is slowed honestly, as a slower device would be: before training, every worker
times a few forward and backward passes of the model at once (the compute a step needs with the
machine shared as in training); after each step the slow worker sleeps ``slowdown - 1`` times its
own median, so its step takes ``slowdown`` times the compute and the other workers' CPU is
untouched. The ``alone`` system measures what that gives: the slow worker's step at ``slowdown``
times the others'. A stalled worker is stopped whole (SIGSTOP, its communication threads too) for
1 to 3 seconds at random times by a process of its own (``staller``), as a machine that stalls.

Nothing during training waits for a collective the system does not make itself: each worker
evaluates its own model every ``eval_every`` of its own steps, off its own clock, and the workers
meet only after the last step, to hand their records to rank 0. A comparison's evaluation, an
all-reduce at every worker's ``eval_every``-th step, would otherwise hold asynchronous workers
to the slowest one's pace.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.compare import systems, worker
from harness.tasks import byte_lm
from harness.tasks.byte_lm import ByteLM
from harness.tasks.stdlib_text import StdlibText

CALIBRATION_STEPS = 8


@dataclasses.dataclass(frozen=True)
class UnevenRun:
    """``run`` with worker ``slow_rank`` (None: none) computing at 1 / ``slowdown`` the pace."""

    run: worker.RunConfig
    slow_rank: int | None = None
    slowdown: float = 2.0
    # Worker stall_rank (None: none) is stopped for 1 to 3 s at random times, about
    # stall_fraction of the run in all (harness.compare.staller).
    stall_rank: int | None = None
    stall_fraction: float = 0.05
    # Worker slow_link_rank (None: none) sits behind a slower NIC, which the emulated cluster
    # sets (runner.run's ``rates``); here it is only reported as the odd one.
    slow_link_rank: int | None = None

    @property
    def system(self) -> str:
        return self.run.system

    def with_lighthouse(self, address: str) -> UnevenRun:
        return dataclasses.replace(self, run=self.run.with_lighthouse(address))


def train(rank: int, world_size: int, init_method: str, config: UnevenRun) -> dict:
    """Runs ``config`` on this worker; rank 0's result holds every worker's record."""
    torch.set_num_threads(config.run.threads)
    warnings.filterwarnings("ignore", message=".*one gossiping process.*")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    try:
        return _train(rank, world_size, config)
    finally:
        dist.destroy_process_group()


def _compute_seconds(module: torch.nn.Module, data: StdlibText, run: worker.RunConfig, rank: int):
    """The median time of a forward and backward pass of ``module``'s copy on this worker."""
    twin = copy.deepcopy(module)
    times = []
    for step in range(CALIBRATION_STEPS + 2):
        inputs, targets = data.batch(step, rank, run.batch_size, run.model.context, run.seed)
        begin = time.perf_counter()
        byte_lm.next_byte_loss(twin, inputs, targets).backward()
        times.append(time.perf_counter() - begin)
    return statistics.median(times[2:])


def _start_staller(fraction: float, seed: int) -> subprocess.Popen:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.compare.staller",
            str(os.getpid()),
            str(fraction),
            str(seed),
        ],
        env=dict(os.environ, PYTHONPATH=path),
    )


def _stop(staller: subprocess.Popen | None) -> None:
    """Ends the staller, which continues this process if it had stopped it."""
    if staller is not None and staller.poll() is None:
        staller.terminate()
        staller.wait()


def _train(rank: int, world_size: int, config: UnevenRun) -> dict:
    run = config.run
    data = StdlibText.load()
    windows = data.heldout_windows(run.model.context, run.eval_windows)
    torch.manual_seed(run.seed)
    module = ByteLM(run.model)
    dist.barrier()  # every worker calibrates at once, sharing the machine as in training
    compute = _compute_seconds(module, data, run, rank)
    slow = rank == config.slow_rank
    extra = (config.slowdown - 1.0) * compute if slow else 0.0
    system = systems.make(run.system, module, run.recipe, run.lighthouse)
    steps = run.recipe.steps
    step_times: list[float] = []
    evaluations: list[tuple[float, int, float]] = []  # (own clock, step, held-out bpb)
    paused = 0.0
    staller = None
    try:
        dist.barrier()
        if rank == config.stall_rank:
            staller = _start_staller(config.stall_fraction, run.seed + rank)
        start = time.perf_counter()
        for step in range(steps):
            inputs, targets = data.batch(step, rank, run.batch_size, run.model.context, run.seed)
            system.train_step(inputs, targets)
            if extra:
                time.sleep(extra)  # the rest of a slower device's step
            step_times.append(time.perf_counter() - start - paused)
            if (step + 1) % run.eval_every == 0 or step + 1 == steps:
                if step + 1 == steps:
                    system.finish()
                sampled = time.perf_counter()
                bpb = byte_lm.heldout_bits_per_byte(system.module, windows)
                evaluations.append((step_times[-1], step + 1, bpb))
                paused += time.perf_counter() - sampled
        _stop(staller)
        record = {
            "rank": rank,
            "slow": slow or rank in (config.stall_rank, config.slow_link_rank),
            "compute_ms": 1000 * compute,
            "extra_ms": 1000 * extra,
            "step_times": step_times,
            "evaluations": evaluations,
            "gossip": system.gossip_statistics(),
        }
        records: list[dict | None] = [None] * world_size
        dist.all_gather_object(records, record)
    finally:
        _stop(staller)
        system.close()
    return {
        "system": run.system,
        "workers": world_size,
        "params": sum(p.numel() for p in module.parameters()),
        "lr": run.recipe.lr,
        "slow_rank": config.slow_rank,
        "slowdown": config.slowdown,
        "records": records,
    }
