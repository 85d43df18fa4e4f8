"""Streaming DiLoCo (fragments, fragment_delay, fragment_alpha; gossip_ext.outer.streaming) on real
processes over gloo, against Streaming DiLoCo written out in plain PyTorch in this process: n
copies of the model, each trained by its own AdamW; fragment j's mean pseudo-gradient is taken at
step s_j - tau of every period and applied at s_j by that fragment's own SGD-Nesterov over its
copy of theta_global, the copies' fragment then set to alpha * local + (1 - alpha) * theta_global.
By gossip (outer_average="gossip"), each copy keeps its own theta_global and optimizers, and its
mean is that of its pseudo-gradient and its in-peer's in the round of the prepare. Float64
throughout: the ranks agree with it to rounding."""

from __future__ import annotations

import io
import os
import signal
from datetime import timedelta

import pytest
import torch
from multiprocess import run_ranks, run_ranks_tolerating_deaths
from test_diloco import INNER_LR, _net, _outer_sgd, _step
from test_faults import LATER_CALLS, _leave_with_the_survivors, _what_a_survivor_reads

import gossip_ext
from gossip_ext.outer.streaming import Schedule, fragment_bounds

H = 4
STEPS = 3 * H + 1  # three periods, then one step of the next (a fragment in flight if tau > 0)
# _net()'s parameters in module order: Linear(5, 4).weight, .bias, Linear(4, 1).weight, .bias,
# 20, 4, 4 and 1 float64 values: the fragments of about equal bytes the wrapper must cut.
BOUNDS = {1: [(0, 4)], 2: [(0, 1), (1, 4)], 3: [(0, 1), (1, 2), (2, 4)]}


def _in_peer(rank: int, world_size: int, round: int) -> int:
    """Who sends to ``rank`` in ``round`` of the default graph (one peer, exponential): rank r
    sends to r + 2^(round mod log2 n)."""
    hops = world_size.bit_length() - 1
    return (rank - 2 ** (round % hops)) % world_size


def _reference(
    world_size: int,
    fragments: int,
    delay: int,
    alpha: float,
    steps: int = STEPS,
    by_gossip: bool = False,
):
    """Every rank's parameters after ``steps`` steps, and every fragment's theta_global (one per
    rank by gossip, else one)."""
    nets = [_net() for _ in range(world_size)]
    inner = [torch.optim.AdamW(n.parameters(), lr=INNER_LR, weight_decay=0.01) for n in nets]
    params = [list(n.parameters()) for n in nets]
    bounds = BOUNDS[fragments]
    copies = world_size if by_gossip else 1
    # theta[c][j]: copy c's theta_global of fragment j, stepped by outer[c][j].
    theta = [
        [[p.detach().clone() for p in params[0][lo:hi]] for lo, hi in bounds] for _ in range(copies)
    ]
    outer = [[_outer_sgd(t) for t in theta_c] for theta_c in theta]
    apply_at = [H * (j + 1) // fragments for j in range(fragments)]
    pending = {}
    for step in range(steps):
        for rank, (net, opt) in enumerate(zip(nets, inner)):
            _step(net, opt, rank, step)
        i = step % H + 1
        for j, (lo, _) in enumerate(bounds):
            if apply_at[j] - delay != i:
                continue
            # Pseudo-gradients d[r][k] of every rank, then each copy's mean of them.
            d = [
                [t - params[r][lo + k].detach() for k, t in enumerate(theta[r % copies][j])]
                for r in range(world_size)
            ]
            if by_gossip:  # uniform mixing: half its own, half its in-peer's (round = step + 1)
                peer = [_in_peer(r, world_size, step + 1) for r in range(world_size)]
                pending[j] = [
                    [(a + b) / 2 for a, b in zip(d[r], d[peer[r]])] for r in range(world_size)
                ]
            else:
                pending[j] = [[torch.stack(ds).mean(0) for ds in zip(*d)]]
        for j, (lo, _) in enumerate(bounds):
            if apply_at[j] != i:
                continue
            for c, means in enumerate(pending.pop(j)):
                for t, g in zip(theta[c][j], means):
                    t.grad = g
                outer[c][j].step()
            with torch.no_grad():
                for r, ps in enumerate(params):
                    for k, t in enumerate(theta[r % copies][j]):
                        ps[lo + k].copy_(torch.lerp(t, ps[lo + k], alpha))
    return [[p.detach().clone() for p in ps] for ps in params], theta


def _wrap(**options) -> gossip_ext.GossipDataParallel:
    options = {
        "base_algorithm": "localsgd",
        "sync_every": H,
        "outer_optimizer": _outer_sgd,
        **options,
    }
    return gossip_ext.GossipDataParallel(_net(), **options)


def _train(rank: int, world_size: int, options: dict) -> dict:
    model = _wrap(**options)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
    model.register_optimizer(opt)
    for step in range(STEPS):
        _step(model, opt, rank, step)
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "theta": [[t.clone() for t in o.param_groups[0]["params"]] for o in model.outer_optimizers],
        "bounds": model.runtime.outer.rule.bounds,
    }


CASES = [
    (2, 0, 0.0),
    (2, 1, 0.0),
    (3, 0, 0.0),
    (2, 1, 0.5),
    (1, 1, 0.0),  # one fragment, delayed: DiLoCo with its communication behind a step
    (1, 2, 0.3),
]


@pytest.mark.parametrize("fragments, delay, alpha", CASES)
def test_streaming_diloco_matches_plain_pytorch(fragments, delay, alpha):
    world_size = 3
    expected, theta = _reference(world_size, fragments, delay, alpha)
    options = {"fragments": fragments, "fragment_delay": delay, "fragment_alpha": alpha}
    _assert_matches(run_ranks(world_size, _train, options), expected, theta, fragments)


@pytest.mark.parametrize("fragments, delay, alpha", [(2, 0, 0.0), (2, 1, 0.0), (3, 0, 0.5)])
def test_streaming_diloco_by_gossip_matches_plain_pytorch(fragments, delay, alpha):
    world_size = 4
    assert all(
        gossip_ext.NPeerDynamicDirectedExponentialGraph().in_peers(r, world_size, t)
        == [_in_peer(r, world_size, t)]
        for r in range(world_size)
        for t in range(4)
    )
    expected, theta = _reference(world_size, fragments, delay, alpha, by_gossip=True)
    options = {
        "fragments": fragments,
        "fragment_delay": delay,
        "fragment_alpha": alpha,
        "outer_average": "gossip",
    }
    results = run_ranks(world_size, _train, options)
    _assert_matches(results, expected, theta, fragments)
    # The workers' theta_global differ (a round mixes two of four), yet their pseudo-gradients'
    # mean is conserved, so theta_global's mean is exact DiLoCo's as long as the step is linear.
    assert not torch.equal(results[0]["theta"][0][0], results[1]["theta"][0][0])


def _assert_matches(results, expected, theta, fragments):
    for rank, result in enumerate(results):
        assert result["bounds"] == BOUNDS[fragments]
        for got, want in zip(result["params"], expected[rank]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for got_fragment, want_fragment in zip(result["theta"], theta[rank % len(theta)]):
            for got, want in zip(got_fragment, want_fragment):
                torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_streaming_with_compressed_messages_stays_within_their_rounding():
    world_size = 3
    expected, _ = _reference(world_size, 2, 1, 0.0)
    options = {"fragments": 2, "fragment_delay": 1, "outer_dtype": "int8"}
    results = run_ranks(world_size, _train, options)
    worst = max(
        (got - want).abs().max().item()
        for rank, result in enumerate(results)
        for got, want in zip(result["params"], expected[rank])
    )
    # As DiLoCo's compressed outer step (test_compressed_outer.py): a few int8 levels of the
    # pseudo-gradients. Measured: 4.5e-4.
    assert 0.0 < worst <= 2e-3, worst


def _over_sgp(rank: int, world_size: int) -> dict:
    """Streaming DiLoCo over the SGP base: the workers gossip every step, and fragment j's
    parameters are theta_global_j, the same on every rank, right after its apply (alpha = 0)."""
    model = _wrap(base_algorithm="sgp", fragments=2, fragment_delay=1)
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
    model.register_optimizer(opt)
    after_apply = []
    for step in range(STEPS):
        _step(model, opt, rank, step)
        if (step % H) + 1 in (2, 4):  # fragment 0 applied after step 2, fragment 1 after 4
            j = 0 if (step % H) + 1 == 2 else 1
            lo, hi = BOUNDS[2][j]
            params = list(model.module.parameters())[lo:hi]
            theta = model.outer_optimizers[j].param_groups[0]["params"]
            after_apply.append(
                (
                    all(torch.equal(p, t) for p, t in zip(params, theta)),
                    [p.detach().clone() for p in params],
                )
            )
    return {"after_apply": after_apply, "bytes_sent": model.bytes_sent}


def test_streaming_over_sgp_sets_every_rank_to_the_same_fragment():
    results = run_ranks(3, _over_sgp)
    for result in results:
        assert result["bytes_sent"] > 0, "the workers gossip between the fragments' steps"
        assert all(equal for equal, _ in result["after_apply"])
    for k in range(len(results[0]["after_apply"])):
        for other in results[1:]:
            for a, b in zip(results[0]["after_apply"][k][1], other["after_apply"][k][1]):
                assert torch.equal(a, b)


def _by_gossip_over_sgp(rank: int, world_size: int) -> dict:
    """Fragment 0 (tau = 1) is prepared after step 1 and applied after step 2, by gossip, while
    the workers gossip every step: records each rank's pseudo-gradient at the prepare and its
    theta_global after the apply."""
    model = _wrap(base_algorithm="sgp", fragments=2, fragment_delay=1, outer_average="gossip")
    opt = torch.optim.AdamW(model.parameters(), lr=INNER_LR, weight_decay=0.01)
    lo, hi = BOUNDS[2][0]
    theta = model.outer_optimizers[0].param_groups[0]["params"]
    seen = {"start": [t.clone() for t in theta]}

    def before_prepare(*_):
        # Registered ahead of register_optimizer's hook: the inner step is done, the prepare not.
        if model.step_count == 0:
            params = list(model.module.parameters())[lo:hi]
            seen["d"] = [t - p.detach() for t, p in zip(theta, params)]

    opt.register_step_post_hook(before_prepare)
    model.register_optimizer(opt)
    for step in range(2):
        _step(model, opt, rank, step)
    seen["theta"] = [t.clone() for t in theta]
    seen["fragment"] = [p.detach().clone() for p in list(model.module.parameters())[lo:hi]]
    seen["bytes_sent"] = model.bytes_sent
    return seen


def test_streaming_by_gossip_over_sgp_conserves_the_mean_pseudo_gradient():
    """Every theta_global starts equal and the first step of SGD-Nesterov is linear in its
    gradient, so the mean over workers of theta_global after the first apply is one step of that
    optimizer with the workers' mean pseudo-gradient: gossip conserved it."""
    results = run_ranks(4, _by_gossip_over_sgp)
    mean_d = [torch.stack(ds).mean(0) for ds in zip(*(r["d"] for r in results))]
    want = [t.clone().requires_grad_() for t in results[0]["start"]]
    opt = _outer_sgd(want)
    for t, g in zip(want, mean_d):
        t.grad = g
    opt.step()
    for k, w in enumerate(want):
        got = torch.stack([r["theta"][k] for r in results]).mean(0)
        torch.testing.assert_close(got, w.detach(), rtol=1e-9, atol=1e-12)
    for r in results:
        assert r["bytes_sent"] > 0
        assert all(torch.equal(p, t) for p, t in zip(r["fragment"], r["theta"]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["theta"], results[1]["theta"]))


# ----------------------------------------------------------------------------- schedule


def test_fragments_are_contiguous_runs_of_about_equal_bytes():
    assert fragment_bounds([10, 10, 10, 10], 2) == [(0, 2), (2, 4)]
    assert fragment_bounds([100, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    assert fragment_bounds([5, 5, 5], 3) == [(0, 1), (1, 2), (2, 3)]
    for sizes, k in [([3, 1, 4, 1, 5, 9, 2, 6], 4), ([1] * 10, 7), ([7, 1], 2)]:
        bounds = fragment_bounds(sizes, k)
        assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(lo < hi for lo, hi in bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError, match=r"fragments must be at most the number of parameters"):
        fragment_bounds([1, 2], 3)


def test_schedule_is_torchfts_offsets():
    # H = 10, k = 4: s_j = floor(10 (j + 1) / 4) = 2, 5, 7, 10; tau = 1 prepares a step earlier.
    schedule = Schedule(10, 4, 1)
    assert schedule.apply_at == [2, 5, 7, 10]
    assert schedule.prepare_at == [1, 4, 6, 9]
    assert schedule.actions(11) == [("prepare", 0)]  # the next period starts over
    assert Schedule(4, 2, 0).actions(2) == [("prepare", 0), ("apply", 0)]


def test_schedule_names_the_fragments_in_flight_after_a_step_and_their_prepares():
    # What an elastic epoch that begins after that step has every member send: prepared at
    # steps 1, 4, 6, 9 of each period of 10, applied at 2, 5, 7, 10.
    schedule = Schedule(10, 4, 1)
    assert schedule.in_flight(0) == {}
    assert schedule.in_flight(1) == {0: 1}
    assert schedule.in_flight(2) == {}
    assert schedule.in_flight(4) == {1: 4}
    assert schedule.in_flight(19) == {3: 19}
    assert schedule.in_flight(20) == {}
    assert Schedule(10, 2, 3).in_flight(13) == {0: 12}  # prepared at 2, applied at 5
    assert all(Schedule(4, 2, 0).in_flight(step) == {} for step in range(12))


# ----------------------------------------------------------------------------- checkpoint


SAVE_AT = H + 1  # fragment 0 was prepared at this step (tau = 1) and is in flight


def _resume_in_flight(rank: int, world_size: int, mean: dict) -> dict:
    options = {"fragments": 2, "fragment_delay": 1, **mean}

    def fresh():
        model = _wrap(**options)
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

    resumed, opt = fresh()
    with torch.no_grad():
        for p in resumed.module.parameters():
            p.add_(1.0)  # a restarted process's own initialisation, overwritten by the load
    state = torch.load(io.BytesIO(saved), weights_only=False)
    resumed.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    # Saved again before it is sent again: still in flight.
    again = resumed.state_dict()["_extra_state"]["streaming"]["fragments"][0]["in_flight"]
    for step in range(SAVE_AT, STEPS):
        _step(resumed, opt, rank, step)
    fragments = state["model"]["_extra_state"]["streaming"]["fragments"]
    return {
        "straight": straight,
        "resumed": [p.detach().clone() for p in resumed.module.parameters()],
        "in_flight_saved": fragments[0]["in_flight"] is not None,
        "in_flight_saved_again": again is not None
        and all(
            torch.equal(a, b)
            for a, b in zip(
                again["pseudo_gradients"], fragments[0]["in_flight"]["pseudo_gradients"]
            )
        ),
        "residuals_saved": fragments[0]["residuals"] is not None,
    }


@pytest.mark.parametrize(
    "mean",
    [{}, {"outer_dtype": "int4"}, {"outer_average": "gossip"}],
    ids=["exact", "int4", "gossip"],
)
def test_a_run_saved_with_a_fragment_in_flight_resumes_bit_for_bit(mean):
    for result in run_ranks(4 if mean.get("outer_average") else 2, _resume_in_flight, mean):
        assert result["in_flight_saved"] and result["in_flight_saved_again"]
        assert result["residuals_saved"] == ("outer_dtype" in mean)
        for got, want in zip(result["resumed"], result["straight"]):
            assert torch.equal(got, want)


# ----------------------------------------------------------------------------- failures


def _survivor_of_a_delayed_sync(
    rank: int, world_size: int, dead: int, sync_dir: str, mean: dict
) -> dict:
    """Fragment 0 is prepared after step 1 (tau = 1) and applied after step 2; the dead peer
    dies before it sends: the survivors' averaging starts, and their apply raises, leaving their
    parameters (step 2's) and theta_global as they were; every later call raises the same
    error."""
    model = _wrap(fragments=2, fragment_delay=1, timeout=timedelta(seconds=1), **mean)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    module = model.module
    outers = model.outer_optimizers
    result = {"error": None}
    try:
        for step in range(4):
            _step(model, opt, rank, step)
            last_model = [p.detach().clone() for p in module.parameters()]
            theta = [[t.clone() for t in o.param_groups[0]["params"]] for o in outers]
            if step == 0 and rank == dead:
                os.kill(os.getpid(), signal.SIGKILL)
            model.transfer_params()
    except (RuntimeError, TimeoutError) as error:
        result = _what_a_survivor_reads(model, module, last_model, error)
        result["theta_unchanged"] = all(
            torch.equal(t, s)
            for o, saved in zip(outers, theta)
            for t, s in zip(o.param_groups[0]["params"], saved)
        )
        result["failed_at_step"] = step
    _leave_with_the_survivors(sync_dir, rank, world_size, dead)
    return result


def test_a_peer_dying_during_a_delayed_sync_changes_nothing_and_stays_raised(tmp_path):
    dead = 1
    outcomes = run_ranks_tolerating_deaths(
        3, _survivor_of_a_delayed_sync, dead, str(tmp_path), {}, deadline_s=150.0
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank in (0, 2):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0 and result["error"] is not None, (rank, outcomes[rank])
        assert result["failed_at_step"] == 1, result  # fragment 0's apply
        # The fragment's all-reduce names the rank that did not check in after it failed.
        assert result["data"]["peers"] == (dead,), (rank, result["error"])
        _assert_unchanged_and_sticky(rank, result)


def test_a_peer_dying_during_a_delayed_gossip_sync_is_named_by_its_neighbour(tmp_path):
    """By gossip only the dead peer's neighbours wait on it: rank 0 receives from rank 1 in
    fragment 0's round (the prepare's step, 1: r sends to r + 2 mod 3), and raises at the apply,
    naming it; rank 2 sends to it, and raises when the send or a later exchange fails."""
    dead = 1
    outcomes = run_ranks_tolerating_deaths(
        3,
        _survivor_of_a_delayed_sync,
        dead,
        str(tmp_path),
        {"outer_average": "gossip"},
        deadline_s=150.0,
    )
    assert outcomes[dead].exitcode == -signal.SIGKILL, outcomes[dead]
    for rank in (0, 2):
        result = outcomes[rank].result
        assert outcomes[rank].exitcode == 0 and result["error"] is not None, (rank, outcomes[rank])
        assert result["type"] == "PeerTimeoutError", result  # a TimeoutError
        _assert_unchanged_and_sticky(rank, result)
    first = outcomes[0].result
    # Fragment 0's apply raises; its prepare posts the round's messages at step 0, the step the
    # dead peer killed itself in, and raises there where its connections are already closed (seen
    # once in a full run). Either way the error names the round and the peer.
    assert first["failed_at_step"] in (0, 1), first
    assert "round 1" in first["error"] and "rank 1" in first["error"], first["error"]
    assert (first["data"]["peers"], first["data"]["round"]) == ((dead,), 1), first["data"]


def _assert_unchanged_and_sticky(rank: int, result: dict) -> None:
    assert result["module_is_last_model"], (rank, result["error"])
    assert result["state_dict_is_last_model"], (rank, result["error"])
    assert result["theta_unchanged"], rank
    for name in LATER_CALLS:
        assert result["later"][name] == (result["type"], result["error"]), (rank, name, result)
