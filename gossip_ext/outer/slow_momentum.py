"""SlowMo's outer rule (Wang et al., ICLR 2020, Algorithm 1; fairscale's
SlowMoDistributedDataParallel): a heavy ball on the average, scaled by the inner learning rate,
its state optionally split over the workers. See ``interface.OuterRule`` for what every rule is."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from gossip_ext.averagings import Mean
from gossip_ext.averagings.buckets import ParameterBuckets, check_saved
from gossip_ext.outer.interface import OuterRule
from gossip_ext.sharded import replicas as sharded


def learning_rates(
    optimizer: torch.optim.Optimizer, buckets: ParameterBuckets
) -> list[list[float | None]]:
    """The current learning rate of every parameter's param group, None for a parameter the
    optimizer does not update; read at every SlowMo step, so schedulers are followed. A
    parameter is known by its storage: the optimizer of a sharded module holds DTensors, the
    buckets their local shards."""
    lr_of = {
        sharded.storage_key(p): float(group["lr"])
        for group in optimizer.param_groups
        for p in group["params"]
    }
    return [[lr_of.get(sharded.storage_key(p)) for p in ps] for ps in buckets.params]


def _segments(
    sizes: Sequence[int], lrs: Sequence[float | None]
) -> Iterator[tuple[int, int, float | None]]:
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


def shard_ranges(numel: int, shards: int, index: int | None) -> tuple[int, int]:
    """The flat range [lo, hi) of shard ``index`` of ``numel`` elements cut into ``shards``
    near-equal parts (the last may be shorter or empty); (0, 0) for ``index`` None."""
    if index is None:
        return 0, 0
    length = -(-numel // shards)
    return min(index * length, numel), min((index + 1) * length, numel)


class SlowMomentum(OuterRule):
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

    The state (``x_slow`` and ``u``) is two model copies. Sharded (``shards > 1``, fairscale's
    ``slowmo_memory_efficient``), rank ``s < shards`` of the averaging group keeps and updates
    only the ``s``-th slice of every bucket, and sends its result to the others: ``2 / shards``
    model copies per rank for one all-gather's worth of extra traffic per SlowMo step. The
    owners send their slices after updating them, so a failure of those sends is not atomic.

    It starts at the first forward (``eager`` False), or, where a step comes first, at that
    step's average, which makes the first SlowMo step a plain average.
    """

    state_key = "slowmo"
    eager = False
    needs_inner_lr = True

    def __init__(
        self,
        momentum: float,
        lr: float,
        group: dist.ProcessGroup,
        shards: int = 1,
        shard: int | None = 0,
    ):
        self.momentum = momentum
        self.lr = lr
        self.group = group
        self.shards = shards
        self.shard = shard  # this rank's shard; None: it keeps none
        self.slow: list[torch.Tensor] | None = None
        self.buffer: list[torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        return self.slow is not None

    @property
    def theta_global(self) -> list[torch.Tensor] | None:
        """``x_slow``, from which an averaging of differences (compressed or sparse messages)
        takes each worker's; only where every rank keeps all of it (unsharded)."""
        return self.slow if self.shards == 1 else None

    def describe(self) -> tuple[str, float, float, int]:
        return ("SlowMo", self.momentum, self.lr, self.shards)

    @torch.no_grad()
    def step(
        self, mean: Mean, buckets: ParameterBuckets, optimizer: torch.optim.Optimizer | None
    ) -> list[torch.Tensor]:
        """The SlowMo step from the workers' mean parameters ``x_avg`` (full flat buckets; from
        a mean of ``x_slow - x_i``, ``x_slow`` minus it), written into them: the new
        parameters. ``optimizer`` is the base optimizer, whose learning rates scale it."""
        if optimizer is None:
            raise ValueError("SlowMo's step needs the inner optimizer (its learning rates)")
        averages = mean.parameters(self.theta_global)
        lrs = learning_rates(optimizer, buckets)
        for b, ((lo, _), average) in enumerate(zip(self.ranges(buckets), averages)):
            sizes = [p.numel() for p in buckets.params[b]]
            self._step_bucket(b, average, lo, sizes, lrs[b])
            if self.shards > 1:
                # Every shard's owner sends its slice of x_slow to the others.
                for shard in range(self.shards):
                    s_lo, s_hi = shard_ranges(average.numel(), self.shards, shard)
                    if s_lo < s_hi:
                        owner = dist.get_global_rank(self.group, shard)
                        dist.broadcast(average[s_lo:s_hi], owner, group=self.group)
        return averages

    def _kept(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``x_slow`` and ``u``, which exist once the rule started."""
        if self.slow is None or self.buffer is None:
            raise RuntimeError("SlowMo's state was used before the rule started")
        return self.slow, self.buffer

    def ranges(self, buckets: ParameterBuckets) -> list[tuple[int, int]]:
        """This rank's slice of every bucket."""
        return [
            shard_ranges(buckets.numel(b), self.shards, self.shard) for b in range(len(buckets))
        ]

    @torch.no_grad()
    def start(self, buckets: ParameterBuckets, means: Sequence[torch.Tensor] | None = None) -> None:
        """x_slow starts at the parameters (or at ``means``, full flat buckets), u at 0."""
        self.slow, self.buffer = [], []
        for b, (lo, hi) in enumerate(self.ranges(buckets)):
            slow = torch.empty(hi - lo, dtype=buckets.dtype(b), device=buckets.device(b))
            if means is None:
                buckets.read(b, slow, lo)
            else:
                slow.copy_(means[b][lo:hi])
            self.slow.append(slow)
            self.buffer.append(torch.zeros_like(slow))

    @torch.no_grad()
    def _step_bucket(
        self,
        bucket: int,
        average: torch.Tensor,
        lo: int,
        sizes: Sequence[int],
        lrs: Sequence[float | None],
    ) -> None:
        """Updates this rank's slice [lo, ...) of ``bucket`` from its exact ``average`` (the full
        flat bucket; ``sizes`` and ``lrs``: its parameters' elements and learning rates) and
        writes x_slow into that slice of ``average``. In place: no temporary."""
        slow, buffer = (kept[bucket] for kept in self._kept())
        hi = lo + slow.numel()
        for start, end, gamma in _segments(sizes, lrs):
            start, end = max(start, lo), min(end, hi)
            if start >= end:
                continue
            x = slow[start - lo : end - lo]
            u = buffer[start - lo : end - lo]
            a = average[start:end]
            if not gamma:
                x.copy_(a)
                continue
            u.mul_(self.momentum).add_(x, alpha=1.0 / gamma).sub_(a, alpha=1.0 / gamma)
            x.add_(u, alpha=-self.lr * gamma)
            a.copy_(x)

    def state_dict(self) -> dict[str, object] | None:
        if self.slow is None:
            return None
        slow, buffer = self._kept()
        return {
            "slow": [t.clone() for t in slow],
            "momentum": [t.clone() for t in buffer],
            "shards": self.shards,
            "shard": self.shard,
        }

    def check_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        if state is None:
            return
        if not isinstance(state, Mapping):
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state is a {type(state).__name__}, "
                "not the mapping of x_slow and its momentum"
            )
        saved = (state.get("shards", 1), state.get("shard", 0))
        if saved != (self.shards, self.shard):
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state is shard {saved[1]} of "
                f"{saved[0]}, but this rank keeps shard {self.shard} of {self.shards} "
                "(slowmo_memory_efficient, slowmo_num_shards and the rank must match)"
            )
        expected = [(hi - lo, buckets.dtype(b)) for b, (lo, hi) in enumerate(self.ranges(buckets))]
        check_saved("SlowMo state", state.get("slow"), expected)
        check_saved("SlowMo momentum", state.get("momentum"), expected)

    def load_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """A checkpoint without SlowMo state (saved before it started) starts it again at the
        next forward."""
        self.check_state_dict(state, buckets, members_changed)
        if not isinstance(state, Mapping):  # None: checked above
            self.slow = self.buffer = None
            return
        self.slow = [t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["slow"])]
        self.buffer = [
            t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["momentum"])
        ]
