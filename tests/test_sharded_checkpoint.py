"""Checkpoints of sharded replicas through torch.distributed.checkpoint
(gossip_ext.sharded.checkpoint), on real processes over gloo: a save resumes bit for bit under
the mesh it was saved with (the parameters, the inner Adam's state, the push-sum and outer state,
a Streaming DiLoCo fragment in flight), and loads under another (2 x 2 to 4 x 1 and back), every
replica taking the saved replica of its index modulo the saved count."""

from __future__ import annotations

import tempfile

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext.sharded import checkpoint as sharded_checkpoint

STEPS, SAVED_AT = 7, 3


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


ALGORITHMS = {
    "sgp": lambda: {"gossip": gossip_ext.SGP(overlap=True)},
    "diloco": lambda: {"gossip": None, "outer": gossip_ext.DiLoCo(_outer_sgd, every=3)},
    "streaming_diloco": lambda: {
        "gossip": None,
        "outer": gossip_ext.DiLoCo(_outer_sgd, every=4, fragments=2, delay=1),
    },
}


def _build(rank: int, replicas: int, shards: int, algorithm: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    # Uneven shards: the first layer's 1 x 6 weight lies whole on the first of two shards.
    net = nn.Sequential(nn.Linear(6, 1), nn.Tanh(), nn.Linear(1, 6)).double()
    fully_shard(net, mesh=mesh["shard"])
    model = gossip_ext.GossipDataParallel(
        net, process_group=mesh["replicate"].get_group(), **ALGORITHMS[algorithm]()
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.register_optimizer(opt)
    return net, model, opt


def _steps(model, opt, rank: int, first: int, last: int, shards: int) -> None:
    replica, shard = divmod(rank, shards)
    for step in range(first, last):
        g = torch.Generator().manual_seed(1000 * step + 10 * replica + shard)
        x = torch.randn(3, 6, generator=g, dtype=torch.float64)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()


def _shards(net) -> list[torch.Tensor]:
    return [t.clone() for _, t in gossip_ext.sharded.replicas.local_shards(net)]


def _same_mesh(rank: int, world_size: int, algorithm: str, path: str) -> bool:
    net, model, opt = _build(rank, 2, 2, algorithm)
    _steps(model, opt, rank, 0, SAVED_AT, 2)
    sharded_checkpoint.save(model, path, opt)
    _steps(model, opt, rank, SAVED_AT, STEPS, 2)
    straight = _shards(net)
    del model, opt

    net, model, opt = _build(rank, 2, 2, algorithm)
    sharded_checkpoint.load(model, path, opt)
    _steps(model, opt, rank, SAVED_AT, STEPS, 2)
    return all(torch.equal(a, b) for a, b in zip(straight, _shards(net)))


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_dcp_checkpoint_resumes_bit_for_bit_under_the_same_mesh(algorithm):
    with tempfile.TemporaryDirectory() as path:
        assert all(run_ranks(4, _same_mesh, algorithm, path))


def _whole(net, model) -> dict:
    """The replica's whole parameters and DiLoCo's theta_global and outer momentum, gathered
    over its shards."""
    from torch.distributed.tensor import DTensor

    params = list(net.parameters())
    outer = model._outer.per_parameter_state()

    def full(local, p):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        ).full_tensor()

    return {
        "params": [p.full_tensor() for p in params],
        "outer": {
            part: [full(t, p) for t, p in zip(tensors, params)] for part, tensors in outer.items()
        },
    }


def _save_under(rank: int, world_size: int, shards: int, path: str) -> dict:
    net, model, opt = _build(rank, world_size // shards, shards, "diloco")
    _steps(model, opt, rank, 0, SAVED_AT, shards)  # an outer step after step 3
    _steps(model, opt, rank, SAVED_AT, SAVED_AT + 1, shards)  # the replicas apart again
    sharded_checkpoint.save(model, path, opt)
    return _whole(net, model)


def _load_under(rank: int, world_size: int, shards: int, path: str) -> dict:
    net, model, opt = _build(rank, world_size // shards, shards, "diloco")
    sharded_checkpoint.load(model, path, opt)
    whole = _whole(net, model)
    whole["steps"] = model.step_count
    whole["round"] = model.gossip_round
    return whole


@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2)])
def test_a_dcp_checkpoint_loads_under_another_mesh(saved, loaded):
    """2 x 2 saved, 4 x 1 loaded (and back): replica r takes saved replica r mod the saved
    count, its shards cut anew; the outer state and the step count come with it."""
    with tempfile.TemporaryDirectory() as path:
        before = run_ranks(4, _save_under, saved, path)
        after = run_ranks(4, _load_under, loaded, path)
    saved_replicas = 4 // saved
    for rank, got in enumerate(after):
        want = before[((rank // loaded) % saved_replicas) * saved]
        assert got["steps"] == SAVED_AT + 1
        for a, b in zip(got["params"], want["params"], strict=True):
            assert torch.equal(a, b), rank
        assert sorted(got["outer"]) == sorted(want["outer"]) and got["outer"]
        for part in want["outer"]:
            for a, b in zip(got["outer"][part], want["outer"][part], strict=True):
                assert torch.equal(a, b), (rank, part)


def _save_streaming(rank: int, world_size: int, path: str) -> None:
    net, model, opt = _build(rank, 2, 2, "streaming_diloco")
    _steps(model, opt, rank, 0, SAVED_AT, 2)
    sharded_checkpoint.save(model, path, opt)


def _load_streaming_under_4x1(rank: int, world_size: int, path: str):
    from multiprocess import error_of

    net, model, opt = _build(rank, 4, 1, "streaming_diloco")
    return error_of(lambda: sharded_checkpoint.load(model, path, opt))


def test_outer_state_that_is_not_per_parameter_refuses_another_mesh_naming_why():
    with tempfile.TemporaryDirectory() as path:
        run_ranks(4, _save_streaming, path)
        errors = run_ranks(4, _load_streaming_under_4x1, path)
    for kind, message in errors:
        assert kind is ValueError, message
        assert "saved under 2 x 2" in message and "this model is 4 x 1" in message, message
        assert "Streaming DiLoCo" in message, message
