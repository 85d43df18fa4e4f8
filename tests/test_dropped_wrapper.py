"""A wrapper dropped with a round in flight (deleted, or collected, with no ``sync_comms()``
after the last step: a loop that ends, a trainer that tears down) lets the round finish, as its
peers' do: the module it wrapped then holds the round absorbed, exactly as ``sync_comms()``
leaves it, and the process group goes on working. Aborting the round instead left gloo's
connections mid-message, and the next collective of the group waited forever."""

import gc

import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import gossip_ext


def _one_step(rank: int, finish) -> nn.Module:
    """One step of a worker on data of its own, its round then finished by ``finish``."""
    torch.manual_seed(0)
    module = nn.Linear(8, 2)
    model = gossip_ext.GossipDataParallel(module, gossip_ext.SGP())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.register_optimizer(optimizer)
    x = torch.full((4, 8), float(rank + 1))
    model(x).pow(2).sum().backward()
    optimizer.step()  # the hook starts the round
    assert model.round_in_flight
    finish(model)
    return module


def _drop(model) -> None:
    del model
    gc.collect()


def _both_ways(rank: int, world_size: int):
    synced = [p.detach().clone() for p in _one_step(rank, lambda m: m.sync_comms()).parameters()]
    dropped = [p.detach().clone() for p in _one_step(rank, _drop).parameters()]
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.ones(1))  # the group still works
    dist.barrier()
    return synced, dropped


def test_a_dropped_wrapper_finishes_its_round_and_leaves_the_group_working():
    for synced, dropped in run_ranks(3, _both_ways):
        for p, q in zip(synced, dropped):
            assert torch.equal(p, q)
