"""The inner mix: the gossip rounds between optimizer steps (SGP, D-PSGD), or none.

GossipDataParallel holds one :class:`InnerMix`. It owns the compiled engine (the flat parameter
buffers, the push-sum state, the transport on the engine's own thread and stream), when rounds
start and are absorbed (``schedule.RoundSchedule``), and the running consensus estimate of
``log_every``. Without an engine (``base_algorithm="localsgd"`` with exact outer averaging, or a
process that does not gossip under ``nprocs_per_node > 1``) every call is a no-op and the push-sum
state reads as weight 1, round 0, nothing sent.

A round after every optimizer step is SGP (``every_step``); an outer step averaged by gossip asks
for its round itself (:meth:`run_round`), which is all the gossip that DiLoCo over gossip does.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.gossip import asynchronous, consensus, schedule, transport
from gossip_ext.gossip.engine import Engine, EngineWrapper, FlatEngine
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase

logger = logging.getLogger(__name__)


def with_peers(graph: GraphBase, peers_per_itr: int) -> GraphBase:
    """A copy of ``graph`` with another number of peers per round (the user's object is left
    as it was constructed)."""
    graph = copy.copy(graph)
    graph.peers_per_itr = peers_per_itr
    return graph


@dataclasses.dataclass(frozen=True)
class Link:
    """Where an engine's rounds travel and how they are reported, the same for whichever
    object builds the engine: the transport's kind (``transport.choose_transport``) over
    ``group`` from ``device``, each round given up after ``timeout``; ``rendezvous``, where an
    NCCL transport's ranks meet (``transport.make_transport``); ``log_every`` and ``verbose``,
    the wrapper's."""

    transport_kind: str
    group: dist.ProcessGroup
    device: torch.device
    timeout: timedelta
    rendezvous: tuple[dist.Store, str] | None = None
    # How the rounds' messages are sealed on the wire (an elastic epoch's, with a job secret).
    sealing: transport.Sealing | None = None
    log_every: int = 0
    verbose: bool = False
    # False: the tensors' storage is another owner's (FSDP2's shards), and the engine gossips
    # copies of them (:class:`MirroredEngine`).
    in_place: bool = True


# Note [A dropped engine lets its round finish]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A mix dropped with a round in flight (its wrapper deleted, or collected, with no sync_comms()
# after the last step) finishes the round and absorbs it, as the peers' do, instead of aborting
# it. An aborted send or receive leaves gloo's connection to that peer mid-message, and every
# later operation of the group over it, a barrier included, then waits forever. A round that
# fails (a peer gone) fails within the timeout and is logged: no one is left to raise it to. An
# elastic epoch's mix gives its round up on purpose (InnerMix.closed), and leaves this undone.
def _let_round_finish(engine: Engine) -> None:
    """Finishes ``engine``'s round in flight, if any (Note [A dropped engine lets its round
    finish])."""
    if not engine.in_flight:
        return
    try:
        engine.finish_round()
    except Exception as error:  # noqa: BLE001 - reported below; nothing is left to raise it to
        logger.info("gossip_ext: a dropped engine's last round did not finish: %s", error)


class InnerMix:
    """The gossip of one worker: ``engine`` (any :class:`~gossip_ext.gossip.engine.Engine`, or
    None) on ``graph``, scheduled by ``overlap`` and ``synch_freq``; a round after every step if
    ``every_step``. ``measured``: the engine, where it is the one that takes the consensus
    estimate of ``log_every``."""

    def __init__(
        self,
        engine: Engine | None,
        graph: GraphBase,
        *,
        overlap: bool,
        synch_freq: int,
        every_step: bool,
        verbose: bool = False,
        finish_on_drop: bool = False,
        measured: consensus.MeasuredEngine | None = None,
    ):
        self.engine = engine
        self.graph = graph
        self.every_step = every_step
        self.verbose = verbose
        self.rounds = schedule.RoundSchedule(engine, overlap=overlap, synch_freq=synch_freq)
        self._measured = measured
        # Note [A dropped engine lets its round finish]. Not at the interpreter's exit: a peer
        # that is gone by then would hold it up to the timeout.
        self._finish_on_drop: weakref.finalize | None = None
        if finish_on_drop and engine is not None:
            self._finish_on_drop = weakref.finalize(self, _let_round_finish, engine)
            self._finish_on_drop.atexit = False

    @classmethod
    def build(
        cls,
        named: Sequence[tuple[str, torch.Tensor]],
        link: Link,
        *,
        graph: GraphBase,
        mixing: MixingBase,
        push_sum: bool,
        overlap: bool,
        synch_freq: int,
        message_dtype: torch.dtype | str | None,
        check_finite: bool,
        every_step: bool,
    ) -> InnerMix:
        """An engine over the ``named`` tensors (the parameters, then any gossiped buffers),
        whose storage it takes over, its rounds travelling over ``link``; the rest as
        ``algorithms.SGP``'s arguments of the same names (built by ``SGP.mix`` and
        ``ByGossip.mix``)."""
        synchronous = not overlap and synch_freq == 0
        # Synchronous modes leave the parameters alone while a round is in flight, so the engine
        # may send them in place (no send buffer; Note [Sending in place]).
        options = _C.EngineOptions(
            graph.compiled_options(),
            mixing.compiled_options(),
            push_sum=push_sum,
            synchronous=synchronous,
            timeout=link.timeout,
            check_finite=check_finite,
            message_dtype=message_dtype,
        )
        carrier = transport.make_transport(
            link.transport_kind,
            link.group,
            link.device,
            link.timeout,
            link.rendezvous,
            link.sealing,
        )
        tensors = [t for _, t in named]
        engine: FlatEngine
        if link.in_place:
            engine = _C.GossipEngine(tensors, [n for n, _ in named], carrier, options)
        else:
            mirrors = [t.detach().clone() for t in tensors]
            engine = _C.GossipEngine(mirrors, [n for n, _ in named], carrier, options)
            engine = MirroredEngine(engine, tensors, mirrors, synchronous)
        measured = None
        if link.log_every > 0:
            engine = measured = consensus.MeasuredEngine(engine, graph, link.log_every)
        return cls(
            engine,
            graph,
            overlap=overlap,
            synch_freq=synch_freq,
            every_step=every_step,
            verbose=link.verbose,
            finish_on_drop=True,
            measured=measured,
        )

    @classmethod
    def asynchronous(
        cls,
        named: Sequence[tuple[str, torch.Tensor]],
        link: Link,
        *,
        graph: GraphBase,
        staleness: int | None,
        message_dtype: torch.dtype | str | None,
        check_finite: bool,
    ) -> InnerMix:
        """Asynchronous push-sum (``asynchronous.AsyncPushSum``) over the ``named`` tensors,
        worked on in place, a round after every step (built by ``algorithms.AsyncSGP.mix``).
        The synchronous schedule drives it: its start sends and absorbs, its finish absorbs
        what arrived and never waits."""
        if link.log_every > 0:
            raise ValueError(
                f"log_every={link.log_every}: the consensus estimate measures a synchronous "
                "round's absorb, which AsyncSGP has not; use log_every=0 with AsyncSGP"
            )
        engine = asynchronous.AsyncPushSum(
            [t for _, t in named],
            link.group,
            graph,
            staleness=staleness,
            message_dtype=message_dtype,
            check_finite=check_finite,
            timeout=link.timeout,
            store=transport.gossip_store(link.group, link.rendezvous, "async"),
            names=[name for name, _ in named],
        )
        return cls(
            engine,
            graph,
            overlap=False,
            synch_freq=0,
            every_step=True,
            verbose=link.verbose,
        )

    # ----------------------------------------------------------------------------- rounds

    def before_forward(self, training: bool) -> None:
        self.rounds.before_forward(training)

    def arm(self, step: int) -> None:
        """The ``step``-th optimizer step (1-based) was taken: the consensus estimate of
        ``log_every`` measures the next absorb on its schedule."""
        if self._measured is not None:
            self._measured.arm(step)

    def after_step(self) -> None:
        """No outer step replaces this step's round: start it, if this mix gossips every step."""
        if self.engine is not None and self.every_step:
            self.rounds.start()
            if self.verbose:
                logger.info("gossip round %d in flight", self.engine.round)

    def drain(self) -> None:
        """Absorbs the round in flight and any owed; raises a failed round's error."""
        self.rounds.drain()

    def settle(self) -> None:
        """Every worker together: absorbs the round in flight and waits until every message any
        worker sent has been absorbed; raises a failed round's error. Nothing is in flight
        afterwards."""
        self.rounds.drain()
        if self.engine is not None:
            self.engine.settle()

    def run_round(self) -> None:
        """One round from start to absorb, blocking (an outer step averaged by gossip)."""
        self.rounds.run_round()

    def restart(self) -> None:
        """After an exact average, every worker holds the consensus value with x = z: push-sum
        restarts from weights 1 (always 1 under lazy mixing)."""
        self.rounds.restart()

    def reset_weight(self) -> None:
        if self.engine is not None:
            # restore() needs an idle engine: the caller drained it.
            self.engine.restore(self.engine.round, 1.0)

    def closed(self) -> InnerMix:
        """This mix without its engine, which is dropped: a round in flight is given up, never
        absorbed (an elastic worker between epochs, or after it left). Given up first, through
        the transport: an NCCL transport would otherwise wait for the round, up to the timeout,
        before letting go of its communicator, and every member is dropping its own round."""
        if self._finish_on_drop is not None:
            self._finish_on_drop.detach()
        if self.engine is not None and self.engine.in_flight:
            self.engine.abandon("its elastic epoch ended")
        return InnerMix(None, self.graph, overlap=False, synch_freq=0, every_step=False)

    def abandon(self, why: str) -> None:
        """Fails the round in flight with a TimeoutError saying ``why`` (any thread may call it:
        an elastic worker's watch, when a peer's heartbeat stopped)."""
        if self.engine is not None:
            self.engine.abandon(why)

    def raise_if_failed(self) -> None:
        self.rounds.raise_if_failed()

    # ----------------------------------------------------------------------------- state

    @property
    def ps_weight(self) -> float:
        return 1.0 if self.engine is None else float(self.engine.ps_weight().item())

    @property
    def round(self) -> int:
        return 0 if self.engine is None else int(self.engine.round)

    @property
    def bytes_sent(self) -> int:
        return 0 if self.engine is None else int(self.engine.bytes_sent)

    def bytes_per_round(self, rank: int, world_size: int) -> float:
        """Bytes a round of this worker (``rank`` of ``world_size`` gossiping) sends: its message
        to each out-peer, the mean over the graph's first rounds (the built-in graphs send to as
        many peers in every round)."""
        if self.engine is None or world_size == 1:
            return 0.0
        rounds = range(2 * world_size)
        peers = sum(len(self.graph.out_peers(rank, world_size, r)) for r in rounds) / len(rounds)
        return peers * int(self.engine.message_bytes)

    @property
    def in_flight(self) -> bool:
        return self.engine is not None and bool(self.engine.in_flight)

    @property
    def lazy_mixing(self) -> bool:
        return self.engine is None or bool(self.engine.lazy_mixing)

    @property
    def estimate(self) -> float | None:
        return None if self._measured is None else self._measured.estimate

    def restore(self, round: int, weight: float) -> None:
        """Puts the push-sum state back to ``round`` and ``weight`` (a checkpoint's), after
        absorbing whatever is in flight."""
        if self.engine is not None:
            self.engine.finish_round()
            self.engine.restore(round, weight)

    def set_graph(self, graph: GraphBase) -> None:
        """Gossips on ``graph`` (the same graph with another ``peers_per_itr``) from the next
        round on."""
        if self.engine is not None:
            self.engine.set_peers_per_itr(graph.peers_per_itr)
            if self._measured is not None:
                self._measured.graph = graph
        self.graph = graph


# An engine over copies of tensors whose storage is another owner's: a module sharded by FSDP2
# (``gossip_ext.sharded.replicas``) gossips its local shards, which FSDP2's all-gather reads, so
# the engine cannot take their storage over as it does whole parameters (``Link.in_place``).
class MirroredEngine(EngineWrapper):
    """An engine (a ``_C.GossipEngine``) over ``mirrors``, copies of the ``shards`` whose storage
    is another owner's. Every other call is the engine's; the calls that start or absorb a
    round copy the shards in first, and a round absorbed whole is copied back. ``synchronous``:
    the engine sends the mirrors in place while a round is in flight, and the shards do not
    change then (the schedule absorbs before the next step), so only the start copies them in."""

    def __init__(
        self,
        engine: FlatEngine,
        shards: Sequence[torch.Tensor],
        mirrors: Sequence[torch.Tensor],
        synchronous: bool,
    ):
        super().__init__(engine)
        self._shards = list(shards)
        self._mirrors = list(mirrors)
        self._synchronous = synchronous

    @torch.no_grad()
    def _copy_in(self) -> None:
        torch._foreach_copy_(self._mirrors, self._shards)

    @torch.no_grad()
    def _copy_out(self) -> None:
        torch._foreach_copy_(self._shards, self._mirrors)

    def start_round(self) -> None:
        self._copy_in()  # the optimizer stepped the shards since the last round
        self.engine.start_round()

    def finish_round(self) -> None:
        if not self.engine.in_flight:
            self.engine.finish_round()  # raises a failed round's error, absorbs nothing
            return
        if not self._synchronous:
            self._copy_in()  # overlapped: absorbed into the parameters stepped since it started
        self.engine.finish_round()
        self._copy_out()

    def try_finish_round(self) -> bool:
        if not self.engine.in_flight:
            return bool(self.engine.try_finish_round())
        if not self._synchronous:
            self._copy_in()
        finished = bool(self.engine.try_finish_round())
        if finished:
            self._copy_out()
        return finished
