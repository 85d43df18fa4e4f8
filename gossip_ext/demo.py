"""The main demo: gossip_ext beside the systems a user would pick instead, on a real task.

    python -m gossip_ext.demo                          # loopback, 2 workers, a few minutes
    python -m gossip_ext.demo --bandwidth 100mbit      # as root: each worker behind its own NIC

Every system (DDP, DDP + PowerSGD, decent-dp, torchft's LocalSGD and DiLoCo, and gossip_ext's
modes; those whose package is missing are named and left out) trains a small byte-level
transformer on the standard library's sources with the same data, seed and schedule
(gossip_ext.tasks). The demo prints one table (time per step beside the workers computing alone,
bytes each worker sent per step on the emulated network, time to DDP's final held-out loss, final
held-out bits per byte), names the system that reached DDP's final held-out loss first, and
writes a plot of held-out bits per byte against wall-clock time. On loopback, communication is a
memory copy: the network result (--bandwidth) is the one that tells the systems apart.

For the full measurement, at 4 and 8 workers and a larger model: benchmarks/lm_compare.py. The
quick MLP demo is python -m gossip_ext.demo_mlp.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from gossip_ext import _netns
from gossip_ext.compare import report, runner, systems, worker
from gossip_ext.tasks.byte_lm import ByteLMConfig


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m gossip_ext.demo",
        description="Compare gossip_ext with DDP, PowerSGD, decent-dp and torchft on a small "
        "byte-level language model.",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(systems.ALL),
        choices=systems.ALL,
        metavar="SYSTEM",
        help=f"a subset of: {' '.join(systems.ALL)} (default: all)",
    )
    parser.add_argument("--steps", type=int, default=120, help="steps per system (default: 120)")
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
    for name in ("workers", "steps", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps <= 10:
        parser.error(f"--steps must be > 10 (the warmup), got {args.steps}")
    args.rate = _netns.rate_option(parser, args.bandwidth, args.workers)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rate is not None and (reason := _netns.unavailable()):
        print(f"python -m gossip_ext.demo --bandwidth: {reason}", file=sys.stderr)
        sys.exit(2)
    network = "loopback" if args.rate is None else f"{_netns.format_rate(args.rate)} NICs"
    model = ByteLMConfig(layers=2, width=128, heads=4, context=64)
    recipe = systems.Recipe(steps=args.steps, warmup=10, local_steps=4)
    rows = {}
    for name in args.systems:
        why_not = systems.available(name)
        if why_not:
            print(f"left out: {why_not}")
            continue
        config = worker.RunConfig(
            system=name, recipe=recipe, model=model, batch_size=8, eval_every=args.eval_every
        )
        rows[name] = runner.run(config, args.workers, args.rate, timeout=3600)
        print(
            f"{name:>17}: {rows[name]['step_ms']:6.0f} ms/step, held-out "
            f"{rows[name]['final_bpb']:.3f} bits per byte",
            flush=True,
        )
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
