"""Compressed gossip messages: bytes and round time of 16-bit messages against float32 ones.

    python benchmarks/compression.py --workers 4 8 --params 1e6 1e7 2.5e7

Every worker holds a model of P float32 parameters. In the same run, on the same processes and
the same gloo group, this measures one synchronous round of GossipDataParallel (transfer_params()
then sync_comms(), 1 peer) with float32 messages (the peer) and with bfloat16 and float16
messages (message_dtype), and the bytes each worker sends per round. Each time is the median over
repetitions of the slowest worker. A second table runs pure gossip in-process (gossip_ext.simulate)
and reports how far the mean moved and how close the workers came, so the price of 16 bits is
shown beside the saving.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

import torch
from results import command_line, machine, write_section
from round_time import (
    add_worker_arguments,
    gossip_round,
    make_params,
    model_sizes,
    run_on_workers,
    timed,
)

import gossip_ext

MESSAGE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def measure(num_params: int, rank: int, world_size: int, reps: int) -> dict[str, tuple[float, int]]:
    """{message dtype name: (seconds per round, bytes sent per round)} for this worker."""
    results = {}
    for name, message_dtype in MESSAGE_DTYPES.items():
        torch.manual_seed(rank)
        model = gossip_ext.GossipDataParallel(make_params(num_params), message_dtype=message_dtype)
        before = model.bytes_sent
        seconds = timed(gossip_round(model), reps)
        rounds = model.gossip_round
        results[name] = (seconds, (model.bytes_sent - before) // max(rounds, 1))
    return results


def format_round_table(results: dict) -> str:
    lines = [
        "| workers | params | float32 ms | bfloat16 ms | float16 ms | float32 MB/round "
        "| 16-bit MB/round | bfloat16/float32 time | float16/float32 time |",
        "|" + "---|" * 9,
    ]
    for (workers, num_params), r in sorted(results.items()):
        f32, b16, f16 = r["float32"], r["bfloat16"], r["float16"]
        lines.append(
            f"| {workers} | {num_params / 1e6:g}M | {1000 * f32[0]:.1f} | {1000 * b16[0]:.1f} "
            f"| {1000 * f16[0]:.1f} | {f32[1] / 1e6:.2f} | {b16[1] / 1e6:.2f} "
            f"| {b16[0] / f32[0]:.2f}x | {f16[0] / f32[0]:.2f}x |"
        )
    return "\n".join(lines)


def consensus_table(nodes: int, dim: int, rounds: int) -> str:
    """Pure gossip from random starts: drift of the mean and distance to it after `rounds`."""
    values = torch.randn(nodes, dim, generator=torch.Generator().manual_seed(0))
    mean = values.double().mean(0)
    lines = [
        f"| message dtype | mean drift after {rounds} rounds | max distance to the mean |",
        "|---|---|---|",
    ]
    for name, message_dtype in MESSAGE_DTYPES.items():
        z = gossip_ext.simulate(None, values, rounds, message_dtype=message_dtype)[-1].double()
        drift = (z.mean(0) - mean).abs().max().item()
        spread = (z - mean).abs().max().item()
        lines.append(f"| {name} | {drift:.1e} | {spread:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_worker_arguments(parser)
    parser.add_argument("--rounds", type=int, default=1000, help="in-process gossip rounds")
    args = parser.parse_args(argv)
    sizes = model_sizes(parser, args)

    results = run_on_workers(args.workers, measure, sizes, args.reps)

    rounds = format_round_table(results)
    consensus = consensus_table(nodes=8, dim=100_000, rounds=args.rounds)
    print(rounds, "\n", consensus, sep="\n")
    if not args.no_record:
        write_section(
            "Compressed messages",
            f"## Compressed messages ({datetime.now(UTC):%Y-%m-%d})\n\n"
            f"Machine: {machine()}; torch {torch.__version__}; gloo on one machine "
            f"(loopback), one thread per worker.\n"
            f"Command: `{command_line()}`\n\n{rounds}\n\nPure gossip in-process, 8 nodes, "
            f"100,000 float32 values each:\n\n{consensus}\n",
        )


if __name__ == "__main__":
    main()
