"""The planner (gossip_ext.plan) against lm_compare's grid: its predicted step time and bytes a
step for every system of a run of benchmarks/lm_compare.py (4 and 8 workers behind 100 Mbit/s and
1 Gbit/s NICs), beside what that run measured.

    python benchmarks/lm_compare.py --settings 4x100mbit 8x100mbit 4x1gbit 8x1gbit \\
        --steps 120 --ddp-steps 120 --eval-every 60 --systems alone SYSTEMS... \\
        --rows ROWS --no-record                                          # as root
    python benchmarks/plan_grid.py --rows ROWS

The planner is given what a user would give it: the parameters, the link's rate, the workers and
the step of the model alone on the same cluster (the run's ``alone``, whose workers share the
machine's cores as the others' do); the kernels' memory bandwidth is ``--kernel-gbytes``. Each
system is the planner's mode that describes it (MODES). Goal: every predicted step time within
GOAL_STEP of the measured one (the mean over the workers); the bytes a step beside those the
workers' NICs counted (TCP/IP's headers and the few bytes of evaluation included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import plan_check  # noqa: E402  (benchmarks/plan_check.py: the host's cost, as it takes it)
import results  # noqa: E402  (benchmarks/results.py)

from gossip_ext.plan import DDP, SGP, Cluster, Mode, Model, Periodic, SparseLoCo  # noqa: E402
from harness import netns  # noqa: E402
from harness.compare import systems, tuning  # noqa: E402

TITLE = "The planner against lm_compare's grid: predicted and measured step times"
GOAL_STEP = 0.15
WIDTH = 128  # the byte-level model's width (harness.tasks.byte_lm): PowerSGD's matrices
H = 4  # lm_compare's --local-steps
# Each system of lm_compare, as the planner's mode (as benchmarks/plan_check.py's, and the rest).
MODES: dict[str, Mode] = {
    "ddp": DDP(),
    "powersgd_r4": DDP(powersgd_rank=4, bucket_bytes=float("inf")),
    "decent_dp": SGP("float32", overlap=True),
    "torchft_localsgd": Periodic("LocalSGD", H),
    "overlap_sgp_bf16": SGP("bfloat16", overlap=True),
    "overlap_sgp_int8": SGP("int8", overlap=True),
    "overlap_sgp_fp8": SGP("float8_e4m3fn", overlap=True),
    "sgp_int8": SGP("int8"),
    "localsgd": Periodic("LocalSGD", H),
    "diloco_topk2": SparseLoCo(H, density=tuning.SPARSE_DENSITY, bits=2),
}
COMMAND = (
    "python benchmarks/lm_compare.py --settings 4x100mbit 8x100mbit 4x1gbit 8x1gbit --steps 120 "
    "--ddp-steps 120 --eval-every 60 --systems alone " + " ".join(MODES) + " --rows ROWS "
    "--no-record; python benchmarks/plan_grid.py --rows ROWS"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", required=True, help="a run of benchmarks/lm_compare.py (--rows)")
    p.add_argument("--kernel-gbytes", type=float, default=10.0, help="this CPU's, GB/s")
    plan_check.add_host_cpu_argument(p)
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="the run's machine's")
    p.add_argument("--no-record", action="store_true")
    return p.parse_args(argv)


def setting_name(workers: int, rate: float) -> str:
    return f"{workers} x {netns.format_rate(rate)}"


def predicted(
    system: str, mode: Mode, model: Model, cluster: Cluster, protocol: dict
) -> tuple[float, float]:
    """The mean step (seconds) and bytes a step the planner gives ``system`` over the run's
    steps: PowerSGD's hook all-reduces plainly, as DDP, for its first steps (its warm start)."""
    step, sent = mode.step(model, cluster).seconds, mode.bytes_per_step(model, cluster)
    if system.startswith("powersgd"):
        steps = protocol["steps"]
        plain = min(steps, systems.powersgd_start(protocol["warmup"]))
        ddp = DDP(bucket_bytes=float("inf"))
        step = (plain * ddp.step(model, cluster).seconds + (steps - plain) * step) / steps
        sent = (plain * ddp.bytes_per_step(model, cluster) + (steps - plain) * sent) / steps
    return step, sent


def compare(run: dict, kernel_bytes: float, host_cpu: float = 0.0, cores: int = 1) -> list[dict]:
    """One entry per setting and system: the predicted and measured step (seconds) and bytes a
    step (None where the run counted none). ``host_cpu``, the CPU a byte sent or received costs,
    is paid on the ``cores`` that every worker of the setting shares: a worker's share of them,
    ``cores / workers``, turns it into time of its step."""
    found = []
    for setting in run["settings"]:
        rows, workers, rate = setting["rows"], setting["workers"], setting["rate"]
        if "alone" not in rows:
            continue
        alone = rows["alone"]
        model = Model(params=alone["params"], step_seconds=alone["step_ms"] / 1e3, width=WIDTH)
        share = min(1.0, cores / workers)
        cluster = Cluster(
            workers=workers,
            link_bits=rate,
            kernel_bytes=kernel_bytes,
            host_seconds_per_byte=host_cpu / share,
        )
        for system, mode in MODES.items():
            if system not in rows:
                continue
            result = rows[system]
            step, sent = predicted(system, mode, model, cluster, run["protocol"])
            found.append(
                {
                    "setting": setting_name(workers, rate),
                    "system": system,
                    "mode": mode.name,
                    "step": (step, result["step_ms"] / 1e3),
                    "bytes": (sent, result.get("wire_bytes_per_step")),
                }
            )
    return found


def table(found: list[dict]) -> str:
    settings = list(dict.fromkeys(f["setting"] for f in found))
    lines = [
        "| system (the planner's mode) | " + " | ".join(settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for system in dict.fromkeys(f["system"] for f in found):
        cells = []
        for setting in settings:
            f = next((f for f in found if f["system"] == system and f["setting"] == setting), None)
            if f is None:
                cells.append("-")
                continue
            (ps, ms), (pb, mb) = f["step"], f["bytes"]
            sent = "" if mb is None else f"; {pb / 1e6:.2f} / {mb / 1e6:.2f} MB"
            cells.append(f"{ps * 1e3:.0f} / {ms * 1e3:.0f} ms ({(ps - ms) / ms:+.0%}){sent}")
        mode = next(f["mode"] for f in found if f["system"] == system)
        lines.append(f"| {system} ({mode}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goals(found: list[dict]) -> str:
    missed = [
        f"{f['system']} ({f['setting']}, {(p - m) / m:+.0%})"
        for f in found
        for p, m in [f["step"]]
        if abs(p - m) > GOAL_STEP * m
    ]
    return f"Step time within {GOAL_STEP:.0%}: {len(found) - len(missed)} of {len(found)}" + (
        f"; missed: {', '.join(missed)}." if missed else ", met."
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with open(args.rows) as f:
        run = json.load(f)
    host_cpu = plan_check.host_cpu_seconds(args.host_cpu_ns)
    found = compare(run, args.kernel_gbytes * 1e9, host_cpu, args.cores)
    text, said = table(found), goals(found)
    print(f"a byte sent or received: {host_cpu * 1e9:.2f} ns of CPU\n\n{text}\n\n{said}")
    if not args.no_record:
        body = (
            "A run of lm_compare's systems (its protocol: the byte-level transformer of 0.44M "
            "parameters, batch 8, one thread a worker, the workers on the machine's 2 cores; 120 "
            "steps each) on its four settings, each system beside the planner's mode for it, "
            "given the parameters, the link and the step of the workers alone on the same "
            f"setting (`alone`); kernels at {args.kernel_gbytes:g} GB/s; a byte sent or "
            f"received {host_cpu * 1e9:.2f} ns of CPU (`gossip_ext.plan.measure."
            "host_seconds_per_byte`, timed on its own), over each worker's share of the "
            f"{args.cores} cores. Each cell: the step, "
            "predicted / measured (the error); the bytes a worker sent a step, predicted / "
            "counted on its NIC.\n\n"
            f'Goal: {said} Why the misses: docs/scaling.md, "Checked against this machine".'
            f"\n\n{text}"
        )
        results.record(TITLE, body, command=COMMAND)
    return found


if __name__ == "__main__":
    main()
