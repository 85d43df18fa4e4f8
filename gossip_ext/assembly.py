"""Assembling a GossipDataParallel's runtime from its configuration, over a process group.

What runs over the group is built here, in the order the ranks need it: the transport's kind,
the outer steps and their rule (before the ranks compare configurations, which include the
rule's hyperparameters), the check that every rank was configured alike, the machine hierarchy,
the broadcast of rank 0's parameters at a job's start, then the inner mix and its engine. A
static job builds once; an elastic one at every membership epoch (membership_runtime).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext import _validation
from gossip_ext._torch_check import _C
from gossip_ext.gossip import hierarchy, inner, transport


@dataclasses.dataclass
class Parts:
    """What runs over a GossipDataParallel's process group, built by :func:`build` and adopted
    by the wrapper, which owns them."""

    outer: Any  # outer.outer_steps.OuterSteps
    mix: Any  # gossip.inner.InnerMix
    hierarchy: Any  # gossip.hierarchy.NodeHierarchy, or None (one process per machine)
    watch: Any  # _validation.ParameterWatch
    gossip_world_size: int
    is_gossip_leader: bool


def build(model, initial: bool, peers_per_itr: int | None = None) -> Parts:
    """Everything of ``model`` (a GossipDataParallel) that runs over ``model.process_group``:
    the outer steps, the inner mix and its engine, after the ranks agreed on the configuration.
    ``initial``: every rank then starts from rank 0's parameters (a job's start); else each
    keeps its own (an elastic epoch's). ``peers_per_itr``: the peers per round, where an elastic
    epoch goes on with another number than the graph was constructed with. Reads the model's
    configuration and writes its parameters (the broadcast); the parts it returns are the
    model's to adopt."""
    config, named = model.configuration, model._named
    # Tensors that overlap in memory would be untied by the engine's flattening. The engine refuses
    # them, naming them, but only on the ranks that build one and after the broadcast: here every
    # rank refuses them before this build communicates anything.
    _C.check_disjoint_parameters([t for _, t in model._gossiped], [n for n, _ in model._gossiped])
    graph = config.graph
    if peers_per_itr is not None and peers_per_itr != graph.peers_per_itr:
        graph = inner.with_peers(graph, peers_per_itr)
    params = [p for _, p in named]
    transport_kind = transport.choose_transport(
        model._device, config.comm_device, dist.get_backend(model.process_group)
    )
    world_size = dist.get_world_size(model.process_group)
    rank = model.process_group.rank()
    gossip_world_size = _validation.gossip_world_size(
        graph, config.push_sum, world_size, config.nprocs_per_node
    )
    config.check_gossip_world(gossip_world_size)
    # The outer step builds its rule before the ranks compare configurations, which include its
    # optimizer's hyperparameters; the rule starts from the parameters after the broadcast below.
    outer_steps = config.outer_steps(
        params,
        [b for _, b in model._buffer_policy.floating],
        model.process_group,
        graph=graph,
        sizes=[p.numel() * p.element_size() for p in model.module.parameters()],
    )
    rule = None if outer_steps.rule is None else outer_steps.rule.describe()
    described = _validation.configuration(
        config.describe(rule), named, model._buffer_policy.layout()
    )
    _validation.check_ranks_agree(described, model.process_group, rank)

    gossip_group = model.process_group
    is_gossip_leader, node = True, None
    if config.nprocs_per_node > 1:
        node = hierarchy.NodeHierarchy(model.module, model.process_group, config.nprocs_per_node)
        gossip_group = node.leaders
        is_gossip_leader = node.is_leader

    if initial:
        with torch.no_grad():
            for p in params:
                dist.broadcast(
                    p, dist.get_global_rank(model.process_group, 0), group=model.process_group
                )
        model._buffer_policy.broadcast_initial(model.process_group)
    outer_steps.start_eagerly()

    # The gossip object, or an outer step's ByGossip where there is none, builds the engine.
    builder = config.engine_owner
    if is_gossip_leader and builder is not None:
        link = inner.Link(
            transport_kind,
            gossip_group,
            model._device,
            config.timeout,
            model._members.nccl_rendezvous(),
            log_every=config.log_every,
            verbose=config.verbose,
            in_place=model._shard_group is None,
        )
        mix = builder.mix(model._gossiped, link, graph)
    else:
        mix = inner.InnerMix(
            None, graph, overlap=config.overlap, synch_freq=config.synch_freq, every_step=False
        )
    if gossip_world_size == 1 and config.gossip is not None and config.membership is None:
        warnings.warn(
            "GossipDataParallel: there is one gossiping process, so gossip does nothing "
            "and this trains like a single process",
            stacklevel=5,
        )
    watch = _validation.ParameterWatch(
        list(model.module.named_parameters()), model._gossiped[len(named) :]
    )
    return Parts(outer_steps, mix, node, watch, gossip_world_size, is_gossip_leader)
