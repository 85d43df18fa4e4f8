"""gossip_ext.simulate (the real engine, one thread per node) against tests/reference.py."""

import math
from datetime import timedelta

import pytest
import torch
from graph_kinds import KIND_OF
from reference import graph_phone_books, pairs_symmetrically, reference_gossip, reference_push_sum

import gossip_ext
from gossip_ext import (
    CustomGraph,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    HypercubeGraph,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    SelfWeightMixing,
    UniformMixing,
)

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

GRAPHS = [
    NPeerDynamicDirectedExponentialGraph(),
    NPeerDynamicDirectedExponentialGraph(2),
    DynamicDirectedExponentialGraph(),
    DynamicDirectedExponentialGraph(2),
    DynamicBipartiteExponentialGraph(),
    DynamicBipartiteExponentialGraph(2),
    DynamicDirectedLinearGraph(),
    DynamicBipartiteLinearGraph(),
    RingGraph(),
    RingGraph(2),
    HypercubeGraph(),
    HypercubeGraph(2),
]
CUSTOM_GRAPHS = [
    CustomGraph([[1], [2], [0]]),
    CustomGraph([[1, 2], [2, 0], [0, 1]]),
    CustomGraph([[1, 3], [0, 2], [3, 1], [2, 0]]),
    CustomGraph([[2, 1], [4, 3], [3, 0], [0, 4], [1, 2]], peers_per_itr=2),
]
WORLD_SIZES = [2, 3, 4, 5, 8]
MIXINGS = [UniformMixing(), SelfWeightMixing(0.3)]
ROUNDS = 10
ATOL = 1e-10


def _books(graph, n: int):
    """Reference phone books of ``graph`` at ``n`` nodes, or None where it does not exist."""
    if isinstance(graph, CustomGraph):
        books = [list(b) for b in graph.phone_books]
        return books if len(books) == n else None
    try:
        return graph_phone_books(KIND_OF[type(graph)], n, graph.peers_per_itr)
    except ValueError:
        return None


def _self_weight(mixing):
    return None if mixing.is_uniform else mixing.self_weight


CASES = [
    (graph, n)
    for graph in GRAPHS + CUSTOM_GRAPHS
    for n in WORLD_SIZES
    if _books(graph, n) is not None
]
SYMMETRIC_CASES = [
    (graph, n) for graph, n in CASES if pairs_symmetrically(_books(graph, n), graph.peers_per_itr)
]


def _case_id(case) -> str:
    graph, n = case
    return f"{graph!r}-n{n}"


def _values(n: int, d: int = 3, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 31 * n)
    return torch.randn(n, d, dtype=torch.float64, generator=generator).to(dtype)


def test_cases_cover_every_graph_class():
    assert {type(g) for g, _ in CASES} == set(KIND_OF) | {CustomGraph}
    assert {type(g) for g, _ in SYMMETRIC_CASES} >= {
        DynamicBipartiteExponentialGraph,
        DynamicBipartiteLinearGraph,
        HypercubeGraph,
        RingGraph,
    }


@pytest.mark.parametrize("mixing", MIXINGS, ids=repr)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_push_sum_matches_reference(case, mixing):
    graph, n = case
    values = _values(n)
    values_before = values.clone()
    z = gossip_ext.simulate(graph, values, ROUNDS, push_sum=True, mixing=mixing)
    expected = reference_gossip(
        _books(graph, n),
        graph.peers_per_itr,
        values,
        ROUNDS,
        push_sum=True,
        self_weight=_self_weight(mixing),
    )
    assert z.shape == (ROUNDS + 1, n, 3)
    assert z.dtype == torch.float64
    assert torch.equal(z[0], values)
    assert torch.equal(values, values_before)
    torch.testing.assert_close(z, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("mixing", MIXINGS, ids=repr)
@pytest.mark.parametrize("case", SYMMETRIC_CASES, ids=_case_id)
def test_push_pull_matches_reference(case, mixing):
    graph, n = case
    values = _values(n, seed=1)
    z = gossip_ext.simulate(graph, values, ROUNDS, push_sum=False, mixing=mixing)
    expected = reference_gossip(
        _books(graph, n),
        graph.peers_per_itr,
        values,
        ROUNDS,
        push_sum=False,
        self_weight=_self_weight(mixing),
    )
    torch.testing.assert_close(z, expected, rtol=0, atol=ATOL)
    # Doubly stochastic mixing: the average never changes.
    mean = values.mean(dim=0)
    torch.testing.assert_close(z.mean(dim=1), mean.expand(ROUNDS + 1, -1), rtol=0, atol=ATOL)


@pytest.mark.parametrize("mixing", MIXINGS, ids=repr)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_push_sum_conserves_mass(case, mixing):
    graph, n = case
    values = _values(n, seed=2)
    z = gossip_ext.simulate(graph, values, ROUNDS, mixing=mixing)
    _, w = reference_push_sum(
        _books(graph, n), graph.peers_per_itr, values, ROUNDS, self_weight=_self_weight(mixing)
    )
    torch.testing.assert_close(
        w.sum(dim=1), torch.full((ROUNDS + 1, 1), float(n), dtype=torch.float64), rtol=0, atol=ATOL
    )
    # Numerators x = w * z: their sum over nodes is the initial sum after every round.
    mass = (z * w).sum(dim=1)
    torch.testing.assert_close(mass, values.sum(dim=0).expand(ROUNDS + 1, -1), rtol=0, atol=ATOL)
    # Every valid graph is regular (in-degree == out-degree), so any mixing that splits a node's
    # value equally among its out-peers is also row-stochastic: the weights stay 1, exactly so
    # for uniform mixing (lazy mixing), and the average of the de-biased values is kept.
    ones = torch.ones_like(w)
    if mixing.is_uniform:
        assert torch.equal(w, ones)
    torch.testing.assert_close(w, ones, rtol=0, atol=1e-14)
    torch.testing.assert_close(
        z.mean(dim=1), values.mean(dim=0).expand(ROUNDS + 1, -1), rtol=0, atol=ATOL
    )


@pytest.mark.parametrize("n", [8, 16, 256])
def test_default_graph_reaches_exact_consensus_after_log2_n_rounds(n):
    rounds = n.bit_length() - 1
    # Integer values: every partial average is a dyadic rational, exact in fp64.
    values = torch.stack(
        [
            torch.arange(n, dtype=torch.float64) ** 2,
            torch.arange(n, dtype=torch.float64) * -3.0 + 7.0,
        ],
        dim=1,
    )
    z = gossip_ext.simulate(None, values, rounds + 1)
    mean = values.mean(dim=0)
    assert not torch.equal(z[rounds - 1], mean.expand(n, -1))
    assert torch.equal(z[rounds], mean.expand(n, -1))
    assert torch.equal(z[rounds + 1], mean.expand(n, -1))


@pytest.mark.parametrize("n", [2, 8, 16])
def test_hypercube_push_pull_reaches_exact_average_after_log2_n_rounds(n):
    rounds = n.bit_length() - 1
    values = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2) ** 2
    z = gossip_ext.simulate(HypercubeGraph(), values, rounds, push_sum=False)
    assert torch.equal(z[rounds], values.mean(dim=0).expand(n, -1))


@pytest.mark.parametrize(
    "graph, n",
    [
        (NPeerDynamicDirectedExponentialGraph(), 5),
        (NPeerDynamicDirectedExponentialGraph(), 8),
        (DynamicDirectedExponentialGraph(), 7),
        (DynamicBipartiteLinearGraph(), 6),
        (RingGraph(), 4),
    ],
    ids=repr,
)
@pytest.mark.parametrize("self_weight", [0.3, 0.6, 0.8])
def test_non_uniform_mixing_converges_to_the_initial_mean(graph, n, self_weight):
    values = _values(n, d=4, seed=3)
    z = gossip_ext.simulate(graph, values, 250, mixing=SelfWeightMixing(self_weight))
    mean = values.mean(dim=0).expand(n, -1)
    assert (z[1] - mean).abs().max() > 1e-3
    torch.testing.assert_close(z[-1], mean, rtol=0, atol=1e-12)


# (rtol, atol) of a 10-round simulation against the fp64 reference, values of magnitude ~1.
LOW_PRECISION = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@pytest.mark.parametrize("mixing", MIXINGS, ids=repr)
@pytest.mark.parametrize(
    "graph, n",
    [
        (NPeerDynamicDirectedExponentialGraph(), 8),
        (DynamicDirectedExponentialGraph(), 5),
        (DynamicBipartiteExponentialGraph(), 6),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dtype", list(LOW_PRECISION), ids=lambda d: str(d).removeprefix("torch."))
def test_low_precision_values(dtype, graph, n, mixing):
    values = _values(n, d=5, dtype=dtype, seed=4)
    z = gossip_ext.simulate(graph, values, ROUNDS, mixing=mixing)
    assert z.dtype == dtype
    assert torch.equal(z[0], values)
    expected = reference_gossip(
        _books(graph, n), graph.peers_per_itr, values, ROUNDS, self_weight=_self_weight(mixing)
    )
    rtol, atol = LOW_PRECISION[dtype]
    torch.testing.assert_close(z.to(torch.float64), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("push_sum", [True, False])
@pytest.mark.parametrize("graph", GRAPHS + [CustomGraph([[]])], ids=repr)
def test_single_node_returns_input_every_round(graph, push_sum):
    for dtype in (torch.float64, torch.float32):
        values = _values(1, d=6, dtype=dtype, seed=5)
        for mixing in MIXINGS:
            z = gossip_ext.simulate(graph, values, 4, push_sum=push_sum, mixing=mixing)
            assert z.shape == (5, 1, 6)
            assert torch.equal(z, values.expand(5, 1, 6))


def test_zero_rounds_returns_the_input():
    values = _values(4)
    z = gossip_ext.simulate(HypercubeGraph(), values, 0)
    assert z.shape == (1, 4, 3)
    assert torch.equal(z[0], values)


def test_default_arguments_and_input_forms():
    values = _values(8)
    z = gossip_ext.simulate(None, values, 3)
    torch.testing.assert_close(
        z,
        gossip_ext.simulate(
            NPeerDynamicDirectedExponentialGraph(), values, 3, push_sum=True, mixing=UniformMixing()
        ),
        rtol=0,
        atol=0,
    )
    # Non-contiguous values, values that require grad, and a custom timeout give the same result.
    strided = values.t().contiguous().t()
    assert not strided.is_contiguous()
    torch.testing.assert_close(gossip_ext.simulate(None, strided, 3), z, rtol=0, atol=0)
    leaf = values.clone().requires_grad_()
    z_leaf = gossip_ext.simulate(None, leaf, 3, timeout=timedelta(seconds=20))
    assert not z_leaf.requires_grad
    torch.testing.assert_close(z_leaf, z, rtol=0, atol=0)
    # The docstring example.
    z = gossip_ext.simulate(None, torch.arange(8.0).reshape(8, 1), rounds=3)
    assert torch.allclose(z[-1], torch.full((8, 1), 3.5))


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph, n",
    [
        (NPeerDynamicDirectedExponentialGraph(), 8),
        (DynamicDirectedExponentialGraph(), 5),
        (DynamicDirectedLinearGraph(), 4),
        (RingGraph(), 4),
        (CustomGraph([[1], [2], [0]]), 3),
    ],
    ids=repr,
)
def test_push_pull_needs_a_symmetric_graph(graph, n):
    name = type(graph).__name__
    with pytest.raises(ValueError, match=rf"push_sum=False.*{name} at world size {n}\b"):
        gossip_ext.simulate(graph, _values(n), 2, push_sum=False)


@pytest.mark.parametrize(
    "graph, n, pattern",
    [
        (DynamicBipartiteExponentialGraph(), 5, r"DynamicBipartiteExponentialGraph.*got 5\b"),
        (HypercubeGraph(), 6, r"HypercubeGraph.*power of two, got 6\b"),
        (NPeerDynamicDirectedExponentialGraph(3), 3, r"peers_per_itr must be < world_size \(3\)"),
        (CustomGraph([[1], [0]]), 3, r"phone books for 2 nodes, but world_size is 3"),
    ],
    ids=repr,
)
def test_graph_that_does_not_fit_the_world_size_raises(graph, n, pattern):
    with pytest.raises(ValueError, match=pattern):
        gossip_ext.simulate(graph, _values(n), 2)


@pytest.mark.parametrize(
    "values, pattern",
    [
        (torch.zeros(8), r"values must be a 2-D tensor \[n, d\] with n, d >= 1, got shape \[8\]"),
        (torch.zeros(2, 2, 2), r"values must be a 2-D tensor .* got shape \[2, 2, 2\]"),
        (torch.zeros(()), r"values must be a 2-D tensor .* got shape \[\]"),
        (torch.zeros(3, 0), r"values must be a 2-D tensor .* got shape \[3, 0\]"),
        (torch.zeros(0, 3), r"world_size must be >= 1, got 0"),
        (torch.zeros(2, 3, device="meta"), r"values must be on the CPU, got meta"),
    ],
    ids=lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None,
)
def test_bad_values_shape_or_device_raises(values, pattern):
    with pytest.raises(ValueError, match=pattern):
        gossip_ext.simulate(None, values, 2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex128])
def test_non_floating_values_raise(dtype):
    with pytest.raises(TypeError, match=r"values must be floating point, got"):
        gossip_ext.simulate(None, torch.zeros(4, 2, dtype=dtype), 2)


@pytest.mark.parametrize("rounds", [-1, -100])
def test_negative_rounds_raises(rounds):
    with pytest.raises(ValueError, match=rf"rounds must be >= 0, got {rounds}\b"):
        gossip_ext.simulate(None, _values(4), rounds)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"graph": "ring"}, r"graph must be a gossip_ext graph, got str"),
        ({"graph": RingGraph}, r"graph must be a gossip_ext graph, got type"),
        ({"mixing": "uniform"}, r"mixing must be a gossip_ext mixing, got str"),
        ({"mixing": 0.5}, r"mixing must be a gossip_ext mixing, got float"),
        ({"values": [[1.0, 2.0], [3.0, 4.0]]}, r"values must be a torch.Tensor, got list"),
        ({"rounds": 2.0}, r"rounds must be an int, got 2.0"),
        ({"rounds": True}, r"rounds must be an int, got True"),
        ({"rounds": "3"}, r"rounds must be an int, got '3'"),
        ({"push_sum": 1}, r"push_sum must be a bool, got 1"),
        ({"push_sum": None}, r"push_sum must be a bool, got None"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_wrong_argument_types_raise(kwargs, pattern):
    arguments = {"graph": None, "values": _values(4), "rounds": 2}
    arguments.update(kwargs)
    with pytest.raises(TypeError, match=pattern):
        gossip_ext.simulate(**arguments)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"timeout must be positive, got 0 ms"):
        gossip_ext.simulate(None, _values(4), 2, timeout=timedelta(0))


def test_reference_sanity():
    # The oracle itself: a one-round average on n = 2, and push-sum weights that leave 1 on a
    # non-regular phone book (node 0 receives from both others) while their sum stays n.
    books = graph_phone_books("npeer_exponential", 2)
    z = reference_gossip(books, 1, torch.tensor([[0.0], [2.0]]), 1)
    assert torch.equal(z[1], torch.tensor([[1.0], [1.0]], dtype=torch.float64))
    values = torch.tensor([[3.0], [6.0], [9.0]])
    x, w = reference_push_sum([[1], [0], [0]], 1, values, 2, self_weight=0.25)
    assert torch.equal(w[1], torch.tensor([[1.75], [1.0], [0.25]], dtype=torch.float64))
    assert math.isclose(w[2].sum().item(), 3.0)
    assert math.isclose(x[2].sum().item(), 18.0)
    z = reference_gossip([[1], [0], [0]], 1, values, 2, self_weight=0.25)
    torch.testing.assert_close(z, x / w)
    with pytest.raises(ValueError, match="symmetrically"):
        reference_gossip([[1], [2], [0]], 1, values, 1, push_sum=False)


# --- compressed messages (Note [Compressed messages]) ------------------------------------------


def _reference_compressed_lazy(graph, values: torch.Tensor, rounds: int, message_dtype):
    """Uniform push-sum with 16-bit messages, written out per node: a node with k out-peers
    sends q = round(z / (k + 1)) to each and keeps its whole numerator minus the k copies."""
    n = values.shape[0]
    schedule = graph.schedule(n)
    z = values.clone()
    for t in range(rounds):
        incoming = torch.zeros_like(z)
        kept = torch.empty_like(z)
        for i in range(n):
            out = schedule.out_peers(i, t)
            share = 1.0 / (len(out) + 1)
            q = (share * z[i]).to(message_dtype).to(z.dtype)
            kept[i] = z[i] - len(out) * q
            for j in out:
                incoming[j] += q
        z = kept + incoming
    return z


@pytest.mark.parametrize("message_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("graph", [NPeerDynamicDirectedExponentialGraph(), RingGraph(2)], ids=repr)
def test_compressed_rounds_match_the_reference(graph, message_dtype):
    values = torch.randn(6, 37, generator=torch.Generator().manual_seed(3))
    got = gossip_ext.simulate(graph, values, 6, message_dtype=message_dtype)
    want = _reference_compressed_lazy(graph, values.double(), 6, message_dtype)
    torch.testing.assert_close(got[-1].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("message_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "dtype, mean_tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)], ids=["fp32", "fp64"]
)
def test_compressed_messages_conserve_the_mean_over_1000_rounds(dtype, mean_tol, message_dtype):
    values = (3.0 * torch.randn(8, 257, generator=torch.Generator().manual_seed(1))).to(dtype)
    z = gossip_ext.simulate(None, values, 1000, message_dtype=message_dtype)
    mean0 = values.double().mean(0)
    # Without the error kept by the sender, the bfloat16 case drifts by 5.5e-3 here (measured
    # with the reference below minus the fold), 30 times this bound.
    drift = (z[-1].double().mean(0) - mean0).abs().max().item()
    assert drift <= mean_tol * 3.0 * 1000**0.5, drift
    # Workers agree to within the message precision (not exactly: every round re-rounds).
    spread = (z[-1].double() - mean0).abs().max().item()
    assert spread <= 3.0 * 2.0 ** (-8 if message_dtype == torch.bfloat16 else -11) * 8, spread


def test_message_dtype_must_be_16_bit():
    with pytest.raises(ValueError, match="message_dtype must be torch.float16 or torch.bfloat16"):
        gossip_ext.simulate(None, torch.ones(4, 3), 1, message_dtype=torch.float32)
