"""Time to the same held-out quality: gossip_ext beside the systems a user would pick instead.

Every system (gossip_ext.compare.systems) trains the byte-level transformer of gossip_ext.tasks
on the standard library's sources with the same data order, seeds, batch size and learning-rate
schedule, for the same number of steps; every worker's held-out bits per byte is measured every
--eval-every steps, off the clock. The table gives, per system: the time a step took and the step
time of the same workers computing without any communication (``alone``: the floor that a
network cannot lower); the bytes each worker sent per step, read off its NIC's counters on the
emulated network; the wall-clock time to DDP's final held-out loss and to --target-bpb; the final
held-out loss; the peak memory of a worker.

    python benchmarks/lm_compare.py                                   # loopback, 2 workers
    python benchmarks/lm_compare.py --workers 4 8 --bandwidth 1gbit 100mbit --steps 600  # as root

With --bandwidth, each worker runs in its own network namespace behind a NIC capped with tbf
(gossip_ext._netns); torchft's lighthouse runs in rank 0's namespace. Writes a plot of held-out
bits per byte against time (--plot) and, unless --no-record, rewrites this benchmark's section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import results  # noqa: E402  (benchmarks/results.py)

from gossip_ext import _netns  # noqa: E402
from gossip_ext.compare import report, runner, systems, worker  # noqa: E402
from gossip_ext.tasks.byte_lm import ByteLMConfig  # noqa: E402

TITLE = "Time to the same held-out quality: gossip_ext beside DDP, PowerSGD, decent-dp, torchft"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(systems.ALL), choices=systems.ALL)
    p.add_argument("--workers", nargs="+", type=int, default=[2])
    p.add_argument(
        "--bandwidth", nargs="+", default=[], help="NIC rates, e.g. 1gbit 100mbit (needs root)"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=8, help="H of LocalSGD, SlowMo, DiLoCo")
    p.add_argument("--target-bpb", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--plot", default="/tmp/gossip_lm_compare.png")
    p.add_argument("--no-record", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rates = [_netns.parse_rate(b) for b in args.bandwidth] or [None]
    if args.bandwidth and (why := _netns.unavailable()):
        sys.exit(f"--bandwidth needs an emulated network: {why}")
    model = ByteLMConfig(layers=args.layers, width=args.width, heads=4, context=args.context)
    recipe = systems.Recipe(
        steps=args.steps, lr=args.lr, warmup=args.warmup, local_steps=args.local_steps
    )
    chosen = [s for s in args.systems if not systems.available(s)]
    for s in set(args.systems) - set(chosen):
        print(f"skipped: {systems.available(s)}")
    all_rows: dict[str, dict[str, dict]] = {}
    sections = []
    for workers in args.workers:
        for rate in rates:
            network = "loopback" if rate is None else f"{_netns.format_rate(rate)} NICs"
            setting = f"{workers} workers, {network}"
            rows: dict[str, dict] = {}
            for name in chosen:
                config = worker.RunConfig(
                    system=name,
                    recipe=recipe,
                    model=model,
                    batch_size=args.batch_size,
                    eval_every=args.eval_every,
                    eval_windows=args.eval_windows,
                )
                start = time.monotonic()
                rows[name] = runner.run(config, workers, rate, args.timeout)
                print(
                    f"{setting}: {name}: {rows[name]['step_ms']:.0f} ms/step, final "
                    f"{rows[name]['final_bpb']:.3f} bpb ({time.monotonic() - start:.0f} s)",
                    flush=True,
                )
            all_rows[setting] = rows
            text = report.table(rows, args.target_bpb)
            print(f"\n{setting}\n{text}\n")
            sections.append(f"### {setting}\n\n{text}")
    report.plot(all_rows, args.plot)
    params = next(iter(next(iter(all_rows.values())).values()))["params"]
    body = (
        f"Byte-level transformer of {params / 1e6:.2f}M parameters ({args.layers} layers, width "
        f"{args.width}, context {args.context}), batch {args.batch_size} per worker, "
        f"{args.steps} steps, AdamW lr {args.lr} (warmup {args.warmup}, cosine), H = "
        f"{args.local_steps}; held-out bits per byte every {args.eval_every} steps.\n\n"
        + "\n\n".join(sections)
    )
    if not args.no_record:
        results.record(TITLE, body)
    return all_rows


if __name__ == "__main__":
    main()
