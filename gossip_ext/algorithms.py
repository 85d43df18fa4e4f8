"""What GossipDataParallel does, as objects: the inner mix, the outer step, the membership.

    model = GossipDataParallel(
        net,
        gossip=SGP(graph=RingGraph(), overlap=True, message_dtype="int8"),  # or PushPull(), None
        outer=DiLoCo(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                     every=64, average=Exact(dtype="int4"), fragments=4, delay=1),
        membership=Elastic("10.0.0.1:29600", min_workers=3),  # or None: a static job
    )

- ``gossip``: what happens between steps. :class:`SGP` (push-sum over a directed graph, the
  default), :class:`PushPull` (D-PSGD: symmetric pairs, no weights), or ``None``: no gossip, the
  workers train alone between outer steps (LocalSGD, DiLoCo).
- ``outer``: what happens every few steps. :class:`Average` (an exact average), :class:`SlowMo`
  (SlowMo's heavy ball on the average), :class:`DiLoCo` (an outer optimizer on the averaged
  pseudo-gradient, streamed in fragments when ``fragments > 1``), or ``None``.
  :class:`Exact` and :class:`ByGossip` say how an outer step averages.
- ``membership``: :class:`Elastic` (workers come and go; gossip_ext.membership) or ``None``.

Each object checks its own arguments when it is made, naming the argument and the value it got;
what no single object can check (a combination of them, the module, the process group) is checked
by the wrapper. Objects are frozen values: equal objects configure the same training, and every
rank must be given equal ones (the wrapper compares them across ranks).

The flat keywords of earlier releases, and SGP's and fairscale's through gossip_ext.compat, are
translated into these objects by :func:`gossip_ext.flat_keywords.from_flat`; ``to_flat`` is its
inverse, the configuration the runtime parts are built from.

An outer step builds its own runtime part (``rule(params, group, ...)``: SlowMo's heavy ball,
DiLoCo's outer optimizer or Streaming DiLoCo's fragments, none for a plain average), which
``outer.OuterSteps`` runs on its schedule.

A gossip object builds its runtime part too (``mix(named, link, graph)``: the engine and its
schedule, an ``inner.InnerMix``), and every object describes itself (``describe()``) for the
check that every rank was configured alike.

Adding an algorithm: a new frozen class here (an ``_algorithm_base.Algorithm``) with its checks,
its ``flat()`` (the settings it stands for) and its runtime part: for an outer step a ``rule``
(an ``outer_rules.OuterRule``); for a way to mix, its ``mix``. Translate its flat spelling, if
one exists, in ``flat_keywords``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext import inner, outer_rules
from gossip_ext._algorithm_base import (
    Algorithm,
    check_argument,
    check_dtype_argument,
    check_every,
    plain,
    where,
)
from gossip_ext.averaging import ParameterBuckets
from gossip_ext.epochs import parse_address
from gossip_ext.graphs import GraphBase, NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import MixingBase, UniformMixing
from gossip_ext.streaming import StreamingOuter


def default_graph() -> GraphBase:
    """The graph a gossip object leaves unsaid: the 1-peer exponential graph."""
    return NPeerDynamicDirectedExponentialGraph()


def engine_owner(gossip: SGP | None, outer: Any) -> SGP | ByGossip | None:
    """Which object builds the engine (its ``mix``): the gossip object, else the ByGossip of an
    outer step averaged by gossip, else none (no round ever runs)."""
    if gossip is not None:
        return gossip
    average = getattr(outer, "average", None)
    return average if isinstance(average, ByGossip) else None


# ----------------------------------------------------------------------------- the inner mix


@dataclasses.dataclass(frozen=True)
class SGP(Algorithm):
    """Stochastic Gradient Push (Assran et al., ICML 2019): after every optimizer step, a
    push-sum round over a rotating graph.

    Args:
        graph (GraphBase, optional): who sends to whom in each round (default:
            ``NPeerDynamicDirectedExponentialGraph(peers_per_itr=1)``).
        mixing (MixingBase, optional): the weights of a round (default: ``UniformMixing()``).
        overlap (bool): absorb each round one step later, so that it runs during the next
            forward, backward and step (default: False).
        synch_freq (int): bounded asynchrony: a forward absorbs a finished round without waiting
            and blocks only after ``synch_freq`` consecutive forwards found it unfinished; 0 is
            synchronous (default: 0).
        message_dtype (torch.dtype or str, optional): ``torch.bfloat16`` or ``torch.float16``
            send float32/float64 parameters in 16 bits; ``"int8"``, ``"int4"`` or
            ``torch.float8_e4m3fn`` send them block-quantized, a float32 scale per block of 128
            values: 0.258 (int8, float8) or 0.133 (int4) of float32's bytes. The parameters, the
            absorb and the push-sum weight stay in full precision and each message's rounding
            error stays in the sender's state (error feedback), so the mean over workers is
            conserved to float32 rounding. None: full precision (default).
        check_finite (bool): raise naming the sender when an absorbed message holds NaN or Inf,
            and naming this rank when its own parameters do, before push-sum spreads them. The
            check rides on the absorb's single pass; on a GPU it is read one step later, to
            avoid a host sync (default: True).
        start_in_forward (bool): under ``overlap=True``, every training forward absorbs the round
            in flight and starts the next, as the reference SGP's loop does; the script then
            calls neither ``transfer_params()`` nor ``register_optimizer()`` (default: False).
    """

    graph: GraphBase | None = None
    mixing: MixingBase | None = None
    overlap: bool = False
    synch_freq: int = 0
    message_dtype: torch.dtype | str | None = None
    check_finite: bool = True
    start_in_forward: bool = False

    push_sum = True  # what sets PushPull apart

    def __post_init__(self) -> None:
        if self.graph is not None:
            check_argument(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
        if self.mixing is not None:
            check_argument(self, "mixing", self.mixing, MixingBase, "a gossip_ext mixing")
        for name in ("overlap", "check_finite", "start_in_forward"):
            check_argument(self, name, getattr(self, name), bool, "a bool")
        check_argument(self, "synch_freq", self.synch_freq, int, "an int")
        if self.synch_freq < 0:
            raise ValueError(f"{where(self, 'synch_freq')}: must be >= 0, got {self.synch_freq}")
        if self.overlap and self.synch_freq > 0:
            raise ValueError(
                f"{type(self).__name__}: overlap=True and synch_freq={self.synch_freq} are two "
                "different schedules for absorbing rounds; choose one"
            )
        if self.start_in_forward and not self.overlap:
            raise ValueError(
                f"{type(self).__name__}: start_in_forward=True needs overlap=True: a "
                "synchronous round is absorbed by the same forward that would start it"
            )
        check_dtype_argument(self, "message_dtype", self.message_dtype)

    def describe(self) -> dict[str, Any]:
        # check_finite is each rank's own: a rank that checks raises, the others go on.
        described = super().describe()
        del described["check_finite"]
        return dict(
            described,
            graph=plain(self.graph or default_graph()),
            mixing=plain(self.mixing or UniformMixing()),
        )

    def mix(self, named, link: inner.Link, graph: GraphBase) -> inner.InnerMix:
        """Its runtime part: an engine over ``named`` (the parameters, then any gossiped
        buffers), its rounds on ``graph`` (this object's, or the elastic epoch's copy with
        another number of peers) over ``link``, one after every optimizer step."""
        return inner.InnerMix.build(
            named,
            link,
            graph=graph,
            mixing=self.mixing or UniformMixing(),
            push_sum=self.push_sum,
            overlap=self.overlap,
            synch_freq=self.synch_freq,
            message_dtype=self.message_dtype,
            check_finite=self.check_finite,
            every_step=True,
        )

    def flat(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "mixing": self.mixing,
            "push_sum": self.push_sum,
            "overlap": self.overlap,
            "synch_freq": self.synch_freq,
            "message_dtype": self.message_dtype,
            "check_finite": self.check_finite,
            "start_in_forward": self.start_in_forward,
            "base_algorithm": "sgp",
        }


@dataclasses.dataclass(frozen=True)
class PushPull(SGP):
    """D-PSGD: every round averages with peers that send back (a graph whose rounds pair ranks
    symmetrically: DynamicBipartiteExponentialGraph, DynamicBipartiteLinearGraph,
    HypercubeGraph, RingGraph(peers_per_itr=2)), with no push-sum weights. Same arguments as
    :class:`SGP`."""

    push_sum = False


# ----------------------------------------------------------------------------- outer steps


@dataclasses.dataclass(frozen=True)
class Exact(Algorithm):
    """An outer step's average over every worker, exactly.

    Args:
        dtype (torch.dtype or str, optional): DiLoCo's pseudo-gradients sent compressed
            (``torch.bfloat16``, ``torch.float16``, ``torch.float8_e4m3fn``, ``"int8"``,
            ``"int4"``) as a reduce-scatter and an all-gather of compressed shards, with error
            feedback on every worker and on every shard's owner: each outer step sends
            ``2 (n - 1) / n`` of the model at the message's width, every worker's global
            parameters stay the same bits, and no rounding accumulates. None: full precision,
            one all-reduce (default).
        device (torch.device or str, optional): where DiLoCo's global parameters and its outer
            optimizer's state live: ``'cpu'`` keeps them in host memory when the parameters are
            on a GPU (torchft's ``backup_device``). Default: the parameters' device.
    """

    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        check_dtype_argument(self, "dtype", self.dtype)
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


@dataclasses.dataclass(frozen=True)
class ByGossip(Algorithm):
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
        average (Exact or ByGossip): how the pseudo-gradients are averaged (default: ``Exact()``).
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
    average: Exact | ByGossip = dataclasses.field(default_factory=Exact)
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
            self, "average", self.average, (Exact, ByGossip), "Exact(...) or ByGossip(...)"
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

    def rule(self, params, group: dist.ProcessGroup, *, graph, mixing, timeout):
        """Its runtime part over ``group``: the outer optimizer over ``theta_global``, or
        Streaming DiLoCo's fragments; averaged by gossip over ``graph`` and ``mixing`` (the inner
        mix's, or ByGossip's own) with ``timeout``, where ``average`` is ByGossip."""
        exact = isinstance(self.average, Exact)
        device = self.average.device if exact else None
        if (self.fragments, self.delay, self.alpha) != (1, 0, 0.0):
            return StreamingOuter(
                params,
                self.optimizer,
                device,
                self.average.dtype if exact else None,
                group,
                sync_every=self.every,
                fragments=self.fragments,
                delay=self.delay,
                alpha=self.alpha,
                gossip=None if exact else (graph, mixing, timeout),
            )
        return outer_rules.OuterOptimizer(params, ParameterBuckets(params), self.optimizer, device)

    def flat(self, gossips: bool) -> dict[str, Any]:
        settings = {
            "outer_optimizer": self.optimizer,
            "sync_every": self.every,
            "fragments": self.fragments,
            "fragment_delay": self.delay,
            "fragment_alpha": self.alpha,
        }
        if isinstance(self.average, ByGossip):
            settings["outer_average"] = "gossip"
        else:
            settings.update(outer_dtype=self.average.dtype, outer_device=self.average.device)
        return settings


# ----------------------------------------------------------------------------- membership


@dataclasses.dataclass(frozen=True)
class Elastic(Algorithm):
    """An elastic job (:mod:`gossip_ext.elastic`): workers join and leave through the membership
    service at ``address`` (``"HOST:PORT"``, ``python -m gossip_ext.membership --port PORT``).
    The first epoch forms once ``min_workers`` workers registered, and the job stops with a
    TimeoutError naming who is gone when fewer are left (default: 1)."""

    address: str
    min_workers: int = 1

    def __post_init__(self) -> None:
        check_argument(self, "address", self.address, str, "a str 'HOST:PORT'")
        parse_address(self.address)
        check_argument(self, "min_workers", self.min_workers, int, "an int")
        if self.min_workers < 1:
            raise ValueError(f"{where(self, 'min_workers')}: must be >= 1, got {self.min_workers}")
