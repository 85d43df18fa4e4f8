"""What a run of workers on their own clocks (``uneven``) measured: held-out quality against time,
the time to a target, and goodput.

- *Quality at time t*: the mean over workers of each worker's latest evaluated held-out loss at
  t, on its own clock (a worker not yet evaluated at t leaves t out).
- *Time to a target*: when that mean first reaches the target, linear between the evaluations
  either side of the crossing.
- *Goodput at time t*: the steps the workers took by t over the steps they could have taken
  computing alone (each at its own step time in the ``alone`` system's run of the same cluster):
  1.0 when nobody waits for anybody, 2 / 3.5 = 0.57 for four workers in lockstep with one at half
  speed.
"""

from __future__ import annotations

import bisect
import statistics


def curve(records: list[dict]) -> list[tuple[float, float]]:
    """(time, mean held-out loss over workers) at every worker's evaluation, in time order."""
    events = sorted((t, r["rank"], bpb) for r in records for t, _, bpb in r["evaluations"])
    latest: dict[int, float] = {}
    points = []
    for t, rank, bpb in events:
        latest[rank] = bpb
        if len(latest) == len(records):
            points.append((t, statistics.fmean(latest.values())))
    return points


def time_to(records: list[dict], target: float) -> float | None:
    """When the curve first reaches ``target``, linear between the evaluations either side of
    the crossing (evaluations come every ``eval_every`` steps, seconds apart: the first one at
    or below the target would round every time up by up to that)."""
    before = None
    for t, bpb in curve(records):
        if bpb <= target:
            if before is None or before[1] == bpb:
                return t
            t0, bpb0 = before
            return t0 + (t - t0) * (bpb0 - target) / (bpb0 - bpb)
        before = (t, bpb)
    return None


def final(records: list[dict]) -> float:
    return curve(records)[-1][1]


def alone_step_seconds(records: list[dict]) -> dict[int, float]:
    """Each worker's mean step time in a run (the ``alone`` system's: compute alone) while every
    worker was still stepping: a worker left alone on the machine steps faster."""
    common = min(r["step_times"][-1] for r in records)
    return {r["rank"]: common / steps_by(r, common) for r in records}


def steps_by(record: dict, t: float) -> int:
    return bisect.bisect_right(record["step_times"], t)


def goodput(records: list[dict], alone: dict[int, float], t: float | None = None) -> float:
    """Goodput at ``t`` (None: when the first worker finished, before any waits at the end)."""
    if t is None:
        t = min(r["step_times"][-1] for r in records)
    taken = sum(steps_by(r, t) for r in records)
    could = sum(t / alone[r["rank"]] for r in records)
    return taken / could


def step_ms(records: list[dict], slow: bool) -> float | None:
    """The mean step time of the slow worker (``slow``) or of the others, in ms."""
    times = [r["step_times"][-1] / len(r["step_times"]) for r in records if r["slow"] == slow]
    return 1000 * statistics.fmean(times) if times else None
