"""Process groups gossip_ext builds for itself from a store, beside the user's.

An elastic epoch's group (``membership.epoch_group``) and the group an asynchronous engine's
messages move on (:func:`messages_group`) are built the way ``init_process_group`` builds its own
(``_new_process_group_helper`` over a PrefixStore) and registered under their own names, with the
rank map the ``torch.distributed`` functions look up. ``dist.new_group`` would need every rank of
the default group (an epoch has none) and would split a default group that may hold the dead.

These are torch's private helpers, isolated here: the one place to change when torch moves them.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def build(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: datetime.timedelta,
    name: str,
    global_ranks: list[int] | None = None,
) -> dist.ProcessGroup:
    """A group of ``world_size`` ranks meeting in ``store`` (``backend``: "gloo" or "nccl"), as
    rank ``rank``; ``name`` unique in this process. ``global_ranks``: each group rank's rank in
    the default group, for the functions that translate them (none: the group's ranks are the
    only ranks, an epoch's). Collective over the group; raises if one does not join within
    ``timeout``."""
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=name,
        timeout=timeout,
        group_desc=name,
    )
    ranks = global_ranks if global_ranks is not None else list(range(world_size))
    c10d._world.pg_group_ranks[group] = {g: r for r, g in enumerate(ranks)}
    return group


def messages_group(
    group: dist.ProcessGroup, store: dist.Store, timeout: datetime.timedelta, name: str
) -> dist.ProcessGroup:
    """``group``'s ranks in a gloo group of their own for an asynchronous engine's messages,
    meeting in ``store`` (the engine's own: one group per engine).

    The engine keeps a receive posted for every in-peer's next message at all times. On the
    user's group those receives would share gloo's connections with the user's collectives, and
    anything that ends the engine's messages (a peer given up, the engine dropped) would end them
    for the user's barrier too; DDP's reducer never holds the user's group either. Collective over
    ``group``, as the engine's construction is."""
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    return build(
        dist.PrefixStore("messages-group", store),
        group.rank(),
        group.size(),
        "gloo",
        timeout,
        name,
        global_ranks=ranks,
    )


def release(group: dist.ProcessGroup | None) -> None:
    """Shuts ``group`` down and forgets it (its pending operations are aborted); nothing if it
    is gone already (the interpreter's exit tore the groups down first)."""
    if group is None or group not in c10d._world.pg_map:
        return
    dist.destroy_process_group(group)
