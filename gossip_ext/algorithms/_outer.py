"""What happens every few optimizer steps: a plain average, SlowMo, DiLoCo (streamed or not),
each building its runtime part (``steps``: an ``outer_steps.OuterSteps`` running its ``rule``);
how DiLoCo's outer step averages is an ``OuterAverage`` (``algorithms._averages``)."""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.algorithms._averages import ByCollective, OuterAverage
from gossip_ext.algorithms._base import (
    Algorithm,
    check_argument,
    check_every,
    value_of,
    where,
)
from gossip_ext.averagings import Averaging
from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase
from gossip_ext.outer import outer_steps, slow_momentum
from gossip_ext.outer import rules as outer_rules
from gossip_ext.outer.interface import OuterRule, OuterRuntime, RuleState
from gossip_ext.outer.streaming import StreamingOuter, StreamingSteps


class Outer(Algorithm, abc.ABC):
    """What every outer step is: its runtime part is :meth:`steps`; ``needs_inner_lr`` says
    whether it reads the inner optimizer's learning rates."""

    needs_inner_lr = False

    @abc.abstractmethod
    def steps(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        graph: GraphBase,
        mixing: MixingBase,
        timeout: timedelta,
        sizes: Sequence[int] | None = None,
    ) -> OuterRuntime:
        """The runtime part over ``params`` (the parameters, or a sharded module's local shards)
        and the floating-point ``buffers`` on ``group``; ``graph`` and ``mixing``: the gossip's,
        for an averaging by gossip; ``sizes``: each whole parameter's bytes, where ``params``
        are shards."""

    def check_combination(self, gossip, membership, nprocs_per_node: int, spelling) -> None:
        """Raises ValueError, in the user's ``spelling``, if this outer step cannot run beside
        the ``gossip`` and ``membership`` given with it (None: none), or with
        ``nprocs_per_node`` processes a machine."""


def check_average(obj: Any) -> None:
    check_argument(
        obj,
        "average",
        obj.average,
        OuterAverage,
        "ByCollective(...), ByGossip(...), ByCompressedGossip(...) or another OuterAverage",
    )


def no_flat_spelling(obj: Any) -> None:
    """The flat keywords average SlowMo's and a plain average's steps by ByCollective() only."""
    if obj.average != ByCollective():
        raise ValueError(
            f"{type(obj).__name__}(average={obj.average!r}) has no flat keyword: give it as an "
            "object"
        )


def averaging_of(average: OuterAverage, params, group, *, graph, mixing, timeout) -> Averaging:
    """The runtime part of ``average`` for the whole model's outer step."""
    return average.averaging(
        ParameterBuckets(params), group, streamed=False, graph=graph, mixing=mixing, timeout=timeout
    )


@dataclasses.dataclass(frozen=True)
class Average(Outer):
    """Every ``every`` optimizer steps (counted by ``transfer_params()`` calls), the workers'
    average in place of that step's gossip round. With gossip: SGP's global averaging; with
    ``gossip=None``: LocalSGD (Lin et al., ICLR 2020), every worker alone in between.

    ``average`` says how (default ``ByCollective()``: the exact average, push-sum's consensus
    value, one all-reduce per dtype, the push-sum weights reset to 1). In compressed or sparse
    messages (``ByCollective(dtype=...)``) every worker keeps the model of the last average and
    sends its difference from it; ``ByGossip()`` and ``ByCompressedGossip()`` mix with a few
    peers (decentralized local SGD), each worker then holding its own model."""

    every: int
    average: OuterAverage = dataclasses.field(default_factory=lambda: ByCollective())

    needs_inner_lr = False  # whether it reads the inner optimizer's learning rates

    def __post_init__(self) -> None:
        check_every(self, self.every)
        check_average(self)
        if self.average.global_device is not None and not self.average.sends_differences:
            raise ValueError(
                f"{where(self, 'average')} places global parameters on "
                f"{self.average.global_device!r}, but a plain average in full precision keeps "
                "none (only compressed or sparse messages keep the model of the last average)"
            )

    def flat(self, gossips: bool) -> dict[str, Any]:
        no_flat_spelling(self)
        return {"global_avg_freq": self.every} if gossips else {"sync_every": self.every}

    def rule(self, params, group, **_) -> OuterRule:
        """Its runtime part: the parameters become the average; where the messages are
        differences from the last average, it keeps that model (``GlobalAverage``)."""
        if self.average.sends_differences:
            buckets = ParameterBuckets(params)
            return outer_rules.GlobalAverage(params, buckets, self.average.global_device)
        return outer_rules.PlainAverage()

    def steps(
        self, params, buffers, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None
    ) -> outer_steps.OuterSteps:
        """Its runtime part: the average of ``params`` (and, by a collective, of the
        floating-point ``buffers``) over ``group`` every ``every`` steps."""
        averaging = averaging_of(
            self.average, params, group, graph=graph, mixing=mixing, timeout=timeout
        )
        return outer_steps.OuterSteps(
            params,
            buffers,
            group,
            rule=self.rule(params, group),
            sync_every=self.every,
            averaging=averaging,
            timeout=timeout,
        )


@dataclasses.dataclass(frozen=True)
class SlowMo(Outer):
    """SlowMo (Wang et al., ICLR 2020): every ``every`` steps, the exact average ``x_avg``, then
    the slow momentum step ``u <- momentum * u + (x_slow - x_avg) / lr_inner``, ``x_slow <-
    x_slow - lr * lr_inner * u``, and every rank's parameters become ``x_slow``; ``lr_inner`` is
    each param group's current learning rate, read from the optimizer given to
    ``register_optimizer()``. ``x_slow`` starts at the parameters of the first forward.
    ``momentum`` in [0, 1) (default 0.5); ``lr`` > 0 (default 1.0). ``memory_efficient``: the slow
    state (two model copies) sharded over ``num_shards`` ranks (None: every rank), each updating
    its slice and sending it to the others, ``2 / num_shards`` copies a rank for one
    all-gather's traffic per step. ``average_every``: also a plain exact average every that
    many steps in between (fairscale's ``localsgd_frequency``; None: none). ``average``: how
    ``x_avg`` is formed (default ``ByCollective()``, exact; in compressed or sparse messages each
    worker sends ``x_slow - x_i``; ``ByGossip()`` or ``ByCompressedGossip()``: each worker's
    ``x_avg`` is its own parameters mixed with a few peers', and so is its ``x_slow``).
    """

    every: int
    momentum: float = 0.5
    lr: float = 1.0
    memory_efficient: bool = False
    num_shards: int | None = None
    average_every: int | None = None
    average: OuterAverage = dataclasses.field(default_factory=lambda: ByCollective())

    needs_inner_lr = True

    def __post_init__(self) -> None:
        check_every(self, self.every)
        check_average(self)
        if self.average.global_device is not None:
            raise ValueError(
                f"{where(self, 'average')} places global parameters on "
                f"{self.average.global_device!r}, but SlowMo keeps x_slow beside the parameters"
            )
        if self.memory_efficient and (
            self.average.sends_differences or not self.average.same_everywhere
        ):
            raise ValueError(
                f"{where(self, 'average')} is {self.average!r}, but memory_efficient=True splits "
                "x_slow over the workers, which needs the same exact average on every worker and "
                "no message taken from x_slow: use ByCollective() (full precision), or "
                "memory_efficient=False"
            )
        check_argument(self, "momentum", self.momentum, (int, float), "a float")
        check_argument(self, "lr", self.lr, (int, float), "a float")
        check_argument(self, "memory_efficient", self.memory_efficient, bool, "a bool")
        # beta = 1 never forgets a slow step and diverges; NaN fails both comparisons.
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{where(self, 'momentum')} must be in [0, 1), got {self.momentum}")
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"{where(self, 'lr')} must be positive and finite, got {self.lr}")
        if self.average_every is not None:
            check_argument(self, "average_every", self.average_every, int, "an int or None")
            if self.average_every < 1:
                raise ValueError(
                    f"{where(self, 'average_every')} must be >= 1 (None: no plain averages), "
                    f"got {self.average_every}"
                )
        if self.num_shards is not None:
            check_argument(self, "num_shards", self.num_shards, int, "an int or None")
            if self.num_shards < 1:
                raise ValueError(
                    f"{where(self, 'num_shards')} must be >= 1 (None: every rank), got "
                    f"{self.num_shards}"
                )

    def rule(self, params, group: dist.ProcessGroup, **_) -> slow_momentum.SlowMomentum:
        """Its runtime part over ``group``: the heavy-ball rule, its state on ``num_shards``
        ranks when memory-efficient (this rank's shard, or None where it keeps none)."""
        world_size, rank = dist.get_world_size(group), group.rank()
        shards = min(world_size, self.num_shards or world_size) if self.memory_efficient else 1
        shard = 0 if shards == 1 else (rank if rank < shards else None)
        return slow_momentum.SlowMomentum(self.momentum, self.lr, group, shards, shard)

    def steps(
        self, params, buffers, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None
    ) -> outer_steps.OuterSteps:
        """Its runtime part: the heavy-ball rule every ``every`` steps on the mean ``average``
        forms, a plain exact average every ``average_every`` steps in between."""
        return outer_steps.OuterSteps(
            params,
            buffers,
            group,
            average_every=self.average_every or 0,
            rule=self.rule(params, group),
            sync_every=self.every,
            averaging=averaging_of(
                self.average, params, group, graph=graph, mixing=mixing, timeout=timeout
            ),
            timeout=timeout,
        )

    def flat(self, gossips: bool) -> dict[str, Any]:
        no_flat_spelling(self)
        return {
            "global_avg_freq": self.average_every,
            "slowmo_freq": self.every,
            "slowmo_momentum": self.momentum,
            "slowmo_lr": self.lr,
            "slowmo_memory_efficient": self.memory_efficient,
            "slowmo_num_shards": self.num_shards,
        }


@dataclasses.dataclass(frozen=True)
class DiLoCo(Outer):
    """DiLoCo (Douillard et al., 2023): every ``every`` inner steps (its H) the workers average
    their pseudo-gradients ``theta_global - theta_i``, an outer optimizer steps ``theta_global``
    with that average as its gradient, and every worker goes on from ``theta_global``, which
    starts at the parameters of the first forward.

    Args:
        optimizer (callable): called once with the global parameters (tensors shaped like the
            module's, in its order), returns the torch.optim.Optimizer that steps them, e.g.
            ``lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)``; an outer
            scheduler goes on ``model.outer_optimizer``, stepped by you.
        every (int): inner steps between outer steps.
        average (OuterAverage): how the pseudo-gradients are averaged: ``ByCollective()`` (the
            default), ``ByGossip()``, ``ByCompressedGossip()``, or one's own.
        fragments (int): Streaming DiLoCo (Douillard et al., 2025) when > 1: the parameters, in
            module order, in ``fragments`` contiguous fragments of about equal bytes, fragment
            ``j`` synchronised at step ``floor(every (j + 1) / fragments)`` of every period with
            its own outer optimizer (``model.outer_optimizers``), so that ``1 / fragments`` of the
            model travels at a time (default: 1).
        delay (int): a fragment's averaging starts ``delay`` steps before its outer step and
            travels while the workers train, ``0 <= delay < every // fragments`` (default: 0).
        alpha (float): at a fragment's outer step its parameters become ``alpha * local + (1 -
            alpha) * theta_global``, in [0, 1]; 0 drops the steps taken in flight (default: 0).
    """

    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    every: int
    average: OuterAverage = dataclasses.field(default_factory=lambda: ByCollective())
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    needs_inner_lr = False

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, type) and issubclass(self.optimizer, torch.optim.Optimizer):
            cls = self.optimizer
            name = cls.__name__
            if getattr(torch.optim, name, None) is not cls:
                name = f"{cls.__module__}.{cls.__qualname__}"
            else:
                name = f"torch.optim.{name}"
            raise TypeError(
                f"{where(self, 'optimizer')} must build a configured optimizer, got the class "
                f"{name}, which would step at its default learning rate: give "
                f"`lambda params: {name}(params, lr=...)` or functools.partial({name}, lr=...) "
                "(DiLoCo's own: `lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, "
                "nesterov=True)`)"
            )
        if not callable(self.optimizer):
            raise TypeError(
                f"{where(self, 'optimizer')} must be a callable that builds a "
                "torch.optim.Optimizer from a list of tensors (e.g. `lambda params: "
                "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`), got "
                f"{type(self.optimizer).__name__} {self.optimizer!r}"
            )
        check_every(self, self.every)
        check_average(self)
        for name in ("fragments", "delay"):
            check_argument(self, name, getattr(self, name), int, "an int")
        check_argument(self, "alpha", self.alpha, (int, float), "a float")
        if self.fragments < 1:
            raise ValueError(f"{where(self, 'fragments')} must be >= 1, got {self.fragments}")
        if self.fragments > self.every:
            raise ValueError(
                f"{where(self, 'fragments')} must be at most {value_of(self, 'every')} (a step "
                f"per fragment), got {self.fragments}"
            )
        if self.delay < 0:
            raise ValueError(f"{where(self, 'delay')} must be >= 0, got {self.delay}")
        if self.delay >= self.every // self.fragments:
            every, fragments = (value_of(self, n).partition("=")[0] for n in ("every", "fragments"))
            raise ValueError(
                f"{where(self, 'delay')} must be < {every} // {fragments} = "
                f"{self.every // self.fragments} (a fragment's average must end before the next "
                f"one starts), got {self.delay}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{where(self, 'alpha')} must be in [0, 1], got {self.alpha}")
        if self.streamed and not self.average.streams:
            raise ValueError(
                f"{where(self, 'average')}: {self.average.whole_only}; got Streaming DiLoCo "
                f"(fragments={self.fragments}, delay={self.delay}, alpha={self.alpha})"
            )

    @property
    def streamed(self) -> bool:
        """Streaming DiLoCo: the outer step in fragments, or overlapped with training."""
        return (self.fragments, self.delay, self.alpha) != (1, 0, 0.0)

    def rule(
        self, params, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None
    ) -> RuleState:
        """Its rule over ``group``: the outer optimizer over ``theta_global``, or Streaming
        DiLoCo's fragments, each averaged as ``average`` says (over ``graph`` and ``mixing``, the
        inner mix's or ByGossip's own, where it gossips; waits bounded by ``timeout``)."""
        if self.streamed:
            return self._fragments(
                params, group, graph=graph, mixing=mixing, timeout=timeout, sizes=sizes
            )
        return self._outer_optimizer(params)

    def _outer_optimizer(self, params) -> outer_rules.OuterOptimizer:
        device = self.average.global_device
        return outer_rules.OuterOptimizer(params, ParameterBuckets(params), self.optimizer, device)

    def _fragments(
        self, params, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes
    ) -> StreamingOuter:
        def averaging(buckets: ParameterBuckets) -> Averaging:
            return self.average.averaging(
                buckets, group, streamed=True, graph=graph, mixing=mixing, timeout=timeout
            )

        return StreamingOuter(
            params,
            self.optimizer,
            self.average.global_device,
            averaging,
            sync_every=self.every,
            fragments=self.fragments,
            delay=self.delay,
            alpha=self.alpha,
            sizes=sizes,
        )

    def steps(
        self, params, buffers, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None
    ) -> OuterRuntime:
        """Its runtime part: the outer optimizer every ``every`` steps on the mean of the
        pseudo-gradients that ``average`` forms, or the fragments on their own schedule."""
        if self.streamed:
            fragments = self._fragments(
                params, group, graph=graph, mixing=mixing, timeout=timeout, sizes=sizes
            )
            return StreamingSteps(
                params, buffers, group, rule=fragments, sync_every=self.every, timeout=timeout
            )
        return outer_steps.OuterSteps(
            params,
            buffers,
            group,
            rule=self._outer_optimizer(params),
            sync_every=self.every,
            averaging=averaging_of(
                self.average, params, group, graph=graph, mixing=mixing, timeout=timeout
            ),
            timeout=timeout,
        )

    def flat(self, gossips: bool) -> dict[str, Any]:
        settings = {
            "outer_optimizer": self.optimizer,
            "sync_every": self.every,
            "fragments": self.fragments,
            "fragment_delay": self.delay,
            "fragment_alpha": self.alpha,
        }
        settings.update(self.average.flat(gossips))
        return settings
