"""Soak loops: many gossip rounds in a row, watching memory, the push-sum weights and hangs.

Shared by benchmarks/soak.py (the long runs: 10,000 in-process rounds, 2,000 gloo steps) and
tests/test_soak.py (the short version CI runs). Two loops:

- :func:`soak_inproc`: ``world_size`` engines over the in-process transport, one Python thread
  per rank driving its ``_C.GossipEngine`` (``start_round``; ``finish_round``). Every
  ``check_every`` rounds the threads meet at a barrier, and with every rank idle the barrier's
  action reads each rank's push-sum weight and numerators (exact state: nothing is in flight)
  and the process's resident set.
- :func:`soak_gloo`: ``world_size`` real processes train a small model with
  GossipDataParallel over gloo. Every ``check_every`` steps each rank absorbs its round
  (``sync_comms``), samples its own resident set and all-reduces its push-sum weight.

Both use per-rank :class:`gossip_ext.SelfWeightMixing` by default, so the weights move away from
1 and travel with every message (uniform mixing on these regular graphs would keep every weight
at exactly 1). Both are bounded in wall-clock time: the engines time out waiting for a peer, and
the threads or processes are joined against a deadline, so a deadlock raises instead of hanging.
"""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocess import exit_without_finalizing
from torch import nn

import gossip_ext
from gossip_ext._torch_check import _C

WORLD_SIZE = 4
# |sum of push-sum weights - n| and |mean numerator - initial mean|, by the weight's dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}

# gloo configurations: GossipDataParallel keyword arguments and the parameters' dtype.
GLOO_MODES = {
    "sync SGP": ({}, torch.float32),
    "overlap SGP": ({"overlap": True}, torch.float32),
    "bounded async (synch_freq=2)": ({"synch_freq": 2}, torch.float32),
    "sync SGP fp64": ({}, torch.float64),
}


def rss_mib() -> float:
    """This process's resident set size (VmRSS of /proc/self/status), in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("VmRSS not found in /proc/self/status")


def self_weight(rank: int) -> float:
    """A different kept share per rank: column- but not row-stochastic mixing moves the weights."""
    return 0.2 + 0.15 * rank


@dataclass
class SoakRun:
    """What one soak configuration measured.

    ``rss`` holds, per process (one for the in-process transport, one per rank over gloo), the
    samples ``(round or step, MiB)`` taken from the end of the warm-up on; the first is the
    baseline.
    """

    name: str
    dtype: torch.dtype
    world_size: int
    rounds: int  # gossip rounds every rank completed
    expected_rounds: int
    wall_s: float
    warmup: int
    rss: list[list[tuple[int, float]]]
    weight_sum_error: float  # max over the checks of |sum of weights - world_size|
    final_weights: list[float]
    weights_should_move: bool
    checks: int
    mass_error: float | None = None  # in-process: max |mean numerator - initial mean|
    consensus_error: float | None = None  # in-process: max |z - initial mean| at the end
    inconsistencies: list[str] = field(default_factory=list)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]

    def rss_growth_mib(self) -> list[float]:
        """Per process: the largest sample after the warm-up minus the baseline."""
        return [max(m for _, m in samples) - samples[0][1] for samples in self.rss]

    def problems(self, rss_bound_mib: float) -> list[str]:
        """What breaks the soak's contract; empty when it holds."""
        found = [f"{self.name}: {text}" for text in self.inconsistencies]
        if self.rounds != self.expected_rounds:
            found.append(f"{self.name}: {self.rounds} rounds done, {self.expected_rounds} expected")
        for proc, (growth, samples) in enumerate(zip(self.rss_growth_mib(), self.rss)):
            if growth > rss_bound_mib:
                trace = ", ".join(f"{t}: {m:.1f}" for t, m in samples)
                found.append(
                    f"{self.name}: RSS of process {proc} grew by {growth:.2f} MiB after the "
                    f"warm-up (bound {rss_bound_mib} MiB); samples (round: MiB) {trace}"
                )
        if not self.weight_sum_error <= self.tolerance:
            found.append(
                f"{self.name}: sum of push-sum weights is off by {self.weight_sum_error:.3e} "
                f"(tolerance {self.tolerance:g}); final weights {self.final_weights}"
            )
        if self.mass_error is not None and not self.mass_error <= self.tolerance:
            found.append(
                f"{self.name}: mean of the numerators drifted by {self.mass_error:.3e} "
                f"(tolerance {self.tolerance:g})"
            )
        if self.consensus_error is not None and not self.consensus_error <= self.tolerance:
            found.append(
                f"{self.name}: the de-biased values ended {self.consensus_error:.3e} away from "
                f"the initial mean (tolerance {self.tolerance:g})"
            )
        if self.weights_should_move and all(abs(w - 1.0) < 1e-3 for w in self.final_weights):
            found.append(f"{self.name}: the weights never moved from 1: {self.final_weights}")
        if self.checks < 2:
            found.append(f"{self.name}: only {self.checks} check(s) after the warm-up")
        return found


def _check_counts(rounds: int, check_every: int, warmup: int, what: str) -> None:
    for name, value in ((what, rounds), ("check_every", check_every), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    if not 0 <= warmup <= rounds - 2 * check_every:
        raise ValueError(
            f"warmup must leave at least two checks: 0 <= warmup <= {what} - 2 * check_every "
            f"= {rounds - 2 * check_every}, got warmup={warmup} ({what}={rounds}, "
            f"check_every={check_every})"
        )


# ----------------------------------------------------------------------------- in-process


def soak_inproc(
    rounds: int,
    dtype: torch.dtype,
    *,
    uniform: bool = False,
    world_size: int = WORLD_SIZE,
    numel: int = 4096,
    check_every: int = 100,
    warmup: int = 500,
    timeout_s: float = 60.0,
) -> SoakRun:
    """Runs ``rounds`` pure gossip rounds among ``world_size`` engines of the in-process transport.

    Args:
        rounds (int): gossip rounds per rank.
        dtype (torch.dtype): dtype of the parameters (float32 or float64); the push-sum weight
            is float64 for float64 parameters, float32 otherwise.
        uniform (bool): uniform mixing (lazy: weights stay 1, parameters sent in place, as
            :func:`gossip_ext.simulate` runs) instead of per-rank self weights (default: False).
        world_size (int): ranks, one thread each (default: 4).
        numel (int): parameters per rank (default: 4096).
        check_every (int): rounds between checks of weights, numerators and RSS (default: 100).
        warmup (int): rounds before the RSS baseline (default: 500).
        timeout_s (float): how long a rank waits for a message; the whole run may take twice
            that plus 1 ms per round and rank before it counts as a deadlock (default: 60).
    """
    _check_counts(rounds, check_every, warmup, "rounds")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
    mixings = [
        gossip_ext.UniformMixing() if uniform else gossip_ext.SelfWeightMixing(self_weight(r))
        for r in range(world_size)
    ]
    initial = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(0)).to(dtype)
    initial_mean = initial.double().mean(0)
    hub = _C.InProcHub(world_size)
    params = [initial[r].clone() for r in range(world_size)]
    engines = [
        _C.GossipEngine(
            [params[r]],
            [f"rank{r}"],
            _C.InProcTransport(hub, r),
            _C.EngineOptions(
                graph.compiled_options(),
                mixings[r].compiled_options(),
                synchronous=uniform,
                timeout=timedelta(seconds=timeout_s),
            ),
        )
        for r in range(world_size)
    ]

    samples: list[tuple[int, float]] = []
    errors = {"weight": 0.0, "mass": 0.0, "checks": 0}

    def check() -> None:
        # Runs in the last thread to reach the barrier, while every rank is idle.
        done = engines[0].round
        weights = [e.ps_weight().double().item() for e in engines]
        mean = torch.stack([e.ps_numerators()[0].double() for e in engines]).mean(0)
        errors["weight"] = max(errors["weight"], abs(sum(weights) - world_size))
        errors["mass"] = max(errors["mass"], (mean - initial_mean).abs().max().item())
        if done >= warmup:
            samples.append((done, rss_mib()))
            errors["checks"] += 1

    barrier = threading.Barrier(world_size, action=check)
    failures: list[BaseException | None] = [None] * world_size

    def run_rank(rank: int) -> None:
        engine = engines[rank]
        try:
            for t in range(1, rounds + 1):
                engine.start_round()
                engine.finish_round()
                if t % check_every == 0 or t == rounds:
                    barrier.wait(timeout=timeout_s)
        except BaseException as error:  # reported by the caller's thread
            failures[rank] = error
            barrier.abort()

    threads = [
        threading.Thread(target=run_rank, args=(r,), name=f"soak-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    budget = 2 * timeout_s + rounds * 1e-3 * world_size
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, start + budget - time.perf_counter()))
    wall = time.perf_counter() - start
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise TimeoutError(
            f"soak_inproc: {hung} still running after {wall:.0f} s ({rounds} rounds, budget "
            f"{budget:.0f} s): a deadlock; rounds done per rank: {[e.round for e in engines]}"
        )
    for rank, error in enumerate(failures):
        # A rank woken by another's failure reports a broken barrier or a timeout; the first
        # error that is neither says why.
        if error is not None and not isinstance(error, threading.BrokenBarrierError):
            raise RuntimeError(f"soak_inproc: rank {rank} failed: {error!r}") from error
    if any(failures):
        raise RuntimeError(f"soak_inproc: the barrier broke: {failures}")

    mixing = "uniform (lazy, in place)" if uniform else "per-rank self weights"
    return SoakRun(
        name=f"in-process, {mixing}, {str(dtype).removeprefix('torch.')}",
        dtype=dtype,
        world_size=world_size,
        rounds=min(e.round for e in engines),
        expected_rounds=rounds,
        wall_s=wall,
        warmup=warmup,
        rss=[samples],
        weight_sum_error=errors["weight"],
        final_weights=[e.ps_weight().double().item() for e in engines],
        weights_should_move=not uniform,
        checks=errors["checks"],
        mass_error=errors["mass"],
        consensus_error=max((p.double() - initial_mean).abs().max().item() for p in params),
    )


# ----------------------------------------------------------------------------- gloo

_FEATURES = 32
_HIDDEN = 64
_BATCHES = 8  # distinct batches per rank, cycled
_BATCH = 16
_LR = 0.01


@dataclass(frozen=True)
class _GlooPlan:
    modes: tuple[str, ...]
    steps: int
    check_every: int
    warmup: int
    timeout_s: float


def _train(rank: int, world_size: int, mode: str, plan: _GlooPlan) -> dict:
    kwargs, dtype = GLOO_MODES[mode]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(_FEATURES, _HIDDEN), nn.Tanh(), nn.Linear(_HIDDEN, 1))
    module.to(dtype)
    model = gossip_ext.GossipDataParallel(
        module,
        mixing=gossip_ext.SelfWeightMixing(self_weight(rank)),
        timeout=timedelta(seconds=plan.timeout_s),
        **kwargs,
    )
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    g = torch.Generator().manual_seed(1000 + rank)
    xs = torch.randn(_BATCHES, _BATCH, _FEATURES, generator=g).to(dtype)
    ys = torch.randn(_BATCHES, _BATCH, 1, generator=g).to(dtype)
    total = torch.zeros(1, dtype=torch.float64)

    def weight_sum_error() -> float:
        model.sync_comms()  # every round started so far absorbed on every rank
        total.fill_(model.ps_weight)
        dist.all_reduce(total)
        return abs(total.item() - world_size)

    samples, max_error, checks, loss = [], 0.0, 0, None
    start = time.perf_counter()
    for step in range(1, plan.steps + 1):
        x, y = xs[step % _BATCHES], ys[step % _BATCHES]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.transfer_params()
        if step % plan.check_every == 0 or step == plan.steps:
            max_error = max(max_error, weight_sum_error())
            if step >= plan.warmup:
                samples.append((step, rss_mib()))
                checks += 1
    wall = time.perf_counter() - start
    max_error = max(max_error, weight_sum_error())
    return {
        "rounds": model.gossip_round,
        "wall_s": wall,
        "rss": samples,
        "weight_sum_error": max_error,
        "ps_weight": model.ps_weight,
        "checks": checks,
        "loss": loss.item(),
    }


def _gloo_rank(rank: int, world_size: int, init_file: str, out_dir: str, plan: _GlooPlan) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=plan.timeout_s),
    )
    try:
        results = {mode: _train(rank, world_size, mode, plan) for mode in plan.modes}
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()  # see tests/multiprocess.py


def soak_gloo(
    steps: int,
    modes: list[str] | None = None,
    *,
    world_size: int = WORLD_SIZE,
    check_every: int = 100,
    warmup: int = 200,
    timeout_s: float = 60.0,
    deadline_s: float | None = None,
) -> list[SoakRun]:
    """Trains ``steps`` steps of a small MLP with GossipDataParallel on ``world_size`` gloo
    processes, once per mode (in one group of processes, one after the other).

    Args:
        steps (int): training steps (one gossip round each) per mode.
        modes (list of str, optional): keys of :data:`GLOO_MODES` (default: all of them).
        world_size (int): processes (default: 4).
        check_every (int): steps between the checks of RSS and weight sum (default: 100).
        warmup (int): steps before the RSS baseline (default: 200).
        timeout_s (float): how long a round or a collective waits for a peer (default: 60).
        deadline_s (float, optional): how long the processes may run in all before they are
            terminated and TimeoutError is raised (default: 120 s plus 10 ms per step and mode).
    """
    modes = list(GLOO_MODES) if modes is None else list(modes)
    unknown = [m for m in modes if m not in GLOO_MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty list of {list(GLOO_MODES)}, got {modes}")
    _check_counts(steps, check_every, warmup, "steps")
    if deadline_s is None:
        deadline_s = 120.0 + 0.01 * steps * len(modes)
    plan = _GlooPlan(tuple(modes), steps, check_every, warmup, timeout_s)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _gloo_rank,
            args=(world_size, os.path.join(out_dir, "store"), out_dir, plan),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + deadline_s
        # join() raises if a rank failed (and terminates the others).
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                alive = [r for r, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    if p.is_alive():
                        p.terminate()
                for p in context.processes:
                    p.join(timeout=10)
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(
                    f"soak_gloo: ranks {alive} still running after {deadline_s:.0f} s "
                    f"({steps} steps of {modes}): a deadlock or a hang; terminated them"
                )
        per_rank = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                per_rank.append(pickle.load(f))

    runs = []
    for mode in modes:
        ranks = [r[mode] for r in per_rank]
        rounds = sorted({r["rounds"] for r in ranks})
        inconsistencies = [
            f"rank {i} ended with a non-finite loss {r['loss']}"
            for i, r in enumerate(ranks)
            if not math.isfinite(r["loss"])
        ]
        if len(rounds) > 1:
            inconsistencies.append(f"ranks completed different numbers of rounds: {rounds}")
        runs.append(
            SoakRun(
                name=f"gloo, {mode}",
                dtype=GLOO_MODES[mode][1],
                world_size=world_size,
                rounds=rounds[0],
                expected_rounds=steps,
                wall_s=max(r["wall_s"] for r in ranks),
                warmup=warmup,
                rss=[r["rss"] for r in ranks],
                weight_sum_error=max(r["weight_sum_error"] for r in ranks),
                final_weights=[r["ps_weight"] for r in ranks],
                weights_should_move=True,
                checks=min(r["checks"] for r in ranks),
                inconsistencies=inconsistencies,
            )
        )
    return runs
