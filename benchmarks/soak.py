"""Soak: thousands of gossip rounds in a row; memory stays flat, weights sum to n, nothing hangs.

    python benchmarks/soak.py --rounds 10000 --steps 2000

A reliability run, not a speed comparison (no peer runs beside it). At n = 4:

- in-process: --rounds pure gossip rounds of four engines over the in-process transport, one
  Python thread per rank, float64 and float32 parameters (--numel each), per-rank self weights
  (so the push-sum weights move and travel), and, as gossip_ext.simulate runs it, uniform lazy
  mixing sending in place. Every --inproc-check-every rounds, with every rank idle: the sum of
  the push-sum weights against n, the mean of the numerators x = w * z against the initial mean
  (mass conservation) and the process's resident set (VmRSS).
- gloo: four processes train a small MLP for --steps steps with GossipDataParallel (per-rank
  SelfWeightMixing) in synchronous SGP, overlap SGP, bounded asynchrony (synch_freq=2) and
  synchronous SGP in float64. Every --gloo-check-every steps each rank absorbs its round, samples
  its own resident set and all-reduces its weight.

RSS growth is the largest sample after the warm-up (--warmup-fraction of the run) minus the
sample at its end, per process. The run fails (exit status 1) if any growth exceeds
--rss-bound-mib, the weight sum or the mean numerator leaves its tolerance (1e-9 for float64
weights, 1e-5 for float32), a rank completes a different number of rounds, or the weights never
leave 1. Every engine times out waiting for a peer (--timeout) and the threads and processes are
joined against a deadline, so a deadlock fails the run instead of hanging it.

The loops live in tests/soak_loops.py, shared with tests/test_soak.py (the short run CI does).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from results import record

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)
from soak_loops import GLOO_MODES, SoakRun, soak_gloo, soak_inproc  # noqa: E402

# In-process configurations: (uniform mixing, dtype).
INPROC_CONFIGS = [
    (False, torch.float64),
    (False, torch.float32),
    (True, torch.float64),
    (True, torch.float32),
]


def _weights(run: SoakRun) -> str:
    return " ".join(f"{w:.4f}" for w in run.final_weights)


def format_table(runs: list[SoakRun]) -> str:
    lines = [
        "| run | ranks | rounds | wall s | rounds/s | RSS at warm-up end MiB | RSS growth after "
        "warm-up MiB (per process) | max weight-sum error | mass error / consensus error | "
        "tolerance | "
        "final weights |",
        "|" + "---|" * 11,
    ]
    for run in runs:
        baseline = "/".join(f"{samples[0][1]:.1f}" for samples in run.rss)
        growth = "/".join(f"{g:.3f}" for g in run.rss_growth_mib())
        mass = "n/a (training)"
        if run.mass_error is not None:
            mass = f"{run.mass_error:.2e} / {run.consensus_error:.2e}"
        lines.append(
            f"| {run.name} | {run.world_size} | {run.rounds} | {run.wall_s:.1f} | "
            f"{run.rounds / run.wall_s:.0f} | {baseline} | {growth} | "
            f"{run.weight_sum_error:.2e} | {mass} | {run.tolerance:g} | {_weights(run)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=10_000, help="in-process rounds, 0 skips (default: 10000)"
    )
    parser.add_argument(
        "--steps", type=int, default=2_000, help="gloo steps per mode, 0 skips (default: 2000)"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(GLOO_MODES),
        default=list(GLOO_MODES),
        help="gloo modes (default: all)",
    )
    parser.add_argument(
        "--numel", type=int, default=4096, help="in-process parameters per rank (default: 4096)"
    )
    parser.add_argument(
        "--inproc-check-every",
        type=int,
        help="rounds between checks (default: 100, fewer for runs under 2000 rounds)",
    )
    parser.add_argument(
        "--gloo-check-every",
        type=int,
        help="steps between checks (default: 100, fewer for runs under 2000 steps)",
    )
    parser.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.1,
        help="share of each run before the RSS baseline (default: 0.1)",
    )
    parser.add_argument(
        "--rss-bound-mib",
        type=float,
        default=4.0,
        help="largest RSS growth after the warm-up that passes (default: 4)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a round waits for a peer before raising (default: 60)",
    )
    parser.add_argument(
        "--no-record", action="store_true", help="do not append the results to RESULTS.md"
    )
    args = parser.parse_args(argv)
    if args.rounds < 0 or args.steps < 0 or args.rounds + args.steps == 0:
        parser.error("--rounds and --steps must be >= 0 and not both 0")
    if not 0.0 <= args.warmup_fraction < 1.0:
        parser.error(f"--warmup-fraction must be in [0, 1), got {args.warmup_fraction}")

    # At least 20 checks per run by default, so that a short run still sees a trend.
    if args.inproc_check_every is None:
        args.inproc_check_every = min(100, max(1, args.rounds // 20))
    if args.gloo_check_every is None:
        args.gloo_check_every = min(100, max(1, args.steps // 20))

    runs: list[SoakRun] = []
    if args.rounds:
        warmup = int(args.rounds * args.warmup_fraction)
        for uniform, dtype in INPROC_CONFIGS:
            runs.append(
                soak_inproc(
                    args.rounds,
                    dtype,
                    uniform=uniform,
                    numel=args.numel,
                    check_every=args.inproc_check_every,
                    warmup=warmup,
                    timeout_s=args.timeout,
                )
            )
            print(format_table(runs[-1:]).splitlines()[-1], flush=True)
    if args.steps:
        runs += soak_gloo(
            args.steps,
            args.modes,
            check_every=args.gloo_check_every,
            warmup=int(args.steps * args.warmup_fraction),
            timeout_s=args.timeout,
        )

    table = format_table(runs)
    problems = [p for run in runs for p in run.problems(args.rss_bound_mib)]
    verdict = (
        "All runs held: RSS growth within the bound, weight sums and numerator means within "
        "tolerance, every rank completed every round, no deadlock."
        if not problems
        else "FAILED:\n" + "\n".join(f"- {p}" for p in problems)
    )
    print(f"\n{table}\n\n{verdict}")
    if not args.no_record:
        record(
            "Soak",
            f"n = 4, NPeerDynamicDirectedExponentialGraph. In-process: {args.rounds} rounds, "
            f"{args.numel} parameters per rank, one Python thread per engine, per-rank self "
            f"weights or uniform lazy mixing sent in place. Gloo: {args.steps} "
            f"steps per mode of an MLP (32-64-1, batch 16, SGD), one thread per process, "
            f"per-rank SelfWeightMixing (self weight 0.2 + 0.15 * rank). Warm-up: "
            f"{args.warmup_fraction:.0%} of each run; checks every {args.inproc_check_every} "
            f"rounds / {args.gloo_check_every} steps. RSS growth = largest VmRSS after the "
            f"warm-up minus VmRSS at its end (bound {args.rss_bound_mib} MiB). Weight-sum error "
            f"= max over the checks of |sum of push-sum weights - 4|; mass error = max over "
            f"the checks and elements of |mean numerator - initial mean|; consensus error = max "
            f"over ranks and elements of |z - initial mean| after the last round. Wall time is the "
            f"loop's (the gloo checks included), the slowest rank's for gloo.\n\n"
            f"{table}\n\n{verdict}",
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
