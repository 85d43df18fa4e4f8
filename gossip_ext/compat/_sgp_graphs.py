"""SGP's graphs (:class:`GraphManager` and its six subclasses) and mixing
(:class:`UniformMixing`) with SGP's constructors and query methods, each holding its gossip_ext
equivalent; exported by :mod:`gossip_ext.compat.sgp`, whose docstring says what maps to what.
"""

from __future__ import annotations

import torch

from gossip_ext import graphs as core_graphs
from gossip_ext import mixing as core_mixing


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
