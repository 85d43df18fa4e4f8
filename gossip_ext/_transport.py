"""Building the engine's transport from the kind ``_validation.choose_transport`` picked.

The engine sends through one of three transports: NCCL between CUDA devices, the training process
group's point-to-point calls, or that process group from pinned host buffers (host staging). Only
NCCL needs more than its constructor: a key space of its own in the default store, in which its
ranks exchange the communicator's unique id.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext import _C, _validation

# Numbers the NCCL transports of this process, for their store prefixes (see _nccl_transport).
_NCCL_TRANSPORTS = itertools.count()


def make_transport(
    kind: str, group: dist.ProcessGroup, device: torch.device, timeout: timedelta
) -> Any:
    """The transport of ``kind`` (``_validation.NCCL``, ``PROCESS_GROUP`` or ``HOST_STAGING``)
    over ``group``. Collective for NCCL: every rank of ``group`` builds its transport together."""
    if kind == _validation.NCCL:
        return _nccl_transport(group, device, timeout)
    transport = _C.ProcessGroupTransport(group)
    if kind == _validation.HOST_STAGING:
        transport = _C.HostStagingTransport(transport)
    return transport


def _nccl_transport(group: dist.ProcessGroup, device: torch.device, timeout: timedelta):
    # Every wrapper gets its own key space in the store; wrappers are built in the same order
    # on every rank (construction is collective), so the counters agree.
    prefix = f"gossip_ext/nccl/{next(_NCCL_TRANSPORTS)}"
    store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
    return _C.NcclTransport(
        store, dist.get_rank(group), dist.get_world_size(group), device.index, timeout
    )
