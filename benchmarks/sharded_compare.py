"""Sharded replicas: gossip_ext's SGP and DiLoCo between replicas beside torch's HSDP.

2 replicas x 2 shards (4 processes): the byte-level language model of harness.tasks sharded by
FSDP2 over each replica's two processes, every block its own unit (harness.compare.sharded).
With --bandwidth (as root) each replica's processes share a network namespace, so FSDP2's
traffic stays inside it, and the replicas' namespaces are joined through NICs capped with tbf
(harness.netns): each replica one machine behind a 100 Mbit/s or 1 Gbit/s link.

The systems: torch's HSDP (``fully_shard`` on the 2-D mesh, the gradients all-reduced across
replicas every step: the baseline), gossip_ext's overlapped SGP between replicas in full
precision and in bfloat16 messages, gossip_ext's DiLoCo, torchft 0.2.0's DiLoCo over the same
shards (its HSDP with DiLoCo), and ``alone`` (each replica trains by itself: the floor of every
step). The protocol is benchmarks/lm_compare.py's: the same data order and seeds, AdamW with
warmup and cosine decay at each system's peak learning rate; HSDP runs --hsdp-steps and its final
held-out loss is the target, the others --steps; the headline is the wall-clock time to HSDP's
final held-out loss. Both DiLoCos take diloco_compare.py's outer Nesterov SGD at H = --sync-every.

    python benchmarks/sharded_compare.py                        # as root: 100 Mbit/s and 1 Gbit/s
    python benchmarks/sharded_compare.py --loopback --steps 40  # anywhere: a quick look

Prints a table per setting; writes every result (--rows, JSON) after each system, and, unless
--no-record, this benchmark's section of benchmarks/RESULTS.md (--from-rows FILE: report a saved
run again without running it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import diloco_compare  # noqa: E402  (its outer step, tuned)
import results  # noqa: E402  (benchmarks/results.py)

from harness import netns  # noqa: E402
from harness.compare import report, sharded, systems  # noqa: E402
from harness.tasks.byte_lm import ByteLMConfig  # noqa: E402

TITLE = "Sharded replicas: gossip_ext's SGP and DiLoCo between replicas beside torch's HSDP"
BASELINE = "hsdp"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(sharded.SYSTEMS), choices=sharded.SYSTEMS)
    p.add_argument("--bandwidth", nargs="+", default=["100mbit", "1gbit"], help="NIC rates")
    p.add_argument("--loopback", action="store_true", help="run on loopback (no root needed)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--steps", type=int, default=960, help="steps of every system but HSDP")
    p.add_argument("--hsdp-steps", type=int, help="HSDP's (default: half of --steps)")
    p.add_argument("--eval-every", type=int, default=30)
    p.add_argument("--eval-windows", type=int, default=64)
    # Width 256 (1.66M parameters, 6.6 MB in fp32): a replica's step on this machine's two cores
    # is about 0.2 s, and HSDP's all-reduce of one model a step takes 0.53 s at 100 Mbit/s and
    # 0.05 s at 1 Gbit/s: the link, not the cores, sets the pace at 100 Mbit/s, and is a quarter
    # of the step at 1 Gbit/s. At width 128 FSDP2's own collectives (gloo, four processes on two
    # cores) cost more than the model's compute; at width 384 a step takes 0.7 s of CPU.
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="per process (a replica: x shards)")
    p.add_argument("--lr", type=float, help="one peak lr for all (default: sharded.PEAK_LR)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--sync-every", type=int, default=16, help="H of both DiLoCos")
    p.add_argument("--outer-lr", type=float, default=diloco_compare.OUTER_LR)
    p.add_argument("--outer-momentum", type=float, default=diloco_compare.OUTER_MOMENTUM)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system")
    p.add_argument("--rows", default="/tmp/gossip_sharded_compare.json")
    p.add_argument("--from-rows", metavar="FILE", help="report the run saved in FILE again")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.hsdp_steps = args.hsdp_steps or args.steps // 2
    for name in ("steps", "hsdp_steps", "eval_every", "batch_size", "sync_every", "replicas"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.replicas < 2 or args.shards < 1:
        p.error(f"--replicas must be >= 2 and --shards >= 1, got {args.replicas}x{args.shards}")
    if min(args.steps, args.hsdp_steps) <= args.warmup:
        p.error(f"--steps and --hsdp-steps must exceed --warmup ({args.warmup})")
    try:
        args.rates = [None] if args.loopback else [netns.parse_rate(b) for b in args.bandwidth]
    except ValueError as e:
        p.error(f"--bandwidth: {e}")
    return args


def config(args, system: str) -> sharded.ShardedConfig:
    """``system``'s run under the protocol of ``args``."""
    recipe = systems.Recipe(
        steps=args.hsdp_steps if system == BASELINE else args.steps,
        lr=args.lr or sharded.PEAK_LR[system],
        warmup=args.warmup,
        local_steps=args.sync_every,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )
    return sharded.ShardedConfig(
        system=system,
        recipe=recipe,
        model=ByteLMConfig(layers=args.layers, width=args.width, heads=4, context=args.context),
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        replicas=args.replicas,
        shards=args.shards,
    )


def setting(args, rate: float | None) -> str:
    where = "loopback" if rate is None else netns.format_rate(rate)
    return f"{args.replicas} replicas x {args.shards} shards, {where}"


def _to_target(rows: dict[str, dict], name: str) -> str:
    """The time to HSDP's final held-out loss, with its multiple of HSDP's."""
    if BASELINE not in rows:
        return "-"
    target = rows[BASELINE]["final_bpb"]
    t, base = report.time_to(rows[name], target), report.time_to(rows[BASELINE], target)
    if t is None:
        return "not reached"
    return f"{t:.1f} s" + (f" ({t / base:.2f}x)" if base else "")


def _sent(row: dict) -> str:
    wire = row["wire_bytes_per_step"]
    return "-" if wire is None else f"{wire / 1e6:.2f} MB"


def table(rows: dict[str, dict]) -> str:
    """A setting's table: a row per system."""
    target = f" {rows[BASELINE]['final_bpb']:.3f} bpb" if BASELINE in rows else ""
    alone = rows["alone"]["step_ms"] if "alone" in rows else None
    lines = [
        f"| system | lr | steps | ms/step | bound by | sent/replica/step | to HSDP's final{target} "
        "| final bpb |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        bound = "-"
        if alone is not None and name != "alone":
            bound = "CPU" if r["step_ms"] <= report.CPU_BOUND * alone else "communication"
        lines.append(
            f"| {name} | {r['lr']:g} | {r['history']['step'][-1]} | {r['step_ms']:.0f} | {bound} "
            f"| {_sent(r)} | {_to_target(rows, name)} | {r['final_bpb']:.3f} |"
        )
    return "\n".join(lines)


def section(args, all_rows: dict[str, dict[str, dict]]) -> str:
    """RESULTS.md's body: a line of protocol and a row per setting, a column per system (the
    file is near its limit of lines, so the table lies on its side)."""
    names = list(dict.fromkeys(n for rows in all_rows.values() for n in rows))
    params = next(iter(next(iter(all_rows.values())).values()))["params"]
    lines = [
        f"Byte-level transformer of {params / 1e6:.2f}M parameters ({args.layers} layers, width "
        f"{args.width}, context {args.context}), each block an FSDP2 unit; {args.replicas} "
        f"replicas x {args.shards} shards, each replica's processes in one namespace, batch "
        f"{args.batch_size} per process. HSDP runs {args.hsdp_steps} steps, its final held-out "
        f"loss the target; the others {args.steps}. DiLoCo (gossip_ext's and torchft's): H = "
        f"{args.sync_every}, outer Nesterov SGD lr {args.outer_lr:g}, momentum "
        f"{args.outer_momentum:g}. Each cell: the time to HSDP's final held-out loss (its "
        "multiple of HSDP's); ms a step; what a replica sent a step; the final held-out bits per "
        "byte.",
        "",
        "| setting | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for where, rows in all_rows.items():
        cells = [
            "not run"
            if n not in rows
            else f"{_to_target(rows, n)}; {rows[n]['step_ms']:.0f} ms; {_sent(rows[n])}; "
            f"{rows[n]['final_bpb']:.3f}"
            for n in names
        ]
        lines.append(f"| {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_rows(path: str, args, all_rows) -> None:
    with open(path, "w") as f:
        json.dump({"args": vars(args), "settings": all_rows}, f)


def load_rows(path: str, args):
    """A saved run's results by setting, and its arguments (its protocol) in place of ``args``'
    but for what only concerns reporting it."""
    with open(path) as f:
        saved = json.load(f)
    keep = {"rows", "from_rows", "no_record"}
    for name, value in saved["args"].items():
        if name not in keep:
            setattr(args, name, value)
    return saved["settings"]


def report_all(args, all_rows) -> None:
    for where, rows in all_rows.items():
        print(f"\n{where}\n{table(rows)}\n", flush=True)
    if not args.no_record and all_rows:
        results.record(TITLE, section(args, all_rows))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_rows:
        all_rows = load_rows(args.from_rows, args)
        report_all(args, all_rows)
        return all_rows
    if not args.loopback and (why := netns.unavailable()):
        sys.exit(f"the emulated network is unavailable ({why}); --loopback runs without it")
    all_rows: dict[str, dict[str, dict]] = {}
    for rate in args.rates:
        rows = all_rows.setdefault(setting(args, rate), {})
        for name in args.systems:
            why_not = sharded.available(name)
            if why_not:
                print(f"left out: {why_not}", flush=True)
                continue
            started = time.monotonic()
            rows[name] = sharded.run(config(args, name), rate, args.timeout)
            print(
                f"{setting(args, rate)}: {name:>20}: {rows[name]['step_ms']:6.0f} ms/step, "
                f"held-out {rows[name]['final_bpb']:.3f} bits per byte "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
            save_rows(args.rows, args, all_rows)  # a long run keeps what it measured
    report_all(args, all_rows)
    return all_rows


if __name__ == "__main__":
    main()
