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
OUTER = "outer"  # DiLoCo's outer optimizer step (gossip_ext.outer)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums and the slow state of half-precision parameters are kept in float32, as the
    kernels accumulate them; other dtypes keep their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ParameterBuckets:
    """Tensors grouped by dtype in order of first appearance (the engine's flat-buffer order), each
    group read and written as one flat vector in its accumulation dtype without a flat copy of
    its own: ranges of it are copied straight between the tensors and a caller's buffer."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            buckets.setdefault(t.dtype, []).append(t)
        self.params = list(buckets.values())

    def __len__(self) -> int:
        return len(self.params)

    def numel(self, bucket: int) -> int:
        return sum(t.numel() for t in self.params[bucket])

    def dtype(self, bucket: int) -> torch.dtype:
        return accumulation_dtype(self.params[bucket][0].dtype)

    def device(self, bucket: int) -> torch.device:
        return self.params[bucket][0].device

    def layout(self) -> list[tuple[int, torch.dtype]]:
        """(elements, accumulation dtype) of each bucket: what a saved slow state must match."""
        return [(self.numel(b), self.dtype(b)) for b in range(len(self))]

    def _pieces(self, bucket: int, lo: int, hi: int):
        """(tensor's flat view, start in it, start in [lo, hi), length) of every tensor of the
        bucket that overlaps the flat range [lo, hi)."""
        offset = 0
        for t in self.params[bucket]:
            start, end = max(lo, offset), min(hi, offset + t.numel())
            if start < end:
                yield t.detach().view(-1), start - offset, start - lo, end - start
            offset += t.numel()

    @torch.no_grad()
    def read(self, bucket: int, out: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """Copies the flat range [lo, lo + len(out)) of the bucket into ``out``."""
        for flat, at, to, n in self._pieces(bucket, lo, lo + out.numel()):
            out[to : to + n].copy_(flat[at : at + n])
        return out

    @torch.no_grad()
    def write(self, bucket: int, values: torch.Tensor, lo: int = 0) -> None:
        """Copies ``values`` into the flat range [lo, lo + len(values)) of the bucket."""
        for flat, at, to, n in self._pieces(bucket, lo, lo + values.numel()):
            flat[at : at + n].copy_(values[to : to + n])


@torch.no_grad()
def exact_average(
    buckets: ParameterBuckets, bucket: int, weight: float | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """``sum_i w_i z_i / sum_i w_i`` of one bucket over the ranks of ``group``, in a new flat
    tensor (the parameters are left as they are); collective, and every rank gets the same bits.

    The result is the only copy of the bucket this takes: the message is built in it and
    all-reduced in place. ``weight`` is this rank's push-sum weight, or None on a rank that holds
    no gossip state of its own (a non-leader of ``nprocs_per_node > 1``): it contributes zeros,
    so the whole group can take part and receive the result while only the gossiping ranks are
    averaged. The weight rides as one extra element of the message, so the sum of the weights
    needs no collective of its own (and counts the contributing ranks when every weight is 1).
    """
    numel = buckets.numel(bucket)
    message = torch.empty(numel + 1, dtype=buckets.dtype(bucket), device=buckets.device(bucket))
    if weight is None:
        message.zero_()
    else:
        buckets.read(bucket, message[:numel])
        message[numel] = 1.0
        if weight != 1.0:
            message.mul_(weight)
    dist.all_reduce(message, group=group)
    return message[:numel].div_(message[numel])


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


def shard_ranges(numel: int, shards: int, index: int | None) -> tuple[int, int]:
    """The flat range [lo, hi) of shard ``index`` of ``numel`` elements cut into ``shards``
    near-equal parts (the last may be shorter or empty); (0, 0) for ``index`` None."""
    if index is None:
        return 0, 0
    length = -(-numel // shards)
    return min(index * length, numel), min((index + 1) * length, numel)


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

    The state (``x_slow`` and ``u``) is two model copies. Sharded (``shards > 1``, fairscale's
    ``slowmo_memory_efficient``), rank ``s < shards`` of the averaging group keeps and updates
    only the ``s``-th slice of every bucket, and sends its result to the others: ``2 / shards``
    model copies per rank for one all-gather's worth of extra traffic per SlowMo step.
    """

    def __init__(self, momentum: float, lr: float, shards: int = 1, shard: int | None = 0):
        self.momentum = momentum
        self.lr = lr
        self.shards = shards
        self.shard = shard  # this rank's shard; None: it keeps none
        self.slow: list[torch.Tensor] | None = None
        self.buffer: list[torch.Tensor] | None = None

    @property
    def initialized(self) -> bool:
        return self.slow is not None

    def ranges(self, buckets: ParameterBuckets) -> list[tuple[int, int]]:
        """This rank's slice of every bucket."""
        return [
            shard_ranges(buckets.numel(b), self.shards, self.shard) for b in range(len(buckets))
        ]

    @torch.no_grad()
    def reset(self, buckets: ParameterBuckets, averages: Sequence[torch.Tensor] | None = None):
        """x_slow starts at the parameters (or at ``averages``, full flat buckets), u at 0."""
        self.slow, self.buffer = [], []
        for b, (lo, hi) in enumerate(self.ranges(buckets)):
            slow = torch.empty(hi - lo, dtype=buckets.dtype(b), device=buckets.device(b))
            if averages is None:
                buckets.read(b, slow, lo)
            else:
                slow.copy_(averages[b][lo:hi])
            self.slow.append(slow)
            self.buffer.append(torch.zeros_like(slow))

    @torch.no_grad()
    def step(
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
        slow, buffer = self.slow[bucket], self.buffer[bucket]
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

    def state_dict(self) -> dict[str, Any] | None:
        if self.slow is None:
            return None
        return {
            "slow": [t.clone() for t in self.slow],
            "momentum": [t.clone() for t in self.buffer],
            "shards": self.shards,
            "shard": self.shard,
        }

    def load_state_dict(self, state: Mapping[str, Any] | None, buckets: ParameterBuckets) -> None:
        if state is None:
            self.slow = self.buffer = None
            return
        saved = (state.get("shards", 1), state.get("shard", 0))
        if saved != (self.shards, self.shard):
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state is shard {saved[1]} of "
                f"{saved[0]}, but this rank keeps shard {self.shard} of {self.shards} "
                "(slowmo_memory_efficient, slowmo_num_shards and the rank must match)"
            )
        expected = [(hi - lo, buckets.dtype(b)) for b, (lo, hi) in enumerate(self.ranges(buckets))]
        found = [(t.numel(), t.dtype) for t in state["slow"]]
        if found != expected:
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state has buckets (elements, dtype) "
                f"{found}, but this model's parameters give {expected}"
            )
        self.slow = [t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["slow"])]
        self.buffer = [
            t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["momentum"])
        ]


class ExactAveraging:
    """The exact-averaging schedule of a GossipDataParallel, its SlowMo state, and one averaging
    step (the gossip state stays with the wrapper).

    Memory: a step holds one transient flat copy of the parameters (every dtype group's average
    until all are written), so that the parameters change only once every collective has
    succeeded (Note [The parameters are the
    model] in the engine); SlowMo adds its state (see :class:`SlowMomentum`). Floating-point
    buffers (BatchNorm's running statistics) are averaged with the parameters.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        global_avg_freq: int,
        slowmo_freq: int,
        slowmo_momentum: float,
        slowmo_lr: float,
        slowmo_shards: int = 1,
        outer=None,
        sync_every: int = 0,
    ):
        self.buckets = ParameterBuckets(params)
        self.buffer_buckets = ParameterBuckets(buffers)
        self.group = group
        self.global_avg_freq = global_avg_freq
        self.slowmo_freq = slowmo_freq
        self.slowmo = None
        if slowmo_freq:
            rank = dist.get_rank(group)
            shard = 0 if slowmo_shards == 1 else (rank if rank < slowmo_shards else None)
            self.slowmo = SlowMomentum(slowmo_momentum, slowmo_lr, slowmo_shards, shard)
        # DiLoCo's outer step (a gossip_ext.outer.OuterStep) every sync_every steps; the
        # argument checks keep it apart from SlowMo and global_avg_freq.
        self.outer = outer
        self.sync_every = sync_every
        self._outer_start_pending = outer is not None

    def kind(self, step: int) -> str | None:
        """What the ``step``-th optimizer step (1-based) ends with: OUTER or SLOWMO (which average
        too) take precedence over a plain AVERAGE; None: a gossip round, as usual."""
        if self.outer is not None and step % self.sync_every == 0:
            return OUTER
        if self.slowmo_freq and step % self.slowmo_freq == 0:
            return SLOWMO
        if self.global_avg_freq and step % self.global_avg_freq == 0:
            return AVERAGE
        return None

    @property
    def start_pending(self) -> bool:
        """Whether SlowMo's x_slow or DiLoCo's theta_global is still to start from the
        parameters of the next forward."""
        return self._outer_start_pending or (
            self.slowmo is not None and not self.slowmo.initialized
        )

    def start_from_parameters(self) -> None:
        """SlowMo's x_slow and DiLoCo's theta_global start at the parameters the first forward
        sees: the common starting point of every rank, after any weights the user loaded into
        the wrapped module."""
        if self.slowmo is not None and not self.slowmo.initialized:
            self.slowmo.reset(self.buckets)
        if self._outer_start_pending:
            self.outer.reset()
            self._outer_start_pending = False

    def apply(
        self,
        kind: str,
        weight: float | None,
        buffer_weight: float | None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Sets the parameters to the exact average (see :func:`exact_average`), followed by
        SlowMo's update (``kind`` SLOWMO, with the base ``optimizer``) or the outer optimizer's
        step (OUTER), and the floating buffers to their average (weighted by
        ``buffer_weight``)."""
        # Every bucket is averaged before any is written: one failed collective changes nothing.
        if kind == SLOWMO:
            results = self._slow_step(weight, optimizer)
        else:
            results = [
                exact_average(self.buckets, b, weight, self.group) for b in range(len(self.buckets))
            ]
        buffer_results = [
            exact_average(self.buffer_buckets, b, buffer_weight, self.group)
            for b in range(len(self.buffer_buckets))
        ]
        if kind == OUTER:  # after every collective: a failed one leaves the outer state alone
            results = self.outer.step(results)
        for b, result in enumerate(results):
            self.buckets.write(b, result)
        for b, result in enumerate(buffer_results):
            self.buffer_buckets.write(b, result)

    def _slow_step(self, weight: float | None, optimizer: torch.optim.Optimizer):
        averages = [
            exact_average(self.buckets, b, weight, self.group) for b in range(len(self.buckets))
        ]
        slowmo = self.slowmo
        if not slowmo.initialized:
            # No forward ran before this step (a gossip-only loop): start from the average,
            # which makes this first SlowMo step a plain averaging step.
            slowmo.reset(self.buckets, averages)
        lrs = learning_rates(optimizer, self.buckets)
        for b, ((lo, _), average) in enumerate(zip(slowmo.ranges(self.buckets), averages)):
            sizes = [p.numel() for p in self.buckets.params[b]]
            slowmo.step(b, average, lo, sizes, lrs[b])
            if slowmo.shards > 1:
                # Every shard's owner sends its slice of x_slow to the others.
                for shard in range(slowmo.shards):
                    s_lo, s_hi = shard_ranges(average.numel(), slowmo.shards, shard)
                    if s_lo < s_hi:
                        owner = dist.get_global_rank(self.group, shard)
                        dist.broadcast(average[s_lo:s_hi], owner, group=self.group)
        return averages

    def state_dict(self) -> dict[str, Any]:
        state = {"slowmo": None if self.slowmo is None else self.slowmo.state_dict()}
        if self.outer is not None:
            state["outer"] = None if self._outer_start_pending else self.outer.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint without SlowMo's or the outer step's state (saved before the first
        forward, or by a run without them) leaves them to start again at the next forward."""
        if self.slowmo is not None:
            self.slowmo.load_state_dict(state.get("slowmo"), self.buckets)
        if self.outer is not None:
            saved = state.get("outer")
            if saved is not None:
                self.outer.load_state_dict(saved)
            self._outer_start_pending = saved is None
