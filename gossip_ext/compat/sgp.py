"""Stochastic Gradient Push's ``gossip`` package, mapped onto gossip_ext's engine.

Scripts written for SGP (its ``gossip_sgd.py``) run with only the import line changed, from
``from gossip import ...`` to ``from gossip_ext.compat.sgp import ...``:

- The graphs (:class:`GraphManager` and its six subclasses) keep SGP's constructor
  ``Graph(rank, world_size, nprocs_per_node=1, local_rank=0, peers_per_itr=1)`` and its query
  methods (``get_peers``, ``is_regular_graph``, ``is_bipartite_graph``, ``is_passive``,
  ``is_dynamic_graph``, the ``peers_per_itr`` property); each holds the equivalent
  :mod:`gossip_ext.graphs` graph (:attr:`GraphManager.core_graph`), whose schedule is the
  truth. A subclass that builds its own phone book in ``_make_graph()`` with ``_add_peers()``,
  as SGP's own graphs do, becomes a :class:`gossip_ext.CustomGraph`.
- :class:`UniformMixing` keeps ``UniformMixing(graph, device)`` and ``get_mixing_weights()``.
- :class:`GossipDataParallel` keeps SGP's constructor, argument for argument and in its order,
  and its methods, on top of :class:`gossip_ext.GossipDataParallel`.

.. note::
    The schedules are gossip_ext's, which fix two flaws of SGP's: the passive nodes of the
    bipartite graphs walk their phone books in the opposite order, so that every round pairs
    nodes symmetrically, and no phone book ever lists the node itself (SGP's
    NPeerDynamicDirectedExponentialGraph does at 6 nodes with 2 peers). Every other phone book
    is SGP's. Changing ``peers_per_itr`` rebuilds the schedule for the new value, where SGP
    kept the phone book built for the old one (NPeerDynamicDirectedExponentialGraph's depends
    on it).

``overlap=True`` has SGP's semantics: every training forward absorbs the previous round and
starts the next, so the script does not call ``transfer_params()`` (which then returns False).
``ps_weight`` is the push-sum weight as a float (SGP's was a one-element tensor).

Accepted and ignored: ``use_streams`` (the engine orders its own streams), ``device_ids`` of
None or one device equal to the module's, ``mix`` of ``transfer_params`` (whether mixing is
lazy is the engine's decision), ``finish_gossip`` of ``state_dict`` (the round in flight is
always finished), and a ``local_node_group`` that holds exactly this node's processes (the
wrapper builds its own node groups). ``unbias()`` and ``ps_numerator()`` do nothing: the
parameters here always hold de-biased values.

Raised, naming the argument and its value: several ``device_ids`` (single-process multi-GPU is
not supported: run one process per GPU); ``rank`` or ``world_size`` that disagree with
torch.distributed; a ``local_node_group`` that is not this node's processes; a graph built for
another rank, world size or ``nprocs_per_node``; a mixing without a gossip_ext equivalent;
``update_gossiper`` of anything but ``'peers_per_itr'``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gossip_ext
from gossip_ext import graphs as core_graphs
from gossip_ext import mixing as core_mixing
from gossip_ext.compat._sgp_graphs import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    MixingManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    UniformMixing,
    _check_bool,
    _check_int,
)

__all__ = [
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GossipDataParallel",
    "GraphManager",
    "MixingManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "UniformMixing",
]


# ----------------------------------------------------------------------------- the wrapper


class GossipDataParallel(gossip_ext.GossipDataParallel):
    """SGP's ``GossipDataParallel``: its constructor and methods over
    :class:`gossip_ext.GossipDataParallel` (the same engine, rounds and checkpoints).

    A script calls :meth:`transfer_params` after every ``optimizer.step()``, except under
    ``overlap=True``, where every training forward absorbs the previous round and starts the
    next (as SGP's forward pre-hook did), and ``transfer_params()`` returns False.

    .. note::
        The parameters always hold the de-biased model ``z = x / w``: :meth:`ps_numerator` and
        :meth:`unbias` do nothing, ``state_dict()`` reports ``is_ps_numerator=False``, and
        :attr:`ps_weight` is the push-sum weight as a float (SGP's was a one-element tensor).

    .. note::
        ``state_dict()`` returns SGP's format, ``{'state_dict': ..., 'ps_weight': tensor([w]),
        'is_ps_numerator': False}``, with :class:`gossip_ext.GossipDataParallel`'s state dict
        (the module under ``module.`` and the push-sum state under ``_extra_state``) inside;
        ``load_state_dict()`` takes it back, and SGP's own checkpoints too. Called with keyword
        arguments (as an enclosing module's ``state_dict()`` does), it returns the inner form.

    .. note::
        One process per device: ``device_ids`` may name only the module's own device (SGP's
        single-process multi-GPU mode is not supported). With ``nprocs_per_node > 1`` the
        processes of node ``k`` must be ranks ``k * nprocs_per_node`` to
        ``(k + 1) * nprocs_per_node - 1``, as in SGP.

    Args:
        module (nn.Module): the model, its parameters on one device.
        device_ids (list, optional): None, or one device (an int for a CUDA index, a str or a
            torch.device) equal to the module's (default: None).
        rank (int, optional): this process's rank; must agree with torch.distributed
            (default: None, torch.distributed's).
        world_size (int, optional): the number of processes; must agree with
            torch.distributed (default: None, torch.distributed's).
        graph (GraphManager, optional): the gossip graph, built for this node
            (``rank // nprocs_per_node`` of ``world_size // nprocs_per_node``); a gossip_ext graph
            is taken as it is (default: None, ``NPeerDynamicDirectedExponentialGraph`` with one
            peer per round).
        mixing (MixingManager, optional): :class:`UniformMixing`, or a gossip_ext mixing
            (default: None, uniform).
        comm_device (torch.device, optional): where messages travel from, as
            :class:`gossip_ext.GossipDataParallel` takes it (default: None, the parameters').
        push_sum (bool): push-sum (SGP) if True, push-pull (D-PSGD) if False (default: True).
        overlap (bool): each forward absorbs the previous round and starts the next, which
            then runs during the forward, backward and step (default: False).
        synch_freq (int): bounded asynchrony: a forward blocks on a round only after
            ``synch_freq`` forwards found it unfinished; 0 is synchronous (default: 0).
        verbose (bool): log every round at INFO level (default: False).
        use_streams (bool): accepted and ignored; the engine orders its own CUDA streams
            (default: True).
        nprocs_per_node (int): processes per node; one of them gossips (default: 1).
        local_node_group (ProcessGroup, optional): accepted if it holds exactly this node's
            processes; the wrapper builds its own node groups (default: None).

    Example::

        >>> from gossip_ext.compat.sgp import GossipDataParallel, RingGraph, UniformMixing
        >>> graph = RingGraph(dist.get_rank(), dist.get_world_size())
        >>> model = GossipDataParallel(net, graph=graph, mixing=UniformMixing(graph, "cpu"))
        >>> for epoch in range(epochs):
        ...     model.update_gossiper("peers_per_itr", 1)
        ...     for x, y in loader:
        ...         loss = criterion(model(x), y)
        ...         loss.backward(); opt.step(); opt.zero_grad()
        ...         model.transfer_params()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | str | torch.device] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        graph: GraphManager | core_graphs.GraphBase | None = None,
        mixing: MixingManager | core_mixing.MixingBase | None = None,
        comm_device: torch.device | str | None = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        verbose: bool = False,
        use_streams: bool = True,
        nprocs_per_node: int = 1,
        local_node_group: dist.ProcessGroup | None = None,
    ):
        # Everything here is local to this process, so a bad argument raises before the core's
        # first collective, where the other ranks would wait for this one.
        _check_bool("use_streams", use_streams)
        _check_device_ids(device_ids, module)
        core_graph = _core_graph(graph)
        core_mix = _core_mixing(mixing)
        m = _check_int("nprocs_per_node", nprocs_per_node, 1)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "GossipDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets it up)"
            )
        process_rank, processes = dist.get_rank(), dist.get_world_size()
        _check_agrees("rank", rank, process_rank)
        _check_agrees("world_size", world_size, processes)
        if processes % m != 0:
            raise ValueError(f"nprocs_per_node ({m}) must divide the world size ({processes})")
        if isinstance(graph, GraphManager):
            _check_graph(graph, process_rank, processes, m)
        if local_node_group is not None:
            _check_local_node_group(local_node_group, process_rank, m)
        super().__init__(
            module,
            graph=core_graph,
            mixing=core_mix,
            push_sum=push_sum,
            overlap=overlap,
            synch_freq=synch_freq,
            nprocs_per_node=m,
            comm_device=comm_device,
            verbose=verbose,
            start_in_forward=overlap,
        )
        self.process_rank = process_rank
        self.local_rank = process_rank % m
        # SGP's update_gossiper() changed the user's graph object too; so does this one.
        self._sgp_graph = graph if isinstance(graph, GraphManager) else None

    def transfer_params(self, mix: bool = True) -> bool:
        """Starts a gossip round with the parameters the optimizer step just produced.

        Returns True if this process started (or, under bounded asynchrony, scheduled) a
        round; False, doing nothing, under ``overlap=True`` (the forward starts the rounds) and
        in evaluation mode (as SGP between ``eval()`` and ``train()``), and also False on the
        processes of a node that do not gossip (they still take part in the step's
        bookkeeping, so call it on every process).

        Args:
            mix (bool): accepted for SGP; whether mixing is lazy is the engine's decision
                (default: True).
        """
        _check_bool("mix", mix)
        if self.overlap or not self.training:
            return False
        super().transfer_params()
        return self.is_gossip_leader

    def update_gossiper(self, attr: str, val: Any) -> None:
        """Sets a gossip setting; only ``'peers_per_itr'`` can change here.

        Collective, as SGP's script uses it: every rank calls it with the same value (at the
        start of each epoch); the round in flight is absorbed first. The graph given to the
        constructor follows the new value, as in SGP.
        """
        if attr != "peers_per_itr":
            raise ValueError(
                f"update_gossiper: attr must be 'peers_per_itr' (the one gossiper setting that "
                f"can change during training), got {attr!r}"
            )
        self.set_peers_per_itr(val)
        if self._sgp_graph is not None:
            self._sgp_graph.peers_per_itr = val

    def state_dict(self, finish_gossip: bool = True, **kwargs: Any) -> dict[str, Any]:
        """SGP's checkpoint: ``{'state_dict': <gossip_ext state dict>, 'ps_weight': tensor([w]),
        'is_ps_numerator': False}``.

        Args:
            finish_gossip (bool): accepted for SGP; the round in flight is always absorbed
                first, so that no share of the model is missing from the checkpoint
                (default: True).
        """
        if kwargs:
            # An enclosing module's state_dict(destination=..., prefix=...): the inner form.
            return super().state_dict(**kwargs)
        _check_bool("finish_gossip", finish_gossip)
        inner = super().state_dict()
        return {
            "state_dict": inner,
            # float64: the engine's weight, not rounded to the parameters' dtype.
            "ps_weight": torch.tensor([self.ps_weight], dtype=torch.float64),
            "is_ps_numerator": False,
        }

    def load_state_dict(self, load_dict: Mapping[str, Any], strict: bool = True, assign=False):
        """Loads SGP's checkpoint format (this wrapper's, or SGP's own, whose parameters may be
        push-sum numerators) or :class:`gossip_ext.GossipDataParallel`'s."""
        return super().load_state_dict(load_dict, strict=strict, assign=assign)

    def ps_numerator(self) -> None:
        """Kept for SGP compatibility: does nothing, since the parameters here always hold
        de-biased values (SGP multiplied them by the push-sum weight in place)."""


def _check_device_ids(device_ids, module: nn.Module) -> None:
    if device_ids is None:
        return
    if isinstance(device_ids, (str, torch.device)) or not isinstance(device_ids, Sequence):
        raise TypeError(
            f"device_ids must be None or a list of one device, got "
            f"{type(device_ids).__name__} {device_ids!r}"
        )
    if len(device_ids) != 1:
        raise ValueError(
            f"device_ids must be None or name one device, got {list(device_ids)!r}: "
            "single-process multi-GPU is not supported, run one process per GPU"
        )
    (given,) = device_ids
    try:
        device = torch.device("cuda", given) if isinstance(given, int) else torch.device(given)
    except (TypeError, RuntimeError) as error:
        raise TypeError(f"device_ids must list devices, got {list(device_ids)!r}") from error
    first = next(module.parameters(), None) if isinstance(module, nn.Module) else None
    if first is None:
        return  # the core names what is wrong with the module
    have = first.device
    if device.type != have.type or device.index not in (None, have.index):
        raise ValueError(
            f"device_ids={list(device_ids)!r} names {device}, but the module's parameters are "
            f"on {have}: move the module to its device before wrapping it"
        )


def _check_agrees(name: str, value, actual: int) -> None:
    if value is None:
        return
    _check_int(name, value, 0)
    if value != actual:
        raise ValueError(
            f"{name}={value} disagrees with torch.distributed, where it is {actual}; "
            f"pass {name}=None or the process group's value"
        )


def _core_graph(graph) -> core_graphs.GraphBase | None:
    if graph is None or isinstance(graph, core_graphs.GraphBase):
        return graph
    if isinstance(graph, GraphManager):
        return graph.core_graph
    raise TypeError(
        f"graph must be a gossip_ext.compat.sgp graph (a GraphManager), a gossip_ext graph or "
        f"None, got {type(graph).__name__} {graph!r}"
    )


def _core_mixing(mixing) -> core_mixing.MixingBase | None:
    if mixing is None or isinstance(mixing, core_mixing.MixingBase):
        return mixing
    if isinstance(mixing, MixingManager):
        return mixing.core_mixing
    raise TypeError(
        f"mixing must be a gossip_ext.compat.sgp mixing (UniformMixing), a gossip_ext mixing "
        f"or None, got {type(mixing).__name__} {mixing!r}"
    )


def _check_graph(graph: GraphManager, process_rank: int, processes: int, m: int) -> None:
    node, nodes = process_rank // m, processes // m
    if (graph.rank, graph.world_size, graph.nprocs_per_node) != (node, nodes, m):
        raise ValueError(
            f"graph={graph!r} was built for another process: this is node rank={node} of "
            f"world_size={nodes} with nprocs_per_node={m} (process {process_rank} of "
            f"{processes}); build it as {type(graph).__name__}({node}, {nodes}, {m}, "
            f"{process_rank % m}, peers_per_itr={graph.peers_per_itr})"
        )


def _check_local_node_group(group, process_rank: int, m: int) -> None:
    node = process_rank // m
    mine = list(range(node * m, (node + 1) * m))
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        ranks = "a group without this process"
    elif isinstance(group, dist.ProcessGroup):
        ranks = sorted(dist.get_process_group_ranks(group))
        if ranks == mine:
            return
    else:
        raise TypeError(
            f"local_node_group must be a ProcessGroup or None, got {type(group).__name__} {group!r}"
        )
    raise ValueError(
        f"local_node_group must hold exactly this node's processes {mine} (nprocs_per_node={m}, "
        f"process {process_rank}), got {ranks}"
    )
