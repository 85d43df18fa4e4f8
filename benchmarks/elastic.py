"""A worker lost and replaced mid-run: gossip_ext's elastic job beside torchft's, on the emulated
cluster.

Each system trains the byte-level language model of harness.compare on ``--workers`` workers,
each in its own network namespace behind a NIC capped at ``--bandwidth``, each launched on its own
(benchmarks/elastic_worker.py), its coordinator on a namespace of its own: gossip_ext's membership
service (``python -m gossip_ext.membership``) or torchft's lighthouse (``torchft_lighthouse``).

- ``gossip``: gossip_ext, ``membership=``, overlapped SGP in bfloat16 messages (the best mode of
  benchmarks/lm_compare.py at 8 workers), min_workers ``--min-workers``;
- ``torchft``: torchft 0.2.0, its Manager (min_replica_size ``--min-workers``, synchronous quorum)
  and LocalSGD every 4 steps; its lighthouse's heartbeat timeout is set to ``--heartbeat-ms``,
  gossip_ext's own silence threshold (gossip_ext.epochs.SILENT_S), for the same detection budget.

Each runs uninterrupted (``--repeats`` times, with different batches, for the run-to-run noise),
and so do two more jobs of gossip_ext's: one without the victim's slot (the failure run's
worker-steps lie between its and the full job's, which gives the loss an uninterrupted run with
the failure run's worker-steps reaches) and ``gossip_static``, a static job (init_process_group
over every worker, no membership: the step time an elastic job must match when nothing fails).
Each system also runs with each failure of ``--failures``: the worker on slot ``--victim`` is
SIGKILLed (``kill``: a crash, a lost machine) or SIGSTOPped for good (``stall``: a hung worker,
waited for until ``--timeout``) after its step ``--fail-at``, and a replacement (a new process,
its own initialisation) is started on the same
slot when worker 0 finishes step ``--replace-at``. From every worker's timeline of finished steps:

- back after (s): from the failure until the end of the last block of 4 steps of a survivor that
  took more than twice that survivor's median block in the window (the latest over survivors;
  blocks, not steps: one of torchft's steps in 4 is a sync);
- lost (s): the survivors' wall time lost in a window, its length minus its blocks at the
  window's median block (their mean), after the failure (until the replacement starts) and after the
  replacement starts (``--join-window`` steps); in an uninterrupted run, the same windows (at
  the same steps) measure the noise;
- replacement trains after (s): from the replacement's start (a new Python process: the import of
  torch and the loading of the data count) until its first training step ends; ``joining``: the
  system's own part of it, from the model built until that step's end;
- final held-out bits per byte: the mean over the job's last members of each one's own model.

    python benchmarks/elastic.py                     # as root: 8 workers at 1 Gbit/s
    python benchmarks/elastic.py --systems gossip --repeats 1 --no-record

Writes every run (--rows, JSON) and, unless --no-record, this benchmark's section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import results  # noqa: E402

from harness import netns  # noqa: E402
from harness.compare import systems  # noqa: E402

TITLE = "Elastic: a worker lost and replaced, beside torchft"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")
PORT = 29400  # the coordinator's, in its own namespace
PEAK_LR = {
    "gossip": systems.PEAK_LR["overlap_sgp_bf16"],
    "gossip_static": systems.PEAK_LR["overlap_sgp_bf16"],
    "torchft": systems.PEAK_LR["torchft_localsgd"],
}
BLOCK = 4  # steps per block of the measures: torchft's LocalSGD syncs every 4 steps
SLOW_FACTOR = 2.0  # a block this many times the window's median is a disturbed one


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--systems", nargs="+", default=["gossip", "torchft"], choices=("gossip", "torchft")
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--steps", type=int, default=480)
    p.add_argument("--failures", nargs="+", default=["kill", "stall"], choices=("kill", "stall"))
    p.add_argument("--fail-at", type=int, default=120)
    p.add_argument("--replace-at", type=int, default=240)
    p.add_argument(
        "--join-window", type=int, default=150, help="steps after the replacement starts"
    )
    p.add_argument("--victim", type=int, default=5, help="the slot of the worker that fails")
    p.add_argument("--min-workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=10.0, help="each worker's, seconds")
    p.add_argument("--heartbeat-ms", type=int, default=1500, help="torchft lighthouse's")
    p.add_argument("--repeats", type=int, default=2, help="uninterrupted runs per system")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--rows", default="/tmp/gossip_elastic.json")
    p.add_argument("--from-rows", metavar="FILE", help="report the runs saved in FILE again")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.rate = netns.rate_option(p, args.bandwidth, args.workers)
    if not 0 <= args.victim < args.workers:
        p.error(f"--victim must be a slot in [0, {args.workers}), got {args.victim}")
    if args.victim == 0:
        p.error("--victim must not be 0: worker 0's progress starts the replacement")
    if not 0 < args.fail_at < args.replace_at < args.steps - args.join_window:
        p.error(
            "need 0 < --fail-at < --replace-at < --steps - --join-window, got "
            f"{args.fail_at}, {args.replace_at}, {args.steps} - {args.join_window}"
        )
    if args.min_workers > args.workers - 1:
        p.error(
            f"--min-workers must let {args.workers - 1} survivors go on, got {args.min_workers}"
        )
    return args


# ----------------------------------------------------------------------------- one run


def _coordinator(system: str, cluster: netns.EmulatedCluster, args, out: str):
    """gossip_ext's membership service or torchft's lighthouse, in the cluster's last namespace;
    returns (process, the address the workers are given)."""
    rank = cluster.workers - 1
    host = cluster.address(rank)
    if system.startswith("gossip"):  # a static job's store is the same service
        argv = [sys.executable, "-m", "gossip_ext.membership", "--host", host, "--port", str(PORT)]
        address, ready = f"{host}:{PORT}", "membership service on"
    else:
        lighthouse = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
        lighthouse = lighthouse or shutil.which("torchft_lighthouse")
        if lighthouse is None:
            raise RuntimeError("torchft_lighthouse not found (pip install torchft==0.2.0)")
        argv = [
            lighthouse, "--bind", f"{host}:{PORT}", "--min_replicas", str(args.min_workers),
            "--heartbeat_timeout_ms", str(args.heartbeat_ms),
        ]  # fmt: skip
        address, ready = f"http://{host}:{PORT}", None
    log = open(os.path.join(out, "coordinator.log"), "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(rank), *argv],
        env=dict(os.environ, RUST_LOG="warn", PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE if ready else log,
        stderr=log,
        text=True,
    )
    if ready and ready not in (proc.stdout.readline() or ""):
        raise RuntimeError(f"the {system} coordinator did not start: see {log.name}")
    if not ready:
        time.sleep(1.0)  # the lighthouse prints nothing when it is up; its workers retry
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited: {open(log.name).read()[-2000:]}")
    return proc, address


def _last_step(path: str) -> int:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    return int(lines[-1].split()[0]) if lines else -1


class _Workers:
    def __init__(self, cluster, system: str, address: str, args, out: str, seed: int) -> None:
        self.cluster, self.system, self.address = cluster, system, address
        self.args, self.out, self.seed = args, out, seed
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.failed: str | None = None  # the victim, killed or stopped

    def start(self, name: str, slot: int, *extra: str) -> None:
        argv = [
            sys.executable, WORKER, "--system", self.system, "--coordinator", self.address,
            "--out", self.out, "--name", name, "--slot", str(slot), "--steps", str(self.args.steps),
            "--lr", str(PEAK_LR[self.system]), "--min-workers", str(self.args.min_workers),
            "--timeout", str(self.args.timeout), "--seed", str(self.seed), *extra,
        ]  # fmt: skip
        env = dict(
            os.environ,
            GLOO_SOCKET_IFNAME=netns.IFNAME,
            GOSSIP_EXT_HOST=self.cluster.address(slot),
            PYTHONUNBUFFERED="1",
            RUST_LOG="warn",
        )
        log = open(os.path.join(self.out, f"{name}.log"), "w")  # noqa: SIM115
        self.started[name] = time.time()
        self.procs[name] = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.namespace(slot), *argv],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def step(self, name: str) -> int:
        return _last_step(os.path.join(self.out, f"{name}.steps"))

    def check(self, deadline: float) -> None:
        if time.time() > deadline:
            raise TimeoutError(f"the run did not finish within {self.args.run_timeout:.0f} s")
        for name, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0) and not (name == self.failed and code == -signal.SIGKILL):
                with open(os.path.join(self.out, f"{name}.log")) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"{self.system} worker {name} exited with {code}:\n{tail}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def run_once(
    cluster, system: str, args, seed: int, failure: str | None, without_victim: bool = False
) -> dict:
    """One job of ``system``; with ``failure`` ("kill" or "stall"), the victim killed or stopped,
    and replaced; ``without_victim``, a job that never had the victim's slot. Every worker's
    result, and the times of the events."""
    with (
        tempfile.TemporaryDirectory(prefix="gossip-elastic-") as out,
        contextlib.ExitStack() as stack,
    ):
        coordinator, address = _coordinator(system, cluster, args, out)
        stack.callback(lambda: (coordinator.kill(), coordinator.wait()))
        workers = _Workers(cluster, system, address, args, out, seed)
        stack.callback(workers.close)
        slots = [s for s in range(args.workers) if not (without_victim and s == args.victim)]
        names = [f"w{slot}" for slot in slots]
        go = os.path.join(out, "go")
        for slot, name in zip(slots, names):
            workers.start(name, slot, "--go", go, "--world-size", str(len(slots)))
        deadline = time.time() + args.run_timeout
        while not all(os.path.exists(os.path.join(out, f"{n}.ready")) for n in names):
            workers.check(deadline)
            time.sleep(0.05)
        open(go, "w").close()
        events = {"go": time.time()}
        victim = f"w{args.victim}"
        while failure and "replaced" not in events:
            workers.check(deadline)
            if "failed" not in events and workers.step(victim) >= args.fail_at:
                stop = signal.SIGKILL if failure == "kill" else signal.SIGSTOP
                workers.procs[victim].send_signal(stop)
                workers.failed = victim
                events["failed"] = time.time()
            if "failed" in events and workers.step("w0") >= args.replace_at:
                workers.start("replacement", args.victim, "--joiner")
                events["replaced"] = workers.started["replacement"]
            time.sleep(0.01)
        while any(p.poll() is None for n, p in workers.procs.items() if n != workers.failed):
            workers.check(deadline)
            time.sleep(0.1)
        workers.check(deadline)
        finished, changes = {}, {}
        for name in workers.procs:
            with open(os.path.join(out, f"{name}.log")) as f:
                changes[name] = [line.strip() for line in f if " epoch " in line]
            if name != workers.failed:
                with open(os.path.join(out, f"{name}.json")) as f:
                    finished[name] = json.load(f)
        return {"system": system, "seed": seed, "failure": failure, "workers_started": len(slots),
                "events": events,
                "workers": finished, "epoch_changes": changes}  # fmt: skip


# ----------------------------------------------------------------------------- measures


def _blocks(steps: list, start: float, stop: float) -> list[tuple[float, float]]:
    """(end time, length) of consecutive blocks of BLOCK steps that end in (start, stop]. A
    block of torchft's LocalSGD holds one sync, so that blocks, unlike single steps, have one
    normal length for every system."""
    times = [t for _, t in steps]
    first = next((i for i, t in enumerate(times) if t > start), len(times))
    first = max(first - 1, 0)  # the block starts at the last step that ended before ``start``
    return [
        (times[i + BLOCK], times[i + BLOCK] - times[i])
        for i in range(first, len(times) - BLOCK, BLOCK)
        if times[i + BLOCK] <= stop
    ]


def _window_end(steps: list, start: float, count: int) -> float:
    after = [t for _, t in steps if t > start]
    return after[min(count, len(after)) - 1] if after else start


def _lost(blocks: list[tuple[float, float]]) -> float:
    if len(blocks) < 3:
        return float("nan")
    lengths = [length for _, length in blocks]
    return sum(lengths) - len(lengths) * statistics.median(lengths)


def measure(run: dict, args) -> dict:
    """The figures of one run. An uninterrupted run's windows start where the failure run's
    events are, at the same steps of worker 0 (their noise)."""
    survivors = {n: r for n, r in run["workers"].items() if n != "replacement"}
    if run["failure"]:
        kill, replaced = run["events"]["failed"], run["events"]["replaced"]
    else:
        # The same steps as the failure run's events, on worker 0's clock.
        steps0 = run["workers"]["w0"]["steps"]
        kill = next(t for s, t in steps0 if s >= args.fail_at)
        replaced = next(t for s, t in steps0 if s >= args.replace_at)
    lost_kill, lost_join, back = [], [], []
    for result in survivors.values():
        steps = result["steps"]
        end = _window_end(steps, replaced, args.join_window)
        during = _blocks(steps, kill, replaced)
        lost_kill.append(_lost(during))
        lost_join.append(_lost(_blocks(steps, replaced, end)))
        median = statistics.median(length for _, length in during)
        slow = [t for t, length in during if length > SLOW_FACTOR * median]
        first = next(t for _, t in steps if t > kill)
        back.append((slow[-1] if slow else first) - kill)
    members = list(run["workers"].values())
    figures = {
        "back_s": max(back),
        "lost_after_failure_s": statistics.mean(lost_kill),
        "lost_after_join_s": statistics.mean(lost_join),
        "final_bpb": statistics.mean(r["heldout_bpb"] for r in members),
        "wall_s": max(r["steps"][-1][1] for r in members) - run["events"]["go"],
        # From each worker's first step to its last: the pace, without the job's start.
        "step_ms": 1000
        * statistics.mean(
            (r["steps"][-1][1] - r["steps"][0][1]) / (len(r["steps"]) - 1) for r in members
        ),
        "worker_steps": sum(len(r["steps"]) for r in members),
    }
    joiner = run["workers"].get("replacement")
    if joiner is not None:
        timeline = joiner["timeline"]
        figures["joiner_trains_s"] = joiner["steps"][0][1] - replaced
        figures["joiner_imported_s"] = timeline["imported"] - replaced
        figures["joiner_loaded_s"] = timeline["loaded"] - replaced
        figures["joiner_joined_s"] = timeline["joined"] - replaced
        # The system's own part: from the model built to the first step's end.
        figures["joiner_joining_s"] = joiner["steps"][0][1] - timeline["loaded"]
        figures["joiner_first_step"] = timeline["first_step"]
    return figures


# ----------------------------------------------------------------------------- report


def _f(value, spec=".2f") -> str:
    return "-" if value is None or value != value else format(value, spec)


_FAILURES = {"kill": "SIGKILL + replace", "stall": "SIGSTOP + replace"}


def _label(run: dict) -> str:
    if run["failure"]:
        return _FAILURES[run["failure"]]
    return f"uninterrupted, {run['workers_started']} workers (batches {run['seed']})"


def report(rows: list[dict], args) -> str:
    lines = [
        f"{args.workers} workers, each in its own network namespace behind a "
        f"{netns.format_rate(args.rate)} NIC (tbf), one torch thread each, all on this "
        f"machine's cores: every step is bound by the CPU, not the network (benchmarks/"
        f"lm_compare.py at this setting), and {args.workers - 1} workers step faster than "
        f"{args.workers}. Byte-level transformer of harness.compare (2 layers, width 128, "
        f"context 64), batch 8 per worker, AdamW, warmup 20 then cosine decay over "
        f"{args.steps} steps. The worker on slot {args.victim} is SIGKILLed, or SIGSTOPped for "
        f"good, after its step {args.fail_at}; a replacement starts on its slot when worker 0 "
        f"finishes step {args.replace_at}. gossip_ext: elastic overlapped SGP, bfloat16 "
        f"messages, min_workers {args.min_workers}; torchft 0.2.0: Manager (min_replica_size "
        f"{args.min_workers}, synchronous quorum) and LocalSGD every 4 steps, lighthouse "
        f"heartbeat timeout {args.heartbeat_ms} ms; every worker's timeout "
        f"{args.timeout:g} s. Times from every worker's wall clock (one machine, one clock), in "
        f"blocks of 4 steps (torchft syncs in one step of 4); `lost` is a window's length minus "
        f"its blocks at the window's median block, the survivors' mean (uninterrupted rows: the "
        f"same windows, for the noise); `joining` is the system's part of the replacement's "
        f"start, from its model built to its first step's end (the rest is Python importing "
        f"torch and loading the data on a machine the others keep busy).",
        "",
        "| system | run | back after failure (s) | lost after failure (s) | replacement trains "
        "after (s) | joining (s) | its first step | lost after join (s) | wall (s) | step (ms) | "
        "worker-steps | final held-out bpb |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f = row["figures"]
        failure = row["failure"]
        run = _label(row)
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


def run_all(args) -> list[dict]:
    """Every run of the benchmark, each system's failure run first, then the uninterrupted."""
    why = netns.unavailable()
    if why:
        sys.exit(why)
    for system in args.systems:
        why_not = systems.available("torchft_localsgd" if system == "torchft" else "sgp")
        if why_not:
            sys.exit(why_not)
    runs = []
    with netns.EmulatedCluster(args.workers + 1, args.rate) as cluster:
        # Interleaved, so that a slow spell of the machine does not fall on one system only.
        # Uninterrupted, besides each system: gossip_ext's job without the victim's slot (the
        # failure run's worker-steps lie between its and the full job's), and a static job.
        calm = [(s, False) for s in args.systems]
        if "gossip" in args.systems:
            calm += [("gossip", True), ("gossip_static", False)]
        plan = [(s, 0, f, False) for f in args.failures for s in args.systems]
        plan += [(s, seed, None, w) for seed in range(args.repeats) for s, w in calm]
        for system, seed, failure, without_victim in plan:
            started = time.time()
            runs.append(run_once(cluster, system, args, seed, failure, without_victim))
            print(f"{system}: {_label(runs[-1])}: {time.time() - started:.0f} s", flush=True)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_rows:
        with open(args.from_rows) as f:
            saved = json.load(f)
        vars(args).update(saved["settings"])  # the saved run's, not this command's
        runs = saved["runs"]
    else:
        runs = run_all(args)
        settings = {k: v for k, v in vars(args).items() if k not in ("from_rows", "no_record")}
        with open(args.rows, "w") as f:
            json.dump({"settings": settings, "runs": runs}, f)
    rows = [
        {k: run[k] for k in ("system", "seed", "failure", "workers_started")}
        | {"figures": measure(run, args)}
        for run in runs
    ]
    body = report(rows, args)
    print(body)
    if not args.no_record:
        results.record(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
