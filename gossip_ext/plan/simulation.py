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
loss, nothing here says. Deaths are not drawn: their cost is the formulas' (``cost``).
"""

from __future__ import annotations

import dataclasses
import math
import random

from gossip_ext.plan.cost import Cluster, Mode, Model, elastic_goodput, restart_goodput

# A stop of an odd worker lasts this long (benchmarks/heterogeneous.py stops one 1 to 3 s).
STALL_SECONDS = 2.0


@dataclasses.dataclass(frozen=True)
class Simulated:
    """A simulated run: the mean step time of the workers that are not odd (past the first
    quarter of the run), and the goodput (steps taken over those they could take computing alone,
    the formulas' share for failures kept)."""

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
    kept = elastic_goodput(cluster) if mode.elastic else restart_goodput(cluster)
    return Simulated(
        step_seconds=sum(starts[i] - settled[i] for i in even) / (len(even) * (steps - warmup)),
        goodput=taken / alone * kept,
    )
