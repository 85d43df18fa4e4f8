"""One gossip round through the NCCL transport on one GPU, beside a bare NCCL send and receive.

    python benchmarks/nccl_round.py --params 2.5e7 1e8

One GPU cannot hold two NCCL ranks, so the engine plays rank 1 of 2 through LoopbackTransport:
its one message per round goes through NCCL to itself. In the same run this times:

- gossip_ext round: start_round() + finish_round() + synchronize() of a synchronous engine on
  float32 parameters (in place: the message is the parameters), and of one with bfloat16
  messages (compress, send half the bytes, absorb with the fold);
- bare send/receive: the same bytes sent and received by torch.distributed's NCCL backend in a
  world of one (one batch_isend_irecv to self), what the round's transfer costs at least;
- device copy: torch's copy of the parameters' bytes. An absorb of one message reads the
  parameters and the message and writes the parameters, 1.5x a copy's bytes: at copy speed it
  takes 1.5x the copy's time.

Bound = bare send/receive + 1.5 x device copy: a round that moves its bytes once and absorbs at
copy speed. Goal: the float32 round within 1.2x of it. It is not a network benchmark: see
benchmarks/round_time.py and the emulated-cluster benchmark for those.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from results import machine, record

import gossip_ext
from gossip_ext._torch_check import _C


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
        gossip_ext.RingGraph().compiled_options(),
        gossip_ext.UniformMixing().compiled_options(),
        synchronous=True,
        message_dtype=message_dtype,
        timeout=timedelta(seconds=60),
    )
    return _C.GossipEngine(params, ["p"], _C.LoopbackTransport(nccl, 1, 2), options)


def bare_send_receive(src: torch.Tensor, dst: torch.Tensor, group) -> None:
    """src sent to this rank and received into dst by torch's NCCL backend, in one group call."""
    ops = [dist.P2POp(dist.isend, src, 0, group), dist.P2POp(dist.irecv, dst, 0, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def copy_ms(num_params: int, reps: int) -> float:
    """A device copy of num_params float32 values."""
    state = torch.empty(num_params, device="cuda")
    copy = torch.empty_like(state)
    return time_ms(lambda: copy.copy_(state), reps)


def measure_rounds(num_params: int, reps: int) -> dict:
    """The gossip rounds of num_params parameters, float32 and bfloat16 messages, and a copy."""
    row = {"params": num_params, "copy": copy_ms(num_params, reps)}
    for name, message_dtype in (("float32", None), ("bfloat16", torch.bfloat16)):
        params = [torch.randn(num_params, device="cuda")]
        e = engine(params, message_dtype, f"bench/{num_params}/{name}")

        def round_trip(e=e):
            e.start_round()
            e.finish_round()
            e.synchronize()

        row[name] = statistics.median(time_ms(round_trip, reps) for _ in range(3))
        print(f"{num_params / 1e6:g}M {name}: gossip round {row[name]:.3f} ms", flush=True)
        del e
    return row


def measure_bare(row: dict, reps: int, nccl_group) -> None:
    """The bare send/receive of each row's message bytes, added to the row."""
    num_params = row["params"]
    for name, message_bytes in (("float32", 4 * num_params), ("bfloat16", 2 * num_params)):
        src = torch.empty(message_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        try:
            row[f"bare {name}"] = statistics.median(
                time_ms(lambda src=src, dst=dst: bare_send_receive(src, dst, nccl_group), reps)
                for _ in range(3)
            )
        except (RuntimeError, ValueError) as error:  # the table still shows the rounds
            print(f"bare send/receive of {message_bytes} bytes to self failed: {error}")
            row[f"bare {name}"] = float("nan")
        print(f"{num_params / 1e6:g}M {name}: bare send/receive {row[f'bare {name}']:.3f} ms")


def format_table(rows: list[dict]) -> str:
    lines = [
        "| params | copy ms | float32 round ms | bare send/recv ms | bound ms | round / bound "
        "(goal <= 1.2) | bf16 round ms | bf16 bare send/recv ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = r["bare float32"] + 1.5 * r["copy"]
        lines.append(
            f"| {r['params'] / 1e6:g}M | {r['copy']:.3f} | {r['float32']:.3f} "
            f"| {r['bare float32']:.3f} | {bound:.3f} | {r['float32'] / bound:.2f}x "
            f"| {r['bfloat16']:.3f} | {r['bare bfloat16']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 2.5e7, 1e8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not hasattr(_C, "NcclTransport"):
        sys.exit("benchmarks/nccl_round.py needs a CUDA GPU and a CUDA build of gossip_ext")
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1
        )
        rows = [measure_rounds(int(p), args.reps) for p in args.params]
        # torch's NCCL communicator only once the engine's rounds are timed: whatever befalls
        # it, the rounds' figures are printed above.
        nccl_group = dist.new_group([0], backend="nccl")
        for row in rows:
            measure_bare(row, args.reps, nccl_group)
        dist.destroy_process_group()
    table = format_table(rows)
    print(f"\nOne NCCL gossip round to self on {machine(torch.device('cuda'))}\n{table}")
    if not args.no_record:
        record("NCCL round on one GPU", table, torch.device("cuda"))


if __name__ == "__main__":
    main()
