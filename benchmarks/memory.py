"""Memory: the extra memory GossipDataParallel takes over the bare model, in model copies.

    python benchmarks/memory.py --params 2.5e7 --steps 5

Two worker processes on gloo (torch.multiprocessing.spawn, a file:// store) train a stack of
nn.Linear layers (float32, about --params parameters) with SGD without momentum, so the optimizer
holds no state. Every configuration runs in a fresh pair of processes, and each process measures
itself: its anonymous resident memory (resident minus file-backed pages, /proc/self/statm: the
code pages of libraries that the first backward faults in are not data) when the model has been
created, after wrapping, and after --steps training steps (zero_grad, forward, backward, step,
and transfer_params() for gossip: the steady state of synchronous mode, a round in flight), and
its peak resident set (VmHWM of /proc/self/status, reset through /proc/self/clear_refs) while
wrapping and during the steps.

Extra memory of a configuration = its growth from "model created" minus the bare model's growth
over the same steps (gradients, activations and the allocators' caches are in both), divided by
the model's bytes. The table gives the largest value over the two processes.

Configurations: the bare model (the baseline); gossip_ext in synchronous SGP (the goal:
<= 1.1 model copies extra), overlap SGP and push-pull (D-PSGD); and, beside them in the same run,
DistributedDataParallel (default, and gradient_as_bucket_view=True) and a plain-PyTorch
push-sum as SGP implements it (flatten the parameters into a new message every round, receive
into new buffers, absorb, copy back).

glibc's malloc keeps freed blocks below its (self-raising) mmap threshold in the heap, which would
make the resident set depend on the order of allocations rather than on what is alive. The
workers therefore run with MALLOC_MMAP_THRESHOLD_=131072, so that every buffer of a model layer is
its own mapping and is returned when freed (--malloc-defaults turns this off).
With --device cuda the model lives on the GPU and torch.cuda.memory_allocated and
max_memory_allocated are reported the same way.

The benchmark's parts, beside this command line: memory_configs.py (the configurations and the
goals), memory_wrappers.py (the model and each configuration's wrapper), memory_workers.py (the
worker processes and the memory they sample) and memory_report.py (the table and the verdicts).
"""

from __future__ import annotations

import argparse
import os

import torch
from memory_configs import CONFIGS, MMAP_THRESHOLD, WIDTH
from memory_report import report
from memory_workers import run_configs
from results import machine, record


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Measures the extra memory of GossipDataParallel over the bare model (and of "
        "DDP and a plain-PyTorch push-sum), in model copies, on 2 gloo workers.",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda (adds torch.cuda allocator numbers) (default: cpu)",
    )
    parser.add_argument(
        "--params",
        type=float,
        default=2.5e7,
        help=f"float32 parameters, rounded to whole {WIDTH}x{WIDTH} Linear layers (default: 2.5e7)",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="training steps per configuration (default: 5)"
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated subset of the configurations; the bare model always runs "
        "(default: all)",
    )
    parser.add_argument(
        "--malloc-defaults",
        action="store_true",
        help=f"keep glibc's malloc defaults instead of MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}",
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not append the results to benchmarks/RESULTS.md",
    )
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs must be a subset of {','.join(CONFIGS)}, got {unknown}")
    args.configs = ["bare model"] + [c for c in CONFIGS if c in configs and c != "bare model"]
    args.params = int(args.params)
    if args.params < 1:
        parser.error(f"--params must be >= 1, got {args.params}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (a steady state), got {args.steps}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    if not os.path.exists("/proc/self/statm"):
        parser.error("this benchmark reads /proc/self/statm (Linux)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = run_configs(args)
    text = report(results, args)
    print(f"\nMemory ({machine(torch.device(args.device))}), torch {torch.__version__}\n")
    print(text)
    if not args.no_record:
        record(f"Memory, {args.device}", text, torch.device(args.device))
    return results


if __name__ == "__main__":
    main()
