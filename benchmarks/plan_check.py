"""The planner (gossip_ext.plan) against this machine: its predicted step times and goodputs for
the systems of a run of benchmarks/heterogeneous.py, beside what that run measured.

    python benchmarks/heterogeneous.py --bandwidth 100mbit --rows ROWS   # as root
    python benchmarks/plan_check.py --rows ROWS [--bandwidth 100mbit] [--workers 4]

The planner is given what a user would give it: the parameters, the link's rate, the workers, and
the step time of the model alone (the run's ``alone`` system on the same cluster: its odd worker's
step gives the slowdown or the share stopped); the
kernels' memory bandwidth is ``--kernel-gbytes``. Each system of the run is the planner's mode
that describes it (MODES). Goals: every predicted step time within GOAL_STEP of the measured one
(the mean over the workers that are not the odd one), every goodput within GOAL_GOODPUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import heterogeneous  # noqa: E402  (benchmarks/heterogeneous.py: its clusters)
import results  # noqa: E402  (benchmarks/results.py)

from gossip_ext.plan import DDP, SGP, AsyncSGP, Cluster, Mode, Model, Periodic  # noqa: E402
from harness import netns  # noqa: E402
from harness.compare import uneven_report as measure  # noqa: E402

TITLE = "The planner against this machine: predicted and measured step times and goodput"
GOAL_STEP = 0.15
GOAL_GOODPUT = 0.05
# The byte-level model's width (harness.tasks.byte_lm), which sets PowerSGD's matrices.
WIDTH = 128
# Each system of the run, as the planner's mode. PowerSGD runs in one bucket there (with several,
# gloo's collectives interleave); decent-dp's D-PSGD sends its model to one peer of the
# exponential graph a step, overlapped, as overlap SGP in float32 does; torchft's at H = 4.
MODES: dict[str, Mode] = {
    "ddp": DDP(),
    "powersgd_r4": DDP(powersgd_rank=4, bucket_bytes=float("inf")),
    "decent_dp": SGP("float32", overlap=True),
    "torchft_localsgd": Periodic("LocalSGD", 4),
    "torchft_diloco": Periodic("DiLoCo", 4),
    "overlap_sgp_int8": SGP("int8", overlap=True),
    "async_sgp_int8": AsyncSGP("int8"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="a run of benchmarks/heterogeneous.py (--rows)")
    p.add_argument("--bandwidth", default="100mbit", help="the run's --bandwidth")
    p.add_argument("--workers", type=int, default=heterogeneous.DEFAULT_WORKERS)
    p.add_argument("--slowdown", type=float, default=2.0, help="the run's --slowdown")
    p.add_argument("--nic-slowdown", type=float, default=10.0, help="the run's --nic-slowdown")
    p.add_argument("--kernel-gbytes", type=float, default=10.0, help="this CPU's, GB/s")
    add_host_cpu_argument(p)
    p.add_argument(
        "--cpu-per-worker", type=float, default=0.5, help="the run's cap on each worker, cores"
    )
    p.add_argument(
        "--run",
        default="python benchmarks/heterogeneous.py --bandwidth 100mbit --cpu-per-worker 0.5 "
        "--systems " + " ".join(["alone", *MODES]) + " --repeats 1 --steps 320 --ddp-steps 160",
        help="the command that made --rows, said in the section",
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.host_cpu = host_cpu_seconds(args.host_cpu_ns)
    return args


def add_host_cpu_argument(p: argparse.ArgumentParser) -> None:
    """--host-cpu-ns, which plan_check and plan_grid both take."""
    p.add_argument(
        "--host-cpu-ns",
        default="measure",
        help="the CPU a byte sent or received costs, ns (gossip_ext.plan.measure."
        "host_seconds_per_byte), or 'measure' (default): timed now, on its own",
    )


def host_cpu_seconds(text: str) -> float:
    """The CPU seconds a byte sent or received costs: given in ns, or measured now."""
    if text == "measure":
        from gossip_ext.plan import measure

        return measure.host_seconds_per_byte()
    return float(text) * 1e-9


def cluster_of(setting: str, alone: list[dict], args: argparse.Namespace) -> Cluster:
    """The run's cluster ``setting`` as the planner describes it, the odd worker's slowness and
    stops read from ``alone``'s steps there, as a user would time their workers."""
    fast, odd = measure.step_ms(alone, slow=False), measure.step_ms(alone, slow=True)
    base = Cluster(
        workers=args.workers,
        link_bits=netns.parse_rate(args.bandwidth),
        kernel_bytes=args.kernel_gbytes * 1e9,
        host_seconds_per_byte=args.host_cpu / args.cpu_per_worker,
    )
    one = 1 / args.workers
    if setting == "slow" and odd:
        return dataclasses.replace(base, slow_fraction=one, slowdown=max(1.0, odd / fast))
    if setting == "slow_nic":
        return dataclasses.replace(base, slow_fraction=one, link_slowdown=args.nic_slowdown)
    if setting == "stalls" and odd:
        return dataclasses.replace(base, slow_fraction=one, stalled=max(0.0, 1 - fast / odd))
    return base


def measured_step(result: dict) -> float:
    """The mean step time, seconds, of the workers that are not the odd one (the median over a
    system's runs)."""
    return (
        statistics.median(measure.step_ms(records, slow=False) for records in measure.runs(result))
        / 1e3
    )


def predicted_step(mode: Mode, model: Model, cluster: Cluster) -> float:
    """The step time of the workers that are not the odd one: in lockstep, the odd one's pace
    over the slowest link; asynchronous, their own."""
    if mode.lockstep and cluster.slow_workers:
        return mode.step(model.slower(cluster.slowdown), cluster.slowest_link()).seconds
    return mode.step(model, cluster).seconds


def compare(rows: dict, args: argparse.Namespace) -> list[dict]:
    """One entry per system and cluster: the predicted and measured step and goodput, the model's
    step that of the workers alone on the same cluster."""
    params = rows["uniform"]["ddp"]["params"]
    found = []
    for setting in rows:
        alone = rows[setting]["alone"]["records"]
        model = Model(
            params=params, step_seconds=measure.step_ms(alone, slow=False) / 1e3, width=WIDTH
        )
        cluster = cluster_of(setting, alone, args)
        alone_here = measure.alone_step_seconds(alone)
        for system, mode in MODES.items():
            if system not in rows[setting]:
                continue
            result = rows[setting][system]
            found.append(
                {
                    "setting": setting,
                    "system": system,
                    "mode": mode.name,
                    "step": (predicted_step(mode, model, cluster), measured_step(result)),
                    "goodput": (
                        mode.goodput(model, cluster),
                        measure.median_goodput(result, alone_here),
                    ),
                }
            )
    return found


def table(found: list[dict]) -> str:
    lines = [
        "| cluster | system (the planner's mode) | step ms, predicted / measured | error | "
        "goodput, predicted / measured | difference |",
        "|---|---|---|---|---|---|",
    ]
    for f in found:
        (ps, ms), (pg, mg) = f["step"], f["goodput"]
        step_cells = "—" if f["setting"] == "stalls" else f"{ps * 1e3:.1f} / {ms * 1e3:.1f}"
        error = "—" if f["setting"] == "stalls" else f"{(ps - ms) / ms:+.0%}"
        lines.append(
            f"| {heterogeneous.NAMES[f['setting']]} | {f['system']} ({f['mode']}) | "
            f"{step_cells} | {error} | {pg:.2f} / {mg:.2f} | {pg - mg:+.2f} |"
        )
    return "\n".join(lines)


def goals(found: list[dict]) -> str:
    # Stalled workers' step times include their stops: their clusters are read by goodput only.
    steps = [f for f in found if f["setting"] != "stalls"]
    missed_steps = [
        f"{f['system']} ({heterogeneous.NAMES[f['setting']]}, {(p - m) / m:+.0%})"
        for f in steps
        for p, m in [f["step"]]
        if abs(p - m) > GOAL_STEP * m
    ]
    missed_goodputs = [
        f"{f['system']} ({heterogeneous.NAMES[f['setting']]}, {p - m:+.2f})"
        for f in found
        for p, m in [f["goodput"]]
        if abs(p - m) > GOAL_GOODPUT
    ]
    said = [
        f"Step time within {GOAL_STEP:.0%}: {len(steps) - len(missed_steps)} of {len(steps)}"
        + (f"; missed: {', '.join(missed_steps)}." if missed_steps else ", met."),
        f"Goodput within {GOAL_GOODPUT}: {len(found) - len(missed_goodputs)} of {len(found)}"
        + (f"; missed: {', '.join(missed_goodputs)}." if missed_goodputs else ", met."),
    ]
    return " ".join(said)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with open(args.rows) as f:
        rows = json.load(f)
    found = compare(rows, args)
    text = table(found)
    said = goals(found)
    print(f"a byte sent or received: {args.host_cpu * 1e9:.2f} ns of CPU\n\n{text}\n\n{said}")
    if not args.no_record:
        body = (
            f"A run of `{args.run}` (the protocol of the heterogeneous section above; "
            f"{args.workers} workers on 2 cores), each system beside the planner's "
            "mode for it, given the parameters, the link and the step of the model alone "
            "(`alone` on the same cluster, whose odd worker gives the slowdown or the share of "
            f"time stopped); kernels at {args.kernel_gbytes:g} GB/s; a byte sent or received "
            f"{args.host_cpu * 1e9:.2f} ns of CPU (`gossip_ext.plan.measure."
            "host_seconds_per_byte`, timed on its own) over the worker's "
            f"{args.cpu_per_worker:g} core. Step times: "
            "the mean over the workers but the odd one (medians over an asynchronous mode's "
            "runs); the stalling cluster is compared by goodput only.\n\n"
            f'Goals: {said} Why the misses: docs/scaling.md, "Checked against this '
            f'machine".\n\n{text}'
        )
        command = f"{args.run} --rows ROWS; python benchmarks/plan_check.py --rows ROWS"
        results.record(TITLE, body, command=command)
    return found


if __name__ == "__main__":
    main()
