"""Who trains: an elastic job's membership."""

from __future__ import annotations

import dataclasses
import math

from gossip_ext.algorithms._base import Algorithm, check_argument, where
from gossip_ext.membership.epochs import MESSAGES, SEALED, parse_address
from gossip_ext.membership.heartbeats import (
    CONFIRM_BEATS,
    HEARTBEAT_S,
    MIN_HEARTBEAT_S,
    SILENT_S,
    Timings,
)


@dataclasses.dataclass(frozen=True)
class Elastic(Algorithm):
    """An elastic job (:mod:`gossip_ext.membership.elastic`): workers join and leave through the
    membership service at ``address`` (``"HOST:PORT"``, ``python -m gossip_ext.membership --port
    PORT``). The first epoch forms once ``min_workers`` workers registered, and the job stops with a
    TimeoutError naming who is gone when fewer are left (default: 1).

    ``secret`` (default: the environment variable ``GOSSIP_EXT_JOB_SECRET``, or the file that
    ``GOSSIP_EXT_JOB_SECRET_FILE`` names) is the job's secret, shared with the service: every value
    of the membership store is sealed with it, so that a process without it can neither join,
    remove a worker, forge an epoch nor receive the model (:mod:`gossip_ext.membership.trust`).
    ``job`` names the job: a worker of another job (another name, model or configuration) is
    refused before it registers, naming what differs.

    ``messages`` (default ``"sealed"``), with a secret: how gossip_ext's own point-to-point
    messages of an epoch travel: ``"sealed"`` (each carries an AES-GCM tag keyed per epoch and
    link, checked before a byte is absorbed), ``"encrypted"`` (the bodies encrypted too) or
    ``"plain"``. Without a secret every message is plain (``"encrypted"`` is refused: there is
    nothing to key it with). gloo's collectives and NCCL's traffic are never sealed
    (docs/elastic.md, Security).

    ``heartbeat_s`` (default 0.1) is how often each worker's heartbeat beats and its watch looks
    at the others'; ``silent_s`` (default 1.5, at least five beats) how long a heartbeat must be
    silent before its worker is taken for dead or stopped and the others go on without it. A
    worker named by a failed round is taken for dead after five silent beats. Every worker of a
    job must give the same two (a worker with others is refused before it registers).

    .. note::
        A shorter silence finds a stopped worker sooner, and takes for dead a live one whose
        process was not scheduled for that long (a loaded machine); docs/elastic.md weighs them.
    """

    address: str
    min_workers: int = 1
    secret: str | bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    job: str = ""
    heartbeat_s: float = HEARTBEAT_S
    silent_s: float = SILENT_S
    messages: str = SEALED

    def __post_init__(self) -> None:
        check_argument(self, "address", self.address, str, "a str 'HOST:PORT'")
        parse_address(self.address, where(self, "address"))
        check_argument(self, "min_workers", self.min_workers, int, "an int")
        if self.min_workers < 1:
            raise ValueError(f"{where(self, 'min_workers')} must be >= 1, got {self.min_workers}")
        if self.secret is not None and not isinstance(self.secret, (str, bytes)):
            # Not check_argument: its message shows the value, and this one is a secret.
            raise TypeError(
                f"{where(self, 'secret')} must be a str or bytes, got {type(self.secret).__name__}"
            )
        check_argument(self, "job", self.job, str, "a str")
        if self.messages not in MESSAGES:
            raise ValueError(
                f"{where(self, 'messages')} must be one of {', '.join(map(repr, MESSAGES))}, "
                f"got {self.messages!r}"
            )
        for name in ("heartbeat_s", "silent_s"):
            value = getattr(self, name)
            check_argument(self, name, value, (int, float), "a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"{where(self, name)} must be a positive number of seconds, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if self.heartbeat_s < MIN_HEARTBEAT_S:
            # Every beat, and every look of each worker's watch, is a request to the service.
            raise ValueError(
                f"{where(self, 'heartbeat_s')} must be >= {MIN_HEARTBEAT_S:g} s (each beat is a "
                f"request to the membership service), got {self.heartbeat_s!r}"
            )
        least = CONFIRM_BEATS * self.heartbeat_s
        if self.silent_s < least:
            # A watch looks once a beat: a silence of one or two beats is a late beat, not a death.
            raise ValueError(
                f"{where(self, 'silent_s')} must be at least {CONFIRM_BEATS} heartbeats "
                f"({CONFIRM_BEATS} x heartbeat_s={self.heartbeat_s:g} = {least:g} s), so that a "
                f"late beat is not taken for a death, got {self.silent_s!r}"
            )

    def describe(self) -> dict[str, object]:
        """As every algorithm's, without the secret: a description is logged and compared."""
        described = super().describe()
        described.pop("secret", None)
        return described

    @property
    def timings(self) -> Timings:
        """The heartbeat's period and the silences, as the membership's workers keep them."""
        return Timings(self.heartbeat_s, self.silent_s)
