"""DiLoCo's outer step: any torch optimizer, stepped on the workers' averaged pseudo-gradient.

Every ``sync_every`` inner steps, each worker's pseudo-gradient ``delta_i = theta_global -
theta_i`` (how far its own optimizer moved it since the last outer step) is averaged over the
workers, an outer optimizer steps ``theta_global`` with that average as its gradient, and every
worker's parameters become ``theta_global`` (Douillard et al., 2023, "DiLoCo: Distributed
Low-Communication Training of Language Models"; SGD with Nesterov momentum is its outer
optimizer).

The all-reduce carries the parameters, not the deltas. ``theta_global`` is the same on every rank,
so ``mean_i(theta_global - theta_i) = theta_global - mean_i(theta_i)``: the message is read
straight from the parameters (:func:`gossip_ext.averaging.exact_average`, with push-sum's weights
under the SGP base) and the average becomes the gradient in place, so a step needs no copy of the
deltas. The schedule and the collectives are :class:`gossip_ext.averaging.ExactAveraging`'s; the
step here is local.

Memory, in model copies (in the accumulation dtype: float32 for 16-bit parameters):
``theta_global`` one, the outer optimizer's state what it keeps (SGD with momentum one, Adam two),
and during a step one transient copy, the average, which becomes the gradient.
``device="cpu"`` keeps ``theta_global`` and the outer optimizer's state in host memory when the
parameters are on a GPU (torchft's ``backup_device``); the average then crosses to the host and
``theta_global`` back once per outer step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext import averaging

OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _build(factory: OuterOptimizerFactory, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``factory(tensors)``, checked: a torch optimizer over exactly those tensors."""
    optimizer = factory(tensors)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "outer_optimizer must build a torch.optim.Optimizer from the list of global "
            f"parameters it is given, but it returned {type(optimizer).__name__} {optimizer!r}"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held != {id(t) for t in tensors}:
        raise ValueError(
            "outer_optimizer must build its optimizer over the tensors it is given (the global "
            "parameters, one per module parameter), but the optimizer it returned holds "
            f"{len(held)} tensors of which {len(held - {id(t) for t in tensors})} are others "
            "(for example the module's own parameters): "
            "use `lambda params: torch.optim.SGD(params, ...)`"
        )
    return optimizer


class OuterStep:
    """``theta_global``, the outer optimizer over it, and one outer step (the schedule, every
    ``sync_every`` steps, stays with :class:`gossip_ext.averaging.ExactAveraging`).

    ``theta_global`` is one flat tensor per dtype bucket of the parameters (the engine's order);
    the outer optimizer sees it as one view per module parameter, shaped like it, in
    ``module.parameters()`` order, so its per-parameter state and its ``state_dict()`` read as
    they would over the module.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        factory: OuterOptimizerFactory,
        device: torch.device | None = None,
    ):
        self.buckets = averaging.ParameterBuckets(params)
        self.group = group
        self.device = self.buckets.device(0) if device is None else torch.device(device)
        self.flat = [
            torch.zeros(self.buckets.numel(b), dtype=self.buckets.dtype(b), device=self.device)
            for b in range(len(self.buckets))
        ]
        self._views: list[list[torch.Tensor]] = []  # per bucket, per parameter
        for b, ps in enumerate(self.buckets.params):
            offset, views = 0, []
            for p in ps:
                views.append(self.flat[b][offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            self._views.append(views)
        by_id = {
            id(p): v for ps, vs in zip(self.buckets.params, self._views) for p, v in zip(ps, vs)
        }
        self.global_params = [by_id[id(p)] for p in params]
        self.optimizer = _build(factory, self.global_params)
        self.reset()

    def describe(self) -> str:
        """What every rank must agree on: the outer optimizer's kind and hyperparameters."""
        groups = [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]
        return f"{type(self.optimizer).__name__}{groups!r}"

    @torch.no_grad()
    def reset(self) -> None:
        """``theta_global`` becomes the parameters (every rank's are equal when it is called: at
        construction after the broadcast, and at the first forward)."""
        for b, flat in enumerate(self.flat):
            if flat.device == self.buckets.device(b):
                self.buckets.read(b, flat)
            else:
                flat.copy_(
                    self.buckets.read(b, torch.empty_like(flat, device=self.buckets.device(b)))
                )

    @torch.no_grad()
    def step(self, averages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Steps ``theta_global`` with ``theta_global - average`` as its gradient, given the
        workers' exact average of every bucket (:func:`gossip_ext.averaging.exact_average`, which
        it overwrites), and returns the new ``theta_global`` per bucket for the caller to write
        into the parameters. Local: the caller runs every collective first, so that one that
        fails leaves ``theta_global`` and the outer optimizer's state as they were."""
        for b, average in enumerate(averages):
            grad = average.to(self.device).neg_().add_(self.flat[b])
            offset = 0
            for view in self._views[b]:
                view.grad = grad[offset : offset + view.numel()].view(view.shape)
                offset += view.numel()
        try:
            self.optimizer.step()
        finally:
            for view in self.global_params:
                view.grad = None
        return self.flat

    @torch.no_grad()
    def step_from_parameters(self) -> list[torch.Tensor]:
        """As :meth:`step`, with this worker's own parameters in place of the exact average: under
        ``outer_average="gossip"`` a gossip round has just mixed them with the round's peers.
        Local; one transient copy of the parameters."""
        averages = [
            self.buckets.read(b, torch.empty_like(flat, device=self.buckets.device(b)))
            for b, flat in enumerate(self.flat)
        ]
        return self.step(averages)

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": [t.clone() for t in self.flat],
            "optimizer": self.optimizer.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        found = [(t.numel(), t.dtype) for t in state["global"]]
        expected = self.buckets.layout()
        if found != expected:
            raise ValueError(
                f"load_state_dict: the checkpoint's theta_global has buckets (elements, dtype) "
                f"{found}, but this model's parameters give {expected}"
            )
        for flat, saved in zip(self.flat, state["global"]):
            flat.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
