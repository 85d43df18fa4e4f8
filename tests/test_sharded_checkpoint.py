"""Checkpoints of sharded replicas through torch.distributed.checkpoint
(gossip_ext.sharded.checkpoint), on real processes over gloo: a save resumes bit for bit under
the mesh it was saved with (the parameters, the inner Adam's state, the push-sum and outer state,
a Streaming DiLoCo fragment in flight), and loads under another (2 x 2 to 4 x 1 and back), every
replica taking the saved replica of its index modulo the saved count."""

from __future__ import annotations

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


def _mesh(shards: int):
    from torch.distributed.device_mesh import init_device_mesh

    replicas = torch.distributed.get_world_size() // shards
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def _build(mesh, algorithm: str):
    from torch.distributed.fsdp import fully_shard

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


def _same_mesh(mesh, rank: int, algorithm: str, path: str) -> bool:
    net, model, opt = _build(mesh, algorithm)
    _steps(model, opt, rank, 0, SAVED_AT, 2)
    sharded_checkpoint.save(model, path, opt)
    _steps(model, opt, rank, SAVED_AT, STEPS, 2)
    straight = _shards(net)
    del model, opt

    net, model, opt = _build(mesh, algorithm)
    sharded_checkpoint.load(model, path, opt)
    _steps(model, opt, rank, SAVED_AT, STEPS, 2)
    return all(torch.equal(a, b) for a, b in zip(straight, _shards(net)))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_dcp_checkpoint_resumes_bit_for_bit_under_the_same_mesh(algorithm, jobs):
    assert all(ranks_run["same_mesh"][algorithm] for ranks_run in jobs["2x2"])


def _whole(net, model) -> dict:
    """The replica's whole parameters and DiLoCo's theta_global and outer momentum, gathered
    over its shards."""
    from torch.distributed.tensor import DTensor

    params = list(net.parameters())
    outer = model.runtime.outer.per_parameter_state()

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


def _save_under(mesh, rank: int, shards: int, path: str) -> dict:
    net, model, opt = _build(mesh, "diloco")
    _steps(model, opt, rank, 0, SAVED_AT, shards)  # an outer step after step 3
    _steps(model, opt, rank, SAVED_AT, SAVED_AT + 1, shards)  # the replicas apart again
    sharded_checkpoint.save(model, path, opt)
    return _whole(net, model)


def _load_under(mesh, path: str) -> dict:
    net, model, opt = _build(mesh, "diloco")
    sharded_checkpoint.load(model, path, opt)
    whole = _whole(net, model)
    whole["steps"] = model.step_count
    whole["round"] = model.gossip_round
    return whole


@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 2)])
def test_a_dcp_checkpoint_loads_under_another_mesh(saved, loaded, jobs, request):
    """2 x 2 saved, 4 x 1 loaded (and back): replica r takes saved replica r mod the saved
    count, its shards cut anew; the outer state and the step count come with it."""
    before = [ranks_run["saved"] for ranks_run in jobs["2x2" if saved == 2 else "4x1"]]
    if loaded == 1:
        after = [ranks_run["loaded"] for ranks_run in jobs["4x1"]]
    else:
        after = request.getfixturevalue("loaded_back_under_2x2")
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


def _save_streaming(mesh, rank: int, path: str) -> None:
    net, model, opt = _build(mesh, "streaming_diloco")
    _steps(model, opt, rank, 0, SAVED_AT, 2)
    sharded_checkpoint.save(model, path, opt)


def _load_streaming(mesh, path: str):
    from multiprocess import error_of

    net, model, opt = _build(mesh, "streaming_diloco")
    return error_of(lambda: sharded_checkpoint.load(model, path, opt))


# Three sets of 4 processes, each building one model after the other on its mesh: 2 x 2 resumes
# every algorithm and saves DiLoCo and Streaming DiLoCo; 4 x 1 loads both and saves DiLoCo;
# 2 x 2 again loads that.


def _first_2x2(rank: int, world_size: int, folder: str) -> dict:
    mesh = _mesh(2)
    run = {"same_mesh": {a: _same_mesh(mesh, rank, a, f"{folder}/{a}") for a in ALGORITHMS}}
    run["saved"] = _save_under(mesh, rank, 2, f"{folder}/saved_2x2")
    _save_streaming(mesh, rank, f"{folder}/streaming_2x2")
    return run


def _then_4x1(rank: int, world_size: int, folder: str) -> dict:
    mesh = _mesh(1)
    run = {"loaded": _load_under(mesh, f"{folder}/saved_2x2")}
    run["streaming_refused"] = _load_streaming(mesh, f"{folder}/streaming_2x2")
    run["saved"] = _save_under(mesh, rank, 1, f"{folder}/saved_4x1")
    return run


def _then_2x2(rank: int, world_size: int, folder: str) -> dict:
    return _load_under(_mesh(2), f"{folder}/saved_4x1")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="module")
def jobs(folder) -> dict[str, list[dict]]:
    return {"2x2": run_ranks(4, _first_2x2, folder), "4x1": run_ranks(4, _then_4x1, folder)}


@pytest.fixture(scope="module")
def loaded_back_under_2x2(jobs, folder) -> list[dict]:
    return run_ranks(4, _then_2x2, folder)


@pytest.mark.timeout(180)
def test_outer_state_that_is_not_per_parameter_refuses_another_mesh_naming_why(jobs):
    for kind, message in (ranks_run["streaming_refused"] for ranks_run in jobs["4x1"]):
        assert kind is ValueError, message
        assert "saved under 2 x 2" in message and "this model is 4 x 1" in message, message
        assert "Streaming DiLoCo" in message, message
