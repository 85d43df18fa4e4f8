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

from gossip_ext import _validation, algorithms
from gossip_ext.gossip import hierarchy, inner


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
    arguments, named = model._arguments, model._named
    outer_step = model.algorithms[1]  # it builds its rule (None: no outer step)
    if peers_per_itr is not None and peers_per_itr != arguments["graph"].peers_per_itr:
        arguments = dict(arguments, graph=inner.with_peers(arguments["graph"], peers_per_itr))
    settings = arguments  # every setting by name (flat_keywords.settings)
    params = [p for _, p in named]
    transport_kind = _validation.choose_transport(
        model._device, settings["comm_device"], dist.get_backend(model.process_group)
    )
    world_size = dist.get_world_size(model.process_group)
    rank = model.process_group.rank()
    gossip_world_size = _validation.gossip_world_size(
        settings["graph"], settings["push_sum"], world_size, settings["nprocs_per_node"]
    )
    _validation.check_localsgd(
        settings["base_algorithm"],
        settings["global_avg_freq"] or 0,
        settings["slowmo_freq"] or 0,
        settings["sync_every"],
        gossip_world_size,
    )
    # The outer step builds its rule before the ranks compare configurations, which include its
    # optimizer's hyperparameters; the rule starts from the parameters after the broadcast below.
    outer_steps = algorithms.outer_steps(
        outer_step,
        params,
        [b for _, b in model._buffer_policy.floating],
        model.process_group,
        graph=settings["graph"],
        mixing=settings["mixing"],
        timeout=settings["timeout"],
        sizes=[p.numel() * p.element_size() for p in model.module.parameters()],
    )
    gossip = model.algorithms[0]
    config = _validation.configuration(
        gossip,
        outer_step,
        rule=None if outer_steps.rule is None else outer_steps.rule.describe(),
        common={k: settings[k] for k in ("nprocs_per_node", "broadcast_buffers", "gossip_buffers")},
        parameters=named,
        buffers=model._buffer_policy.layout(),
    )
    _validation.check_ranks_agree(config, model.process_group, rank)

    gossip_group = model.process_group
    is_gossip_leader, node = True, None
    if settings["nprocs_per_node"] > 1:
        node = hierarchy.NodeHierarchy(
            model.module, model.process_group, settings["nprocs_per_node"]
        )
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
    builder = algorithms.engine_owner(gossip, outer_step)
    if is_gossip_leader and builder is not None:
        link = inner.Link(
            transport_kind,
            gossip_group,
            model._device,
            settings["timeout"],
            model._members.nccl_rendezvous(),
            log_every=settings["log_every"],
            verbose=settings["verbose"],
            in_place=model._shard_group is None,
        )
        mix = builder.mix(model._gossiped, link, settings["graph"])
    else:
        mix = inner.InnerMix(
            None,
            settings["graph"],
            overlap=model.overlap,
            synch_freq=model.synch_freq,
            every_step=False,
        )
    if gossip_world_size == 1 and settings["base_algorithm"] == "sgp" and not model.elastic:
        warnings.warn(
            "GossipDataParallel: there is one gossiping process, so gossip does nothing "
            "and this trains like a single process",
            stacklevel=5,
        )
    watch = _validation.ParameterWatch(
        list(model.module.named_parameters()), model._gossiped[len(named) :]
    )
    return Parts(outer_steps, mix, node, watch, gossip_world_size, is_gossip_leader)
