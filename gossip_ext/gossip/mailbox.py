"""Who sends to whom in asynchronous gossip, and the channels its messages move on.

The channels are the compiled engine's (csrc/transport/mailbox/mailbox.h): a ``_C.Mailbox`` per
in-peer keeps a receive posted for that peer's next message and queues what arrives, and a
``_C.Outbox`` per out-peer confirms the sends in order and lets their buffers go, each on a thread
of its own that never takes the interpreter's lock, over the transport's asynchronous messages
(Note [Asynchronous messages] in csrc/transport/transport.h), on a gloo group of their own
(``groups.messages_group``). Messages then move at the network's pace whatever the pace of either
worker's steps, and a receive that fails (the peer's connection closed) is kept as a
:class:`~gossip_ext.errors.PeerTimeoutError` naming the peer, its round and how it was seen,
raised to the training thread at its next call. A peer silent for the timeout while this worker
steps is named by :meth:`Channels.check_silence`, made at each step (Note [Silence is measured
while this worker trains] in csrc/transport/mailbox/mailbox.h): a pause of every worker's (the
user's barrier, an evaluation) is no failure. A peer that said it left (``_C.Departures``, keys
in a store of the group's) ends its channels without an error.

This module says which rounds a sender's schedule names a receiver in (a pure function of the
graph and the round), opens one engine's channels (:class:`Channels`), and learns when a peer's
next message is due (:func:`next_due`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.gossip import groups


class Schedule(Protocol):
    """Who a worker sends to in each round: a gossip graph (``graphs.GraphBase``), or
    :class:`Everyone`."""

    def phone_book(self, rank: int, world_size: int, /) -> list[int]: ...

    def out_peers(self, rank: int, world_size: int, round_: int, /) -> list[int]: ...


def sends_in_round(graph: Schedule, sender: int, receiver: int, world_size: int) -> list[bool]:
    """Whether ``sender`` sends to ``receiver`` in each round of one period of its schedule (a
    schedule repeats after as many rounds as the sender has peers)."""
    period = max(1, len(graph.phone_book(sender, world_size)))
    return [receiver in graph.out_peers(sender, world_size, round_) for round_ in range(period)]


class Everyone:
    """The schedule of a message every worker sends to every other one in every round (an
    asynchronous outer step's pseudo-gradient), as a graph's ``phone_book``/``out_peers``."""

    def phone_book(self, rank: int, world_size: int) -> list[int]:
        return [peer for peer in range(world_size) if peer != rank]

    def out_peers(self, rank: int, world_size: int, round_: int) -> list[int]:
        return self.phone_book(rank, world_size)


class Channels:
    """One asynchronous engine's channels with its peers on ``group``'s ranks: it opens them,
    on a group of its own (``groups.messages_group``, named ``name``), and :meth:`leave` ends them
    all. ``store``: where the workers say they leave, and meet to build that group;
    ``generation``: tells this engine's messages from another's on the same ranks
    (``_C.mailbox_tag``), and grows by one at each :meth:`reopen`.

    An engine's finalizer holds its channels, never the engine, so a dropped engine is collected
    and the finalizer (or the interpreter's exit, whichever comes first) lets the threads go."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        store: dist.Store,
        generation: int,
        timeout: timedelta,
        name: str,
    ):
        self.rank, self.world_size = group.rank(), group.size()
        self.generation, self.timeout = generation, timeout
        self._group = groups.messages_group(group, store, timeout, name)
        self._transport = _C.ProcessGroupTransport(self._group)
        self._departures = _C.Departures(store, self.rank)
        self._open: list[_C.PeerChannel] = []

    def mailbox(
        self,
        schedule: Schedule,
        peer: int,
        nbytes: int,
        start: int = 0,
        held_limit: int | None = None,
    ) -> _C.Mailbox:
        """The mailbox of ``peer``'s messages of ``nbytes`` each, from its round ``start`` on."""
        box = _C.Mailbox(
            self._transport,
            self._departures,
            peer,
            self.generation,
            self.timeout,
            nbytes,
            sends_in_round(schedule, peer, self.rank, self.world_size),
            start,
            held_limit,
        )
        self._open.append(box)
        return box

    def outbox(self, peer: int) -> _C.Outbox:
        """The outbox of this worker's messages to ``peer``."""
        box = _C.Outbox(self._transport, self._departures, peer, self.generation, self.timeout)
        self._open.append(box)
        return box

    def check_silence(self) -> None:
        """At each of this worker's steps: raises the PeerTimeoutError of a channel that failed,
        or of a peer silent for the timeout while this worker stepped."""
        for box in self._open:
            box.check_silence()

    def reopen(self) -> None:
        """Closes every channel (what was in flight is given up) and starts a new generation."""
        for box in self._open:
            box.close()
        self._open.clear()
        self.generation += 1

    def leave(self, why: str, round_: int | None = None) -> None:
        """Says that this worker leaves, then fails and ends every channel with a
        PeerTimeoutError saying ``why`` (an engine's ``abandon``, or its finalizer)."""
        self._departures.announce(self.rank)
        for box in self._open:
            box.fail(why, round_)  # joins its thread: nothing waits on the group after this
        groups.release(self._group)


# ----------------------------------------------------------------------------- deadlines
# When a peer's next message is due, learned from when its latest arrived (median interval plus a
# few median absolute deviations: robust to the odd stall). A message later than that counts at
# the next step, never lost: only the wrapper's ``timeout`` of silence names a peer as failed.

MIN_INTERVALS = 3  # intervals to learn from before any deadline is given
DEVIATIONS = 3.0  # median absolute deviations past the median interval
FLOOR_S = 0.002  # the least slack, so that a perfectly regular peer is not cut off by jitter


def next_due(arrivals: Sequence[float], deviations: float = DEVIATIONS) -> float | None:
    """When the message after ``arrivals`` (times, oldest first) is due; None until
    MIN_INTERVALS intervals were seen."""
    intervals = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    if len(intervals) < MIN_INTERVALS:
        return None
    median = statistics.median(intervals)
    spread = statistics.median(abs(i - median) for i in intervals)
    return arrivals[-1] + median + max(deviations * spread, FLOOR_S)
