"""The membership store's protocol: the keys of an elastic job's membership service
(:mod:`gossip_ext.membership.service`) and how a worker registers, reads and forms epochs with them.

Every value a worker acts on is sealed with the job's secret (:mod:`gossip_ext.membership.trust`):
one whose seal fails is ignored, as if it had not been written. The store itself is a hint: no
counter is added to (an outsider's ``set`` of a counter's key makes the service drop every client
that adds to it), the sealed lists are remembered by every worker that read them and written back
where the store lost them (:mod:`gossip_ext.membership.ledger`), and every loop over the store
ends at the timeout in an error naming the key.

The membership is a sequence of epochs, each a sorted list of worker ids (ids are handed out in
order of registration, so the oldest member is rank 0 of every epoch it is in). Nothing here is
a global step: a worker's watch thread reads the count of changes (``events``: the entries of
``registered``, ``gone`` and ``changes`` it knows) with the heartbeats it watches, its training
steps compare it with their epoch's, and it takes part in forming a new epoch only when the
membership changed. The keys:

- ``job``: the job's nonce, written by the service (:func:`trust.start_job`);
- ``fingerprint``: what every worker of the job must be (:mod:`gossip_ext.membership.admission`),
  written by the first;
- ``id/ID``: worker id ID claimed by one process (two that read one count take two ids);
- ``registered``: every worker id that ever registered, appended (``"3,"``);
- ``gone``: the ids that left or were removed, with why (``"3:died;"``), appended;
- ``changes``: sealed entries ``"ID:TOKEN;"``, a member's word that the membership must be formed
  again (a failure that accused nobody); the ``events`` count is how many entries of
  ``registered``, ``gone`` and ``changes`` a worker knows;
- ``epoch/E``: ``"<events>|<ids>"``, the members of epoch E and the ``events`` count they reflect,
  written once (compare-and-set: the first proposal wins, every worker reads the same list);
- ``epoch/E/here/ID``: member ID reached epoch E (its check-in);
- ``epoch/E/leaving/ID``: member ID is leaving epoch E alive (before it drops its connections);
- ``latest``: the newest epoch whose members all checked in;
- ``ready/ID``: worker ID holds the job's state (it trained, or received it from a donor);
- ``beat/ID``: worker ID's heartbeat, a count its own thread raises every ``heartbeat_s`` (a
  count that does not rise, or is not sealed, is no beat);
- ``replica/ID/told/N``: what worker ID, the leader of a sharded replica, told its replica's other
  processes the N-th time (gossip_ext.sharded.elastic: the epoch it formed, or why it stopped).

A worker that forms epoch E + 1 proposes ``(members of E, and everyone registered) - gone``; each
proposed member checks in and waits for the others; one that does not check in, and whose
heartbeat stopped for ``silent_s`` (it died, or its process is stopped) or that stays away for the
timeout, is written to ``gone`` as not having reached the epoch, and the next epoch is formed
without it. A worker that finds itself in ``gone`` was removed (it stalled past the timeout, or
left), and is told so.
"""

from __future__ import annotations

import datetime
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from gossip_ext.errors import TamperedStoreError
from gossip_ext.gossip import groups, transport
from gossip_ext.membership import epoch_group, ledger, trust
from gossip_ext.membership.heartbeats import (  # noqa: F401 - the protocol's defaults, here too
    CONFIRM_S,
    DEFAULT_TIMINGS,
    HEARTBEAT_S,
    LEFT,
    SILENT_S,
    Beats,
    Heartbeat,
    Timings,
    Watch,
)

POLL_S = 0.01  # how often a waiting worker looks again at a key another worker will write
# How an epoch's own messages travel (Elastic(messages=...)): Note [Sealed messages].
PLAIN, SEALED, ENCRYPTED = "plain", "sealed", "encrypted"
MESSAGES = (PLAIN, SEALED, ENCRYPTED)


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


def _parse_epoch(number: int, text: str) -> Epoch | None:
    """Epoch ``number`` as its (opened) value ``"<events>|<ids>"`` says; None where it does not
    parse (a value sealed by the job's workers always does)."""
    events, _, members = text.partition("|")
    ids = [i for i in members.split(",") if i]
    if not events.isdigit() or not all(i.isdigit() for i in ids):
        return None
    return Epoch(number, tuple(int(i) for i in ids), int(events))


class RemovedError(RuntimeError):
    """This worker is no longer a member of the job: it stalled past the timeout or left. A new
    GossipDataParallel (a new worker) can join again."""


class MembershipClient:
    """One worker's view of the membership service at ``address``: registration, epochs,
    announcements, each value sealed with the job's ``secret`` (None: an open job). Every wait
    is bounded by ``timeout``; its heartbeat and the watch over the others' keep the job's
    ``timings``."""

    def __init__(
        self,
        address: str,
        timeout: datetime.timedelta,
        secret: bytes | None = None,
        timings: Timings = DEFAULT_TIMINGS,
    ):
        host, port = parse_address(address)
        self.secret = secret
        self.timings = timings
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
        self.seal = trust.seal_for_job(self.store, secret, address, timeout)
        self._registered = ledger.Ledger(self.store, self.seal, "registered", ",")
        self._gone = ledger.Ledger(self.store, self.seal, "gone", ";")
        self._changes = ledger.Ledger(self.store, self.seal, "changes", ";")
        self._ledgers = (self._registered, self._gone, self._changes)
        self.worker = -1
        self.heartbeat: Heartbeat | None = None
        self.watch: Watch | None = None

    # ----------------------------------------------------------------------------- reading

    def _text(self, key: str) -> str:
        """The value of ``key``; "" where none is written or its seal fails. Never waits."""
        raw = (trust.peek(self.store, key) or b"").decode(errors="replace")
        return (self.seal.open(key, raw) or "") if raw else ""

    def put(self, key: str, value: str) -> None:
        """``value`` under ``key``, sealed."""
        self.store.set(key, self.seal.seal(key, value))

    def claim(self, key: str, value: str, deadline: float | None = None) -> str:
        """Writes ``value`` under ``key`` unless another worker of the job wrote first: the value
        that stays, the same on every worker. A value an outsider wrote first is replaced (only
        if it is still that value: two workers replacing it never overwrite each other), and a
        key deleted meanwhile is written afresh. TamperedStoreError naming the key where no
        sealed value stays by ``deadline`` (time.monotonic(); default: the timeout from now)."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout.total_seconds()
        mine = self.seal.seal(key, value)
        written = self.store.compare_set(key, "", mine).decode(errors="replace")
        while (opened := self.seal.open(key, written)) is None:
            if time.monotonic() > deadline:
                raise TamperedStoreError(
                    f"gossip_ext: worker {self.worker} could not claim {key!r} in the membership "
                    f"store at {self.address} within {self.timeout.total_seconds():g} s: a "
                    "process without the job's secret keeps writing or deleting it",
                    key=key,
                )
            expected = written if trust.peek(self.store, key) is not None else ""
            written = self.store.compare_set(key, expected, mine).decode(errors="replace")
        return opened

    def build_group(
        self, epoch: Epoch, rank: int, backend: str, part: str = ""
    ) -> dist.ProcessGroup:
        """The group of ``epoch`` (its ``part``: ``epoch_group.build``), as rank ``rank``, over
        the sealed rendezvous; in a job with a secret every connection of it then proves it
        holds the secret before the group carries anything (``groups.prove_pairs``), or the
        group is released and UnprovenPeerError raised naming the ranks whose proof failed.
        Collective over the epoch's members."""
        group = epoch_group.build(
            self.rendezvous_store,
            epoch.number,
            rank,
            len(epoch.members),
            backend,
            self.timeout,
            part=part,
        )
        key = self.seal.derive("pairs", epoch.number, part)
        if key is None:
            return group
        try:
            groups.prove_pairs(group, key, f"epoch {epoch.number}{part}".encode(), self.timeout)
        except BaseException:
            epoch_group.release(group)
            raise
        return group

    def link_sealing(self, epoch: Epoch, messages: str, part: str = "") -> transport.Sealing | None:
        """How the engine's messages of ``epoch`` (its ``part``) are sealed on the wire, as
        ``messages`` ("plain", "sealed", "encrypted") asks: each direction of each link keyed by
        the job's secret, the epoch and both workers' ids (Note [Sealed messages]). None in a job
        without a secret, or with "plain"."""
        seal = self.seal
        if messages == PLAIN or not seal.authenticated:
            return None
        members = epoch.members

        def key(sender: int, receiver: int) -> bytes:
            derived = seal.derive("link", epoch.number, part, members[sender], members[receiver])
            if derived is None:  # an authenticated seal always derives: a bug of ours
                raise RuntimeError("gossip_ext: the job's seal derived no key for a link")
            return derived

        return transport.Sealing(key, encrypt=messages == ENCRYPTED)

    @property
    def rendezvous_store(self) -> dist.Store:
        """The store torch's own rendezvous use (an epoch group's addresses, an NCCL id): sealed
        where the job has a secret."""
        if not self.seal.authenticated:
            return self.store
        return trust.SealedStore(self.store, self.seal, self.timeout)

    def registered(self) -> list[int]:
        return [int(i) for i in self._registered.read() if i.isdigit()]

    def gone(self) -> dict[int, str]:
        """Worker id -> why it is gone (the first reason written)."""
        gone: dict[int, str] = {}
        for entry in self._gone.read():
            worker, _, why = entry.partition(":")
            if worker.isdigit():
                gone.setdefault(int(worker), why)
        return gone

    def events(self) -> int:
        """How many changes of the membership this worker knows: the entries of ``registered``,
        ``gone`` and ``changes``, the store read now (two requests)."""
        raws = ledger.read_keys(self.store, [book.key for book in self._ledgers])
        return sum(len(book.merge(raw)) for book, raw in zip(self._ledgers, raws))

    def epoch(self, number: int) -> Epoch | None:
        """Epoch ``number`` if it was proposed."""
        text = self._text(f"epoch/{number}")
        if not text:
            return None
        return _parse_epoch(number, text)

    def latest(self) -> int:
        """The newest epoch every member of which checked in; -1 before the first."""
        text = self._text("latest")
        return int(text) if text.isdigit() else -1

    def mark_ready(self) -> None:
        """This worker holds the job's state (see ElasticWorker.mark_ready)."""
        self.put(f"ready/{self.worker}", "1")

    def is_ready(self, worker: int) -> bool:
        return self._text(f"ready/{worker}") == "1"

    # ----------------------------------------------------------------------------- writing

    def register(self) -> int:
        """A new worker id, whose heartbeat starts now; the members form an epoch with it at
        their next step boundary."""
        token = secrets.token_hex(8)
        # The first id no worker claimed: ids are claimed in order, so the count of those
        # registered is where to look first (a count an outsider lowered costs a few claims).
        worker = len(self.registered())
        deadline = time.monotonic() + self.timeout.total_seconds()
        while self.claim(f"id/{worker}", token, deadline) != token:
            worker += 1
        self.worker = worker
        self.heartbeat = Heartbeat(
            self.address, self.timeout, self.seal, self.worker, self.timings.heartbeat_s
        )
        watcher = MembershipClient(self.address, self.timeout, self.secret, self.timings)
        watcher.worker = self.worker  # its announcements claim in this worker's name
        self.watch = Watch(watcher)
        self._registered.add([str(self.worker)])
        return self.worker

    def announce_gone(self, workers: Sequence[int], why: str) -> None:
        """Writes ``workers`` gone, each once: of several workers that find the same peer dead
        (its neighbours, at about the same time), the first to claim it announces it, so that
        the members form one epoch without it, not one per accuser."""
        me = str(self.worker)
        claimed = [w for w in workers if self.claim(f"gone/{w}", me) == me]
        if not claimed:
            return
        why = why.replace(";", ",").replace("|", "/").replace(trust.SEPARATOR, "-")
        self._gone.add([f"{w}:{why}" for w in claimed])

    def mark_leaving(self, epoch: Epoch) -> None:
        self.put(f"epoch/{epoch.number}/leaving/{self.worker}", "1")

    def leaving(self, epoch: Epoch, worker: int) -> bool:
        """Whether ``worker`` said it is leaving ``epoch`` alive (for the next one, or the job)."""
        return self._text(f"epoch/{epoch.number}/leaving/{worker}") == "1"

    def bump(self) -> None:
        """Tells every member that the membership must be formed again (a failure that accused
        nobody: the next check-in finds who is missing)."""
        self._changes.add([f"{self.worker}:{secrets.token_hex(8)}"])

    def silent(self, workers: Sequence[int], events: int) -> list[int]:
        """Those of ``workers`` whose heartbeat stays silent for ``confirm_s`` (dead or stopped);
        returns early, with none, once the ``events`` count moves on (another worker announced a
        change, which is what to go by)."""
        beats = Beats(self.store, self.seal, workers, self.timings)
        end = time.monotonic() + self.timings.confirm_s
        while time.monotonic() < end:
            if self.events() != events:
                return []
            time.sleep(self.timings.heartbeat_s / 2)
        return beats.unchanged(workers)

    def propose(self, number: int, members: Sequence[int], events: int) -> Epoch:
        """Epoch ``number`` with ``members`` unless another proposal came first: the epoch as
        written, the same on every worker."""
        text = f"{events}|{','.join(str(m) for m in sorted(members))}"
        return _parse_epoch(number, self.claim(f"epoch/{number}", text))

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
        self.put(f"epoch/{epoch.number}/here/{self.worker}", "1")
        keys = [f"epoch/{epoch.number}/here/{m}" for m in epoch.members]
        deadline = time.monotonic() + self.timeout.total_seconds()
        beats = Beats(self.store, self.seal, epoch.members, self.timings)
        while True:
            away = [m for m, key in zip(epoch.members, keys) if not self._here(key)]
            if not away:
                self.put("latest", str(epoch.number))
                return []
            gone = self.gone()
            if any(m in gone for m in epoch.members):
                return [m for m in epoch.members if m in gone]
            silent = beats.silent(away)
            if silent:
                return silent
            if time.monotonic() > deadline:
                return away
            time.sleep(POLL_S)

    def _here(self, key: str) -> bool:
        return self._text(key) == "1"

    def wait_while_beating(self, key: str, worker: int) -> str:
        """The value of ``key`` once written (and sealed), waiting as long as ``worker``'s
        heartbeat goes on: TimeoutError naming the worker once it is silent for ``silent_s``
        (dead or stopped)."""
        beats = Beats(self.store, self.seal, [worker], self.timings)
        while not self._text(key):
            if beats.silent([worker]):
                raise TimeoutError(
                    f"gossip_ext: the heartbeat of worker {worker} stopped for "
                    f"{self.timings.silent_s:g} s "
                    f"while this process waited for {key!r} (its process died or is stopped)"
                )
            time.sleep(POLL_S)
        return self._text(key)

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
