"""How an outer step averages, as configuration objects: ``OuterAverage`` (the base a user
subclasses), ``ByCollective`` (a collective over every worker: full precision, compressed or
sparse messages), ``ByGossip`` (one gossip round) and ``ByCompressedGossip`` (sparse gossip on
fixed neighbours). Each builds its runtime part, a ``gossip_ext.averagings.Averaging``."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.algorithms._base import (
    Algorithm,
    check_argument,
    check_dtype_argument,
    check_message_dtype,
    where,
)
from gossip_ext.averagings import AllReduceMean, AllReducePseudoGradientMean, Averaging, RoundMean
from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.averagings.compressed import CompressedMean
from gossip_ext.averagings.gossip_exchange import GossipMean
from gossip_ext.averagings.sparse import TopK
from gossip_ext.averagings.sparse_gossip import (
    DEFAULT_CONSENSUS_STEP,
    SparseGossip,
    fixed_neighbours,
)
from gossip_ext.gossip import inner
from gossip_ext.graphs import GraphBase, RingGraph
from gossip_ext.mixing import MixingBase, UniformMixing


def check_outer_message_format(name: str, value) -> None:
    """An outer step's mean over every worker may send what a gossip message may
    (``MESSAGE_DTYPES``), or sparse messages (a ``TopK``)."""
    if callable(getattr(value, "mean_over", None)):  # a message format with a mean of its own
        return
    try:
        check_message_dtype(name, value)
    except ValueError as error:
        raise ValueError(f"{error}; or sparse messages, TopK(density=..., bits=...)") from None


class OuterAverage(Algorithm):
    """How DiLoCo's outer step averages: the configuration of a way to average, which builds its
    runtime part (a ``gossip_ext.averagings.Averaging``). Subclass it, as a frozen dataclass, to
    average another way (see docs/design.md, "Extending gossip_ext")."""

    # Whether it can average a Streaming DiLoCo fragment; False: say why in ``whole_only``.
    streams = True
    whole_only = ""
    # Whether every worker receives the same mean (a collective's): then one process of a machine
    # may stand for the others (nprocs_per_node > 1) and SlowMo's state may be split over workers.
    # False where each worker mixes with a few peers and keeps a global model of its own.
    same_everywhere = True
    # Whether it can run in an elastic job, whose every epoch has other members.
    survives_epochs = True

    def averaging(
        self,
        buckets: ParameterBuckets,
        group: dist.ProcessGroup,
        *,
        streamed: bool,
        graph,
        mixing,
        timeout,
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

    @property
    def own_engine(self) -> bool:
        """Whether it sets up that engine itself (a graph, mixing or message of its own), which
        only a job without gossip can honour."""
        return False

    @property
    def sends_differences(self) -> bool:
        """Whether its messages are each worker's difference from global parameters (the
        pseudo-gradients; compressed and sparse messages keep their error feedback against
        them), which the outer rule must then keep; False: it averages the parameters."""
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
            :mod:`gossip_ext.averagings.sparse`).
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
                    f"{where(self, 'device')} must be a device, got {self.device!r} ({error})"
                ) from None

    def averaging(self, buckets, group, *, streamed, graph, mixing, timeout) -> Averaging:
        """The exact all-reduce (of the parameters; of a fragment's pseudo-gradients), or the
        exact mean of the pseudo-gradients in ``dtype``'s messages."""
        if self.dtype is None:
            exact = AllReducePseudoGradientMean if streamed else AllReduceMean
            return exact(group, timeout, buckets.layout())
        layout, device = buckets.layout(), buckets.device(0)
        own = getattr(self.dtype, "mean_over", None)  # a message format of its own (TopK)
        if own is not None:
            return own(layout, device, group, timeout)
        return CompressedMean(layout, device, self.dtype, group, timeout)

    @property
    def global_device(self):
        return self.device

    @property
    def sends_differences(self) -> bool:
        return self.dtype is not None

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

    same_everywhere = False

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
        if self.own_engine and not gossips:
            settings.update(graph=self.graph, mixing=self.mixing, message_dtype=self.message_dtype)
        return settings


@dataclasses.dataclass(frozen=True)
class ByCompressedGossip(OuterAverage):
    """An outer step's average by gossip in sparse messages, on a fixed graph (CHOCO-gossip; see
    :mod:`gossip_ext.averagings.sparse_gossip`): every worker keeps a public copy of its parameters
    that its neighbours hold too, sends them the ``message`` of its parameters' difference from it,
    moves its parameters ``consensus_step`` of the way towards its neighbourhood's copies, and steps
    its own ``theta_global`` with ``theta_global - z``. The mean over workers is kept, as under
    :class:`ByGossip`; each outer step sends one message to each neighbour, whatever the
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

    same_everywhere = False
    survives_epochs = False
    streams = False
    whole_only = (
        "ByCompressedGossip averages the whole model at each outer step (one public copy of it "
        "per worker); Streaming DiLoCo takes sparse messages through ByCollective(dtype=TopK(...))"
    )

    def __post_init__(self) -> None:
        check_argument(self, "message", self.message, TopK, "a gossip_ext.TopK")
        if self.message.feedback_decay != 1.0:
            raise ValueError(
                f"{where(self, 'message')}'s feedback_decay must be 1 (the public copy keeps what "
                f"a message leaves out), got {self.message.feedback_decay}"
            )
        check_argument(self, "consensus_step", self.consensus_step, (int, float), "a float")
        if not 0.0 < self.consensus_step <= 1.0:
            raise ValueError(
                f"{where(self, 'consensus_step')} must be in (0, 1], got {self.consensus_step}"
            )
        if self.graph is not None:
            check_argument(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
            if self.graph.is_dynamic:
                raise ValueError(
                    f"{where(self, 'graph')} must be fixed (the neighbours hold each worker's "
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
