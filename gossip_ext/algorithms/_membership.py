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
    TimeoutError naming who is gone when fewer are left (default: 1)."""

    address: str
    min_workers: int = 1

    def __post_init__(self) -> None:
        check_argument(self, "address", self.address, str, "a str 'HOST:PORT'")
        parse_address(self.address, where(self, "address"))
        check_argument(self, "min_workers", self.min_workers, int, "an int")
        if self.min_workers < 1:
            raise ValueError(f"{where(self, 'min_workers')} must be >= 1, got {self.min_workers}")
