"""The parts GossipDataParallel composes, on their own in one process: the inner mix without an
engine (LocalSGD's, and a non-gossiping process's), the outer steps' kept failure and the buffer
policy. The parts with an
engine or collectives are tested through the wrapper on real processes (test_distributed.py,
test_averaging.py, test_diloco.py, test_buffers.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gossip_ext import _buffers
from gossip_ext.gossip import inner
from gossip_ext.graphs import NPeerDynamicDirectedExponentialGraph
from gossip_ext.outer import outer_steps
from gossip_ext.outer.interface import StepContext


def test_an_inner_mix_without_an_engine_does_nothing_and_reads_as_no_gossip():
    graph = NPeerDynamicDirectedExponentialGraph()
    mix = inner.InnerMix(None, graph, overlap=False, synch_freq=0, every_step=True)
    for call in (
        lambda: mix.before_forward(True),
        lambda: mix.arm(1),
        mix.after_step,
        mix.drain,
        mix.run_round,
        mix.restart,
        mix.reset_weight,
        mix.raise_if_failed,
        lambda: mix.restore(5, 0.5),
    ):
        call()
    assert (mix.ps_weight, mix.round, mix.bytes_sent, mix.in_flight) == (1.0, 0, 0, False)
    assert mix.lazy_mixing and mix.estimate is None


def test_outer_steps_keep_a_failed_steps_error_raised_by_every_later_call():
    # Note [A failed outer step]: a plain average every 2 steps, whose collective fails (no
    # process group here); every later call raises that same error, and communicates nothing.
    steps = outer_steps.OuterSteps([torch.zeros(3)], [], None, average_every=2)
    mix = inner.InnerMix(
        None, NPeerDynamicDirectedExponentialGraph(), overlap=False, synch_freq=0, every_step=False
    )
    context = StepContext(mix=mix, weight=lambda: 1.0, buffer_weight=lambda weight: weight)
    assert steps.end_step(1, lambda: context)  # nothing due: the step's round runs
    with pytest.raises(ValueError, match="process group") as failed:
        steps.end_step(2, lambda: context)
    for call in (
        steps.raise_if_failed,
        lambda: steps.end_step(3, lambda: context),  # not a step of the average either
        lambda: steps.average_now(3, context),
    ):
        with pytest.raises(ValueError) as again:
            call()
        assert again.value is failed.value
    mix.raise_if_failed()  # the inner gossip holds no outer failure


def test_a_new_peers_per_itr_is_a_copy_of_the_graph():
    graph = NPeerDynamicDirectedExponentialGraph(peers_per_itr=1)
    mix = inner.InnerMix(None, graph, overlap=False, synch_freq=0, every_step=True)
    mix.set_graph(inner.with_peers(graph, 2))
    assert mix.graph.peers_per_itr == 2 and graph.peers_per_itr == 1


def _net_with_statistics() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


@pytest.mark.parametrize("gossip_buffers", [False, True])
def test_the_buffer_policy_averages_floating_buffers_with_their_weight(gossip_buffers):
    policy = _buffers.BufferPolicy(
        _net_with_statistics(),
        torch.device("cpu"),
        broadcast_buffers=False,
        gossip_buffers=gossip_buffers,
    )
    # BatchNorm's running mean and variance; its step counter is an integer and not averaged.
    assert [n for n, _ in policy.floating] == ["1.running_mean", "1.running_var"]
    assert [n for n, _ in policy.gossiped] == (
        ["1.running_mean", "1.running_var"] if gossip_buffers else []
    )
    # Gossiped buffers carry the parameters' push-sum weight; the others are plain values.
    assert policy.weight(0.25) == (0.25 if gossip_buffers else 1.0)
    assert policy.weight(None) is None, "a process without gossip state contributes zeros"
    assert policy.layout() == [
        ("1.running_mean", (4,), "torch.float32"),
        ("1.running_var", (4,), "torch.float32"),
    ]


def test_buffers_away_from_the_parameters_are_refused_by_name():
    net = _net_with_statistics()
    net[1].running_mean = net[1].running_mean.to("meta")
    with pytest.raises(ValueError, match=r"buffer '1.running_mean' is on meta"):
        _buffers.BufferPolicy(
            net, torch.device("cpu"), broadcast_buffers=False, gossip_buffers=False
        )
