"""Assembling a GossipDataParallel's runtime from its configuration, over a process group.

What runs over the group is built here, in the order the ranks need it: the transport's kind,
the outer steps and their rule (before the ranks compare configurations, which include the
rule's hyperparameters), the check that every rank was configured alike, the machine hierarchy,
the broadcast of rank 0's parameters at a job's start, then the inner mix and its engine. A
static job builds once; an elastic one at every membership epoch (membership_runtime).

What was built is said in one line (:func:`first_line`), logged at rank 0 when a job starts
(logger ``gossip_ext.assembly``, INFO) and kept by the wrapper as ``wire_summary``: the mode, the
graph, the message format and the bytes each worker sends per step. The bytes are asked of the parts
themselves before any step: the engine's message to each out-peer of a round (``bytes_sent``
grows by exactly that), and the outer step's averaging over its period (a ring all-reduce's
2 (n - 1) / n of the model, a compressed or sparse mean's messages). Traffic inside a machine
(``nprocs_per_node > 1``) is not counted.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

import gossip_ext
from gossip_ext import _validation
from gossip_ext._torch_check import _C
from gossip_ext.algorithms import Configuration
from gossip_ext.gossip import hierarchy, inner, transport
from gossip_ext.outer.asynchronous import AsyncOuterSteps
from gossip_ext.outer.outer_steps import OuterSteps

logger = logging.getLogger(__name__)  # under "gossip_ext": its INFO lines


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
    summary: str  # first_line: the mode, graph, message format and bytes per step


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
    rule = outer_steps.describe_rule()
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
    summary = first_line(
        config,
        mix,
        outer_steps,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        gossip_rank=gossip_group.rank() if is_gossip_leader else 0,
        gossip_world_size=gossip_world_size,
        world_size=world_size,
    )
    if initial and rank == 0:
        logger.info(summary)
    return Parts(outer_steps, mix, node, watch, gossip_world_size, is_gossip_leader, summary)


# ----------------------------------------------------------------------------- the first line


def brief(obj: object) -> str:
    """``repr`` of an algorithm object with only the arguments that differ from their defaults
    (``SGP(overlap=True, message_dtype='int8')``), the arguments it requires included."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return repr(obj)
    said = []
    for field in dataclasses.fields(obj):
        if not field.repr or not field.init:
            continue
        value = getattr(obj, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        if field.default_factory is not dataclasses.MISSING and value == field.default_factory():
            continue
        said.append(f"{field.name}={brief(value)}")
    return f"{type(obj).__name__}({', '.join(said)})"


def megabytes(n: float) -> str:
    """``n`` bytes to three significant figures, in B, kB, MB or GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def first_line(
    config: Configuration,
    mix: inner.InnerMix,
    outer: OuterSteps | AsyncOuterSteps,
    *,
    param_bytes: int,
    gossip_rank: int,
    gossip_world_size: int,
    world_size: int,
) -> str:
    """What a worker of ``config`` will do with the ``mix`` and ``outer`` steps built for it, in
    one line. ``param_bytes``: its parameters' bytes; ``gossip_rank`` of ``gossip_world_size``:
    its place among the gossiping processes, of ``world_size`` in all."""
    round_bytes = mix.bytes_per_round(gossip_rank, gossip_world_size)
    gossip_bytes = round_bytes if mix.every_step else 0.0
    outer_bytes = outer.bytes_per_step(int(round_bytes))
    said = [f"gossip_ext {gossip_ext.__version__}: {world_size} workers"]
    if gossip_world_size != world_size:
        said[0] += f" ({gossip_world_size} gossiping, {config.nprocs_per_node} a machine)"
    mode = [brief(o) for o in (config.gossip, config.outer, config.membership) if o is not None]
    said.append("mode " + " + ".join(mode))
    if mix.engine is not None:
        said.append(f"graph {config.graph!r}")
        dtype = config.message_dtype
        fmt = "the parameters' dtype" if dtype is None else str(dtype).replace("torch.", "")
        said.append(
            f"messages in {fmt}, {megabytes(mix.engine.message_bytes)} to each out-peer "
            f"({mix.engine.message_bytes / param_bytes:.3g}x the parameters' "
            f"{megabytes(param_bytes)})"
        )
    # Asynchronous modes skip a peer still busy with the last message, so the figure is a
    # bound; synchronous ones send exactly it (tests/test_first_line.py).
    if outer_bytes is None:
        said.append(
            f"at most {megabytes(gossip_bytes)} a step sent per worker by gossip, and the outer "
            "step's averaging, whose bytes it does not say"
        )
    else:
        parts = [f"gossip {megabytes(gossip_bytes)}", f"outer steps {megabytes(outer_bytes)}"]
        said.append(
            f"at most {megabytes(gossip_bytes + outer_bytes)} a step sent per worker "
            f"({', '.join(part for part in parts if not part.endswith(' 0 B'))})"
        )
    return "; ".join(said)
