"""FSDP2's collectives inside a replica of an elastic job, with a lost process raised as
ReplicaLostError wherever FSDP2 meets it: the forward's all-gathers, the backward's all-gathers
and its reduce-scatters.

FSDP2 runs the backward's collectives in autograd hooks, so without this a process of the
replica that died during the backward showed its siblings the process group's own error (gloo's
"Connection closed by peer"), out of ``loss.backward()``, and the other replicas waited for the
replica's heartbeat to stop. These collectives are FSDP2's default ones (an all-gather into one
tensor, a reduce-scatter of one tensor, through the public ``torch.distributed`` calls), set on
every FSDP2 module of the replica through FSDP2's public ``set_custom_all_gather`` and
``set_custom_reduce_scatter``; a failure of a peer is handed to ``lose``, which announces the
replica gone and raises ReplicaLostError. A collective started asynchronously returns its work
as it is: FSDP2 waits on it, and its failure is torch's (FSDP2 starts none so by default).

They replace FSDP2's collectives when the wrapper is built: a user's own, set before, is
replaced; set it after building the wrapper to keep it (a lost process then raises what it
raises). A module FSDP2 refuses them for (parameters on several meshes) keeps its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext.membership import elastic as elastic_worker


def run_or_lose(lose: Callable[[BaseException], NoReturn], fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, over the replica's group; a peer's failure there (a process of
    the replica gone) is handed to ``lose``, which raises ReplicaLostError."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        if not elastic_worker.is_peer_failure(error):
            raise
        lose(error)


class _Collective:
    """What FSDP2 asks of a collective: ``allocate`` its buffers, and run on a group."""

    def __init__(self, lose: Callable[[BaseException], NoReturn]):
        self._lose = lose

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _run(self, collective: Callable, *args, **kwargs):
        return run_or_lose(self._lose, collective, *args, **kwargs)


class ReplicaAllGather(_Collective):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return self._run(
            dist.all_gather_into_tensor, output_tensor, input_tensor, group=group, async_op=async_op
        )


class ReplicaReduceScatter(_Collective):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return self._run(
            dist.reduce_scatter_tensor,
            output_tensor,
            input_tensor,
            op=op,
            group=group,
            async_op=async_op,
        )


def install(module: nn.Module, lose: Callable[[BaseException], NoReturn]) -> None:
    """Sets the replica's collectives on every FSDP2 module of ``module``."""
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = ReplicaAllGather(lose), ReplicaReduceScatter(lose)
    for part in module.modules():
        if not isinstance(part, FSDPModule):
            continue
        try:
            part.set_custom_all_gather(all_gather)
            part.set_custom_reduce_scatter(reduce_scatter)
        except ValueError:
            continue  # several param groups (meshes): FSDP2 allows no custom collective there
