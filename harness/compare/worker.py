"""One worker of a comparison run: trains the byte-level language model with one system and
records its held-out quality against wall-clock time.

Every worker of every system draws the same batches (``StdlibText.batch`` of its rank and step),
starts from the same seed and follows the same learning-rate schedule. The clock runs from a
barrier before the first step and stops while the held-out loss is measured (an evaluation is not
training time), and the held-out loss is the mean over workers of each worker's own model, the
model each would keep (gossip and decent-dp workers differ slightly; DDP's are identical).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from harness.compare import systems
from harness.tasks import byte_lm
from harness.tasks.byte_lm import ByteLM, ByteLMConfig
from harness.tasks.stdlib_text import StdlibText


@dataclasses.dataclass(frozen=True)
class RunConfig:
    system: str
    recipe: systems.Recipe
    model: ByteLMConfig = ByteLMConfig()
    batch_size: int = 16
    seed: int = 0
    eval_every: int = 50
    eval_windows: int = 64
    threads: int = 1  # torch threads per worker: workers share the machine's cores
    lighthouse: str | None = None  # torchft's, started by the runner

    def with_lighthouse(self, address: str) -> RunConfig:
        return dataclasses.replace(self, lighthouse=address)


def _mean_over_workers(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _bytes_sent() -> int | None:
    """The bytes this worker's NIC has sent (GLOO_SOCKET_IFNAME, as on the emulated cluster), or
    None on loopback."""
    nic = os.environ.get("GLOO_SOCKET_IFNAME")
    if not nic or nic == "lo":
        return None
    with open(f"/sys/class/net/{nic}/statistics/tx_bytes") as f:
        return int(f.read())


def train(rank: int, world_size: int, init_method: str, config: RunConfig, build=None) -> dict:
    """Runs ``config`` on this worker; returns its history and summary (rank 0's is reported).
    ``build(config, module)``, if given, returns the system and a function called with the
    module after each evaluation (or None), in place of ``systems.make``'s (sharded replicas
    build their system on a device mesh: harness.compare.sharded)."""
    torch.set_num_threads(config.threads)
    warnings.filterwarnings("ignore", message=".*one gossiping process.*")
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=5),
    )
    try:
        return _train(rank, world_size, config, build or _build)
    finally:
        dist.destroy_process_group()


def _build(config: RunConfig, module: torch.nn.Module):
    return systems.make(config.system, module, config.recipe, config.lighthouse), None


def _train(rank: int, world_size: int, config: RunConfig, build) -> dict:
    data = StdlibText.load()
    windows = data.heldout_windows(config.model.context, config.eval_windows)
    torch.manual_seed(config.seed)
    module = ByteLM(config.model)
    system, after_evaluation = build(config, module)
    history: dict[str, list] = {"step": [], "time": [], "train_loss": [], "heldout_bpb": []}
    losses: list[float] = []
    paused = 0.0
    steps = config.recipe.steps
    try:
        dist.barrier()
        sent_before = _bytes_sent()
        start = time.perf_counter()
        for step in range(steps):
            inputs, targets = data.batch(
                step, rank, config.batch_size, config.model.context, config.seed
            )
            losses.append(system.train_step(inputs, targets))
            if (step + 1) % config.eval_every == 0 or step + 1 == steps:
                if step + 1 == steps:
                    system.finish()
                sampled = time.perf_counter()
                history["step"].append(step + 1)
                history["time"].append(sampled - start - paused)
                history["train_loss"].append(_mean_over_workers(sum(losses) / len(losses)))
                bpb = byte_lm.heldout_bits_per_byte(system.module, windows)
                if after_evaluation is not None:
                    after_evaluation(system.module)
                history["heldout_bpb"].append(_mean_over_workers(bpb))
                losses.clear()
                paused += time.perf_counter() - sampled
        elapsed = history["time"][-1]
        sent = _bytes_sent()
    finally:
        system.close()
    return {
        "system": config.system,
        "workers": world_size,
        "params": sum(p.numel() for p in module.parameters()),
        "lr": config.recipe.lr,
        "step_ms": 1000 * _mean_over_workers(elapsed) / steps,
        "final_bpb": history["heldout_bpb"][-1],
        # Measured on the worker's NIC, all it sent (evaluation's few bytes included); None on
        # loopback, whose counters count every process of the machine.
        "wire_bytes_per_step": (
            None
            if sent is None or sent_before is None
            else _mean_over_workers((sent - sent_before) / steps)
        ),
        "peak_rss_mib": _mean_over_workers(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ),
        "history": history,
    }
