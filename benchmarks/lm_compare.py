"""Time to the same held-out quality: gossip_ext beside the systems a user would pick instead.

Every system (harness.compare.systems) trains the byte-level transformer of harness.tasks
on the standard library's sources with the same data order, seeds, batch size and schedule shape
(AdamW, warmup, cosine decay), each at its own peak learning rate (systems.PEAK_LR, from a sweep).
DDP runs --ddp-steps and its final held-out loss is the target; the others run --steps (twice as
many by default), so that a system needing more steps than DDP can still reach it, and the
question is who gets there first in wall-clock time. Every worker's held-out bits per byte is
measured every --eval-every steps, off the clock. The table gives, per system: the time a step
took, and whether it is bound by the CPU (within 1.3x of the same workers computing without any
communication, ``alone``: the floor no network can lower) or by communication; the bytes each
worker sent per step, read off its NIC's counters on the emulated network; the wall-clock time to
DDP's final held-out loss and to --target-bpb; the final held-out loss; the peak memory of a
worker. The communication-free bound is DDP's steps at ``alone``'s time a step: DDP's run had its
communication cost nothing. A goals table gives, per setting, the bound, the best gossip_ext mode's
time to DDP's final held-out loss as a multiple of it and the best peer's (the first of DDP,
PowerSGD, decent-dp and torchft), and whether the goal (GOAL) is met.

    python benchmarks/lm_compare.py                                   # loopback, 2 workers
    python benchmarks/lm_compare.py --workers 4 8 --bandwidth 100mbit 1gbit  # as root
    python benchmarks/lm_compare.py --settings 4x100mbit 4x1gbit 8x1gbit

With --bandwidth, each worker runs in its own network namespace behind a NIC capped with tbf
(harness.netns); torchft's lighthouse runs in rank 0's namespace. Writes a plot of held-out
bits per byte against time (--plot), every result with its held-out history (--rows, JSON) and,
unless --no-record, rewrites this benchmark's section of benchmarks/RESULTS.md.
--from-rows FILE reports a saved run again (table, goals, plot, RESULTS.md) without running it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import results  # noqa: E402  (benchmarks/results.py)

from harness import netns  # noqa: E402
from harness.compare import report, runner, systems  # noqa: E402
from harness.tasks.byte_lm import ByteLMConfig  # noqa: E402

TITLE = "Time to the same held-out quality: gossip_ext beside DDP, PowerSGD, decent-dp, torchft"
# What this comparison runs unless --systems says otherwise: every system but the DiLoCos that
# diloco_compare.py and streaming_compare.py run at their own H (torchft's DiLoCo stays, at
# H = 4: the bar for gossip_ext's own) and the asynchronous modes that heterogeneous.py runs
# beside the lockstep systems, on a uniform cluster too.
SYSTEMS = tuple(
    s
    for s in systems.ALL
    if not s.startswith(("diloco", "streaming_diloco", "torchft_streaming", "async_"))
)
# The goals, on every setting: gossip_ext's best system to DDP's final held-out loss within
# GOAL_OF_BOUND of the communication-free bound (report.bound) and within GOAL_OF_PEER of the best
# peer's time (the first of DDP, PowerSGD, decent-dp and torchft to it).
GOAL_OF_BOUND = 1.15
GOAL_OF_PEER = 0.6
GOAL = f"<= {GOAL_OF_BOUND}x the bound, <= {GOAL_OF_PEER}x the best peer"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=systems.ALL)
    p.add_argument("--workers", nargs="+", type=int, default=[2])
    p.add_argument(
        "--settings",
        nargs="+",
        metavar="WORKERSxRATE",
        help="settings to run instead of every --workers with every --bandwidth, e.g. "
        "4x100mbit 8x1gbit (needs root)",
    )
    p.add_argument(
        "--bandwidth", nargs="+", default=[], help="NIC rates, e.g. 1gbit 100mbit (needs root)"
    )
    p.add_argument("--steps", type=int, default=960, help="steps of every system but DDP")
    p.add_argument(
        "--ddp-steps",
        type=int,
        help="DDP's steps; its final held-out loss is the target (default: half of --steps, so "
        "that a system needing more steps than DDP can still reach it)",
    )
    p.add_argument("--eval-every", type=int, default=30)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument(
        "--lr", type=float, help="one peak learning rate for all (default: each system's own)"
    )
    p.add_argument(
        "--outer-lr", type=float, default=systems.Recipe.outer_lr, help="DiLoCo's outer lr"
    )
    p.add_argument(
        "--outer-momentum",
        type=float,
        default=systems.Recipe.outer_momentum,
        help="DiLoCo's outer momentum (Nesterov)",
    )
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--local-steps", type=int, default=4, help="H of LocalSGD, SlowMo, DiLoCo")
    p.add_argument("--target-bpb", type=float, default=3.1)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--plot", default="/tmp/gossip_lm_compare.png")
    p.add_argument("--rows", default="/tmp/gossip_lm_compare.json", help="write every result here")
    p.add_argument("--from-rows", metavar="FILE", help="report the run saved in FILE again")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.ddp_steps = args.ddp_steps or args.steps // 2
    for name in ("steps", "ddp_steps", "eval_every", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.steps, args.ddp_steps) <= args.warmup:
        p.error(f"--steps and --ddp-steps must exceed --warmup ({args.warmup})")
    try:
        rates = [netns.parse_rate(b) for b in args.bandwidth] or [None]
    except ValueError as e:
        p.error(f"--bandwidth: {e}")
    args.settings_parsed = [(w, r) for w in args.workers for r in rates]
    if args.settings:
        args.settings_parsed = parse_settings(p, args.settings)
    if any(w < 1 for w, _ in args.settings_parsed):
        p.error(f"--workers must be >= 1, got {args.workers}")
    return args


def parse_settings(p: argparse.ArgumentParser, texts) -> list[tuple[int, float]]:
    """--settings as (workers, NIC rate in bits/s) pairs; a malformed one is a usage error."""
    settings = []
    for text in texts:
        workers, _, rate = text.partition("x")
        try:
            settings.append((int(workers), netns.parse_rate(rate)))
        except ValueError as e:
            p.error(f"--settings: {text!r} is not WORKERSxRATE like 4x100mbit ({e})")
    return settings


def first(rows, names, target: float, ddp_time: float) -> tuple[float | None, str]:
    """The first of ``names`` to ``target``: when, and as a table cell with its ratio to DDP."""
    if not any(name in rows for name in names):
        return None, "not run"
    found = report.best(rows, names, target)
    if found is None:
        return None, "not reached"
    name, t = found
    return t, f"{name} {t:.1f} s ({t / ddp_time:.2f}x)"


def goals(all_rows: dict[tuple[int, float | None], dict[str, dict]]) -> str:
    """The issue's goals (GOAL) on every setting with a DDP row: the communication-free bound,
    gossip_ext's best system's time to DDP's final held-out loss and its multiple of the bound,
    the best peer's (DDP's included), whether both goals are met and, behind 100 Mbit/s NICs,
    whether a sparse DiLoCo was the first to it (:func:`sparse_first`)."""
    lines = [
        "| setting | goal | communication-free bound | best gossip_ext mode (x bound) "
        "| best peer (x DDP) | met | a sparse DiLoCo first (100 Mbit/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (workers, rate), rows in all_rows.items():
        if "ddp" not in rows:
            continue
        target = rows["ddp"]["final_bpb"]
        ddp_time = report.time_to(rows["ddp"], target)
        floor = report.bound(rows)
        ours = report.best(rows, report.gossip_rows(rows), target)
        # DDP reaches its own final loss: there is always a best peer.
        peer = report.best(rows, report.peer_rows(rows), target)
        if ours is None:
            ours_text = "not run" if not report.gossip_rows(rows) else "not reached"
        else:
            ours_text = f"{ours[0]} {ours[1]:.1f} s" + (
                "" if floor is None else f" ({ours[1] / floor:.2f}x)"
            )
        met = "-"
        if floor is not None:
            ok = ours is not None and ours[1] <= min(GOAL_OF_BOUND * floor, GOAL_OF_PEER * peer[1])
            met = "yes" if ok else "no"
        lines.append(
            f"| {_setting(workers, rate)} | {GOAL} | "
            + ("no `alone` row" if floor is None else f"{floor:.1f} s")
            + f" | {ours_text} | {peer[0]} {peer[1]:.1f} s ({peer[1] / ddp_time:.2f}x) | {met} "
            f"| {sparse_first(rows) if rate == 1e8 else '-'} |"
        )
    return "\n".join(lines)


def _sparse(name: str) -> bool:
    """Whether a row is a sparse DiLoCo (top-k outer messages)."""
    return any(word in report.system_of(name) for word in ("sparse", "topk"))


def sparse_first(rows: dict[str, dict]) -> str:
    """Whether a sparse DiLoCo was the first system to DDP's final held-out loss in ``rows``:
    "not run" where none ran, else yes or no with its time (and the first's, if not it)."""
    names = [name for name in rows if _sparse(name)]
    if not names:
        return "not run"
    target = rows["ddp"]["final_bpb"]
    first_one, ours = report.fastest(rows, target), report.best(rows, names, target)
    if ours is None:
        return f"no: not reached; {first_one[0]} first, {first_one[1]:.1f} s"
    if _sparse(first_one[0]):  # DDP reaches its own final loss: there is always a first
        return f"yes: {ours[0]} {ours[1]:.1f} s"
    return f"no: {ours[0]} {ours[1]:.1f} s; {first_one[0]} first, {first_one[1]:.1f} s"


def _setting(workers: int, rate: float | None) -> str:
    return f"{workers} workers, " + ("loopback" if rate is None else netns.format_rate(rate))


def save_rows(path: str, protocol: runner.Protocol, all_rows) -> None:
    """The run, as the report reads it: the protocol and every setting's results."""
    run = {
        "protocol": dataclasses.asdict(protocol),
        "settings": [{"workers": w, "rate": r, "rows": rows} for (w, r), rows in all_rows.items()],
    }
    with open(path, "w") as f:
        json.dump(run, f)
    print(f"results written to {path}")


def load_rows(path: str):
    with open(path) as f:
        run = json.load(f)
    fields = run["protocol"]
    protocol = runner.Protocol(**{**fields, "model": ByteLMConfig(**fields["model"])})
    all_rows = {(s["workers"], s["rate"]): s["rows"] for s in run["settings"]}
    return protocol, all_rows


def systems_table(all_rows, target_bpb: float | None) -> str:
    """RESULTS.md's table of a run: a row per system, a column per setting, each cell the time to
    DDP's final held-out loss (its multiple of DDP's), to ``target_bpb``, a step's time, what a
    worker sent a step and the final held-out loss. benchmarks/results.py's summary reads the
    first of these in every cell."""
    names = list(dict.fromkeys(name for rows in all_rows.values() for name in rows))
    header = ["system", "lr", *(_setting(w, r) for w, r in all_rows)]
    lines = [
        "Each cell: the time to DDP's final held-out loss (its multiple of DDP's); "
        + ("" if target_bpb is None else f"to {target_bpb:.2f} bpb; ")
        + "the time of a step; what each worker sent a step; the final held-out bits per byte. "
        "The run prints each setting's full table, with what bounds each step and a worker's "
        "peak memory, and saves every result (--rows).",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]

    def seconds(t: float | None) -> str:
        return "not reached" if t is None else f"{t:.1f} s"

    for name in names:
        lr, cells = next(rows[name]["lr"] for rows in all_rows.values() if name in rows), []
        for rows in all_rows.values():
            r, ddp = rows.get(name), rows.get("ddp")
            if r is None:
                cells.append("not run")
                continue
            to_ddp = "-"
            if ddp is not None:
                target = ddp["final_bpb"]
                t, ddp_time = report.time_to(r, target), report.time_to(ddp, target)
                ratio = f" ({t / ddp_time:.2f}x)" if t is not None and ddp_time else ""
                to_ddp = seconds(t) + ratio
            wire = r["wire_bytes_per_step"]
            cell = [to_ddp]
            if target_bpb is not None:
                cell.append(seconds(report.time_to(r, target_bpb)))
            cell += [
                f"{r['step_ms']:.0f} ms",
                "-" if wire is None else f"{wire / 1e6:.2f} MB",
                f"{r['final_bpb']:.3f}",
            ]
            cells.append("; ".join(cell))
        lines.append(f"| {name} | {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_settings(all_rows, target_bpb: float, plot: str, echo: bool = True):
    """Every setting's full table (printed if ``echo``), the table of systems across settings as
    a RESULTS.md subsection, the plot of them all at ``plot``, and the model's parameter count:
    what every comparison reports alike."""
    for (workers, rate), rows in all_rows.items():
        if echo:
            print(f"\n{_setting(workers, rate)}\n{report.table(rows, target_bpb)}\n", flush=True)
    report.plot({_setting(w, r): rows for (w, r), rows in all_rows.items()}, plot)
    params = next(iter(next(iter(all_rows.values())).values()))["params"]
    return [f"### Every system\n\n{systems_table(all_rows, target_bpb)}"], params


def report_all(args, protocol: runner.Protocol, all_rows, echo: bool) -> None:
    """Tables (printed if ``echo``), goals and plot of a run; into RESULTS.md unless --no-record."""
    sections, params = report_settings(all_rows, args.target_bpb, args.plot, echo)
    goal_table = goals(all_rows)
    print(goal_table)
    body = (
        protocol.describe(params)
        + f" A step within {report.CPU_BOUND}x of the workers computing alone (`alone`) is "
        "bound by the CPU, otherwise by communication. The communication-free bound: DDP's "
        "steps at `alone`'s time a step.\n\n"
        + ("### Goals\n\n" + goal_table + "\n\n" if "|---|" in goal_table else "")
        + "\n\n".join(sections)
    )
    if not args.no_record:
        results.record(TITLE, body)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_rows:
        protocol, all_rows = load_rows(args.from_rows)
        report_all(args, protocol, all_rows, echo=True)
        return all_rows
    networked = any(rate is not None for _, rate in args.settings_parsed)
    if networked and (why := netns.unavailable()):
        sys.exit(f"--bandwidth needs an emulated network: {why}")
    protocol = runner.Protocol(
        steps=args.steps,
        ddp_steps=args.ddp_steps,
        model=ByteLMConfig(layers=args.layers, width=args.width, heads=4, context=args.context),
        batch_size=args.batch_size,
        warmup=args.warmup,
        local_steps=args.local_steps,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        lr=args.lr,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    all_rows: dict[tuple[int, float | None], dict[str, dict]] = {}
    for workers, rate in args.settings_parsed:
        rows = runner.run_systems(args.systems, protocol, workers, rate, args.timeout)
        all_rows[(workers, rate)] = rows
        print(f"\n{_setting(workers, rate)}\n{report.table(rows, args.target_bpb)}\n", flush=True)
        save_rows(args.rows, protocol, all_rows)  # after each setting: a long run keeps its part
    report_all(args, protocol, all_rows, echo=False)
    return all_rows


if __name__ == "__main__":
    main()
