"""LocalSGD as the base algorithm (base_algorithm="localsgd"), on real processes over gloo.

The oracle: every rank trains alone with plain torch SGD, and every ``k``-th step the ranks'
parameters are replaced by their plain mean, computed here from all ranks' values.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

D = 5
LR = 0.1
STEPS = 7
EVERY = 3


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, D, generator=g), torch.randn(4, 1, generator=g)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 3), nn.Tanh(), nn.Linear(3, 1))


def _train_localsgd(rank: int, world_size: int) -> dict:
    model = gossip_ext.GossipDataParallel(_net(), base_algorithm="localsgd", global_avg_freq=EVERY)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model.transfer_params()
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "bytes_sent": model.bytes_sent,
        "engine": model.runtime.mix.engine is not None,
    }


def _reference(world_size: int) -> list[list[torch.Tensor]]:
    nets = [_net() for _ in range(world_size)]
    opts = [torch.optim.SGD(n.parameters(), lr=LR, momentum=0.9) for n in nets]
    for step in range(STEPS):
        for rank, (net, opt) in enumerate(zip(nets, opts)):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        if (step + 1) % EVERY == 0:
            with torch.no_grad():
                for ps in zip(*(n.parameters() for n in nets)):
                    mean = torch.stack(ps).mean(0)
                    for p in ps:
                        p.copy_(mean)
    return [[p.detach() for p in n.parameters()] for n in nets]


@pytest.mark.parametrize("world_size", [2, 3])
def test_localsgd_trains_alone_and_averages_every_k_steps(world_size):
    results = run_ranks(world_size, _train_localsgd)
    expected = _reference(world_size)
    for rank, result in enumerate(results):
        assert result["bytes_sent"] == 0 and not result["engine"]
        for got, want in zip(result["params"], expected[rank]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The last average was at step 6; step 7 trained alone: the ranks differ again.
    assert not torch.equal(results[0]["params"][0], results[1]["params"][0])


def _without_averaging(rank: int, world_size: int) -> str:
    try:
        gossip_ext.GossipDataParallel(nn.Linear(2, 1), base_algorithm="localsgd")
    except ValueError as error:
        return str(error)
    return "no error"


def test_localsgd_without_averaging_is_refused():
    for message in run_ranks(2, _without_averaging):
        assert "base_algorithm='localsgd'" in message and "global_avg_freq" in message
