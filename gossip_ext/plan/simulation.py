"""What the closed formulas cannot give: who waits for whom, step by step, when step times vary.

The formulas of ``cost``, ``modes`` and ``outer_modes`` take every step to last its mean. Where
steps vary (each drawn around its mean, a worker stopped now and then), a lockstep mode pays, at
every step, the slowest of the workers it waits for, which grows with their number; an
asynchronous one pays nothing. :func:`simulate` plays a mode's waits out over drawn step times:
each mode says who it waits for (``Mode.schedule``: a new ``waits.Schedule`` for each run), and the
simulation computes, step by step, when every worker starts its next step. With every step at its
mean it gives the formulas' step time (``tests/test_plan.py`` holds it to them).

It simulates time, not learning: how far apart the workers' models stay after k rounds of a graph
is ``gossip_ext.simulate``'s (the compiled push-sum numerics); what the waits cost in held-out
loss, nothing here says. Deaths are drawn apart from the steps (:func:`drawn_failures_kept`),
over enough failures for their share to settle: a death costs minutes, a step a second.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

from gossip_ext.plan.cost import Cluster, Mode, Model

# A stop of an odd worker lasts this long (benchmarks/heterogeneous.py stops one 1 to 3 s).
STALL_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Simulated:
    """A simulated run: the mean step time of the workers that are not odd (past the first
    quarter of the run), and the goodput (steps taken over those they could take computing alone,
    times the share of time the drawn failures left)."""

    step_seconds: float
    goodput: float


def simulate(
    mode: Mode,
    model: Model,
    cluster: Cluster,
    *,
    steps: int = 200,
    jitter: float = 0.0,
    seed: int = 0,
) -> Simulated:
    """Plays at least ``steps`` steps of ``mode`` on ``cluster`` (whole periods of its outer
    steps, four at least): each worker's step drawn around its mean (log-normal, ``jitter`` its
    spread: 0.1 is about 10%), the odd workers slower and stopped ``STALL_SECONDS`` at random
    for ``cluster.stalled`` of their time."""
    if steps < 1:
        raise ValueError(f"simulate(steps=...): at least 1, got {steps}")
    if jitter < 0:
        raise ValueError(f"simulate(jitter=...): at least 0, got {jitter}")
    rng = random.Random(seed)
    n, odd = cluster.workers, cluster.slow_workers
    # A lockstep mode's messages cross the slowest link every time; an asynchronous worker's
    # link only sets how many of its messages get through.
    seen = cluster.slowest_link() if mode.lockstep else cluster
    schedule = mode.schedule(model, seen)
    means = [model.step_seconds * (cluster.slowdown if i >= n - odd else 1.0) for i in range(n)]
    stop_chance = [
        min(1.0, cluster.stalled * m / (STALL_SECONDS * (1.0 - cluster.stalled)))
        if i >= n - odd
        else 0.0
        for i, m in enumerate(means)
    ]
    computing = [0.0] * n  # each worker's compute and stops: its time alone
    starts = [0.0] * n
    # The step time is read past the first quarter of the run, once the waits settled, over
    # whole periods of the schedule: at least ``steps`` steps, in four parts of whole periods.
    chunk = 4 * schedule.period
    steps = -(-steps // chunk) * chunk
    warmup, settled = steps // 4, [0.0] * n
    for k in range(steps):
        if k == warmup:
            settled = list(starts)
        draws = []
        for i in range(n):
            step = means[i] * math.exp(jitter * rng.gauss(0.0, 1.0) - jitter * jitter / 2)
            if stop_chance[i] and rng.random() < stop_chance[i]:
                step += STALL_SECONDS
            draws.append(step)
            computing[i] += step
        finishes = [s + d for s, d in zip(starts, draws)]
        starts = schedule.next_starts(k, starts, finishes)
    even = range(n - odd)
    taken = sum(steps / starts[i] for i in range(n))
    alone = sum(steps / computing[i] for i in range(n))
    kept = drawn_failures_kept(mode.elastic, cluster, random.Random(seed + 1))
    return Simulated(
        step_seconds=sum(starts[i] - settled[i] for i in even) / (len(even) * (steps - warmup)),
        goodput=taken / alone * kept,
    )


def drawn_failures_kept(
    elastic: bool, cluster: Cluster, rng: random.Random, failures: int = 4000
) -> float:
    """The share of the workers' time that ``failures`` failures drawn at the cluster's rate
    leave (Note [Failures' cost] in ``cost``): a job that restarts loses, at each, what it did
    since its last save and a restart, which a failure during it starts over; an elastic job, the
    failed worker until it is back and the others an epoch change's pause each."""
    if cluster.mtbf is None:
        return 1.0
    if elastic:
        return _elastic_kept(cluster, rng, failures)
    rate, save, restart = 1.0 / cluster.mtbf, cluster.checkpoint_every, cluster.restart
    elapsed = saved = 0.0
    for _ in range(failures):
        ran = rng.expovariate(rate)  # from a start to the next failure
        saved += ran // save * save  # what it did since its last save is lost
        elapsed += ran
        # The restart, begun again at each failure during it (failures have no memory: the run
        # after it lasts a new draw).
        while (gap := rng.expovariate(rate)) < restart:
            elapsed += gap
        elapsed += restart
    return saved / elapsed


def _elastic_kept(cluster: Cluster, rng: random.Random, failures: int) -> float:
    """Each worker runs until it fails (at 1 / (n M)) and is back ``restart`` later; each failure
    pauses the others then running for ``epoch_pause``."""
    n, mtbf = cluster.workers, cluster.mtbf
    assert mtbf is not None
    rate = 1.0 / (n * mtbf)
    next_failures = [(rng.expovariate(rate), i) for i in range(n)]
    heapq.heapify(next_failures)
    down: list[float] = []  # when each worker that is down runs again
    lost = 0.0
    for _ in range(failures):
        now, i = heapq.heappop(next_failures)
        while down and down[0] <= now:
            heapq.heappop(down)
        lost += cluster.restart + (n - 1 - len(down)) * cluster.epoch_pause
        heapq.heappush(down, now + cluster.restart)
        heapq.heappush(next_failures, (now + cluster.restart + rng.expovariate(rate), i))
    horizon = next_failures[0][0]
    # A worker still down at the horizon has lost only what fell before it.
    lost -= sum(max(0.0, back - horizon) for back in down)
    return max(0.0, 1.0 - lost / (n * horizon))
