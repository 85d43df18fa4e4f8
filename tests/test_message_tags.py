"""The compiled engine's one registry of message tags (csrc/transport/message_tags.h), as the
Python layer reads it: every kind of message on a process group has a range of its own, the
ranges fit c10d's int tags, and the tags each kind makes stay in its range."""

from __future__ import annotations

import itertools

from gossip_ext._torch_check import _C
from gossip_ext.gossip import transport

KINDS = ("round", "outer_exchange", "liveness", "mailbox")


def _ranges() -> dict[str, range]:
    ranges = {}
    for kind in KINDS:
        base, span = _C.MESSAGE_TAGS[kind]
        ranges[kind] = range(base, base + span)
    return ranges


def test_the_ranges_are_disjoint_and_fit_an_int():
    ranges = _ranges()
    for a, b in itertools.combinations(KINDS, 2):
        assert ranges[a].stop <= ranges[b].start or ranges[b].stop <= ranges[a].start, (a, b)
    assert min(r.start for r in ranges.values()) >= 0
    assert max(r.stop for r in ranges.values()) <= 2**31


def test_each_kinds_tags_stay_in_its_range_as_they_wrap():
    ranges = _ranges()
    for sequence in (0, 1, 15, 2**29 - 1, 2**29, 2**40 + 3):
        assert transport.outer_exchange_tag(sequence) in ranges["outer_exchange"], sequence
    bits = _C.MESSAGE_TAGS["mailbox_sequence_bits"]
    for generation, sequence in itertools.product((0, 1, 63, 64, 1000), (0, 1, 2**bits, 2**50)):
        assert _C.mailbox_tag(generation, sequence) in ranges["mailbox"], (generation, sequence)


def test_asynchronous_messages_of_two_generations_or_sequences_never_share_a_tag():
    bits = _C.MESSAGE_TAGS["mailbox_sequence_bits"]
    generations = _C.MESSAGE_TAGS["mailbox"][1] >> bits
    # Every generation in a row of them, each with the messages a pair can have in flight.
    tags = [_C.mailbox_tag(g, s) for g in range(generations) for s in range(8)]
    assert len(set(tags)) == len(tags)
    # The sequence wraps only past 2^bits messages between two workers, and never leaves the
    # range, whatever the numbers.
    assert _C.mailbox_tag(3, 0) == _C.mailbox_tag(3, 2**bits) != _C.mailbox_tag(3, 2**bits - 1)
    assert _C.mailbox_tag(-1, -1) in _ranges()["mailbox"]
