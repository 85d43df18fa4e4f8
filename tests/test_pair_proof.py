"""Every connection of a group gossip_ext builds for an elastic epoch proves, over the connection
itself, that its other end holds the job's secret before the group carries anything
(gossip_ext.gossip.groups.prove_pairs), on real processes over gloo.

An outsider that took a member's place on a gloo connection holds that connection and speaks
gloo, but not the secret: here it is a rank of the group whose key is not the job's (or that
answers with bytes of another size, or not at all). The honest ranks refuse it, naming it, within
the timeout, and before any other message moves; with the right key the group is proven and
carries messages as before."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from multiprocess import run_ranks

from gossip_ext.errors import UnprovenPeerError
from gossip_ext.gossip import groups

KEY = b"a key of this epoch's own, 32 bytes"
TIMEOUT = timedelta(seconds=3)


def _prove(rank, world_size, outsider, behaviour):
    group = dist.group.WORLD
    began = time.monotonic()
    if rank == outsider and behaviour == "silent":
        time.sleep(TIMEOUT.total_seconds() + 1.0)  # holds the connections, answers nothing
        return {"refused": None, "seconds": time.monotonic() - began}
    if rank == outsider and behaviour == "wrong size":
        # Answers every challenge with a message of another length than an answer's.
        for peer in range(world_size):
            if peer != rank:
                dist.send(torch.zeros(7, dtype=torch.uint8), peer)
        time.sleep(TIMEOUT.total_seconds() + 1.0)
        return {"refused": None, "seconds": time.monotonic() - began}
    key = b"a guess at the key, 32 bytes long" if rank == outsider else KEY
    try:
        groups.prove_pairs(group, key, b"epoch 3", TIMEOUT)
    except UnprovenPeerError as error:
        seconds = time.monotonic() - began
        return {"refused": list(error.peers), "message": str(error), "seconds": seconds}
    # Proven: the group carries the job's messages as before.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"refused": [], "sum": float(total), "seconds": time.monotonic() - began}


def test_with_the_jobs_key_every_connection_is_proven_and_the_group_carries_on():
    results = run_ranks(3, _prove, -1, "")
    for rank, result in enumerate(results):
        assert result["refused"] == [], (rank, result)
        assert result["sum"] == 0.0 + 1.0 + 2.0


def test_a_rank_without_the_key_is_refused_by_every_other_naming_it_within_the_timeout():
    results = run_ranks(3, _prove, 2, "guess")
    for rank in (0, 1):
        assert results[rank]["refused"] == [2], results[rank]
        assert "rank 2" in results[rank]["message"] and "secret" in results[rank]["message"]
        assert results[rank]["seconds"] < TIMEOUT.total_seconds() + 2.0, results[rank]
    # The outsider's own proof of the others fails too: it cannot tell a right answer.
    assert sorted(results[2]["refused"]) == [0, 1]


def test_an_outsider_that_answers_nothing_or_with_other_bytes_is_refused_within_the_timeout():
    results = run_ranks(3, _prove, 1, "silent")
    for rank in (0, 2):
        assert results[rank]["refused"] == [1], results[rank]
        assert results[rank]["seconds"] < TIMEOUT.total_seconds() + 2.0, results[rank]
    # A message of another size breaks its receiver's whole gloo context (gloo's own doing): the
    # honest rank it reached closes its other connections too, so the others may name it beside
    # the outsider. The group is refused all the same, and the refusal accuses nobody.
    results = run_ranks(3, _prove, 1, "wrong size")
    for rank in (0, 2):
        assert 1 in results[rank]["refused"], results[rank]
        assert results[rank]["seconds"] < TIMEOUT.total_seconds() + 2.0, results[rank]


def test_fields_encode_unambiguously():
    # A separator inside a field would make these two lists of fields one string.
    assert groups.encode_fields("a|b", "c") != groups.encode_fields("a", "b|c")
    assert groups.encode_fields("ab", "") != groups.encode_fields("a", "b")
    assert groups.encode_fields(12) == groups.encode_fields("12")


def _handoff_of(rank, world_size, announced):
    from gossip_ext.membership import handoff

    group = dist.group.WORLD
    if rank == 0:  # the donor's side, announcing a size of its choosing
        dist.send(torch.tensor([announced], dtype=torch.int64), 1, group)
        return None
    limit = handoff.handoff_limit(torch.nn.Linear(8, 2))
    try:
        handoff.receive_state(0, group, torch.device("cpu"), limit)
    except ValueError as error:
        return str(error)
    return "taken"


def test_a_handoff_announcing_more_than_the_job_can_take_is_refused_before_allocating():
    for announced in (10**15, 0, -5):
        refused = run_ranks(2, _handoff_of, announced)[1]
        assert f"a state of {announced} bytes" in refused and "before anything" in refused


def _liveness(rank, world_size):
    from gossip_ext._torch_check import _C

    group, store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    wait = timedelta(seconds=2)
    if rank == 1:
        responder = _C.LivenessResponder(group)
        store.set("answering", "1")
        store.wait(["asked"])
        responder.close()  # stops answering, as a stopped process would
        store.set("closed", "1")
        store.wait(["done"])
        return None
    store.wait(["answering"])
    answered = _C.ping(group, 1, wait)
    store.set("asked", "1")
    store.wait(["closed"])
    began = time.monotonic()
    silent = _C.ping(group, 1, wait)
    took = time.monotonic() - began
    store.set("done", "1")
    return answered, silent, took


def test_a_member_answers_a_ping_over_the_group_and_one_that_stopped_answering_does_not():
    answered, silent, took = run_ranks(2, _liveness)[0]
    assert answered and not silent
    assert 1.9 <= took < 4.0  # the ping's own wait, then aborted: no gloo wait ran out
