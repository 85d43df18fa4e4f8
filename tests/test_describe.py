"""describe() gives plain values all the way down, message formats included: json.dumps takes
every object's description, and ranks that differ in one innermost setting are told its name."""

from __future__ import annotations

import json

import pytest
import torch
from multiprocess import error_of, run_ranks
from torch import nn

import gossip_ext
from gossip_ext.errors import ConfigurationMismatch


def _sgd(params):
    return torch.optim.SGD(params, lr=0.7)


OBJECTS = [
    gossip_ext.SGP(message_dtype="int8"),
    gossip_ext.SGP(message_dtype=torch.float8_e4m3fn, graph=gossip_ext.RingGraph()),
    gossip_ext.PushPull(graph=gossip_ext.HypercubeGraph()),
    gossip_ext.Average(every=3),
    gossip_ext.SlowMo(every=4, memory_efficient=True),
    gossip_ext.DiLoCo(_sgd, every=4, average=gossip_ext.ByCollective(dtype=gossip_ext.TopK())),
    gossip_ext.DiLoCo(_sgd, every=4, average=gossip_ext.ByCollective("int4"), fragments=2),
    gossip_ext.DiLoCo(_sgd, every=4, average=gossip_ext.ByCompressedGossip(gossip_ext.TopK())),
    gossip_ext.DiLoCo(_sgd, every=4, average=gossip_ext.ByGossip(graph=gossip_ext.RingGraph())),
    gossip_ext.Elastic("127.0.0.1:29600", min_workers=2),
]


@pytest.mark.parametrize("obj", OBJECTS, ids=lambda o: type(o).__name__)
def test_every_description_is_plain_values(obj):
    described = obj.describe()
    assert json.loads(json.dumps(described)) == described


def test_a_message_format_is_described_by_its_settings():
    described = gossip_ext.ByCollective(dtype=gossip_ext.TopK(density=1 / 32, bits=4)).describe()
    assert described["dtype"] == {
        "kind": "TopK",
        "density": 1 / 32,
        "bits": 4,
        "chunk": 4096,
        "feedback_decay": 1.0,
    }


def _densities_differ(rank: int, world_size: int):
    topk = gossip_ext.TopK(density=1 / 64 if rank == 0 else 1 / 32)
    outer = gossip_ext.DiLoCo(_sgd, every=4, average=gossip_ext.ByCollective(dtype=topk))
    return error_of(lambda: gossip_ext.GossipDataParallel(nn.Linear(3, 1), outer=outer))


def test_ranks_that_differ_in_a_density_are_told_the_innermost_setting():
    for kind, message in run_ranks(2, _densities_differ):
        assert kind is ConfigurationMismatch  # a ValueError
        assert "outer.average.dtype.density: rank 0 has 0.015625, rank 1 has 0.03125" in message
