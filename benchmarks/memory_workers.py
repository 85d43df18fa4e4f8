"""The measuring side of benchmarks/memory.py: the worker processes and what they sample.

run_configs starts a fresh pair of gloo workers for every configuration (so that no
configuration inherits another's heap); each worker builds the model, wraps it, trains
--steps steps and samples its own memory with a Probe at every point the report compares:
anonymous resident memory from /proc/self/statm, the peak from VmHWM, and the CUDA allocator's
figures when the model is on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from memory_configs import BATCH, CONFIGS, MMAP_THRESHOLD, WIDTH, WORLD_SIZE
from memory_wrappers import TorchftDiLoCo, make_model, wrap

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

# ----------------------------------------------------------------------------- measuring


PAGE = os.sysconf("SC_PAGE_SIZE")


def anon_rss_bytes() -> int:
    """Anonymous resident memory: resident minus file-backed and shared pages (/proc/self/statm),
    so that code pages of libraries faulted in by the first backward do not count."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def reset_peak() -> bool:
    """Resets VmHWM to the current resident set (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


class Probe:
    """Samples this process's memory: the resident set, and the CUDA allocator when on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.samples: dict[str, int] = {}

    def mark(self, name: str) -> None:
        self.samples[f"rss {name}"] = anon_rss_bytes()
        if self.cuda:
            torch.cuda.synchronize()
            self.samples[f"cuda {name}"] = torch.cuda.memory_allocated()

    def start_peak(self) -> None:
        self.peak_ok = reset_peak()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def end_peak(self, name: str) -> None:
        self.samples[f"rss {name}"] = peak_rss_bytes() if self.peak_ok else -1
        if self.cuda:
            torch.cuda.synchronize()
            self.samples[f"cuda {name}"] = torch.cuda.max_memory_allocated()


# ----------------------------------------------------------------------------- workers


def measure(rank: int, world_size: int, config: str, args) -> dict:
    kind, options = CONFIGS[config]
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    probe = Probe(device)
    gen = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(BATCH, WIDTH, generator=gen).to(device) for _ in range(args.steps)]

    # The first optimizer a process builds imports what torch.optim loads lazily (about 66 MiB of
    # code and data, once per process): outside the measurement, or an outer optimizer built
    # while wrapping would be charged for it.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    probe.mark("start")
    torch.manual_seed(0)
    module = make_model(args.params, device)
    probe.mark("model")
    probe.start_peak()
    if kind == "torchft":  # built around the inner optimizer
        opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0)
        model = TorchftDiLoCo(module, opt, args.lighthouse, rank, world_size, **options)
    else:
        model = wrap(kind, options, module, rank, world_size)
    probe.end_peak("wrap peak")
    probe.mark("wrapped")
    if kind != "torchft":
        opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0)
    if kind == "hook":
        model.register_optimizer(opt)
    dist.barrier()
    probe.start_peak()
    for x in inputs:
        if kind != "fairscale":
            opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if kind in ("gossip", "plain"):
            model.transfer_params()
        elif kind == "fairscale":  # fairscale's loop: the gradients are freed before averaging
            opt.zero_grad(set_to_none=True)
            model.perform_slowmo(opt)
    if kind == "plain":
        # Its receive buffers are new each round: count them once the peer's message has landed
        # (gossip_ext's are persistent and were filled by the previous rounds).
        model.wait_for_messages()
    probe.end_peak("steps peak")
    probe.mark("steady")
    dist.barrier()
    if kind == "torchft":
        model.close()
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "samples": probe.samples,
        "model_bytes": model_bytes,
        "num_params": sum(p.numel() for p in module.parameters()),
        "peak_ok": probe.peak_ok,
    }


def worker(rank: int, world_size: int, init_file: str, config: str, args, out) -> None:
    torch.set_num_threads(1)  # the two workers share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    try:
        try:
            out[(config, rank)] = measure(rank, world_size, config, args)
        except (ValueError, TypeError, RuntimeError) as e:
            # A configuration this build does not support (e.g. gossip of CUDA parameters)
            # raises on every rank before any communication: record why, and go on.
            out[(config, rank)] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
            traceback.print_exc()
    finally:
        dist.destroy_process_group()


def run_configs(args) -> dict:
    if not args.malloc_defaults:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # inherited by spawned workers
    results = {}
    with mp.Manager() as manager:
        out = manager.dict()
        for config in args.configs:
            with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
                args.lighthouse = None
                if CONFIGS[config][0] == "torchft":
                    if importlib.util.find_spec("torchft") is None:
                        print(f"left out: {config} (pip install torchft==0.2.0)")
                        continue
                    from harness.compare.runner import lighthouse

                    args.lighthouse = stack.enter_context(lighthouse(WORLD_SIZE))
                mp.spawn(
                    worker,
                    args=(WORLD_SIZE, os.path.join(tmp, "store"), config, args, out),
                    nprocs=WORLD_SIZE,
                )
            results[config] = [out[(config, rank)] for rank in range(WORLD_SIZE)]
    return results
