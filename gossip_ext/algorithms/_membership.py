"""Who trains: an elastic job's membership."""

from __future__ import annotations

import dataclasses

from gossip_ext.algorithms._base import Algorithm, check_argument, where
from gossip_ext.membership.epochs import parse_address


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
    refused before it registers, naming what differs."""

    address: str
    min_workers: int = 1
    secret: str | bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    job: str = ""

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

    def describe(self) -> dict[str, object]:
        """As every algorithm's, without the secret: a description is logged and compared."""
        described = super().describe()
        described.pop("secret", None)
        return described
