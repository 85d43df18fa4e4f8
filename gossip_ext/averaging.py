"""Exact averaging across workers: periodic global averaging, on-demand averaging and SlowMo.

Gossip only drives the workers' models towards their average. The helpers here reach it exactly,
with one all-reduce of the parameters per dtype, for what gossip cannot give: a periodic reset of
the drift between workers (``global_avg_freq``), one model for evaluation or a checkpoint
(``average_parameters()``), and the outer step of SlowMo (``slowmo_freq``).

The average is push-sum's consensus value ``sum_i w_i z_i / sum_i w_i``: what gossip itself
converges to, and the only average that keeps the push-sum mass (the sums of x = w z and of w)
unchanged when every weight is reset to 1 afterwards. Whenever the weights are 1 (lazy mixing:
uniform mixing on any built-in graph) it is the plain mean of the de-biased parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

# What an exact-averaging step of the training loop does (ExactAveraging.kind).
AVERAGE = "average"
SLOWMO = "slowmo"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums and the slow state of half-precision parameters are kept in float32, as the
    kernels accumulate them; other dtypes keep their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ParameterBuckets:
    """The parameters grouped by dtype in order of first appearance (the engine's flat-buffer
    order), flattened into copies in their accumulation dtype and written back."""

    def __init__(self, params: Sequence[torch.Tensor]):
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            buckets.setdefault(p.dtype, []).append(p)
        self.params = list(buckets.values())

    def flatten(self) -> list[torch.Tensor]:
        return [
            torch.cat([p.detach().reshape(-1) for p in ps]).to(accumulation_dtype(ps[0].dtype))
            for ps in self.params
        ]

    def layout(self) -> list[tuple[int, torch.dtype]]:
        """(elements, accumulation dtype) of each bucket: what a saved slow state must match."""
        return [(sum(p.numel() for p in ps), accumulation_dtype(ps[0].dtype)) for ps in self.params]

    @torch.no_grad()
    def write(self, flats: Sequence[torch.Tensor]) -> None:
        for ps, flat in zip(self.params, flats):
            offset = 0
            for p in ps:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


@torch.no_grad()
def exact_average(
    buckets: ParameterBuckets, weight: float | None, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """``sum_i w_i z_i / sum_i w_i`` over the ranks of ``group``, one all-reduce per bucket;
    collective, and every rank gets the same bits.

    ``weight`` is this rank's push-sum weight, or None on a rank that holds no gossip state of its
    own (a non-leader of ``nprocs_per_node > 1``): it contributes zeros, so the whole group can
    take part and receive the result while only the gossiping ranks are averaged. The weight rides
    as one extra element of each message, so the sum of the weights needs no collective of its
    own (and counts the contributing ranks when every weight is 1).
    """
    averages = []
    for ps in buckets.params:
        dtype = accumulation_dtype(ps[0].dtype)
        if weight is None:
            numel = sum(p.numel() for p in ps)
            message = torch.zeros(numel + 1, dtype=dtype, device=ps[0].device)
        else:
            tail = torch.ones(1, dtype=dtype, device=ps[0].device)
            message = torch.cat([p.detach().reshape(-1).to(dtype) for p in ps] + [tail])
            if weight != 1.0:
                message.mul_(weight)
        dist.all_reduce(message, group=group)
        averages.append(message[:-1].div_(message[-1]))
    return averages


def learning_rates(
    optimizer: torch.optim.Optimizer, buckets: ParameterBuckets
) -> list[list[float | None]]:
    """The current learning rate of every parameter's param group, None for a parameter the
    optimizer does not update; read at every SlowMo step, so schedulers are followed."""
    lr_of = {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}
    return [[lr_of.get(id(p)) for p in ps] for ps in buckets.params]


def _segments(sizes: Sequence[int], lrs: Sequence[float | None]):
    """(start, end, lr) runs of consecutive parameters with one learning rate: usually a single
    run per bucket, so the update is a few whole-buffer operations."""
    start = 0
    run_start, run_lr = 0, None
    for i, (size, lr) in enumerate(zip(sizes, lrs)):
        if i > 0 and lr != run_lr:
            yield run_start, start, run_lr
            run_start = start
        run_lr = lr
        start += size
    if start > run_start:
        yield run_start, start, run_lr


class SlowMomentum:
    """SlowMo's outer update (Wang et al., ICLR 2020, Algorithm 1; fairscale's
    SlowMoDistributedDataParallel), identical on every rank.

    With ``x_avg`` the exact average, ``gamma`` the base optimizer's current learning rate,
    ``beta`` the slow momentum and ``alpha`` the slow learning rate::

        u      <- beta * u + (x_slow - x_avg) / gamma
        x_slow <- x_slow - alpha * gamma * u

    and the parameters become ``x_slow``. Dividing by ``gamma`` makes ``u`` a sum of gradients
    (the base steps undone), so a learning-rate schedule does not rescale the momentum. A
    parameter that no param group holds, or whose group has ``lr == 0`` (nothing to take
    momentum on), is set to ``x_avg`` with ``u`` unchanged.
    """

    def __init__(self, momentum: float, lr: float):
        self.momentum = momentum
        self.lr = lr
        self.slow: list[torch.Tensor] | None = None
        self.buffer: list[torch.Tensor] | None = None

    @property
    def initialized(self) -> bool:
        return self.slow is not None

    def reset(self, flats: Sequence[torch.Tensor]) -> None:
        self.slow = [f.detach().clone() for f in flats]
        self.buffer = [torch.zeros_like(f) for f in self.slow]

    @torch.no_grad()
    def step(
        self,
        averaged: Sequence[torch.Tensor],
        buckets: ParameterBuckets,
        lrs: Sequence[Sequence[float | None]],
    ) -> list[torch.Tensor]:
        for slow, buffer, avg, ps, bucket_lrs in zip(
            self.slow, self.buffer, averaged, buckets.params, lrs
        ):
            for start, end, gamma in _segments([p.numel() for p in ps], bucket_lrs):
                x, u, a = slow[start:end], buffer[start:end], avg[start:end]
                if not gamma:
                    x.copy_(a)
                    continue
                u.mul_(self.momentum).add_(x - a, alpha=1.0 / gamma)
                x.add_(u, alpha=-self.lr * gamma)
        return self.slow

    def state_dict(self) -> dict[str, list[torch.Tensor]] | None:
        if self.slow is None:
            return None
        return {
            "slow": [t.clone() for t in self.slow],
            "momentum": [t.clone() for t in self.buffer],
        }

    def load_state_dict(
        self, state: Mapping[str, Any] | None, layout: Sequence[tuple[int, torch.dtype]], device
    ) -> None:
        if state is None:
            self.slow = self.buffer = None
            return
        saved = [(t.numel(), t.dtype) for t in state["slow"]]
        if saved != list(layout):
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state has buckets (elements, dtype) "
                f"{saved}, but this model's parameters give {list(layout)}"
            )
        self.slow = [t.detach().to(device).clone() for t in state["slow"]]
        self.buffer = [t.detach().to(device).clone() for t in state["momentum"]]


class ExactAveraging:
    """The exact-averaging schedule of a GossipDataParallel, its SlowMo state, and the arithmetic
    of one averaging step (the collectives and the gossip state stay with the wrapper)."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        global_avg_freq: int,
        slowmo_freq: int,
        slowmo_momentum: float,
        slowmo_lr: float,
    ):
        self.buckets = ParameterBuckets(params)
        self.global_avg_freq = global_avg_freq
        self.slowmo_freq = slowmo_freq
        self.slowmo = SlowMomentum(slowmo_momentum, slowmo_lr) if slowmo_freq else None

    def kind(self, step: int) -> str | None:
        """What the ``step``-th optimizer step (1-based) ends with: SLOWMO (which averages too)
        takes precedence over a plain AVERAGE; None: a gossip round, as usual."""
        if self.slowmo_freq and step % self.slowmo_freq == 0:
            return SLOWMO
        if self.global_avg_freq and step % self.global_avg_freq == 0:
            return AVERAGE
        return None

    @property
    def slow_start_pending(self) -> bool:
        return self.slowmo is not None and not self.slowmo.initialized

    def start_slow_params(self) -> None:
        """SlowMo's x_slow starts at the parameters the first forward sees: the common starting
        point of every rank, after any weights the user loaded into the wrapped module."""
        self.slowmo.reset(self.buckets.flatten())

    def apply(
        self,
        weight: float | None,
        group: dist.ProcessGroup,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Sets the parameters to the exact average (see :func:`exact_average`), followed by the
        SlowMo update when an optimizer is given."""
        result = exact_average(self.buckets, weight, group)
        if optimizer is not None:
            if not self.slowmo.initialized:
                # No forward ran before this step (a gossip-only loop): start from the average,
                # which makes this first SlowMo step a plain averaging step.
                self.slowmo.reset(result)
            lrs = learning_rates(optimizer, self.buckets)
            result = self.slowmo.step(result, self.buckets, lrs)
        self.buckets.write(result)

    def state_dict(self) -> dict[str, Any]:
        return {"slowmo": None if self.slowmo is None else self.slowmo.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint without SlowMo state (saved before the first forward, or by a run without
        SlowMo) leaves x_slow to start again at the next forward."""
        if self.slowmo is None:
            return
        device = self.buckets.params[0][0].device
        self.slowmo.load_state_dict(state.get("slowmo"), self.buckets.layout(), device)
