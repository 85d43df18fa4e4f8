"""Asynchronous push-sum: each worker gossips at its own pace, and a slow worker costs its share.

The algorithm is the compiled engine's ``_C.AsyncPushSum`` (csrc/engine/async_push_sum.h, with
Note [Flow control by absorption] and Note [Scale-free shares]; docs/algorithms.md,
"Asynchronous gossip"): after each optimizer step a worker sends its round's shares, waits where
a staleness bound says, and absorbs every message that has arrived, on the engine's flat
buffers with its fused kernels; its messages move on the engine's channels (``mailbox``), never
on a Python thread. A message that arrives late is absorbed late, never dropped, so at
quiescence (:meth:`AsyncPushSum.settle`) the weights sum to the number of workers and the
weighted mean of the models is the mean of what the workers held. A peer whose message does not
come within the timeout, or whose connection closes, raises a
:class:`~gossip_ext.errors.PeerTimeoutError` naming it, its round and how it was seen.

This module adds the calls every worker makes together, which need the process group: the start
(a barrier), :meth:`AsyncPushSum.settle` and :meth:`AsyncPushSum.restore` (the peers' counts).
The messages themselves move on a gloo group of the engine's own (``groups.messages_group``), so
the user's collectives on ``group`` never share a connection with a receive posted ahead.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.gossip import groups, transport
from gossip_ext.graphs import GraphBase


class AsyncPushSum:
    """One worker's asynchronous push-sum over ``tensors`` (its floating-point parameters, on
    one device, CPU or CUDA; flattened into the engine's buffers as the synchronous engine's
    are) with the ranks of ``group`` (gloo: Note [Asynchronous gossip on GPUs] in ``messages``)
    on ``graph``; ``names`` name them in errors.

    The calls are the engine interface's (``gossip.engine.Engine``), so the wrapper's schedule
    drives it as it drives the synchronous engine: :meth:`start_round` after each optimizer step
    (send, bound, absorb), :meth:`finish_round` before a forward (absorb what arrived, never
    waiting). ``staleness`` tau: absorb sender rounds <= t + tau and wait for those <= t - tau
    (None: never wait). ``record``: keep every send and absorb in :attr:`history` (the tests
    replay it through a reference)."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        graph: GraphBase,
        *,
        staleness: int | None,
        message_dtype: torch.dtype | str | None = None,
        check_finite: bool = True,
        timeout: timedelta = timedelta(minutes=5),
        store: dist.Store | None = None,
        record: bool = False,
        names: Sequence[str] | None = None,
    ):
        tensors = list(tensors)
        self.graph, self.staleness, self.timeout = graph, staleness, timeout
        self.rank, self.world_size = group.rank(), group.size()
        transport.host_messages_device(tensors, "AsyncSGP", group)
        instance = transport.next_instance(group, "async-tags")
        options = _C.AsyncOptions(
            graph.compiled_options(),
            staleness,
            check_finite,
            timeout,
            message_dtype,
            # Tells this engine's messages from those of another asynchronous engine on the
            # same ranks, and of an earlier restore: they are never matched.
            instance * 8,
            record,
        )
        store = transport.gossip_store(group, None, "async") if store is None else store
        departures = _C.Departures(store, self.rank)
        self._group = group
        self._messages = groups.messages_group(
            group, store, timeout, transport.engine_group_name(group, "async", instance)
        )
        # Every send and absorb of the engine's, with whatever the caller adds between them
        # (the tests add their steps), in order.
        self.history: list[tuple] | None = [] if record else None
        self._recorded = 0  # of the engine's events, those copied into history
        self._engine = _C.AsyncPushSum(
            tensors,
            list(names) if names is not None else [f"parameter {i}" for i in range(len(tensors))],
            _C.ProcessGroupTransport(self._messages),
            departures,
            options,
        )
        # The finalizer holds the compiled engine and its group, not this object: a dropped
        # engine is collected, and the finalizer (or the interpreter's exit, whichever comes
        # first) lets its channels' threads go, then their group.
        self._finalizer = weakref.finalize(
            self, _leave, self._engine, self._messages, "the engine was dropped"
        )
        # Every worker starts its rounds together, as it would after DDP's constructor: a worker
        # that began seconds before its peers (their construction slower, on a loaded machine:
        # measured 2.7 s apart on 2 cores) would train alone, its weight held by peers that have
        # not stepped, and meet their untrained models afterwards.
        dist.barrier(group=group)

    # ------------------------------------------------------------------------- the rounds

    def start_round(self) -> None:
        """Sends this worker's round, waits where the bound says, and absorbs what arrived."""
        try:
            self._engine.start_round()
        finally:
            self._record_events()

    def finish_round(self) -> None:
        """Absorbs every message that has arrived within the bound; never waits."""
        try:
            self._engine.finish_round()
        finally:
            self._record_events()

    def _record_events(self) -> None:
        if self.history is not None:
            events = self._engine.history(self._recorded)
            self._recorded += len(events)
            self.history.extend(events)

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
        self._engine.raise_if_failed()
        sent = torch.tensor(self._engine.sent_counts(), dtype=torch.int64)
        counts = [torch.zeros_like(sent) for _ in range(self.world_size)]
        dist.all_gather(counts, sent, group=self._group)
        try:
            self._engine.settle([int(c[self.rank]) for c in counts])
        finally:
            self._record_events()

    def raise_if_failed(self) -> None:
        self._engine.raise_if_failed()

    def abandon(self, why: str) -> None:
        """Leaves the gossip: says so to the peers (who then neither wait for this worker nor
        take its silence for a failure), and fails whatever waits here with a PeerTimeoutError
        saying ``why``. Any thread may call it; the wrapper does when the engine is dropped (the
        job's end, an elastic epoch's). Messages in flight to or from this worker are given up:
        their mass leaves with it, and every model stays de-biased."""
        self._finalizer.detach()
        _leave(self._engine, self._messages, why)

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
        return self._engine.round

    def statistics(self) -> dict[str, float | None]:
        """What this worker's gossip did so far: the shares its schedule named
        (``scheduled``), those held back by flow control (``held_back``: the peer had not taken
        the last one), those sent, the messages absorbed, and their staleness (this worker's
        round when it absorbed a message less the sender's round in it)."""
        return self._engine.statistics()

    @property
    def bytes_sent(self) -> int:
        return self._engine.bytes_sent

    @property
    def message_bytes(self) -> int:
        """Bytes of a round's message to one out-peer (its header included)."""
        return self._engine.message_bytes

    @property
    def lazy_mixing(self) -> bool:
        return False

    def flat_buffers(self) -> list[torch.Tensor]:
        """The flat buffers the parameters are views of, one per dtype."""
        return self._engine.flat_buffers()

    def ps_weight(self) -> torch.Tensor:
        return torch.tensor([self._engine.weight], dtype=torch.float64)

    def kept_ps_weight(self) -> torch.Tensor:
        return self.ps_weight()

    def restore(self, round: int, ps_weight: float) -> None:  # noqa: A002 - as the engine's
        """Every worker together: puts this worker at ``round`` with ``ps_weight`` (a
        checkpoint's) and re-opens its channels at its peers' restored rounds. Messages that
        were in flight are not in any checkpoint; the weights then sum to less than the number
        of workers, which push-sum's de-biasing absorbs."""
        mine = torch.tensor([int(round)], dtype=torch.int64)
        rounds = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rounds, mine, group=self._group)
        self._engine.restore(int(round), float(ps_weight), [int(r) for r in rounds])

    def set_peers_per_itr(self, peers_per_itr: int) -> None:
        raise ValueError(
            f"AsyncSGP: the peers per round are fixed for the job (got peers_per_itr="
            f"{peers_per_itr}): each worker's messages are numbered by its own rounds on one "
            "schedule, which every receiver walks; construct the graph with the peers wanted"
        )


def _leave(engine: _C.AsyncPushSum, messages: dist.ProcessGroup, why: str) -> None:
    """Ends ``engine``'s gossip (its threads joined), then the group its messages moved on."""
    engine.abandon(why)
    groups.release(messages)
