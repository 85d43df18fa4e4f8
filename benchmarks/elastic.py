"""A worker lost and replaced mid-run: gossip_ext's elastic job beside torchft's, on the emulated
cluster.

Each system trains the byte-level language model of harness.compare on ``--workers`` workers,
each in its own network namespace behind a NIC capped at ``--bandwidth``, each launched on its own
(benchmarks/elastic_worker.py), its coordinator on a namespace of its own: gossip_ext's membership
service (``python -m gossip_ext.membership``) or torchft's lighthouse (``torchft_lighthouse``).

- ``gossip``: gossip_ext, ``membership=``, overlapped SGP in bfloat16 messages (the best mode of
  benchmarks/lm_compare.py at 8 workers), min_workers ``--min-workers``;
- ``gossip_sealed``: exactly ``gossip``, with a job secret (a random token new with every run, in
  the environment of the service and of every worker: every value of the membership store
  HMAC-sealed, heartbeats sealed counters, the epoch groups' rendezvous through the sealing
  store; gossip_ext/membership/trust.py);
- ``torchft``: torchft 0.2.0, its Manager (min_replica_size ``--min-workers``, synchronous quorum)
  and LocalSGD every 4 steps; its lighthouse's heartbeat timeout is set to ``--heartbeat-ms``,
  gossip_ext's own silence threshold (gossip_ext.membership.epochs.SILENT_S), for the same detection
  budget.

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
    python benchmarks/elastic.py --systems gossip gossip_sealed --failures kill  # the secret's cost
    python benchmarks/elastic.py --systems gossip --shards 2 --workers 4 --victim 3 \
        --min-workers 2 --failures kill              # replicas of 2 FSDP2 shard processes

With ``gossip_sealed`` among the systems, its failure runs and ``gossip``'s are repeated too
(``--repeats``, the two alternating which runs first), and its goals hold each of the sealed
job's figures (back after, lost after the failure, joining, the uninterrupted step time) to the
open job's: their means at most 10% above, or at most the open job's run-to-run spread above
where that is larger (10% of a sub-second figure is below this machine's noise; a sealed figure
below the open one is noise, not a cost); its own section of RESULTS.md.

With ``--shards S`` every worker is a replica of S processes sharing its slot's namespace, the
model sharded over them by FSDP2 (an elastic job of sharded replicas; torchft's: one replica
group of S ranks, its HSDP layout, LocalSGD on the local shards): process ``--victim-shard`` of
the victim is killed, its replica leaves, and a whole new replica replaces it; its own section
of RESULTS.md.

Writes every run (--rows, JSON) and, unless --no-record, this benchmark's section of
benchmarks/RESULTS.md.

The benchmark's parts, beside this command line: elastic_run.py (one run: the coordinator, the
workers, the failure and the replacement), elastic_measures.py (a run's figures from the
workers' timelines) and elastic_report.py (the table and the goals); elastic_worker.py is the
worker process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

import results  # noqa: E402
from elastic_measures import measure  # noqa: E402
from elastic_report import report, run_label  # noqa: E402
from elastic_run import run_once  # noqa: E402

from harness import netns  # noqa: E402
from harness.compare import systems  # noqa: E402

TITLE = "Elastic: a worker lost and replaced, beside torchft"
SHARDED_TITLE = "Elastic sharded replicas: a replica lost with one process, replaced shard by shard"
SEALED_TITLE = "Elastic with a job secret: the same job sealed and open, side by side"
SYSTEMS = ("gossip", "gossip_sealed", "torchft")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=["gossip", "torchft"], choices=SYSTEMS)
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
    p.add_argument(
        "--shards", type=int, default=1, help="processes per worker: replicas sharded by FSDP2"
    )
    p.add_argument(
        "--victim-shard", type=int, help="which process of the victim fails (default: the last)"
    )
    p.add_argument("--min-workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=10.0, help="each worker's, seconds")
    p.add_argument("--heartbeat-ms", type=int, default=1500, help="torchft lighthouse's")
    p.add_argument("--repeats", type=int, default=2, help="uninterrupted runs per system")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--rows", default="/tmp/gossip_elastic.json")
    p.add_argument(
        "--from-rows", nargs="+", metavar="FILE", help="report the runs saved in FILEs again"
    )
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    args.rate = netns.rate_option(p, args.bandwidth, args.workers)
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    if args.shards > 1 and "gossip_sealed" in args.systems:
        p.error("--systems gossip_sealed compares workers of one process: not with --shards")
    if args.victim_shard is None:
        args.victim_shard = args.shards - 1
    if not 0 <= args.victim_shard < args.shards:
        p.error(f"--victim-shard must be in [0, {args.shards}), got {args.victim_shard}")
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


def plan(args) -> list[tuple[str, int, str | None, bool]]:
    """Every run of the benchmark, in order: (system, the batches' seed, the failure or None,
    without the victim's slot). Interleaved, so that a slow spell of the machine does not fall on
    one system only: each repeat's failure runs, then its uninterrupted ones."""
    sealed = "gossip_sealed" in args.systems
    # Uninterrupted, besides each system: gossip_ext's job without the victim's slot (the
    # failure run's worker-steps lie between its and the full job's), and a static job.
    extra = []
    if "gossip" in args.systems:
        extra += [("gossip", True)]
        if args.shards == 1:  # a static job of sharded replicas is sharded_compare.py's
            extra += [("gossip_static", False)]
    runs = []
    for seed in range(args.repeats):
        # The sealed job's figures are held to the open job's run-to-run spread: theirs are
        # repeated with a failure too, and which of them runs first alternates.
        order = args.systems[::-1] if sealed and seed % 2 else args.systems
        failing = order if seed == 0 else [s for s in order if sealed and s.startswith("gossip")]
        runs += [(s, seed, f, False) for f in args.failures for s in failing]
        runs += [(s, seed, None, False) for s in order] + [(s, seed, None, w) for s, w in extra]
    return runs


def run_all(args) -> list[dict]:
    """Every run of plan(args), on one emulated cluster."""
    why = netns.unavailable()
    if why:
        sys.exit(why)
    for system in args.systems:
        why_not = systems.available("torchft_localsgd" if system == "torchft" else "sgp")
        if why_not:
            sys.exit(why_not)
    runs = []
    with netns.EmulatedCluster(args.workers + 1, args.rate) as cluster:
        for system, seed, failure, without_victim in plan(args):
            started = time.time()
            runs.append(run_once(cluster, system, args, seed, failure, without_victim))
            print(f"{system}: {run_label(runs[-1])}: {time.time() - started:.0f} s", flush=True)
    return runs


def _saved(args) -> tuple[list[dict], str | None]:
    """The runs saved in every file of --from-rows, one table, and the commands that ran them:
    each file's settings must be the first's but for the systems, which add up."""
    runs, commands, systems = [], [], []
    for path in args.from_rows:
        with open(path) as f:
            saved = json.load(f)
        settings = dict(saved["settings"])
        settings.pop("rows", None)  # where each was written
        systems += [s for s in settings.pop("systems") if s not in systems]
        if path == args.from_rows[0]:
            first = settings
        elif settings != first:
            sys.exit(f"--from-rows: {path} was run with other settings than {args.from_rows[0]}")
        runs += saved["runs"]
        commands.append(saved.get("command") or "")
    vars(args).update(first, systems=systems)  # the saved runs', not this command's
    return runs, "; ".join(c for c in commands if c) or None


def title(args) -> str:
    """The title of this benchmark's section of RESULTS.md for these settings: one section each
    for the comparison beside torchft, for sharded replicas and for the sealed job."""
    if args.shards > 1:
        return SHARDED_TITLE
    return SEALED_TITLE if "gossip_sealed" in args.systems else TITLE


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_rows:
        runs, command = _saved(args)
    else:
        runs, command = run_all(args), results.command_line()
        settings = {k: v for k, v in vars(args).items() if k not in ("from_rows", "no_record")}
        with open(args.rows, "w") as f:
            json.dump({"settings": settings, "runs": runs, "command": command}, f)
    rows = [
        {k: run[k] for k in ("system", "seed", "failure", "workers_started")}
        | {"figures": measure(run, args)}
        for run in runs
    ]
    body = report(rows, args)
    if len(args.from_rows or []) > 1:
        body = (
            f"The rows come from {len(args.from_rows)} runs of the benchmark on this machine with "
            f"the same settings, one per system set (the commands above, joined by `;`).\n\n" + body
        )
    print(body)
    if not args.no_record:
        results.record(title(args), body, command=command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
