"""Asynchronous push-sum: each worker gossips at its own pace, and a slow worker costs its share.

Push-sum de-biases whatever mass has arrived, whenever it arrived (docs/algorithms.md,
"Asynchronous gossip"). Worker i holds its model z_i (the parameters) and a weight w_i. After
each optimizer step it runs its round t_i, a counter of its own:

1. *Send.* To each out-peer of round t_i (the graph's schedule, a pure function of the round) it
   posts the share (w_i z_i / (k+1), w_i / (k+1)), as z_i and the share's weight (Note
   [Scale-free shares]), and keeps one share: w_i <- w_i / (k+1). A lossy message's rounding
   stays in the kept numerator (``messages.Codec``).
2. *Absorb* every message that has arrived of sender rounds <= t_i + tau:
   z_i <- (w_i z_i + sum x_m) / (w_i + sum w_m),  w_i <- w_i + sum w_m.
   A peer that has not yet absorbed this worker's last messages is skipped in this round (its
   share kept), so a slow link or a stopped peer never makes a queue or a wait, nor collects
   this worker's weight (Note [Flow control by absorption]).
3. *Bound.* If ``staleness`` tau is set, wait until every message of rounds <= t_i - tau that
   this worker is owed has arrived, and every message it owes has been taken, absorbing as they
   come. tau = 0 with equal speeds is synchronous SGP; tau = None never waits.

A message that arrives late is absorbed late, never dropped, so the sums of x and of w over all
workers and all messages in flight never change: at quiescence (:meth:`AsyncPushSum.settle`) the
weights sum to the number of workers and the mean of the numerators is what the workers hold.
The parameters hold the de-biased z at every moment a user can see them.

Messages move on the compiled engine's threads (``mailbox``): a worker never waits for a peer's
step, only, where tau says so, for a message. A peer whose message does not come within the timeout,
or whose connection closes, raises a :class:`~gossip_ext.errors.PeerTimeoutError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.errors import NonFiniteError, PeerTimeoutError
from gossip_ext.gossip import mailbox, messages, transport
from gossip_ext.graphs import GraphBase

# Note [Flow control by absorption]: a share in flight is mass its sender no longer holds, and
# it carries the model of the round it left. A peer that receives but does not absorb (it started
# late, it paused) would collect a sender's weight round after round, halving it each time, until
# the next message to reach the sender, however stale (a late starter's untrained model, weight
# about 1), replaced its trained model: measured on 4 workers of 30 steps, 3 runs in 10 ended
# with a model no better than a constant. So a peer's
# mailbox holds at most HELD_LIMIT arrived messages before it receives another, and a sender
# skips a peer with MAX_BACKLOG sends not yet taken, keeping that share: at most two of a
# sender's messages wait on one peer, one held there and one on the link, which keeps a link busy
# while its receiver steps.
MAX_BACKLOG = 1
HELD_LIMIT = 1


@dataclasses.dataclass
class AsyncCounts:
    """What one worker's asynchronous gossip did: the shares its schedule named (``scheduled``),
    those held back by flow control (Note [Flow control by absorption]: the peer had not taken
    the last one), those sent, the messages absorbed, and their staleness: this worker's round
    when it absorbed a message less the sender's round in it (0: a round of the same count; a
    sender ahead of this worker gives a negative one)."""

    scheduled: int = 0
    held_back: int = 0
    sent: int = 0
    messages: int = 0
    staleness_sum: int = 0
    staleness_max: int | None = None  # None: nothing absorbed yet

    def absorbed(self, own_round: int, rounds: list[int]) -> None:
        self.messages += len(rounds)
        for round_ in rounds:
            lag = own_round - round_
            self.staleness_sum += lag
            self.staleness_max = lag if self.staleness_max is None else max(self.staleness_max, lag)

    def as_dict(self) -> dict[str, float | None]:
        return {
            "scheduled": self.scheduled,
            "held_back": self.held_back,
            "sent": self.sent,
            "messages": self.messages,
            "mean_staleness": self.staleness_sum / self.messages if self.messages else 0.0,
            "max_staleness": self.staleness_max,
        }


class AsyncPushSum:
    """One worker's asynchronous push-sum over ``tensors`` (its floating-point parameters, on
    one device, CPU or CUDA, worked on in place) with the ranks of ``group`` (gloo: Note
    [Asynchronous gossip on GPUs] in ``messages``) on ``graph``.

    The call names follow the compiled engine's, so the wrapper's schedule drives either:
    :meth:`start_round` after each optimizer step (send, absorb, bound), :meth:`finish_round`
    before a forward (absorb what arrived, never waiting). ``record``: keep every send and
    absorb in :attr:`history` (the tests replay it through a reference).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        graph: GraphBase,
        *,
        staleness: int | None,
        message_dtype=None,
        check_finite: bool = True,
        timeout: timedelta = timedelta(minutes=5),
        store: dist.Store | None = None,
        record: bool = False,
    ):
        self._tensors = list(tensors)
        self._group, self.graph = group, graph
        self.staleness, self.check_finite, self.timeout = staleness, check_finite, timeout
        self.rank, self.world_size = group.rank(), group.size()
        wide = any(t.dtype == torch.float64 for t in self._tensors)
        self._dtype = torch.float64 if wide else torch.float32
        self._device = transport.host_messages_device(self._tensors, "AsyncSGP", group)
        self._sizes = [t.numel() for t in self._tensors]
        self._codec = messages.Codec(sum(self._sizes), self._dtype, message_dtype, self._device)
        # The parameters as one flat copy, gathered once a round: sent, then mixed, then
        # written back. Parameters of a narrower dtype round on the way back, so their flat
        # copy is gathered again before a mix.
        self._flat = torch.empty(sum(self._sizes), dtype=self._dtype, device=self._device)
        self._flat_is_exact = all(t.dtype == self._dtype for t in self._tensors)
        self._weight = 1.0
        self._round = 0  # rounds sent
        self._bytes_sent = 0
        self._counts = AsyncCounts()
        self._failure: BaseException | None = None
        self.history: list[tuple] | None = [] if record else None
        # The generation tells this engine's messages from those of another asynchronous engine
        # on the same ranks, and of an earlier restore: they are never matched.
        self._channels = mailbox.Channels(
            group,
            transport.gossip_store(group, None, "async") if store is None else store,
            transport.next_instance(group, "async-tags") * 8,
            timeout,
        )
        self._outboxes = self._open_outboxes(graph.phone_book(self.rank, self.world_size))
        self._mailboxes = self._open_mailboxes([0] * self.world_size)
        self._finalizer = weakref.finalize(self, self._channels.leave, "the engine was dropped")
        # Every worker starts its rounds together, as it would after DDP's constructor: a worker
        # that began seconds before its peers (their construction slower, on a loaded machine:
        # measured 2.7 s apart on 2 cores) would train alone, its weight held by peers that have
        # not stepped, and meet their untrained models afterwards.
        dist.barrier(group=group)

    def _open_mailboxes(self, rounds: Sequence[int]) -> dict[int, _C.Mailbox]:
        return {
            peer: self._channels.mailbox(
                self.graph,
                peer,
                self._codec.nbytes,
                rounds[peer],
                held_limit=HELD_LIMIT if self.staleness is None else None,
            )
            for peer in mailbox.in_peers(self.graph, self.rank, self.world_size)
        }

    def _open_outboxes(self, peers: Sequence[int]) -> dict[int, _C.Outbox]:
        return {peer: self._channels.outbox(peer) for peer in dict.fromkeys(peers)}

    # ------------------------------------------------------------------------- the rounds

    def start_round(self) -> None:
        """Sends this worker's round, absorbs what arrived, and waits where the bound says."""
        self._guarded(self._send_absorb_bound)

    def finish_round(self) -> None:
        """Absorbs every message that has arrived within the bound; never waits."""
        self._guarded(self._absorb)

    def try_finish_round(self) -> bool:
        """Absorbs what arrived (:meth:`finish_round`). True: a round of this engine is whole
        once started, its shares posted and its arrivals absorbed, and a message that arrives
        later belongs to a later round, so no round is left to finish."""
        self.finish_round()
        return True

    def synchronize(self) -> None:
        """:meth:`finish_round`: the absorb writes the parameters before it returns."""
        self.finish_round()

    def settle(self) -> None:
        """Every worker together: waits until every message sent so far has been absorbed and
        every send confirmed. Afterwards nothing is in flight: the weights sum to the number of
        workers and the numerators to what they summed to at the start plus the steps taken."""
        self._guarded(self._settle)

    def _send_absorb_bound(self) -> None:
        round_ = self._round
        # A peer that left (finished its steps) is sent nothing more, and, with no staleness
        # bound, one that has not taken this worker's last messages yet (a slow link, a stopped
        # process) is skipped this round rather than waited for or queued for: its share stays
        # here. (A bound instead waits for it, tau rounds later.)
        scheduled = self.graph.out_peers(self.rank, self.world_size, round_)
        for peer in scheduled:
            # A send that failed (the peer died) is raised here, where its peer is scheduled:
            # its unconfirmed send stays in the backlog, so flow control would skip the peer
            # from now on and no later post would raise it.
            self._outboxes[peer].raise_if_failed()
        live = [peer for peer in scheduled if not self._outboxes[peer].ended]
        out_peers = [
            peer
            for peer in live
            if self.staleness is not None or self._outboxes[peer].backlog < MAX_BACKLOG
        ]
        self._counts.scheduled += len(scheduled)
        self._counts.held_back += len(live) - len(out_peers)
        flat = messages.flatten(self._tensors, self._dtype, self._flat)
        if out_peers:
            out_peers = self._send(round_, out_peers, flat)
        self._round = round_ + 1
        if self.history is not None:
            self.history.append(("send", round_, tuple(out_peers)))
        if self.staleness is not None:
            owed = round_ - self.staleness
            for outbox in self._outboxes.values():
                outbox.wait_until_past(owed)
            for inbox in self._mailboxes.values():
                inbox.wait_until_past(owed)
        # The parameters are ``flat`` still: nothing stepped meanwhile.
        self._absorb(flat if self._flat_is_exact else None)

    def _send(self, round_: int, out_peers: list[int], flat: torch.Tensor) -> list[int]:
        """Sends one share to each of ``out_peers`` and keeps one; returns the peers that were
        sent theirs (a peer that left meanwhile gets none: its share is kept too). ``flat``: the
        parameters, flattened; afterwards what they hold.

        Note [Scale-free shares]: a message carries the sender's de-biased z (not w z) and the
        weight of its share, and every update below mixes models with coefficients that are
        ratios of weights. A worker that hears from nobody for many rounds (its peers finished
        first) halves its weight each round; its weight may get as small as float64 allows,
        and no float32 value is ever scaled by it."""
        share = self._weight / (len(out_peers) + 1)
        # One pass sends the share and keeps its rounding here: with every peer sent one,
        # (w z - s share q) / share = z + s (z - q) (Note [Compressed messages] in
        # csrc/engine/gossip_engine.h), so ``flat`` is then the kept z.
        message = self._codec.encode(flat, share, round_, feedback=len(out_peers))
        if self.check_finite and not self._codec.values_finite(message, flat):
            self._raise_nonfinite([])
        sent = [peer for peer in out_peers if self._outboxes[peer].post(round_, message)]
        unsent = len(out_peers) - len(sent)
        self._counts.sent += len(sent)
        if unsent:
            # A share not sent (its peer left meanwhile) is kept: absorbed back as a message
            # of weight unsent * share, z <- (share z + unsent share q) / ((1 + unsent) share).
            self._codec.absorb(flat, message, 1.0 / unsent, (1 + unsent) / unsent)
        if unsent or not self._codec.lossless:
            messages.write_flat(self._tensors, flat)
        self._weight = share * (1 + unsent)
        self._bytes_sent += len(sent) * self._codec.nbytes
        return sent

    def _absorb(self, flat: torch.Tensor | None = None) -> None:
        """Mixes in every message that arrived within the bound; ``flat``: the parameters,
        already flattened."""
        through = None if self.staleness is None else self._round - 1 + self.staleness
        arrived = [
            (peer, r, buf) for peer, box in self._mailboxes.items() for r, buf in box.take(through)
        ]
        if not arrived:
            return
        mixed = messages.flatten(self._tensors, self._dtype, self._flat) if flat is None else flat
        nonfinite = None
        if self.check_finite:
            nonfinite = torch.zeros(1, dtype=torch.int32, device=self._device)
        weight = self._weight
        for _, _, message in arrived:
            share = messages.weight_of(message)
            if self.check_finite and not math.isfinite(share):
                self._raise_nonfinite(arrived)
            total = weight + share
            # z <- (w z + w_m z_m) / (w + w_m) as (alpha z + z_m) / new_weight, in ratios of
            # weights (Note [Scale-free shares]). A share below 1e-30 of the weight moves z
            # by less than any float's resolution (and its ratio would overflow float32).
            if share > 0.0 and share >= 1e-30 * weight:
                self._codec.absorb(mixed, message, weight / share, total / share, nonfinite)
            weight = total
        if nonfinite is not None and bool(nonfinite.item()):
            self._raise_nonfinite(arrived)
        messages.write_flat(self._tensors, mixed)
        self._weight = weight
        self._counts.absorbed(self._round - 1, [r for _, r, _ in arrived])
        if self.history is not None:
            self.history.append(("absorb", tuple((peer, r) for peer, r, _ in arrived)))

    def _settle(self) -> None:
        # What each worker sent each other one: a receiver waits for as many messages.
        sent = torch.zeros(self.world_size, dtype=torch.int64)
        for peer, outbox in self._outboxes.items():
            sent[peer] = outbox.sent
        counts = [torch.zeros_like(sent) for _ in range(self.world_size)]
        dist.all_gather(counts, sent, group=self._group)
        for peer, inbox in self._mailboxes.items():
            inbox.wait_for(int(counts[peer][self.rank]))
        for outbox in self._outboxes.values():
            outbox.wait_until_past(None)
        staleness, self.staleness = self.staleness, None  # take every round that arrived
        try:
            self._absorb()
        finally:
            self.staleness = staleness

    def _raise_nonfinite(self, arrived) -> None:
        senders = [
            peer
            for peer, _, message in arrived
            if not (
                math.isfinite(messages.weight_of(message))
                and bool(torch.isfinite(self._codec.read(message)).all())
            )
        ]
        whose = f"from peers {senders}" if senders else f"in rank {self.rank}'s own parameters"
        raise NonFiniteError(
            f"gossip_ext: rank {self.rank} found NaN or Inf in its asynchronous round "
            f"{self._round}, {whose}; push-sum would spread them, so no round goes on, and the "
            "parameters keep the model they hold",
            peers=senders,
            round=self._round,
            transport="process_group(gloo)",
        )

    # ------------------------------------------------------------------------- failures

    def _guarded(self, body) -> None:
        self.raise_if_failed()
        try:
            body()
        except (PeerTimeoutError, NonFiniteError) as error:
            self._failure = error
            raise

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)

    def abandon(self, why: str) -> None:
        """Leaves the gossip: says so to the peers (who then neither wait for this worker nor
        take its silence for a failure), and fails whatever waits here with a PeerTimeoutError
        saying ``why``. Any thread may call it; the wrapper does when the engine is dropped (the
        job's end, an elastic epoch's). Messages in flight to or from this worker are given up:
        their mass leaves with it, and every model stays de-biased."""
        self._finalizer.detach()
        self._channels.leave(why, self._round)

    def close(self) -> None:
        """Leaves the gossip (:meth:`abandon`) at the end of training."""
        self.abandon("it was closed")

    # ------------------------------------------------------------------------- state

    @property
    def in_flight(self) -> bool:
        """Always: a receive is posted for every in-peer's next message, which
        :meth:`finish_round` absorbs whenever it has arrived."""
        return True

    @property
    def round(self) -> int:
        return self._round

    def statistics(self) -> dict[str, float | None]:
        """What this worker's gossip did so far (:class:`AsyncCounts`), as plain values."""
        return self._counts.as_dict()

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    @property
    def message_bytes(self) -> int:
        """Bytes of a round's message to one out-peer (its header included)."""
        return self._codec.nbytes

    @property
    def lazy_mixing(self) -> bool:
        return False

    def ps_weight(self) -> torch.Tensor:
        return torch.tensor([self._weight], dtype=torch.float64)

    def kept_ps_weight(self) -> torch.Tensor:
        return self.ps_weight()

    def restore(self, round: int, ps_weight: float) -> None:  # noqa: A002 - as the engine's
        """Every worker together: puts this worker at ``round`` with ``ps_weight`` (a
        checkpoint's) and re-opens its mailboxes at its peers' restored rounds. Messages that
        were in flight are not in any checkpoint; the weights then sum to less than the number
        of workers, which push-sum's de-biasing absorbs."""
        self._channels.reopen()
        mine = torch.tensor([int(round)], dtype=torch.int64)
        rounds = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rounds, mine, group=self._group)
        self._round, self._weight = int(round), float(ps_weight)
        self._outboxes = self._open_outboxes(list(self._outboxes))
        self._mailboxes = self._open_mailboxes([int(r) for r in rounds])

    def set_peers_per_itr(self, peers_per_itr: int) -> None:
        raise ValueError(
            f"AsyncSGP: the peers per round are fixed for the job (got peers_per_itr="
            f"{peers_per_itr}): each worker's messages are numbered by its own rounds on one "
            "schedule, which every receiver walks; construct the graph with the peers wanted"
        )
