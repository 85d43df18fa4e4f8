"""A slow worker costs its share, or the job: time to the same held-out quality on a cluster where
one worker computes at half speed, beside the same cluster uniform, in one run.

Every system trains lm_compare's task with its protocol (harness.compare.runner.Protocol: the
byte-level transformer, the same batches, schedule and peak learning rates; DDP runs --ddp-steps,
the others --steps) on workers that each keep their own clock (harness.compare.uneven): each
evaluates its own model every --eval-every of its own steps, off its clock, so that nothing but
the system's own communication holds a worker back. On the slow cluster, worker --slow-rank
computes at 1 / --slowdown the pace: after each step it sleeps the rest of what a slower device
would take (its own compute time, measured before training, times --slowdown - 1); the ``alone``
system measures the result. The target is the uniform cluster's DDP's final held-out loss.

Per system: the time to the target on each cluster and their ratio (a slow worker that costs only
its share costs 4 / 3.5 = 1.14x on four workers; lockstep costs the whole slowdown), the goodput
on the slow cluster (the steps the workers took over the steps they could have taken computing
alone, up to the first worker's last step), and the step times of the fast workers and the slow
one.

    python benchmarks/heterogeneous.py                          # loopback, 4 workers
    python benchmarks/heterogeneous.py --bandwidth 100mbit     # as root: the emulated network

Rewrites this benchmark's section of benchmarks/RESULTS.md unless --no-record; --rows keeps
every worker's record (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import results  # noqa: E402  (benchmarks/results.py)

from harness import netns  # noqa: E402
from harness.compare import runner, systems  # noqa: E402
from harness.compare import uneven_report as measure  # noqa: E402
from harness.compare.uneven import UnevenRun  # noqa: E402

TITLE = "A slow worker: time to the same held-out quality with one worker at half speed"
SYSTEMS = (
    "alone",
    "ddp",
    "powersgd_r4",
    "decent_dp",
    "torchft_diloco",
    "overlap_sgp_int8",
    "async_sgp_int8",
)
ASYNCHRONOUS = ("async_sgp", "async_sgp_int8")
# The goal: the best asynchronous mode within GOAL_RATIO of its own uniform-cluster time.
GOAL_RATIO = 1.15
SETTINGS = ("uniform", "slow")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=systems.ALL)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bandwidth", default=None, help="each NIC's rate, e.g. 100mbit (as root)")
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--ddp-steps", type=int, default=240)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--slowdown", type=float, default=2.0)
    p.add_argument("--slow-rank", type=int, default=None, help="default: the last worker")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--rows", default="/tmp/gossip_heterogeneous.json")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if "alone" not in args.systems or "ddp" not in args.systems:
        p.error("--systems needs alone (goodput's reference) and ddp (the target)")
    args.rate = netns.parse_rate(args.bandwidth) if args.bandwidth else None
    args.slow_rank = args.workers - 1 if args.slow_rank is None else args.slow_rank
    return args


def run_all(args, protocol: runner.Protocol) -> dict[str, dict[str, dict]]:
    """Every system on the uniform cluster, then on the slow one: {setting: {system: result}}."""
    rows: dict[str, dict[str, dict]] = {setting: {} for setting in SETTINGS}
    for setting in SETTINGS:
        slow_rank = None if setting == "uniform" else args.slow_rank
        for system in args.systems:
            why_not = systems.available(system)
            if why_not:
                print(f"left out: {why_not}", flush=True)
                continue
            config = UnevenRun(protocol.config(system), slow_rank, args.slowdown)
            started = time.monotonic()
            rows[setting][system] = runner.run(
                config, args.workers, args.rate, args.timeout, "harness.compare.uneven:train"
            )
            records = rows[setting][system]["records"]
            print(
                f"{setting:>8} {system:>17}: final {measure.final(records):.3f} bits per byte "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
        with open(args.rows, "w") as f:
            json.dump(rows, f)
    return rows


def table(rows: dict[str, dict[str, dict]]) -> tuple[str, float]:
    """The table of every system across both clusters, and the target it was measured to."""
    target = measure.final(rows["uniform"]["ddp"]["records"])
    alone = measure.alone_step_seconds(rows["slow"]["alone"]["records"])
    lines = [
        "| system | uniform: time to target | one worker at half speed: time to target | ratio "
        "| goodput | step ms, fast workers / slow one | final held-out bpb |",
        "|---|---|---|---|---|---|---|",
    ]
    for system in rows["uniform"]:
        if system not in rows["slow"]:
            continue
        uniform = measure.time_to(rows["uniform"][system]["records"], target)
        records = rows["slow"][system]["records"]
        slow = measure.time_to(records, target)
        ratio = f"{slow / uniform:.2f}x" if uniform and slow else "-"
        lines.append(
            f"| {system} | {_seconds(uniform)} | {_seconds(slow)} | {ratio} "
            f"| {measure.goodput(records, alone):.2f} "
            f"| {measure.step_ms(records, False):.0f} / {measure.step_ms(records, True):.0f} "
            f"| {measure.final(records):.3f} |"
        )
    return "\n".join(lines), target


def _seconds(t: float | None) -> str:
    return "not reached" if t is None else f"{t:.1f} s"


def goal(rows: dict[str, dict[str, dict]], target: float) -> str:
    ratios = {}
    for system in ASYNCHRONOUS:
        if system in rows["slow"] and system in rows["uniform"]:
            uniform = measure.time_to(rows["uniform"][system]["records"], target)
            slow = measure.time_to(rows["slow"][system]["records"], target)
            if uniform and slow:
                ratios[system] = slow / uniform
    if not ratios:
        return "Goal: no asynchronous mode reached the target on both clusters."
    best = min(ratios, key=ratios.get)
    met = "met" if ratios[best] <= GOAL_RATIO else "missed"
    return (
        f"Goal (the best asynchronous mode within {GOAL_RATIO}x of its uniform-cluster time): "
        f"{best} at {ratios[best]:.2f}x, {met}."
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rate is not None and (why := netns.unavailable()):
        sys.exit(f"--bandwidth needs an emulated network: {why}")
    protocol = runner.Protocol(
        steps=args.steps,
        ddp_steps=args.ddp_steps,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
    )
    rows = run_all(args, protocol)
    text, target = table(rows)
    summary = goal(rows, target)
    print(f"\n{text}\n\n{summary}", flush=True)
    network = "loopback" if args.rate is None else f"{netns.format_rate(args.rate)} NICs"
    params = rows["uniform"]["ddp"]["params"]
    body = (
        protocol.describe(params)
        + f" {args.workers} workers, {network}; on the slow cluster worker {args.slow_rank} "
        f"computes at 1/{args.slowdown:g} the pace (it sleeps {args.slowdown - 1:g}x its own "
        "measured compute after each step). Each worker evaluates its own model every "
        f"{args.eval_every} of its own steps, off its own clock; held-out loss at a time is the "
        "mean over workers of each one's latest. Target: the uniform cluster's DDP's final "
        f"held-out loss, {target:.3f} bits per byte. Goodput: steps taken over the steps the "
        "workers could have taken computing alone (`alone` on the slow cluster), up to the first "
        f"worker's last step.\n\n{text}\n\n{summary}\n"
    )
    if not args.no_record:
        results.record(TITLE, body)
    return rows


if __name__ == "__main__":
    main()
