"""The measures of benchmarks/elastic.py: one run's figures, from every worker's timeline of
finished steps (how soon the survivors are back, the wall time they lose, how soon the
replacement trains, the final loss), as the benchmark's docstring defines them.
"""

from __future__ import annotations

import statistics

BLOCK = 4  # steps per block of the measures: torchft's LocalSGD syncs every 4 steps
SLOW_FACTOR = 2.0  # a block this many times the window's median is a disturbed one


def _blocks(steps: list, start: float, stop: float) -> list[tuple[float, float]]:
    """(end time, length) of consecutive blocks of BLOCK steps that end in (start, stop]. A
    block of torchft's LocalSGD holds one sync, so that blocks, unlike single steps, have one
    normal length for every system."""
    times = [t for _, t in steps]
    first = next((i for i, t in enumerate(times) if t > start), len(times))
    first = max(first - 1, 0)  # the block starts at the last step that ended before ``start``
    return [
        (times[i + BLOCK], times[i + BLOCK] - times[i])
        for i in range(first, len(times) - BLOCK, BLOCK)
        if times[i + BLOCK] <= stop
    ]


def _window_end(steps: list, start: float, count: int) -> float:
    after = [t for _, t in steps if t > start]
    return after[min(count, len(after)) - 1] if after else start


def _lost(blocks: list[tuple[float, float]]) -> float:
    if len(blocks) < 3:
        return float("nan")
    lengths = [length for _, length in blocks]
    return sum(lengths) - len(lengths) * statistics.median(lengths)


def measure(run: dict, args) -> dict:
    """The figures of one run. An uninterrupted run's windows start where the failure run's
    events are, at the same steps of worker 0 (their noise)."""
    survivors = {n: r for n, r in run["workers"].items() if n != "replacement"}
    if run["failure"]:
        kill, replaced = run["events"]["failed"], run["events"]["replaced"]
    else:
        # The same steps as the failure run's events, on worker 0's clock.
        steps0 = run["workers"]["w0"]["steps"]
        kill = next(t for s, t in steps0 if s >= args.fail_at)
        replaced = next(t for s, t in steps0 if s >= args.replace_at)
    lost_kill, lost_join, back = [], [], []
    for result in survivors.values():
        steps = result["steps"]
        end = _window_end(steps, replaced, args.join_window)
        during = _blocks(steps, kill, replaced)
        lost_kill.append(_lost(during))
        lost_join.append(_lost(_blocks(steps, replaced, end)))
        median = statistics.median(length for _, length in during)
        slow = [t for t, length in during if length > SLOW_FACTOR * median]
        first = next(t for _, t in steps if t > kill)
        back.append((slow[-1] if slow else first) - kill)
    members = list(run["workers"].values())
    figures = {
        "back_s": max(back),
        "lost_after_failure_s": statistics.mean(lost_kill),
        "lost_after_join_s": statistics.mean(lost_join),
        "final_bpb": statistics.mean(r["heldout_bpb"] for r in members),
        "wall_s": max(r["steps"][-1][1] for r in members) - run["events"]["go"],
        # From each worker's first step to its last: the pace, without the job's start.
        "step_ms": 1000
        * statistics.mean(
            (r["steps"][-1][1] - r["steps"][0][1]) / (len(r["steps"]) - 1) for r in members
        ),
        "worker_steps": sum(len(r["steps"]) for r in members),
    }
    joiner = run["workers"].get("replacement")
    if joiner is not None:
        timeline = joiner["timeline"]
        figures["joiner_trains_s"] = joiner["steps"][0][1] - replaced
        figures["joiner_imported_s"] = timeline["imported"] - replaced
        figures["joiner_loaded_s"] = timeline["loaded"] - replaced
        figures["joiner_joined_s"] = timeline["joined"] - replaced
        # The system's own part: from the model built to the first step's end.
        figures["joiner_joining_s"] = joiner["steps"][0][1] - timeline["loaded"]
        figures["joiner_first_step"] = timeline["first_step"]
    return figures
