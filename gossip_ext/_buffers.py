"""What happens to a module's buffers (BatchNorm's running statistics) under gossip.

Parameters are what the optimizer trains and gossip averages; buffers are the module's other
state. Three policies, chosen by the wrapper's arguments:
- default: each worker keeps its own buffers between exact averages, and every exact step
  (``global_avg_freq``, SlowMo, DiLoCo, ``average_parameters()``) averages the floating-point
  ones with the parameters;
- ``broadcast_buffers``: rank 0's buffers are sent to every rank before every training forward
  (as DDP and fairscale's SlowMo do);
- ``gossip_buffers``: the floating-point buffers travel with the parameters in every gossip
  round, so that each worker's statistics follow its averaged weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _validation

# Buffer broadcasts go in buckets of DDP's size for module-state broadcasts.
_BUCKET_BYTES = 250 * 1024 * 1024


class BufferPolicy:
    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        *,
        broadcast_buffers: bool,
        gossip_buffers: bool,
    ):
        self.floating = [
            (n, b) for n, b in module.named_buffers() if b.is_floating_point() and b.numel() > 0
        ]
        _validation.check_buffers(self.floating, device, gossip_buffers)
        self.gossiped = self.floating if gossip_buffers else []
        self.averaged = [b for _, b in self.floating]
        self.broadcast_buffers = broadcast_buffers
        self.gossip_buffers = gossip_buffers
        self._module_buffers = list(module.buffers())

    def layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Averaged or gossiped with the parameters: every rank's must agree."""
        return [(n, tuple(b.shape), str(b.dtype)) for n, b in self.floating]

    @torch.no_grad()
    def broadcast_initial(self, group: dist.ProcessGroup) -> None:
        """Gossiped buffers start equal on every rank, as the parameters do."""
        if self.gossip_buffers:
            for _, b in self.floating:
                dist.broadcast(b, dist.get_global_rank(group, 0), group=group)

    def before_training_forward(self, group: dist.ProcessGroup) -> None:
        if self.broadcast_buffers and self._module_buffers:
            dist._broadcast_coalesced(
                group, [b.detach() for b in self._module_buffers], _BUCKET_BYTES, 0
            )

    def weight(self, parameter_weight: float | None) -> float | None:
        """The push-sum weight of the buffers in an exact average: the parameters' where they are
        gossiped (de-biased values with the same weight), else 1 (None: a rank that holds no
        gossip state and contributes zeros)."""
        if self.gossip_buffers or parameter_weight is None:
            return parameter_weight
        return 1.0
