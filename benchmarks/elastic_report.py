"""The report of benchmarks/elastic.py: the table of every run's figures, and the issue's goals
checked against them.
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

from harness import netns  # noqa: E402


def _f(value, spec=".2f") -> str:
    """A table cell: "-" where the run has no such figure (None) or could not measure it (NaN)."""
    return "-" if value is None or value != value else format(value, spec)


_FAILURES = {"kill": "SIGKILL + replace", "stall": "SIGSTOP + replace"}


def run_label(run: dict) -> str:
    """The table's `run` column; elastic.py also prints it as each run ends."""
    if run["failure"]:
        return _FAILURES[run["failure"]]
    return f"uninterrupted, {run['workers_started']} workers (batches {run['seed']})"


def _sharded(args) -> str:
    """What the report says of sharded replicas, where the workers are."""
    if getattr(args, "shards", 1) == 1:
        return ""
    return (
        f"Every worker is a replica of {args.shards} processes in its namespace, the model "
        f"sharded over them by FSDP2 (every block a unit), each process its own batch of 8; the "
        f"failure is process {args.victim_shard} of the victim's replica SIGKILLed (its other "
        f"processes leave with ReplicaLostError), the replacement a whole new replica. "
    )


def report(rows: list[dict], args) -> str:
    lines = [
        _sharded(args) + f"{args.workers} workers, each in its own network namespace behind a "
        f"{netns.format_rate(args.rate)} NIC (tbf), one torch thread each, all on this "
        f"machine's cores: every step is bound by the CPU, not the network (benchmarks/"
        f"lm_compare.py at this setting), and {args.workers - 1} workers step faster than "
        f"{args.workers}. Byte-level transformer of harness.compare (2 layers, width 128, "
        f"context 64), batch 8 per worker, AdamW, warmup 20 then cosine decay over "
        f"{args.steps} steps. The worker on slot {args.victim} is SIGKILLed, or SIGSTOPped for "
        f"good, after its step {args.fail_at}; a replacement starts on its slot when worker 0 "
        f"finishes step {args.replace_at}. gossip_ext: elastic overlapped SGP, bfloat16 "
        f"messages, min_workers {args.min_workers}; "
        + (
            f"torchft 0.2.0: Manager (min_replica_size {args.min_workers}, synchronous quorum) "
            f"and LocalSGD every 4 steps, lighthouse heartbeat timeout {args.heartbeat_ms} ms; "
            if "torchft" in args.systems
            else ""
        )
        + f"every worker's timeout {args.timeout:g} s. Times from every worker's wall clock "
        f"(one machine, one clock), in blocks of 4 steps (torchft syncs in one step of 4); "
        f"`lost` is a window's length minus its blocks at the window's median block, the "
        f"survivors' mean (uninterrupted rows: the same windows, for the noise); `joining` is "
        f"the system's part of the replacement's start, from its model built to its first "
        f"step's end (the rest is Python importing torch and loading the data on a machine the "
        f"others keep busy).",
        "",
        "| system | run | back after failure (s) | lost after failure (s) | replacement trains "
        "after (s) | joining (s) | its first step | lost after join (s) | wall (s) | step (ms) | "
        "worker-steps | final held-out bpb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f = row["figures"]
        failure = row["failure"]
        run = run_label(row)
        lines.append(
            f"| {row['system']} | {run} | {_f(f['back_s']) if failure else '-'} "
            f"| {_f(f['lost_after_failure_s'])} | {_f(f.get('joiner_trains_s'))} "
            f"| {_f(f.get('joiner_joining_s'))} "
            f"| {f.get('joiner_first_step', '-')} | {_f(f['lost_after_join_s'])} "
            f"| {_f(f['wall_s'], '.1f')} | {_f(f['step_ms'], '.1f')} | {f['worker_steps']} "
            f"| {_f(f['final_bpb'], '.4f')} |"
        )
    lines += ["", *goals(rows, args)]
    return "\n".join(lines)


def goals(rows: list[dict], args) -> list[str]:
    """The issue's goals, each against the figures measured here."""
    runs = {(r["system"], r["failure"]): r["figures"] for r in rows if r["failure"]}

    def calm(system: str, workers: int) -> list[dict]:
        return [
            r["figures"]
            for r in rows
            if r["system"] == system and not r["failure"] and r["workers_started"] == workers
        ]

    out = ["| goal | measured | met |", "|---|---|---|"]
    bounds = {
        "kill": ("2 s of a SIGKILL", 2.0),
        "stall": ("timeout + 2 s of a stall", args.timeout + 2),
    }
    for failure, (what, bound) in bounds.items():
        ours = runs.get(("gossip", failure))
        if ours:
            out.append(
                f"| survivors back at full step rate within {what} | {ours['back_s']:.2f} s "
                f"| {'yes' if ours['back_s'] <= bound else 'no'} |"
            )
    full, fewer = calm("gossip", args.workers), calm("gossip", args.workers - 1)
    if len(full) > 1 and len(fewer) > 1:
        # The loss an uninterrupted job reaches with the failure run's worker-steps: between the
        # job without the victim's slot and the full one, in proportion to worker-steps.
        (s0, b0), (s1, b1) = [
            (
                statistics.mean(f["worker_steps"] for f in g),
                statistics.mean(f["final_bpb"] for f in g),
            )
            for g in (fewer, full)
        ]
        noise = max(max(f["final_bpb"] for f in g) - min(f["final_bpb"] for f in g)
                    for g in (full, fewer))  # fmt: skip
        for failure in ("kill", "stall"):
            ours = runs.get(("gossip", failure))
            if ours:
                expected = b0 + (b1 - b0) * (ours["worker_steps"] - s0) / (s1 - s0)
                gap = ours["final_bpb"] - expected
                out.append(
                    f"| final held-out loss within run-to-run noise of an uninterrupted run with "
                    f"the same worker-steps ({_FAILURES[failure]}) | {ours['final_bpb']:.4f} at "
                    f"{ours['worker_steps']} worker-steps vs {expected:.4f} ({gap:+.4f}; "
                    f"uninterrupted runs differ by up to {noise:.4f}) | "
                    f"{'yes' if gap <= noise else 'no'} |"
                )
    static, elastic = calm("gossip_static", args.workers), full
    if len(static) > 1 and len(elastic) > 1:
        per = [[f["step_ms"] for f in g] for g in (elastic, static)]
        noise = max(max(v) - min(v) for v in per)
        diff = statistics.mean(per[0]) - statistics.mean(per[1])
        out.append(
            f"| no failure: the step time of a static job within noise | "
            f"{statistics.mean(per[0]):.1f} ms vs {statistics.mean(per[1]):.1f} ms static "
            f"({diff:+.1f} ms; runs of one kind differ by up to {noise:.1f} ms) | "
            f"{'yes' if abs(diff) <= noise else 'no'} |"
        )
    for failure in ("kill", "stall"):
        ours, theirs = runs.get(("gossip", failure)), runs.get(("torchft", failure))
        if ours and theirs:
            mine = ours["lost_after_failure_s"] + ours["lost_after_join_s"]
            other = theirs["lost_after_failure_s"] + theirs["lost_after_join_s"]
            out.append(
                f"| less wall time lost per failure than torchft ({_FAILURES[failure]}) | "
                f"{mine:.2f} s vs {other:.2f} s | {'yes' if mine < other else 'no'} |"
            )
    return out if len(out) > 2 else []
