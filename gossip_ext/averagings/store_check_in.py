"""Who is missing after a collective over every worker failed: each live rank checks in at the
process group's store, and the ranks that do not within a short deadline are named.

The check-in is the NCCL transport's before its blocking calls (csrc/transport/store_check_in.h):
each rank sets ``key/rank`` and waits, at most the deadline, for every ``key/r``; the ranks whose
keys are not there then are the missing ones. The store is the one the group was created with,
under the group's own prefix (``ProcessGroup.get_group_store``): the default store's for a static
job's groups, the membership store's for an elastic epoch's.

A collective fails at different times on different ranks: at once on those its algorithm pairs
with the dead worker (their connection closes), at the timeout on the others, which wait for a
survivor that already stopped. So the first rank to fail also marks the failure at the store, and
a rank still waiting for the same collective looks for that mark
(:meth:`CollectiveCheckIn.failed_elsewhere`) and stops waiting: the survivors check in within a
moment of each other, well inside the deadline, and only the dead, stalled or departed are
missing. A live rank that reaches the collective more than the deadline after the first failure
(a straggler) looks the same to the others, and is named too.

Cross-rank contract: every rank of a group waits for its collectives over every worker in the same
order, as it posts them, so one rank's n-th wait is every other rank's n-th; its key counts them.
"""

from __future__ import annotations

import datetime
import weakref

import torch.distributed as dist

# The longest a rank waits for the others to check in (a quarter of the timeout where that is
# shorter): how much later than the failure the error comes, to name the missing. Short, as a
# dead worker never checks in: every survivor waits it out.
MAX_DEADLINE = datetime.timedelta(seconds=2)


class _Waits:
    """A group's store (None: it has none this process can reach) and how many waits for its
    collectives over every worker this process began."""

    def __init__(self, store: dist.Store | None):
        self.store = store
        self.count = 0


# Weakly, as each elastic epoch's group is dropped when the epoch ends.
_waits: weakref.WeakKeyDictionary[dist.ProcessGroup, _Waits] = weakref.WeakKeyDictionary()


def _store_of(group: dist.ProcessGroup) -> dist.Store | None:
    try:
        return group.get_group_store()
    except (AttributeError, RuntimeError):  # a group made without a store
        return None


class CollectiveCheckIn:
    """The check-in of one wait for collectives over every worker of ``group`` (taken before the
    wait: it counts the group's waits), with its deadline: a quarter of ``timeout``, at most
    :data:`MAX_DEADLINE`."""

    def __init__(self, group: dist.ProcessGroup, timeout: datetime.timedelta):
        waits = _waits.get(group)
        if waits is None:
            waits = _waits[group] = _Waits(_store_of(group))
        self.group = group
        self.store = waits.store
        self.key = f"gossip_ext/collective_check_in/{waits.count}"
        waits.count += 1
        self.deadline = min(timeout / 4, MAX_DEADLINE)
        # How often a rank still waiting looks for the mark: four looks per deadline, so that
        # the waiting survivors check in well before the first stops waiting for them.
        self.look_every_s = self.deadline.total_seconds() / 4

    def failed_elsewhere(self) -> bool:
        """Whether another rank marked this wait's collectives as failed."""
        if self.store is None:
            return False
        try:
            return bool(self.store.check([f"{self.key}/failed"]))
        except Exception:  # noqa: BLE001 - no store to ask: the wait's own timeout still holds
            return False

    def missing(self) -> list[int] | None:
        """Marks the failure, checks this rank in and waits, at most the deadline, for every
        other rank; returns the ranks (in the group) that did not check in, or None where the
        store cannot be reached (nothing is known then)."""
        if self.store is None:
            return None
        rank, world_size = self.group.rank(), self.group.size()
        keys = [f"{self.key}/{r}" for r in range(world_size)]
        try:
            self.store.set(f"{self.key}/failed", str(rank))
            self.store.set(keys[rank], "1")
        except Exception:  # noqa: BLE001 - a store gone with its host
            return None
        try:
            self.store.wait(keys, self.deadline)
            return []
        except Exception:  # noqa: BLE001 - timed out, or the store failed: see which keys are there
            pass
        try:
            return [r for r in range(world_size) if not self.store.check([keys[r]])]
        except Exception:  # noqa: BLE001
            return None
