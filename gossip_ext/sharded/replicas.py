"""Sharded replicas: a module sharded by FSDP2 inside each replica, gossip or outer steps between
replicas.

A replica is a group of processes that hold one model between them, each parameter a DTensor
sharded by ``fully_shard`` over the replica's shard mesh. Process ``s`` of every replica holds
the same slice of every parameter, so the processes with shard ``s`` form a *replica group*, one
process per replica: GossipDataParallel is given that group as ``process_group`` and runs on the
process's local shards (``DTensor.to_local()``) over it, exactly as it runs on whole parameters
over a world of unsharded workers. Nothing gathers the whole model to communicate: shard ``s``
travels only between the replicas' processes ``s``, so the bytes a replica sends per round are
one model's, spread over its processes. FSDP2's own collectives (the all-gather before the
forward, the reduce-scatter of the gradients) stay inside the replica.

The local shards are FSDP2's storage (its all-gather reads them), so the engine cannot take it
over as it does whole parameters: it gossips copies of them (``gossip.inner.MirroredEngine``),
taken where the parameters may have changed (before a round starts, and before an overlapped
round is absorbed into parameters stepped since) and written back once a round was absorbed
whole. A round that fails writes nothing back: the shards stay the model they were.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _dtensor_type() -> type | None:
    """DTensor, if torch.distributed.tensor was imported (a sharded module needs it); else no
    parameter can be one. gossip_ext does not import it itself: it costs a process seconds of
    CPU, which a job that shards nothing must not pay for."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds DTensor parameters (``fully_shard``)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def local_shards(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Each parameter's local shard, by name: a tensor sharing the shard's storage (writing it
    writes the model), or the parameter itself where it is not a DTensor."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(module.named_parameters())
    with torch.no_grad():
        return [
            (name, p.to_local().detach() if isinstance(p, dtensor) else p)
            for name, p in module.named_parameters()
        ]


def replica_layout(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    nprocs_per_node: int,
    membership: Any,
    gossip_buffers: bool,
) -> dist.ProcessGroup | None:
    """The group of this replica's processes (its shard mesh) if ``module`` is sharded, after
    :func:`check_layout`; None if it is not."""
    if not is_sharded(module):
        return None
    check_layout(
        module,
        process_group,
        nprocs_per_node=nprocs_per_node,
        membership=membership,
        gossip_buffers=gossip_buffers,
    )
    return shard_group(module)


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """What a parameter and its local shard have in common: where the shard's values are, and
    how many (a DTensor's ``to_local()`` is a new view each time; the storage is the same)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor = tensor.to_local()
    return tensor.data_ptr(), tensor.numel()


def check_layout(
    module: nn.Module,
    process_group: dist.ProcessGroup | None,
    *,
    nprocs_per_node: int,
    membership: Any,
    gossip_buffers: bool,
) -> None:
    """A sharded module's constructor arguments, on every rank before any communication: the
    replica group must be given, and must hold one process per replica; in an elastic job
    (``membership``), the epochs build it, and it must not be given."""
    if nprocs_per_node > 1:
        raise ValueError(
            f"nprocs_per_node={nprocs_per_node}: a sharded module already splits the model over "
            "the processes of a replica; gossip runs between replicas, process s of each with "
            "process s of the others (nprocs_per_node=1)"
        )
    if gossip_buffers:
        raise ValueError(
            "gossip_buffers=True with a sharded module: each process of a replica holds its own "
            "copy of the buffers; average them with broadcast_buffers or keep them local"
        )
    if membership is not None:
        if process_group is not None:
            raise ValueError(
                "process_group with membership: in an elastic job of sharded replicas, each "
                "epoch builds the group of the replicas' processes of this shard; give only the "
                "module sharded over its replica's processes (fully_shard(module, mesh=...))"
            )
        return
    if process_group is None:
        raise ValueError(
            "process_group: a sharded module gossips between replicas, so give the group of this "
            "process's counterparts in the other replicas, e.g. process_group="
            'mesh["replicate"].get_group() for fully_shard(module, mesh=mesh["shard"]) on a 2-D '
            "init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
        )
    replicas = set(dist.get_process_group_ranks(process_group))
    me = dist.get_rank()
    for name, p in module.named_parameters():
        if not isinstance(p, _dtensor_type()):
            raise ValueError(
                f"parameter '{name}' is not sharded while others are: shard the whole module "
                "with fully_shard (its submodules too, as needed), so that every parameter is "
                "a DTensor"
            )
        shard_ranks = set(p.device_mesh.mesh.flatten().tolist())
        shared = sorted((shard_ranks & replicas) - {me})
        if shared or me not in shard_ranks:
            raise ValueError(
                f"process_group (ranks {sorted(replicas)}) must hold one process per replica, "
                f"but parameter '{name}' is sharded over ranks {sorted(shard_ranks)}, which "
                f"share {shared or 'none, this rank not among them'} with it: pass the group of "
                'the other dimension of the mesh (mesh["replicate"].get_group())'
            )


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` of sharded parameters with each DTensor of its state (a
    momentum, Adam's moments) as this process's local shard: what moves to another replica's
    process of the same shard, whose mesh is not this one's."""
    dtensor = _dtensor_type()
    return {
        "state": {
            index: {
                key: value.to_local() if isinstance(value, dtensor) else value
                for key, value in entries.items()
            }
            for index, entries in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def sharded_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any]:
    """:func:`local_optimizer_state`'s result made ``optimizer``'s again: each local tensor shaped
    as its parameter's local shard becomes a DTensor sharded as the parameter (a scalar, such as
    Adam's step, stays as it is)."""
    from torch.distributed.tensor import DTensor  # imported by whoever sharded the module

    # state_dict() numbers the parameters in the order of the param groups.
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def sharded(param: torch.Tensor, value: Any) -> Any:
        if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor)):
            return value
        if value.dim() != param.dim() or value.shape != param.to_local().shape:
            return value
        return DTensor.from_local(
            value.to(param.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    return {
        "state": {
            index: {key: sharded(params[index], value) for key, value in entries.items()}
            for index, entries in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def reshard(module: nn.Module) -> None:
    """Puts every FSDP2 module of ``module`` back in its sharded state. A forward outside
    training leaves the root's parameters gathered (FSDP2 reshards them after the backward),
    and the next forward would compute with those instead of the shards that gossip wrote."""
    from torch.distributed.fsdp import FSDPModule  # imported by whoever sharded the module

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def shard_group(module: nn.Module) -> dist.ProcessGroup:
    """The group of this replica's processes (the shard mesh of the module's parameters)."""
    dtensor = _dtensor_type()
    return next(p for p in module.parameters() if isinstance(p, dtensor)).device_mesh.get_group()
