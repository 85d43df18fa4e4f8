"""The outer rule of asynchronous DiLoCo (``outer.asynchronous``): Nesterov momentum on the merged
pseudo-gradients, its momentum term optionally delayed to one update per round's worth of samples.

Every worker holds its own copy of ``theta_global`` and steps it with each merge ``G`` of the
pseudo-gradients that reached it, in whatever grouping they arrived. The rule is linear in the
``G``'s: two workers that merged the same pseudo-gradients in different groupings hold the same
``theta_global`` once the momentum has forgotten the difference in timing, and, with
``momentum=0``, at once (to float rounding). An adaptive outer optimizer (Adam) is not linear, and
its copies would drift apart for good; that is why this rule is fixed rather than any torch
optimizer.

With ``delayed=False``, every merge is one step of SGD with Nesterov momentum (as
``torch.optim.SGD(nesterov=True)``): ``m <- beta m + G``, ``theta <- theta - lr (G + beta m)``.
Merged in pieces, this advances the momentum once per piece, a round's worth of samples in many
small updates. With ``delayed=True`` (delayed Nesterov momentum), a merge moves ``theta`` by its
gradient term at once, ``theta <- theta - lr G``, and adds ``G`` to an accumulator; each time the
samples merged reach one round's (every worker's ``every`` steps), the momentum takes the
accumulator, ``m <- beta m + A``, ``theta <- theta - lr beta m``, ``A <- 0``. Over a round merged
whole, the two are the same step; merged in pieces, the delayed rule keeps the momentum at the
pace of rounds, as the synchronous outer step it replaces.
"""

from __future__ import annotations

from typing import Any

import torch


class NesterovOuter:
    """``theta_global`` (one flat tensor of ``dtype`` on ``device``) and the outer step's state
    on it.

    ``round_samples``: the samples of one synchronous round (every worker's ``every`` steps),
    the unit of the momentum's delay; samples are counted in inner steps."""

    state_key = "async_outer"

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        *,
        lr: float,
        momentum: float,
        delayed: bool,
        round_samples: int,
        device: torch.device | str = "cpu",
    ):
        self.lr, self.momentum, self.delayed = lr, momentum, delayed
        self.round_samples = round_samples
        self.theta = torch.zeros(numel, dtype=dtype, device=device)
        self.velocity = torch.zeros(numel, dtype=dtype, device=device)
        self.accumulated = torch.zeros(numel, dtype=dtype, device=device)
        self.samples_accumulated = 0
        self.steps = 0  # merges applied

    def start(self, theta: torch.Tensor) -> None:
        """Starts at ``theta`` (every worker's parameters alike), the momentum at rest."""
        self.theta.copy_(theta)
        self.velocity.zero_()
        self.accumulated.zero_()
        self.samples_accumulated = 0
        self.steps = 0

    @torch.no_grad()
    def step(self, merged: torch.Tensor, samples: int) -> None:
        """Steps ``theta`` with ``merged`` (the pseudo-gradients of ``samples`` inner steps in
        all, each already weighted by its share of a round's samples)."""
        beta = self.momentum
        if not self.delayed:
            self.velocity.mul_(beta).add_(merged)
            self.theta.sub_(merged + beta * self.velocity, alpha=self.lr)
        else:
            self.theta.sub_(merged, alpha=self.lr)
            self.accumulated.add_(merged)
            self.samples_accumulated += samples
            if self.samples_accumulated >= self.round_samples:
                # Once per round's samples; a merge past a round carries its surplus into the next.
                self.samples_accumulated -= self.round_samples
                self.velocity.mul_(beta).add_(self.accumulated)
                self.theta.sub_(self.velocity, alpha=self.lr * beta)
                self.accumulated.zero_()
        self.steps += 1

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "NesterovOuter",
            "lr": self.lr,
            "momentum": self.momentum,
            "delayed": self.delayed,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta": self.theta.clone(),
            "velocity": self.velocity.clone(),
            "accumulated": self.accumulated.clone(),
            "samples_accumulated": self.samples_accumulated,
            "steps": self.steps,
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse
        ``state``: every tensor is checked before the first is copied."""
        for name in ("theta", "velocity", "accumulated"):
            saved = state.get(name)
            if not isinstance(saved, torch.Tensor) or saved.shape != getattr(self, name).shape:
                found = saved.numel() if isinstance(saved, torch.Tensor) else saved
                raise ValueError(
                    f"the asynchronous outer step's checkpoint holds {name} of "
                    f"{found} values, but this model has {self.theta.numel()}"
                )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        for name in ("theta", "velocity", "accumulated"):
            getattr(self, name).copy_(state[name])
        self.samples_accumulated = int(state["samples_accumulated"])
        self.steps = int(state["steps"])
