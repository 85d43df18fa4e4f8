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
- *Repeated runs*: a system run more than once on a cluster (its result's ``repeats``: the other
  runs' records) is reported by the median of each measure over its runs, a run that never
  reached the target counting as the latest.
"""

from __future__ import annotations

import bisect
import math
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


def runs(result: dict) -> list[list[dict]]:
    """Every run's records of one system on one cluster: the first, then its repeats."""
    return [result["records"], *result.get("repeats", [])]


def median_time_to(result: dict, target: float) -> float | None:
    """The median over ``result``'s runs of the time to ``target``; None where the median run
    never reached it."""
    times = [time_to(records, target) for records in runs(result)]
    middle = statistics.median(math.inf if t is None else t for t in times)
    return None if math.isinf(middle) else middle


def median_final(result: dict) -> float:
    return statistics.median(final(records) for records in runs(result))


def median_goodput(result: dict, alone: dict[int, float]) -> float:
    return statistics.median(goodput(records, alone) for records in runs(result))


def label(system: str, result: dict) -> str:
    """The system's name, and how many runs its figures are the median of where more than one."""
    count = len(runs(result))
    return system if count == 1 else f"{system} (median of {count} runs)"


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


def table(rows: dict[str, dict], target: float, name: str, uniform: dict | None = None) -> str:
    """A markdown table of every system of ``rows`` (system -> run) on the cluster ``name``:
    its time to ``target`` (beside the ``uniform`` cluster's and their ratio, where given), its
    goodput against the ``alone`` row, the step times of the other workers and of the odd one
    (its first run's), its final held-out loss; medians over a system's repeated runs."""
    alone = alone_step_seconds(rows["alone"]["records"])
    beside = uniform is not None
    head = "| system | " + ("uniform: time to target | " if beside else "")
    head += f"{name}: time to target | " + ("ratio | " if beside else "")
    head += "goodput | step ms, the other workers / the odd one | final held-out bpb |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for system, result in rows.items():
        records = result["records"]
        uneven = median_time_to(result, target)
        cells = [label(system, result)]
        if beside:
            before = median_time_to(uniform[system], target) if system in uniform else None
            ratio = f"{uneven / before:.2f}x" if before and uneven else "-"
            cells += [seconds(before), seconds(uneven), ratio]
        else:
            cells.append(seconds(uneven))
        cells += [
            f"{median_goodput(result, alone):.2f}",
            f"{ms(step_ms(records, False))} / {ms(step_ms(records, True))}",
            f"{median_final(result):.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ms(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f}"


def seconds(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.1f} s"


def plot(clusters: dict[str, dict[str, dict]], target: float, path: str, asynchronous) -> None:
    """Held-out loss against each cluster's time, a panel per cluster (name -> system -> run):
    the lockstep systems' curves stretch where a worker is slow, the ``asynchronous`` ones'
    (solid lines) should not."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(clusters), figsize=(6.5 * len(clusters), 5), sharey=True)
    axes = axes if len(clusters) > 1 else [axes]
    for ax, (name, rows) in zip(axes, clusters.items()):
        for system, result in rows.items():
            points = curve(result["records"])
            style = "-" if system in asynchronous else ("--" if system != "alone" else ":")
            ax.plot(*zip(*points), style, label=system)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(name)
        ax.set_xlabel("wall-clock seconds of training")
        ax.set_ylim(top=4.5)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[0].set_ylabel("held-out bits per byte (mean over workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
