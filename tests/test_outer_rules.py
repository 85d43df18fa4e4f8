"""The outer steps' parts on their own, in one process: the schedule of gossip_ext.outer.outer_steps
and the rules of gossip_ext.outer.rules against torch's optimizers and SlowMo's formula."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip_ext.averagings import ParameterMean, PseudoGradientMean
from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.outer import outer_steps, slow_momentum
from gossip_ext.outer import rules as outer_rules


def _params():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    return list(net.parameters())


def _flat_averages(params, shift: float) -> list[torch.Tensor]:
    """One bucket (one dtype): the parameters' values moved by ``shift``, as an average would."""
    return [torch.cat([p.detach().reshape(-1) for p in params]) + shift]


@pytest.mark.parametrize(
    "every,sync,expected",
    [
        (0, 3, [None, None, "outer", None, None, "outer"]),
        (2, 3, [None, "average", "outer", "average", None, "outer"]),
        (2, 0, [None, "average", None, "average", None, "average"]),
    ],
)
def test_the_schedule_puts_the_rule_before_a_plain_average(every, sync, expected):
    params = _params()
    rule = outer_rules.OuterOptimizer(
        params, ParameterBuckets(params), lambda ps: torch.optim.SGD(ps, lr=1.0)
    )
    steps = outer_steps.OuterSteps(
        params, [], None, average_every=every, rule=rule if sync else None, sync_every=sync
    )
    assert [steps.kind(s) for s in range(1, 7)] == expected


def test_the_outer_optimizer_is_torchs_stepped_on_theta_minus_the_average():
    params = _params()
    buckets = ParameterBuckets(params)

    def nesterov(ps):
        return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, weight_decay=0.1)

    rule = outer_rules.OuterOptimizer(params, buckets, nesterov)
    rule.start(buckets)
    theta = [p.detach().clone() for p in params]
    reference = nesterov(theta)
    for k in range(3):
        averages = _flat_averages(params, 0.1 * (k + 1))
        mean = averages[0].clone()
        new = rule.step(ParameterMean(averages), buckets)
        offset = 0
        for t in theta:
            t.grad = t.detach() - mean[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
        reference.step()
        want = torch.cat([t.detach().reshape(-1) for t in theta])
        torch.testing.assert_close(new[0], want, rtol=1e-12, atol=1e-12)
        assert all(p.grad is None for p in rule.global_params), "gradients are not kept"
    # Its view of theta_global is shaped and ordered as the module's parameters.
    assert [t.shape for t in rule.global_params] == [p.shape for p in params]


def test_the_outer_optimizer_state_round_trips_and_checks_its_layout():
    params = _params()
    buckets = ParameterBuckets(params)
    rule = outer_rules.OuterOptimizer(
        params, buckets, lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9)
    )
    rule.start(buckets)
    rule.step(ParameterMean(_flat_averages(params, 0.5)), buckets)
    saved = rule.state_dict()
    other = outer_rules.OuterOptimizer(
        params, buckets, lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9)
    )
    other.load_state_dict(saved, buckets)
    assert other.started and torch.equal(other.flat[0], rule.flat[0])
    a = rule.step(ParameterMean(_flat_averages(params, 0.2)), buckets)[0].clone()
    b = other.step(ParameterMean(_flat_averages(params, 0.2)), buckets)[0]
    assert torch.equal(a, b), "the momentum came back with the checkpoint"
    smaller = _params()[:2]
    with pytest.raises(ValueError, match="theta_global has buckets"):
        outer_rules.OuterOptimizer(
            smaller, ParameterBuckets(smaller), lambda ps: torch.optim.SGD(ps, lr=1.0)
        ).load_state_dict(saved, ParameterBuckets(smaller))


def test_slowmo_is_heavy_ball_on_the_average_scaled_by_the_inner_lr():
    params = _params()
    buckets = ParameterBuckets(params)
    inner = torch.optim.SGD(params, lr=0.05)
    beta, alpha, gamma = 0.5, 0.8, 0.05
    rule = slow_momentum.SlowMomentum(beta, alpha, group=None)
    rule.start(buckets)
    slow = torch.cat([p.detach().reshape(-1) for p in params])
    u = torch.zeros_like(slow)
    for k in range(3):
        averages = _flat_averages(params, -0.01 * (k + 1))
        x_avg = averages[0].clone()
        new = rule.step(ParameterMean(averages), buckets, inner)[0]
        u = beta * u + (slow - x_avg) / gamma
        slow = slow - alpha * gamma * u
        torch.testing.assert_close(new, slow, rtol=1e-12, atol=1e-12)


def test_each_rule_steps_alike_on_a_mean_of_parameters_and_of_pseudo_gradients():
    """An averaging of parameters and one of pseudo-gradients hand a rule the same mean in its
    two forms (``Mean.parameters``, ``Mean.pseudo_gradients``): DiLoCo's and SlowMo's steps
    agree on both; a plain average, which keeps no global parameters, refuses the second."""
    params = _params()
    buckets = ParameterBuckets(params)

    def nesterov(ps):
        return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)

    inner = torch.optim.SGD(params, lr=0.05)
    pairs = [
        tuple(outer_rules.OuterOptimizer(params, buckets, nesterov) for _ in range(2)),
        tuple(slow_momentum.SlowMomentum(0.5, 0.8, group=None) for _ in range(2)),
    ]
    for of_parameters, of_pseudo_gradients in pairs:
        of_parameters.start(buckets)
        of_pseudo_gradients.start(buckets)
        for k in range(3):
            average = _flat_averages(params, 0.1 * (k + 1))[0]
            pseudo_gradient = of_pseudo_gradients.theta_global[0] - average
            a = of_parameters.step(ParameterMean([average.clone()]), buckets, inner)[0]
            b = of_pseudo_gradients.step(PseudoGradientMean([pseudo_gradient]), buckets, inner)[0]
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="global parameters"):
        outer_rules.PlainAverage().step(PseudoGradientMean([torch.zeros(1)]), buckets, None)
