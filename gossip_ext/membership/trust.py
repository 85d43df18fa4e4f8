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

import datetime
import hashlib
import hmac
import logging
import os
import secrets
from typing import Protocol

import torch.distributed as dist

logger = logging.getLogger("gossip_ext.membership.trust")

SECRET_ENV = "GOSSIP_EXT_JOB_SECRET"
SECRET_FILE_ENV = "GOSSIP_EXT_JOB_SECRET_FILE"
# The key under which the service writes the job's nonce: "open" without a secret.
JOB_KEY = "job"
OPEN = "open"
SEPARATOR = "~"  # between a value and its seal (a seal is hex: no separator inside it)

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
    return given


class Seal(Protocol):
    """How the values of the membership store are sealed and opened."""

    authenticated: bool

    def seal(self, key: str, value: str) -> str:
        """``value`` as written under ``key``."""
        ...

    def open(self, key: str, written: str) -> str | None:
        """The value ``written`` under ``key`` carries, or None where its seal fails."""
        ...


class Unsealed:
    """No secret: values are written and taken as they are."""

    authenticated = False

    def seal(self, key: str, value: str) -> str:
        return value

    def open(self, key: str, written: str) -> str | None:
        return written


class HmacSeal:
    """Values sealed with HMAC-SHA256 over (the job's nonce, the key, the value)."""

    authenticated = True

    def __init__(self, secret: bytes, nonce: str):
        self._secret = secret
        self._nonce = nonce.encode()
        self._logged: set[str] = set()

    def _mac(self, key: str, value: str) -> str:
        message = b"|".join((self._nonce, key.encode(), value.encode()))
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

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


def seal_for_job(store: dist.Store, secret: bytes | None, address: str) -> Seal:
    """The seal of the job whose service ``store`` reaches: its nonce checked with ``secret``.
    Raises PermissionError where the service and this worker disagree on having a secret, or
    where the service's nonce is not sealed with this secret (another job's service, or another
    secret)."""
    written = store.get(JOB_KEY).decode() if store.check([JOB_KEY]) else ""
    if secret is None:
        if written and written != OPEN:
            raise PermissionError(
                f"gossip_ext: the membership service at {address} was started with a job "
                f"secret, and this worker has none: set {SECRET_ENV} (or {SECRET_FILE_ENV}) to "
                "the job's secret, or Elastic(..., secret=...)"
            )
        return Unsealed()
    if written == OPEN or not written:
        raise PermissionError(
            f"gossip_ext: this worker has a job secret, but the membership service at {address} "
            f"was started without one: start it with {SECRET_ENV} (or {SECRET_FILE_ENV}) set to "
            "the same secret"
        )
    nonce, _, _ = written.rpartition(SEPARATOR)
    if HmacSeal(secret, nonce).open(JOB_KEY, written) is None:
        raise PermissionError(
            f"gossip_ext: the membership service at {address} holds another secret than this "
            "worker's (its job nonce is not sealed with it): is this the job's service, and the "
            "job's secret?"
        )
    return HmacSeal(secret, nonce)


def start_job(store: dist.Store, secret: bytes | None) -> None:
    """The service's side: writes the job's nonce, sealed with ``secret`` (or ``open``)."""
    if secret is None:
        store.set(JOB_KEY, OPEN)
        return
    nonce = secrets.token_hex(16)
    store.set(JOB_KEY, HmacSeal(secret, nonce).seal(JOB_KEY, nonce))


class SealedStore(dist.Store):
    """A store whose values are sealed, for torch's own rendezvous over the membership store (an
    epoch group's addresses, an NCCL unique id): a value whose seal fails raises, and the group is
    not built (the members form the next epoch). Implements what those rendezvous call."""

    def __init__(self, store: dist.Store, seal: Seal):
        super().__init__()
        self._store = store
        self._seal = seal

    def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        self._store.set(key, self._seal.seal(key, bytes(value).hex()))

    def get(self, key: str) -> bytes:
        value = self._seal.open(key, self._store.get(key).decode())
        if value is None:
            raise RuntimeError(
                f"gossip_ext: {key!r} in the membership store is not sealed with the job's "
                "secret (written by a process outside the job): not connecting"
            )
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
