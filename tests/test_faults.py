"""A stalled or dead peer: every other rank raises an error naming the peer instead of hanging."""

import time
from datetime import timedelta

import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext


def _one_rank_stalls(rank: int, world_size: int, stall_s: float) -> dict:
    model = gossip_ext.GossipDataParallel(nn.Linear(3, 1), timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(stall_s)  # never gossips: a stalled worker
        return {}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    model.transfer_params()
    start = time.perf_counter()
    try:
        model(torch.ones(1, 3))
    except TimeoutError as error:
        elapsed = time.perf_counter() - start
        # The engine stays failed: the next call raises the same error instead of waiting again.
        try:
            model.transfer_params()
            repeated = None
        except TimeoutError as again:
            repeated = str(again)
        return {"error": str(error), "elapsed": elapsed, "repeated": repeated}
    return {"error": None}


def test_a_stalled_peer_raises_timeout_naming_the_peer_and_round():
    results = run_ranks(2, _one_rank_stalls, 4.0)
    r = results[0]
    assert r["error"] is not None, "the forward did not time out"
    assert "peers [1]" in r["error"] and "round 0" in r["error"], r["error"]
    # Within the 1 s timeout plus scheduling slack on a loaded machine: no hang.
    assert 0.9 <= r["elapsed"] < 10.0, r["elapsed"]
    assert r["repeated"] == r["error"]


def _disagreeing_ranks(rank: int, world_size: int) -> str:
    graph = (
        gossip_ext.RingGraph() if rank == 2 else gossip_ext.NPeerDynamicDirectedExponentialGraph()
    )
    try:
        gossip_ext.GossipDataParallel(nn.Linear(3, 1), graph=graph)
    except ValueError as error:
        return str(error)
    return ""


def test_ranks_that_disagree_on_the_configuration_all_raise_naming_the_rank():
    errors = run_ranks(3, _disagreeing_ranks)
    for error in errors:  # every rank raises, before any gossip
        assert "rank 2 was configured differently" in error, error
        assert "RingGraph" in error and "NPeerDynamicDirectedExponentialGraph" in error, error
