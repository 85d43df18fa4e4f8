"""A slow worker costs its share, or the job: time to the same held-out quality on a cluster where
one worker computes at half speed, sits behind a slower link, or stalls now and then, beside the
same cluster uniform.

Every system trains lm_compare's task with its protocol (harness.compare.runner.Protocol: the
byte-level transformer, the same batches, schedule and peak learning rates; DDP runs --ddp-steps,
the others --steps) on workers that each keep their own clock (harness.compare.uneven): each
evaluates its own model every --eval-every of its own steps, off its clock, so that nothing but
the system's own communication holds a worker back. On the slow cluster, worker --slow-rank
computes at 1 / --slowdown the pace: after each step it sleeps the rest of what a slower device
would take (its own compute time, measured before training, times --slowdown - 1); the ``alone``
system measures the result. On the slow-link cluster the same worker's NIC runs at 1 /
--nic-slowdown of the others' rate (needs --bandwidth). On the stalling cluster it is stopped
whole (SIGSTOP)
for 1 to 3 s at random times, about 5% of the run (harness.compare.staller). The target is the
uniform cluster's DDP's final held-out loss.

Per system and cluster: the time to the target beside the uniform cluster's, and their ratio (a
slow worker that costs only its share costs 4 / 3.5 = 1.14x on four workers; lockstep costs the
whole slowdown), the goodput (the steps the workers took over the steps they could have taken
computing alone on that cluster, up to the first worker's last step), and the step times of the
other workers and of the slow or stalling one.

    python benchmarks/heterogeneous.py                          # loopback, 4 workers
    python benchmarks/heterogeneous.py --bandwidth 100mbit     # as root: the emulated network

Each asynchronous mode runs --repeats times on every cluster (3 by default), reported by the
median over its runs: the order its messages arrive in, and so its mixing, differs from run to
run, and two single runs of AsyncSGP's time to the target on the same cluster were 13% apart.

Rewrites this benchmark's section of benchmarks/RESULTS.md unless --no-record and writes a plot
(--plot); --rows keeps every worker's record (JSON), and --from-rows FILE starts from a saved
run, running only the systems and settings it lacks (give it the run's other options: they are the
protocol's description).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import results  # noqa: E402  (benchmarks/results.py)

from harness import netns  # noqa: E402
from harness.compare import runner, systems  # noqa: E402
from harness.compare import uneven_report as measure  # noqa: E402
from harness.compare.uneven import UnevenRun  # noqa: E402

DEFAULT_WORKERS = 4
TITLE = "A slow or stalling worker: time to the same held-out quality beside a uniform cluster"
SYSTEMS = (
    "alone",
    "ddp",
    "powersgd_r4",
    "decent_dp",
    "torchft_localsgd",
    "torchft_diloco",
    "overlap_sgp_int8",
    "async_sgp_int8",
    "async_diloco_int8",
)
ASYNCHRONOUS = ("async_sgp", "async_sgp_int8", "async_diloco", "async_diloco_int8")
# The clusters, each beside the uniform one: one worker at half speed; one worker's NIC at a
# tenth of the others' rate (on the emulated network only); one worker stopped for 1 to 3 s at
# random times, about STALL_FRACTION of the run.
SETTINGS = ("uniform", "slow", "slow_nic", "stalls")
NAMES = {
    "uniform": "uniform",
    "slow": "one worker at half speed",
    "slow_nic": "one worker behind a slower link",
    "stalls": "one worker stalling",
}
STALL_FRACTION = 0.05
# The goals: with one half-speed worker, the best asynchronous mode within GOAL_RATIO of
# its uniform-cluster time; under random stalls, its goodput at least GOAL_GOODPUT.
GOAL_RATIO = 1.15
GOAL_GOODPUT = 0.9
# The asynchronous engine's goals, for AsyncSGP int8 beside overlap SGP int8: on the uniform
# cluster at most its time; with one half-speed worker at most GOAL_OVER_ALONE times the ratio of
# the workers alone; behind the slow link at most GOAL_SLOW_LINK times its uniform time (the
# ratio it had before the engine moved into C++).
ASYNC, OVERLAP = "async_sgp_int8", "overlap_sgp_int8"
GOAL_OVER_ALONE = 1.05
GOAL_SLOW_LINK = 1.17


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=systems.ALL)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    p.add_argument("--bandwidth", default=None, help="each NIC's rate, e.g. 100mbit (as root)")
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--ddp-steps", type=int, default=240)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--slowdown", type=float, default=2.0)
    p.add_argument("--nic-slowdown", type=float, default=10.0)
    p.add_argument("--slow-rank", type=int, default=None, help="default: the last worker")
    p.add_argument(
        "--cpu-per-worker",
        type=float,
        default=None,
        help="hold each worker to this many cores' time (cgroup; needs --bandwidth), e.g. 0.25 "
        "for 8 workers on 2 cores; default: they share the cores",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each asynchronous mode on each cluster, reported by their median (its "
        "arrivals, and so its mixing, differ from run to run)",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--rows", default="/tmp/gossip_heterogeneous.json")
    p.add_argument("--plot", default="/tmp/gossip_heterogeneous.png", help="'' for none")
    p.add_argument(
        "--from-rows",
        metavar="FILE",
        help="start from the run saved in FILE: run only what it lacks, report it all",
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    if "alone" not in args.systems or "ddp" not in args.systems:
        p.error("--systems needs alone (goodput's reference) and ddp (the target)")
    if "uniform" not in args.settings:
        p.error("--settings needs uniform (the target, and every ratio's denominator)")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.rate = netns.parse_rate(args.bandwidth) if args.bandwidth else None
    if args.rate is None and args.cpu_per_worker is not None:
        p.error("--cpu-per-worker needs --bandwidth (the caps hold the emulated cluster's workers)")
    if args.rate is None and "slow_nic" in args.settings:
        args.settings.remove("slow_nic")  # a slower link needs the emulated network
    args.slow_rank = args.workers - 1 if args.slow_rank is None else args.slow_rank
    return args


def uneven_run(args, protocol: runner.Protocol, setting: str, system: str) -> UnevenRun:
    config = protocol.config(system)
    if setting == "slow":
        return UnevenRun(config, slow_rank=args.slow_rank, slowdown=args.slowdown)
    if setting == "stalls":
        return UnevenRun(config, stall_rank=args.slow_rank, stall_fraction=STALL_FRACTION)
    if setting == "slow_nic":
        return UnevenRun(config, slow_link_rank=args.slow_rank)
    return UnevenRun(config)


def run_all(args, protocol: runner.Protocol, rows) -> dict[str, dict[str, dict]]:
    """Every system on each setting that ``rows`` lacks, each asynchronous mode as many times
    as ``--repeats`` asks (the first run's result holds the others' records in ``repeats``):
    {setting: {system: result}}."""
    for setting in args.settings:
        rows.setdefault(setting, {})
        for system in args.systems:
            wanted = args.repeats if system in ASYNCHRONOUS else 1
            done = len(measure.runs(rows[setting][system])) if system in rows[setting] else 0
            if done >= wanted:
                continue
            why_not = systems.available(system)
            if why_not:
                print(f"left out: {why_not}", flush=True)
                continue
            for _ in range(wanted - done):
                started = time.monotonic()
                result = run_one(args, protocol, setting, system)
                if system in rows[setting]:
                    rows[setting][system].setdefault("repeats", []).append(result["records"])
                else:
                    rows[setting][system] = result
                print(
                    f"{setting:>8} {system:>17}: final {measure.final(result['records']):.3f} "
                    f"bits per byte ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
                with open(args.rows, "w") as f:
                    json.dump(rows, f)
    return rows


def in_order(rows: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """``rows`` with the clusters and the systems in SETTINGS' and SYSTEMS' order (a saved run
    that a later one completed has them in the order they ran)."""

    def rank(name: str, order: tuple[str, ...]) -> int:
        return order.index(name) if name in order else len(order)

    ordered = {}
    for setting in sorted(rows, key=lambda setting: rank(setting, SETTINGS)):
        names = sorted(rows[setting], key=lambda system: rank(system, SYSTEMS))
        ordered[setting] = {system: rows[setting][system] for system in names}
    return ordered


def run_one(args, protocol: runner.Protocol, setting: str, system: str) -> dict:
    rates = None
    if setting == "slow_nic":
        rates = {args.slow_rank: args.rate / args.nic_slowdown}
    return runner.run(
        uneven_run(args, protocol, setting, system),
        args.workers,
        args.rate,
        args.timeout,
        "harness.compare.uneven:train",
        rates,
        args.cpu_per_worker,
    )


def table(rows: dict[str, dict[str, dict]], setting: str, target: float) -> str:
    """The table of every system on ``setting`` beside the uniform cluster, and the systems
    this cluster left out (a shorter run of a slow setting)."""
    text = measure.table(rows[setting], target, NAMES[setting], rows["uniform"])
    missing = [s for s in rows["uniform"] if s not in rows[setting]]
    if missing:
        text += f"\n\nNot run on this cluster: {', '.join(missing)}."
    return text


def goals(rows: dict[str, dict[str, dict]], target: float) -> list[str]:
    """Each goal with the best asynchronous mode's figure, met or missed."""
    said = []
    if "slow" in rows:
        ratios = {}
        for system in ASYNCHRONOUS:
            if system in rows["slow"]:
                uniform = measure.median_time_to(rows["uniform"][system], target)
                slow = measure.median_time_to(rows["slow"][system], target)
                if uniform and slow:
                    ratios[system] = slow / uniform
        if ratios:
            best = min(ratios, key=ratios.get)
            met = "met" if ratios[best] <= GOAL_RATIO else "missed"
            said.append(
                f"One worker at half speed, the best asynchronous mode within {GOAL_RATIO}x of "
                f"its uniform-cluster time: {best} at {ratios[best]:.2f}x, {met}."
            )
    if "stalls" in rows:
        alone = measure.alone_step_seconds(rows["stalls"]["alone"]["records"])
        # A mode's goodput counts where it reached the target: steps that never reach the
        # quality are not worth their pace.
        goodputs = {
            system: measure.median_goodput(rows["stalls"][system], alone)
            for system in ASYNCHRONOUS
            if system in rows["stalls"] and measure.median_time_to(rows["stalls"][system], target)
        }
        if goodputs:
            best = max(goodputs, key=goodputs.get)
            met = "met" if goodputs[best] >= GOAL_GOODPUT else "missed"
            said.append(
                f"Random stalls, goodput at least {GOAL_GOODPUT} (of the asynchronous modes "
                f"that reached the target): {best} at "
                f"{goodputs[best]:.3f}, {met}."
            )
    return said


def engine_goals(rows: dict[str, dict[str, dict]], target: float) -> list[str]:
    """The asynchronous engine's goals (see GOAL_OVER_ALONE), met or missed."""

    def time(setting: str, system: str) -> float | None:
        if system not in rows.get(setting, {}) or system not in rows["uniform"]:
            return None
        return measure.median_time_to(rows[setting][system], target)

    def verdict(met: bool) -> str:
        return "met" if met else "missed"

    said = []
    uniform, overlap = time("uniform", ASYNC), time("uniform", OVERLAP)
    if uniform and overlap:
        said.append(
            f"Uniform cluster, {ASYNC} at most {OVERLAP}'s time: {uniform:.1f} s against "
            f"{overlap:.1f} s, {verdict(uniform <= overlap)}."
        )
    slow, alone, alone_slow = time("slow", ASYNC), time("uniform", "alone"), time("slow", "alone")
    if uniform and slow and alone and alone_slow:
        ratio, bound = slow / uniform, GOAL_OVER_ALONE * alone_slow / alone
        said.append(
            f"One worker at half speed, {ASYNC}'s ratio at most {GOAL_OVER_ALONE}x the workers "
            f"alone's ({alone_slow / alone:.2f}x): {ratio:.2f}x, {verdict(ratio <= bound)}."
        )
    slow_link = time("slow_nic", ASYNC)
    if uniform and slow_link:
        ratio = slow_link / uniform
        said.append(
            f"Behind the slow link, {ASYNC} at most {GOAL_SLOW_LINK}x its uniform time: "
            f"{ratio:.2f}x, {verdict(ratio <= GOAL_SLOW_LINK)}."
        )
    return said


def plot(rows: dict[str, dict[str, dict]], target: float, path: str) -> None:
    """Held-out loss against each cluster's time, a panel per cluster."""
    clusters = {NAMES[setting]: rows[setting] for setting in rows}
    measure.plot(clusters, target, path, ASYNCHRONOUS)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.rate is not None and (why := netns.unavailable()):
        sys.exit(f"--bandwidth needs an emulated network: {why}")
    protocol = runner.Protocol(
        steps=args.steps,
        ddp_steps=args.ddp_steps,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
    )
    rows = {}
    if args.from_rows:
        with open(args.from_rows) as f:
            rows = json.load(f)
    saved = _runs_counted(rows)
    rows = in_order(run_all(args, protocol, rows))
    completed = _runs_counted(rows) != saved
    target = measure.final(rows["uniform"]["ddp"]["records"])
    tables = [
        f"### {NAMES[setting].capitalize()}\n\n{table(rows, setting, target)}"
        for setting in rows
        if setting != "uniform"
    ]
    said = goals(rows, target) + engine_goals(rows, target)
    print("\n\n".join(tables + said), flush=True)
    if args.plot:
        plot(rows, target, args.plot)
    network = "loopback" if args.rate is None else f"{netns.format_rate(args.rate)} NICs"
    if args.cpu_per_worker is not None:
        network += f", each worker held to {args.cpu_per_worker:g} cores' time (a cgroup's cap)"
    params = rows["uniform"]["ddp"]["params"]
    described = protocol.describe(params)
    if args.workers != DEFAULT_WORKERS:
        # The protocol is the 4 workers' section's: said once, in that section.
        described = "The protocol of the section above, at another size."
    body = (
        described
        + f" {args.workers} workers, {network}. On the slow cluster worker {args.slow_rank} "
        f"computes at 1/{args.slowdown:g} the pace (it sleeps {args.slowdown - 1:g}x its own "
        "measured compute after each step); on the slow-link one its NIC runs at "
        f"1/{args.nic_slowdown:g} of the others' rate; on the stalling one it is stopped whole "
        "(SIGSTOP) "
        f"for 1 to 3 s at random times, about {STALL_FRACTION:.0%} of the run. Each worker "
        f"evaluates its own model every {args.eval_every} of its own steps, off its own clock; "
        "held-out loss at a time is the mean over workers of each one's latest, and the time to "
        "a target is where it crosses it, linear between evaluations. Target: the "
        f"uniform cluster's DDP's final held-out loss, {target:.3f} bits per byte. Goodput: the "
        "steps taken over the steps the workers could have taken computing alone (`alone` on "
        "the same cluster), up to the first worker's last step."
        + _saved_rows_note(rows, args.systems, bool(args.from_rows), completed)
        + (
            f" Each asynchronous mode ran {args.repeats} times on every cluster (its arrivals, "
            "and so its mixing, differ from run to run) and its figures are the medians over "
            "its runs; the plot shows its first."
            if args.repeats > 1
            else ""
        )
        + " Per cluster: the time to the target (its ratio to the same system's uniform time) "
        "and the goodput; the step times of each worker are in the command's output.\n\n"
        + "Goals: "
        + " ".join(said)
        + "\n\n"
        + summary(rows, target)
        + "\n"
    )
    if not args.no_record:
        # The command that reproduces the run, not the one that reported a saved run again.
        sys.argv = _without(sys.argv, ("--from-rows", "--rows", "--plot"))
        # A run of another size is a section of its own, beside the 4 workers' one.
        title = TITLE if args.workers == DEFAULT_WORKERS else f"{TITLE}, {args.workers} workers"
        results.record(title, body)
    return rows


def summary(rows: dict[str, dict[str, dict]], target: float) -> str:
    """One table of every system on every cluster: its time to ``target`` on the uniform
    cluster, and on each other one that time, its ratio to the uniform one and the goodput."""
    settings = [setting for setting in rows if setting != "uniform"]
    head = "| system | uniform | " + " | ".join(NAMES[s] for s in settings) + " |"
    lines = [head, "|---|---|" + "---|" * len(settings)]
    for system, result in rows["uniform"].items():
        uniform = measure.median_time_to(result, target)
        cells = [measure.label(system, result), measure.seconds(uniform)]
        for setting in settings:
            if system not in rows[setting]:
                cells.append("not run")
                continue
            alone = measure.alone_step_seconds(rows[setting]["alone"]["records"])
            uneven = measure.median_time_to(rows[setting][system], target)
            ratio = f" ({uneven / uniform:.2f}x)" if uniform and uneven else ""
            good = measure.median_goodput(rows[setting][system], alone)
            cells.append(f"{measure.seconds(uneven)}{ratio}, goodput {good:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _runs_counted(rows: dict[str, dict[str, dict]]) -> dict[str, dict[str, int]]:
    """How many runs each system has on each cluster."""
    return {
        setting: {system: len(measure.runs(result)) for system, result in systems_.items()}
        for setting, systems_ in rows.items()
    }


def _saved_rows_note(
    rows: dict[str, dict[str, dict]], asked: list[str], saved: bool, completed: bool
) -> str:
    """Where the rows came from, when a saved run (--from-rows) gave some or all of them."""
    if not saved:
        return ""
    if not completed:
        return " Every row comes from one run of the command below, reported again (--from-rows)."
    elsewhere = [system for system in rows["uniform"] if system not in asked]
    named = f" (all of {', '.join(elsewhere)})" if elsewhere else ""
    return (
        " Some rows come from earlier runs of the same protocol the same day" + named + ", "
        "which this command completed (--from-rows)."
    )


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without ``options`` and the value after each."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in options)):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
