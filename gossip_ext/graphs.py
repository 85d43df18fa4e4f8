"""Communication graphs: who sends to whom in each gossip round.

The graphs of Stochastic Gradient Push (Assran et al., ICML 2019) with its bugs fixed, a hypercube
pairing and a user-supplied phone book. A graph object holds only its options; the schedule for a
world size is computed by the compiled engine, identically on every rank, with no communication.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

from gossip_ext._torch_check import _C

__all__ = [
    "CustomGraph",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GraphBase",
    "HypercubeGraph",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
]


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class GraphBase:
    """A gossip graph: a phone book of out-peers per node, walked ``peers_per_itr`` slots a round.

    Round ``t`` of node ``r`` sends to slots ``(g + t * peers_per_itr) mod L`` of ``r``'s phone
    book, ``g = 0 .. peers_per_itr - 1``; its in-peers are the nodes whose slot holds ``r``.

    Args:
        peers_per_itr (int): out-peers per round (default: 1). Must be < the world size.
    """

    _kind: _C.GraphKind
    is_bipartite = False
    is_dynamic = True

    def __init__(self, peers_per_itr: int = 1):
        self.peers_per_itr = _check_int("peers_per_itr", peers_per_itr, 1)

    def compiled_options(self) -> _C.GraphOptions:
        """This graph as the compiled engine takes it (``_C.EngineOptions``)."""
        return _C.GraphOptions(self._kind, self.peers_per_itr)

    @functools.lru_cache(maxsize=8)  # noqa: B019 (graphs are few and long-lived)
    def schedule(self, world_size: int) -> _C.Graph:
        """The compiled schedule for ``world_size`` nodes; raises ValueError if they do not fit."""
        _check_int("world_size", world_size, 1)
        return _C.Graph(self.compiled_options(), world_size)

    @property
    def is_regular(self) -> bool:
        """Every round, every node has as many in-peers as out-peers (true of every built-in
        graph, and required of a CustomGraph): uniform mixing then keeps push-sum weights at 1."""
        return True

    def pairs_symmetrically(self, world_size: int) -> bool:
        """Every round, each node's in-peers are its out-peers (push-pull/D-PSGD needs this)."""
        return self.schedule(world_size).pairs_symmetrically

    def phone_book(self, rank: int, world_size: int) -> list[int]:
        """The ordered, distinct out-peers of ``rank`` (never ``rank`` itself)."""
        return self.schedule(world_size).phone_book(self._rank(rank, world_size))

    def out_peers(self, rank: int, world_size: int, round: int) -> list[int]:
        """The nodes ``rank`` sends to in ``round``."""
        return self.schedule(world_size).out_peers(self._rank(rank, world_size), round)

    def in_peers(self, rank: int, world_size: int, round: int) -> list[int]:
        """The nodes ``rank`` receives from in ``round``, ordered by slot, then by rank."""
        return self.schedule(world_size).in_peers(self._rank(rank, world_size), round)

    @staticmethod
    def _rank(rank: int, world_size: int) -> int:
        _check_int("rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
        return rank

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def _key(self):
        return (self.peers_per_itr,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(peers_per_itr={self.peers_per_itr})"


class NPeerDynamicDirectedExponentialGraph(GraphBase):
    """The default SGP graph: phone book ``r + j * (p+1)^i`` for ``i = 0..`` while
    ``(p+1)^i <= n-1`` and ``j = 1..p`` (``p = peers_per_itr``).

    With ``p = 1`` and ``n`` a power of two, uniform push-sum reaches the exact average after
    ``log2(n)`` rounds. Example: ``n = 8, p = 1`` gives +1, +2, +4.
    """

    _kind = _C.GraphKind.NPeerDynamicDirectedExponential


class DynamicDirectedExponentialGraph(GraphBase):
    """Phone book ``r + 2^i, r - 2^i`` for ``2^i <= n - 1``. Example: ``n = 8`` gives
    +1, -1, +2, -2, +4."""

    _kind = _C.GraphKind.DynamicDirectedExponential


class DynamicBipartiteExponentialGraph(GraphBase):
    """Odd (active) nodes talk only to even (passive) nodes, at odd offsets 1 and ``1 + 2^i``.

    Passive nodes walk the offsets with the opposite sign, so every round pairs nodes
    symmetrically (r -> s implies s -> r), as push-pull averaging (D-PSGD) needs. Needs an even
    world size.
    """

    _kind = _C.GraphKind.DynamicBipartiteExponential
    is_bipartite = True


class DynamicDirectedLinearGraph(GraphBase):
    """Phone book ``r + i, r - i`` for odd ``i < n``."""

    _kind = _C.GraphKind.DynamicDirectedLinear


class DynamicBipartiteLinearGraph(GraphBase):
    """Like DynamicBipartiteExponentialGraph with every odd offset ``1, 3, 5, ...``: symmetric
    pairs every round. Needs an even world size."""

    _kind = _C.GraphKind.DynamicBipartiteLinear
    is_bipartite = True


class RingGraph(GraphBase):
    """Static ring: ``r -> r + 1`` (``peers_per_itr=1``) or ``r -> r +- 1`` (``peers_per_itr=2``,
    symmetric)."""

    _kind = _C.GraphKind.Ring
    is_dynamic = False

    def __init__(self, peers_per_itr: int = 1):
        super().__init__(peers_per_itr)
        if peers_per_itr > 2:
            raise ValueError(f"RingGraph: peers_per_itr must be 1 or 2, got {peers_per_itr}")


class HypercubeGraph(GraphBase):
    """Hypercube pairing ``r xor 2^i``: symmetric every round; with ``peers_per_itr=1`` push-pull
    averaging reaches the exact average after ``log2(n)`` rounds. Needs a power-of-two world
    size."""

    _kind = _C.GraphKind.Hypercube


class CustomGraph(GraphBase):
    """A user-supplied phone book per node, for a fixed world size ``len(phone_books)``.

    Validated when used: peers in range, no self edges, no repeated peer, equal lengths, and in
    every round every node's in-degree equals its out-degree.

    Args:
        phone_books (Sequence[Sequence[int]]): ``phone_books[r]`` lists node ``r``'s out-peers.
        peers_per_itr (int): out-peers per round (default: 1).

    Example::

        >>> ring = CustomGraph([[1], [2], [0]])
        >>> ring.out_peers(rank=2, world_size=3, round=0)
        [0]
    """

    _kind = _C.GraphKind.Custom

    def __init__(self, phone_books: Sequence[Sequence[int]], peers_per_itr: int = 1):
        super().__init__(peers_per_itr)
        try:
            self.phone_books = tuple(tuple(operator.index(p) for p in book) for book in phone_books)
        except TypeError as error:
            raise TypeError(
                f"phone_books must be a sequence of sequences of ints, got {phone_books!r}"
            ) from error
        if not self.phone_books:
            raise ValueError("phone_books must list at least one node, got []")
        # Validate now rather than at first use.
        self.schedule(len(self.phone_books))

    def compiled_options(self) -> _C.GraphOptions:
        return _C.GraphOptions(self._kind, self.peers_per_itr, [list(b) for b in self.phone_books])

    @property
    def is_dynamic(self) -> bool:  # type: ignore[override]
        return self.schedule(len(self.phone_books)).is_dynamic

    def schedule(self, world_size: int) -> _C.Graph:
        if world_size != len(self.phone_books):
            raise ValueError(
                f"CustomGraph has phone books for {len(self.phone_books)} nodes, "
                f"but world_size is {world_size}"
            )
        return super().schedule(world_size)

    def _key(self):
        return (self.peers_per_itr, self.phone_books)

    def __repr__(self) -> str:
        books = [list(b) for b in self.phone_books]
        return f"CustomGraph({books}, peers_per_itr={self.peers_per_itr})"
