"""Several processes per machine (``nprocs_per_node > 1``): one gossips, the others follow it.

Inside a machine the processes average their gradients after every backward, as DDP would, and
only the first of them (the node's leader) takes part in gossip; before every forward the others
receive its parameters. Gossip then sees one worker per machine and crosses the network once per
machine instead of once per process. Kept apart from the wrapper because none of it touches the
gossip engine: it is collectives over the node's own process group and autograd hooks.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's bucket size for module-state broadcasts


def _weak_call(method):
    """``method`` through a weak reference to its object: a hook that does nothing once the
    object is gone, instead of keeping it alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class NodeHierarchy:
    """The node and leader process groups of one wrapper, and the node-local gradient averaging
    and parameter broadcast over them.

    Construction is collective over ``process_group``: every rank creates every group, in the same
    order. ``leaders`` is the group the node leaders gossip over; ``is_leader`` says whether this
    process is one (group rank 0 of its node).
    """

    def __init__(
        self, module: nn.Module, process_group: dist.ProcessGroup, nprocs_per_node: int
    ) -> None:
        m = nprocs_per_node
        rank = dist.get_rank(process_group)
        world_size = dist.get_world_size(process_group)
        to_global = [dist.get_global_rank(process_group, r) for r in range(world_size)]
        for node in range(world_size // m):
            group = dist.new_group([to_global[node * m + i] for i in range(m)])
            if rank // m == node:
                self.node_group = group  # its group rank 0 is the node's gossiping process
        self.leaders = dist.new_group([to_global[node * m] for node in range(world_size // m)])
        self.is_leader = rank % m == 0
        self._module = module
        self._nprocs_per_node = m
        self._sync_gradients = True
        self._backward_callback_queued = False

    def hook_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Averages the gradients inside the node at the end of every backward."""
        # Through a weak reference, as the wrapper's optimizer: the parameters outlive no wrapper.
        on_grad_ready = _weak_call(self._on_grad_ready)
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(on_grad_ready)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self._sync_gradients
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = previous

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        # The first gradient of a backward queues one callback that runs when the whole backward
        # has finished: the end of backward, detected by the autograd engine itself.
        if self._sync_gradients and not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_gradients)

    def _average_gradients(self) -> None:
        self._backward_callback_queued = False
        named = [(n, p.grad) for n, p in self._module.named_parameters() if p.grad is not None]
        if not named:
            return
        check_dense_gradients(named, self._nprocs_per_node)
        grads = [g for _, g in named]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.node_group)
        flat.div_(self._nprocs_per_node)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def receive_parameters(self) -> None:
        """Sets this process's parameters and buffers to its node leader's."""
        # One coalesced broadcast (as DDP syncs module states) instead of one per tensor.
        tensors = [p.detach() for p in self._module.parameters()]
        tensors += [b.detach() for b in self._module.buffers()]
        dist._broadcast_coalesced(self.node_group, tensors, _BROADCAST_BUCKET_BYTES, 0)


def check_dense_gradients(
    named_grads: list[tuple[str, torch.Tensor]], nprocs_per_node: int
) -> None:
    # Sparse gradients that no module announced (F.embedding(..., sparse=True) in a custom
    # forward) are only seen here, at the end of backward.
    for name, grad in named_grads:
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter '{name}' got a {grad.layout} gradient, but nprocs_per_node="
                f"{nprocs_per_node} averages gradients inside a node, which needs dense ones: "
                "produce dense gradients (sparse=False), or use nprocs_per_node=1"
            )
