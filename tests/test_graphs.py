"""The graph and mixing API against the reference of docs/design.md section 2
(tests/reference.py)."""

import math
import random
import re

import pytest
from graph_kinds import KIND_OF
from reference import (
    BIPARTITE_KINDS,
    graph_phone_books,
    in_peers,
    mixing_weights,
    out_peers,
    pairs_symmetrically,
    period,
)

from gossip_ext import (
    CustomGraph,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    HypercubeGraph,
    MixingWeights,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    SelfWeightMixing,
    UniformMixing,
)

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

GRAPH_CLASSES = list(KIND_OF)
WORLD_SIZES = list(range(1, 18)) + [32, 64]


def _peer_counts(cls) -> tuple[int, ...]:
    return (1, 2) if cls is RingGraph else (1, 2, 3)


def _reference_books(cls, n: int, p: int):
    """The reference phone books, or None where the graph does not exist at this world size."""
    try:
        return graph_phone_books(KIND_OF[cls], n, p)
    except ValueError:
        return None


_ALL = [(cls, p, n) for cls in GRAPH_CLASSES for p in _peer_counts(cls) for n in WORLD_SIZES]
VALID = [(cls, p, n) for cls, p, n in _ALL if _reference_books(cls, n, p) is not None]
INVALID = [(cls, p, n) for cls, p, n in _ALL if _reference_books(cls, n, p) is None]


def _case_id(case) -> str:
    cls, p, n = case
    return f"{cls.__name__}-p{p}-n{n}"


def _rounds_to_check(books, p: int) -> list[int]:
    # Two full periods, then a round far beyond 32 bits (the round counter is int64).
    return list(range(2 * period(books, p) + 1)) + [2**40 + 3]


def test_cases_cover_valid_and_invalid_world_sizes():
    # Guards the parametrization below against silently collapsing to nothing.
    assert len(VALID) > 200
    assert len(INVALID) > 50


@pytest.mark.parametrize("case", VALID, ids=_case_id)
def test_schedule_matches_reference(case):
    cls, p, n = case
    books = graph_phone_books(KIND_OF[cls], n, p)
    graph = cls(p)
    for r in range(n):
        assert graph.phone_book(r, n) == books[r], f"phone_book({r}, {n})"
    for t in _rounds_to_check(books, p):
        for r in range(n):
            assert graph.out_peers(r, n, t) == out_peers(books, p, r, t), (
                f"out_peers({r}, {n}, {t})"
            )
            assert graph.in_peers(r, n, t) == in_peers(books, p, r, t), f"in_peers({r}, {n}, {t})"
    assert graph.pairs_symmetrically(n) == pairs_symmetrically(books, p)
    assert graph.is_regular
    schedule = graph.schedule(n)
    assert schedule.is_regular
    assert schedule.period == period(books, p)
    assert schedule.world_size == n


@pytest.mark.parametrize("case", INVALID, ids=_case_id)
def test_invalid_world_size_raises(case):
    cls, p, n = case
    graph = cls(p)
    for call in (
        lambda: graph.phone_book(0, n),
        lambda: graph.out_peers(0, n, 0),
        lambda: graph.in_peers(0, n, 0),
        lambda: graph.pairs_symmetrically(n),
    ):
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert cls.__name__ in message
        assert re.search(rf"\b{n}\b", message), message


@pytest.mark.parametrize("cls", GRAPH_CLASSES, ids=lambda c: c.__name__)
def test_world_size_one_has_no_peers(cls):
    for p in _peer_counts(cls):
        graph = cls(p)
        assert graph.phone_book(0, 1) == []
        assert graph.out_peers(0, 1, 0) == []
        assert graph.in_peers(0, 1, 5) == []
        assert graph.pairs_symmetrically(1)


@pytest.mark.parametrize(
    "cls, expected",
    [
        (NPeerDynamicDirectedExponentialGraph, (False, True)),
        (DynamicDirectedExponentialGraph, (False, True)),
        (DynamicBipartiteExponentialGraph, (True, True)),
        (DynamicDirectedLinearGraph, (False, True)),
        (DynamicBipartiteLinearGraph, (True, True)),
        (RingGraph, (False, False)),
        (HypercubeGraph, (False, True)),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else str(v),
)
def test_graph_properties(cls, expected):
    graph = cls()
    assert (graph.is_bipartite, graph.is_dynamic) == expected
    assert graph.is_regular
    assert graph.peers_per_itr == 1


@pytest.mark.parametrize(
    "graph, n, symmetric",
    [
        (NPeerDynamicDirectedExponentialGraph(), 8, False),
        (DynamicDirectedExponentialGraph(), 8, False),
        (DynamicDirectedLinearGraph(), 8, False),
        (RingGraph(1), 5, False),
        (RingGraph(2), 5, True),
        (HypercubeGraph(), 16, True),
        (HypercubeGraph(2), 16, True),
        (DynamicBipartiteExponentialGraph(), 16, True),
        (DynamicBipartiteLinearGraph(3), 12, True),
        (NPeerDynamicDirectedExponentialGraph(), 2, True),
    ],
    ids=repr,
)
def test_pairs_symmetrically_known_values(graph, n, symmetric):
    assert graph.pairs_symmetrically(n) is symmetric


def test_design_quoted_sequences():
    npeer = NPeerDynamicDirectedExponentialGraph()
    assert npeer.phone_book(0, 8) == [1, 2, 4]
    assert npeer.phone_book(0, 32) == [1, 2, 4, 8, 16]
    assert npeer.phone_book(5, 8) == [6, 7, 1]
    directed = DynamicDirectedExponentialGraph()
    assert directed.phone_book(0, 8) == [1, 7, 2, 6, 4]
    assert all(len(directed.phone_book(r, 32)) == 9 for r in range(32))
    # Round t of the default graph sends to slot t mod L.
    assert [npeer.out_peers(3, 8, t) for t in range(4)] == [[4], [5], [7], [4]]
    assert [npeer.in_peers(3, 8, t) for t in range(3)] == [[2], [1], [7]]
    assert RingGraph().phone_book(4, 5) == [0]
    assert RingGraph(2).phone_book(0, 5) == [1, 4]
    assert HypercubeGraph().phone_book(5, 8) == [4, 7, 1]


@pytest.mark.parametrize(
    "p, n, length, largest_step",
    [
        (1, 64, 6, 32),
        (1, 65, 7, 64),  # 2^6 == n - 1 is included
        (2, 243, 10, 162),
        (2, 244, 12, 243),  # 3^5 == n - 1: SGP's float log_3(243) == 4.999... dropped it
        (3, 256, 12, 192),
        (3, 257, 15, 256),  # 4^4 == n - 1
    ],
)
def test_npeer_peer_count_uses_exact_integer_logarithm(p, n, length, largest_step):
    book = NPeerDynamicDirectedExponentialGraph(p).phone_book(0, n)
    assert len(book) == length
    assert largest_step in book
    assert book == graph_phone_books("npeer_exponential", n, p)[0]


@pytest.mark.parametrize(
    "cls", [DynamicBipartiteExponentialGraph, DynamicBipartiteLinearGraph], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("n", [2, 4, 6, 8, 10, 12, 14, 16, 32, 64])
def test_bipartite_graphs_pair_opposite_roles_symmetrically(cls, n):
    assert KIND_OF[cls] in BIPARTITE_KINDS
    peer_counts = [p for p in (1, 2, 3) if _reference_books(cls, n, p) is not None]
    assert 1 in peer_counts
    for p in peer_counts:
        graph = cls(p)
        assert graph.pairs_symmetrically(n)
        for r in range(n):
            assert all(peer % 2 != r % 2 for peer in graph.phone_book(r, n))
        for t in range(2 * len(graph.phone_book(0, n)) + 1):
            for r in range(n):
                out = graph.out_peers(r, n, t)
                assert sorted(out) == sorted(graph.in_peers(r, n, t)), (p, r, t)
                for s in out:
                    assert r in graph.out_peers(s, n, t)


@pytest.mark.parametrize(
    "cls", [DynamicBipartiteExponentialGraph, DynamicBipartiteLinearGraph], ids=lambda c: c.__name__
)
@pytest.mark.parametrize("n", [3, 5, 7, 9])
def test_bipartite_odd_world_size_raises(cls, n):
    with pytest.raises(ValueError, match=rf"{cls.__name__}.*even world size, got {n}\b"):
        cls().phone_book(0, n)


def test_hypercube_needs_power_of_two():
    with pytest.raises(ValueError, match=r"HypercubeGraph.*power of two, got 6\b"):
        HypercubeGraph().phone_book(0, 6)
    with pytest.raises(ValueError, match=r"power of two, got 12\b"):
        HypercubeGraph().out_peers(0, 12, 0)


@pytest.mark.parametrize("p", [3, 4, 10])
def test_ring_peers_per_itr_at_most_two(p):
    with pytest.raises(ValueError, match=rf"RingGraph: peers_per_itr must be 1 or 2, got {p}\b"):
        RingGraph(p)


@pytest.mark.parametrize("cls", GRAPH_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("p", [0, -1])
def test_peers_per_itr_below_one_raises(cls, p):
    with pytest.raises(ValueError, match=rf"peers_per_itr must be >= 1, got {p}\b"):
        cls(p)


@pytest.mark.parametrize("cls", GRAPH_CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("p", [1.0, "1", True, None])
def test_peers_per_itr_wrong_type_raises(cls, p):
    with pytest.raises(TypeError, match=r"peers_per_itr must be an int"):
        cls(p)


@pytest.mark.parametrize("p, n", [(2, 2), (3, 3), (4, 4), (5, 4)])
def test_peers_per_itr_at_least_world_size_raises(p, n):
    graph = NPeerDynamicDirectedExponentialGraph(p)
    with pytest.raises(ValueError, match=rf"peers_per_itr must be < world_size \({n}\), got {p}\b"):
        graph.out_peers(0, n, 0)


def test_peers_per_itr_beyond_phone_book_raises():
    # Hypercube at n = 8 has 3 distinct peers per node.
    with pytest.raises(ValueError, match=r"peers_per_itr \(4\) exceeds .* \(3\) at world size 8"):
        HypercubeGraph(4).phone_book(0, 8)


@pytest.mark.parametrize("n", [0, -3])
def test_world_size_below_one_raises(n):
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {n}"):
        NPeerDynamicDirectedExponentialGraph().phone_book(0, n)


@pytest.mark.parametrize("n", [8.0, "8", None])
def test_world_size_wrong_type_raises(n):
    with pytest.raises(TypeError, match=r"world_size must be an int"):
        NPeerDynamicDirectedExponentialGraph().phone_book(0, n)


@pytest.mark.parametrize("method", ["phone_book", "out_peers", "in_peers"])
def test_rank_out_of_range_raises(method):
    graph = DynamicDirectedExponentialGraph()
    extra = () if method == "phone_book" else (0,)
    with pytest.raises(ValueError, match=r"rank must be < world_size \(8\), got 8\b"):
        getattr(graph, method)(8, 8, *extra)
    with pytest.raises(ValueError, match=r"rank must be >= 0, got -1\b"):
        getattr(graph, method)(-1, 8, *extra)
    with pytest.raises(TypeError, match=r"rank must be an int"):
        getattr(graph, method)(1.0, 8, *extra)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_round_near_int64_limit_follows_the_schedule(p):
    # Round t uses slots (g + t * p) mod L for any int64 t: t * p must not overflow.
    graph = NPeerDynamicDirectedExponentialGraph(p)
    books = graph_phone_books("npeer_exponential", 16, p)
    for t in (2**62 + 1, 2**63 - 1):
        for r in (0, 5):
            assert graph.out_peers(r, 16, t) == out_peers(books, p, r, t), (r, t)
            assert graph.in_peers(r, 16, t) == in_peers(books, p, r, t), (r, t)


@pytest.mark.parametrize("method", ["out_peers", "in_peers"])
def test_negative_round_raises(method):
    with pytest.raises(ValueError, match=r"round must be >= 0, got -1\b"):
        getattr(RingGraph(), method)(0, 4, -1)


# --- CustomGraph -------------------------------------------------------------------------------


def _random_regular_books(n: int, length: int, seed: int) -> list[list[int]]:
    """Phone books whose every slot is a derangement: in-degree == out-degree in every round."""
    rng = random.Random(seed)
    slots = []
    while len(slots) < length:
        perm = list(range(n))
        rng.shuffle(perm)
        column_ok = all(perm[r] != r for r in range(n))
        distinct = all(all(perm[r] != s[r] for s in slots) for r in range(n))
        if column_ok and distinct:
            slots.append(perm)
    return [[slots[s][r] for s in range(length)] for r in range(n)]


CUSTOM_CASES = [
    ([[1], [2], [0]], 1),
    ([[1, 2], [2, 0], [0, 1]], 1),
    ([[1, 2], [2, 0], [0, 1]], 2),
    ([[1], [0]], 1),
    ([[1, 3], [0, 2], [3, 1], [2, 0]], 1),
    (_random_regular_books(6, 3, seed=1), 1),
    (_random_regular_books(7, 4, seed=2), 2),
    (_random_regular_books(9, 5, seed=3), 3),
    ([[]], 1),
]


@pytest.mark.parametrize("books, p", CUSTOM_CASES, ids=lambda v: str(v))
def test_custom_graph_matches_reference(books, p):
    n = len(books)
    graph = CustomGraph(books, peers_per_itr=p)
    for r in range(n):
        assert graph.phone_book(r, n) == books[r]
    for t in range(2 * period(books, p) + 2):
        for r in range(n):
            assert graph.out_peers(r, n, t) == out_peers(books, p, r, t)
            assert graph.in_peers(r, n, t) == in_peers(books, p, r, t)
    assert graph.pairs_symmetrically(n) == pairs_symmetrically(books, p)
    assert graph.is_dynamic == (period(books, p) > 1)
    assert graph.is_regular
    assert not graph.is_bipartite


def test_custom_graph_docstring_example_and_dynamic_flag():
    ring = CustomGraph([[1], [2], [0]])
    assert ring.out_peers(rank=2, world_size=3, round=0) == [0]
    assert not ring.is_dynamic
    assert CustomGraph([[1, 2], [2, 0], [0, 1]]).is_dynamic
    assert not CustomGraph([[1, 2], [2, 0], [0, 1]], peers_per_itr=2).is_dynamic


def test_custom_graphs_with_different_books_do_not_share_a_schedule():
    # Schedules are cached per graph: two graphs of the same world size must not collide.
    a = CustomGraph([[1], [2], [0]])
    b = CustomGraph([[2], [0], [1]])
    assert a != b
    assert a == CustomGraph([[1], [2], [0]])
    assert hash(a) == hash(CustomGraph([[1], [2], [0]]))
    assert a.out_peers(0, 3, 0) == [1]
    assert b.out_peers(0, 3, 0) == [2]
    assert a.in_peers(0, 3, 0) == [2]


@pytest.mark.parametrize(
    "books, p, pattern",
    [
        ([[1], [1]], 1, r"CustomGraph: node 1 lists itself as a peer"),
        ([[0, 1], [0, 1]], 1, r"CustomGraph: node 0 lists itself as a peer"),
        ([[1], [0], [0]], 1, r"in-degree must equal out-degree \(1\).*node 0 has 2 in-peers"),
        ([[1, 2], [0, 2], [1, 0]], 1, r"in-degree must equal out-degree"),
        ([[1], [5]], 1, r"node 1 lists peer 5, outside \[0, 2\)"),
        ([[-1], [0]], 1, r"node 0 lists peer -1, outside \[0, 2\)"),
        ([[1, 1], [0, 0]], 1, r"node 0 lists peer 1 twice"),
        ([[1, 2], [0], [0, 1]], 1, r"same length; node 0 has 2 peers, node 1 has 1"),
        ([[1], [2], [0]], 2, r"peers_per_itr \(2\) exceeds .* \(1\) at world size 3"),
        ([[1], [0]], 2, r"peers_per_itr must be < world_size \(2\), got 2"),
        ([], 1, r"phone_books must list at least one node, got \[\]"),
    ],
    ids=lambda v: str(v),
)
def test_custom_graph_invalid_books_raise(books, p, pattern):
    with pytest.raises(ValueError, match=pattern):
        CustomGraph(books, peers_per_itr=p)


@pytest.mark.parametrize("books", [[[0]], [[3]], [[-1]]], ids=str)
def test_custom_graph_single_node_with_peers_raises(books):
    # One node can have no peer: [[0]] is a self edge, [[3]] and [[-1]] are out of range.
    # docs/design.md section 2: a user-supplied phone book is validated (no self edges).
    with pytest.raises(ValueError, match=r"CustomGraph"):
        CustomGraph(books)


@pytest.mark.parametrize("books", [5, [1, 0], None], ids=repr)
def test_custom_graph_not_nested_sequence_raises(books):
    with pytest.raises(TypeError, match=r"phone_books must be a sequence of sequences of ints"):
        CustomGraph(books)


@pytest.mark.parametrize("books", [[[1.5], [0]], [["1"], ["0"]]], ids=repr)
def test_custom_graph_non_integer_peers_raise(books):
    # A float or string peer must be refused, not truncated or parsed into a different graph.
    with pytest.raises(TypeError, match=r"phone_books"):
        CustomGraph(books)


def test_custom_graph_world_size_mismatch_raises():
    graph = CustomGraph([[1], [0]])
    with pytest.raises(ValueError, match=r"phone books for 2 nodes, but world_size is 3"):
        graph.phone_book(0, 3)
    with pytest.raises(ValueError, match=r"phone books for 2 nodes, but world_size is 1"):
        graph.out_peers(0, 1, 0)


# --- Mixing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(9))
def test_uniform_mixing_weights(k):
    weights = UniformMixing().weights(k)
    assert isinstance(weights, MixingWeights)
    assert tuple(weights) == pytest.approx(mixing_weights(k), rel=1e-15, abs=0)
    assert weights.self_weight + k * weights.peer_weight == pytest.approx(1.0, rel=1e-15)
    if k:
        assert weights.self_weight == weights.peer_weight == pytest.approx(1 / (k + 1))


@pytest.mark.parametrize("a", [0.05, 0.3, 0.5, 0.9, 1 - 1e-9])
@pytest.mark.parametrize("k", range(6))
def test_self_weight_mixing_weights(a, k):
    weights = SelfWeightMixing(a).weights(k)
    assert tuple(weights) == pytest.approx(mixing_weights(k, a), rel=1e-15, abs=0)
    assert weights.self_weight + k * weights.peer_weight == pytest.approx(1.0, rel=1e-15)
    if k == 0:
        assert tuple(weights) == (1.0, 0.0)


def test_mixing_flags_and_defaults():
    assert UniformMixing().is_uniform
    assert not SelfWeightMixing().is_uniform
    assert SelfWeightMixing().self_weight == 0.5
    assert SelfWeightMixing(1 / 4).self_weight == 0.25
    assert SelfWeightMixing(0.3) == SelfWeightMixing(0.3)
    assert SelfWeightMixing(0.3) != SelfWeightMixing(0.4)
    assert UniformMixing() == UniformMixing()


@pytest.mark.parametrize(
    "graph, n",
    [
        (NPeerDynamicDirectedExponentialGraph(), 8),
        (NPeerDynamicDirectedExponentialGraph(2), 9),
        (DynamicDirectedExponentialGraph(3), 8),
        (RingGraph(2), 5),
        (HypercubeGraph(), 1),
    ],
    ids=repr,
)
@pytest.mark.parametrize("mixing", [UniformMixing(), SelfWeightMixing(0.3)], ids=repr)
def test_weights_for_uses_the_rounds_out_degree(graph, n, mixing):
    self_weight = None if mixing.is_uniform else mixing.self_weight
    kind = KIND_OF[type(graph)]
    books = graph_phone_books(kind, n, graph.peers_per_itr)
    for t in range(4):
        for r in range(n):
            k = len(out_peers(books, graph.peers_per_itr, r, t))
            expected = mixing_weights(k, self_weight)
            got = mixing.weights_for(graph, rank=r, world_size=n, round=t)
            assert tuple(got) == pytest.approx(expected, rel=1e-15, abs=0)


@pytest.mark.parametrize("a", [0, 0.0, 1, 1.0, -0.1, 1.5, math.nan, math.inf, -math.inf])
def test_self_weight_out_of_range_raises(a):
    with pytest.raises(ValueError, match=rf"self_weight must be in \(0, 1\), got {a}"):
        SelfWeightMixing(a)


@pytest.mark.parametrize("a", ["x", None, True, [0.5]])
def test_self_weight_wrong_type_raises(a):
    with pytest.raises(TypeError, match=r"self_weight must be a float, got"):
        SelfWeightMixing(a)


@pytest.mark.parametrize("mixing", [UniformMixing(), SelfWeightMixing(0.3)], ids=repr)
def test_weights_bad_num_out_peers_raises(mixing):
    with pytest.raises(ValueError, match=r"num_out_peers must be >= 0, got -1"):
        mixing.weights(-1)
    for bad in (1.5, "2", True, None):
        with pytest.raises(TypeError, match=r"num_out_peers must be an int"):
            mixing.weights(bad)
