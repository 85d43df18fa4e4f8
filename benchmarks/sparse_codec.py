"""Sparse top-k messages: the compiled kernels against the plain-PyTorch codec of the same format.

    python benchmarks/sparse_codec.py --threads 1 --workers 4

For the bucket of the byte-level transformer of 0.44M parameters (2 layers, width 128, context
64: the comparisons' model, one float32 bucket), in each TopK format, in the same run, this times:

- encode + decode: one message encoded and added into a total, by
  ``torch.ops.gossip_ext.topk_encode`` and ``topk_add_into`` (compiled), by
  tests/sparse_reference.py (torch ops: a stable sort per chunk, gather, scatter_add_; the byte
  for byte reference of the kernels), and by the torch codec the outer step ran before the
  kernels (torch.topk in place of the stable sort: the same bytes but for the order of positions
  and which of equal magnitudes is kept);
- the outer step's own compute: what ``SparseMean.mean`` runs on one rank of --workers, with the
  collectives left out: one encode, then ``workers + 1`` messages added (every rank's message,
  and its own once more for its residual).

The compiled and the reference messages are checked equal first. Times are medians of
torch.utils.benchmark.Timer.blocked_autorange on the CPU, with --threads threads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.benchmark import Timer

import gossip_ext  # noqa: F401  (registers torch.ops.gossip_ext)
from gossip_ext.averagings.sparse import TopK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path += [ROOT, os.path.join(ROOT, "tests")]  # harness/, and the reference in tests/
import sparse_reference as reference  # noqa: E402

from harness.tasks.byte_lm import ByteLM, ByteLMConfig  # noqa: E402

FORMATS = {
    "topk 1/64 2-bit": TopK(density=1 / 64, bits=2),
    "topk 1/64 4-bit": TopK(density=1 / 64, bits=4),
}


def topk_encode(values: torch.Tensor, k: int, bits: int, chunk: int) -> torch.Tensor:
    """The torch codec SparseMean ran before the kernels: torch.topk picks each chunk's k (its
    positions in topk's order, ties as topk breaks them), otherwise the reference's arithmetic."""
    chunks = -(-values.numel() // chunk)
    padded = values.new_zeros(chunks * chunk)
    padded[: values.numel()] = values
    rows = padded.view(chunks, chunk)
    positions = rows.abs().topk(k, dim=1, sorted=False).indices
    kept = rows.gather(1, positions)
    scale = kept.abs().amax(dim=1, keepdim=True).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(values.dtype)
    levels = 2**bits - 1
    codes = ((kept / safe + 1) * (levels / 2)).round_().clamp_(0, levels).to(torch.uint8)
    return torch.cat(
        [
            scale.reshape(-1).view(torch.uint8),
            positions.to(torch.int16).reshape(-1).view(torch.uint8),
            reference.pack(codes.reshape(-1), bits),
        ]
    )


CODECS = {
    "compiled": (torch.ops.gossip_ext.topk_encode, torch.ops.gossip_ext.topk_add_into),
    "reference": (reference.encode, reference.add_into),
    "topk": (topk_encode, reference.add_into),
}


def model_numel() -> int:
    model = ByteLM(ByteLMConfig(layers=2, width=128, context=64))
    return sum(p.numel() for p in model.parameters())


def seconds(fn, threads: int) -> float:
    return (
        Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        .blocked_autorange(min_run_time=1.0)
        .median
    )


def run(numel: int, workers: int, threads: int) -> list[tuple]:
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for name, f in FORMATS.items():
        chunks = -(-numel // f.chunk)
        total = torch.zeros(chunks, f.chunk)
        args = (f.k, f.bits, f.chunk)
        messages = {c: encode(values, *args) for c, (encode, _) in CODECS.items()}
        if not torch.equal(messages["compiled"], messages["reference"]):
            raise RuntimeError(f"{name}: the compiled message differs from the reference's")
        times = {}
        for codec, (encode, add_into) in CODECS.items():

            def one(encode=encode, add_into=add_into, total=total, args=args):
                add_into(total, encode(values, *args), *args)

            def step(encode=encode, add_into=add_into, total=total, args=args):
                message = encode(values, *args)
                for _ in range(workers + 1):
                    add_into(total, message, *args)

            times[codec] = (seconds(one, threads), seconds(step, threads))
        rows.append((name, times))
    return rows


def format_table(rows: list[tuple], numel: int, workers: int, threads: int) -> str:
    lines = [
        f"{numel:,} float32 values (one bucket), {threads} thread{'s' * (threads > 1)}; the outer "
        f"step's compute at {workers} workers (1 encode, {workers + 1} decodes). Each cell: the "
        "time, and its multiple of the compiled kernels'.",
        "",
        "| message | what | compiled | torch reference (stable sort) | torch, topk (before) |",
        "|---|---|---|---|---|",
    ]
    for name, t in rows:
        for i, what in enumerate(("encode + decode", "outer step compute")):
            base = t["compiled"][i]
            cells = [f"{1e3 * t[c][i]:.2f} ms ({t[c][i] / base:.1f}x)" for c in CODECS]
            lines.append(f"| {name} | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--workers", type=int, default=4, help="workers (default: 4)")
    parser.add_argument(
        "--numel", type=int, default=0, help="values (default: the 0.44M-parameter model's)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = args.numel or model_numel()
    print(format_table(run(numel, args.workers, args.threads), numel, args.workers, args.threads))


if __name__ == "__main__":
    main()
