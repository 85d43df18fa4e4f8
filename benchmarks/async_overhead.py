"""What AsyncSGP's round costs a worker's CPU, outside its forward and backward.

    python benchmarks/async_overhead.py --workers 4 8 --params 1e6 --steps 300 \\
        --baseline /path/to/an/earlier/checkout

Every worker holds P float32 parameters and runs the gossip of an AsyncSGP step, and nothing
else: ``finish_round()`` where a forward would start, ``start_round()`` after the step, int8
messages on the default graph, no staleness bound, the step's compute stood in for by a sleep
of ``--step-ms`` so that messages flow between steps as in training. Per worker, over the steps
after a warm-up:

- the training thread's CPU time inside the two calls, per step (``time.thread_time``): what
  the step waits for on its own thread;
- the whole process's CPU time per step (``time.process_time``: every thread, the message
  channels' and gloo's included, the sleeps not): what the round takes from the machine.

A row is the median over workers. ``--baseline`` runs the same loop, in the same invocation, with
the gossip_ext of another checkout (built in place: ``python setup.py build_ext --inplace``
there), imported by PYTHONPATH; the table then gives this checkout's figures as a ratio of it.
The processes talk over gloo on loopback: this measures CPU, not the network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WARMUP_STEPS = 20


def _worker(rank: int, world_size: int, init: str, args, out: str) -> None:
    from gossip_ext.gossip.asynchronous import AsyncPushSum
    from gossip_ext.graphs import NPeerDynamicDirectedExponentialGraph

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.manual_seed(rank)
    sizes = [int(args.params) // 4] * 4
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    engine = AsyncPushSum(
        params,
        dist.group.WORLD,
        NPeerDynamicDirectedExponentialGraph(),
        staleness=None,
        message_dtype="int8",
        timeout=timedelta(seconds=120),
    )
    inside = 0.0
    for step in range(WARMUP_STEPS + args.steps):
        if step == WARMUP_STEPS:
            inside, process_begin = 0.0, time.process_time()
        began = time.thread_time()
        engine.finish_round()
        inside += time.thread_time() - began
        time.sleep(args.step_ms / 1000)  # the forward, backward and optimizer step
        with torch.no_grad():
            for p in params:
                p.add_(0.001)
        began = time.thread_time()
        engine.start_round()
        inside += time.thread_time() - began
    process = time.process_time() - process_begin
    dist.barrier()
    engine.settle()
    engine.close()
    with open(f"{out}.{rank}", "w") as f:
        per_step = {"thread_ms": inside / args.steps, "process_ms": process / args.steps}
        json.dump({key: 1e3 * seconds for key, seconds in per_step.items()}, f)
    dist.destroy_process_group()


def run_here(workers: int, args) -> dict[str, float]:
    """The medians over ``workers`` workers of this interpreter's gossip_ext."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = f"file://{tmp}/init", f"{tmp}/result"
        mp.spawn(_worker, (workers, init, args, out), nprocs=workers, join=True)
        results = [json.load(open(f"{out}.{r}")) for r in range(workers)]
    return {key: statistics.median(r[key] for r in results) for key in ("thread_ms", "process_ms")}


def run_checkout(checkout: str, workers: int, args) -> dict[str, float]:
    """The same, run by a fresh interpreter that imports the gossip_ext of ``checkout``."""
    command = [sys.executable, os.path.abspath(__file__), "--one", str(workers)]
    command += ["--params", str(args.params), "--steps", str(args.steps)]
    command += ["--step-ms", str(args.step_ms)]
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _commit(checkout: str) -> str:
    done = subprocess.run(
        ["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--baseline", help="an earlier checkout, built in place")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a baseline's sub-run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_here(args.one, args)))
        return
    from results import record

    rows = []
    for workers in args.workers:
        mine = run_here(workers, args)
        base = run_checkout(args.baseline, workers, args) if args.baseline else None
        row = f"| {workers} | {mine['thread_ms']:.2f} | {mine['process_ms']:.2f} |"
        if base:
            row += (
                f" {base['thread_ms']:.2f} | {base['process_ms']:.2f} |"
                f" {mine['thread_ms'] / base['thread_ms']:.2f}x |"
                f" {mine['process_ms'] / base['process_ms']:.2f}x |"
            )
        rows.append(row)
        print(row, flush=True)
    header = "| workers | training thread, ms CPU/step | process, ms CPU/step |"
    rule = "|---|---|---|"
    if args.baseline:
        header += " baseline thread | baseline process | thread ratio | process ratio |"
        rule += "---|---|---|---|"
    body = (
        f"AsyncSGP's round alone ({args.params:.0e} float32 parameters, int8 messages, default "
        f"graph, no staleness bound, {args.steps} steps paced at {args.step_ms:g} ms after "
        f"{WARMUP_STEPS} of warm-up), median over workers"
        + (f"; baseline: gossip_ext at {_commit(args.baseline)}" if args.baseline else "")
        + ".\n\n"
        + "\n".join([header, rule, *rows])
    )
    record("Asynchronous round, CPU per step", body)


if __name__ == "__main__":
    main()
