"""The main demo: gossip_ext beside the systems a user would pick instead, on a real task.

    python -m harness.demo                          # loopback, 2 workers, a few minutes
    python -m harness.demo --bandwidth 100mbit      # as root: each worker behind its own NIC

Every system (DDP, DDP + PowerSGD, decent-dp, torchft's LocalSGD and DiLoCo, and gossip_ext's
modes; those whose package is missing are named and left out, and the Streaming DiLoCos join at
a sync period that fits their fragments, ``--sync-every 16``) trains a small byte-level
transformer on the standard library's sources with the same data, seed and schedule shape
(harness.tasks), each at its own peak learning rate (harness.compare.systems.PEAK_LR). DDP
runs half the steps of the others: its final held-out loss is the target, which a system that
steps faster but learns less per step can still reach. The demo prints one table (time per step
beside the workers computing alone, bytes each worker sent per step on the emulated network, time
to DDP's final held-out loss, final held-out bits per byte), names the system that reached DDP's
final held-out loss first, and writes a plot of held-out bits per byte against wall-clock time. On
loopback, communication is a memory copy: the network result (--bandwidth) is the one that tells
the systems apart.

For the full measurement, at 4 and 8 workers and long enough for the order not to be noise:
benchmarks/lm_compare.py. The quick MLP demo is python -m harness.demo_mlp.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from harness import netns
from harness.compare import report, runner, systems


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m harness.demo",
        description="Compare gossip_ext with DDP, PowerSGD, decent-dp and torchft on a small "
        "byte-level language model.",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=systems.ALL,
        metavar="SYSTEM",
        help=f"a subset of: {' '.join(systems.ALL)} (default: every one that runs at the sync "
        "period)",
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
        default=160,
        help="steps of every system but DDP, which runs half as many: its final held-out loss is "
        "the target (default: 160)",
    )
    parser.add_argument(
        "--eval-every", type=int, default=20, help="steps between held-out evaluations"
    )
    parser.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="run on an emulated cluster (needs root): every worker in its own network namespace "
        "behind a NIC of this rate, e.g. 1gbit or 100mbit (default: loopback)",
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
        args.systems = [s for s in systems.ALL if not systems.schedule_problem(s, args.sync_every)]
    for name in args.systems:
        problem = systems.schedule_problem(name, args.sync_every)
        if problem:
            parser.error(f"--sync-every: {problem}")
    args.rate = netns.rate_option(parser, args.bandwidth, args.workers)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rate is not None and (reason := netns.unavailable()):
        print(f"python -m harness.demo --bandwidth: {reason}", file=sys.stderr)
        sys.exit(2)
    network = "loopback" if args.rate is None else f"{netns.format_rate(args.rate)} NICs"
    protocol = runner.Protocol(
        steps=args.steps,
        ddp_steps=args.steps // 2,
        warmup=10,
        local_steps=args.sync_every,
        eval_every=args.eval_every,
    )
    rows = runner.run_systems(args.systems, protocol, args.workers, args.rate, timeout=3600)
    setting = f"{args.workers} workers, {network}"
    print(f"\n{setting}\n{report.table(rows)}\n")
    if "ddp" in rows:
        target = rows["ddp"]["final_bpb"]
        first = report.fastest(rows, target)
        if first:
            print(
                f"fastest to DDP's final held-out loss ({target:.3f} bits per byte): "
                f"{first[0]}, in {first[1]:.1f} s of training"
            )
    report.plot({setting: rows}, args.plot)
    return rows


if __name__ == "__main__":
    main()
