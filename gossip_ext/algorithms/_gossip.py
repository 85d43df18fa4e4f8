"""What happens between optimizer steps: gossip rounds (SGP, D-PSGD, asynchronous push-sum), each
object building its engine (``mix``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gossip_ext.algorithms._base import (
    Algorithm,
    check_argument,
    check_dtype_argument,
    plain,
    where,
)
from gossip_ext.gossip import inner
from gossip_ext.graphs import GraphBase, NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import MixingBase, UniformMixing


def default_graph() -> GraphBase:
    """The graph a gossip object leaves unsaid: the 1-peer exponential graph."""
    return NPeerDynamicDirectedExponentialGraph()


class Gossip(Algorithm):
    """What every gossip object is: its runtime part is ``mix(named, link, graph)``, an
    ``inner.InnerMix``; ``push_sum`` says whether its rounds carry weights."""

    push_sum = True

    def check_combination(self, outer, membership, spelling) -> None:
        """Raises ValueError, in the user's ``spelling``, if this gossip cannot run beside the
        ``outer`` step or the ``membership`` given with it (None: none)."""


@dataclasses.dataclass(frozen=True)
class SGP(Gossip):
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
            raise ValueError(f"{where(self, 'synch_freq')} must be >= 0, got {self.synch_freq}")
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


@dataclasses.dataclass(frozen=True)
class AsyncSGP(Gossip):
    """Asynchronous push-sum: every worker gossips at its own pace, so a slow worker costs its
    share of the work, not every worker's time (docs/algorithms.md, "Asynchronous gossip").

    After each optimizer step a worker sends push-sum shares of its round (a counter of its
    own) to the graph's out-peers and absorbs every message that has arrived; it never waits for
    a peer's step. Messages move on threads of their own; push-sum's weights de-bias whatever
    mass arrived, whenever it arrived. Runs over gloo with CPU parameters.

    Args:
        graph (GraphBase, optional): who a round sends to (default:
            ``NPeerDynamicDirectedExponentialGraph(peers_per_itr=1)``); fixed for the job.
        staleness (int, optional): tau: absorb no message of a round beyond this worker's own +
            tau, and wait, before the next forward, for every message of rounds up to its own -
            tau that it is owed or owes. ``0`` with equal speeds is synchronous SGP; None never
            waits, so no worker ever waits for another (default: None).
        message_dtype (torch.dtype or str, optional): ``torch.bfloat16``, ``torch.float16``,
            ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn`` send the numerators compressed,
            their rounding kept in the sender (error feedback); the weight travels in float64.
            None: full precision (default).
        check_finite (bool): raise naming the senders when an absorb would take NaN or Inf;
            the parameters then keep the model before it (default: True).
    """

    graph: GraphBase | None = None
    staleness: int | None = None
    message_dtype: torch.dtype | str | None = None
    check_finite: bool = True

    def __post_init__(self) -> None:
        if self.graph is not None:
            check_argument(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
        if self.staleness is not None:
            check_argument(self, "staleness", self.staleness, int, "an int or None")
            if self.staleness < 0:
                raise ValueError(
                    f"{where(self, 'staleness')} must be >= 0 (rounds) or None, got "
                    f"{self.staleness}"
                )
        check_argument(self, "check_finite", self.check_finite, bool, "a bool")
        check_dtype_argument(self, "message_dtype", self.message_dtype)

    def check_combination(self, outer, membership, spelling) -> None:
        # Both would need every worker at the same step or round, which asynchronous workers
        # never share: an outer step's collective, an elastic epoch's fresh start.
        gossip = spelling.object(self, "gossip")
        if outer is not None:
            raise ValueError(
                f"{gossip} with outer={outer!r}: an outer step averages every worker at the "
                "same step, which asynchronous workers never share; use outer=None (the "
                "gossip alone averages), gossip=None with outer=AsyncDiLoCo(...), or SGP(...) "
                "with an outer step"
            )
        if membership is not None:
            raise ValueError(
                f"{gossip} with {spelling.object(membership, 'membership')}: an elastic job's "
                "epochs restart every worker at one round; use SGP(...) in elastic jobs"
            )

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        del described["check_finite"]  # each rank's own, as SGP's
        return dict(described, graph=plain(self.graph or default_graph()))

    def mix(self, named, link: inner.Link, graph: GraphBase) -> inner.InnerMix:
        """Its runtime part: an ``asynchronous.AsyncPushSum`` over ``named`` on ``graph``."""
        return inner.InnerMix.asynchronous(
            named,
            link,
            graph=graph,
            staleness=self.staleness,
            message_dtype=self.message_dtype,
            check_finite=self.check_finite,
        )

    def flat(self) -> dict[str, Any]:
        raise TypeError(
            "AsyncSGP has no flat keywords: earlier releases had no asynchronous gossip; "
            "give gossip=AsyncSGP(...)"
        )
