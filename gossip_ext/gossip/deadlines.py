"""Deadlines learned from arrival times, not guessed: when a peer's next message is due.

A peer's messages arrive at its own pace. From the times its latest messages arrived, the next is
due at the last arrival plus the median interval plus a few median absolute deviations of the
intervals (robust to the odd stall, unlike a mean and a standard deviation). A wait that runs to
that time and no further lets a message that comes on time count now; one that comes later
counts at the next step, never lost, so a slow peer is never taken for a dead one (only the
wrapper's ``timeout`` of silence names a peer as failed).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

MIN_INTERVALS = 3  # intervals to learn from before any deadline is given
DEVIATIONS = 3.0  # median absolute deviations past the median interval
FLOOR_S = 0.002  # the least slack, so that a perfectly regular peer is not cut off by jitter


def next_due(arrivals: Sequence[float], deviations: float = DEVIATIONS) -> float | None:
    """When the message after ``arrivals`` (times, oldest first) is due; None until
    MIN_INTERVALS intervals were seen."""
    intervals = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
    if len(intervals) < MIN_INTERVALS:
        return None
    median = statistics.median(intervals)
    spread = statistics.median(abs(i - median) for i in intervals)
    return arrivals[-1] + median + max(deviations * spread, FLOOR_S)
