"""Assembling a GossipDataParallel's runtime from its configuration, over a process group.

What runs over the group is built here, in the order the ranks need it: the transport's kind,
the outer steps and their rule (before the ranks compare configurations, which include the
rule's hyperparameters), the check that every rank was configured alike, the machine hierarchy,
the broadcast of rank 0's parameters at a job's start, then the inner mix and its engine. The
wrapper's :class:`Runtime` holds what was built beside what it runs on; a static job builds once,
an elastic one at every membership epoch (``membership.runtime``).

What was built is said in one line (:func:`first_line`), logged at rank 0 when a job starts
(logger ``gossip_ext.assembly``, INFO) and shown by the wrapper as ``wire_summary``: the mode, the
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
import weakref

import torch
import torch.distributed as dist
from torch import nn

import gossip_ext
from gossip_ext import _buffers, _validation
from gossip_ext._torch_check import _C
from gossip_ext.algorithms import Configuration
from gossip_ext.gossip import hierarchy, inner, transport
from gossip_ext.outer.interface import OuterRuntime

logger = logging.getLogger(__name__)  # under "gossip_ext": its INFO lines


class Runtime:
    """What a GossipDataParallel runs on, which it owns as ``model.runtime`` (as DDP its
    reducer) and hands to what works for it (the checkpoint, the membership's epochs, a sharded
    checkpoint): the tensors it gossips, fixed at construction; what runs over its process group,
    built by :meth:`build` at a job's start and at every elastic epoch; its clock and its
    optimizer. Every member is public to those parts; the wrapper's own state stays its own.

    ``named``: the parameters (a sharded module's local shards) by name; ``buffer_policy``: what
    happens to the module's buffers; ``device``: the parameters'; ``shard_group``: the processes
    of this replica (a module sharded by FSDP2), or None; ``order``: the wrapper's check of the
    order of calls, told when parameters are loaded rather than stepped."""

    def __init__(
        self,
        module: nn.Module,
        configuration: Configuration,
        named: list[tuple[str, torch.Tensor]],
        buffer_policy: _buffers.BufferPolicy,
        device: torch.device,
        shard_group: dist.ProcessGroup | None,
        order: _validation.CallOrder,
    ):
        self.module, self.configuration = module, configuration
        self.named, self.buffer_policy, self.device = named, buffer_policy, device
        self.gossiped = named + buffer_policy.gossiped
        self.shard_group = shard_group
        self._order = order
        self.steps = 0  # transfer_params() calls: the clock of the outer steps
        # The last optimizer given to register_optimizer() or transfer_params(), whose learning
        # rates SlowMo reads. A weak reference: its step hook refers to the wrapper, and a cycle
        # would keep both (and the engine's transport thread) alive until the garbage collector
        # runs, or past exit.
        self.optimizer_ref: weakref.ref[torch.optim.Optimizer] | None = None
        # What runs over the process group: none until the first build, and none between an
        # elastic job's epochs.
        self.process_group: dist.ProcessGroup | None = None
        self.mix = inner.InnerMix(None, configuration.graph, overlap=False, synch_freq=0,
                                  every_step=False)  # fmt: skip
        self._outer: OuterRuntime | None = None
        self.hierarchy: hierarchy.NodeHierarchy | None = None
        self._watch: _validation.ParameterWatch | None = None
        self.gossip_world_size = 0
        self.is_gossip_leader = True
        self.summary = ""  # first_line: the mode, graph, message format and bytes per step

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None if self.optimizer_ref is None else self.optimizer_ref()

    @property
    def outer(self) -> OuterRuntime:
        """The outer steps over the process group (every job has them: with no outer step, the
        ones ``average_parameters()`` asks for)."""
        if self._outer is None:
            raise RuntimeError(self._between_epochs)
        return self._outer

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group, which every built job has (``process_group``: None between an
        elastic job's epochs)."""
        if self.process_group is None:
            raise RuntimeError(self._between_epochs)
        return self.process_group

    @property
    def watch(self) -> _validation.ParameterWatch:
        """The check that the parameters' storage is still the engine's."""
        if self._watch is None:
            raise RuntimeError(self._between_epochs)
        return self._watch

    _between_epochs = (
        "gossip_ext: this worker holds no process group now (between an elastic job's epochs, "
        "or after it left): nothing runs over one"
    )

    def raise_if_failed(self) -> None:
        """Raises the error of a failed round or outer step, if one failed: it stays raised by
        every later call that would communicate (Note [A failed outer step] in
        ``outer.outer_steps``)."""
        self.mix.raise_if_failed()
        if self._outer is not None:
            self._outer.raise_if_failed()

    def parameters_loaded(self) -> None:
        """The parameters were loaded or handed over, not stepped (``_validation.CallOrder``)."""
        self._order.parameters_loaded()

    def close_mix(self) -> None:
        """Drops the engine, giving up a round in flight (a worker leaving, an epoch ending)."""
        self.mix = self.mix.closed()

    def drop_epoch_parts(self) -> None:
        """Lets go of what holds the epoch's group (gloo closes connections only when freed)."""
        self.close_mix()
        self._outer = self.process_group = None

    def build(
        self,
        group: dist.ProcessGroup,
        initial: bool,
        peers_per_itr: int | None = None,
        rendezvous: tuple[dist.Store, str] | None = None,
        sealing: transport.Sealing | None = None,
    ) -> None:
        """Builds everything that runs over ``group``: the outer steps, the inner mix and its
        engine, after the ranks agreed on the configuration. ``initial``: every rank then starts
        from rank 0's parameters (a job's start); else each keeps its own (an elastic epoch's).
        ``peers_per_itr``: the peers per round, where an elastic epoch goes on with another
        number than the graph was constructed with; ``rendezvous``: where an NCCL transport's
        ranks meet (None: the default store); ``sealing``: how the engine's messages are sealed
        on the wire (None: as they lie). Writes the parameters (the broadcast)."""
        config, named = self.configuration, self.named
        # Tensors that overlap in memory would be untied by the engine's flattening. The engine
        # refuses them, naming them, but only on the ranks that build one and after the
        # broadcast: here every rank refuses them before this build communicates anything.
        _C.check_disjoint_parameters([t for _, t in self.gossiped], [n for n, _ in self.gossiped])
        graph = config.graph
        if peers_per_itr is not None and peers_per_itr != graph.peers_per_itr:
            graph = inner.with_peers(graph, peers_per_itr)
        params = [p for _, p in named]
        transport_kind = transport.choose_transport(
            self.device, config.comm_device, dist.get_backend(group)
        )
        world_size = dist.get_world_size(group)
        rank = group.rank()
        gossip_world_size = _validation.gossip_world_size(
            graph, config.push_sum, world_size, config.nprocs_per_node
        )
        config.check_gossip_world(gossip_world_size)
        # The outer step builds its rule before the ranks compare configurations, which include
        # its optimizer's hyperparameters; the rule starts from the parameters after the broadcast
        # below.
        outer_steps = config.outer_steps(
            params,
            [b for _, b in self.buffer_policy.floating],
            group,
            graph=graph,
            sizes=[p.numel() * p.element_size() for p in self.module.parameters()],
        )
        described = _validation.configuration(
            config.describe(outer_steps.describe_rule()), named, self.buffer_policy.layout()
        )
        _validation.check_ranks_agree(described, group, rank)

        gossip_group = group
        is_gossip_leader, node = True, None
        if config.nprocs_per_node > 1:
            node = hierarchy.NodeHierarchy(self.module, group, config.nprocs_per_node)
            gossip_group = node.leaders
            is_gossip_leader = node.is_leader

        if initial:
            with torch.no_grad():
                for p in params:
                    dist.broadcast(p, dist.get_global_rank(group, 0), group=group)
            self.buffer_policy.broadcast_initial(group)
        outer_steps.start_eagerly()

        # The gossip object, or an outer step's ByGossip where there is none, builds the engine.
        builder = config.engine_owner
        if is_gossip_leader and builder is not None:
            link = inner.Link(
                transport_kind,
                gossip_group,
                self.device,
                config.timeout,
                rendezvous,
                sealing,
                log_every=config.log_every,
                verbose=config.verbose,
                in_place=self.shard_group is None,
            )
            mix = builder.mix(self.gossiped, link, graph)
        else:
            mix = inner.InnerMix(
                None, graph, overlap=config.overlap, synch_freq=config.synch_freq, every_step=False
            )
        if gossip_world_size == 1 and config.gossip is not None and config.membership is None:
            warnings.warn(
                "GossipDataParallel: there is one gossiping process, so gossip does nothing "
                "and this trains like a single process",
                stacklevel=4,  # the constructor's caller
            )
        watch = _validation.ParameterWatch(
            list(self.module.named_parameters()), self.gossiped[len(named) :]
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
        self.process_group, self._outer, self.mix, self.hierarchy = group, outer_steps, mix, node
        self._watch, self.gossip_world_size = watch, gossip_world_size
        self.is_gossip_leader, self.summary = is_gossip_leader, summary


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
    outer: OuterRuntime,
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
