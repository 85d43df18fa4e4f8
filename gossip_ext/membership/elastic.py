"""One worker of an elastic job: its epochs, how it notices a change, who it answers for.

A worker joins through the membership service (:mod:`gossip_ext.membership.service`; its protocol in
:mod:`gossip_ext.membership.epochs`) and trains in epochs, each with a process group of its own over
that epoch's members (:mod:`.epoch_group`). At every step boundary it compares the count of the
membership's changes, as its watch thread last read it, with its epoch's; when the membership
changed (a worker registered, left, or was announced dead) it moves to the next epoch there. When a
round or a collective fails because a peer died or stalled, the worker announces the peers the error
is about (a :class:`~gossip_ext.PeerTimeoutError`'s ``peers``, never read out of its message) unless
a change is already pending, which explains the failure, and moves on the same way; a worker that is
not a neighbour of the dead one learns it from the count, without waiting for a timeout of its own.
Forming an epoch is the only moment the members wait for each other: each checks in, and one that
does not within the timeout is removed.

What moves with a worker from one epoch to the next is its own: its model, its optimizer, its
step count and outer state. The push-sum weight restarts at 1 in every epoch (a dead worker's
share of the mass is dropped; see docs/elastic.md). A worker that joins a running job receives the
state of one member that was already training (the donor: the oldest such member) before its
first forward (:mod:`.handoff`), and never seeds anyone with its own initialisation.
"""

from __future__ import annotations

import datetime
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.errors import PeerTimeoutError
from gossip_ext.gossip.transport import Sealing
from gossip_ext.membership import admission, epoch_group
from gossip_ext.membership.epochs import (
    DEFAULT_TIMINGS,
    LEFT,
    SEALED,
    Epoch,
    MembershipClient,
    RemovedError,
    Timings,
)

logger = logging.getLogger("gossip_ext.membership.elastic")


# The first epoch forms once min_workers registered and no other registered for this long.
FIRST_EPOCH_SETTLE_S = 1.0
# How often a joiner that waits for the members to take it in looks whether any is left.
GONE_LOOK_S = 0.25


@dataclass(frozen=True)
class Failure:
    """A peer failure that moves a worker to the next epoch, kept without the error: its
    traceback's frames hold the failed engine, whose transport would keep the epoch's group, and
    its connections, open. ``text`` is for the log; ``peers`` are the ranks of the epoch's group
    the error is about (a :class:`PeerTimeoutError`'s ``peers``; none for c10d's errors)."""

    text: str
    peers: tuple[int, ...] = ()

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        peers = error.peers if isinstance(error, PeerTimeoutError) else ()
        return cls(f"{type(error).__name__}: {error}", tuple(peers))

    def __str__(self) -> str:
        return self.text


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is what a dead, stalled or departed peer makes a round or a collective
    raise: a TimeoutError (the engine's, the exchanges'), or c10d's RuntimeError from a closed
    connection or a timed-out wait. Anything else (a bad argument, a non-finite model) is the
    user's to see."""
    if isinstance(error, TimeoutError):
        return True
    if isinstance(error, (RuntimeError, dist.DistError)) and not isinstance(error, RemovedError):
        text = str(error)
        return any(
            s in text
            for s in ("Connection closed", "Connection reset", "Timed out", "timed out", "aborted")
        )
    return False


@dataclass
class Change:
    """An epoch change: the epoch, its group, this worker's rank, who left and who joined."""

    epoch: Epoch
    group: dist.ProcessGroup
    rank: int
    left: list[int]
    joined: list[int]
    seconds: float

    @property
    def donor(self) -> int | None:
        """The rank that hands its state to the joiners (None: nobody joined)."""
        if not self.joined:
            return None
        return min(self.epoch.rank(m) for m in self.epoch.members if m not in self.joined)


class ElasticWorker:
    """This process's membership: registered at construction, in one epoch at a time. Every
    value it reads from the service is sealed with the job's ``secret``
    (:mod:`gossip_ext.membership.trust`; None: an open job), and it registers only once its
    ``fingerprint`` matches the job's (:mod:`gossip_ext.membership.admission`). Its heartbeat
    and its watch over the other members keep the job's ``timings``."""

    def __init__(
        self,
        address: str,
        min_workers: int,
        timeout: datetime.timedelta,
        backend: str,
        shards: int = 1,
        *,
        secret: bytes | None = None,
        fingerprint: Mapping[str, object] | None = None,
        timings: Timings = DEFAULT_TIMINGS,
        messages: str = SEALED,
    ):
        self.client = MembershipClient(address, timeout, secret, timings)
        self.messages = messages  # how the epochs' messages travel (Elastic(messages=...))
        self.shards = shards  # the processes of each replica (1: unsharded)
        self.fingerprint = dict(fingerprint or {}, shards=shards)
        self.min_workers = min_workers
        self.timeout = timeout
        self.backend = backend
        self.epoch: Epoch | None = None
        self.group: dist.ProcessGroup | None = None
        self.left = False
        self.ready = False  # holds the job's state (see mark_ready)
        self._responder: _C.LivenessResponder | None = None
        # Called from the watch's thread when a member's heartbeat stops (epochs.Watch): gives up
        # whatever this worker waits on from it. Set by the wrapper.
        self.on_silent: Callable[[str], None] = lambda why: None

    @property
    def worker(self) -> int:
        return self.client.worker

    # ----------------------------------------------------------------------------- joining

    def register(self) -> int:
        """This worker's id, registered once it was admitted (its fingerprint is the job's:
        JobMismatchError naming what differs otherwise); :meth:`join` does it if it was not
        done."""
        if self.client.worker < 0:
            admission.admit(self.client, self.fingerprint)
            self.client.register()
        return self.client.worker

    def join(self) -> Change:
        """Registers and waits until this worker is a member of a formed epoch: the first one
        (once ``min_workers`` registered) or the next one the members form."""
        start = time.monotonic()
        client = self.client
        self.register()
        deadline = start + self.timeout.total_seconds()
        number = max(client.latest(), 0)
        while True:
            epoch = client.epoch(number)
            if epoch is None and number == 0:
                epoch = self._propose_first(deadline)
            if epoch is None:
                epoch = self._wait_for_the_members(number, deadline)
            if epoch is None:
                raise TimeoutError(
                    f"gossip_ext: worker {self.worker} waited {self.timeout.total_seconds():g} s "
                    f"for the members at {client.address} to form epoch {number} with it; are "
                    "they training (their step boundaries form it)?"
                )
            if self.worker not in epoch.members:
                client.check_removed()
                number += 1
                continue
            change = self._form(epoch, previous=None, start=start)
            if change is not None:
                return change
            number += 1

    def _wait_for_the_members(self, number: int, deadline: float) -> Epoch | None:
        """Epoch ``number`` once the members of epoch ``number - 1`` form it at a step boundary,
        or None at ``deadline``; RuntimeError as soon as every one of them is gone (the job
        finished or failed): no one is left to form it, nor to hand this worker the model."""
        client = self.client
        previous = client.epoch(number - 1)
        while True:
            look_until = min(deadline, time.monotonic() + GONE_LOOK_S)
            epoch = client.wait_for_epoch(number, look_until)
            if epoch is not None or time.monotonic() > deadline or previous is None:
                return epoch
            gone = client.gone()
            if all(m in gone for m in previous.members):
                raise RuntimeError(
                    f"gossip_ext: worker {self.worker} cannot join the job at {client.address}: "
                    f"every member of its epoch {previous.number} is gone ("
                    + ", ".join(f"worker {m}: {gone[m]}" for m in previous.members)
                    + "), so no one is left to take it in or to hand it the model; start a new "
                    "job, from a checkpoint"
                )

    def _propose_first(self, deadline: float) -> Epoch:
        """Epoch 0, once ``min_workers`` workers registered and FIRST_EPOCH_SETTLE_S passed
        without another registering (workers launched together start together; a later one
        joins the next epoch)."""
        client = self.client
        seen, since = -1, time.monotonic()
        while True:
            members, events = client.candidate([])
            epoch = client.epoch(0)
            if epoch is not None:
                return epoch
            if len(members) != seen:
                seen, since = len(members), time.monotonic()
            settled = time.monotonic() - since >= FIRST_EPOCH_SETTLE_S
            if len(members) >= self.min_workers and (settled or time.monotonic() > deadline):
                return client.propose(0, members, events)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"gossip_ext: {len(members)} of min_workers={self.min_workers} workers "
                    f"registered at {client.address} within {self.timeout.total_seconds():g} s"
                )
            time.sleep(0.05)

    # ----------------------------------------------------------------------------- changing

    def changed(self) -> bool:
        """Whether the membership changed since this epoch formed, as the watch's latest look at
        the service saw it (every heartbeat): no step waits on a request of its own."""
        return self.client.watch.events > self.epoch.events

    def next_epoch(self, failure: Failure | None) -> Change:
        """Moves to the next epoch: announces the peers of the ``failure`` (unless a change is
        already pending, which explains it), forms the epoch over the live members, builds its
        group. Raises RemovedError if this worker was removed, TimeoutError (naming who
        is gone) below ``min_workers``."""
        start = time.monotonic()
        client = self.client
        previous = self.epoch
        if failure is not None:
            logger.info("gossip_ext epoch %d: leaving it after %s", previous.number, failure)
        client.check_removed()
        if failure is not None and client.events() == previous.events:
            self._accuse(failure, previous)
        self._release(in_background=failure is not None)
        number, current = previous.number + 1, previous.members
        while True:
            members, events = client.candidate(current)
            if self.worker not in members:
                client.check_removed()
            gone = client.gone()
            lost = sorted(set(previous.members) - set(members))
            failed = [w for w in lost if gone.get(w) != LEFT]
            if len(members) < self.min_workers and failed:
                # Workers that finished and left wind a job down; only failures stop it.
                raise TimeoutError(
                    f"gossip_ext: {len(members)} workers remain, fewer than min_workers="
                    f"{self.min_workers}: "
                    + ", ".join(f"worker {w} ({gone.get(w, 'gone')})" for w in failed)
                    + " gone"
                )
            epoch = client.epoch(number) or client.propose(number, members, events)
            if self.worker not in epoch.members:
                client.check_removed()
                number += 1
                continue
            change = self._form(epoch, previous, start)
            if change is not None:
                return change
            number, current = number + 1, epoch.members

    def _accuse(self, failure: Failure, epoch: Epoch) -> None:
        """Announces the peers of ``failure`` as gone once their heartbeat is found silent
        too: a peer that timed out because it was itself waiting on a stalled one is alive, and
        so is one whose connection closed because gloo gave up on another of its peers (gloo
        closes a timed-out worker's connections before it can say anything). Where nobody is
        accused, the failure still starts a new epoch for every member, whose check-in finds who
        is missing."""
        client = self.client
        named = [epoch.members[r] for r in failure.peers if 0 <= r < len(epoch.members)]
        # A peer that said it is leaving the epoch closed its side on purpose: it is alive.
        named = [w for w in named if w != self.worker and not client.leaving(epoch, w)]
        if named:
            named = client.silent(named, epoch.events)
        alive = self.answering(named)
        if alive:
            logger.warning(
                "gossip_ext epoch %d: worker(s) %s answered over the epoch's group though "
                "their round failed and their heartbeat looked silent: not accused",
                epoch.number,
                alive,
            )
        named = [w for w in named if w not in alive]
        if named:
            client.announce_gone(named, f"its round failed in epoch {epoch.number}")
        elif client.events() == epoch.events:
            client.bump()

    def _form(self, epoch: Epoch, previous: Epoch | None, start: float) -> Change | None:
        """Checks in to ``epoch`` and builds its group; None if a member is missing (it is
        announced gone, and the caller forms the next epoch)."""
        client = self.client
        if self.ready or epoch.number == 0:
            # This worker holds the job's state: it trained before, or starts the job.
            self.mark_ready()
        checking_in = time.monotonic()
        missing = client.check_in(epoch)
        if missing:
            client.announce_gone(missing, f"did not reach epoch {epoch.number} in time")
            return None
        # A worker whose state is part of the job trained in an earlier epoch, or received a
        # donor's state. The others of an epoch are joiners, and receive it.
        joined = [m for m in epoch.members if not client.is_ready(m)]
        if len(joined) == len(epoch.members):
            raise RuntimeError(
                f"gossip_ext: no member of epoch {epoch.number} at {client.address} holds the "
                "model (every worker that trained is gone): restart the job from a checkpoint"
            )
        building = time.monotonic()
        try:
            group = client.build_group(epoch, epoch.rank(self.worker), self.backend)
        except Exception as error:  # noqa: BLE001 - a member died after its check-in
            # The next epoch's check-in finds who it was; a connection that failed its proof
            # (UnprovenPeerError) is a new connection in the next epoch's group, and no member
            # is accused for it.
            logger.warning("epoch %d: building its group failed: %s", epoch.number, error)
            return None
        self.epoch, self.group = epoch, group
        others = [m for m in epoch.members if m != self.worker]
        # Answers the others' pings while the group lives (Note [A silence is confirmed over
        # the group] in csrc/transport/process_group/liveness.h).
        self._responder = _C.LivenessResponder(group)
        self.client.watch.follow(epoch, others, self.on_silent, self.answering)
        left = [] if previous is None else sorted(set(previous.members) - set(epoch.members))
        change = Change(
            epoch, group, epoch.rank(self.worker), left, joined, time.monotonic() - start
        )
        logger.info(
            "gossip_ext epoch %d: worker %d is rank %d of %d; left %s, joined %s; members %s; "
            "its messages %s; "
            "the change took %.3f s (until check-in %.3f s, check-in %.3f s, group %.3f s)",
            epoch.number,
            self.worker,
            change.rank,
            len(epoch.members),
            left,
            joined,
            list(epoch.members),
            self.messages if self.client.seal.authenticated else "plain (an open job)",
            change.seconds,
            checking_in - start,
            building - checking_in,
            time.monotonic() - building,
        )
        return change

    def message_sealing(self) -> Sealing | None:
        """How this epoch's gossip messages are sealed on the wire (None: as they lie)."""
        return self.client.link_sealing(self.epoch, self.messages)

    def nccl_rendezvous(self) -> tuple[dist.Store, str]:
        """Where the ranks of this epoch's NCCL transport meet: a key of the epoch in the
        membership store (no default store exists, and the key must differ from every earlier
        epoch's, which a joiner could not count)."""
        store = self.client.rendezvous_store
        return dist.PrefixStore(f"epoch/{self.epoch.number}/nccl", store), "unique_id"

    def leaving_epoch(self) -> None:
        """Says, before this worker drops anything of its epoch, that it is leaving it alive: a
        peer whose round with it fails then does not take it for dead."""
        if self.client.watch is not None:
            self.client.watch.pause()
        if self.epoch is not None:
            self.client.mark_leaving(self.epoch)

    def mark_ready(self) -> None:
        """This worker holds the job's state (it starts the job, or received the state from a
        donor): from now on it can hand it on."""
        self.ready = True
        self.client.mark_ready()

    # ----------------------------------------------------------------------------- leaving

    def leave(self) -> None:
        """Leaves the job: the members drop this worker at their next step boundary."""
        if self.left:
            return
        self.left = True
        try:
            self.leaving_epoch()
            self.client.announce_gone([self.worker], LEFT)
        finally:
            self._release()
            if self.client.watch is not None:
                self.client.watch.stop()
            if self.client.heartbeat is not None:
                self.client.heartbeat.stop()

    def answering(self, workers: Sequence[int]) -> list[int]:
        """Those of ``workers`` (members of this epoch) that answer a ping over the epoch's group
        within the job's ``confirm_s``: alive, whatever the store shows of their beats (Note [A
        silence is confirmed over the group])."""
        group, epoch = self.group, self.epoch
        if group is None or epoch is None:
            return []
        wait = datetime.timedelta(seconds=self.client.timings.confirm_s)
        return [w for w in workers if w in epoch.members and _C.ping(group, epoch.rank(w), wait)]

    def _release(self, *, in_background: bool = False) -> None:
        """Lets go of the epoch's group. Its connections close only when it is freed (gloo has
        no close), which the peers still waiting on this worker must see now. Freeing it waits
        for its worker threads, and one still inside a collective that a failure left behind
        waits there for the whole timeout (``abort()`` does not reach it): after a failure the
        group is freed ``in_background``, so that the epoch change does not wait with it."""
        if self._responder is not None:
            self._responder.close()  # before its group goes: it waits in a receive of the group
            self._responder = None
        holder, self.group = [self.group], None
        let_go(holder, in_background=in_background)


def let_go(holder: list[dist.ProcessGroup | None], *, in_background: bool = False) -> None:
    """Releases the epoch group that ``holder`` (a list of one) holds, and frees it: ``holder``
    is emptied, its reference the last (an argument would be the caller's too). In a thread of
    its own where ``in_background`` (see ElasticWorker._release)."""
    if holder[0] is None:
        return
    epoch_group.release(holder[0])  # torch forgets it at once; freeing it may take longer
    if in_background:
        # Not a daemon: the interpreter's exit waits for it, rather than finalize while it is
        # inside torch's destructor.
        threading.Thread(target=_free, args=(holder,), name="gossip_ext free group").start()
    else:
        _free(holder)


def _free(holder: list[dist.ProcessGroup]) -> None:
    """Drops the last reference to the group in ``holder``."""
    freed = weakref.ref(holder[0])
    holder.clear()
    if freed() is not None:
        # A reference cycle still holds it (a traceback's frames): a full collection, which
        # takes a tenth of a second in a process holding torch and a model, only then.
        gc.collect()


# ----------------------------------------------------------------------------- the handoff
