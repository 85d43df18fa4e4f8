"""Bad input to GossipDataParallel: a clear error naming the argument (or parameter) and the
value, raised on every rank, and before any communication wherever construction can tell.

A spawn costs seconds on two cores and a case milliseconds, so the construction cases share one
3-rank run and the cases met while training share one 2-rank run (module-scoped fixtures); each
case still has its own test. While a bad wrapper is being built, the collectives of
torch.distributed are swapped for ones that fail the case, so a check that only fires after
communicating shows up as a failure naming the collective, not as a hang.

Ranks that disagree on the configuration (case 16) are tested in tests/test_faults.py,
test_ranks_that_disagree_on_the_configuration_all_raise_naming_the_rank.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from multiprocess import error_of, run_ranks
from torch import nn

import gossip_ext

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

# ----------------------------------------------------------------------------- harness

_COLLECTIVES = (
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "new_group",
    "_broadcast_coalesced",
)


@contextlib.contextmanager
def _no_communication():
    def refuse(name):
        def collective(*args, **kwargs):
            raise AssertionError(f"communicated (dist.{name}) before rejecting the bad input")

        return collective

    with contextlib.ExitStack() as stack:
        for name in _COLLECTIVES:
            stack.enter_context(mock.patch.object(dist, name, refuse(name)))
        yield


def _bad_construction(module: nn.Module, **kwargs) -> tuple[type, str] | None:
    with _no_communication():
        return error_of(lambda: gossip_ext.GossipDataParallel(module, **kwargs))


def _assert_raised(errors: list, error_type: type, *fragments: str) -> None:
    """Every rank raised error_type with every fragment in its message."""
    for rank, got in enumerate(errors):
        assert got is not None, f"rank {rank} raised nothing"
        assert issubclass(got[0], error_type), f"rank {rank}: {got[0].__name__}: {got[1]}"
        for fragment in fragments:
            assert fragment in got[1], f"rank {rank}: {fragment!r} not in {got[1]!r}"


class _TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        # meta stands in for a second accelerator: a real device, and no GPU needed.
        self.shadow = nn.Parameter(torch.ones(2, device="meta"))


class _WithExtra(nn.Module):
    def __init__(self, extra: nn.Parameter):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.extra = extra


class _SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(4, 2, sparse=True)
        self.head = nn.Linear(2, 1)


class _FunctionalSparse(nn.Module):
    """Sparse gradients that no module announces: only the end of backward can see them."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.ones(4, 2))

    def forward(self, idx):
        return nn.functional.embedding(idx, self.table, sparse=True)


# Built at world size 3: odd, not a power of two, and not divisible by 2.
_BAD_AT_THREE = {
    "custom_graph_of_two": lambda: (nn.Linear(2, 1), {"graph": gossip_ext.CustomGraph([[1], [0]])}),
    "hypercube": lambda: (nn.Linear(2, 1), {"graph": gossip_ext.HypercubeGraph()}),
    "bipartite_exponential": lambda: (
        nn.Linear(2, 1),
        {"graph": gossip_ext.DynamicBipartiteExponentialGraph()},
    ),
    "bipartite_linear": lambda: (
        nn.Linear(2, 1),
        {"graph": gossip_ext.DynamicBipartiteLinearGraph()},
    ),
    "push_pull_directed": lambda: (nn.Linear(2, 1), {"push_sum": False}),
    "peers_per_itr_3": lambda: (
        nn.Linear(2, 1),
        {"graph": gossip_ext.NPeerDynamicDirectedExponentialGraph(peers_per_itr=3)},
    ),
    "nprocs_per_node_2": lambda: (nn.Linear(2, 1), {"nprocs_per_node": 2}),
    "no_parameters": lambda: (nn.Sequential(nn.ReLU()), {}),
    "lazy": lambda: (nn.LazyLinear(1), {}),
    "two_devices": lambda: (_TwoDevices(), {}),
    "int64": lambda: (
        _WithExtra(nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)),
        {},
    ),
    "complex64": lambda: (_WithExtra(nn.Parameter(torch.ones(2, dtype=torch.complex64))), {}),
}


def _construct_at_three(rank: int, world_size: int) -> dict:
    errors = {}
    for case, make in _BAD_AT_THREE.items():
        module, kwargs = make()
        errors[case] = _bad_construction(module, **kwargs)
    # A checkpoint from world size 3, for the 2-rank run to refuse.
    checkpoint = gossip_ext.GossipDataParallel(nn.Linear(2, 1)).state_dict()
    return {"errors": errors, "checkpoint": checkpoint}


@pytest.fixture(scope="module")
def at_three():
    results = run_ranks(3, _construct_at_three)
    return {
        "errors": {case: [r["errors"][case] for r in results] for case in _BAD_AT_THREE},
        "checkpoint": results[0]["checkpoint"],
    }


# ----------------------------------------------------------------------------- cases met in use

X = torch.ones(1, 2)


def _step(model, opt) -> None:
    model(X).sum().backward()
    opt.step()


def _calls_out_of_order() -> dict:
    out = {}
    model = gossip_ext.GossipDataParallel(nn.Linear(2, 1), overlap=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # legal: one round per step
        _step(model, opt)
        model.transfer_params()
    model.sync_comms()
    model.transfer_params()  # legal: sync_comms() finished the step's round on purpose
    out["overlap_twice"] = error_of(model.transfer_params)
    model.sync_comms()

    model = gossip_ext.GossipDataParallel(nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.register_optimizer(opt)
    _step(model, opt)
    out["hook_then_hand"] = error_of(model.transfer_params)
    model(X).sum().backward()
    model.transfer_params()
    out["hand_then_hook"] = error_of(opt.step)
    model.sync_comms()

    # Legal without overlap: back-to-back manual rounds, as a gossip-only loop runs them
    # (benchmarks/round_time.py).
    model = gossip_ext.GossipDataParallel(nn.Linear(2, 1))
    for _ in range(2):
        model.transfer_params()
        model.sync_comms()
    model.transfer_params()
    model.transfer_params()
    model.sync_comms()
    out["legal_rounds"] = model.gossip_round
    return out


def _parameters_changed_after_wrapping() -> dict:
    out = {}
    module = nn.Linear(2, 1)
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    model.transfer_params()
    module.new = nn.Linear(2, 2)
    out["forward"] = error_of(lambda: model(X))
    out["transfer_params"] = error_of(model.transfer_params)
    del module.new
    nn.Linear(3, 3)  # registrations outside the wrapped module are none of its business
    out["after_undo"] = error_of(lambda: model(X))
    module.bias = nn.Parameter(torch.zeros(1))
    out["replaced"] = error_of(lambda: model(X))
    model.sync_comms()
    return out


def _storage_replaced() -> tuple[type, str] | None:
    module = nn.Linear(2, 1)
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    module.weight.data = torch.zeros(1, 2)
    _step(model, opt)
    return error_of(model.transfer_params)


def _sparse_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randint(0, 6, (4,), generator=g), torch.randn(4, 3, generator=g)


def _sparse_gradients(rank: int) -> dict:
    out = {"hierarchical": _bad_construction(_SparseEmbedding(), nprocs_per_node=2)}
    model = gossip_ext.GossipDataParallel(_FunctionalSparse(), nprocs_per_node=2)
    out["unannounced"] = error_of(lambda: model(torch.tensor([0, 1])).sum().backward())

    torch.manual_seed(0)
    module = nn.Embedding(6, 3, sparse=True)
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out["sparse_grads"] = []
    for step in range(3):
        idx, target = _sparse_batch(rank, step)
        loss = ((model(idx) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        out["sparse_grads"].append(module.weight.grad.is_sparse)
        opt.step()
        model.transfer_params()
    model.sync_comms()
    out["final"] = module.weight.detach().clone()
    return out


def _foreign_checkpoints(checkpoint_from_three: dict) -> dict:
    model = gossip_ext.GossipDataParallel(nn.Linear(2, 1))
    ring = gossip_ext.GossipDataParallel(nn.Linear(2, 1), graph=gossip_ext.RingGraph())
    return {
        "world_size": error_of(lambda: model.load_state_dict(checkpoint_from_three)),
        "graph": error_of(lambda: model.load_state_dict(ring.state_dict())),
    }


def _use_at_two(rank: int, world_size: int, checkpoint_from_three: dict) -> dict:
    # Every case leaves no round in flight, so the next one starts clean.
    return {
        "order": _calls_out_of_order(),
        "added": _parameters_changed_after_wrapping(),
        "storage": _storage_replaced(),
        "sparse": _sparse_gradients(rank),
        "checkpoint": _foreign_checkpoints(checkpoint_from_three),
    }


@pytest.fixture(scope="module")
def at_two(at_three):
    return run_ranks(2, _use_at_two, at_three["checkpoint"])


# ----------------------------------------------------------------------------- the cases


def test_01_process_group_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_process_group\(\) first"):
        gossip_ext.GossipDataParallel(nn.Linear(2, 1))


def test_02_graph_that_does_not_fit_the_world_size(at_three):
    _assert_raised(
        at_three["errors"]["custom_graph_of_two"],
        ValueError,
        "graph=CustomGraph([[1], [0]], peers_per_itr=1)",
        "phone books for 2 nodes, but world_size is 3",
    )
    _assert_raised(
        at_three["errors"]["hypercube"],
        ValueError,
        "graph=HypercubeGraph(peers_per_itr=1)",
        "power of two, got 3",
    )


def test_03_bipartite_graph_at_odd_world_size(at_three):
    for case, name in (
        ("bipartite_exponential", "DynamicBipartiteExponentialGraph"),
        ("bipartite_linear", "DynamicBipartiteLinearGraph"),
    ):
        _assert_raised(
            at_three["errors"][case], ValueError, f"graph={name}(", "even world size, got 3"
        )


def test_04_push_pull_with_a_graph_that_does_not_pair_nodes(at_three):
    _assert_raised(
        at_three["errors"]["push_pull_directed"],
        ValueError,
        "push_sum=False",
        "graph=NPeerDynamicDirectedExponentialGraph(peers_per_itr=1) does not",
        "3 gossiping processes",
    )


def test_05_peers_per_itr_out_of_range(at_three):
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"peers_per_itr must be >= 1, got {bad}"):
            gossip_ext.NPeerDynamicDirectedExponentialGraph(peers_per_itr=bad)
    _assert_raised(
        at_three["errors"]["peers_per_itr_3"],
        ValueError,
        "graph=NPeerDynamicDirectedExponentialGraph(peers_per_itr=3)",
        "peers_per_itr must be < world_size (3), got 3",
    )


def test_06_nprocs_per_node_that_does_not_divide_the_world_size(at_three):
    _assert_raised(
        at_three["errors"]["nprocs_per_node_2"],
        ValueError,
        "nprocs_per_node (2) must divide the world size (3)",
    )
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"nprocs_per_node must be >= 1, got {bad}"):
            gossip_ext.GossipDataParallel(nn.Linear(2, 1), nprocs_per_node=bad)


def test_07_negative_synch_freq():
    with pytest.raises(ValueError, match="synch_freq must be >= 0, got -1"):
        gossip_ext.GossipDataParallel(nn.Linear(2, 1), synch_freq=-1)


def test_08_a_second_round_in_one_step(at_two):
    orders = [r["order"] for r in at_two]
    assert [o["legal_rounds"] for o in orders] == [4, 4]
    _assert_raised(
        [o["overlap_twice"] for o in orders],
        RuntimeError,
        "overlap=True: transfer_params() was called twice with no forward in between (by hand, "
        "then by hand)",
    )
    _assert_raised(
        [o["hook_then_hand"] for o in orders],
        RuntimeError,
        "transfer_params() was called by hand in a step where it was already called by "
        "register_optimizer()",
    )
    _assert_raised(
        [o["hand_then_hook"] for o in orders],
        RuntimeError,
        "called by register_optimizer() after optimizer.step() in a step where it was already "
        "called by hand",
    )


def test_09_module_without_parameters(at_three):
    _assert_raised(
        at_three["errors"]["no_parameters"], ValueError, "module (Sequential) has no parameters"
    )
    _assert_raised(
        at_three["errors"]["lazy"], ValueError, "parameter 'weight' is not initialized yet"
    )


def test_10_parameters_on_several_devices(at_three):
    _assert_raised(
        at_three["errors"]["two_devices"],
        ValueError,
        "parameter 'shadow' is on meta but parameter 'weight' is on cpu",
    )


def test_11_integer_and_complex_parameters(at_three):
    _assert_raised(
        at_three["errors"]["int64"],
        TypeError,
        "parameter 'extra' has dtype torch.int64",
        "register_buffer",
    )
    _assert_raised(
        at_three["errors"]["complex64"],
        TypeError,
        "parameter 'extra' has dtype torch.complex64",
        "view_as_real",
    )


def test_12_parameters_added_after_wrapping(at_two):
    added = [r["added"] for r in at_two]
    for when in ("forward", "transfer_params"):
        _assert_raised(
            [a[when] for a in added],
            RuntimeError,
            "after the module was wrapped",
            "added ['new.weight', 'new.bias']",
        )
    assert [a["after_undo"] for a in added] == [None, None]
    _assert_raised([a["replaced"] for a in added], RuntimeError, "replaced ['bias']")


def test_13_parameter_storage_replaced(at_two):
    _assert_raised(
        [r["storage"] for r in at_two],
        RuntimeError,
        "parameter 'weight' no longer views its flat gossip buffer",
    )


def test_14_sparse_gradients(at_two):
    sparse = [r["sparse"] for r in at_two]
    _assert_raised(
        [s["hierarchical"] for s in sparse],
        ValueError,
        "parameter 'embed.weight' gets sparse gradients",
        "nprocs_per_node=2",
    )
    _assert_raised(
        [s["unannounced"] for s in sparse],
        RuntimeError,
        "parameter 'table' got a torch.sparse_coo gradient",
    )
    # One process per node: the optimizer takes the sparse gradients and gossip averages the
    # parameters. Two ranks with weights 1/2 average exactly, so this is SGD on both ranks' loss.
    assert all(all(s["sparse_grads"]) for s in sparse)
    torch.manual_seed(0)
    ref = nn.Embedding(6, 3)
    init = ref.weight.detach().clone()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        losses = [
            ((ref(idx) - target) ** 2).mean()
            for idx, target in (_sparse_batch(rank, step) for rank in range(2))
        ]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    assert not torch.equal(sparse[0]["final"], init)
    assert torch.equal(sparse[0]["final"], sparse[1]["final"])
    torch.testing.assert_close(sparse[0]["final"], ref.weight.detach(), rtol=1e-5, atol=1e-6)


def test_15_checkpoint_from_another_world_size_or_graph(at_two):
    checkpoints = [r["checkpoint"] for r in at_two]
    _assert_raised(
        [c["world_size"] for c in checkpoints],
        ValueError,
        "saved with gossip_world_size=3, but this model has gossip_world_size=2",
    )
    _assert_raised(
        [c["graph"] for c in checkpoints],
        ValueError,
        "saved with graph='RingGraph(peers_per_itr=1)', but this model has "
        "graph='NPeerDynamicDirectedExponentialGraph(peers_per_itr=1)'",
    )


@pytest.mark.parametrize(
    "argument, value",
    [
        ("module", "model"),
        ("module", nn.Linear),
        ("graph", "ring"),
        ("graph", gossip_ext.UniformMixing()),
        ("mixing", 0.5),
        ("mixing", gossip_ext.RingGraph()),
        ("push_sum", 1),
        ("overlap", "yes"),
        ("synch_freq", 1.5),
        ("synch_freq", True),
        ("nprocs_per_node", 2.0),
        ("process_group", "world"),
        ("comm_device", 0),
        ("timeout", 30),
        ("verbose", "no"),
        ("check_finite", 1),
        ("global_avg_freq", 1.5),
        ("slowmo_freq", True),
        ("slowmo_momentum", "0.5"),
        ("slowmo_lr", None),
        ("log_every", 2.0),
    ],
)
def test_constructor_argument_types(argument, value):
    # Checked before torch.distributed is looked at: no process group needed.
    kwargs = {"module": nn.Linear(2, 1), "timeout": timedelta(seconds=5), argument: value}
    module = kwargs.pop("module")
    with pytest.raises(TypeError) as raised:
        gossip_ext.GossipDataParallel(module, **kwargs)
    message = str(raised.value)
    assert message.startswith(f"{argument} must be "), message
    assert repr(value) in message, message


@pytest.mark.parametrize("value", [torch.float32, torch.int8, "bfloat16", "int2", 8])
def test_message_dtype_must_be_a_message_format(value):
    with pytest.raises(
        ValueError,
        match=r"message_dtype must be torch.bfloat16, torch.float16, torch.float8_e4m3fn, "
        rf"'int8', 'int4' or None \(full precision\), got {value!r}",
    ):
        gossip_ext.GossipDataParallel(nn.Linear(2, 1), message_dtype=value)
