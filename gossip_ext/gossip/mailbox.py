"""The threads that let asynchronous gossip (push-sum's, ``asynchronous.AsyncPushSum``, and outer
steps', ``outer.asynchronous``) never wait for a peer: a :class:`Mailbox` per
in-peer keeps a receive posted for that peer's next message and queues what arrives (for push-sum,
at most one message not yet absorbed: Note [Flow control by absorption]), and an
:class:`Outbox` per out-peer confirms the sends in order and lets their buffers go.

Gloo moves a point-to-point message only once its receiver has posted the receive, and it
completes a send or a receive only inside ``wait()``; a training thread that posts and polls
would hold every sender up until its next step. These threads post and wait instead, so messages
move at the network's pace whatever the pace of either worker's steps.

A peer's messages to this worker are numbered in the order it sent them (``tag``), and each
carries the sender's round; ``next_round`` walks the rounds in which the sender's schedule (a
pure function of the graph and the round) names this worker, which is the round a receiver waits
for when a staleness bound says it must. A receive that fails
(the peer's connection closed) or waits longer than the timeout (the peer stopped) is kept as a
:class:`~gossip_ext.errors.PeerTimeoutError` naming the peer and its round, raised to the
training thread at its next call.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol

import torch

from gossip_ext._torch_check import _C
from gossip_ext.errors import PeerTimeoutError
from gossip_ext.gossip import messages, transport

ARRIVALS_KEPT = 16  # arrival times a mailbox keeps, for a deadline learned from them


def tag(generation: int, sequence: int) -> int:
    """The gloo tag of the ``sequence``-th message from one worker to another in the
    ``generation`` of their gossip (an engine's instance on these ranks, eight restores apart:
    ``transport.next_instance``). Messages between two workers are numbered, not
    named by round: a sender may skip a round's message to a peer (``AsyncPushSum``), and a
    receive posted for a round that never comes would hold every later message. The round
    travels in the message (``messages.round_of``). The tag is in asynchronous messages' range
    of the compiled engine's tag registry (``transport.mailbox_tag``)."""
    return transport.mailbox_tag(generation, sequence)


class Schedule(Protocol):
    """Who a worker sends to in each round: a gossip graph (``graphs.GraphBase``), or
    :class:`Everyone`."""

    def phone_book(self, rank: int, world_size: int, /) -> list[int]: ...

    def out_peers(self, rank: int, world_size: int, round_: int, /) -> list[int]: ...


def next_round(graph: Schedule, sender: int, receiver: int, world_size: int, start: int):
    """The first round >= ``start`` in which ``sender`` sends to ``receiver``; None if never."""
    period = max(1, len(graph.phone_book(sender, world_size)))
    for round_ in range(start, start + period):
        if receiver in graph.out_peers(sender, world_size, round_):
            return round_
    return None


def in_peers(graph: Schedule, rank: int, world_size: int) -> list[int]:
    """Every rank that sends to ``rank`` in some round."""
    return [
        peer
        for peer in range(world_size)
        if peer != rank and next_round(graph, peer, rank, world_size, 0) is not None
    ]


class Everyone:
    """The schedule of a message every worker sends to every other one in every round (an
    asynchronous outer step's pseudo-gradient), as a graph's ``phone_book``/``out_peers``."""

    def phone_book(self, rank: int, world_size: int) -> list[int]:
        return [peer for peer in range(world_size) if peer != rank]

    def out_peers(self, rank: int, world_size: int, round_: int) -> list[int]:
        return self.phone_book(rank, world_size)


class Departures:
    """Where the workers of one asynchronous gossip say they are leaving: keys in ``store``
    (under a prefix of the group's). A worker says so before it lets its connections go, and
    when a peer's failure ends its part (``rank``: this worker), so that a peer that sees a
    connection close can tell a worker that finished, or that gave up on a third, from one that
    died.

    Note [A failure closes more than its pair]: gloo closes a worker's connections when one of
    its operations times out, so the peers of a worker that timed out on a stopped peer see
    their connections to it close, not the stopped one's silence. The worker that timed out says
    here that it leaves, and a peer that sees a connection close looks for that word for a
    moment (``LEAVE_GRACE_S``) before it names the peer as failed: each names the one that
    stopped."""

    LEAVE_GRACE_S = 1.0

    def __init__(self, store, rank: int | None = None):
        self._store, self.rank = store, rank

    def announce(self, rank: int) -> None:
        try:
            self._store.set(f"left/{rank}", "1")
        except Exception:  # noqa: BLE001 - a store gone with its host: peers then see a failure
            pass

    def leaving(self) -> None:
        """This worker leaves (a peer's failure ended its part)."""
        if self.rank is not None:
            self.announce(self.rank)

    def has_left(self, rank: int) -> bool:
        try:
            return bool(self._store.check([f"left/{rank}"]))
        except Exception:  # noqa: BLE001 - no store to ask: the peer is not known to have left
            return False

    def has_left_soon(self, rank: int) -> bool:
        """Whether ``rank`` says it left, within ``LEAVE_GRACE_S`` (Note [A failure closes more
        than its pair])."""
        deadline = time.monotonic() + self.LEAVE_GRACE_S
        while not self.has_left(rank):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True


class _PeerThread:
    """A daemon thread over one peer's messages, in round order, and the error that ended it;
    or, where the peer said it was leaving, ``ended``."""

    def __init__(self, peer: int, timeout: timedelta, departures: Departures, name: str):
        self.peer, self.timeout, self._departures = peer, timeout, departures
        self._changed = threading.Condition()
        self._closing = False
        self.ended = False
        self._work = None  # the operation the thread waits in, for close() to abort
        self.error: PeerTimeoutError | None = None
        self._thread = threading.Thread(target=self._run_guarded, name=name, daemon=True)

    def _wait(self, work, round_: int, what: str) -> bool:
        """Waits for ``work``; False if close() aborted it. A failure becomes ``self.error``."""
        with self._changed:
            if self._closing:
                _C.abort_work(work)
                return False
            self._work = work
        try:
            completed = work.wait(self.timeout)
        except Exception as failure:  # noqa: BLE001 - gloo's error, kept typed for the caller
            with self._changed:
                if self._closing:
                    return False
            self._raise_unless_left(failure, round_, what)
            return False
        with self._changed:
            self._work = None
            return bool(completed) and not self._closing

    def _raise_unless_left(self, failure: Exception, round_: int, what: str) -> None:
        """After gloo's ``failure`` to ``what`` the peer: ``ended`` if the peer said it was
        leaving, else a PeerTimeoutError naming it and its round (and this worker leaves)."""
        timed_out = "Timed out waiting" in str(failure)
        if timed_out:
            # This worker's own wait ran out: gloo closes its connections now, and the peers
            # that see them close must find it gone (Note [A failure closes more than its pair]).
            self._departures.leaving()
        if self._departures.has_left_soon(self.peer):
            with self._changed:
                self.ended = True
                self._changed.notify_all()
            return
        self._departures.leaving()
        # Say how it was seen: a wait that ran out its timeout, or a connection that closed
        # (the peer died or left: seen at once, no timeout waited out).
        how = (
            f"did not answer within {self.timeout}; the peer may have stalled"
            if timed_out
            else "saw its connection close, without waiting out a timeout; the peer may have died"
        )
        raise PeerTimeoutError(
            f"gossip_ext: asynchronous gossip failed to {what} peer {self.peer} (its round "
            f"{round_}): it {how} or left the training loop: {failure}",
            peers=[self.peer],
            round=round_,
            transport="process_group(gloo)",
            timeout=self.timeout if timed_out else None,
        ) from failure

    def _run_guarded(self) -> None:
        try:
            self._run()
        except PeerTimeoutError as error:
            with self._changed:
                self.error = error
                self._changed.notify_all()

    def fail(self, error: PeerTimeoutError) -> None:
        """Ends the thread with ``error``, raised to whoever waits on it now or later (the
        caller gave the peer up)."""
        with self._changed:
            if self.error is None:
                self.error = error
        self.close()

    def _wait_a_little(self, left: float) -> None:
        """Waits (holding ``_changed``) for a change, at most ``left`` seconds, and half a second
        at a time to look whether the peer said it left (then ``ended``)."""
        self._changed.wait(min(left, 0.5))
        if self._departures.has_left(self.peer):
            self.ended = True

    def raise_if_failed(self) -> None:
        with self._changed:
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        """Aborts the operation in flight and lets the thread end (it is a daemon: a peer that
        never answers cannot hold the process)."""
        with self._changed:
            self._closing = True
            work = self._work
            self._changed.notify_all()
        if work is not None:
            try:
                _C.abort_work(work)
            except Exception:  # noqa: BLE001 - an operation that already ended
                pass
        self._thread.join(timeout=1.0)


class Mailbox(_PeerThread):
    """Receives ``peer``'s messages to ``rank`` of ``nbytes`` each, from round ``start`` on."""

    def __init__(
        self,
        group,
        graph: Schedule,
        peer: int,
        rank: int,
        nbytes: int,
        start: int,
        timeout: timedelta,
        departures: Departures,
        generation: int = 0,
        held_limit: int | None = None,
    ):
        super().__init__(peer, timeout, departures, f"gossip_ext-mailbox-{peer}")
        self._group, self._graph, self._rank, self._nbytes = group, graph, rank, nbytes
        # Note [Flow control by absorption]: at most ``held_limit`` arrived messages wait here
        # untaken before the next receive is posted, so a sender's unconfirmed sends (its
        # backlog) count what this worker has not absorbed, not what the network has not moved.
        # A blocking wait (a staleness bound, ``settle``) lifts the limit while it waits.
        self._held_limit, self._lifted = held_limit, False
        self._world_size, self._generation = group.size(), generation
        self.received = 0  # messages arrived, taken or not
        # When the latest messages arrived (time.monotonic()), for deadlines learned from them.
        self._arrival_times: collections.deque[float] = collections.deque(maxlen=ARRIVALS_KEPT)
        self.expected = next_round(graph, peer, rank, self._world_size, start)
        self._arrived: collections.deque[tuple[int, torch.Tensor, float]] = collections.deque()
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._holds_enough() and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                expected, sequence = self.expected, self.received
            buffer = torch.empty(self._nbytes, dtype=torch.uint8)
            try:
                posted = self._group.recv([buffer], self.peer, tag(self._generation, sequence))
            except Exception as failure:  # noqa: BLE001 - gloo's error, kept typed for the caller
                # A connection already closed fails the receive as it is posted, not in its wait:
                # the same failure, or the thread would end with it unseen by the training loop.
                self._raise_unless_left(failure, expected, "receive from")
                return
            if not self._wait(posted, expected, "receive from"):
                return
            round_ = messages.round_of(buffer)
            with self._changed:
                now = time.monotonic()
                self._arrived.append((round_, buffer, now))
                self._arrival_times.append(now)
                self.received += 1
                self.expected = next_round(
                    self._graph, self.peer, self._rank, self._world_size, round_ + 1
                )
                self._changed.notify_all()

    def _holds_enough(self) -> bool:
        return (
            self._held_limit is not None
            and not self._lifted
            and len(self._arrived) >= self._held_limit
        )

    def take(self, through: float) -> list[tuple[int, torch.Tensor]]:
        """The messages that arrived of rounds <= ``through`` (math.inf: all), in round order."""
        taken = []
        with self._changed:
            while self._arrived and self._arrived[0][0] <= through:
                round_, buffer, _ = self._arrived.popleft()
                taken.append((round_, buffer))
            if taken:
                self._changed.notify_all()  # room for the next receive
            if not taken and self.error is not None and not self._arrived:
                raise self.error
        return taken

    def arrival_times(self) -> list[float]:
        """When the latest messages (at most ARRIVALS_KEPT) arrived, oldest first."""
        with self._changed:
            return list(self._arrival_times)

    def wait_until_past(self, round_: int) -> None:
        """Blocks until every message of rounds <= ``round_`` has arrived (taken or not), where
        the sender skips no round (a staleness bound)."""
        self._wait_until(lambda: self.expected > round_)

    def wait_for(self, count: int) -> None:
        """Blocks until ``count`` messages in all have arrived (taken or not)."""
        self._wait_until(lambda: self.received >= count)

    def wait_for_before(self, count: int, deadline: float) -> bool:
        """Waits until ``count`` messages in all have arrived (taken or not), or the peer left,
        or ``time.monotonic()`` passes ``deadline``; whether they arrived. Raises the peer's
        failure."""
        with self._changed, self._limit_lifted():
            while self.received < count and not self.ended:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return False
                self._wait_a_little(left)
            return self.received >= count

    @contextlib.contextmanager
    def _limit_lifted(self):
        """Receives past ``held_limit`` while the caller (holding ``_changed``) waits for a
        message: a wait must not wait on its own untaken messages."""
        self._lifted = True
        self._changed.notify_all()
        try:
            yield
        finally:
            self._lifted = False

    def _wait_until(self, done) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._changed, self._limit_lifted():
            while not done() and not self.ended:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise PeerTimeoutError(
                        f"gossip_ext: asynchronous gossip waited {self.timeout} for peer "
                        f"{self.peer}'s message of its round {self.expected}; the peer may "
                        "have died, stalled or left the training loop",
                        peers=[self.peer],
                        round=self.expected,
                        transport="process_group(gloo)",
                        timeout=self.timeout,
                    )
                self._wait_a_little(left)


class Outbox(_PeerThread):
    """Confirms this worker's sends to ``peer``, in the order they were posted."""

    def __init__(
        self, group, peer: int, timeout: timedelta, departures: Departures, generation: int = 0
    ):
        super().__init__(peer, timeout, departures, f"gossip_ext-outbox-{peer}")
        self._group, self._generation = group, generation
        self.sent = 0  # messages posted
        self._posted: collections.deque[tuple[int, torch.Tensor, object]] = collections.deque()
        self._thread.start()

    def post(self, round_: int, message: torch.Tensor) -> bool:
        """Sends ``message`` as this worker's round ``round_``; never blocks. False: the peer
        has left, and nothing was sent."""
        self.raise_if_failed()
        if self.ended:
            return False
        try:
            work = self._group.send([message], self.peer, tag(self._generation, self.sent))
        except Exception as failure:  # noqa: BLE001 - gloo's error, kept typed for the caller
            self._raise_unless_left(failure, round_, "send to")
            return False
        with self._changed:
            self._posted.append((round_, message, work))
            self.sent += 1
            self._changed.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._posted and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                round_, _, work = self._posted[0]
            if not self._wait(work, round_, "send to"):
                return
            with self._changed:
                self._posted.popleft()  # the buffer goes with it
                self._changed.notify_all()

    def close(self) -> None:
        """Aborts every send not yet confirmed, then ends the thread: no gloo operation of this
        worker's outlives its gossip."""
        with self._changed:
            posted = [work for _, _, work in self._posted]
        for work in posted:
            try:
                _C.abort_work(work)
            except Exception:  # noqa: BLE001 - an operation that already ended
                pass
        super().close()

    @property
    def backlog(self) -> int:
        """Sends posted and not yet confirmed."""
        with self._changed:
            return len(self._posted)

    def wait_until_past(self, round_: float) -> None:
        """Blocks until every send of rounds <= ``round_`` is confirmed."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._changed:
            while self._posted and self._posted[0][0] <= round_ and not self.ended:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeoutError(
                        f"gossip_ext: asynchronous gossip waited {self.timeout} for peer "
                        f"{self.peer} to take this worker's message of round "
                        f"{self._posted[0][0]}; the peer may have died, stalled or left the "
                        "training loop",
                        peers=[self.peer],
                        round=self._posted[0][0],
                        transport="process_group(gloo)",
                        timeout=self.timeout,
                    )
                self._wait_a_little(left)
            if self.error is not None:
                raise self.error


def leave(departures: Departures, rank: int, boxes, why: str, round_: int | None = None) -> None:
    """Says that ``rank`` leaves, then fails and ends every thread of ``boxes`` with a
    PeerTimeoutError saying ``why`` (an engine's ``abandon``, or its finalizer)."""
    departures.announce(rank)
    error = PeerTimeoutError(
        f"gossip_ext: rank {rank} gave up its asynchronous gossip: {why}",
        round=round_,
        transport="process_group(gloo)",
    )
    for box in boxes:
        box.fail(error)


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
