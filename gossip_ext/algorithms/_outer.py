"""What happens every few optimizer steps: an exact average, SlowMo, DiLoCo (streamed or not),
and how an outer step averages (ByCollective, ByGossip, ByCompressedGossip: OuterAverage objects,
each building its runtime ``gossip_ext.averagings.Averaging``); each outer step building its
rule (``rule``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext import inner, outer, outer_rules
from gossip_ext._argument_checks import check_outer_message_format
from gossip_ext.averagings import AllReduceMean, AllReducePseudoGradientMean, Averaging, RoundMean
from gossip_ext.algorithms._base import (
    Algorithm,
    check_argument,
    check_dtype_argument,
    check_every,
    where,
)
from gossip_ext.averaging import ParameterBuckets
from gossip_ext.compressed_average import CompressedMean
from gossip_ext.compressed_gossip import DEFAULT_CONSENSUS_STEP, SparseGossip, fixed_neighbours
from gossip_ext.fragment_gossip import GossipMean
from gossip_ext.graphs import GraphBase, RingGraph
from gossip_ext.mixing import MixingBase, UniformMixing
from gossip_ext.sparse_average import TopK
from gossip_ext.streaming import StreamingOuter


class OuterAverage(Algorithm):
    """How DiLoCo's outer step averages: the configuration of a way to average, which builds its
    runtime part (a ``gossip_ext.averagings.Averaging``). Subclass it, as a frozen dataclass, to
    average another way (see docs/design.md, "Adding a way to average")."""

    # Whether it can average a Streaming DiLoCo fragment; False: say why in ``whole_only``.
    streams = True
    whole_only = ""

    def averaging(
        self, buckets: ParameterBuckets, group: dist.ProcessGroup, *, streamed: bool, graph,
        mixing, timeout,
    ) -> Averaging:
        """Its runtime part over ``buckets`` (the whole model's, or a fragment's when
        ``streamed``) on ``group``; a gossip averages over ``graph`` with ``mixing`` (the inner
        mix's, or its own), every wait bounded by ``timeout``."""
        raise NotImplementedError(f"{type(self).__name__} must build its averaging")

    @property
    def global_device(self) -> torch.device | str | None:
        """Where ``theta_global`` lives (None: the parameters' device)."""
        return None

    @property
    def needs_engine(self) -> bool:
        """Whether it runs rounds of the inner gossip's engine (where there is no gossip, it
        builds one: ``mix``)."""
        return False

    def flat(self, gossips: bool) -> dict[str, Any]:
        """Its settings in the earlier releases' flat keywords."""
        return {}


@dataclasses.dataclass(frozen=True)
class ByCollective(OuterAverage):
    """An outer step's mean over every worker, formed by a collective: every worker then holds
    the same mean, bit for bit (exact in full precision; in compressed or sparse messages, with
    error feedback keeping what they leave out).

    Args:
        dtype (torch.dtype or str, optional): DiLoCo's pseudo-gradients sent compressed
            (``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``, ``"int8"``,
            ``"int4"``) as a reduce-scatter and an all-gather of compressed shards, with error
            feedback on every worker and on every shard's owner: each outer step sends
            ``2 (n - 1) / n`` of the model at the message's width, every worker's global
            parameters stay the same bits, and no rounding accumulates. None: full precision,
            one all-reduce (default). Or sparse messages, :class:`gossip_ext.TopK`: the largest
            values of every chunk in 2 or 4 bits with error feedback, gathered by every worker
            (SparseLoCo's; about 0.009 of float32's bytes a message, see
            :mod:`gossip_ext.sparse_average`).
        device (torch.device or str, optional): where DiLoCo's global parameters and its outer
            optimizer's state live: ``'cpu'`` keeps them in host memory when the parameters are
            on a GPU (torchft's ``backup_device``). Default: the parameters' device.
    """

    dtype: torch.dtype | str | TopK | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        check_dtype_argument(self, "dtype", self.dtype, check_outer_message_format)
        if self.device is not None:
            check_argument(
                self, "device", self.device, (str, torch.device), "a torch.device or str"
            )
            try:
                torch.device(self.device)
            except RuntimeError as error:
                raise ValueError(
                    f"{where(self, 'device')}: {self.device!r} is not a device ({error})"
                ) from None

    def averaging(self, buckets, group, *, streamed, graph, mixing, timeout) -> Averaging:
        """The exact all-reduce (of the parameters; of a fragment's pseudo-gradients), or the
        exact mean of the pseudo-gradients in ``dtype``'s messages."""
        if self.dtype is None:
            return (AllReducePseudoGradientMean if streamed else AllReduceMean)(group, timeout)
        layout, device = buckets.layout(), buckets.device(0)
        own = getattr(self.dtype, "mean_over", None)  # a message format of its own (TopK)
        if own is not None:
            return own(layout, device, group, timeout)
        return CompressedMean(layout, device, self.dtype, group, timeout)

    @property
    def global_device(self):
        return self.device

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {"outer_dtype": self.dtype, "outer_device": self.device}


# The former name (it meant "over every worker", and is not exact in compressed messages), kept
# for one release.
Exact = ByCollective


@dataclasses.dataclass(frozen=True)
class ByGossip(OuterAverage):
    """An outer step's average by one gossip round, with no collective over every worker: each
    worker mixes its parameters with the round's peers and steps its own global parameters with
    ``theta_global - z``. Push-sum keeps the mean over workers, so their mean moves as under an
    exact average; each worker's own differs from it by what one round did not mix
    (``consensus_distance()`` right after an outer step says by how much). With Streaming
    DiLoCo, a fragment's pseudo-gradient goes to the out-peers of one round while the workers
    train. With ``gossip=None`` the round needs a ``graph``, ``mixing`` and ``message_dtype``
    of its own (as :class:`SGP`'s); with gossip, it runs on the inner mix's engine."""

    graph: GraphBase | None = None
    mixing: MixingBase | None = None
    message_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        if self.graph is not None:
            check_argument(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
        if self.mixing is not None:
            check_argument(self, "mixing", self.mixing, MixingBase, "a gossip_ext mixing")
        check_dtype_argument(self, "message_dtype", self.message_dtype)

    def mix(self, named, link: inner.Link, graph: GraphBase) -> inner.InnerMix:
        """Its runtime part where ``gossip=None``: an engine of its own (as :meth:`SGP.mix`'s,
        synchronous) whose round only the outer step asks for."""
        return inner.InnerMix.build(
            named,
            link,
            graph=graph,
            mixing=self.mixing or UniformMixing(),
            push_sum=True,
            overlap=False,
            synch_freq=0,
            message_dtype=self.message_dtype,
            check_finite=True,
            every_step=False,
        )

    @property
    def own_engine(self) -> bool:
        return (self.graph, self.mixing, self.message_dtype) != (None, None, None)

    @property
    def needs_engine(self) -> bool:
        return True

    def averaging(self, buckets, group, *, streamed, graph, mixing, timeout) -> Averaging:
        """The whole model: one round of the engine; a fragment: one exchange of its
        pseudo-gradients with the peers of a round of ``graph``."""
        if streamed:
            return GossipMean(buckets.layout(), graph, mixing, group, timeout)
        return RoundMean()

    def flat(self, gossips: bool) -> dict[str, Any]:
        settings: dict[str, Any] = {"outer_average": "gossip"}
        if self.own_engine:
            if gossips:
                raise ValueError(
                    "ByGossip(graph=..., mixing=..., message_dtype=...) gives the outer round an "
                    "engine of its own, but gossip is set: the outer round then runs on the "
                    "inner mix's engine; give those settings to the gossip object"
                )
            settings.update(graph=self.graph, mixing=self.mixing, message_dtype=self.message_dtype)
        return settings


@dataclasses.dataclass(frozen=True)
class ByCompressedGossip(OuterAverage):
    """An outer step's average by gossip in sparse messages, on a fixed graph (CHOCO-gossip; see
    :mod:`gossip_ext.compressed_gossip`): every worker keeps a public copy of its parameters that
    its neighbours hold too, sends them the ``message`` of its parameters' difference from it,
    moves its parameters ``consensus_step`` of the way towards its neighbourhood's copies, and
    steps its own ``theta_global`` with ``theta_global - z``. The mean over workers is kept, as
    under :class:`ByGossip`; each outer step sends one message to each neighbour, whatever the
    number of workers.

    Args:
        message (TopK): the sparse message (default ``TopK(density=1/32, bits=2)``). Its
            ``feedback_decay`` must be 1: what a message leaves out stays in the difference from
            the public copy, which is the error feedback.
        consensus_step (float): gamma, in (0, 1] (default 0.25, the best of those tried: see
            ``compressed_gossip.DEFAULT_CONSENSUS_STEP``).
        graph (GraphBase, optional): fixed and symmetric, as ``RingGraph(peers_per_itr=2)``, the
            default (the other worker, at two workers).
    """

    message: TopK = dataclasses.field(default_factory=lambda: TopK(density=1 / 32, bits=2))
    consensus_step: float = DEFAULT_CONSENSUS_STEP
    graph: GraphBase | None = None

    streams = False
    whole_only = (
        "ByCompressedGossip averages the whole model at each outer step (one public copy of it "
        "per worker); Streaming DiLoCo takes sparse messages through ByCollective(dtype=TopK(...))"
    )

    def __post_init__(self) -> None:
        check_argument(self, "message", self.message, TopK, "a gossip_ext.TopK")
        if self.message.feedback_decay != 1.0:
            raise ValueError(
                f"{where(self, 'message')}: feedback_decay must be 1 (the public copy keeps what a "
                f"message leaves out), got {self.message.feedback_decay}"
            )
        check_argument(self, "consensus_step", self.consensus_step, (int, float), "a float")
        if not 0.0 < self.consensus_step <= 1.0:
            raise ValueError(
                f"{where(self, 'consensus_step')}: must be in (0, 1], got {self.consensus_step}"
            )
        if self.graph is not None:
            check_argument(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
            if self.graph.is_dynamic:
                raise ValueError(
                    f"{where(self, 'graph')}: must be fixed (the neighbours hold each worker's "
                    f"public copy), got {self.graph!r}; e.g. RingGraph(peers_per_itr=2)"
                )

    def averaging(self, buckets, group, *, streamed, graph, mixing, timeout) -> SparseGossip:
        """The sparse gossip of this worker with its neighbours on ``group``."""
        world_size, rank = dist.get_world_size(group), group.rank()
        ring = self.graph or RingGraph(peers_per_itr=2 if world_size > 2 else 1)
        neighbours = fixed_neighbours(ring, rank, world_size)
        return SparseGossip(
            buckets.layout(),
            buckets.device(0),
            self.message,
            self.consensus_step,
            neighbours,
            group,
            timeout,
        )

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {
            "outer_average": "compressed_gossip",
            "outer_dtype": self.message,
            "outer_consensus_step": self.consensus_step,
            "outer_graph": self.graph,
        }


@dataclasses.dataclass(frozen=True)
class Average(Algorithm):
    """Every ``every`` optimizer steps (counted by ``transfer_params()`` calls), the parameters'
    exact average (push-sum's consensus value, one all-reduce per dtype) in place of that step's
    gossip round, the push-sum weights reset to 1. With gossip: SGP's global averaging; with
    ``gossip=None``: LocalSGD (Lin et al., ICLR 2020), every worker alone in between."""

    every: int

    def __post_init__(self) -> None:
        check_every(self, self.every)

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {"global_avg_freq": self.every} if gossips else {"sync_every": self.every}

    def rule(self, params, group, **_) -> None:
        """A plain average has no rule and no state."""
        return None

    def steps(self, params, buffers, group: dist.ProcessGroup, *, timeout, **_) -> outer.OuterSteps:
        """Its runtime part: an exact average of ``params`` and the floating-point ``buffers``
        over ``group`` every ``every`` steps."""
        return outer.OuterSteps(
            params, buffers, group, average_every=self.every, timeout=timeout
        )


@dataclasses.dataclass(frozen=True)
class SlowMo(Algorithm):
    """SlowMo (Wang et al., ICLR 2020): every ``every`` steps, the exact average ``x_avg``, then
    the slow momentum step ``u <- momentum * u + (x_slow - x_avg) / lr_inner``, ``x_slow <-
    x_slow - lr * lr_inner * u``, and every rank's parameters become ``x_slow``; ``lr_inner`` is
    each param group's current learning rate, read from the optimizer given to
    ``register_optimizer()``. ``x_slow`` starts at the parameters of the first forward.
    ``momentum`` in [0, 1) (default 0.5); ``lr`` > 0 (default 1.0). ``memory_efficient``: the slow
    state (two model copies) sharded over ``num_shards`` ranks (None: every rank), each updating
    its slice and sending it to the others, ``2 / num_shards`` copies a rank for one
    all-gather's traffic per step. ``average_every``: also a plain exact average every that
    many steps in between (fairscale's ``localsgd_frequency``; None: none).
    """

    every: int
    momentum: float = 0.5
    lr: float = 1.0
    memory_efficient: bool = False
    num_shards: int | None = None
    average_every: int | None = None

    def __post_init__(self) -> None:
        check_every(self, self.every)
        check_argument(self, "momentum", self.momentum, (int, float), "a float")
        check_argument(self, "lr", self.lr, (int, float), "a float")
        check_argument(self, "memory_efficient", self.memory_efficient, bool, "a bool")
        # beta = 1 never forgets a slow step and diverges; NaN fails both comparisons.
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{where(self, 'momentum')}: must be in [0, 1), got {self.momentum}")
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"{where(self, 'lr')}: must be positive and finite, got {self.lr}")
        if self.average_every is not None:
            check_argument(self, "average_every", self.average_every, int, "an int or None")
            if self.average_every < 1:
                raise ValueError(
                    f"{where(self, 'average_every')}: must be >= 1 (None: no plain averages), "
                    f"got {self.average_every}"
                )
        if self.num_shards is not None:
            check_argument(self, "num_shards", self.num_shards, int, "an int or None")
            if self.num_shards < 1:
                raise ValueError(
                    f"{where(self, 'num_shards')}: must be >= 1 (None: every rank), got "
                    f"{self.num_shards}"
                )

    def rule(self, params, group: dist.ProcessGroup, **_) -> outer_rules.SlowMomentum:
        """Its runtime part over ``group``: the heavy-ball rule, its state on ``num_shards``
        ranks when memory-efficient (this rank's shard, or None where it keeps none)."""
        world_size, rank = dist.get_world_size(group), group.rank()
        shards = min(world_size, self.num_shards or world_size) if self.memory_efficient else 1
        shard = 0 if shards == 1 else (rank if rank < shards else None)
        return outer_rules.SlowMomentum(self.momentum, self.lr, group, shards, shard)

    def steps(self, params, buffers, group: dist.ProcessGroup, *, timeout, **_) -> outer.OuterSteps:
        """Its runtime part: the heavy-ball rule every ``every`` steps, a plain average every
        ``average_every`` steps in between (see :class:`Average`)."""
        return outer.OuterSteps(
            params,
            buffers,
            group,
            average_every=self.average_every or 0,
            rule=self.rule(params, group),
            sync_every=self.every,
            timeout=timeout,
        )

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {
            "global_avg_freq": self.average_every,
            "slowmo_freq": self.every,
            "slowmo_momentum": self.momentum,
            "slowmo_lr": self.lr,
            "slowmo_memory_efficient": self.memory_efficient,
            "slowmo_num_shards": self.num_shards,
        }


@dataclasses.dataclass(frozen=True)
class DiLoCo(Algorithm):
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

    def __post_init__(self) -> None:
        if not callable(self.optimizer):
            raise TypeError(
                f"{where(self, 'optimizer')}: optimizer must be a callable that builds a "
                "torch.optim.Optimizer from a list of tensors (e.g. `lambda params: "
                "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`), got "
                f"{type(self.optimizer).__name__} {self.optimizer!r}"
            )
        check_every(self, self.every)
        check_argument(
            self,
            "average",
            self.average,
            OuterAverage,
            "ByCollective(...), ByGossip(...), ByCompressedGossip(...) or another OuterAverage",
        )
        for name in ("fragments", "delay"):
            check_argument(self, name, getattr(self, name), int, "an int")
        check_argument(self, "alpha", self.alpha, (int, float), "a float")
        if self.fragments < 1 or self.fragments > self.every:
            raise ValueError(
                f"{where(self, 'fragments')}: must be in [1, every={self.every}] (a step per "
                f"fragment), got {self.fragments}"
            )
        if not 0 <= self.delay < self.every // self.fragments:
            raise ValueError(
                f"{where(self, 'delay')}: must be in [0, every // fragments = "
                f"{self.every // self.fragments}) (a fragment's average must end before the next "
                f"one starts), got {self.delay}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{where(self, 'alpha')}: must be in [0, 1], got {self.alpha}")
        if self.streamed and not self.average.streams:
            raise ValueError(
                f"{where(self, 'average')}: {self.average.whole_only}; got Streaming DiLoCo "
                f"(fragments={self.fragments}, delay={self.delay}, alpha={self.alpha})"
            )

    @property
    def streamed(self) -> bool:
        """Streaming DiLoCo: the outer step in fragments, or overlapped with training."""
        return (self.fragments, self.delay, self.alpha) != (1, 0, 0.0)

    def rule(self, params, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None):
        """Its runtime part over ``group``: the outer optimizer over ``theta_global``, or
        Streaming DiLoCo's fragments, each averaged as ``average`` says (over ``graph`` and
        ``mixing``, the inner mix's or ByGossip's own, where it gossips; waits bounded by
        ``timeout``)."""
        device = self.average.global_device
        if self.streamed:

            def averaging(buckets: ParameterBuckets) -> Averaging:
                return self.average.averaging(
                    buckets, group, streamed=True, graph=graph, mixing=mixing, timeout=timeout
                )

            return StreamingOuter(
                params,
                self.optimizer,
                device,
                averaging,
                sync_every=self.every,
                fragments=self.fragments,
                delay=self.delay,
                alpha=self.alpha,
                sizes=sizes,
            )
        return outer_rules.OuterOptimizer(params, ParameterBuckets(params), self.optimizer, device)

    def steps(
        self, params, buffers, group: dist.ProcessGroup, *, graph, mixing, timeout, sizes=None
    ) -> outer.OuterSteps:
        """Its runtime part: :meth:`rule` every ``every`` steps (or on the fragments' own
        schedule), its pseudo-gradients averaged as ``average`` says."""
        averaging = None
        if not self.streamed:
            averaging = self.average.averaging(
                ParameterBuckets(params),
                group,
                streamed=False,
                graph=graph,
                mixing=mixing,
                timeout=timeout,
            )
        return outer.OuterSteps(
            params,
            buffers,
            group,
            rule=self.rule(params, group, graph=graph, mixing=mixing, timeout=timeout, sizes=sizes),
            sync_every=self.every,
            averaging=averaging,
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
