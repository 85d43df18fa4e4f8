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


def _check_int(name: str, value, minimum: int, below: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


# ----------------------------------------------------------------------------- graphs


class GraphManager:
    """SGP's graph: who node ``rank`` sends to and receives from, ``peers_per_itr`` peers a
    round, as a query object over the equivalent gossip_ext graph.

    ``get_peers(rotate=True)`` advances the object's own round counter and returns the peers of
    that round. The wrapper does not advance it: its engine keeps its own round
    (:attr:`gossip_ext.GossipDataParallel.gossip_round`) on the same schedule.

    .. note::
        ``rank`` and ``world_size`` count nodes (machines), as in SGP; peers are returned as
        *process* ranks ``node * nprocs_per_node``, the node's gossiping process. (SGP returned
        in-peers as node ranks; here both lists are process ranks.)

    Args:
        rank (int): this node's rank, in ``[0, world_size)``.
        world_size (int): the number of nodes (processes / ``nprocs_per_node``).
        nprocs_per_node (int): processes per node (default: 1).
        local_rank (int): this process's rank inside its node, in ``[0, nprocs_per_node)``;
            kept for SGP's scripts, not used (default: 0).
        peers_per_itr (int): out-peers per round, < ``world_size`` (default: 1).
    """

    # The gossip_ext graph with the same phone books; None: built from _make_graph().
    _core_class: type[core_graphs.GraphBase] | None = None

    def __init__(
        self,
        rank: int,
        world_size: int,
        nprocs_per_node: int = 1,
        local_rank: int = 0,
        peers_per_itr: int = 1,
    ):
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0, below=world_size)
        self.nprocs_per_node = _check_int("nprocs_per_node", nprocs_per_node, 1)
        self.local_rank = _check_int("local_rank", local_rank, 0, below=nprocs_per_node)
        # SGP's own _make_graph() reads _peers_per_itr, and user subclasses copy it.
        self._peers_per_itr = _check_int("peers_per_itr", peers_per_itr, 1)
        self._phone_books: list[list[int]] | None = None
        if self._core_class is None:
            self._phone_books = [[] for _ in range(world_size)]
            self._make_graph()
        self.peers_per_itr = peers_per_itr

    @property
    def peers_per_itr(self) -> int:
        """Out-peers per round. Setting it rebuilds the schedule and, as in SGP, restarts the
        walk through the phone book at its first slot."""
        return self._peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, value: int) -> None:
        _check_int("peers_per_itr", value, 1)
        if self._core_class is None:
            graph = core_graphs.CustomGraph(self._phone_books, value)
        else:
            graph = self._core_class(value)
        graph.schedule(self.world_size)  # raises ValueError naming peers_per_itr if it misfits
        self._core_graph = graph
        self._peers_per_itr = value
        self._round = 0

    @property
    def core_graph(self) -> core_graphs.GraphBase:
        """The equivalent :mod:`gossip_ext.graphs` graph, for
        :class:`gossip_ext.GossipDataParallel`."""
        return self._core_graph

    def get_peers(self, rotate: bool = False) -> tuple[list[int], list[int]]:
        """The out-peers and in-peers of this node in the current round, as process ranks;
        ``rotate=True`` first moves on to the next round."""
        if _check_bool("rotate", rotate):
            self._round += 1
        m = self.nprocs_per_node
        out_peers = self._core_graph.out_peers(self.rank, self.world_size, self._round)
        in_peers = self._core_graph.in_peers(self.rank, self.world_size, self._round)
        return [q * m for q in out_peers], [q * m for q in in_peers]

    def is_regular_graph(self) -> bool:
        """Whether every node has as many in-peers as out-peers in every round."""
        return self._core_graph.is_regular

    def is_bipartite_graph(self) -> bool:
        """Whether the graph pairs passive (even) nodes with active (odd) ones."""
        return self._core_graph.is_bipartite

    def is_passive(self, rank: int | None = None) -> bool:
        """Whether node ``rank`` (default: this node) is a passive node of a bipartite graph."""
        rank = self.rank if rank is None else _check_int("rank", rank, 0, below=self.world_size)
        return self.is_bipartite_graph() and rank % 2 == 0

    def is_dynamic_graph(self, graph_type=None) -> bool:
        """Whether the peers change from round to round. ``graph_type`` is SGP's, unused."""
        return self._core_graph.is_dynamic

    # SGP's phone-book builders, for subclasses that define _make_graph().

    def _make_graph(self) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} must build its phone book in _make_graph() with "
            "_add_peers(rank, peers), or derive from one of the built-in graphs"
        )

    def _add_peers(self, rank: int, peers) -> None:
        for peer in peers:
            if peer not in self._phone_books[rank]:
                self._phone_books[rank].append(peer)

    def _rotate_forward(self, r: int, p: int) -> int:
        return (r + p) % self.world_size

    def _rotate_backward(self, r: int, p: int) -> int:
        return (r - p) % self.world_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"nprocs_per_node={self.nprocs_per_node}, local_rank={self.local_rank}, "
            f"peers_per_itr={self.peers_per_itr})"
        )


class DynamicDirectedExponentialGraph(GraphManager):
    """Phone book ``r + 2^i, r - 2^i`` for ``2^i <= n - 1``; e.g. ``n = 8``: +1, -1, +2, -2, +4."""

    _core_class = core_graphs.DynamicDirectedExponentialGraph


class NPeerDynamicDirectedExponentialGraph(GraphManager):
    """SGP's default: phone book ``r + j * (p+1)^i``, ``j = 1..p``; e.g. ``n = 8, p = 1``:
    +1, +2, +4."""

    _core_class = core_graphs.NPeerDynamicDirectedExponentialGraph


class DynamicBipartiteExponentialGraph(GraphManager):
    """Active (odd) nodes talk to passive (even) ones at offsets ``+-1`` and ``+-(1 + 2^i)``;
    needs an even number of nodes."""

    _core_class = core_graphs.DynamicBipartiteExponentialGraph


class DynamicDirectedLinearGraph(GraphManager):
    """Phone book ``r + i, r - i`` for odd ``i < n``."""

    _core_class = core_graphs.DynamicDirectedLinearGraph


class DynamicBipartiteLinearGraph(GraphManager):
    """Active (odd) nodes talk to passive (even) ones at every odd offset ``+-i``; needs an even
    number of nodes."""

    _core_class = core_graphs.DynamicBipartiteLinearGraph


class RingGraph(GraphManager):
    """Static ring: ``r -> r + 1`` (``peers_per_itr=1``) or ``r -> r +- 1`` (2)."""

    _core_class = core_graphs.RingGraph


# ----------------------------------------------------------------------------- mixing


class MixingManager:
    """SGP's mixing weights over ``graph``'s peers.

    Args:
        graph (GraphManager): the graph whose out-peers are weighted.
        device (torch.device, optional): where :meth:`get_mixing_weights` puts its tensors
            (default: None, the CPU).
    """

    def __init__(self, graph: GraphManager, device: torch.device | str | None = None):
        if not isinstance(graph, GraphManager):
            raise TypeError(
                f"graph must be a gossip_ext.compat.sgp graph (a GraphManager), "
                f"got {type(graph).__name__} {graph!r}"
            )
        self.graph_manager = graph
        try:
            self.device = None if device is None else torch.device(device)
        except (TypeError, RuntimeError) as error:
            raise TypeError(f"device must be a torch.device, got {device!r}") from error

    def is_regular(self) -> bool:
        """Whether push-sum weights stay 1 (a regular graph with uniform weights)."""
        return self.graph_manager.is_regular_graph() and self.is_uniform()

    def is_uniform(self) -> bool:
        """Whether every out-peer gets the same weight."""
        raise NotImplementedError

    def get_mixing_weights(self, residual_adjusted: bool = True) -> dict:
        """The weights of the graph's current round: ``'lo'`` (kept), ``'uniform'`` and one
        per out-peer (process rank), each a one-element tensor on ``device``."""
        raise NotImplementedError

    @property
    def core_mixing(self) -> core_mixing.MixingBase:
        """The equivalent :mod:`gossip_ext.mixing` weights, for
        :class:`gossip_ext.GossipDataParallel`."""
        raise TypeError(
            f"{type(self).__name__} has no gossip_ext equivalent: use UniformMixing, or pass "
            "a gossip_ext mixing (gossip_ext.SelfWeightMixing, gossip_ext.UniformMixing)"
        )


class UniformMixing(MixingManager):
    """The node and each of its ``k`` out-peers get ``1 / (k + 1)``.

    ``get_mixing_weights(residual_adjusted=True)`` (SGP's default) gives the peers' weights
    relative to the kept one, i.e. 1; ``residual_adjusted=False`` gives ``1 / (k + 1)``.
    """

    def is_uniform(self) -> bool:
        return True

    def get_mixing_weights(self, residual_adjusted: bool = True) -> dict:
        _check_bool("residual_adjusted", residual_adjusted)
        out_peers, _ = self.graph_manager.get_peers()
        kept, sent = self.core_mixing.weights(len(out_peers))
        lo = torch.tensor([kept], device=self.device)
        peer = torch.tensor([sent / kept if residual_adjusted else sent], device=self.device)
        weights = {"lo": lo, "uniform": peer.clone()}
        weights.update({q: peer.clone() for q in out_peers})
        return weights

    @property
    def core_mixing(self) -> core_mixing.MixingBase:
        return core_mixing.UniformMixing()


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
