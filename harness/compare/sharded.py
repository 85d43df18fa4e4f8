"""Sharded replicas compared: R replicas x S shards, the byte-level language model sharded by
FSDP2 inside each replica, and what runs between the replicas.

Process ``rank`` is shard ``rank % S`` of replica ``rank // S`` (consecutive ranks, so that the
rows of ``init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))`` are
replicas). On the emulated network each replica's processes share one namespace
(``EmulatedCluster.run(..., per_namespace=S)``): FSDP2's collectives stay inside it, and only
what runs between replicas crosses its capped NIC.

==================  ==========================================================================
alone               each replica trains by itself (FSDP2 over its shards, nothing between
                    replicas): the compute floor no network can lower
hsdp                torch's HSDP, ``fully_shard`` on the 2-D mesh: the gradients
                    reduce-scattered inside the replica and all-reduced across replicas every
                    step (the baseline: its final held-out loss is the target)
sgp_overlap         gossip_ext's SGP between replicas (``process_group=mesh["replicate"]``),
                    overlapped with the next step; ``_bf16``: in bfloat16 messages
diloco              gossip_ext's DiLoCo between replicas: the exact average of the
                    pseudo-gradients every ``local_steps`` steps, an outer Nesterov SGD step
torchft_hsdp_       torchft 0.2.0's DiLoCo over the same shards: each replica one torchft replica
 diloco             group of S ranks (its Manager's pg joins shard s of every replica), the same
                    outer step
==================  ==========================================================================

Every block is sharded as its own FSDP2 unit, then the root (the embedding, tied to the output
layer, the positions and the last norm): what a user of FSDP2 does, so that a replica gathers one
block at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import tempfile
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

import gossip_ext
from harness import netns
from harness.compare import systems, worker

SYSTEMS = ("alone", "hsdp", "sgp_overlap", "sgp_overlap_bf16", "diloco", "torchft_hsdp_diloco")
# The peak learning rates of harness.compare.systems.PEAK_LR for the same algorithm unsharded
# (HSDP steps as DDP does, on the mean gradient of every process); not swept again for a replica
# of S processes' batches.
PEAK_LR = {
    "alone": systems.PEAK_LR["alone"],
    "hsdp": systems.PEAK_LR["ddp"],
    "sgp_overlap": systems.PEAK_LR["overlap_sgp"],
    "sgp_overlap_bf16": systems.PEAK_LR["overlap_sgp_bf16"],
    "diloco": systems.PEAK_LR["diloco"],
    "torchft_hsdp_diloco": systems.PEAK_LR["torchft_diloco"],
}


@dataclasses.dataclass(frozen=True)
class ShardedConfig(worker.RunConfig):
    """A run of ``system`` on ``replicas`` x ``shards`` processes."""

    replicas: int = 2
    shards: int = 2

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards


def available(system: str) -> str | None:
    """None if this Python can run ``system``, else why not."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; the systems are {', '.join(SYSTEMS)}")
    if system.startswith("torchft"):
        return systems.available("torchft_diloco")
    return None


def shard(module: nn.Module, mesh) -> None:
    """FSDP2 over ``mesh``: every block its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


def reshard(module: nn.Module) -> None:
    """Every FSDP2 unit of ``module`` back to its shards, after an evaluation: its forward
    leaves the root's parameters gathered (FSDP2 reshards them after a backward), and whatever
    writes the shards before the next forward (a gossip round absorbed, an outer step) would not
    be gathered again. gossip_ext's forward reshards by itself; this does it for every system
    alike."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class _Gossip(systems._OptimizerStep):
    """gossip_ext between replicas, on each process's shards."""

    def __init__(self, module: nn.Module, recipe: systems.Recipe, system: str, group) -> None:
        if system == "diloco":
            algorithms: dict[str, Any] = {
                "gossip": None,
                "outer": gossip_ext.DiLoCo(recipe.outer_optimizer, every=recipe.local_steps),
            }
        else:
            dtype = torch.bfloat16 if system.endswith("_bf16") else None
            algorithms = {"gossip": gossip_ext.SGP(overlap=True, message_dtype=dtype)}
        model = gossip_ext.GossipDataParallel(
            module, process_group=group, timeout=recipe.timeout, **algorithms
        )
        super().__init__(module, recipe, model)
        model.register_optimizer(self.opt)

    def finish(self) -> None:
        self.model.sync_comms()


def make(system: str, module: nn.Module, mesh, recipe: systems.Recipe, lighthouse=None):
    """``system``'s side of this process for ``module`` (not yet sharded) on the 2-D ``mesh``.
    Collective over the mesh: every process calls it together, after seeding alike."""
    why_not = available(system)
    if why_not:
        raise RuntimeError(why_not)
    if system == "hsdp":
        shard(module, mesh)  # the 2-D mesh: replicated along its first dimension
        return systems._OptimizerStep(module, recipe, module)
    shard(module, mesh["shard"])
    if system == "alone":
        return systems._OptimizerStep(module, recipe, module)
    if system == "torchft_hsdp_diloco":
        from harness.compare import sharded_torchft

        return sharded_torchft.TorchftHsdpDiloco(module, recipe, mesh, lighthouse)
    return _Gossip(module, recipe, system, mesh["replicate"].get_group())


def train(rank: int, world_size: int, init_method: str, config: ShardedConfig) -> dict:
    """Runs ``config`` on this process; its history and summary (rank 0's is reported)."""
    if world_size != config.world_size:
        raise ValueError(
            f"{config.replicas} replicas x {config.shards} shards need {config.world_size} "
            f"processes, got {world_size}"
        )
    return worker.train(rank, world_size, init_method, config, _build)


def _build(config: ShardedConfig, module: nn.Module):
    """The system and the evaluation's cleanup, for worker.train."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", (config.replicas, config.shards), mesh_dim_names=("replicate", "shard")
    )
    return make(config.system, module, mesh, config.recipe, config.lighthouse), reshard


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, config) -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum otherwise
    result = train(rank, world_size, f"file://{init_file}", config)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # gloo's threads can abort a finalizing interpreter (harness/compare/runner.py): leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local(config: ShardedConfig, start_method: str = "spawn") -> dict:
    """``config`` on this machine's loopback; rank 0's result."""
    from harness.compare import runner

    with contextlib.ExitStack() as stack:
        if config.system.startswith("torchft"):
            address = stack.enter_context(runner.lighthouse(config.replicas))
            config = dataclasses.replace(config, lighthouse=address)
        out_dir = stack.enter_context(tempfile.TemporaryDirectory())
        mp.start_processes(
            _entry,
            args=(config.world_size, os.path.join(out_dir, "store"), out_dir, config),
            nprocs=config.world_size,
            join=True,
            start_method=start_method,
        )
        with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
            return pickle.load(f)


def run(config: ShardedConfig, rate: float | None, timeout: float) -> dict:
    """``config`` on loopback if ``rate`` is None, else on an emulated network: a namespace per
    replica, its shards' processes inside it, its NIC capped at ``rate`` bits/s (needs root)."""
    if rate is None:
        return run_local(config)
    from harness.compare import runner

    with netns.EmulatedCluster(config.replicas, rate) as cluster:
        with contextlib.ExitStack() as stack:
            if config.system.startswith("torchft"):
                address = stack.enter_context(runner._lighthouse_in(cluster))
                config = dataclasses.replace(config, lighthouse=address)
            return cluster.run(
                "harness.compare.sharded:train", config, timeout, per_namespace=config.shards
            )
