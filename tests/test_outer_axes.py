"""The two axes of an outer step, every combination: a plain average and SlowMo average by every
way DiLoCo does (compressed and sparse messages, one gossip round, compressed gossip), each
checked on 3 gloo processes against a reference that is already trusted:

- a plain average is DiLoCo's outer step with plain SGD at learning rate 1 (theta - 1 * (theta -
  mean) is the mean), so ``Average(k, average=X)`` must train as ``DiLoCo(SGD(lr=1), k,
  average=X)``: bit for bit where the messages are differences from the last average (the
  same computation), to rounding where the rule writes the mean instead of stepping to it;
- SlowMo with no momentum and a slow learning rate of 1 is a plain average, so ``SlowMo(k, 0, 1,
  average=X)`` must train as ``Average(k, average=X)``, to rounding.

The combinations that cannot work are refused when the object is made, naming why."""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from outer_grid import train_steps
from torch import nn

import gossip_ext
from gossip_ext import ByCollective, ByCompressedGossip, ByGossip, TopK

STEPS, EVERY, WORLD_SIZE = 14, 3, 3


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def _averages() -> dict:
    topk = TopK(density=1 / 8, bits=4, chunk=32)
    return {
        "int8": lambda: ByCollective(dtype="int8"),
        "topk": lambda: ByCollective(dtype=topk),
        "gossip": lambda: ByGossip(),
        "compressed_gossip": lambda: ByCompressedGossip(message=topk, consensus_step=0.5),
    }


def _configurations() -> dict:
    """Name -> the outer step, every one with gossip=None."""
    configs = {}
    for name, average in _averages().items():
        configs[f"average/{name}"] = lambda a=average: gossip_ext.Average(EVERY, average=a())
        configs[f"diloco_sgd1/{name}"] = lambda a=average: gossip_ext.DiLoCo(
            _plain_sgd, every=EVERY, average=a()
        )
        configs[f"slowmo_plain/{name}"] = lambda a=average: gossip_ext.SlowMo(
            EVERY, momentum=0.0, lr=1.0, average=a()
        )
        configs[f"slowmo/{name}"] = lambda a=average: gossip_ext.SlowMo(
            EVERY, momentum=0.5, lr=1.0, average=a()
        )
    return configs


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    trained = {}
    for name, outer in _configurations().items():
        model = gossip_ext.GossipDataParallel(_net(), gossip=None, outer=outer())
        train_steps(model, rank, STEPS)
        # After the last outer step (step 12), two inner steps: the ranks' models are apart.
        trained[name] = [p.detach().clone() for p in model.module.parameters()]
    return trained


@pytest.fixture(scope="module")
def trained():
    return run_ranks(WORLD_SIZE, _train)


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("average", ["int8", "topk"])
def test_a_plain_average_in_differences_is_diloco_at_sgd_lr_1_bit_for_bit(trained, average):
    for rank in trained:
        mine, reference = rank[f"average/{average}"], rank[f"diloco_sgd1/{average}"]
        assert all(torch.equal(p, q) for p, q in zip(mine, reference))


@pytest.mark.parametrize("average", ["gossip", "compressed_gossip"])
def test_a_plain_average_by_gossip_is_diloco_at_sgd_lr_1(trained, average):
    for rank in trained:
        assert _close(rank[f"average/{average}"], rank[f"diloco_sgd1/{average}"])
    # Gossip mixes with a few peers: the workers' models stay apart, unlike a collective's.
    first, second = (r[f"average/{average}"] for r in trained[:2])
    assert not _close(first, second)


@pytest.mark.parametrize("average", list(_averages()))
def test_slowmo_without_momentum_is_a_plain_average_whatever_averages_it(trained, average):
    for rank in trained:
        assert _close(rank[f"slowmo_plain/{average}"], rank[f"average/{average}"])
        # And its momentum does something.
        assert not _close(rank[f"slowmo/{average}"], rank[f"slowmo_plain/{average}"])


def test_every_configuration_trains_to_finite_parameters(trained):
    for rank in trained:
        for name, params in rank.items():
            assert all(bool(torch.isfinite(p).all()) for p in params), name


@pytest.mark.parametrize(
    "make, words",
    [
        (
            lambda: gossip_ext.SlowMo(4, memory_efficient=True, average=ByGossip()),
            "memory_efficient=True splits x_slow over the workers",
        ),
        (
            lambda: gossip_ext.SlowMo(4, memory_efficient=True, average=ByCollective("int8")),
            "no message taken from x_slow",
        ),
        (
            lambda: gossip_ext.SlowMo(4, average=ByCollective(device="cpu")),
            "SlowMo keeps x_slow beside the parameters",
        ),
        (
            lambda: gossip_ext.Average(4, average=ByCollective(device="cpu")),
            "a plain average in full precision keeps none",
        ),
        (lambda: gossip_ext.Average(4, average="gossip"), "Average(average=...): average must"),
    ],
)
def test_combinations_that_cannot_work_are_refused_when_made(make, words):
    with pytest.raises((TypeError, ValueError)) as raised:
        make()
    assert words in str(raised.value), str(raised.value)


def test_an_outer_step_averaged_by_gossip_is_refused_with_processes_per_machine():
    # nprocs_per_node > 1 lets one process of a machine stand for the others, which needs the
    # same mean on every worker: a plain average by gossip, as DiLoCo's, is refused.
    config = gossip_ext.algorithms.Configuration
    with pytest.raises(ValueError, match=r"average=ByGossip\(.*\) with nprocs_per_node=2"):
        config(None, gossip_ext.Average(4, average=ByGossip()), nprocs_per_node=2)
    with pytest.raises(ValueError, match="flat keyword"):
        gossip_ext.flat_keywords.to_flat(None, gossip_ext.Average(4, average=ByGossip()), None)
