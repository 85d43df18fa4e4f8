"""Exact averaging in GossipDataParallel: periodic global averaging (global_avg_freq),
average_parameters() and SlowMo (slowmo_freq), on real processes over gloo.

The oracles are independent of the library: the plain-PyTorch gossip simulator
(tests/training_reference.py) replayed between averaging steps, the push-sum weights computed
from the mixing schedule (tests/reference.py), SlowMo's update written from the paper, and
single-process heavy-ball SGD.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import reference
import torch
from multiprocess import run_ranks
from torch import nn
from training_reference import ABSORB, START, STEP, mixing, replay

import gossip_ext

D = 4
LR = 0.05
AVERAGE = "average"  # an exact-averaging step, in the event logs of this file


def _data(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4321)
    return torch.randn(world_size, 2, D, generator=g), torch.randn(world_size, 2, 1, generator=g)


def _self_weight(rank: int) -> float:
    return 0.2 + 0.15 * rank


def _snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


# ----------------------------------------------------------------------------- the oracle


def _split(events: list[str]) -> list[list[str]]:
    segments = [[]]
    for event in events:
        if event == AVERAGE:
            segments.append([])
        else:
            segments[-1].append(event)
    return segments


def _push_sum_weights(n: int, rounds: range, out_peers, self_weight) -> list[float]:
    """The weights after `rounds`, from 1 everywhere: they depend on the schedule alone."""
    w = [1.0] * n
    for r in rounds:
        new = [0.0] * n
        for i in range(n):
            peers = out_peers(i, r)
            keep, give = mixing(len(peers), None if self_weight is None else self_weight[i])
            new[i] += keep * w[i]
            for j in peers:
                new[j] += give * w[i]
        w = new
    return w


def _replay_with_averaging(
    init, grad_fn, events, out_peers, self_weight=None, slowmo=None, outer=None
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Replays every node's event log, where AVERAGE (at the same place on every node, with no
    round in flight) sets every node to sum_i w_i z_i / sum_i w_i and the weights to 1; with
    slowmo = (beta, alpha, steps_between) the AVERAGE steps numbered by steps_between are SlowMo
    steps, and with outer, a function of the AVERAGE's index and the average, every node is set
    to what it returns instead. Returns the final values and the values after each AVERAGE."""
    n = len(init)
    per_node = [_split(e) for e in events]
    z = [[t.detach().to(torch.float64) for t in node] for node in init]
    slow = [t.clone() for t in z[0]]
    momentum = [torch.zeros_like(t) for t in slow]
    offset = 0
    after = []
    for index in range(len(per_node[0])):
        segment = [segments[index] for segments in per_node]
        rounds = segment[0].count(START)
        z = replay(
            init=z,
            grad_fn=grad_fn,
            lr=LR,
            events=segment,
            out_peers=lambda i, r, offset=offset: out_peers(i, r + offset),
            self_weight=self_weight,
        )
        if index == len(per_node[0]) - 1:
            return z, after
        w = _push_sum_weights(n, range(offset, offset + rounds), out_peers, self_weight)
        average = [sum(w[i] * z[i][k] for i in range(n)) / sum(w) for k in range(len(z[0]))]
        if slowmo is not None and slowmo[2](index):
            beta, alpha, _ = slowmo
            for k in range(len(slow)):
                momentum[k] = beta * momentum[k] + (slow[k] - average[k]) / LR
                slow[k] = slow[k] - alpha * LR * momentum[k]
            average = [t.clone() for t in slow]
        if outer is not None:
            average = outer(index, average)
        z = [[t.clone() for t in average] for _ in range(n)]
        after.append(average)
        offset += rounds
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- global_avg_freq

K = 3  # global_avg_freq
STEPS = 8
AVERAGING_MODES = {
    "sync": {},
    "overlap": {"overlap": True},
    "self_weight": {},  # SelfWeightMixing with a different share per rank: weights move off 1
    "hierarchical": {"nprocs_per_node": 2},
}


def _events(mode: str, steps: int, every: int) -> list[str]:
    """What each node does, as the wrapper documents it: the averaging step's all-reduce takes
    the place of its gossip round, after absorbing the round in flight."""
    events = []
    for step in range(1, steps + 1):
        events += [STEP, ABSORB] if mode == "overlap" else [ABSORB, STEP]
        events.append(AVERAGE if step % every == 0 else START)
    return events + [ABSORB]


def _train_with_averaging(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    results = {}
    for mode, kwargs in AVERAGING_MODES.items():
        torch.manual_seed(0)
        module = nn.Linear(D, 1)
        if mode == "self_weight":
            kwargs = {"mixing": gossip_ext.SelfWeightMixing(_self_weight(rank))}
        model = gossip_ext.GossipDataParallel(module, global_avg_freq=K, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        init = _snapshot(module)
        averaged, weights_before, weights_after = [], [], []
        for step in range(1, STEPS + 1):
            loss = ((model(x[rank]) - y[rank]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            weights_before.append(model.ps_weight)
            model.transfer_params()
            if step % K == 0:
                averaged.append(_snapshot(module))
                weights_after.append(model.ps_weight)
                assert not model.round_in_flight
        model.sync_comms()
        results[mode] = {
            "init": init,
            "final": _snapshot(module),
            "averaged": averaged,
            "weights_before": weights_before,
            "weights_after": weights_after,
            "rounds": model.gossip_round,
        }
    results["bounded"] = _bounded_with_averaging(rank, x, y)
    return results


def _bounded_with_averaging(rank: int, x, y) -> dict:
    """Bounded asynchrony, where timing decides which forward absorbs a round: rank 0 is slow
    to send, so its peers go on with rounds in flight and defer starts."""
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, synch_freq=2, global_avg_freq=K)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    averaged, in_flight_seen = [], False
    for step in range(1, STEPS + 1):
        in_flight_seen |= model.round_in_flight
        loss = ((model(x[rank]) - y[rank]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            time.sleep(0.05)
        model.transfer_params()
        if step % K == 0:
            averaged.append((_snapshot(module), model.ps_weight, model.round_in_flight))
    model.sync_comms()
    return {"averaged": averaged, "rounds": model.gossip_round, "in_flight_seen": in_flight_seen}


@pytest.fixture(scope="module")
def averaging_runs():
    return run_ranks(4, _train_with_averaging)


@pytest.mark.parametrize("mode", list(AVERAGING_MODES))
def test_global_averaging_gives_every_rank_the_reference_average(averaging_runs, mode):
    results = [r[mode] for r in averaging_runs]
    world_size = len(results)
    x, y = _data(world_size)
    books = reference.graph_phone_books("npeer_exponential", world_size, 1)
    m = 2 if mode == "hierarchical" else 1
    nodes = world_size // m
    if m > 1:
        books = reference.graph_phone_books("npeer_exponential", nodes, 1)

    def grad_fn(i, z):
        # A node of m processes takes the mean of their gradients: one batch of all their rows.
        weight, bias = (t.requires_grad_() for t in z)
        rows, targets = x[i * m : (i + 1) * m].reshape(-1, D), y[i * m : (i + 1) * m].reshape(-1, 1)
        ((rows.double() @ weight.T + bias - targets.double()) ** 2).mean().backward()
        return [weight.grad, bias.grad]

    self_weight = [_self_weight(i) for i in range(nodes)] if mode == "self_weight" else None
    final, averaged = _replay_with_averaging(
        init=[results[i * m]["init"] for i in range(nodes)],
        grad_fn=grad_fn,
        events=[_events(mode, STEPS, K)] * nodes,
        out_peers=lambda i, r: reference.out_peers(books, 1, i, r),
        self_weight=self_weight,
    )
    assert len(averaged) == STEPS // K
    for rank, r in enumerate(results):
        node = rank // m
        # Right after every averaging step: every rank holds the reference's exact average...
        for got, want in zip(r["averaged"], averaged):
            for g, w in zip(got, want):
                torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
        # ... the same bits as every other rank, and push-sum weight 1.
        for got, first in zip(r["averaged"], results[0]["averaged"]):
            assert all(torch.equal(g, f) for g, f in zip(got, first))
        assert r["weights_after"] == [1.0] * (STEPS // K)
        leader = rank % m == 0
        if leader:  # the others receive the last round's result at their next forward
            for g, w in zip(r["final"], final[node]):
                torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)
        # The averaging steps ran no gossip round.
        assert r["rounds"] == (STEPS - STEPS // K if leader else 0)
    if mode == "self_weight":
        # The weights did move off 1 between averaging steps, so the reset was tested.
        assert any(abs(w - 1.0) > 1e-3 for r in results for w in r["weights_before"])


def test_global_averaging_under_bounded_asynchrony_meets_every_owed_round(averaging_runs):
    results = [r["bounded"] for r in averaging_runs]
    # Every rank ran every owed round (one per step but the averaging ones) before averaging...
    assert [r["rounds"] for r in results] == [STEPS - STEPS // K] * len(results)
    for r in results:
        # ... and left the averaging step idle, with weight 1 and the same bits as rank 0.
        for (params, weight, in_flight), first in zip(r["averaged"], results[0]["averaged"]):
            assert weight == 1.0 and not in_flight
            assert all(torch.equal(a, b) for a, b in zip(params, first[0]))
    assert any(r["in_flight_seen"] for r in results)


# ----------------------------------------------------------------------------- average_parameters()


def _average_on_demand(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    out = {}
    for mode in ("lazy", "self_weight", "hierarchical"):
        torch.manual_seed(0)
        module = nn.Linear(D, 1).double()
        kwargs = {
            "lazy": {},
            "self_weight": {"mixing": gossip_ext.SelfWeightMixing(_self_weight(rank))},
            "hierarchical": {"nprocs_per_node": 2},
        }[mode]
        model = gossip_ext.GossipDataParallel(module, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for _ in range(4):
            loss = ((model(x[rank].double()) - y[rank].double()) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # Nothing in flight: the values and weight the average must be taken of. A gossip
            # round keeps sum_i w_i z_i and sum_i w_i, so the one about to start cannot change it.
            before = {"z": _snapshot(module), "w": model.ps_weight}
            model.transfer_params()
        assert model.round_in_flight or not model.is_gossip_leader
        model.average_parameters()  # finishes the round in flight first
        out[mode] = {
            "before": before,
            "after": _snapshot(module),
            "w_after": model.ps_weight,
            "leader": model.is_gossip_leader,
        }
        model.sync_comms()
    return out


def test_average_parameters_is_the_weighted_mean_of_the_ranks_values():
    per_rank = run_ranks(4, _average_on_demand)
    for mode in ("lazy", "self_weight", "hierarchical"):
        results = [r[mode] for r in per_rank]
        leaders = [r for r in results if r["leader"]]
        assert len(leaders) == (2 if mode == "hierarchical" else 4)
        total = sum(r["before"]["w"] for r in leaders)
        for k in range(2):
            want = sum(r["before"]["w"] * r["before"]["z"][k] for r in leaders) / total
            if mode != "self_weight":  # weights 1: the plain mean of the de-biased parameters
                plain = torch.stack([r["before"]["z"][k] for r in leaders]).mean(0)
                torch.testing.assert_close(want, plain, rtol=0, atol=1e-14)
            for rank, r in enumerate(results):
                torch.testing.assert_close(
                    r["after"][k], want, rtol=0, atol=1e-12, msg=f"{mode}, rank {rank}"
                )
                assert r["w_after"] == 1.0
        if mode == "self_weight":
            assert any(abs(r["before"]["w"] - 1.0) > 1e-3 for r in results)


# ----------------------------------------------------------------------------- SlowMo

SLOWMO_LR = 0.1
SLOWMO_STEPS = 8
# (slowmo_momentum beta, slowmo_lr alpha): heavy ball with momentum beta and lr alpha * LR.
HEAVY_BALL = ((0.5, 1.0), (0.9, 1.0), (0.7, 0.5))


def _train_slowmo(model, module, x: torch.Tensor, y: torch.Tensor) -> list:
    """SLOWMO_STEPS of plain SGD (no momentum) on this rank's data, the SlowMo step run by the
    optimizer hook; the module's parameters before and after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=SLOWMO_LR)
    model.register_optimizer(opt)
    trajectory = [_snapshot(module)]
    for _ in range(SLOWMO_STEPS):
        loss = ((model(x.double()) - y.double()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        trajectory.append(_snapshot(module))
    return trajectory


def _slowmo_every_step(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    trajectories = {"misuse": _misuse(rank)}
    for beta, alpha in HEAVY_BALL:
        torch.manual_seed(0)
        module = nn.Linear(D, 1).double()
        model = gossip_ext.GossipDataParallel(
            module, slowmo_freq=1, slowmo_momentum=beta, slowmo_lr=alpha
        )
        trajectories[(beta, alpha)] = _train_slowmo(model, module, x[rank], y[rank])
    return trajectories


def _heavy_ball(world_size: int, beta: float, alpha: float, init) -> list[list[torch.Tensor]]:
    x, y = _data(world_size)
    module = nn.Linear(D, 1).double()
    with torch.no_grad():
        for p, value in zip(module.parameters(), init):
            p.copy_(value)
    opt = torch.optim.SGD(module.parameters(), lr=alpha * SLOWMO_LR, momentum=beta)
    trajectory = [_snapshot(module)]
    for _ in range(SLOWMO_STEPS):
        loss = ((module(x.reshape(-1, D).double()) - y.reshape(-1, 1).double()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        trajectory.append(_snapshot(module))
    return trajectory


@pytest.fixture(scope="module")
def slowmo_every_step():
    return run_ranks(2, _slowmo_every_step)


def test_slowmo_every_step_on_two_ranks_is_full_batch_heavy_ball(slowmo_every_step):
    # Every step, each rank takes x - LR g_i from the common x; the exact average is
    # x - LR g with g the full-batch gradient (each rank's loss is a mean over equally many
    # rows); then u <- beta u + (x - x_avg) / LR = beta u + g and x <- x - alpha LR u: torch's
    # SGD with momentum beta (dampening 0, u starting at 0) and learning rate alpha * LR.
    per_rank = slowmo_every_step
    for beta, alpha in HEAVY_BALL:
        want = _heavy_ball(2, beta, alpha, per_rank[0][(beta, alpha)][0])
        for rank, r in enumerate(per_rank):
            for step, (got, expected) in enumerate(zip(r[(beta, alpha)], want)):
                for g, e in zip(got, expected):
                    torch.testing.assert_close(
                        g,
                        e,
                        rtol=1e-12,
                        atol=1e-12,
                        msg=lambda m, s=step, b=beta, a=alpha, r=rank: (
                            f"beta={b}, alpha={a}, rank {r}, step {s}: {m}"
                        ),
                    )


SLOWMO_FREQ = 3
SLOWMO_AVG_FREQ = 2
SLOWMO_BETA, SLOWMO_ALPHA = 0.6, 0.8


def _slowmo_with_gossip(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    model = gossip_ext.GossipDataParallel(
        module,
        global_avg_freq=SLOWMO_AVG_FREQ,
        slowmo_freq=SLOWMO_FREQ,
        slowmo_momentum=SLOWMO_BETA,
        slowmo_lr=SLOWMO_ALPHA,
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    init = _snapshot(module)
    model(x[rank].double())  # x_slow starts at the first forward's parameters
    by_hand = _error_of(model.transfer_params)  # SlowMo needs the optimizer's learning rate
    model.register_optimizer(opt)
    for _ in range(STEPS):
        loss = ((model(x[rank].double()) - y[rank].double()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    return {"init": init, "final": _snapshot(module), "by_hand": by_hand}


def _error_of(call):
    try:
        call()
    except Exception as error:
        return type(error), str(error)
    return None


def test_slowmo_and_global_averaging_between_gossip_rounds_match_the_reference():
    world_size = 4
    per_rank = run_ranks(world_size, _slowmo_with_gossip)
    for r in per_rank:
        assert r["by_hand"] is not None and r["by_hand"][0] is RuntimeError
        assert "register_optimizer" in r["by_hand"][1] and "slowmo_freq=3" in r["by_hand"][1]
    x, y = _data(world_size)
    books = reference.graph_phone_books("npeer_exponential", world_size, 1)

    def grad_fn(i, z):
        weight, bias = (t.requires_grad_() for t in z)
        ((x[i].double() @ weight.T + bias - y[i].double()) ** 2).mean().backward()
        return [weight.grad, bias.grad]

    every = [s for s in range(1, STEPS + 1) if s % SLOWMO_FREQ == 0 or s % SLOWMO_AVG_FREQ == 0]
    slowmo_steps = [index for index, s in enumerate(every) if s % SLOWMO_FREQ == 0]
    events = []
    for step in range(1, STEPS + 1):
        events += [ABSORB, STEP, AVERAGE if step in every else START]
    final, _ = _replay_with_averaging(
        init=[r["init"] for r in per_rank],
        grad_fn=grad_fn,
        events=[events + [ABSORB]] * world_size,
        out_peers=lambda i, r: reference.out_peers(books, 1, i, r),
        slowmo=(SLOWMO_BETA, SLOWMO_ALPHA, lambda index: index in slowmo_steps),
    )
    for rank, r in enumerate(per_rank):
        for got, want in zip(r["final"], final[rank]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")


# ----------------------------------------------------------------------------- checkpoints


def _slowmo_checkpoint_run(rank: int, world_size: int, ckpt_dir: str, phase: str):
    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    model = gossip_ext.GossipDataParallel(module, slowmo_freq=3, slowmo_momentum=0.7)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    model.register_optimizer(opt)
    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    steps = range(10)
    if phase == "resume":
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        steps = range(5, 10)
    for step in steps:
        if phase == "first_half" and step == 5:
            state = model.state_dict()
            torch.save({"model": state, "opt": opt.state_dict()}, path)
            return state["_extra_state"]
        loss = ((model(x[rank].double()) - y[rank].double()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    return _snapshot(module)


def test_slowmo_state_dict_round_trip_continues_the_same_trajectory(tmp_path):
    whole = run_ranks(2, _slowmo_checkpoint_run, str(tmp_path), "whole")
    saved = run_ranks(2, _slowmo_checkpoint_run, str(tmp_path), "first_half")
    resumed = run_ranks(2, _slowmo_checkpoint_run, str(tmp_path), "resume")
    for extra in saved:
        # Saved after 5 steps, one SlowMo step (at 3) in: the schedule's position and a
        # non-zero slow momentum travel with the checkpoint.
        assert extra["steps"] == 5
        assert any(t.abs().sum() > 0 for t in extra["slowmo"]["momentum"])
    for a, b in zip(whole, resumed):
        for pa, pb in zip(a, b):
            assert torch.equal(pa, pb)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "argument, value, error, message",
    [
        ("global_avg_freq", 2.0, TypeError, "global_avg_freq must be an int or None, got float"),
        ("global_avg_freq", True, TypeError, "global_avg_freq must be an int or None, got True"),
        ("global_avg_freq", -1, ValueError, "global_avg_freq must be >= 0 (0 or None: off), got"),
        ("slowmo_freq", "4", TypeError, "slowmo_freq must be an int or None, got str"),
        ("slowmo_freq", -3, ValueError, "slowmo_freq must be >= 0 (0 or None: off), got -3"),
        ("slowmo_momentum", None, TypeError, "slowmo_momentum must be a float, got NoneType"),
        ("slowmo_momentum", 1.0, ValueError, "slowmo_momentum must be in [0, 1), got 1.0"),
        ("slowmo_momentum", -0.1, ValueError, "slowmo_momentum must be in [0, 1), got -0.1"),
        ("slowmo_momentum", float("nan"), ValueError, "slowmo_momentum must be in [0, 1), got"),
        ("slowmo_lr", "1", TypeError, "slowmo_lr must be a float, got str"),
        ("slowmo_lr", 0.0, ValueError, "slowmo_lr must be positive and finite, got 0.0"),
        ("slowmo_lr", float("inf"), ValueError, "slowmo_lr must be positive and finite, got"),
        ("log_every", 1.5, TypeError, "log_every must be an int, got float"),
        ("log_every", -1, ValueError, "log_every must be >= 0 (0: off), got -1"),
    ],
)
def test_bad_averaging_arguments_name_the_argument(argument, value, error, message):
    # Checked before torch.distributed is looked at: no process group needed.
    with pytest.raises(error) as raised:
        gossip_ext.GossipDataParallel(
            nn.Linear(2, 1), timeout=timedelta(seconds=5), **{argument: value}
        )
    assert str(raised.value).startswith(message), str(raised.value)


def _misuse(rank: int) -> dict:
    model = gossip_ext.GossipDataParallel(nn.Linear(2, 1), slowmo_freq=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.param_groups[0]["lr"] = -0.5
    return {
        "bad_lr": _error_of(lambda: model.register_optimizer(opt)),
        # Averaging steps are collectives: ranks on different schedules must not start.
        "disagree": _error_of(
            lambda: gossip_ext.GossipDataParallel(nn.Linear(2, 1), global_avg_freq=rank + 1)
        ),
    }


def test_slowmo_rejects_an_optimizer_without_a_usable_learning_rate(slowmo_every_step):
    for r in slowmo_every_step:
        error = r["misuse"]["bad_lr"]
        assert error is not None and error[0] is ValueError
        assert "param group 0 has lr=-0.5" in error[1], error[1]


def test_ranks_on_different_averaging_schedules_all_raise(slowmo_every_step):
    for r in slowmo_every_step:
        error = r["misuse"]["disagree"]
        assert error is not None and issubclass(error[0], ValueError)
        assert "outer.every: rank 0 has 1, rank 1 has 2" in error[1], error[1]


def _slowmo_sharded(rank: int, world_size: int) -> dict:
    x, y = _data(world_size)
    beta, alpha = HEAVY_BALL[-1]
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    model = gossip_ext.GossipDataParallel(
        module,
        slowmo_freq=1,
        slowmo_momentum=beta,
        slowmo_lr=alpha,
        slowmo_memory_efficient=True,
        slowmo_num_shards=2,
    )
    trajectory = _train_slowmo(model, module, x[rank], y[rank])
    state = model.runtime.outer.rule
    return {"trajectory": trajectory, "kept": [t.numel() for t in state.slow + state.buffer]}


def test_sharded_slowmo_is_the_same_heavy_ball_with_the_state_split_between_ranks():
    # D + 1 = 5 parameters in two shards of 3 and 2; the third rank keeps no SlowMo state.
    results = run_ranks(3, _slowmo_sharded)
    assert [r["kept"] for r in results] == [[3, 3], [2, 2], [0, 0]]
    beta, alpha = HEAVY_BALL[-1]
    want = _heavy_ball(3, beta, alpha, results[0]["trajectory"][0])
    for r in results:
        for got, expected in zip(r["trajectory"], want):
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
