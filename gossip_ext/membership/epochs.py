"""The membership store's protocol: the keys of an elastic job's membership service
(:mod:`gossip_ext.membership.service`) and how a worker registers, reads and forms epochs with them.

The membership is a sequence of epochs, each a sorted list of worker ids (ids are handed out in
order of registration, so the oldest member is rank 0 of every epoch it is in). Nothing here is
a global step: a worker's watch thread reads one counter (``events``) with the heartbeats it
watches, its training steps compare it with their epoch's, and it takes part in forming a new
epoch only when the membership changed. The keys:

- ``registered``: every worker id that ever registered, appended (``"3,"``);
- ``gone``: the ids that left or were removed, with why (``"3:died;"``), appended;
- ``events``: a counter bumped after every registration and every entry of ``gone``;
- ``epoch/E``: ``"<events>|<ids>"``, the members of epoch E and the ``events`` count they reflect,
  written once (compare-and-set: the first proposal wins, every worker reads the same list);
- ``epoch/E/here/ID``: member ID reached epoch E (its check-in);
- ``epoch/E/leaving/ID``: member ID is leaving epoch E alive (before it drops its connections);
- ``latest``: the newest epoch whose members all checked in;
- ``ready/ID``: worker ID holds the job's state (it trained, or received it from a donor);
- ``beat/ID``: worker ID's heartbeat, a counter its own thread bumps every HEARTBEAT_S;
- ``replica/ID/told/N``: what worker ID, the leader of a sharded replica, told its replica's other
  processes the N-th time (gossip_ext.sharded.elastic: the epoch it formed, or why it stopped).

A worker that forms epoch E + 1 proposes ``(members of E, and everyone registered) - gone``; each
proposed member checks in and waits for the others; one that does not check in, and whose
heartbeat stopped for SILENT_S (it died, or its process is stopped) or that stays away for the
timeout, is written to ``gone`` as not having reached the epoch, and the next epoch is formed
without it. A worker that finds itself in ``gone`` was removed (it stalled past the timeout, or
left), and is told so.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.distributed as dist

POLL_S = 0.01  # how often a waiting worker looks again at a key another worker will write
logger = logging.getLogger("gossip_ext.membership.elastic")  # with the epoch-change lines

LEFT = "left the job"  # why a worker that called leave() (or exited) is gone
HEARTBEAT_S = 0.1  # how often a worker's heartbeat thread bumps its counter
SILENT_S = 1.5  # a heartbeat silent this long: the worker is dead or stopped
# How long a worker that a failed round names is watched before it is accused: its heartbeat
# thread runs while it waits in a round (the wait releases the GIL), so five beats missed in a
# row mean its process is dead or stopped. It is the time every survivor of a SIGKILL waits.
CONFIRM_S = 5 * HEARTBEAT_S


def parse_address(address: str, name: str = "membership") -> tuple[str, int]:
    """("HOST", PORT) of ``"HOST:PORT"``; an error naming ``name`` and the value otherwise."""
    if not isinstance(address, str):
        raise TypeError(f"{name} must be a str 'HOST:PORT', got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be 'HOST:PORT' with a port in 1..65535, got {address!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Epoch:
    """One membership epoch: its number, its members (worker ids, sorted), and the ``events``
    count its membership reflects."""

    number: int
    members: tuple[int, ...]
    events: int

    def rank(self, worker: int) -> int:
        return self.members.index(worker)


class RemovedError(RuntimeError):
    """This worker is no longer a member of the job: it stalled past the timeout or left. A new
    GossipDataParallel (a new worker) can join again."""


class MembershipClient:
    """One worker's view of the membership service at ``address``: registration, epochs,
    announcements. Every wait is bounded by ``timeout``."""

    def __init__(self, address: str, timeout: datetime.timedelta):
        host, port = parse_address(address)
        self.address = address
        self.timeout = timeout
        try:
            self.store = dist.TCPStore(
                host, port, is_master=False, timeout=timeout, wait_for_workers=False
            )
        except Exception as error:  # noqa: BLE001 - re-raised with what the user must do
            raise TimeoutError(
                f"membership={address!r}: no membership service answered within "
                f"{timeout.total_seconds():g} s; start one with "
                f"`python -m gossip_ext.membership --port {port}` on {host} ({error})"
            ) from error
        self.worker = -1
        self.heartbeat: Heartbeat | None = None
        self.watch: Watch | None = None

    # ----------------------------------------------------------------------------- reading

    def _text(self, key: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def registered(self) -> list[int]:
        return [int(i) for i in self._text("registered").split(",") if i]

    def gone(self) -> dict[int, str]:
        """Worker id -> why it is gone (the first reason written)."""
        gone: dict[int, str] = {}
        for entry in self._text("gone").split(";"):
            if entry:
                worker, _, why = entry.partition(":")
                gone.setdefault(int(worker), why)
        return gone

    def events(self) -> int:
        return self.store.add("events", 0)

    def epoch(self, number: int) -> Epoch | None:
        """Epoch ``number`` if it was proposed."""
        text = self._text(f"epoch/{number}")
        if not text:
            return None
        events, _, members = text.partition("|")
        return Epoch(number, tuple(int(i) for i in members.split(",") if i), int(events))

    def latest(self) -> int:
        """The newest epoch every member of which checked in; -1 before the first."""
        text = self._text("latest")
        return int(text) if text else -1

    # ----------------------------------------------------------------------------- writing

    def register(self) -> int:
        """A new worker id, whose heartbeat starts now; the members form an epoch with it at
        their next step boundary."""
        self.worker = self.store.add("worker_ids", 1) - 1
        self.heartbeat = Heartbeat(*parse_address(self.address), self.worker, self.timeout)
        self.watch = Watch(self.address, self.worker, self.timeout)
        self.store.append("registered", f"{self.worker},")
        self.store.add("events", 1)
        return self.worker

    def check_layout(self, shards: int) -> None:
        """Refuses a worker whose replicas are split over another number of processes than the
        job's: the first worker of a job writes how many (1: unsharded), and every later one must
        match, since shard s of a replica gossips only with shard s of the others."""
        written = self.store.compare_set("replica_shards", "", str(shards)).decode()
        if written != str(shards):
            raise ValueError(
                f"gossip_ext: this replica is sharded over {shards} process"
                f"{'es' if shards > 1 else ''}, but the replicas of the job at {self.address} "
                f"are sharded over {written}; a replica joins with as many shard processes as "
                "the others (a live job is not resharded: resume it from a checkpoint, which "
                "reshards, gossip_ext.sharded.checkpoint)"
            )

    def announce_gone(self, workers: Sequence[int], why: str) -> None:
        """Writes ``workers`` gone, each once: of several workers that find the same peer dead
        (its neighbours, at about the same time), the first to claim it announces it, so that
        the members form one epoch without it, not one per accuser."""
        me = str(self.worker)
        claimed = [w for w in workers if self.store.compare_set(f"gone/{w}", "", me) == me.encode()]
        if not claimed:
            return
        why = why.replace(";", ",").replace("|", "/")
        self.store.append("gone", "".join(f"{w}:{why};" for w in claimed))
        self.store.add("events", 1)

    def mark_leaving(self, epoch: Epoch) -> None:
        self.store.set(f"epoch/{epoch.number}/leaving/{self.worker}", "1")

    def leaving(self, epoch: Epoch, worker: int) -> bool:
        """Whether ``worker`` said it is leaving ``epoch`` alive (for the next one, or the job)."""
        return self.store.check([f"epoch/{epoch.number}/leaving/{worker}"])

    def bump(self) -> None:
        """Tells every member that the membership must be formed again (a failure that accused
        nobody: the next check-in finds who is missing)."""
        self.store.add("events", 1)

    def silent(self, workers: Sequence[int], events: int) -> list[int]:
        """Those of ``workers`` whose heartbeat stays silent for CONFIRM_S (dead or stopped);
        returns early, with none, once the ``events`` count moves on (another worker announced a
        change, which is what to go by)."""
        beats = _Beats(self.store, workers)
        end = time.monotonic() + CONFIRM_S
        while time.monotonic() < end:
            if self.events() != events:
                return []
            time.sleep(HEARTBEAT_S / 2)
        return beats.unchanged(workers)

    def propose(self, number: int, members: Sequence[int], events: int) -> Epoch:
        """Epoch ``number`` with ``members`` unless another proposal came first: the epoch as
        written, the same on every worker."""
        text = f"{events}|{','.join(str(m) for m in sorted(members))}"
        self.store.compare_set(f"epoch/{number}", "", text)
        return self.epoch(number)

    def candidate(self, current: Sequence[int]) -> tuple[list[int], int]:
        """(the members the next epoch should have, the ``events`` count that reflects): the
        current ones and everyone registered, less those gone. The count is read first, so that
        any event after it triggers another epoch."""
        events = self.events()
        gone = self.gone()
        members = sorted((set(current) | set(self.registered())) - set(gone))
        return members, events

    # ----------------------------------------------------------------------------- epochs

    def check_in(self, epoch: Epoch) -> list[int]:
        """Marks this worker present in ``epoch`` and waits for the other members. Returns the
        members that keep the epoch from forming: none (it formed), those written to ``gone``
        meanwhile (no use waiting for them), or those that did not check in within the
        timeout."""
        self.store.set(f"epoch/{epoch.number}/here/{self.worker}", "1")
        keys = [f"epoch/{epoch.number}/here/{m}" for m in epoch.members]
        deadline = time.monotonic() + self.timeout.total_seconds()
        beats = _Beats(self.store, epoch.members)
        while True:
            if self.store.check(keys):
                self.store.set("latest", str(epoch.number))
                return []
            gone = self.gone()
            if any(m in gone for m in epoch.members):
                return [m for m in epoch.members if m in gone]
            away = [m for m, key in zip(epoch.members, keys) if not self.store.check([key])]
            silent = beats.silent(away)
            if silent:
                return silent
            if time.monotonic() > deadline:
                return away
            time.sleep(POLL_S)

    def wait_while_beating(self, key: str, worker: int) -> bytes:
        """The value of ``key`` once written, waiting as long as ``worker``'s heartbeat goes on:
        TimeoutError naming the worker once it is silent for SILENT_S (dead or stopped)."""
        beats = _Beats(self.store, [worker])
        while not self.store.check([key]):
            if beats.silent([worker]):
                raise TimeoutError(
                    f"gossip_ext: the heartbeat of worker {worker} stopped for {SILENT_S:g} s "
                    f"while this process waited for {key!r} (its process died or is stopped)"
                )
            time.sleep(POLL_S)
        return self.store.get(key)

    def wait_for_epoch(self, number: int, deadline: float) -> Epoch | None:
        """Epoch ``number`` once proposed, or None at ``deadline`` (time.monotonic())."""
        while True:
            epoch = self.epoch(number)
            if epoch is not None or time.monotonic() > deadline:
                return epoch
            time.sleep(POLL_S)

    def check_removed(self) -> None:
        """Raises RemovedError if this worker is in ``gone``."""
        why = self.gone().get(self.worker)
        if why is not None:
            raise RemovedError(
                f"gossip_ext: worker {self.worker} was removed from the job at "
                f"{self.address} ({why}); its model is as it was. To take part again, start it "
                "as a new worker (a new GossipDataParallel), which receives the model from a "
                "live member"
            )


class _Beats:
    """The heartbeats of ``workers`` as seen from a check-in or a watch: which stopped for
    SILENT_S. Each look reads every beat it needs, and the ``events`` count, in one request
    (``multi_get``): a watch looks at every beat, and each of N workers reading N - 1 keys one by
    one made N^2 requests per look at the service."""

    def __init__(self, store: dist.Store, workers: Sequence[int]):
        self.store = store
        for w in workers:
            # multi_get waits for a key that does not exist yet (the store's timeout, minutes):
            # a worker that died before its first beat must still read as silent.
            store.add(f"beat/{w}", 0)
        self.events = -1  # the ``events`` count at the latest look (it exists: this registered)
        now = time.monotonic()
        self.seen = {w: (beat, now) for w, beat in zip(workers, self._read(workers))}
        self.read_at = now

    def _read(self, workers: Sequence[int]) -> list[int]:
        events, *beats = self.store.multi_get(["events", *(f"beat/{w}" for w in workers)])
        self.events = int(events)
        return [int(v) for v in beats]

    def unchanged(self, workers: Sequence[int]) -> list[int]:
        """Those of ``workers`` whose heartbeat did not move since this began watching."""
        return [w for w, b in zip(workers, self._read(workers)) if b == self.seen[w][0]]

    def silent(self, workers: Sequence[int]) -> list[int]:
        now = time.monotonic()
        if now - self.read_at < HEARTBEAT_S / 2:  # a watch looks every HEARTBEAT_S, give or take
            return []
        self.read_at = now
        silent = []
        for w, beat in zip(workers, self._read(workers)):
            last, since = self.seen[w]
            if beat != last:
                self.seen[w] = (beat, now)
            elif now - since > SILENT_S:
                silent.append(w)
        return silent


class Heartbeat:
    """Bumps ``beat/ID`` every HEARTBEAT_S from a thread of its own, on a store connection of its
    own, until stopped: how the members forming an epoch tell a dead or stopped worker from one
    that is only busy finishing its step."""

    def __init__(self, host: str, port: int, worker: int, timeout: datetime.timedelta):
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self.key = f"beat/{worker}"
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"gossip_ext heartbeat {worker}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the service is gone; the worker will find out
                return

    def stop(self) -> None:
        self.stopped.set()


class Watch:
    """Watches the heartbeats of the other members of this worker's epoch, from a thread of its
    own on a store connection of its own, while the worker trains in that epoch. A member whose
    heartbeat stays silent for SILENT_S (its process died or is stopped: a busy one still beats)
    is announced gone, and ``on_silent`` is called with why, from this thread: the worker gives up
    a round that waits for that member then, not at the timeout, and every member moves to the
    next epoch without it (its announcement bumps ``events``). A thread apart from the
    heartbeat's: a beat must never wait behind the watch's work (an announcement, a round given
    up, an NCCL communicator aborted)."""

    def __init__(self, address: str, worker: int, timeout: datetime.timedelta):
        self.client = MembershipClient(address, timeout)
        self.client.worker = worker  # its announcements claim in this worker's name
        self._lock = threading.Lock()
        self._following: tuple[Epoch, list[int], Callable[[str], None]] | None = None
        # The highest ``events`` count its looks read: the worker compares it with its epoch's at
        # every step boundary, so that no step waits on a request to the service.
        self.events = -1
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._run, name=f"gossip_ext watch {worker}", daemon=True
        )
        self.thread.start()

    def follow(self, epoch: Epoch, others: Sequence[int], on_silent: Callable[[str], None]):
        """Watches ``others`` (the epoch's members but this worker) until :meth:`pause`."""
        with self._lock:
            self._following = (epoch, list(others), on_silent)

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
        while not self.stopped.wait(HEARTBEAT_S):
            with self._lock:
                following = self._following
            if following is None:
                continue
            epoch, others, on_silent = following
            try:
                if watched is not following:
                    watched, beats, why = following, _Beats(self.client.store, others), None
                elif why is None:
                    why = self._silent(epoch, others, beats)
                    if why is not None:
                        logger.info("gossip_ext epoch %d: %s", epoch.number, why)
            except Exception:  # noqa: BLE001 - the service is gone; the worker will find out
                return
            self.events = max(self.events, beats.events)
            if why is None:
                continue
            # Again at every look until the worker leaves the epoch: a round it starts after the
            # first call (its engine was being built) is given up too.
            with self._lock:  # pause() waits for it: no call reaches the worker's next epoch
                if self._following is following:
                    on_silent(why)

    def _silent(self, epoch: Epoch, others: list[int], beats: _Beats) -> str | None:
        """Why to give up on the members whose heartbeat stopped (announced gone), or None."""
        silent = beats.silent(others)
        if not silent:
            return None
        gone = self.client.gone()
        # One that left on purpose closed its connections: its rounds fail at once.
        silent = [w for w in silent if gone.get(w) != LEFT]
        if not silent:
            return None
        self.client.announce_gone(silent, f"its heartbeat stopped in epoch {epoch.number}")
        return (
            f"the heartbeat of worker{'s' if len(silent) > 1 else ''} "
            f"{', '.join(map(str, silent))} stopped for {SILENT_S:g} s in epoch {epoch.number} "
            "(its process died or is stopped)"
        )
