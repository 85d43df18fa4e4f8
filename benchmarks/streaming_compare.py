"""Streaming DiLoCo with int8 and int4 outer messages beside DiLoCo, torchft's DiLoCo and
torchft's Streaming DiLoCo, DDP and the workers computing alone.

The same task, data, seeds and protocol as benchmarks/lm_compare.py and diloco_compare.py
(harness.compare): DDP runs --ddp-steps and its final held-out loss is the target; every other
system runs --steps. At H = --sync-every, with the outer Nesterov SGD of diloco_compare.py
(lr 0.7, momentum 0.5):

- ``diloco``: gossip_ext's DiLoCo, the exact average of the whole model every H steps;
  ``diloco_int8``: the same in int8 messages (outer_dtype);
- ``streaming_diloco_t<tau>_<dtype>``: gossip_ext's Streaming DiLoCo, 4 fragments, one synced
  every H / 4 steps, its averaging started tau steps earlier and travelling while the workers
  train, the pseudo-gradients in fp32, int8 or int4 with error feedback;
- ``torchft_diloco`` and ``torchft_streaming_diloco_t<tau>``: torchft 0.2.0's, the latter over
  the same 4 fragments on the same schedule with fragment_sync_delay tau, uncompressed (its
  quantization needs CUDA and Triton).

    python benchmarks/streaming_compare.py                  # as root: 8 workers at 100 Mbit/s
    python benchmarks/streaming_compare.py --settings 8x1gbit 8x100mbit

Prints a table per setting and a goals table (at 8 workers behind 100 Mbit/s NICs: DDP's final
held-out loss in <= 0.1x DDP's time and <= 0.5x torchft's Streaming DiLoCo's), plus the time to
the quality every Streaming DiLoCo and torchft's reach; writes a plot (--plot), every result
(--rows, JSON) and, unless --no-record, this benchmark's section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import diloco_compare  # noqa: E402  (its outer step, tuned)
import lm_compare  # noqa: E402  (its settings parser and saved runs)
import results  # noqa: E402

from harness import netns  # noqa: E402
from harness.compare import report, runner  # noqa: E402

TITLE = "Streaming DiLoCo with int8 and int4 messages beside torchft's"
ONCE = ("alone", "ddp")
PER_H = (
    "torchft_diloco",
    "torchft_streaming_diloco_t1",
    "torchft_streaming_diloco_t2",
    "diloco",
    "diloco_int8",
    "streaming_diloco_t1_fp32",
    "streaming_diloco_t1_int8",
    "streaming_diloco_t2_int8",
    "streaming_diloco_t1_int4",
    "streaming_diloco_t2_int4",
)
OURS = tuple(s for s in PER_H if s.startswith("streaming_diloco"))
THEIRS = tuple(s for s in PER_H if s.startswith("torchft_streaming_diloco"))
GOAL = "<= 0.1x DDP and <= 0.5x torchft's Streaming DiLoCo"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=["8x100mbit"])
    p.add_argument("--sync-every", type=int, default=16, help="H (default: 16)")
    p.add_argument("--outer-lr", type=float, default=diloco_compare.OUTER_LR)
    p.add_argument("--outer-momentum", type=float, default=diloco_compare.OUTER_MOMENTUM)
    p.add_argument("--target-bpb", type=float, default=3.1)
    p.add_argument("--steps", type=int, default=960)
    p.add_argument("--ddp-steps", type=int, default=480)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--plot", default="/tmp/gossip_streaming_compare.png")
    p.add_argument("--rows", default="/tmp/gossip_streaming_compare.json")
    p.add_argument("--from-rows", metavar="FILE", help="report the run saved in FILE again")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if args.sync_every < 4 or args.sync_every % 4:
        p.error(f"--sync-every must be a multiple of the 4 fragments, got {args.sync_every}")
    args.parsed = lm_compare.parse_settings(p, args.settings)
    if any(w < 2 for w, _ in args.parsed):
        p.error(f"--settings: DiLoCo needs at least 2 workers, got {args.settings}")
    return args


def goals(all_rows) -> str:
    """Per setting: the first Streaming DiLoCo of gossip_ext's to DDP's final held-out loss, and
    to the quality it and torchft's Streaming DiLoCo both reach (the higher of torchft's final
    and gossip_ext's best final)."""
    lines = [
        "| setting | goal | to DDP's final: gossip_ext's best Streaming DiLoCo | DDP "
        "| torchft Streaming DiLoCo | to the quality both reach: gossip_ext's best "
        "| torchft Streaming DiLoCo | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (workers, rate), rows in all_rows.items():
        target = rows["ddp"]["final_bpb"]
        ddp_time = report.time_to(rows["ddp"], target)
        ours, ours_text = lm_compare.first(rows, OURS, target, ddp_time)
        theirs, theirs_text = lm_compare.first(rows, THEIRS, target, ddp_time)
        ours_finals = [rows[n]["final_bpb"] for n in OURS if n in rows]
        theirs_finals = [rows[n]["final_bpb"] for n in THEIRS if n in rows]
        common_text, theirs_common = "not run", "not run"
        if theirs_finals and ours_finals:
            # The quality both reach: the higher of the two sides' best finals.
            common = max(min(theirs_finals), min(ours_finals))
            theirs_name, theirs_time = report.best(rows, THEIRS, common)
            name, ours_time = report.best(rows, OURS, common)
            common_text = (
                f"{common:.3f} bpb: {name} {ours_time:.1f} s ({ours_time / theirs_time:.2f}x)"
            )
            theirs_common = f"{theirs_name} {theirs_time:.1f} s"
        goal, met = "-", "-"
        if (workers, rate) == (8, 1e8):
            goal = GOAL
            ok = (
                ours is not None
                and ours <= 0.1 * ddp_time
                and (theirs is None or ours <= 0.5 * theirs)
            )
            met = "yes" if ok else "no"
        lines.append(
            f"| {workers} workers, {netns.format_rate(rate)} | {goal} | {ours_text} "
            f"| {ddp_time:.1f} s | {theirs_text} | {common_text} | {theirs_common} | {met} |"
        )
    return "\n".join(lines)


def describe(params: int, protocol: runner.Protocol, args) -> str:
    m = protocol.model
    return (
        f"Byte-level transformer of {params / 1e6:.2f}M parameters ({m.layers} layers, width "
        f"{m.width}, context {m.context}), batch {protocol.batch_size} per worker, one torch "
        f"thread per worker (benchmarks/lm_compare.py's protocol). Every system runs "
        f"{protocol.steps} steps but DDP, which runs {protocol.ddp_steps}: DDP's final held-out "
        f"loss is the target. AdamW at each system's peak lr (harness.compare.systems). "
        f"H = {args.sync_every}, outer Nesterov SGD at lr {args.outer_lr:g}, momentum "
        f"{args.outer_momentum:g}; Streaming DiLoCo in 4 fragments, one synced every "
        f"{args.sync_every // 4} steps, gossip_ext's and torchft's alike. What a worker sent is "
        f"what its NIC sent. A step within {report.CPU_BOUND}x of `alone`'s is bound by the CPU."
    )


def report_all(args, protocol, all_rows) -> None:
    sections, params = lm_compare.report_settings(all_rows, args.target_bpb, args.plot)
    goal_table = goals(all_rows)
    print(goal_table)
    body = describe(params, protocol, args) + "\n\n### Goals\n\n" + goal_table + "\n\n"
    body += "\n\n".join(sections)
    if not args.no_record:
        results.record(TITLE, body)


def main(argv=None):
    args = parse_args(argv)
    if args.from_rows:
        protocol, all_rows = lm_compare.load_rows(args.from_rows)
        report_all(args, protocol, all_rows)
        return all_rows
    if why := netns.unavailable():
        sys.exit(f"this benchmark needs an emulated network: {why}")
    protocol = runner.Protocol(steps=args.steps, ddp_steps=args.ddp_steps)
    at_h = dataclasses.replace(
        protocol,
        local_steps=args.sync_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    all_rows = {}
    for workers, rate in args.parsed:
        rows = runner.run_systems(ONCE, protocol, workers, rate, args.timeout)
        rows.update(runner.run_systems(PER_H, at_h, workers, rate, args.timeout))
        all_rows[(workers, rate)] = rows
        lm_compare.save_rows(args.rows, protocol, all_rows)  # a long run keeps its part
    report_all(args, protocol, all_rows)
    return all_rows


if __name__ == "__main__":
    main()
