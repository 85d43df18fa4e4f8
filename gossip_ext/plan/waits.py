"""Who a worker waits for before its next step, mode by mode: the schedules that
``simulation.simulate`` plays out over drawn step times (``cost.Mode.schedule`` builds one a run).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence


class Schedule(abc.ABC):
    """Who a worker waits for before its next step: given every worker's start and compute
    finish of step ``k`` (0-based), the starts of step ``k + 1``. A schedule may keep what it
    needs of earlier steps (a link still busy, a message in flight): one per run."""

    # The steps after which the schedule repeats (an outer step's period): a run is read over
    # whole periods.
    period: int = 1

    @abc.abstractmethod
    def next_starts(
        self, k: int, starts: Sequence[float], finishes: Sequence[float]
    ) -> list[float]: ...


class OwnPace(Schedule):
    """Every worker at its own pace (asynchronous gossip): its next step starts after its own
    compute and ``kernels``."""

    def __init__(self, kernels: float = 0.0):
        self.kernels = kernels

    def next_starts(
        self, k: int, starts: Sequence[float], finishes: Sequence[float]
    ) -> list[float]:
        return [f + self.kernels for f in finishes]


class Lockstep(Schedule):
    """Every worker waits for every other at every step (an all-reduce): the step ends when the
    slowest worker's ``communication`` has, which the last ``hidden`` share of each worker's
    compute (DDP's backward) overlaps but for its ``tail`` (the part that starts only once the
    compute ends: DDP's last bucket), after its ``kernels``."""

    def __init__(
        self, communication: float, hidden: float = 0.0, kernels: float = 0.0, tail: float = 0.0
    ):
        self.communication = communication
        self.hidden = hidden
        self.kernels = kernels
        self.tail = tail

    def next_starts(
        self, k: int, starts: Sequence[float], finishes: Sequence[float]
    ) -> list[float]:
        end = max(
            f + self.kernels + max(self.tail, self.communication - self.hidden * (f - s))
            for s, f in zip(starts, finishes)
        )
        return [end] * len(starts)


class EveryFew(Schedule):
    """Every worker at its own pace but every ``every`` steps, where all wait for the slowest
    and then pay ``communication`` (an outer step's all-reduce), less what ``hide`` steps of the
    slowest worker's compute overlap (a Streaming DiLoCo fragment's ``delay``), times ``share``
    (the part of a period's fragments one barrier stands for); every step also pays
    ``per_step`` after its compute (a CPU worker's copies of what it sends)."""

    def __init__(
        self,
        every: int,
        communication: float,
        hide: int = 0,
        share: float = 1.0,
        per_step: float = 0.0,
    ):
        self.every = self.period = every
        self.communication = communication
        self.hide = hide
        self.share = share
        self.per_step = per_step

    def next_starts(
        self, k: int, starts: Sequence[float], finishes: Sequence[float]
    ) -> list[float]:
        slowest = max(f - s for s, f in zip(starts, finishes))  # the compute that hides
        finishes = [f + self.per_step for f in finishes]
        if (k + 1) % self.every:
            return finishes
        barrier = self.share * max(0.0, self.communication - self.hide * slowest)
        return [max(finishes) + barrier] * len(finishes)


class Neighbours(Schedule):
    """A gossip round a step on the exponential graph (the engine's default, one peer a round):
    at round ``k`` worker ``i`` sends its message to ``i + 2^(k mod ceil(log2 n))`` and receives
    one from ``i - 2^(k mod ceil(log2 n))``. A message holds its sender's link for ``wire`` (one
    after another) and arrives ``latency`` later.
    Synchronous: the next step starts once this round's message arrived and its own was sent.
    ``overlap``: once the previous round's message arrived (the round runs beside the step)."""

    def __init__(self, wire: float, latency: float, kernels: float = 0.0, overlap: bool = False):
        self.wire, self.latency, self.kernels, self.overlap = wire, latency, kernels, overlap
        self.link_free: list[float] = []
        self.arrived: list[float] = []  # the previous round's message, for overlap

    @staticmethod
    def in_peer(i: int, k: int, n: int) -> int:
        return (i - 2 ** (k % max(1, math.ceil(math.log2(n))))) % n

    def next_starts(
        self, k: int, starts: Sequence[float], finishes: Sequence[float]
    ) -> list[float]:
        n = len(finishes)
        if not self.link_free:
            self.link_free = [0.0] * n
        sent = [max(f, free) + self.wire for f, free in zip(finishes, self.link_free)]
        self.link_free = sent
        arrived = [sent[self.in_peer(i, k, n)] + self.latency for i in range(n)]
        if not self.overlap:
            return [max(sent[i], arrived[i]) + self.kernels for i in range(n)]
        before, self.arrived = self.arrived, arrived
        if not before:  # the first round has no round before it to wait for
            return [f + self.kernels for f in finishes]
        return [max(finishes[i], before[i]) + self.kernels for i in range(n)]
