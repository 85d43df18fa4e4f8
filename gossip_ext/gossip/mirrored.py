"""An engine over copies of tensors whose storage is another owner's: a module sharded by FSDP2
(``gossip_ext.sharded.replicas``) gossips its local shards, which FSDP2's all-gather reads, so the
engine cannot take their storage over as it does whole parameters (``inner.Link.in_place``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class MirroredEngine:
    """An engine (a ``_C.GossipEngine``) over ``mirrors``, copies of the ``shards`` whose storage
    is another owner's. Every call reads through to the engine; the calls that start or absorb a
    round copy the shards in first, and a round absorbed whole is copied back. ``synchronous``:
    the engine sends the mirrors in place while a round is in flight, and the shards do not
    change then (the schedule absorbs before the next step), so only the start copies them in."""

    def __init__(
        self,
        engine: Any,
        shards: Sequence[torch.Tensor],
        mirrors: Sequence[torch.Tensor],
        synchronous: bool,
    ):
        self.engine = engine
        self._shards = list(shards)
        self._mirrors = list(mirrors)
        self._synchronous = synchronous

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    @torch.no_grad()
    def _copy_in(self) -> None:
        torch._foreach_copy_(self._mirrors, self._shards)

    @torch.no_grad()
    def _copy_out(self) -> None:
        torch._foreach_copy_(self._shards, self._mirrors)

    def start_round(self) -> None:
        self._copy_in()  # the optimizer stepped the shards since the last round
        self.engine.start_round()

    def finish_round(self) -> None:
        if not self.engine.in_flight:
            self.engine.finish_round()  # raises a failed round's error, absorbs nothing
            return
        if not self._synchronous:
            self._copy_in()  # overlapped: absorbed into the parameters stepped since it started
        self.engine.finish_round()
        self._copy_out()

    def try_finish_round(self) -> bool:
        if not self.engine.in_flight:
            return bool(self.engine.try_finish_round())
        if not self._synchronous:
            self._copy_in()
        finished = bool(self.engine.try_finish_round())
        if finished:
            self._copy_out()
        return finished
