"""A worker's heartbeat, and the watch over the other members' heartbeats: how an elastic job
tells a dead or stopped worker from one that is only busy (the keys in
:mod:`gossip_ext.membership.epochs`)."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from gossip_ext.membership import ledger, trust

if TYPE_CHECKING:  # the client builds the watch: only its type is needed here
    from gossip_ext.membership.epochs import Epoch, MembershipClient

logger = logging.getLogger("gossip_ext.membership.elastic")  # with the epoch-change lines

LEFT = "left the job"  # why a worker that called leave() (or exited) is gone
# The defaults of Elastic(heartbeat_s=..., silent_s=...): see Timings.
HEARTBEAT_S = 0.1
SILENT_S = 1.5
# A worker that a failed round names is watched for this many beats before it is accused: its
# heartbeat thread runs while it waits in a round (the wait releases the GIL), so five beats
# missed in a row mean its process is dead or stopped.
CONFIRM_BEATS = 5
CONFIRM_S = CONFIRM_BEATS * HEARTBEAT_S  # the default's: the time every survivor of a SIGKILL waits
# The shortest period a beat may have: each beat, and each look of every watch, is a request to
# the service, N workers' worth.
MIN_HEARTBEAT_S = 0.01


@dataclass(frozen=True)
class Timings:
    """How an elastic job tells a dead or stopped worker from one that is only busy, the same on
    every worker of the job (``Elastic(heartbeat_s=..., silent_s=...)``; docs/elastic.md).

    ``heartbeat_s``: how often a worker's heartbeat thread raises its count, and how often a
    watch looks at the others'. ``silent_s``: a heartbeat silent this long means its worker is
    dead or stopped (a watch announces it gone). ``confirm_s`` (five beats): how long a worker
    that a failed round names is watched before it is accused."""

    heartbeat_s: float = HEARTBEAT_S
    silent_s: float = SILENT_S

    @property
    def confirm_s(self) -> float:
        return CONFIRM_BEATS * self.heartbeat_s


DEFAULT_TIMINGS = Timings()


class Beats:
    """The heartbeats of ``workers`` as seen from a check-in or a watch: which stopped for
    ``timings.silent_s``. Each look reads every beat it needs in one request (``multi_get``,
    through ``ledger.read_keys``, which never waits on a deleted key): a watch looks at every
    beat, and each of N workers reading N - 1 keys one by one made N^2 requests per look at the
    service. A beat is a sealed count that rose: one that an outsider wrote is no beat, and one
    lower than a count seen before (an old beat written back) is tampering, logged once."""

    def __init__(
        self,
        store: dist.Store,
        seal: trust.Seal,
        workers: Sequence[int],
        timings: Timings = DEFAULT_TIMINGS,
    ):
        self.store = store
        self.seal = seal
        self.timings = timings
        for w in workers:
            # multi_get waits for a key that does not exist yet (the store's timeout, minutes):
            # a worker that died before its first beat must still read as silent.
            store.compare_set(f"beat/{w}", "", seal.seal(f"beat/{w}", "0"))
        self._replayed: set[int] = set()  # workers whose beat was seen written back, logged
        now = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {}
        self.seen = {w: (beat, now) for w, beat in zip(workers, self._read(workers))}
        self.read_at = now

    def _read(self, workers: Sequence[int]) -> list[int]:
        keys = [f"beat/{w}" for w in workers]
        beats = ledger.read_keys(self.store, keys)
        opened = (
            self.seal.open(k, (b or b"").decode(errors="replace")) for k, b in zip(keys, beats)
        )
        counts = [int(v) if v is not None and v.isdigit() else -1 for v in opened]
        for w, count in zip(workers, counts):
            if 0 <= count < self.seen.get(w, (-1, 0.0))[0] and w not in self._replayed:
                self._replayed.add(w)
                logger.warning(
                    "gossip_ext: worker %d's heartbeat in the membership store went back from "
                    "%d to %d: a process outside the job wrote an old beat back",
                    w,
                    self.seen[w][0],
                    count,
                )
        return counts

    def unchanged(self, workers: Sequence[int]) -> list[int]:
        """Those of ``workers`` whose heartbeat did not rise since this began watching."""
        return [w for w, b in zip(workers, self._read(workers)) if b <= self.seen[w][0]]

    def heard(self, workers: Sequence[int]) -> None:
        """``workers`` are alive now (they answered otherwise): their silences start again."""
        now = time.monotonic()
        for w in workers:
            self.seen[w] = (self.seen[w][0], now)

    def silent(self, workers: Sequence[int]) -> list[int]:
        now = time.monotonic()
        if now - self.read_at < self.timings.heartbeat_s / 2:  # a watch looks every beat or so
            return []
        self.read_at = now
        silent = []
        for w, beat in zip(workers, self._read(workers)):
            last, since = self.seen[w]
            if beat > last:
                self.seen[w] = (beat, now)
            elif now - since > self.timings.silent_s:
                silent.append(w)
        return silent


class Heartbeat:
    """Raises ``beat/ID``'s sealed count every ``period_s`` from a thread of its own, on a store
    connection of its own, until stopped: how the members forming an epoch tell a dead or
    stopped worker from one that is only busy finishing its step."""

    def __init__(
        self,
        address: str,
        timeout: datetime.timedelta,
        seal: trust.Seal,
        worker: int,
        period_s: float = HEARTBEAT_S,
    ):
        host, _, port = address.rpartition(":")
        self.store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)
        self.seal = seal
        self.key = f"beat/{worker}"
        self.period_s = period_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"gossip_ext heartbeat {worker}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        count = 0
        while not self.stopped.wait(self.period_s):
            count += 1
            try:
                self.store.set(self.key, self.seal.seal(self.key, str(count)))
            except Exception:  # noqa: BLE001 - the service is gone; the worker will find out
                return

    def stop(self) -> None:
        self.stopped.set()


class Watch:
    """Watches the heartbeats of the other members of this worker's epoch, from a thread of its
    own on a store connection of its own, while the worker trains in that epoch. A member whose
    heartbeat stays silent for the job's ``silent_s`` (its process died or is stopped: a busy one
    still beats) is announced gone, and ``on_silent`` is called with why, from this thread: the
    worker gives up a round that waits for that member then, not at the timeout, and every member
    moves to the next epoch without it (its announcement bumps ``events``). A thread apart from
    the heartbeat's: a beat must never wait behind the watch's work (an announcement, a round
    given up, an NCCL communicator aborted)."""

    def __init__(self, client: MembershipClient):
        self.client = client  # a connection of its own, announcing in this worker's name
        worker = client.worker
        self._lock = threading.Lock()
        self._following: (
            tuple[Epoch, list[int], Callable[[str], None], Callable[[Sequence[int]], list[int]]]
            | None
        ) = None
        # The highest ``events`` count its looks read: the worker compares it with its epoch's at
        # every step boundary, so that no step waits on a request to the service.
        self.events = -1
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"gossip_ext watch {worker}", daemon=True
        )
        self.thread.start()

    def follow(
        self,
        epoch: Epoch,
        others: Sequence[int],
        on_silent: Callable[[str], None],
        answering: Callable[[Sequence[int]], list[int]],
    ):
        """Watches ``others`` (the epoch's members but this worker) until :meth:`pause`.
        ``answering(workers)``: those of them that answer over the epoch's group (Note [A
        silence is confirmed over the group]), asked before any is announced gone."""
        with self._lock:
            self._following = (epoch, list(others), on_silent, answering)

    def pause(self) -> None:
        """Stops watching (this worker is leaving its epoch): once it returns, ``on_silent`` is
        not running and will not be called for that epoch."""
        with self._lock:
            self._following = None

    def stop(self) -> None:
        self.pause()
        self.stopped.set()

    def _run(self) -> None:
        watched, beats, why = None, None, None
        timings = self.client.timings
        while not self.stopped.wait(timings.heartbeat_s):
            with self._lock:
                following = self._following
            if following is None:
                continue
            epoch, others, on_silent, answering = following
            try:
                if watched is not following:
                    beats = Beats(self.client.store, self.client.seal, others, timings)
                    watched, why = following, None
                elif why is None:
                    why = self._silent(epoch, others, beats, answering)
                    if why is not None:
                        logger.info("gossip_ext epoch %d: %s", epoch.number, why)
                self.events = max(self.events, self.client.events())
            except Exception:  # noqa: BLE001 - the service is gone; the worker will find out
                return
            if why is None:
                continue
            # Again at every look until the worker leaves the epoch: a round it starts after the
            # first call (its engine was being built) is given up too.
            with self._lock:  # pause() waits for it: no call reaches the worker's next epoch
                if self._following is following:
                    on_silent(why)

    def _silent(
        self,
        epoch: Epoch,
        others: list[int],
        beats: Beats,
        answering: Callable[[Sequence[int]], list[int]],
    ) -> str | None:
        """Why to give up on the members whose heartbeat stopped (announced gone), or None."""
        silent = beats.silent(others)
        if not silent:
            return None
        gone = self.client.gone()
        # One that left on purpose closed its connections: its rounds fail at once.
        silent = [w for w in silent if gone.get(w) != LEFT]
        # One that answers over the epoch's group is alive: its beats in the store were written
        # over (Note [A silence is confirmed over the group]).
        alive = answering(silent)
        if alive:
            logger.warning(
                "gossip_ext epoch %d: worker(s) %s answered over the epoch's group though their "
                "heartbeat in the membership store looked silent: a process outside the job is "
                "writing their beats back; not announced gone",
                epoch.number,
                alive,
            )
            beats.heard(alive)
        silent = [w for w in silent if w not in alive]
        if not silent:
            return None
        self.client.announce_gone(silent, f"its heartbeat stopped in epoch {epoch.number}")
        return (
            f"the heartbeat of worker{'s' if len(silent) > 1 else ''} "
            f"{', '.join(map(str, silent))} stopped for {self.client.timings.silent_s:g} s in "
            f"epoch {epoch.number} "
            "(its process died or is stopped)"
        )
