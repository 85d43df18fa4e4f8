"""Checkpoints of sharded replicas through torch.distributed.checkpoint (DCP).

Under gossip or between DiLoCo's outer steps the replicas hold different models, which DCP
alone cannot save: it keeps one copy of every entry of the same name and offsets, as it should
for HSDP's identical replicas. So every tensor that differs between replicas is saved with a
leading replica dimension: a parameter of shape ``G``, sharded by FSDP2 along its first dimension
inside each replica, becomes a tensor of shape ``(replicas, *G)`` sharded along both, one row a
replica. The same is done for the inner optimizer's tensors and for the outer step's state where
it is one tensor per parameter (DiLoCo's ``theta_global`` and outer optimizer); the rest (the
push-sum state, the step count, any other outer state) is saved by every process under a name of
its own.

Loading under the same mesh puts everything back: the run continues bit for bit. Under another
mesh (``replicas' x shards'``), DCP cuts every tensor for the new shards, and replica ``r`` takes
saved replica ``r mod replicas``: its parameters, inner and outer optimizer state and step count;
the push-sum state starts again (round 0, weight 1: the parameters are the model). Outer state
that is not one tensor per parameter (SlowMo's, Streaming DiLoCo's, compressed messages'
residuals) cannot be cut anew, and loading it under another mesh raises, naming it.

    gossip_ext.sharded.checkpoint.save(model, "ckpt/step-1000", optimizer)
    gossip_ext.sharded.checkpoint.load(model, "ckpt/step-1000", optimizer)  # any mesh
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _plain_messages
from gossip_ext.sharded import replicas as sharded

_LAYOUT = "gossip_ext.layout"


def save(model: nn.Module, checkpoint_id: str, optimizer: torch.optim.Optimizer | None = None):
    """Saves a GossipDataParallel of sharded replicas (and the inner ``optimizer``, if given)
    under ``checkpoint_id`` (a directory). Collective over every process of every replica; it
    absorbs the round in flight first, as ``state_dict()`` does."""
    from torch.distributed.tensor import Shard

    layout = _Layout(model)
    model.sync_comms()
    sharded.reshard(model.module)
    mesh = layout.mesh()
    state: dict[str, Any] = {_LAYOUT: torch.tensor([layout.replicas, layout.shards])}
    for key, (local, like) in _per_parameter(model, optimizer).items():
        state[key] = _from_local(
            local.unsqueeze(0), mesh, [Shard(0), Shard(1)], like, layout.replicas
        )
    outer = model.runtime.outer.per_parameter_state()
    meta = {
        "steps": model.step_count,
        "optimizer": _optimizer_rest(model, optimizer),
        "outer_per_parameter": None if outer is None else sorted(outer),
    }
    state[f"replica{layout.replica}.meta"] = _saved(meta)
    state[f"replica{layout.replica}.shard{layout.shard}.extra"] = _saved(model.get_extra_state())
    _dcp().save(state, checkpoint_id=checkpoint_id)


def load(model: nn.Module, checkpoint_id: str, optimizer: torch.optim.Optimizer | None = None):
    """Loads what :func:`save` wrote into a GossipDataParallel of sharded replicas built on any
    mesh (see the module), and into the inner ``optimizer`` if given. Collective."""
    from torch.distributed.tensor import Shard

    dcp = _dcp()
    layout = _Layout(model)
    model.sync_comms()
    sharded.reshard(model.module)
    saved = {_LAYOUT: torch.zeros(2, dtype=torch.int64)}
    dcp.load(saved, checkpoint_id=checkpoint_id)
    replicas, shards = (int(v) for v in saved[_LAYOUT])
    same_mesh = (replicas, shards) == (layout.replicas, layout.shards)
    source = layout.replica % replicas
    names = set(dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata)
    wanted = _per_parameter(model, optimizer, saved_names=names)
    targets: dict[str, Any] = {}
    for key, (local, like) in wanted.items():
        rows = torch.empty((replicas, *local.shape), dtype=local.dtype, device=local.device)
        targets[key] = _from_local(rows, like.device_mesh, [Shard(1)], like, replicas)
    meta_key = f"replica{source}.meta"
    targets[meta_key] = b""
    extra_key = f"replica{layout.replica}.shard{layout.shard}.extra"
    if same_mesh:
        targets[extra_key] = b""
    dcp.load(targets, checkpoint_id=checkpoint_id)

    rows = {_parse(key): targets[key].to_local()[source] for key in wanted}
    # Before anything is written: a load that fails leaves the model as it was.
    meta = _meta(_loaded(targets[meta_key], checkpoint_id, meta_key), checkpoint_id, meta_key)
    extra = _loaded(targets[extra_key], checkpoint_id, extra_key) if same_mesh else None
    if not same_mesh and meta["outer_per_parameter"] is None:
        raise ValueError(
            f"load: {checkpoint_id!r} was saved under {replicas} x {shards} (replicas x shards), "
            f"this model is {layout.replicas} x {layout.shards}, and its outer step's state "
            "(SlowMo's, Streaming DiLoCo's or compressed messages' residuals) is not one tensor "
            "per parameter, so it cannot be cut for another mesh; load it under the mesh it was "
            "saved with"
        )
    with torch.no_grad():
        for (kind, _, name), row in rows.items():
            if kind == "module":
                wanted[_key(kind, "", name)][0].copy_(row)
    if optimizer is not None:
        _load_optimizer(model, optimizer, rows, meta["optimizer"])
    if same_mesh:
        model.set_extra_state(extra)
        return
    outer: dict[str, list[torch.Tensor]] = {}
    for name, _ in model.module.named_parameters():
        for (kind, part, of), row in rows.items():
            if kind == "outer" and of == name:
                outer.setdefault(part, []).append(row)
    model.runtime.outer.load_per_parameter_state(outer)
    model.step_count = int(meta["steps"])
    model.runtime.mix.restore(0, 1.0)


# ----------------------------------------------------------------------------- helpers


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loaded(data: bytes, checkpoint_id: str, key: str) -> Any:
    """What :func:`_saved` wrote, as tensors and plain values only (``weights_only``: a checkpoint
    names no code to run)."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # noqa: BLE001 - whatever torch.load finds, said with the entry
        raise ValueError(
            f"load: {checkpoint_id!r}'s entry {key!r} is not tensors and plain values: "
            f"{type(error).__name__}: {error}"
        ) from None


def _meta(meta: Any, checkpoint_id: str, key: str) -> dict[str, Any]:
    """``meta`` (what :func:`save` wrote under ``replicaR.meta``), checked before it is used."""

    def wrong(what: str) -> ValueError:
        return ValueError(f"load: {checkpoint_id!r}'s entry {key!r}: {what}, got {meta!r:.200}")

    if not isinstance(meta, dict) or meta.keys() != {"steps", "optimizer", "outer_per_parameter"}:
        raise wrong("expected a dict of steps, optimizer and outer_per_parameter")
    if isinstance(meta["steps"], bool) or not isinstance(meta["steps"], int):
        raise wrong("steps should be an int")
    outer = meta["outer_per_parameter"]
    if outer is not None and not (
        isinstance(outer, (list, tuple)) and all(isinstance(p, str) for p in outer)
    ):
        raise wrong("outer_per_parameter should be None or a list of names")
    rest = meta["optimizer"]
    if rest is not None and not (
        isinstance(rest, dict)
        and rest.keys() == {"scalars", "groups"}
        and isinstance(rest["scalars"], dict)
        and all(isinstance(v, dict) for v in rest["scalars"].values())
        and isinstance(rest["groups"], (list, tuple))
        and all(isinstance(g, dict) for g in rest["groups"])
    ):
        raise wrong("optimizer should be None or a dict of scalars (by name) and groups")
    return meta


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


class _Layout:
    """Where this process is: replica ``replica`` of ``replicas`` (its rank in the replica
    group), shard ``shard`` of ``shards`` (its rank in the replica's shard mesh)."""

    def __init__(self, model: nn.Module):
        if model.runtime.shard_group is None:
            raise ValueError(
                "sharded_checkpoint: the model's module is not sharded (no DTensor parameters); "
                "save it with torch.save(model.state_dict())"
            )
        self.model = model
        self.replicas = dist.get_world_size(model.process_group)
        self.replica = model.process_group.rank()
        self.shards = dist.get_world_size(model.runtime.shard_group)
        self.shard = model.runtime.shard_group.rank()

    def mesh(self):
        """The 2-D mesh, replicas x shards, of the processes' global ranks (each replica's row
        gathered over the replica group)."""
        from torch.distributed.device_mesh import DeviceMesh

        mine = dist.get_process_group_ranks(self.model.runtime.shard_group)
        rows = _plain_messages.all_gather(
            mine, self.model.process_group, "a replica's shard processes", [int]
        )
        if any(len(row) != len(mine) for row in rows):
            raise ValueError(
                "sharded_checkpoint: the replicas hold different numbers of shard processes "
                f"(their global ranks: {rows}); a checkpoint needs every replica alike"
            )
        device = next(self.model.module.parameters()).device.type
        return DeviceMesh.from_group(
            [self.model.process_group, self.model.runtime.shard_group],
            device,
            mesh=torch.tensor(rows),
            mesh_dim_names=("replicate", "shard"),
        )


def _from_local(local, mesh, placements, like, replicas: int):
    """A DTensor of global shape ``(replicas, *like.shape)`` whose local part is ``local``."""
    from torch.distributed.tensor import DTensor, Shard

    if tuple(like.placements) != (Shard(0),):
        raise ValueError(
            f"sharded_checkpoint: parameters sharded as {like.placements} are not supported; "
            "fully_shard's default, Shard(0) over the replica's shard mesh, is"
        )
    shape = torch.Size((replicas, *like.shape))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local.contiguous(), mesh, placements, run_check=False, shape=shape, stride=stride
    )


def _key(kind: str, part: str, name: str) -> str:
    """A per-parameter entry's name: ``module|<param>``, ``optimizer|<state>|<param>``,
    ``outer|<part>|<param>`` (parameter names hold dots)."""
    return f"{kind}|{part}|{name}" if part else f"{kind}|{name}"


def _parse(key: str) -> tuple[str, str, str]:
    kind, *rest = key.split("|")
    return (kind, "", rest[0]) if len(rest) == 1 else (kind, rest[0], rest[1])


def _per_parameter(model, optimizer, saved_names: set[str] | None = None) -> dict:
    """Every tensor that is one per parameter, by entry name (:func:`_key`): ``(local tensor
    shaped like the local shard, the module's DTensor parameter)``. Loading (``saved_names``:
    the checkpoint's entries), the inner optimizer's and the outer state's entries are those the
    checkpoint holds, made empty where this process has none yet."""
    params = list(model.module.named_parameters())
    locals_ = [t for _, t in model.runtime.named]
    entries = {_key("module", "", n): (local, p) for (n, p), local in zip(params, locals_)}
    if saved_names is None:
        outer = model.runtime.outer.per_parameter_state() or {}
        for part, tensors in outer.items():
            for (name, p), value in zip(params, tensors):
                entries[_key("outer", part, name)] = (value, p)
        for name, p in params:
            if optimizer is not None:
                for key, value in optimizer.state.get(p, {}).items():
                    if _is_like(value, p):
                        entries[_key("optimizer", key, name)] = (value.to_local(), p)
        return entries
    by_name = dict(zip((n for n, _ in params), zip(locals_, (p for _, p in params))))
    for saved in saved_names:
        if "|" not in saved:
            continue  # the layout, the replicas' and processes' own state
        kind, part, name = _parse(saved)
        if kind == "outer" or (kind == "optimizer" and optimizer is not None):
            local, p = by_name[name]
            entries[saved] = (torch.empty_like(local), p)
    return {k: v for k, v in entries.items() if k in saved_names}


def _local(p):
    with torch.no_grad():
        return p.to_local()


def _is_like(value, p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor) and value.shape == p.shape


def _optimizer_rest(model, optimizer) -> dict | None:
    """The inner optimizer's state that is not a tensor shaped like its parameter (Adam's
    ``step``), and its param groups' settings, by parameter name."""
    if optimizer is None:
        return None
    scalars = {}
    for name, p in model.module.named_parameters():
        rest = {k: v for k, v in optimizer.state.get(p, {}).items() if not _is_like(v, p)}
        if rest:
            scalars[name] = rest
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"scalars": scalars, "groups": groups}


def _load_optimizer(model, optimizer, rows, rest) -> None:
    from torch.distributed.tensor import DTensor

    for name, p in model.module.named_parameters():
        state = optimizer.state.setdefault(p, {})
        for (kind, key, of), row in rows.items():
            if kind == "optimizer" and of == name:
                state[key] = DTensor.from_local(
                    row.clone(),
                    p.device_mesh,
                    p.placements,
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
        if rest is not None:
            state.update(rest["scalars"].get(name, {}))
    if rest is not None:
        for group, saved in zip(optimizer.param_groups, rest["groups"]):
            group.update(saved)
