"""The engine's interface: what runs one worker's gossip rounds, as the round schedule
(``schedule.RoundSchedule``), the inner mix (``inner.InnerMix``) and the checkpoint ask it.

Four objects implement it: the compiled lockstep engine (``_C.GossipEngine``, typed in
``gossip_ext/_C.pyi``), asynchronous push-sum (``asynchronous.AsyncPushSum``), and two that wrap
another engine and forward what they do not change (:class:`EngineWrapper`): the engine over
copies of another owner's tensors (``inner.MirroredEngine``) and the one that measures the
consensus distance as it absorbs (``consensus.MeasuredEngine``). A type checker holds each to
:class:`Engine` (the typing stage of ``tools/run_tests.sh``).

The contract, whatever the schedule:

- *A round* is ``start_round`` (send this worker's shares, never blocking for the network) and
  then ``finish_round`` (absorb what the round brought). Between them the parameters hold the
  model they held at the start (Note [The parameters are the model], csrc/engine/gossip_engine.h).
- *A failure* (a peer that died or stalled, a non-finite message) is raised by the call that meets
  it, as a typed error naming the peers and the round, and again by every later call
  (``raise_if_failed``); a failed round changed nothing.
- *At rest* (``settle``, every worker together): nothing this worker sent or is owed is on its way,
  so the push-sum weights over the workers sum to their number.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Engine(Protocol):
    """One worker's gossip rounds over its flat parameters (see the module docstring)."""

    # ------------------------------------------------------------------ the rounds

    def start_round(self) -> object:
        """Starts this worker's next round: sends its shares, and never waits for a peer's step
        (an asynchronous engine also absorbs what arrived, and waits where its bound says). What
        it returns is the implementation's own (the compiled engine's round ``Work``); the
        schedule does not use it."""

    def finish_round(self) -> None:
        """Absorbs the round in flight, waiting for its messages within the timeout (an
        asynchronous engine absorbs what arrived and never waits)."""

    def try_finish_round(self) -> bool:
        """Absorbs the round in flight if every message has arrived, never waiting; whether no
        round remains in flight afterwards."""

    def synchronize(self) -> None:
        """:meth:`finish_round`, then waits until the parameters hold the absorbed model (a CUDA
        engine's absorb runs on its own stream)."""

    def settle(self) -> None:
        """Every worker together: waits until nothing this worker sent or is owed is in flight,
        and absorbs it. A lockstep engine's finished round leaves nothing in flight."""

    def raise_if_failed(self) -> None:
        """Raises the error of a round that failed, if one did (the same error every time)."""

    def abandon(self, why: str) -> None:
        """Fails the round in flight, from any thread, with an error saying ``why`` (an elastic
        worker's watch saw a peer's heartbeat stop; the engine is being dropped)."""

    # ------------------------------------------------------------------ the push-sum state

    @property
    def in_flight(self) -> bool:
        """Whether messages of this worker's gossip may still be on their way to be absorbed by
        :meth:`finish_round`: a lockstep round started and not absorbed, or, asynchronously,
        always (a receive is posted for every in-peer's next message)."""

    @property
    def round(self) -> int:
        """Rounds this worker has started."""

    @property
    def lazy_mixing(self) -> bool:
        """Whether the push-sum weight stays 1 and never travels (a regular graph, uniform mixing,
        lockstep rounds)."""

    @property
    def bytes_sent(self) -> int:
        """Bytes of gossip messages sent so far."""

    @property
    def message_bytes(self) -> int:
        """Bytes of one round's message to one out-peer."""

    def ps_weight(self) -> torch.Tensor:
        """The push-sum weight of the model the parameters hold, as a one-element tensor."""

    def kept_ps_weight(self) -> torch.Tensor:
        """The weight this worker kept of the round in flight (its share of its own mass)."""

    def restore(self, round: int, ps_weight: float) -> None:  # noqa: A002 - the binding's name
        """Puts the engine, idle, at ``round`` with weight ``ps_weight`` (a checkpoint's)."""

    def set_peers_per_itr(self, peers_per_itr: int) -> None:
        """Gossips with ``peers_per_itr`` out-peers per round from the next round on; raises
        ValueError where the engine's schedule cannot change."""


class FlatEngine(Engine, Protocol):
    """An engine whose parameters are flat buffers it can show: what the consensus estimate
    (``consensus.MeasuredEngine``) reads before and after an absorb."""

    @property
    def rank(self) -> int:
        """This worker's rank among the gossiping workers."""

    @property
    def world_size(self) -> int:
        """The number of gossiping workers."""

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers the parameters are views of, one per (device, dtype)."""


class EngineWrapper:
    """An engine over ``engine`` that forwards every call of :class:`FlatEngine`; a subclass
    overrides the calls it changes (``inner.MirroredEngine`` copies around a round's start and
    absorb, ``consensus.MeasuredEngine`` measures the absorb)."""

    def __init__(self, engine: FlatEngine):
        self.engine = engine

    def start_round(self) -> None:
        self.engine.start_round()

    def finish_round(self) -> None:
        self.engine.finish_round()

    def try_finish_round(self) -> bool:
        return self.engine.try_finish_round()

    def synchronize(self) -> None:
        self.engine.synchronize()

    def settle(self) -> None:
        self.engine.settle()

    def raise_if_failed(self) -> None:
        self.engine.raise_if_failed()

    def abandon(self, why: str) -> None:
        self.engine.abandon(why)

    @property
    def in_flight(self) -> bool:
        return self.engine.in_flight

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def lazy_mixing(self) -> bool:
        return self.engine.lazy_mixing

    @property
    def bytes_sent(self) -> int:
        return self.engine.bytes_sent

    @property
    def message_bytes(self) -> int:
        return self.engine.message_bytes

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def flat_buffers(self) -> list[torch.Tensor]:
        return self.engine.flat_buffers()

    def ps_weight(self) -> torch.Tensor:
        return self.engine.ps_weight()

    def kept_ps_weight(self) -> torch.Tensor:
        return self.engine.kept_ps_weight()

    def restore(self, round: int, ps_weight: float) -> None:  # noqa: A002 - the binding's name
        self.engine.restore(round, ps_weight)

    def set_peers_per_itr(self, peers_per_itr: int) -> None:
        self.engine.set_peers_per_itr(peers_per_itr)
