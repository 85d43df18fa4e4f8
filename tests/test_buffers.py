"""Buffers (BatchNorm's running statistics): averaged by exact averaging, broadcast before the
forward (broadcast_buffers) or gossiped with the parameters (gossip_buffers); real processes over
gloo, with the ranks' own statistics as the oracle."""

from __future__ import annotations

import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

C = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, C), nn.BatchNorm1d(C))


def _own_statistics(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 2, generator=g) * (rank + 1) + rank


def _bn(model) -> nn.BatchNorm1d:
    return model.module[1]


def _statistics(bn: nn.BatchNorm1d) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bn.state_dict().items()}


def _run(rank: int, world_size: int, mode: str) -> dict:
    kwargs = {"broadcast_buffers": mode == "broadcast", "gossip_buffers": mode == "gossip"}
    model = gossip_ext.GossipDataParallel(_net(), **kwargs)
    model(_own_statistics(rank))  # updates this rank's running statistics
    before = _statistics(_bn(model))
    if mode == "average":
        model.average_parameters()
    elif mode == "gossip":
        model.transfer_params()
        model.sync_comms()
    else:
        model(_own_statistics(rank))  # the broadcast comes first, then this batch's update
    return {"before": before, "after": _statistics(_bn(model))}


def test_average_parameters_averages_floating_buffers():
    results = run_ranks(3, _run, "average")
    for key in ("running_mean", "running_var"):
        mean = torch.stack([r["before"][key] for r in results]).mean(0)
        for r in results:
            torch.testing.assert_close(r["after"][key], mean)
    # The integer counter is not averaged (every rank counted the same batches).
    assert all(r["after"]["num_batches_tracked"] == 1 for r in results)


def test_gossip_buffers_mixes_running_statistics_with_the_parameters():
    # Two nodes, one peer each: a uniform round is the exact average.
    results = run_ranks(2, _run, "gossip")
    for key in ("running_mean", "running_var"):
        mean = (results[0]["before"][key] + results[1]["before"][key]) / 2
        for r in results:
            torch.testing.assert_close(r["after"][key], mean)


def test_without_gossip_buffers_a_round_leaves_the_statistics_alone():
    results = run_ranks(2, _run_plain_round)
    for r in results:
        torch.testing.assert_close(r["after"]["running_mean"], r["before"]["running_mean"])


def _run_plain_round(rank: int, world_size: int) -> dict:
    model = gossip_ext.GossipDataParallel(_net())
    model(_own_statistics(rank))
    before = _statistics(_bn(model))
    model.transfer_params()
    model.sync_comms()
    return {"before": before, "after": _statistics(_bn(model))}


def test_broadcast_buffers_gives_every_rank_rank_0s_buffers_before_the_forward():
    results = run_ranks(3, _run, "broadcast")
    # Every rank's second forward starts from rank 0's statistics, then folds in its own batch.
    for rank, r in enumerate(results):
        bn = nn.BatchNorm1d(C)
        bn.load_state_dict(results[0]["before"])
        torch.manual_seed(0)
        linear = nn.Linear(2, C)
        bn(linear(_own_statistics(rank)))
        torch.testing.assert_close(
            r["after"]["running_mean"], bn.running_mean, rtol=1e-5, atol=1e-6
        )
