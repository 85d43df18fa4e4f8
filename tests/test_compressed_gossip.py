"""DiLoCo's outer average by gossip in sparse messages (``ByCompressedGossip``): real processes
over gloo against a plain-PyTorch reference of the same algorithm, written here from
gossip_ext.averagings.sparse_gossip's docstring (CHOCO-gossip on a ring, every worker's own
``theta_global``); the mean over workers kept; the bytes; a dead neighbour named, nothing changed
and the error kept; a checkpoint resumed bit for bit; bad arguments named."""

from __future__ import annotations

import io
import os
import signal
from datetime import timedelta

import pytest
import torch
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from sparse_reference import carried
from test_faults import LATER_CALLS, _leave_with_the_survivors, _what_a_survivor_reads
from test_sparse_outer import INNER_LR, OUTER, STEPS, H, _batch, _net
from torch import nn

import gossip_ext
from gossip_ext.averagings.sparse import TopK

FORMAT = TopK(density=1 / 8, bits=2, chunk=16)
GAMMA = 0.5


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _ring(rank: int, world_size: int) -> list[int]:
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size})


def _reference(world_size: int, steps: int = STEPS) -> list[list[torch.Tensor]]:
    """Every worker's theta_global after ``steps`` steps, in one process."""
    nets = [_net() for _ in range(world_size)]
    inner = [torch.optim.SGD(n.parameters(), lr=INNER_LR) for n in nets]
    thetas = [[p.detach().clone() for p in n.parameters()] for n in nets]
    outers = [torch.optim.SGD(theta, **OUTER) for theta in thetas]
    start = _flat(nets[0].parameters())
    public = [start.clone() for _ in range(world_size)]  # xhat_i
    neighbourhood = [start.clone() for _ in range(world_size)]  # s_i
    for step in range(steps):
        for rank, (net, opt) in enumerate(zip(nets, inner)):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        if (step + 1) % H:
            continue
        xs = [_flat(net.parameters()) for net in nets]
        q = [carried(x - xhat, FORMAT) for x, xhat in zip(xs, public)]
        for rank in range(world_size):
            neighbours = _ring(rank, world_size)
            arrived = q[rank] + sum(q[j] for j in neighbours)
            public[rank] = public[rank] + q[rank]
            neighbourhood[rank] = neighbourhood[rank] + arrived / (len(neighbours) + 1)
            mixed = xs[rank] + GAMMA * (neighbourhood[rank] - public[rank])
            offset = 0
            for t in thetas[rank]:
                z = mixed[offset : offset + t.numel()].view(t.shape)
                t.grad = t.detach() - z
                offset += t.numel()
            outers[rank].step()
            with torch.no_grad():
                for p, t in zip(nets[rank].parameters(), thetas[rank]):
                    p.copy_(t)
    return [[t.detach() for t in theta] for theta in thetas]


def _wrap(module: nn.Module, **settings) -> gossip_ext.GossipDataParallel:
    average = gossip_ext.ByCompressedGossip(message=FORMAT, consensus_step=GAMMA)
    return gossip_ext.GossipDataParallel(
        module,
        gossip=None,
        outer=gossip_ext.DiLoCo(lambda ps: torch.optim.SGD(ps, **OUTER), every=H, average=average),
        **settings,
    )


def _step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _train(rank: int, world_size: int) -> dict:
    model = _wrap(_net())
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    model.register_optimizer(opt)
    for step in range(STEPS):
        _step(model, opt, rank, step)
    return {
        "theta": [t.detach().clone() for t in model.outer_optimizer.param_groups[0]["params"]],
        "bytes": model.runtime.outer.averaging.bytes_per_step(),
        "neighbours": model.runtime.outer.averaging.neighbours,
    }


def test_diloco_by_sparse_gossip_matches_the_reference_and_keeps_the_mean():
    world_size = 4
    results = run_ranks(world_size, _train)
    want = _reference(world_size)
    numel = sum(t.numel() for t in want[0])
    for rank, result in enumerate(results):
        assert result["neighbours"] == _ring(rank, world_size)
        for got, expected in zip(result["theta"], want[rank], strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"rank {rank}")
        assert result["bytes"] == 2 * FORMAT.message_bytes(numel)
    # Gossip, not an exact average: the workers' global parameters differ.
    thetas = [_flat(r["theta"]) for r in results]
    assert max(float((t - thetas[0]).abs().max()) for t in thetas[1:]) > 1e-6


def _one_outer_step_of_plain_sgd(rank: int, world_size: int) -> dict:
    """One outer step with the outer optimizer SGD(lr=1): theta_global becomes z_i itself, so the
    workers' mean of theta_global is the mean of their parameters before the mix."""
    module = _net()
    average = gossip_ext.ByCompressedGossip(message=FORMAT, consensus_step=1.0)
    model = gossip_ext.GossipDataParallel(
        module,
        gossip=None,
        outer=gossip_ext.DiLoCo(lambda ps: torch.optim.SGD(ps, lr=1.0), every=H, average=average),
    )
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    for step in range(H):
        _step(model, opt, rank, step)
        if step < H - 1:
            model.transfer_params()
    before = _flat(module.parameters()).clone()
    model.transfer_params()
    return {"before": before, "after": _flat(module.parameters()).clone()}


def test_the_mix_keeps_the_mean_over_the_workers():
    results = run_ranks(3, _one_outer_step_of_plain_sgd)
    before = torch.stack([r["before"] for r in results])
    after = torch.stack([r["after"] for r in results])
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.mean(0), before.mean(0), rtol=0, atol=1e-14)


def _resume(rank: int, world_size: int) -> dict:
    """A run saved after its first outer step and resumed in a fresh wrapper equals the run
    that went straight through."""
    model = _wrap(_net())
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    model.register_optimizer(opt)
    saved = None
    for step in range(STEPS):
        _step(model, opt, rank, step)
        if step == H:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            saved = buffer.getvalue()
    straight = [p.detach().clone() for p in model.module.parameters()]
    resumed = _wrap(_net())
    opt = torch.optim.SGD(resumed.parameters(), lr=INNER_LR)
    resumed.register_optimizer(opt)
    state = torch.load(io.BytesIO(saved), weights_only=False)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    for step in range(H + 1, STEPS):
        _step(resumed, opt, rank, step)
    return {
        "straight": straight,
        "resumed": [p.detach().clone() for p in resumed.module.parameters()],
        "copies_saved": state["model"]["_extra_state"]["outer_public_copies"]["steps"] == 1,
    }


def test_a_checkpoint_resumes_bit_for_bit():
    for result in run_ranks(3, _resume):
        assert result["copies_saved"]
        for got, want in zip(result["resumed"], result["straight"], strict=True):
            assert torch.equal(got, want)


def _survivor(rank: int, world_size: int, dead: int, sync_dir: str) -> dict:
    """The dead rank dies before the first outer step; its neighbours raise at that step,
    naming it, with their parameters and theta_global as they were, and keep raising."""
    module = nn.Linear(3, 1)
    model = gossip_ext.GossipDataParallel(
        module,
        gossip=None,
        outer=gossip_ext.DiLoCo(
            lambda ps: torch.optim.SGD(ps, lr=0.7),
            every=2,
            average=gossip_ext.ByCompressedGossip(message=TopK(density=1 / 2, chunk=2)),
        ),
        timeout=timedelta(seconds=1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    theta = model.outer_optimizer.param_groups[0]["params"]
    result = {"error": None}
    try:
        for step in range(4):
            loss = model(torch.full((2, 3), 1.0 + rank + step)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            last_model = [p.detach().clone() for p in module.parameters()]
            saved_theta = [t.clone() for t in theta]
            if step == 1 and rank == dead:
                os.kill(os.getpid(), signal.SIGKILL)
            model.transfer_params()
    except (RuntimeError, TimeoutError) as error:
        result = _what_a_survivor_reads(model, module, last_model, error)
        result["theta_unchanged"] = all(torch.equal(t, s) for t, s in zip(theta, saved_theta))
        result["failed_at_step"] = step
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


def test_a_dead_neighbour_is_named_and_changes_nothing(tmp_path):
    dead = 1
    outcomes = run_ranks_tolerating_deaths(3, _survivor, dead, str(tmp_path), deadline_s=120.0)
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank in (0, 2):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0 and result["error"] is not None, (rank, outcomes[rank])
        assert result["type"] == "PeerTimeoutError", result
        assert result["failed_at_step"] == 1, result
        assert result["data"]["peers"] == (dead,), result
        assert "from rank 1" in result["error"], result["error"]
        assert result["module_is_last_model"] and result["state_dict_is_last_model"], rank
        assert result["theta_unchanged"], rank
        for name in LATER_CALLS:
            assert result["later"][name] == (result["type"], result["error"]), (rank, name)


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"consensus_step.*must be in \(0, 1\], got 1.5"):
        gossip_ext.ByCompressedGossip(consensus_step=1.5)
    with pytest.raises(ValueError, match=r"feedback_decay must be 1.*got 0.9"):
        gossip_ext.ByCompressedGossip(message=TopK(feedback_decay=0.9))
    with pytest.raises(TypeError, match=r"message.*TopK"):
        gossip_ext.ByCompressedGossip(message="int8")
    with pytest.raises(ValueError, match=r"graph.*must be fixed"):
        gossip_ext.ByCompressedGossip(graph=gossip_ext.DynamicDirectedExponentialGraph())
    with pytest.raises(ValueError, match=r"Streaming DiLoCo \(fragments=2"):
        gossip_ext.DiLoCo(
            lambda ps: torch.optim.SGD(ps, lr=1.0),
            every=4,
            average=gossip_ext.ByCompressedGossip(),
            fragments=2,
        )


def _every_two_steps(average, **settings) -> gossip_ext.GossipDataParallel:
    return gossip_ext.GossipDataParallel(
        nn.Linear(3, 1),
        gossip=None,
        outer=gossip_ext.DiLoCo(lambda ps: torch.optim.SGD(ps, lr=1.0), every=2, average=average),
        **settings,
    )


def test_an_elastic_job_is_refused_naming_why():
    # Objects given, objects named: the error says what to change in the user's own line.
    named = r"membership=Elastic\(address='127.0.0.1:29999'.* with average=ByCompressedGossip"
    with pytest.raises(ValueError, match=named):
        _every_two_steps(
            gossip_ext.ByCompressedGossip(), membership=gossip_ext.Elastic("127.0.0.1:29999")
        )


def _directed_ring(rank: int, world_size: int) -> str:
    try:
        _every_two_steps(gossip_ext.ByCompressedGossip(graph=gossip_ext.RingGraph()))
    except ValueError as error:
        return str(error)
    return ""


def test_a_graph_that_does_not_pair_symmetrically_is_refused():
    for error in run_ranks(3, _directed_ring):
        assert "must be fixed and symmetric" in error and "RingGraph" in error, error
