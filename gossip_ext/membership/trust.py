"""Who may take part in an elastic job: the job secret, and the seal every value of the membership
store carries with it.

The membership service is a TCPStore, which anyone who reaches its port may read, write, append
to and delete from. So every value a worker acts on (a registration, a worker gone, an epoch's
members, a check-in, a heartbeat, a replica's message to its processes, a group's addresses) is
sealed: ``value~HMAC-SHA256(secret, job | key | value)``. The key is inside the seal, so a
value copied to another key fails; the job's nonce (written by the service once, sealed) is
inside it too, so a value from an earlier job of the same secret fails; values that change
(heartbeats) carry a counter, and a reader takes only a larger one. A value whose seal fails is
ignored and logged once, never acted on.

What the seal does not do: it does not encrypt (a value can be read by whoever reaches the port,
and the workers' gloo and NCCL traffic is plaintext); it does not stop an outsider from deleting
keys or flooding the service, which ends in a clear error (a timeout naming what was missing), not
in a worker acting on a forged value.

Without a secret (:class:`Unsealed`), values are taken as they are: anyone who reaches the port
can join, remove members and read the model, and the service and the first worker say so.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import hmac
import logging
import math
import os
import secrets
import threading
import time
from typing import Protocol

import torch.distributed as dist

from gossip_ext.errors import TamperedStoreError
from gossip_ext.gossip import groups

logger = logging.getLogger("gossip_ext.membership.trust")

SECRET_ENV = "GOSSIP_EXT_JOB_SECRET"
SECRET_FILE_ENV = "GOSSIP_EXT_JOB_SECRET_FILE"
# The key under which the service writes the job's nonce: "open" without a secret.
JOB_KEY = "job"
OPEN = "open"
SEPARATOR = "~"  # between a value and its seal (a seal is hex: no separator inside it)
# Where workers ask the service for the job's nonce (seal_for_job), and its answers' prefix.
CHALLENGES_KEY = "challenges"
CHALLENGE_POLL_S = 0.02
MAX_ANSWERS_PER_LOOK = 64
_SENTINEL = "\x00gossip_ext: no value\x00"

OPEN_PORT_WARNING = (
    f"no job secret is set ({SECRET_ENV} or {SECRET_FILE_ENV}): anyone who reaches the "
    "membership service's port can join this job, remove its workers and receive its model"
)


def job_secret(given: str | bytes | None = None) -> bytes | None:
    """The job's secret: ``given``, else the environment variable GOSSIP_EXT_JOB_SECRET, else the
    contents of the file GOSSIP_EXT_JOB_SECRET_FILE names (surrounding whitespace dropped); None
    where none is set. Never a command-line argument: ``ps`` shows those to every user."""
    if given is None:
        given = os.environ.get(SECRET_ENV) or None
    if given is None and os.environ.get(SECRET_FILE_ENV):
        path = os.environ[SECRET_FILE_ENV]
        try:
            mode = os.stat(path).st_mode
            if mode & 0o077:
                raise ValueError(
                    f"{SECRET_FILE_ENV}={path!r} is readable by other users (mode "
                    f"{mode & 0o777:o}): `chmod 600 {path}`, as ssh asks of a private key"
                )
            with open(path, "rb") as file:
                given = file.read().strip()
        except OSError as error:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} cannot be read: {error}") from error
        if not given:
            raise ValueError(f"{SECRET_FILE_ENV}={path!r} names an empty file")
    if given is None:
        return None
    if isinstance(given, str):
        given = given.encode()
    if not isinstance(given, bytes):
        raise TypeError(f"secret must be a str or bytes, got {type(given).__name__}")
    if len(given) < 16:
        raise ValueError(f"secret must be at least 16 bytes (a random token), got {len(given)}")
    if _entropy_bits(given) < MIN_SECRET_BITS:
        raise ValueError(
            f"secret has about {_entropy_bits(given):.0f} bits of entropy, fewer than "
            f"{MIN_SECRET_BITS}: a guessable secret seals nothing; use a random token, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return given


# A secret's entropy below this is refused: 16 random bytes carry 128, a hex token of 16 digits 64.
MIN_SECRET_BITS = 64


def _entropy_bits(secret: bytes) -> float:
    """An upper estimate of ``secret``'s entropy: its length times the Shannon entropy of its
    bytes' frequencies. It catches a repeated or short-alphabet secret, not a dictionary word."""
    counts = collections.Counter(secret)
    n = len(secret)
    return max(0.0, -n * sum(c / n * math.log2(c / n) for c in counts.values()))


class Seal(Protocol):
    """How the values of the membership store are sealed and opened."""

    authenticated: bool

    def seal(self, key: str, value: str) -> str:
        """``value`` as written under ``key``."""
        ...

    def open(self, key: str, written: str) -> str | None:
        """The value ``written`` under ``key`` carries, or None where its seal fails."""
        ...

    def derive(self, label: str, *fields: str | int) -> bytes | None:
        """A key of this job's own for ``label`` and ``fields`` (a group's pair proofs), or
        None where the job has no secret."""
        ...


class Unsealed:
    """No secret: values are written and taken as they are."""

    authenticated = False

    def seal(self, key: str, value: str) -> str:
        return value

    def open(self, key: str, written: str) -> str | None:
        return written

    def derive(self, label: str, *fields: str | int) -> bytes | None:
        return None


class HmacSeal:
    """Values sealed with HMAC-SHA256 over (the job's nonce, the key, the value)."""

    authenticated = True

    def __init__(self, secret: bytes, nonce: str):
        self._secret = secret
        self._nonce = nonce.encode()
        self._logged: set[str] = set()

    def _mac(self, key: str, value: str) -> str:
        # Fields by their lengths, not a separator: no key and value of one seal are another's.
        message = groups.encode_fields(b"gossip_ext/seal", self._nonce, key, value)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def derive(self, label: str, *fields: str | int) -> bytes | None:
        message = groups.encode_fields(b"gossip_ext/derive", self._nonce, label, *fields)
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def seal(self, key: str, value: str) -> str:
        return f"{value}{SEPARATOR}{self._mac(key, value)}"

    def open(self, key: str, written: str) -> str | None:
        value, sep, mac = written.rpartition(SEPARATOR)
        if sep and hmac.compare_digest(mac, self._mac(key, value)):
            return value
        # Once per key: an outsider writing a key again and again must not flood the log.
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(
                "gossip_ext: ignored a value of %r in the membership store that is not sealed "
                "with this job's secret (written by a process outside the job)",
                key,
            )
        return None


def _job_answer(secret: bytes, nonce: str, challenge: str) -> str:
    message = groups.encode_fields(b"gossip_ext/job", nonce, challenge)
    return f"{nonce}{SEPARATOR}{hmac.new(secret, message, hashlib.sha256).hexdigest()}"


def seal_for_job(
    store: dist.Store, secret: bytes | None, address: str, timeout: datetime.timedelta
) -> Seal:
    """The seal of the job whose service ``store`` reaches. With ``secret``, the job's nonce is
    asked of the service itself: a fresh challenge, which only the running service (or a holder
    of the secret) can answer with the nonce it holds, so a nonce of an earlier job of the same
    secret written back under ``job`` is never taken for this one's. Raises PermissionError where
    the service and this worker disagree on having a secret or the answer is not sealed with it,
    TamperedStoreError naming the challenge where no answer comes within ``timeout``."""
    written = (peek(store, JOB_KEY) or b"").decode(errors="replace")
    if secret is None:
        if written and written != OPEN:
            raise PermissionError(
                f"gossip_ext: the membership service at {address} was started with a job "
                f"secret, and this worker has none: set {SECRET_ENV} (or {SECRET_FILE_ENV}) to "
                "the job's secret, or Elastic(..., secret=...)"
            )
        return Unsealed()
    challenge = secrets.token_hex(16)
    store.append(CHALLENGES_KEY, f"{challenge};")
    key = f"{CHALLENGES_KEY}/{challenge}"
    # A service started without a secret never answers: once its ``job`` says so, a short wait.
    patience = timeout.total_seconds() if written != OPEN else min(timeout.total_seconds(), 2.0)
    deadline = time.monotonic() + patience
    while (answer := peek(store, key)) is None:
        if time.monotonic() > deadline:
            if written == OPEN:
                raise PermissionError(
                    f"gossip_ext: this worker has a job secret, but the membership service at "
                    f"{address} was started without one: start it with {SECRET_ENV} (or "
                    f"{SECRET_FILE_ENV}) set to the same secret"
                )
            raise TamperedStoreError(
                f"gossip_ext: the membership service at {address} did not answer this worker's "
                f"challenge ({key!r}) within {timeout.total_seconds():g} s: is it gossip_ext's "
                "service, and is a process outside the job deleting its keys?",
                key=key,
            )
        time.sleep(CHALLENGE_POLL_S)
    nonce, _, _ = answer.decode(errors="replace").rpartition(SEPARATOR)
    if not hmac.compare_digest(
        answer.decode(errors="replace"), _job_answer(secret, nonce, challenge)
    ):
        raise PermissionError(
            f"gossip_ext: the membership service at {address} holds another secret than this "
            "worker's (its answer to a fresh challenge is not sealed with it): is this the job's "
            "service, and the job's secret?"
        )
    return HmacSeal(secret, nonce)


class JobAnswers:
    """The service's side of :func:`seal_for_job`: a thread that answers every challenge appended
    under ``challenges`` with the job's nonce, sealed with the challenge, until stopped. At most
    MAX_ANSWERS_PER_LOOK a look, so an outsider appending challenges costs the service little."""

    def __init__(self, store: dist.Store, secret: bytes, nonce: str):
        self._store, self._secret, self._nonce = store, secret, nonce
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="gossip_ext job answers", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(CHALLENGE_POLL_S):
            try:
                raw = peek(self._store, CHALLENGES_KEY)
                if not raw:
                    continue
                asked = [c for c in raw.decode(errors="replace").split(";") if _is_challenge(c)]
                for challenge in asked[:MAX_ANSWERS_PER_LOOK]:
                    answer = _job_answer(self._secret, self._nonce, challenge)
                    self._store.set(f"{CHALLENGES_KEY}/{challenge}", answer)
                # Cleared unless more came meanwhile (they are answered at the next look).
                self._store.compare_set(CHALLENGES_KEY, raw.decode(errors="replace"), "")
            except Exception:  # noqa: BLE001 - the store is shutting down with the service
                return

    def stop(self) -> None:
        self._stopped.set()


def _is_challenge(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def start_job(store: dist.Store, secret: bytes | None) -> JobAnswers | None:
    """The service's side: writes ``job`` (the job's nonce, sealed with ``secret``, or ``open``)
    and, with a secret, starts answering the workers' challenges (stop it with the service)."""
    if secret is None:
        store.set(JOB_KEY, OPEN)
        return None
    nonce = secrets.token_hex(16)
    store.set(JOB_KEY, HmacSeal(secret, nonce).seal(JOB_KEY, nonce))
    return JobAnswers(store, secret, nonce)


def peek(store: dist.Store, key: str) -> bytes | None:
    """``key``'s value, or None where none is written; never waits (``get`` waits for a missing
    key, and an outsider may delete any key): compare_set with a sentinel neither writes nor
    waits."""
    value = store.compare_set(key, _SENTINEL, _SENTINEL)
    return None if value == _SENTINEL.encode() else value


class SealedStore(dist.Store):
    """A store whose values are sealed, for torch's own rendezvous over the membership store (an
    epoch group's addresses, an NCCL unique id). A value whose seal fails is waited past: the
    member's own may still come, or come back (an outsider wrote first, or over it); one that is
    not sealed by ``timeout`` raises TamperedStoreError naming the key, and the group is not built
    (the members form the next epoch). Implements what those rendezvous call."""

    def __init__(self, store: dist.Store, seal: Seal, timeout: datetime.timedelta):
        super().__init__()
        self._store = store
        self._seal = seal
        self._timeout = timeout

    def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        self._store.set(key, self._seal.seal(key, bytes(value).hex()))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout.total_seconds()
        while (
            value := self._seal.open(key, self._store.get(key).decode(errors="replace"))
        ) is None:
            if time.monotonic() > deadline:
                raise TamperedStoreError(
                    f"gossip_ext: {key!r} in the membership store held no value sealed with the "
                    f"job's secret for {self._timeout.total_seconds():g} s (a process outside the "
                    "job wrote over it): not connecting",
                    key=key,
                )
            time.sleep(CHALLENGE_POLL_S)
        return bytes.fromhex(value)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._store.wait(keys)
        else:
            self._store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._store.set_timeout(timeout)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise NotImplementedError("a sealed store's values are written with set()")
