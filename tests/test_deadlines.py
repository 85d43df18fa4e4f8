"""Deadlines learned from arrival times (``next_due`` in gossip_ext.gossip.mailbox), against
numbers worked by hand: the median interval plus three median absolute deviations after the last
arrival."""

from __future__ import annotations

import pytest

from gossip_ext.gossip import mailbox


def test_nothing_is_due_until_three_intervals_were_seen():
    assert mailbox.next_due([]) is None
    assert mailbox.next_due([0.0, 1.0, 2.0]) is None  # two intervals
    assert mailbox.next_due([0.0, 1.0, 2.0, 3.0]) == pytest.approx(4.0 + mailbox.FLOOR_S)


def test_the_deadline_is_the_median_interval_plus_three_deviations():
    # Intervals 1.0, 1.2, 0.8, 1.1, 5.0 (a stall): median 1.1; deviations 0.1, 0.1, 0.3, 0.0,
    # 3.9, median 0.1. Due at 9.1 + 1.1 + 0.3: the stall does not stretch the deadline.
    arrivals = [0.0, 1.0, 2.2, 3.0, 4.1, 9.1]
    assert mailbox.next_due(arrivals) == pytest.approx(10.5)
    assert mailbox.next_due(arrivals, deviations=1.0) == pytest.approx(10.3)


def test_a_regular_peer_gets_the_floor_of_slack():
    assert mailbox.next_due([0.0, 0.5, 1.0, 1.5, 2.0]) == pytest.approx(2.5 + 0.002)
