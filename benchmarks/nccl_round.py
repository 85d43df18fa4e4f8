"""One gossip round through the NCCL transport on one GPU, against a device copy of its bytes.

    python benchmarks/nccl_round.py --params 1e6 1e7 2.5e7

One GPU cannot hold two NCCL ranks, so the engine plays rank 1 of 2 through LoopbackTransport:
its one message per round goes through NCCL to itself. In the same run this times:

- gossip_ext round: start_round() + finish_round() + synchronize() of a synchronous engine on
  float32 parameters (in place: the message is the parameters), and of one with bfloat16
  messages (compress, send half the bytes, absorb with the fold);
- device copy: torch's copy of the same number of bytes, what a send to self must at least move.

The ratio says what the round's bookkeeping (two events, one NCCL group, the absorb kernel) costs
beyond moving the bytes. It is not a network benchmark: see benchmarks/round_time.py and the
emulated-cluster benchmark for those.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from results import machine, record

import gossip_ext
from gossip_ext import _C


def time_ms(fn, reps: int) -> float:
    """Median wall time of fn() in ms, the GPU synchronised around each call."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return 1000 * sorted(samples)[len(samples) // 2]


def engine(params: list[torch.Tensor], message_dtype, key: str):
    store = dist.distributed_c10d._get_default_store()
    nccl = _C.NcclTransport(store, key, 0, 1, torch.cuda.current_device(), timedelta(seconds=60))
    options = _C.EngineOptions(
        gossip_ext.RingGraph()._options(),
        gossip_ext.UniformMixing()._options(),
        synchronous=True,
        message_dtype=message_dtype,
        timeout=timedelta(seconds=60),
    )
    return _C.GossipEngine(params, ["p"], _C.LoopbackTransport(nccl, 1, 2), options)


def measure(num_params: int, reps: int) -> dict:
    row = {"params": num_params}
    for name, message_dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        params = [torch.randn(num_params, device="cuda")]
        e = engine(params, message_dtype, f"bench/{num_params}/{name}")

        def round_trip(e=e):
            e.start_round()
            e.finish_round()
            e.synchronize()

        row[name] = time_ms(round_trip, reps)
        message_bytes = num_params * (4 if message_dtype is None else 2)
        src = torch.empty(message_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        row[f"copy {name}"] = time_ms(lambda dst=dst, src=src: dst.copy_(src), reps)
        del e
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7, 2.5e7, 1e8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not hasattr(_C, "NcclTransport"):
        sys.exit("benchmarks/nccl_round.py needs a CUDA GPU and a CUDA build of gossip_ext")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        rows = [measure(int(p), args.reps) for p in args.params]
        dist.destroy_process_group()
    lines = [
        "| float32 params | round ms | device copy ms | round / copy | bf16 round ms | "
        "bf16 copy ms | bf16 round / copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['params'] / 1e6:g}M | {r['float32']:.3f} | {r['copy float32']:.3f} | "
            f"{r['float32'] / r['copy float32']:.2f}x | {r['bfloat16']:.3f} | "
            f"{r['copy bfloat16']:.3f} | {r['bfloat16'] / r['copy bfloat16']:.2f}x |"
        )
    table = "\n".join(lines)
    print(f"\nOne NCCL gossip round to self on {machine(torch.device('cuda'))}\n{table}")
    if not args.no_record:
        record("NCCL round on one GPU", table, torch.device("cuda"))


if __name__ == "__main__":
    main()
