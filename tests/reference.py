"""The test oracle: push-sum gossip in plain Python and PyTorch, from docs/design.md sections 1-2.

Nothing here imports gossip_ext or follows its code. Graphs are built from their definitions in
docs/design.md section 2 with integer arithmetic only; a round is the column-stochastic mixing
matrix of section 1 applied to the stacked fp64 numerators ``x`` and weights ``w`` of all nodes,
and the de-biased value is ``z = x / w``. The tests compare the library against these functions.

Graph kinds are plain strings (see ``GRAPH_KINDS``); a custom graph is just its phone books, so
``reference_gossip`` takes phone books, not a graph object.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "BIPARTITE_KINDS",
    "GRAPH_KINDS",
    "graph_phone_books",
    "in_peers",
    "mixing_matrix",
    "mixing_weights",
    "out_peers",
    "pairs_symmetrically",
    "period",
    "reference_gossip",
    "reference_push_sum",
    "self_weight_weights",
    "uniform_weights",
    "validate_phone_books",
]

GRAPH_KINDS = (
    "npeer_exponential",  # NPeerDynamicDirectedExponentialGraph
    "directed_exponential",  # DynamicDirectedExponentialGraph
    "bipartite_exponential",  # DynamicBipartiteExponentialGraph
    "directed_linear",  # DynamicDirectedLinearGraph
    "bipartite_linear",  # DynamicBipartiteLinearGraph
    "ring",  # RingGraph
    "hypercube",  # HypercubeGraph
)
BIPARTITE_KINDS = ("bipartite_exponential", "bipartite_linear")


def _offsets(kind: str, n: int, p: int) -> list[int]:
    """Signed offsets in phone-book order, before reduction mod n and de-duplication."""
    offsets: list[int] = []
    if kind == "npeer_exponential":
        # for i = 0.., j = 1..p while (p+1)^i <= n-1: +j*(p+1)^i
        step = 1
        while step <= n - 1:
            offsets += [j * step for j in range(1, p + 1)]
            step *= p + 1
    elif kind == "directed_exponential":
        # for i while 2^i <= n-1: +2^i, -2^i
        step = 1
        while step <= n - 1:
            offsets += [step, -step]
            step *= 2
    elif kind == "bipartite_exponential":
        # Odd offsets 1, then 1 + 2^i for i >= 1 while 2^i <= n-1 (SGP's construction): an odd
        # offset always joins an even node to an odd one when n is even.
        offsets += [1, -1]
        step = 2
        while step <= n - 1:
            offsets += [1 + step, -(1 + step)]
            step *= 2
    elif kind in ("directed_linear", "bipartite_linear"):
        # +i, -i for odd i < n
        for i in range(1, n, 2):
            offsets += [i, -i]
    elif kind == "ring":
        offsets = [1] if p == 1 else [1, -1]
    else:
        raise ValueError(f"no offsets for graph kind {kind!r}")
    return offsets


def graph_phone_books(kind: str, n: int, peers_per_itr: int = 1) -> list[list[int]]:
    """``phone_books[r]``: the ordered, distinct out-peers of node ``r`` (docs/design.md section 2).

    Raises ValueError where the graph does not exist at this world size: peers_per_itr < 1, or
    >= n (n > 1), odd n for a bipartite graph, a ring with more than 2 peers, a hypercube whose n
    is not a power of two, or more peers per round than each phone book holds.
    """
    if kind not in GRAPH_KINDS:
        raise ValueError(f"unknown graph kind {kind!r}")
    p = peers_per_itr
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if p < 1:
        raise ValueError(f"peers_per_itr must be >= 1, got {p}")
    if kind == "ring" and p > 2:
        raise ValueError(f"ring: peers_per_itr must be 1 or 2, got {p}")
    if n == 1:
        return [[]]
    if p >= n:
        raise ValueError(f"peers_per_itr ({p}) must be < world size ({n})")
    if kind in BIPARTITE_KINDS and n % 2:
        raise ValueError(f"bipartite graph needs an even world size, got {n}")
    if kind == "hypercube":
        if n & (n - 1):
            raise ValueError(f"hypercube needs a power-of-two world size, got {n}")
        books = [[r ^ (1 << i) for i in range(n.bit_length() - 1)] for r in range(n)]
    else:
        offsets = _offsets(kind, n, p)
        books = []
        for r in range(n):
            # Bipartite: odd ranks are active, even ranks passive. A passive node walks the
            # offsets with the opposite sign, so that r and r + d meet in the same slot (symmetric
            # pairs, as in the paper-era construction).
            sign = -1 if kind in BIPARTITE_KINDS and r % 2 == 0 else 1
            book: list[int] = []
            for offset in offsets:
                peer = (r + sign * offset) % n
                if peer != r and peer not in book:
                    book.append(peer)
            books.append(book)
    validate_phone_books(books, p)
    return books


def validate_phone_books(phone_books: Sequence[Sequence[int]], peers_per_itr: int) -> None:
    """Raises ValueError unless the phone books form a valid graph (docs/design.md section 2)."""
    n = len(phone_books)
    if n == 0:
        raise ValueError("no phone books")
    if n == 1:
        if list(phone_books[0]):
            raise ValueError(f"a single node can have no peers, got {list(phone_books[0])}")
        return
    length = len(phone_books[0])
    for r, book in enumerate(phone_books):
        if len(book) != length:
            raise ValueError(
                f"phone book lengths differ: node 0 has {length}, node {r} {len(book)}"
            )
        if len(set(book)) != len(book):
            raise ValueError(f"node {r} lists a peer twice: {list(book)}")
        for peer in book:
            if not 0 <= peer < n:
                raise ValueError(f"node {r} lists peer {peer}, outside [0, {n})")
            if peer == r:
                raise ValueError(f"node {r} lists itself")
    if not 1 <= peers_per_itr < n or peers_per_itr > length:
        raise ValueError(f"peers_per_itr {peers_per_itr} does not fit n={n}, length {length}")
    for t in range(period(phone_books, peers_per_itr)):
        for r in range(n):
            if len(in_peers(phone_books, peers_per_itr, r, t)) != peers_per_itr:
                raise ValueError(f"node {r} has in-degree != out-degree in round {t}")


def _slots(length: int, peers_per_itr: int, round: int) -> list[int]:
    return [(g + round * peers_per_itr) % length for g in range(peers_per_itr)]


def out_peers(phone_books, peers_per_itr: int, rank: int, round: int) -> list[int]:
    """The nodes ``rank`` sends to in ``round``: slots (g + round * p) mod L, g = 0..p-1."""
    book = phone_books[rank]
    if not book:
        return []
    return [book[s] for s in _slots(len(book), peers_per_itr, round)]


def in_peers(phone_books, peers_per_itr: int, rank: int, round: int) -> list[int]:
    """The nodes that send to ``rank`` in ``round``, ordered by slot, then by rank."""
    length = len(phone_books[0])
    if length == 0:
        return []
    peers = []
    for s in _slots(length, peers_per_itr, round):
        peers += [q for q, book in enumerate(phone_books) if book[s] == rank]
    return peers


def period(phone_books, peers_per_itr: int) -> int:
    """The number of rounds after which the schedule repeats (1 when nobody has peers)."""
    length = len(phone_books[0])
    for t in range(1, length + 1):
        if (t * peers_per_itr) % length == 0:
            return t
    return 1


def pairs_symmetrically(phone_books, peers_per_itr: int) -> bool:
    """Every round, every node's in-peers are exactly its out-peers."""
    return all(
        sorted(out_peers(phone_books, peers_per_itr, r, t))
        == sorted(in_peers(phone_books, peers_per_itr, r, t))
        for t in range(period(phone_books, peers_per_itr))
        for r in range(len(phone_books))
    )


def uniform_weights(num_out_peers: int) -> tuple[float, float]:
    """(self, per-peer) share of uniform mixing: 1 / (k + 1) each; (1, 0) with no peers."""
    if num_out_peers == 0:
        return 1.0, 0.0
    share = 1.0 / (num_out_peers + 1)
    return share, share


def self_weight_weights(self_weight: float, num_out_peers: int) -> tuple[float, float]:
    """(self, per-peer) share when the node keeps ``self_weight``; (1, 0) with no peers."""
    if num_out_peers == 0:
        return 1.0, 0.0
    return self_weight, (1.0 - self_weight) / num_out_peers


def mixing_weights(num_out_peers: int, self_weight: float | None = None) -> tuple[float, float]:
    """Uniform mixing when ``self_weight`` is None, else self-weight mixing."""
    if self_weight is None:
        return uniform_weights(num_out_peers)
    return self_weight_weights(self_weight, num_out_peers)


def mixing_matrix(
    phone_books, peers_per_itr: int, round: int, self_weight: float | None = None
) -> torch.Tensor:
    """The [n, n] fp64 column-stochastic matrix M of one round: x_new = M @ x.

    Column i is how node i splits its value: M[i, i] is the share it keeps, M[j, i] the share
    it sends to each out-peer j.
    """
    n = len(phone_books)
    m = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        peers = out_peers(phone_books, peers_per_itr, i, round)
        keep, send = mixing_weights(len(peers), self_weight)
        m[i, i] = keep
        for j in peers:
            m[j, i] = send
    return m


def reference_push_sum(
    phone_books,
    peers_per_itr: int,
    values: torch.Tensor,
    rounds: int,
    self_weight: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Push-sum numerators and weights after every round.

    Returns ``(x, w)``: ``x`` is [rounds + 1, n, d] and ``w`` is [rounds + 1, n, 1], both fp64;
    entry 0 holds ``values`` and ones.
    """
    x = values.detach().to(torch.float64).clone()
    w = torch.ones(x.shape[0], 1, dtype=torch.float64)
    xs, ws = [x], [w]
    for t in range(rounds):
        m = mixing_matrix(phone_books, peers_per_itr, t, self_weight)
        x, w = m @ x, m @ w
        xs.append(x)
        ws.append(w)
    return torch.stack(xs), torch.stack(ws)


def reference_gossip(
    phone_books,
    peers_per_itr: int,
    values: torch.Tensor,
    rounds: int,
    push_sum: bool = True,
    self_weight: float | None = None,
) -> torch.Tensor:
    """The de-biased values z = x / w of every node after every round, [rounds + 1, n, d] fp64.

    ``push_sum=False`` is push-pull averaging (D-PSGD): no weight, z <- M @ z. It needs a graph
    that pairs nodes symmetrically every round (then M is symmetric, doubly stochastic); this
    raises ValueError for any other graph.
    """
    if not push_sum:
        if not pairs_symmetrically(phone_books, peers_per_itr):
            raise ValueError("push-pull averaging needs a graph that pairs nodes symmetrically")
        z = values.detach().to(torch.float64).clone()
        zs = [z]
        for t in range(rounds):
            m = mixing_matrix(phone_books, peers_per_itr, t, self_weight)
            if not torch.equal(m, m.T):
                raise ValueError(f"round {t}: the push-pull mixing matrix is not symmetric")
            z = m @ z
            zs.append(z)
        return torch.stack(zs)
    x, w = reference_push_sum(phone_books, peers_per_itr, values, rounds, self_weight)
    return x / w
