"""GossipDataParallel on real processes over gloo, against the plain-PyTorch training simulator
(tests/training_reference.py) and the independent schedule (tests/reference.py)."""

from __future__ import annotations

import functools
import itertools
import os
import time
import warnings

import pytest
import reference
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn
from training_reference import ABSORB, START, STEP, log_gossip, replay

import gossip_ext

D = 4  # features of the toy regression
LR = 0.05


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(world_size, 2, D, generator=g), torch.randn(world_size, 2, 1, generator=g)


def _loss(weight, bias, x, y):
    return ((x @ weight.T + bias - y) ** 2).mean()


class MixedPrecisionLinear(nn.Module):
    """A float32 weight and a float64 bias: two flat buffers on one schedule."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, D))
        self.bias = nn.Parameter(torch.randn(1, dtype=torch.float64))

    def forward(self, x):
        return x @ self.weight.T + self.bias.to(x.dtype)


def _self_weight(rank: int) -> float:
    return 0.2 + 0.1 * rank


MODES = {
    "sync": {},
    "overlap": {"overlap": True},
    "bounded_async": {"synch_freq": 2},
    "push_pull": {"push_sum": False, "graph": gossip_ext.RingGraph(peers_per_itr=2)},
    # Different kept shares per rank: column- but not row-stochastic, so the weights change.
    "self_weight": {"mixing": None},
    "mixed_dtypes": {},
}


def _train_all_modes(rank: int, world_size: int, steps: int) -> dict:
    x, y = _data(world_size)
    results = {}
    for mode, kwargs in MODES.items():
        torch.manual_seed(0)
        module = MixedPrecisionLinear() if mode == "mixed_dtypes" else nn.Linear(D, 1)
        if mode == "self_weight":
            kwargs = {"mixing": gossip_ext.SelfWeightMixing(_self_weight(rank))}
        model = gossip_ext.GossipDataParallel(module, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        events = []
        for _ in range(steps):
            out = log_gossip(model, functools.partial(model, x[rank]), events)
            loss = ((out - y[rank]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            events.append(STEP)
            log_gossip(model, model.transfer_params, events)
        log_gossip(model, model.sync_comms, events)
        results[mode] = {
            "init": [p.detach().clone() for p in _fresh_init(mode)],
            "final": [p.detach().clone() for p in module.parameters()],
            "events": events,
            "ps_weight": model.ps_weight,
        }
    return results


def _fresh_init(mode):
    torch.manual_seed(0)
    module = MixedPrecisionLinear() if mode == "mixed_dtypes" else nn.Linear(D, 1)
    return list(module.parameters())


def _expected(world_size: int, mode: str, per_rank: list[dict]) -> list[list[torch.Tensor]]:
    x, y = _data(world_size)
    kwargs = MODES[mode]
    graph = kwargs.get("graph")
    kind = "ring" if graph is not None else "npeer_exponential"
    p = graph.peers_per_itr if graph is not None else 1
    books = reference.graph_phone_books(kind, world_size, p)

    def grad_fn(i, z):
        weight, bias = (t.requires_grad_() for t in z)
        _loss(weight, bias, x[i].to(torch.float64), y[i].to(torch.float64)).backward()
        return [weight.grad, bias.grad]

    return replay(
        init=[r["init"] for r in per_rank],
        grad_fn=grad_fn,
        lr=LR,
        events=[r["events"] for r in per_rank],
        out_peers=lambda i, r: reference.out_peers(books, p, i, r),
        self_weight=[_self_weight(i) for i in range(world_size)] if mode == "self_weight" else None,
    )


# World size 4 is the CUDA rehearsal's multi-rank run over the process-group transport.
@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.extension), 5, 8])
def test_every_mode_matches_the_simulator(world_size):
    steps = 12
    per_rank = run_ranks(world_size, _train_all_modes, steps)
    for mode in MODES:
        results = [r[mode] for r in per_rank]
        expected = _expected(world_size, mode, results)
        for rank in range(world_size):
            for got, want in zip(results[rank]["final"], expected[rank]):
                torch.testing.assert_close(
                    got.to(torch.float64),
                    want,
                    rtol=1e-5,
                    atol=1e-5,
                    msg=lambda m, mode=mode, rank=rank: f"{mode}, rank {rank}: {m}",
                )
        if mode == "sync":
            # The events really were synchronous: every step absorbed the previous round.
            assert results[0]["events"].count(START) == steps
        if mode == "self_weight":
            weights = [r["ps_weight"] for r in results]
            assert any(abs(w - 1.0) > 1e-3 for w in weights), weights  # the weight travelled
            assert sum(weights) == pytest.approx(world_size, abs=1e-5)


# Bounded asynchrony under timing skew. Each cycle of SKEW_CYCLE steps, rank 0 sleeps before
# one transfer_params, so the rank that receives from it finds the round unfinished: its next
# forward goes on without absorbing, and its next transfer_params must defer its start. Then the
# other ranks sleep before one forward, long enough for rank 0's message to land, so that forward
# absorbs the late round and takes up the deferred start.
SKEW_CYCLE = 4
SKEW_SLOW_SEND = 0.05  # seconds rank 0 sleeps before transfer_params
SKEW_SLOW_FORWARD = 0.15  # seconds the other ranks sleep before a forward


def _skewed_bounded_async(rank: int, world_size: int, steps: int) -> dict:
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, synch_freq=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    calls = []  # (call, events it logged), to tell which call started or absorbed a round

    def observe(name, call):
        events = []
        result = log_gossip(model, call, events)
        calls.append((name, events))
        return result

    for step in range(steps):
        if rank != 0 and step % SKEW_CYCLE == 2:
            time.sleep(SKEW_SLOW_FORWARD)
        out = observe("forward", lambda: model(x[rank]))
        loss = ((out - y[rank]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        calls.append(("step", [STEP]))
        if rank == 0 and step % SKEW_CYCLE == 0:
            time.sleep(SKEW_SLOW_SEND)
        observe("transfer_params", model.transfer_params)
    observe("sync_comms", model.sync_comms)
    return {
        "init": [p.detach().clone() for p in _fresh_init("sync")],
        "final": [p.detach().clone() for p in module.parameters()],
        "calls": calls,
        "rounds": model.gossip_round,
    }


def test_bounded_asynchrony_under_timing_skew_matches_the_simulator():
    world_size, steps = 4, 4 * SKEW_CYCLE
    per_rank = run_ranks(world_size, _skewed_bounded_async, steps)
    events = [[e for _, logged in r["calls"] for e in logged] for r in per_rank]

    # (c) Timing moves starts and absorbs, never the rounds: one per transfer_params, everywhere.
    assert [e.count(START) for e in events] == [steps] * world_size
    assert [e.count(ABSORB) for e in events] == [steps] * world_size
    assert [r["rounds"] for r in per_rank] == [steps] * world_size

    # (a) Asynchrony really happened; none of these can happen in synchronous SGP, where every
    # forward absorbs the round in flight and every transfer_params starts one.
    calls = [c for r in per_rank for c in r["calls"]]
    # A transfer_params found the previous round unfinished and deferred its start...
    assert any(name == "transfer_params" and START not in logged for name, logged in calls)
    # ...and a later forward absorbed that round and started the owed one.
    assert any(name == "forward" and logged == [ABSORB, START] for name, logged in calls)
    # A forward went on without waiting for the round in flight: a step with a round in flight.
    stepped_in_flight = any(
        a == START and b == STEP for e in events for a, b in itertools.pairwise(e)
    )
    assert stepped_in_flight, events

    # (b) Whatever the timing was, the result is the simulator's replay of the logged events.
    x, y = _data(world_size)
    books = reference.graph_phone_books("npeer_exponential", world_size, 1)

    def grad_fn(i, z):
        weight, bias = (t.requires_grad_() for t in z)
        _loss(weight, bias, x[i].to(torch.float64), y[i].to(torch.float64)).backward()
        return [weight.grad, bias.grad]

    expected = replay(
        init=[r["init"] for r in per_rank],
        grad_fn=grad_fn,
        lr=LR,
        events=events,
        out_peers=lambda i, r: reference.out_peers(books, 1, i, r),
    )
    for rank in range(world_size):
        for got, want in zip(per_rank[rank]["final"], expected[rank]):
            torch.testing.assert_close(
                got.to(torch.float64),
                want,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, rank=rank: f"rank {rank}: {m}",
            )


def _full_batch_sgd(world_size: int, steps: int) -> list[torch.Tensor]:
    """Single-process SGD on every rank's rows at once: what exact averaging must reproduce."""
    x, y = _data(world_size)
    torch.manual_seed(0)
    ref = nn.Linear(D, 1)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(steps):
        loss = ((ref(x.reshape(-1, D)) - y.reshape(-1, 1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach() for p in ref.parameters()]


def _two_rank_full_batch(rank: int, world_size: int) -> list[torch.Tensor]:
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(opt)  # the automatic mode: gossip after every step
    for _ in range(6):
        loss = ((model(x[rank]) - y[rank]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    return [p.detach().clone() for p in module.parameters()]


def test_two_ranks_equal_full_batch_sgd():
    # One round with weights 1/2 is exact averaging, and the loss is a mean over both rows, so
    # SGP on 2 ranks is full-batch SGD.
    results = run_ranks(2, _two_rank_full_batch)
    want_params = _full_batch_sgd(world_size=2, steps=6)
    for rank_params in results:
        for got, want in zip(rank_params, want_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _pure_gossip(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    mixing = gossip_ext.SelfWeightMixing(_self_weight(rank))
    model = gossip_ext.GossipDataParallel(module, mixing=mixing)
    with torch.no_grad():  # distinct starting points, set in place after the initial broadcast
        for p in module.parameters():
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view_as(p) * (rank + 1))
    init = [p.detach().clone() for p in module.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    weights = []
    x = torch.ones(1, D, dtype=torch.float64)
    for step in range(steps):
        model(x).sum().backward()
        opt.step()
        model.transfer_params()
        if step == 0:
            model.sync_comms()
            weights.append(model.ps_weight)
    model.sync_comms()
    return {
        "init": init,
        "final": [p.detach().clone() for p in module.parameters()],
        "ps_weight_after_first": weights[0],
        "ps_weight": model.ps_weight,
    }


def test_non_lazy_push_sum_converges_to_the_exact_mean():
    world_size = 4
    results = run_ranks(world_size, _pure_gossip, 60)
    first = [r["ps_weight_after_first"] for r in results]
    assert any(abs(w - 1.0) > 1e-3 for w in first), first
    assert sum(r["ps_weight"] for r in results) == pytest.approx(world_size, abs=1e-9)
    for i in range(2):
        mean = torch.stack([r["init"][i] for r in results]).mean(0)
        for r in results:
            torch.testing.assert_close(r["final"][i], mean, rtol=0, atol=1e-6)


def _hierarchical(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, nprocs_per_node=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    snapshots = []
    for _ in range(5):
        loss = ((model(x[rank]) - y[rank]) ** 2).mean()
        snapshots.append([p.detach().clone() for p in module.parameters()])
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.transfer_params()
    model(x[rank])
    snapshots.append([p.detach().clone() for p in module.parameters()])
    return {"snapshots": snapshots, "leader": model.is_gossip_leader}


def test_hierarchical_nodes_hold_identical_parameters_and_follow_gossip_of_node_means():
    results = run_ranks(4, _hierarchical)
    assert [r["leader"] for r in results] == [True, False, True, False]
    for node in (0, 1):
        a, b = results[2 * node]["snapshots"], results[2 * node + 1]["snapshots"]
        for sa, sb in zip(a, b):
            for pa, pb in zip(sa, sb):
                assert torch.equal(pa, pb)
    # Two nodes, each a full batch over its two processes' rows; two-node gossip is exact
    # averaging, so every node follows full-batch SGD on all four rows.
    want_params = _full_batch_sgd(world_size=4, steps=5)
    for r in results:
        for got, want in zip(r["snapshots"][-1], want_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _train_eval_train(rank: int, world_size: int) -> list:
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    model = gossip_ext.GossipDataParallel(module, overlap=True)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float(rank))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.ones(1, D, dtype=torch.float64)
    for step in range(6):
        model.train(step % 2 == 0)  # every other forward is an evaluation
        model(x).sum().backward()
        opt.step()
        model.transfer_params()
    model.eval()
    model(x)
    return [p.detach().clone() for p in module.parameters()]


def test_train_eval_train_loses_no_message():
    world_size = 4
    results = run_ranks(world_size, _train_eval_train)
    # lr = 0 and uniform mixing: gossip must conserve the mean exactly, whatever eval absorbed.
    for i in range(2):
        mean = torch.stack([r[i] for r in results]).mean()
        assert mean.item() == pytest.approx(sum(range(world_size)) / world_size, abs=1e-12)


def _checkpoint_run(rank: int, world_size: int, ckpt_dir: str, phase: str, overlap: bool):
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    steps = range(10)
    if phase == "resume":
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        steps = range(5, 10)
    for step in steps:
        if phase == "first_half" and step == 5:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
            return None
        loss = ((model(x[rank]) - y[rank]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.transfer_params()
    model.sync_comms()
    return [p.detach().clone() for p in module.parameters()]


def test_state_dict_round_trip_continues_the_same_trajectory(tmp_path):
    world_size = 3
    whole = run_ranks(world_size, _checkpoint_run, str(tmp_path), "whole", False)
    run_ranks(world_size, _checkpoint_run, str(tmp_path), "first_half", False)
    resumed = run_ranks(world_size, _checkpoint_run, str(tmp_path), "resume", False)
    for a, b in zip(whole, resumed):
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def _world_of_one(rank: int, world_size: int):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = gossip_ext.GossipDataParallel(nn.Linear(D, 1))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model(torch.ones(1, D)).sum().backward()
    opt.step()
    model.transfer_params()
    model(torch.ones(1, D))
    return [str(w.message) for w in caught]


def test_world_size_one_trains_and_warns():
    messages = run_ranks(1, _world_of_one)[0]
    assert any("one gossiping process" in m for m in messages), messages


def test_requires_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        gossip_ext.GossipDataParallel(nn.Linear(2, 1))


def _accumulate_with_no_sync(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, nprocs_per_node=2)
    x = torch.full((1, D), float(rank + 1))
    with model.no_sync():
        model(x).sum().backward()
    local = module.weight.grad.clone()
    module.weight.grad = None
    model(x).sum().backward()
    averaged = module.weight.grad.clone()
    model.block()  # absorbs nothing in flight and meets every rank
    numerators = model.ps_numerator()
    return {
        "local": local,
        "averaged": averaged,
        "numerators": numerators,
        "weight": module.weight.detach().clone(),
    }


def test_no_sync_skips_node_gradient_averaging():
    results = run_ranks(4, _accumulate_with_no_sync)
    for rank, r in enumerate(results):
        # d(sum(w x + b))/dw = x: inside no_sync each process keeps its own gradient ...
        torch.testing.assert_close(r["local"], torch.full((1, D), float(rank + 1)))
        # ... outside, the gradient is the mean over the node's two processes.
        node_mean = float(2 * (rank // 2) + 1.5)
        torch.testing.assert_close(r["averaged"], torch.full((1, D), node_mean))
        # No round in flight and lazy mixing: the numerators are the parameters.
        torch.testing.assert_close(r["numerators"]["weight"], r["weight"])
