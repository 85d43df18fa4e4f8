"""GossipDataParallel(gossip=AsyncSGP(...)) as a user trains with it, on real processes over gloo:
with no staleness it trains as synchronous SGP does; with a slow worker the others do not wait
for it and every model a user reads is a valid one; bad arguments are named."""

from __future__ import annotations

import time

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

D = 6
LR = 0.05


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, D, generator=g)
    return x, x.sum(dim=1, keepdim=True) * (1 + 0.2 * rank)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(rank, world_size, gossip, steps, delays):
    model = gossip_ext.GossipDataParallel(_net(), gossip=gossip)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    begin = time.monotonic()
    for step in range(steps):
        time.sleep(delays[rank])
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        model.transfer_params()
    elapsed = time.monotonic() - begin
    # What a user reads the moment its last step is taken: its own model, mixed with whatever
    # arrived by then (a fast worker's may hold a slow peer's message of many steps ago).
    model.eval()
    read = {k: v.clone() for k, v in model.module.state_dict().items()}
    read_loss = _held_out_loss(model, world_size)
    # The job's end, every worker together (settle, as the docs say to before evaluating the
    # job): every message sent is absorbed, the slow worker's last ones included. This process
    # ends by os._exit, which runs no finalizer to tell its peers that it finished.
    model.settle()
    state = {k: v.clone() for k, v in model.module.state_dict().items()}
    return {
        "read": read,
        "read_loss": read_loss,
        "state": state,
        "loss": _held_out_loss(model, world_size),
        "elapsed": elapsed,
        "weight": model.ps_weight,
    }


def _held_out_loss(model: nn.Module, world_size: int) -> float:
    with torch.no_grad():
        x, y = _batch(world_size, 10_000)  # held out: no rank trained on it
        return float(nn.functional.mse_loss(model(x), y))


def _both(rank, world_size, steps):
    synchronous = _train(rank, world_size, gossip_ext.SGP(), steps, [0.0] * world_size)
    asynchronous = _train(
        rank, world_size, gossip_ext.AsyncSGP(staleness=0), steps, [0.0] * world_size
    )
    return synchronous, asynchronous


def test_with_no_staleness_it_trains_as_synchronous_sgp():
    for synchronous, asynchronous in run_ranks(4, _both, 8):
        for name, value in synchronous["state"].items():
            torch.testing.assert_close(asynchronous["state"][name], value, rtol=1e-5, atol=1e-6)


def _untrained_loss() -> float:
    x, y = _batch(4, 10_000)
    with torch.no_grad():
        return float(nn.functional.mse_loss(_net()(x), y))


def test_with_a_slow_worker_the_others_keep_their_pace_and_every_model_is_valid():
    # The time a step's compute would take: rank 2 is four times slower (30 steps: 3.6 s). Steps
    # this long keep the workers' start, which a loaded machine's scheduler may spread by half a
    # second, small beside the run (at 10 ms steps, fast workers had then finished before the
    # others began, and met their untrained models afterwards).
    delays = [0.03, 0.03, 0.12, 0.03]
    results = run_ranks(4, _train, gossip_ext.AsyncSGP(message_dtype="int8"), 30, delays)
    slow = results[2]["elapsed"]
    for rank in (0, 1, 3):
        # The fast ranks finished well before the slow one: nobody waited for its steps.
        assert results[rank]["elapsed"] < 0.6 * slow, [r["elapsed"] for r in results]
    before = _untrained_loss()
    for result in results:
        # Read between steps and at rest: valid models, each better than an untrained one.
        # Measured held-out losses 1.4-5.6 on a quiet machine, against 22 untrained (1.8 for
        # synchronous SGP); with two busy loops beside the test, one run in six left two fast
        # workers at 12-14: a fast worker gives half its weight away every round, so its own
        # steps count for less in the mass than the slow worker's (docs/algorithms.md,
        # "Asynchronous gossip"), and a slow peer's stale message can outweigh them.
        for model, loss in (("read", "read_loss"), ("state", "loss")):
            assert all(torch.isfinite(v).all() for v in result[model].values())
            assert result[loss] < 0.7 * before, ([r[loss] for r in results], before)
        assert result["weight"] > 0
    # At rest nothing is in flight: the weights sum to the number of workers.
    assert sum(r["weight"] for r in results) == pytest.approx(4, abs=1e-6)


def _settled(rank, world_size, steps, delays):
    model = gossip_ext.GossipDataParallel(_net(), gossip=gossip_ext.AsyncSGP())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    initial = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    # This worker's part of the job's numerator sum: a step moves z by its delta, so the
    # numerator w z by w delta, at the weight the worker holds then; gossip moves none of it.
    added = torch.zeros_like(initial)
    for step in range(steps):
        time.sleep(delays[rank])
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        opt.step()
        after = torch.cat([p.detach().flatten().double() for p in model.parameters()])
        added += model.ps_weight * (after - before)
        model.transfer_params()
    model.settle()
    z = torch.cat([p.detach().flatten().double() for p in model.parameters()])
    return {"initial": initial, "added": added, "weight": model.ps_weight, "z": z}


def test_settle_leaves_nothing_in_flight_and_the_weighted_mean_is_what_the_workers_held():
    results = run_ranks(4, _settled, 20, [0.005, 0.005, 0.02, 0.005])
    weights = [r["weight"] for r in results]
    assert sum(weights) == pytest.approx(4.0, abs=1e-9), weights
    # Bookkept outside the engine: the same initial model on every worker, plus each step's
    # numerator. Every message sent was absorbed, so the weighted sum holds all of it.
    expected = sum(r["initial"] + r["added"] for r in results) / 4
    weighted = sum(r["weight"] * r["z"] for r in results) / sum(weights)
    torch.testing.assert_close(weighted, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"staleness": -1}, ValueError, "AsyncSGP(staleness=...): staleness must be >= 0"),
        ({"staleness": 1.5}, TypeError, "AsyncSGP(staleness=...): staleness must be an int"),
        ({"message_dtype": "int3"}, ValueError, "message_dtype must be"),
        ({"graph": "ring"}, TypeError, "AsyncSGP(graph=...): graph must be a gossip_ext graph"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    with pytest.raises(error) as raised:
        gossip_ext.AsyncSGP(**kwargs)
    assert words in str(raised.value)


def test_an_outer_step_beside_it_is_refused_naming_both():
    with pytest.raises(ValueError) as raised:
        gossip_ext.algorithms.Configuration(gossip_ext.AsyncSGP(), gossip_ext.Average(every=4))
    assert "gossip=AsyncSGP(" in str(raised.value) and "outer=Average(" in str(raised.value)
