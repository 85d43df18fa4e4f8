"""DiLoCo's outer step (outer_optimizer, sync_every), on real processes over gloo.

The oracle is DiLoCo written out in plain PyTorch in this process: n copies of the model, each
trained by its own AdamW on its own batches; every H steps the mean of the pseudo-gradients
``theta_global - theta_i`` becomes the gradient of an SGD-Nesterov optimizer over a separate
copy ``theta_global``, and every copy is then set to it. Float64 throughout, so the ranks must
agree with it to rounding.
"""

from __future__ import annotations

import io
import math
import os
import signal
from datetime import timedelta

import pytest
import torch
from multiprocess import error_of, run_ranks, run_ranks_tolerating_deaths
from test_faults import LATER_CALLS, _leave_with_the_survivors, _what_a_survivor_reads
from torch import nn

import gossip_ext

D = 5
H = 3
STEPS = 3 * H + 2  # three outer steps, then two inner steps of the next period
INNER_LR = 0.02
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _outer_sgd(params):
    return torch.optim.SGD(params, **OUTER)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (
        torch.randn(4, D, generator=g, dtype=torch.float64),
        torch.randn(4, 1, generator=g, dtype=torch.float64),
    )


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _inner_schedule(step: int) -> float:
    """Warmup over 2 steps, then cosine to 0 over the run."""
    return min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def _outer_schedule(outer_step: int) -> float:
    return 0.8**outer_step


def _schedulers(inner, outer, schedules: bool):
    if not schedules:
        return None, None
    return (
        torch.optim.lr_scheduler.LambdaLR(inner, _inner_schedule),
        torch.optim.lr_scheduler.LambdaLR(outer, _outer_schedule),
    )


def _step(net, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(net(x), y).backward()
    opt.step()


def _reference(world_size: int, schedules: bool) -> tuple[list[list[torch.Tensor]], list]:
    """Every rank's parameters after STEPS steps, and theta_global."""
    nets = [_net() for _ in range(world_size)]
    inner = [torch.optim.AdamW(n.parameters(), lr=INNER_LR, weight_decay=0.01) for n in nets]
    theta = [p.detach().clone() for p in nets[0].parameters()]
    outer = _outer_sgd(theta)
    scheds = [_schedulers(opt, outer, schedules) for opt in inner]
    for step in range(STEPS):
        for rank, (net, opt) in enumerate(zip(nets, inner)):
            _step(net, opt, rank, step)
            if scheds[rank][0] is not None:
                scheds[rank][0].step()
        if (step + 1) % H == 0:
            for j, t in enumerate(theta):
                t.grad = torch.stack([t - list(n.parameters())[j].detach() for n in nets]).mean(0)
            outer.step()
            if scheds[0][1] is not None:
                scheds[0][1].step()
            with torch.no_grad():
                for net in nets:
                    for p, t in zip(net.parameters(), theta):
                        p.copy_(t)
    return [[p.detach().clone() for p in n.parameters()] for n in nets], theta


def _wrap(module: nn.Module, **options) -> gossip_ext.GossipDataParallel:
    options = {
        "base_algorithm": "localsgd",
        "sync_every": H,
        "outer_optimizer": _outer_sgd,
        **options,
    }
    return gossip_ext.GossipDataParallel(module, **options)


def _train_diloco(rank: int, world_size: int, schedules: bool, options=None) -> dict:
    model = _wrap(_net(), **(options or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
    model.register_optimizer(opt)
    inner_sched, outer_sched = _schedulers(opt, model.outer_optimizer, schedules)
    for step in range(STEPS):
        _step(model, opt, rank, step)
        if inner_sched is not None:
            inner_sched.step()
            if (step + 1) % H == 0:
                outer_sched.step()
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "theta": [t.clone() for t in model.outer_optimizer.param_groups[0]["params"]],
        "bytes_sent": model.bytes_sent,
    }


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_diloco_matches_plain_pytorch(world_size):
    expected, theta = _reference(world_size, schedules=False)
    for rank, result in enumerate(run_ranks(world_size, _train_diloco, False)):
        for got, want in zip(result["params"], expected[rank]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for got, want in zip(result["theta"], theta):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert result["bytes_sent"] == 0, "no gossip between outer steps"


def test_diloco_follows_inner_and_outer_learning_rate_schedules():
    expected, theta = _reference(3, schedules=True)
    unscheduled, _ = _reference(3, schedules=False)
    assert not torch.allclose(expected[0][0], unscheduled[0][0]), "the schedules must matter"
    for rank, result in enumerate(run_ranks(3, _train_diloco, True)):
        for got, want in zip(result["params"] + result["theta"], expected[rank] + theta):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- checkpoint


SAVE_AT = H + 1  # after one outer step (its momentum is state), inside the next period


def _resume_bit_for_bit(rank: int, world_size: int, outer_dtype) -> dict:
    def fresh():
        model = _wrap(_net(), outer_dtype=outer_dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
        model.register_optimizer(opt)
        return model, opt

    model, opt = fresh()
    saved = None
    for step in range(STEPS):
        _step(model, opt, rank, step)
        if step + 1 == SAVE_AT:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
            saved = buffer.getvalue()
    straight = [p.detach().clone() for p in model.module.parameters()]

    # A new wrapper and optimizer, as a restarted process makes them; its own start is forgotten.
    resumed, opt = fresh()
    with torch.no_grad():
        for p in resumed.module.parameters():
            p.add_(1.0)
    state = torch.load(io.BytesIO(saved), weights_only=False)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    for step in range(SAVE_AT, STEPS):
        _step(resumed, opt, rank, step)
    return {
        "straight": straight,
        "resumed": [p.detach().clone() for p in resumed.module.parameters()],
        "saved_outer": "outer" in state["model"]["_extra_state"],
        "saved_residuals": "outer_residuals" in state["model"]["_extra_state"],
    }


# "int4": the checkpoint holds the error-feedback residuals of the compressed outer step.
@pytest.mark.parametrize("outer_dtype", [None, "int4"])
def test_a_resumed_run_continues_bit_for_bit(outer_dtype):
    for result in run_ranks(2, _resume_bit_for_bit, outer_dtype):
        assert result["saved_outer"]
        assert result["saved_residuals"] == (outer_dtype is not None)
        for got, want in zip(result["resumed"], result["straight"]):
            assert torch.equal(got, want)


# ----------------------------------------------------------------------------- failures


def _survivor_of_a_failed_outer_step(
    rank: int, world_size: int, dead: int, sync_dir: str, outer_dtype
) -> dict:
    """A peer dies right before the second outer step: the survivors' all-reduce fails, and
    their parameters (the last inner step's), theta_global and the outer momentum stay as they
    were; every later call raises the same error."""
    torch.manual_seed(0)
    module = nn.Linear(3, 1)
    model = gossip_ext.GossipDataParallel(
        module,
        base_algorithm="localsgd",
        sync_every=2,
        outer_optimizer=_outer_sgd,
        outer_dtype=outer_dtype,
        timeout=timedelta(seconds=1),  # the survivors' check-in waits a quarter of it
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = model.outer_optimizer
    theta_tensors = outer.param_groups[0]["params"]
    result = {"error": None}
    try:
        for step in range(4):
            model(torch.full((1, 3), float(rank + 1))).sum().backward()
            opt.step()
            opt.zero_grad()
            last_model = [p.detach().clone() for p in module.parameters()]
            theta = [t.clone() for t in outer.param_groups[0]["params"]]
            momentum = [outer.state[t].get("momentum_buffer") for t in theta_tensors]
            momentum = [m.clone() for m in momentum if m is not None]
            if step == 3 and rank == dead:
                os.kill(os.getpid(), signal.SIGKILL)
            model.transfer_params()
    except gossip_ext.PeerTimeoutError as error:  # the typed error, not gloo's own
        result = _what_a_survivor_reads(model, module, last_model, error)
        result["theta_unchanged"] = all(torch.equal(t, s) for t, s in zip(theta_tensors, theta))
        result["momentum_unchanged"] = len(momentum) == 2 and all(
            torch.equal(outer.state[t]["momentum_buffer"], m)
            for t, m in zip(theta_tensors, momentum)
        )
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


# "int8": the compressed outer step's residuals are kept only once its collectives succeed.
@pytest.mark.parametrize("outer_dtype", [None, "int8"])
def test_a_peer_dying_during_an_outer_step_changes_nothing_and_stays_raised(tmp_path, outer_dtype):
    dead = 1
    outcomes = run_ranks_tolerating_deaths(
        3, _survivor_of_a_failed_outer_step, dead, str(tmp_path), outer_dtype, deadline_s=150.0
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank in (0, 2):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0 and result["error"] is not None, (rank, outcomes[rank])
        # The outer step's all-reduce names the rank that did not check in after it failed.
        assert result["data"]["peers"] == (dead,), (rank, result["error"])
        assert result["module_is_last_model"], (rank, result["error"])
        assert result["state_dict_is_last_model"], (rank, result["error"])
        assert result["theta_unchanged"] and result["momentum_unchanged"], rank
        for name in LATER_CALLS:
            assert result["later"][name] == (result["type"], result["error"]), (rank, name, result)


# ----------------------------------------------------------------------------- bad input


def _not_an_optimizer(params):
    return params


def _the_modules_parameters(module):
    return lambda params: torch.optim.SGD(module.parameters(), lr=0.7)


def _bad_outer_arguments(rank: int, world_size: int) -> list:
    def make(**options):
        return error_of(lambda: gossip_ext.GossipDataParallel(_net(), **options))

    net = _net()
    return [
        make(outer_optimizer="sgd", sync_every=4),
        make(outer_optimizer=_not_an_optimizer, sync_every=4),
        error_of(
            lambda: gossip_ext.GossipDataParallel(
                net, outer_optimizer=_the_modules_parameters(net), sync_every=4
            )
        ),
        make(outer_optimizer=_outer_sgd, sync_every=0),
        make(outer_optimizer=_outer_sgd),
        make(outer_optimizer=_outer_sgd, sync_every=4, slowmo_freq=4),
        make(sync_every=4, global_avg_freq=8),
        make(outer_device="cpu"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_device="cuda:0"),
        make(base_algorithm="localsgd"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_average="mean"),
        make(sync_every=4, outer_average="gossip"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_average="gossip", nprocs_per_node=2),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_dtype="int3"),
        make(sync_every=4, outer_dtype="int8"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_average="gossip", outer_dtype="int4"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_average="compressed_gossip"),
        make(outer_optimizer=_outer_sgd, sync_every=4, outer_consensus_step=0.75),
        make(outer_optimizer=_outer_sgd, sync_every=4, fragments=0),
        make(outer_optimizer=_outer_sgd, sync_every=4, fragment_delay=-1),
        make(outer_optimizer=_outer_sgd, sync_every=4, fragment_alpha=1.5),
        make(sync_every=4, fragments=2),
        make(outer_optimizer=_outer_sgd, sync_every=4, fragments=5),
        make(outer_optimizer=_outer_sgd, sync_every=8, fragments=4, fragment_delay=2),
        make(outer_optimizer=_outer_sgd, sync_every=8, fragments=5),
        error_of(
            lambda: _wrap(_net(), fragments=2, fragment_delay=0, sync_every=4).outer_optimizer
        ),
    ]


def test_bad_outer_arguments_raise_naming_the_argument_and_value():
    errors = run_ranks(2, _bad_outer_arguments)[0]
    expected = [
        (TypeError, "outer_optimizer must be a callable", "str 'sgd'"),
        (TypeError, "outer_optimizer must build a torch.optim.Optimizer", "returned list"),
        (ValueError, "over the tensors it is given", "lambda params"),
        (ValueError, "sync_every must be >= 1", "got 0"),
        (ValueError, "outer_optimizer needs sync_every", "sync_every=None"),
        (ValueError, "sync_every=4 and slowmo_freq=4", "choose one"),
        (ValueError, "sync_every=4 and global_avg_freq=8", "choose one"),
        (ValueError, "outer_device='cpu'", "outer_optimizer is None"),
        (ValueError, "outer_device must be 'cpu' or the parameters' device cpu", "'cuda:0'"),
        (ValueError, "base_algorithm='localsgd'", "sync_every=None"),
        (
            ValueError,
            "outer_average must be 'allreduce', 'gossip' or 'compressed_gossip'",
            "'mean'",
        ),
        (ValueError, "outer_average='gossip'", "outer_optimizer is None"),
        (ValueError, "outer_average='gossip' with nprocs_per_node=2", "outer_average='allreduce'"),
        (ValueError, "outer_dtype must be torch.bfloat16", "'int4' or None", "got 'int3'"),
        (ValueError, "outer_dtype='int8' compresses DiLoCo's", "outer_optimizer is None"),
        (ValueError, "outer_dtype='int4'", "outer_average='gossip'", "message_dtype compresses"),
        (ValueError, "outer_average='compressed_gossip' sends sparse", "TopK(...), got None"),
        (ValueError, "outer_consensus_step=0.75", "outer_average is 'allreduce'"),
        (ValueError, "fragments must be >= 1", "got 0"),
        (ValueError, "fragment_delay must be >= 0", "got -1"),
        (ValueError, "fragment_alpha must be in [0, 1]", "got 1.5"),
        (ValueError, "fragments=2", "need outer_optimizer and sync_every"),
        (ValueError, "fragments must be at most sync_every=4", "got 5"),
        (ValueError, "fragment_delay must be < sync_every // fragments = 2", "got 2"),
        (ValueError, "fragments must be at most the number of parameters (4)", "got 5"),
        (ValueError, "fragments=2: each fragment has an outer optimizer", "model.outer_optimizers"),
    ]
    for got, (kind, *words) in zip(errors, expected, strict=True):
        assert got is not None and got[0] is kind, (got, words)
        for word in words:
            assert word in got[1], (got, word)


def _ranks_with_other_outer_optimizers(rank: int, world_size: int):
    lr = 0.7 if rank == 0 else 0.5
    return error_of(lambda: _wrap(_net(), outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr)))


def test_ranks_with_different_outer_optimizers_raise():
    for error in run_ranks(2, _ranks_with_other_outer_optimizers):
        assert error is not None and issubclass(error[0], ValueError)
        assert "outer.rule: rank 0 has" in error[1] and "'lr': 0.5" in error[1], error


# ----------------------------------------------------------------------------- over SGP


SGP_STEPS, SGP_EVERY, SGP_LR = 8, 3, 0.05


def _sgp_with_outer_steps(rank: int, world_size: int) -> dict:
    from test_averaging import _data, _self_weight

    x, y = _data(world_size)
    torch.manual_seed(0)
    module = nn.Linear(x.shape[-1], 1).double()
    model = gossip_ext.GossipDataParallel(
        module,
        mixing=gossip_ext.SelfWeightMixing(_self_weight(rank)),  # push-sum weights off 1
        sync_every=SGP_EVERY,
        outer_optimizer=_outer_sgd,
    )
    opt = torch.optim.SGD(model.parameters(), lr=SGP_LR)
    model.register_optimizer(opt)
    init = [p.detach().clone() for p in module.parameters()]
    weights = []
    for _ in range(SGP_STEPS):
        loss = ((model(x[rank].double()) - y[rank].double()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        weights.append(model.ps_weight)
    model.sync_comms()
    return {"init": init, "final": [p.detach().clone() for p in module.parameters()], "w": weights}


def test_outer_steps_over_sgp_match_the_gossip_replay():
    """SGP every step, and every SGP_EVERY steps the push-sum consensus value steps the outer
    optimizer instead of that step's round (the plain-PyTorch replay of tests/test_averaging.py,
    with torch's SGD-Nesterov over its own copy of theta_global)."""
    import reference
    from test_averaging import LR, _data, _replay_with_averaging, _self_weight
    from training_reference import ABSORB, START, STEP

    assert LR == SGP_LR
    world_size = 4
    per_rank = run_ranks(world_size, _sgp_with_outer_steps)
    assert any(abs(w - 1.0) > 1e-3 for r in per_rank for w in r["w"]), "weights must move off 1"
    x, y = _data(world_size)
    books = reference.graph_phone_books("npeer_exponential", world_size, 1)

    def grad_fn(i, z):
        weight, bias = (t.requires_grad_() for t in z)
        ((x[i].double() @ weight.T + bias - y[i].double()) ** 2).mean().backward()
        return [weight.grad, bias.grad]

    theta = [t.clone() for t in per_rank[0]["init"]]
    outer = _outer_sgd(theta)

    def outer_step(index, average):
        for t, a in zip(theta, average):
            t.grad = t - a
        outer.step()
        return [t.detach().clone() for t in theta]

    events = []
    for step in range(1, SGP_STEPS + 1):
        events += [ABSORB, STEP, "average" if step % SGP_EVERY == 0 else START]
    final, _ = _replay_with_averaging(
        init=[r["init"] for r in per_rank],
        grad_fn=grad_fn,
        events=[events + [ABSORB]] * world_size,
        out_peers=lambda i, r: reference.out_peers(books, 1, i, r),
        self_weight=[_self_weight(i) for i in range(world_size)],
        outer=outer_step,
    )
    for rank, r in enumerate(per_rank):
        for got, want in zip(r["final"], final[rank]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")


# ----------------------------------------------------------------------------- gossip averaging


def _diloco_by_gossip(rank: int, world_size: int, base: str, message_dtype) -> dict:
    model = _wrap(_net(), base_algorithm=base, outer_average="gossip", message_dtype=message_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
    outer = model.outer_optimizer
    seen = {"params": [], "before": [], "after": [], "bytes": []}

    def before_outer_step(*_):
        # Registered ahead of register_optimizer's hook: runs first, with the inner step done.
        if model.step_count % H == H - 1:
            seen["params"].append([p.detach().clone() for p in model.module.parameters()])
            seen["before"].append([t.clone() for t in outer.param_groups[0]["params"]])

    opt.register_step_post_hook(before_outer_step)
    model.register_optimizer(opt)
    for step in range(STEPS):
        _step(model, opt, rank, step)
        seen["bytes"].append(model.bytes_sent)
        if (step + 1) % H == 0:
            seen["after"].append([t.clone() for t in outer.param_groups[0]["params"]])
    seen["consensus"] = model.consensus_distance()
    seen["final"] = [p.detach().clone() for p in model.module.parameters()]
    return seen


@pytest.mark.parametrize(
    "base,message_dtype", [("localsgd", None), ("localsgd", torch.bfloat16), ("sgp", None)]
)
def test_gossip_outer_averaging_keeps_the_mean_of_exact_diloco(base, message_dtype):
    """Push-sum keeps the mean over workers and SGD with momentum is linear, so the mean of the
    workers' theta_global after every outer step is the outer optimizer stepped from their mean
    with the mean of their pseudo-gradients (through the first outer step, where every theta_global
    is the same start, that is exact DiLoCo's step)."""
    world_size = 4
    runs = run_ranks(world_size, _diloco_by_gossip, base, message_dtype)
    tolerance = 1e-9 if message_dtype is None else 2e-2 * INNER_LR  # one bf16 rounding of a step
    mean_theta = [t.clone() for t in runs[0]["before"][0]]
    reference = _outer_sgd(mean_theta)
    for k in range(STEPS // H):
        before = [torch.stack([r["before"][k][j] for r in runs]).mean(0) for j in range(4)]
        delta = [
            torch.stack([r["before"][k][j] - r["params"][k][j] for r in runs]).mean(0)
            for j in range(4)
        ]
        with torch.no_grad():
            for t, b in zip(mean_theta, before):
                t.copy_(b)
        for t, d in zip(mean_theta, delta):
            t.grad = d
        reference.step()
        for j, want in enumerate(mean_theta):
            got = torch.stack([r["after"][k][j] for r in runs]).mean(0)
            torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance, msg=f"step {k}")
    # The workers differ (each mixed with its own peer); under LocalSGD each sends one model to one
    # peer per period, at its outer step, and nothing else (over SGP, one every step).
    assert any(not torch.equal(r["after"][0][0], runs[0]["after"][0][0]) for r in runs[1:])
    assert 0 < runs[0]["consensus"] < 0.1
    for r in runs:
        model_bytes = sum(t.numel() * (2 if message_dtype else 8) for t in r["final"])
        sent = [b - a for a, b in zip([0] + r["bytes"], r["bytes"])]
        every = 1 if base == "sgp" else H
        assert sent == [model_bytes if (s + 1) % every == 0 else 0 for s in range(STEPS)], sent
