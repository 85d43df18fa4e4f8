"""Round time: one gossip round of gossip_ext against the ways its peers keep workers together.

    python benchmarks/round_time.py --workers 4 8 --params 1e6 1e7 2.5e7

Every worker holds a model of P float32 parameters. In the same run, on the same processes and
the same gloo group, this measures the wall time of:

- gossip_ext: one round of GossipDataParallel (1 peer): transfer_params() then sync_comms();
- DDP all-reduce: the gradient all-reduce DistributedDataParallel runs every step, as DDP does
  it (25 MB buckets, all-reduced asynchronously, then averaged);
- PeriodicModelAverager: torch's model averaging (an all-reduce of the parameters), period 1;
- plain push-sum: an SGP-style round in plain PyTorch on the same graph: flatten, scale,
  isend/irecv with the peers, absorb, unflatten.

Each time is the median over repetitions of the slowest worker, so a row is what a step waits
for. The table gives gossip_ext's time as a ratio of each peer's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from datetime import UTC, datetime, timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results import command_line, machine, write_section
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

import gossip_ext

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's default bucket_cap_mb


def make_params(num_params: int) -> nn.ParameterList:
    """Four tensors summing to num_params elements, like the layers of a small model."""
    sizes = [num_params // 4] * 3
    sizes.append(num_params - sum(sizes))
    return nn.ParameterList(nn.Parameter(torch.randn(s)) for s in sizes)


def slowest_median(samples: list[float]) -> float:
    """The median over repetitions of this worker, then the maximum over workers."""
    median = torch.tensor([sorted(samples)[len(samples) // 2]], dtype=torch.float64)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def timed(fn, reps: int) -> float:
    fn()  # warm-up: allocations, connections
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return slowest_median(samples)


def ddp_allreduce(grads: list[torch.Tensor], world_size: int):
    """DDP's communication per step: gradients packed into 25 MB buckets, each all-reduced
    asynchronously, then divided by the world size."""
    buckets, current, current_bytes = [], [], 0
    for g in reversed(grads):  # DDP fills buckets in reverse order of registration
        current.append(g)
        current_bytes += g.numel() * g.element_size()
        if current_bytes >= DDP_BUCKET_BYTES:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    flats = [torch.empty(sum(g.numel() for g in b)) for b in buckets]

    def run():
        works = []
        for flat, bucket in zip(flats, buckets):
            torch.cat([g.reshape(-1) for g in bucket], out=flat)
            works.append(dist.all_reduce(flat, async_op=True))
        for flat, bucket, work in zip(flats, buckets, works):
            work.wait()
            flat.div_(world_size)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    return run


def plain_push_sum(params: list[torch.Tensor], graph, rank: int, world_size: int):
    """A plain-PyTorch push-sum round as SGP implements it, with point-to-point messages."""
    state = {"round": 0}

    def run():
        r = state["round"]
        out_peers = graph.out_peers(rank, world_size, r)
        in_peers = graph.in_peers(rank, world_size, r)
        share = 1.0 / (len(out_peers) + 1)
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in params]).mul_(share)
            received = [torch.empty_like(flat) for _ in in_peers]
            works = [dist.irecv(buf, src) for buf, src in zip(received, in_peers)]
            works += [dist.isend(flat, dst) for dst in out_peers]
            for work in works:
                work.wait()
            for buf in received:
                flat.add_(buf)
            offset = 0
            for p in params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        state["round"] = r + 1

    return run


def gossip_round(model: gossip_ext.GossipDataParallel):
    def run():
        model.transfer_params()
        model.sync_comms()

    return run


def measure(num_params: int, rank: int, world_size: int, reps: int) -> dict[str, float]:
    torch.manual_seed(rank)
    module = make_params(num_params)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    params = list(module.parameters())
    graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
    with warnings.catch_warnings():
        # torch advises against period 1; it is the per-step cost this table compares.
        warnings.filterwarnings("ignore", message="When period is 1")
        averager = PeriodicModelAverager(period=1, warmup_steps=0)
    times = {
        "plain push-sum": timed(plain_push_sum(params, graph, rank, world_size), reps),
        "DDP all-reduce": timed(ddp_allreduce([p.grad for p in params], world_size), reps),
        "PeriodicModelAverager": timed(lambda: averager.average_parameters(params), reps),
    }
    model = gossip_ext.GossipDataParallel(module, graph=graph)
    times["gossip_ext"] = timed(gossip_round(model), reps)
    return times


def worker(
    rank: int, world_size: int, init_file: str, measure_fn, sizes: list[int], reps: int, out
) -> None:
    torch.set_num_threads(1)  # the workers share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )
    try:
        for num_params in sizes:
            result = measure_fn(num_params, rank, world_size, reps)
            if rank == 0:
                out[(world_size, num_params)] = result
    finally:
        dist.destroy_process_group()


def run_on_workers(world_sizes: list[int], measure_fn, sizes: list[int], reps: int) -> dict:
    """measure_fn(num_params, rank, world_size, reps) on every rank of a gloo group of each world
    size, for each size; returns rank 0's results by (world size, num_params). measure_fn must be
    a module-level function (it is pickled to the workers)."""
    with mp.Manager() as manager:
        out = manager.dict()
        for workers in world_sizes:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(
                    worker,
                    args=(workers, os.path.join(tmp, "store"), measure_fn, sizes, reps, out),
                    nprocs=workers,
                )
        return dict(out)


PEERS = ("DDP all-reduce", "PeriodicModelAverager", "plain push-sum")


def format_table(results: dict) -> str:
    header = "| workers | params | gossip_ext ms | " + " | ".join(f"{p} ms" for p in PEERS)
    header += " | " + " | ".join(f"gossip/{p.split()[0]}" for p in PEERS) + " |"
    lines = [header, "|" + "---|" * (3 + 2 * len(PEERS))]
    for (workers, num_params), t in sorted(results.items()):
        g = t["gossip_ext"]
        row = f"| {workers} | {num_params / 1e6:g}M | {1000 * g:.1f} | "
        row += " | ".join(f"{1000 * t[p]:.1f}" for p in PEERS) + " | "
        row += " | ".join(f"{g / t[p]:.2f}x" for p in PEERS) + " |"
        lines.append(row)
    return "\n".join(lines)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """--workers, --params, --reps and --no-record, shared with benchmarks/compression.py."""
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[4, 8], help="world sizes to run (default: 4 8)"
    )
    parser.add_argument(
        "--params",
        type=float,
        nargs="+",
        default=[1e6, 1e7, 2.5e7],
        help="float32 parameters per model (default: 1e6 1e7 2.5e7)",
    )
    parser.add_argument(
        "--reps", type=int, default=5, help="timed repetitions per measurement (default: 5)"
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not append the results to benchmarks/RESULTS.md",
    )


def model_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """Validates add_worker_arguments' values; returns the model sizes as ints."""
    if any(w < 2 for w in args.workers):
        parser.error(f"--workers must be >= 2, got {args.workers}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    return [int(p) for p in args.params]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    sizes = model_sizes(parser, args)

    results = run_on_workers(args.workers, measure, sizes, args.reps)

    table = format_table(results)
    print(table)
    key = (8, 25_000_000)
    if key in results:
        t = results[key]
        ddp = t["gossip_ext"] / t["DDP all-reduce"]
        plain = t["gossip_ext"] / t["plain push-sum"]
        print(
            f"\ngoals at 8 workers, 25M parameters: <= 0.5x DDP all-reduce: {ddp:.2f}x "
            f"({'met' if ddp <= 0.5 else 'missed'}); <= 0.7x plain push-sum: {plain:.2f}x "
            f"({'met' if plain <= 0.7 else 'missed'})"
        )
    if not args.no_record:
        write_section(
            "Round time",
            f"## Round time ({datetime.now(UTC):%Y-%m-%d})\n\n"
            f"Machine: {machine()}; torch {torch.__version__}; gloo on one machine "
            f"(loopback), one thread per worker.\n"
            f"Command: `{command_line()}`\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
