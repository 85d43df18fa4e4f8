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
"""

from __future__ import annotations

import argparse
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
from results import machine, record
from torch import nn

import gossip_ext
from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

WORLD_SIZE = 2
WIDTH = 2048  # features of every Linear layer
BATCH = 16
GOAL_COPIES = 1.1
MMAP_THRESHOLD = "131072"

# name -> (kind, options); "bare" is the baseline every other row is measured against.
CONFIGS = {
    "bare model": ("bare", {}),
    "gossip_ext sync SGP": ("gossip", {}),
    "gossip_ext overlap SGP": ("gossip", {"overlap": True}),
    "gossip_ext push-pull (D-PSGD)": ("gossip", {"push_sum": False}),
    "DDP": ("ddp", {}),
    "DDP gradient_as_bucket_view": ("ddp", {"gradient_as_bucket_view": True}),
    "plain push-sum (SGP-style)": ("plain", {}),
}
# fairscale's SlowMoDistributedDataParallel through gossip_ext.compat.fairscale, in fairscale's own
# loop (step, zero_grad, perform_slowmo), beside the core wrapper with register_optimizer(), whose
# hook averages right after the step, while the gradients are still alive.
_SLOWMO = {"slowmo_momentum": 0.5, "slowmo_frequency": 1, "nprocs_per_node": 1}
CONFIGS.update(
    {
        "fairscale SlowMo memory-efficient": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 100, "slowmo_memory_efficient": True},
        ),
        "fairscale SlowMo no sharding": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 100, "slowmo_memory_efficient": False},
        ),
        "fairscale LocalSGD + SlowMo memory-efficient": (
            "fairscale",
            {**_SLOWMO, "localsgd_frequency": 1, "slowmo_memory_efficient": True},
        ),
        "fairscale LocalSGD": (
            "fairscale",
            {"slowmo_momentum": 0.0, "localsgd_frequency": 1, "nprocs_per_node": 1},
        ),
        "gossip_ext LocalSGD (hook)": (
            "hook",
            {"base_algorithm": "localsgd", "global_avg_freq": 1},
        ),
        "gossip_ext SlowMo memory-efficient (hook)": (
            "hook",
            {"base_algorithm": "localsgd", "slowmo_freq": 1, "slowmo_memory_efficient": True},
        ),
        "gossip_ext SlowMo (hook)": ("hook", {"base_algorithm": "localsgd", "slowmo_freq": 1}),
    }
)


def nesterov(params) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer (SGD with Nesterov momentum: one model copy of state)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


# DiLoCo with an outer step after every inner step (sync_every=1), so that the steps measure its
# steady state with the outer momentum alive; torchft's DiLoCo beside it, the same outer SGD.
_DILOCO = {"base_algorithm": "localsgd", "sync_every": 1, "outer_optimizer": nesterov}
CONFIGS.update(
    {
        "gossip_ext DiLoCo (hook)": ("hook", _DILOCO),
        "gossip_ext DiLoCo gossip average (hook)": (
            "hook",
            {**_DILOCO, "outer_average": "gossip"},
        ),
        "gossip_ext DiLoCo outer_device=cpu (hook)": ("hook", {**_DILOCO, "outer_device": "cpu"}),
        "torchft DiLoCo": ("torchft", {"sync_every": 1}),
    }
)
DILOCO = ("gossip_ext DiLoCo (hook)", "torchft DiLoCo")
# The extra model copies fairscale's tests/experimental/nn/data_parallel/test_gossip.py expects at
# the peak (2 workers, so the memory-efficient state is split in halves) and this project's goals.
SLOWMO_GOALS = {
    "fairscale SlowMo memory-efficient": ("~1.0 (approx(1.0, rel 0.1))", 1.1),
    "fairscale SlowMo no sharding": ("~2.0 (approx(2.0, rel 0.1))", 2.1),
    "fairscale LocalSGD + SlowMo memory-efficient": ("1.0 + LocalSGD's < 0.3", 1.3),
    "fairscale LocalSGD": ("< 0.3", 0.3),
}
GOSSIP_SYNC = "gossip_ext sync SGP"
PEERS = ("DDP", "DDP gradient_as_bucket_view", "plain push-sum (SGP-style)")


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


# ----------------------------------------------------------------------------- models


def make_model(num_params: int, device: torch.device) -> nn.Module:
    layers = max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).to(device)


class PlainPushSum:
    """Synchronous push-sum in plain PyTorch, as SGP's gossiper does it: a round flattens the
    parameters into a new message scaled by the mixing share, posts it to the out-peers and
    receives into new buffers (after the optimizer step); the next forward waits, sums, and
    copies the result back into the parameters. Uniform mixing on a regular graph, so the
    push-sum weight stays 1 and is not sent."""

    def __init__(self, module: nn.Module, rank: int, world_size: int):
        self.module = module
        self.params = list(module.parameters())
        self.graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
        self.rank, self.world_size, self.round = rank, world_size, 0
        self.pending = None
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, 0)

    def __call__(self, x):
        self.finish_round()
        return self.module(x)

    def transfer_params(self) -> None:
        self.finish_round()
        out_peers = self.graph.out_peers(self.rank, self.world_size, self.round)
        in_peers = self.graph.in_peers(self.rank, self.world_size, self.round)
        with torch.no_grad():
            message = torch.cat([p.reshape(-1) for p in self.params]).mul_(
                1.0 / (len(out_peers) + 1)
            )
            received = [torch.empty_like(message) for _ in in_peers]
            works = [dist.irecv(buf, src) for buf, src in zip(received, in_peers)]
            works += [dist.isend(message, dst) for dst in out_peers]
        self.pending = (message, received, works)

    def wait_for_messages(self) -> None:
        if self.pending is not None:
            for work in self.pending[2]:
                work.wait()

    def finish_round(self) -> None:
        if self.pending is None:
            return
        self.wait_for_messages()
        message, received, _ = self.pending
        with torch.no_grad():
            for buf in received:
                message.add_(buf)
            offset = 0
            for p in self.params:
                p.copy_(message[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.pending = None
        self.round += 1


class TorchftDiLoCo:
    """torchft's DiLoCo on this worker: one replica group of one process, coordinated by the
    lighthouse the parent started; outer steps run from the inner optimizer's step hook."""

    def __init__(self, module: nn.Module, opt, lighthouse: str, rank: int, world_size: int, **kw):
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        self.module = module
        timeout = timedelta(minutes=5)
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda sd: module.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": module.state_dict()},
            min_replica_size=world_size,
            use_async_quorum=False,
            replica_id=f"replica_{rank}",
            store_addr="127.0.0.1",
            store_port=self._store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            hostname="127.0.0.1",
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self.diloco = DiLoCo(self.manager, [module], opt, nesterov(module.parameters()), **kw)
        self.diloco.__enter__()

    def __call__(self, x):
        return self.module(x)

    def close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def wrap(kind: str, options: dict, module: nn.Module, rank: int, world_size: int):
    if kind == "bare":
        return module
    if kind == "gossip":
        if options.get("push_sum") is False:
            options = {**options, "graph": gossip_ext.DynamicBipartiteExponentialGraph()}
        return gossip_ext.GossipDataParallel(module, **options)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(module, **options)
    if kind == "fairscale":
        return SlowMoDistributedDataParallel(module, **options)
    if kind == "hook":
        return gossip_ext.GossipDataParallel(module, **options)
    if next(module.parameters()).device.type != "cpu":
        raise ValueError(
            "the plain push-sum sends with gloo point-to-point, which takes CPU tensors"
        )
    return PlainPushSum(module, rank, world_size)


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


# ----------------------------------------------------------------------------- reporting


def growth(result: dict, metric: str, point: str) -> int:
    """Bytes this process grew by from "model created" to the given point."""
    return result["samples"][f"{metric} {point}"] - result["samples"][f"{metric} model"]


def extra_copies(results: dict, config: str, metric: str, point: str, base_point: str) -> float:
    """The largest, over the ranks, of (config's growth - bare model's growth) / model bytes."""
    values = []
    for rank in range(WORLD_SIZE):
        mine, bare = results[config][rank], results["bare model"][rank]
        extra = growth(mine, metric, point) - growth(bare, metric, base_point)
        values.append(extra / mine["model_bytes"])
    return max(values)


def format_table(results: dict, metric: str) -> str:
    points = [
        ("after wrap", "wrapped", "wrapped"),
        ("peak while wrapping", "wrap peak", "wrap peak"),
        ("steady state after steps", "steady", "steady"),
        ("peak during steps", "steps peak", "steps peak"),
    ]
    header = "| configuration | " + " | ".join(p[0] for p in points) + " |"
    lines = [header, "|" + "---|" * (1 + len(points))]
    for config, ranks in results.items():
        if config == "bare model":
            continue
        if "error" in ranks[0]:
            lines.append(f"| {config} | " + " | ".join(["n/a"] * len(points)) + " |")
            continue
        cells = []
        for _, point, base in points:
            if metric == "rss" and "peak" in point and not ranks[0]["peak_ok"]:
                cells.append("n/a")
            else:
                cells.append(f"{extra_copies(results, config, metric, point, base):.2f}")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bare_line(results: dict, metric: str) -> str:
    bare = results["bare model"][0]
    mb = bare["model_bytes"] / 2**20
    grow = growth(bare, metric, "steady") / bare["model_bytes"]
    return (
        f"Model: {bare['num_params'] / 1e6:.2f}M float32 parameters = {mb:.1f} MiB (one model "
        f"copy). The bare model grows by {grow:.2f} copies over the steps (its gradients, one "
        f"copy, and the BLAS and allocator working set)."
    )


def verdict(results: dict, metric: str) -> str:
    sync = results.get(GOSSIP_SYNC)
    if sync is None:
        return ""
    if "error" in sync[0]:
        return f"gossip_ext sync SGP could not run here: {sync[0]['error']}"
    steady = extra_copies(results, GOSSIP_SYNC, metric, "steady", "steady")
    peak_ok = metric != "rss" or sync[0]["peak_ok"]
    peak = extra_copies(results, GOSSIP_SYNC, metric, "steps peak", "steps peak")
    worst = max(steady, peak) if peak_ok else steady
    lines = [
        f"Goal: <= {GOAL_COPIES} model copies extra in synchronous mode: steady {steady:.2f}, "
        + (f"peak {peak:.2f}" if peak_ok else "peak n/a")
        + f" -> {'met' if worst <= GOAL_COPIES else 'missed'}."
    ]
    beside = []
    for peer in PEERS:
        if peer in results and "error" not in results[peer][0]:
            other = extra_copies(results, peer, metric, "steady", "steady")
            ratio = f"{steady / other:.2f}x" if other > 0.05 else "n/a (peer adds ~0)"
            beside.append(f"{peer}: {steady:.2f} against {other:.2f} copies (ratio {ratio})")
    if beside:
        lines.append("Steady extra vs " + "; vs ".join(beside) + ".")
    return "\n".join(lines)


def slowmo_verdict(results: dict, metric: str) -> str:
    lines = []
    for config, (fairscale, goal) in SLOWMO_GOALS.items():
        if config not in results or "error" in results[config][0]:
            continue
        peak = extra_copies(results, config, metric, "steps peak", "steps peak")
        lines.append(
            f"- {config}: peak {peak:.2f} extra copies; fairscale's tests expect {fairscale}; "
            f"goal <= {goal} -> {'met' if peak <= goal else 'missed'}"
        )
    return "\n".join(lines)


def diloco_verdict(results: dict, metric: str) -> str:
    """DiLoCo's outer state beside torchft's: theta_global and the outer momentum are two model
    copies; a step adds the average, which becomes the gradient."""
    found = {c: results[c] for c in DILOCO if c in results and "error" not in results[c][0]}
    if not found:
        return ""
    cells = [
        f"{c}: steady {extra_copies(results, c, metric, 'steady', 'steady'):.2f}, peak "
        f"{extra_copies(results, c, metric, 'steps peak', 'steps peak'):.2f}"
        for c in found
    ]
    return (
        "- DiLoCo (outer SGD-Nesterov every step), extra copies: "
        + "; ".join(cells)
        + ". Expected for gossip_ext: 2 steady (theta_global, the outer momentum), 3 at the "
        "peak (the average, which becomes the gradient). torchft keeps the same two copies (its "
        "backup of the global parameters and the outer momentum) but its outer step ends with "
        "zero_grad() on the module's parameters, which frees the gradients that the bare loop "
        "keeps until its next zero_grad(): its steady figure is one copy lower for that."
    )


def composition(world_size: int) -> str:
    graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
    in_peers = max(
        len(graph.in_peers(r, world_size, t))
        for r in range(world_size)
        for t in range(4 * world_size)
    )
    return (
        f"What gossip_ext's extra memory is made of (GossipEngine, world size {world_size}, "
        f"{graph!r}): a receive buffer per in-peer, {in_peers} here, allocated by the first "
        f"round. Synchronous modes send the parameters in place (Note [Sending in place]), so "
        f"they need no send buffer; overlap and bounded asynchrony keep one, a model copy, "
        f"because the optimizer updates the parameters while the round is in flight. The flat "
        f"parameter buffer takes over the parameters' storage one parameter at a time (at most "
        f"one parameter is held twice while wrapping), so it adds nothing. Expected steady "
        f"extra: {in_peers} copies (synchronous), 1 + {in_peers} (overlap)."
    )


def report(results: dict, args) -> str:
    device = torch.device(args.device)
    malloc = (
        "glibc defaults" if args.malloc_defaults else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    parts = [
        f"{WORLD_SIZE} workers on gloo, {args.steps} steps, SGD without momentum, batch {BATCH}; "
        f"model on {device.type}; {malloc}.",
        bare_line(results, "rss"),
        "",
        "Extra memory over the bare model, in model copies (max over the 2 workers; anonymous "
        "RSS, peaks from VmHWM):",
        "",
        format_table(results, "rss"),
        "",
        verdict(results, "rss"),
        slowmo_verdict(results, "rss"),
        diloco_verdict(results, "rss"),
    ]
    if device.type == "cuda":
        parts += [
            "",
            "Extra CUDA memory (torch.cuda memory_allocated / max_memory_allocated), in model "
            "copies:",
            "",
            format_table(results, "cuda"),
            "",
            verdict(results, "cuda"),
        ]
    errors = [f"- {c}: {r[0]['error']}" for c, r in results.items() if "error" in r[0]]
    if errors:
        parts += ["", "Not run:", *errors]
    parts += ["", composition(WORLD_SIZE)]
    return "\n".join(parts)


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
