"""The main demo: gossip_ext beside the systems a user would pick instead, on a real task.

    python -m harness.demo                          # as root: each worker behind a 100 Mbit/s NIC
    python -m harness.demo --bandwidth loopback     # on loopback, where a message is a memory copy
    python -m harness.demo --systems all            # every system, not the default few
    python -m harness.demo --slow-worker            # one worker at half speed: who waits for it

Where an emulated cluster can be built (root, Linux, ``ip`` and ``tc``: harness.netns), every
worker runs in its own network namespace behind a 100 Mbit/s NIC, and the first line printed says
so; elsewhere the demo runs on loopback and its first line says why and how to get the network.
The systems (DDP, DDP + PowerSGD, decent-dp, torchft's LocalSGD and DiLoCo, and gossip_ext's SGP
in int8 messages, overlapped and not, and DiLoCo with int8 outer messages, beside 4 workers
computing alone; ``--systems`` runs any of the others, those whose package is missing are named
and left out) train a small byte-level transformer on the standard library's sources with the
same data, seed and schedule shape (harness.tasks), each at its own peak learning rate for the
demo's length (harness.compare.tuning.DEMO_LR). DDP runs two thirds of the others' steps: its
final held-out loss is the target, which a system that steps faster but learns less per step can
still reach, and which the workers computing alone do not. The demo prints one table (time per
step beside the workers computing alone, bytes each worker sent per step on the emulated network,
time to DDP's final held-out loss as a multiple of DDP's and of the communication-free bound,
final held-out bits per byte), names the system that reached DDP's final held-out loss first and
gossip_ext's best against the bound and the best peer, and writes a plot of held-out bits per
byte against wall-clock time. The bound is the fewest steps any system needed to reach the
target at the pace of the workers computing alone (harness.compare.report.bound): no system can
come out below it.

With ``--slow-worker`` the last worker computes at half speed (after each step it sleeps its own
measured compute time, as a device half as fast would take: harness.compare.uneven), every worker
keeps its own clock and evaluates its own model, and the asynchronous modes (AsyncSGP,
AsyncDiLoCo) join the default systems. The table then gives each system's time to DDP's final
held-out loss on that cluster, its goodput (the steps the workers took over those they could have
taken computing alone) and the step times of the other workers and of the slow one; the plot
shows the lockstep systems' curves stretch to the slow worker's pace while the asynchronous ones
keep the fast workers'. The full measurement beside the uniform cluster:
benchmarks/heterogeneous.py.

For the full measurement, at 4 and 8 workers and long enough for the order not to be noise:
benchmarks/lm_compare.py. The quick MLP demo is python -m harness.demo_mlp.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from harness import netns
from harness.compare import report, runner, systems, tuning
from harness.compare import uneven_report as uneven_measure
from harness.compare.uneven import UnevenRun

# What the demo runs unless --systems says otherwise: the workers computing alone (the floor), the
# peers a user would pick instead, and gossip_ext's fastest modes at 100 Mbit/s, within a few
# minutes on 2 cores; the rest run with --systems.
SYSTEMS = (
    "alone",
    "ddp",
    "powersgd_r4",
    "decent_dp",
    "torchft_localsgd",
    "torchft_diloco",
    "overlap_sgp_int8",
    "sgp_int8",
    "diloco_int8",
)
DEFAULT_RATE = 1e8  # each worker's NIC where the emulated cluster can be built
# The demo's length: the full comparison's protocol (benchmarks/lm_compare.py: 960 steps, DDP
# 480, 4 and 8 workers) shrunk to fit five minutes on two cores. At 4 workers, 4 NICs' worth of
# gossip shows what an average of two cannot. DDP runs two thirds of the others' steps, not
# half: at 160 steps and DDP's 80, the workers computing alone, stepping twice as often on a
# quarter of DDP's batch, ended at DDP's quality (4.006 against 4.010 bits per byte, each at
# its best rate), and a target that training without communication reaches shows nothing.
# Every system runs at its peak rate for this length (tuning.DEMO_LR).
STEPS = 180
# What --slow-worker adds: the modes that let the fast workers keep their pace.
ASYNCHRONOUS = ("async_sgp_int8", "async_diloco_int8")
SLOWDOWN = 2.0  # the slow worker's pace, as a fraction of the others': 1 / SLOWDOWN


def ddp_steps(steps: int) -> int:
    """DDP's steps in a demo of ``steps``: two thirds, whose final held-out loss is the target."""
    return 2 * steps // 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m harness.demo",
        description="Compare gossip_ext with DDP, PowerSGD, decent-dp and torchft on a small "
        "byte-level language model.",
    )
    parser.add_argument(
        "--workers", type=int, default=4, help="worker processes (default: %(default)s)"
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=("all", *systems.ALL),
        metavar="SYSTEM",
        help=f"any of: {' '.join(systems.ALL)}; or all, every one that runs at the sync period "
        f"(default: {' '.join(SYSTEMS)})",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        default=4,
        metavar="H",
        help="the sync period of LocalSGD, SlowMo and the DiLoCos (default: 4; each Streaming "
        f"DiLoCo, {systems.STREAMING_FRAGMENTS} fragments, needs a multiple of "
        f"{systems.STREAMING_FRAGMENTS} of at least {systems.STREAMING_FRAGMENTS} * (tau + 1))",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=STEPS,
        help="steps of every system but DDP, which runs two thirds as many: its final held-out "
        "loss is the target (default: %(default)s)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=20, help="steps between held-out evaluations"
    )
    parser.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="every worker in its own network namespace behind a NIC of this rate, e.g. 1gbit or "
        "100mbit (an emulated cluster: needs root, Linux and iproute2), or loopback for none "
        "(default: 100mbit where the emulated cluster can be built, else loopback)",
    )
    parser.add_argument(
        "--slow-worker",
        action="store_true",
        help="the last worker computes at half speed; the asynchronous modes join the systems",
    )
    parser.add_argument(
        "--plot",
        default=os.path.join(tempfile.gettempdir(), "gossip_demo.png"),
        help="where to write the PNG plot (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    for name in ("workers", "steps", "eval_every", "sync_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps <= 20:
        parser.error(f"--steps must be > 20 (twice the warmup), got {args.steps}")
    if args.systems is None:
        args.systems = list(SYSTEMS) + (list(ASYNCHRONOUS) if args.slow_worker else [])
    elif "all" in args.systems:
        args.systems = [s for s in systems.ALL if not systems.schedule_problem(s, args.sync_every)]
    for name in args.systems:
        problem = systems.schedule_problem(name, args.sync_every)
        if problem:
            parser.error(f"--sync-every: {problem}")
    args.rate = None
    if args.bandwidth not in (None, "loopback"):
        args.rate = netns.rate_option(parser, args.bandwidth, args.workers)
    return args


def network(args) -> tuple[float | None, str]:
    """The NIC rate the demo runs at (None: loopback) and the line that says so, first: the
    emulated 100 Mbit/s cluster by default where it can be built, else loopback and why."""
    workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
    if args.rate is not None:
        return args.rate, _on_network(workers, args.rate)
    if args.bandwidth == "loopback":
        return None, (
            f"{workers} on loopback (--bandwidth loopback), where a message is a memory copy: "
            "the systems differ little; without the flag, as root, each worker is behind its own "
            f"{netns.format_rate(DEFAULT_RATE)} NIC"
        )
    why = netns.unavailable() if args.workers > 1 else "one worker has no network to cross"
    if why is None:
        return DEFAULT_RATE, _on_network(workers, DEFAULT_RATE)
    return None, (
        f"{workers} on loopback, where a message is a memory copy ({why}); to put each worker "
        f"behind its own {netns.format_rate(DEFAULT_RATE)} NIC, where the systems differ, run "
        "it as root on Linux with iproute2 (ip, tc)"
    )


def _on_network(workers: str, rate: float) -> str:
    return (
        f"{workers}, each behind its own {netns.format_rate(rate)} NIC (an emulated cluster: "
        "network namespaces and tc); --bandwidth loopback to skip"
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rate is not None and (reason := netns.unavailable()):
        print(f"python -m harness.demo --bandwidth: {reason}", file=sys.stderr)
        sys.exit(2)
    rate, line = network(args)
    print(line, flush=True)
    protocol = runner.Protocol(
        steps=args.steps,
        ddp_steps=ddp_steps(args.steps),
        warmup=10,
        local_steps=args.sync_every,
        eval_every=args.eval_every,
        peak_lr=tuning.DEMO_LR,
        peak_lr_source="harness.compare.tuning.DEMO_LR",
    )
    if args.slow_worker:
        return _with_a_slow_worker(args, protocol, rate)
    rows = runner.run_systems(args.systems, protocol, args.workers, rate, timeout=3600)
    setting = f"{args.workers} workers, " + (
        "loopback" if rate is None else f"{netns.format_rate(rate)} NICs"
    )
    print(f"\n{setting}\n{report.table(rows)}\n")
    for line in verdict(rows):
        print(line)
    report.plot({setting: rows}, args.plot)
    return rows


def _with_a_slow_worker(args, protocol: runner.Protocol, rate: float | None) -> dict:
    """Every system on the cluster whose last worker computes at half speed, each worker on its
    own clock: the table, who reached DDP's final held-out loss first, and the plot."""
    if "alone" not in args.systems or "ddp" not in args.systems:
        sys.exit("--slow-worker needs alone (goodput's reference) and ddp (the target)")
    slow = args.workers - 1
    rows = {}
    for name in args.systems:
        why_not = systems.available(name)
        if why_not:
            print(f"left out: {why_not}", flush=True)
            continue
        run = UnevenRun(protocol.config(name), slow_rank=slow, slowdown=SLOWDOWN)
        rows[name] = runner.run(run, args.workers, rate, 3600, "harness.compare.uneven:train")
        print(f"{name:>17}: {uneven_measure.final(rows[name]['records']):.3f} bits per byte")
    target = uneven_measure.final(rows["ddp"]["records"])
    name = f"worker {slow} at 1/{SLOWDOWN:g} speed"
    print(f"\n{args.workers} workers, {name}\n")
    print(uneven_measure.table(rows, target, name) + "\n")
    reached = {
        system: t
        for system, result in rows.items()
        if system != "alone" and (t := uneven_measure.time_to(result["records"], target))
    }
    if reached:
        first = min(reached, key=reached.get)
        print(
            f"fastest to DDP's final held-out loss ({target:.3f} bits per byte) with a slow "
            f"worker: {first}, in {reached[first]:.1f} s of training"
        )
    uneven_measure.plot({name: rows}, target, args.plot, ASYNCHRONOUS)
    return rows


def verdict(rows: dict[str, dict]) -> list[str]:
    """Who reached DDP's final held-out loss first; gossip_ext's best against the
    communication-free bound and against the best peer (DDP's time included)."""
    if "ddp" not in rows:
        return []
    target = rows["ddp"]["final_bpb"]
    lines = []
    first = report.fastest(rows, target)
    if first:
        lines.append(
            f"fastest to DDP's final held-out loss ({target:.3f} bits per byte): "
            f"{first[0]}, in {first[1]:.1f} s of training"
        )
    ours = report.best(rows, report.gossip_rows(rows), target)
    peer = report.best(rows, report.peer_rows(rows), target)
    floor = report.bound(rows)
    if ours is None and report.gossip_rows(rows):
        lines.append("gossip_ext's modes: none reached it")
    if ours and peer:
        against = [f"{ours[1] / peer[1]:.2f}x the best peer's ({peer[0]}, {peer[1]:.1f} s)"]
        if floor:
            against.insert(
                0, f"{ours[1] / floor:.2f}x the communication-free bound ({floor:.1f} s)"
            )
        lines.append(f"gossip_ext's best, {ours[0]}: {ours[1]:.1f} s, " + " and ".join(against))
    return lines


if __name__ == "__main__":
    main()
