"""A process group per membership epoch, built from the membership store, with no default group.

``dist.new_group`` splits the default group, which would still contain the dead; and
``init_process_group`` would take the default group over from the user. So an epoch's group is
built as gossip_ext's own groups are (``gossip.groups``: ``_new_process_group_helper`` over a
PrefixStore of the membership store) and registered, under its own name, with the rank map the
``torch.distributed`` functions look up (identity: the epoch's ranks are the only ranks). Those
functions then take it as ``group=``, as any group. Code that uses it must ask the group itself
for its rank (``group.rank()``): ``dist.get_rank(group)`` consults the default group.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from gossip_ext.gossip import groups


def build(
    store: dist.Store,
    epoch: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: datetime.timedelta,
    part: str = "",
) -> dist.ProcessGroup:
    """The group of ``epoch`` (``backend``: "gloo" or "nccl"), as rank ``rank`` of
    ``world_size``. Collective over the epoch's members; raises if one does not join within
    ``timeout``. ``part``: which of an epoch's groups (a sharded replica's process s builds the
    group of the replicas' processes s, part ``/shard{s}``); one group per part and epoch."""
    name = f"gossip_ext_epoch_{epoch}{part.replace('/', '_')}"
    return groups.build(
        dist.PrefixStore(f"epoch/{epoch}/group{part}", store),
        rank,
        world_size,
        backend,
        timeout,
        name,
    )


def release(group: dist.ProcessGroup | None) -> None:
    """Shuts ``group`` down and forgets it (its pending operations are aborted)."""
    groups.release(group)
