"""gossip_ext.compat.sgp: SGP's graphs, mixing and wrapper on gossip_ext's engine.

Adapted from facebookresearch/stochastic_gradient_push (under its license, CC-BY-NC 4.0): the
phone books of ``gossip/graph_manager.py`` (written out below as offsets for a few world sizes)
and the training loop of ``gossip_sgd.py`` (``train()``, ``validate()``,
``update_peers_per_itr()`` and its per-epoch checkpoint), reimplemented at toy scale on CPU over
gloo, with the script's calls to the wrapper unchanged.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from multiprocess import error_of, run_ranks
from torch import nn

import gossip_ext
from gossip_ext.compat import sgp
from gossip_ext.gossip import consensus

# ----------------------------------------------------------------------------- graphs

CORE_GRAPHS = {
    sgp.DynamicDirectedExponentialGraph: gossip_ext.DynamicDirectedExponentialGraph,
    sgp.DynamicBipartiteExponentialGraph: gossip_ext.DynamicBipartiteExponentialGraph,
    sgp.DynamicDirectedLinearGraph: gossip_ext.DynamicDirectedLinearGraph,
    sgp.DynamicBipartiteLinearGraph: gossip_ext.DynamicBipartiteLinearGraph,
    sgp.RingGraph: gossip_ext.RingGraph,
    sgp.NPeerDynamicDirectedExponentialGraph: gossip_ext.NPeerDynamicDirectedExponentialGraph,
}
BIPARTITE = (sgp.DynamicBipartiteExponentialGraph, sgp.DynamicBipartiteLinearGraph)


@pytest.mark.parametrize("nprocs_per_node", [1, 2])
@pytest.mark.parametrize("peers_per_itr", [1, 2])
@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("cls", list(CORE_GRAPHS), ids=lambda c: c.__name__)
def test_get_peers_walks_the_core_schedule(cls, world_size, peers_per_itr, nprocs_per_node):
    m = nprocs_per_node
    core = CORE_GRAPHS[cls](peers_per_itr)
    for rank in range(world_size):
        graph = cls(rank, world_size, m, m - 1, peers_per_itr)
        assert graph.core_graph == core
        rounds = 2 * len(core.phone_book(rank, world_size)) + 1
        for t in range(rounds):
            out_peers, in_peers = graph.get_peers(rotate=t > 0)
            # Process ranks: node * nprocs_per_node.
            assert out_peers == [q * m for q in core.out_peers(rank, world_size, t)]
            assert in_peers == [q * m for q in core.in_peers(rank, world_size, t)]
            assert graph.get_peers() == (out_peers, in_peers)  # no rotation: the same round


# SGP's phone books, as offsets from the node in SGP's order, and whether SGP rotates them.
SGP_BOOKS = {
    (sgp.NPeerDynamicDirectedExponentialGraph, 8, 1): [1, 2, 4],
    (sgp.NPeerDynamicDirectedExponentialGraph, 8, 2): [1, 2, 3, 6],
    (sgp.NPeerDynamicDirectedExponentialGraph, 4, 1): [1, 2],
    (sgp.NPeerDynamicDirectedExponentialGraph, 4, 2): [1, 2, 3],
    (sgp.DynamicDirectedExponentialGraph, 8, 1): [1, -1, 2, -2, 4],
    (sgp.DynamicDirectedExponentialGraph, 4, 1): [1, -1, 2],
    (sgp.DynamicDirectedLinearGraph, 8, 1): [1, -1, 3, -3],
    (sgp.DynamicDirectedLinearGraph, 4, 2): [1, -1],
    (sgp.RingGraph, 8, 1): [1, -1],  # static: SGP never rotates, so always +1
    (sgp.RingGraph, 4, 2): [1, -1],
    # Active (odd) nodes; passive (even) ones walk the same offsets with the opposite sign
    # here, so that every round pairs nodes symmetrically (SGP's walked the same sign).
    (sgp.DynamicBipartiteExponentialGraph, 8, 1): [1, -1, 3, -3],
    (sgp.DynamicBipartiteExponentialGraph, 4, 1): [1, -1],
    (sgp.DynamicBipartiteLinearGraph, 8, 2): [1, -1, 3, -3],
}


def _sgp_out_peers(cls, rank, world_size, peers_per_itr, t):
    offsets = SGP_BOOKS[(cls, world_size, peers_per_itr)]
    if cls in BIPARTITE and rank % 2 == 0:
        offsets = [-o for o in offsets]
    book = [(rank + o) % world_size for o in offsets]
    t = 0 if cls is sgp.RingGraph else t
    return [book[(g + t * peers_per_itr) % len(book)] for g in range(peers_per_itr)]


@pytest.mark.parametrize("cls, world_size, peers_per_itr", list(SGP_BOOKS))
def test_get_peers_walks_sgps_phone_books(cls, world_size, peers_per_itr):
    graphs = [cls(r, world_size, peers_per_itr=peers_per_itr) for r in range(world_size)]
    for t in range(2 * len(SGP_BOOKS[(cls, world_size, peers_per_itr)]) + 1):
        peers = [g.get_peers(rotate=t > 0) for g in graphs]
        for rank in range(world_size):
            out_peers, in_peers = peers[rank]
            assert out_peers == _sgp_out_peers(cls, rank, world_size, peers_per_itr, t), t
            # SGP's in-peers: by slot, then by rank.
            want = [
                s
                for g in range(peers_per_itr)
                for s in range(world_size)
                if _sgp_out_peers(cls, s, world_size, peers_per_itr, t)[g] == rank
            ]
            assert in_peers == want, (rank, t)
            if cls in BIPARTITE:
                assert sorted(out_peers) == sorted(in_peers)


def test_query_methods():
    for cls in CORE_GRAPHS:
        graph = cls(1, 4)
        assert graph.is_regular_graph()
        assert graph.is_bipartite_graph() == (cls in BIPARTITE)
        assert graph.is_dynamic_graph() == (cls is not sgp.RingGraph)
        assert not graph.is_passive()  # node 1 is active
        assert graph.is_passive(2) == (cls in BIPARTITE)


def test_setting_peers_per_itr_rebuilds_the_schedule_and_restarts_the_walk():
    graph = sgp.NPeerDynamicDirectedExponentialGraph(0, 8)
    assert graph.get_peers(rotate=True) == ([2], [6])
    graph.peers_per_itr = 2
    assert graph.peers_per_itr == 2
    assert graph.core_graph == gossip_ext.NPeerDynamicDirectedExponentialGraph(2)
    # SGP's p = 2 phone book (+1, +2, +3, +6) from its first slot.
    assert graph.get_peers() == ([1, 2], [7, 6])
    assert graph.get_peers(rotate=True) == ([3, 6], [5, 2])


def test_a_subclass_with_its_own_phone_book_becomes_a_custom_graph():
    class Skip(sgp.GraphManager):  # SGP-style: _make_graph() with _add_peers()
        def _make_graph(self):
            for r in range(self.world_size):
                self._add_peers(r, [self._rotate_forward(r, 2), self._rotate_backward(r, 2)])

    graph = Skip(1, 5)
    assert graph.core_graph == gossip_ext.CustomGraph([[2, 3], [3, 4], [4, 0], [0, 1], [1, 2]])
    assert graph.get_peers() == ([3], [4])
    assert graph.get_peers(rotate=True) == ([4], [3])


@pytest.mark.parametrize("peers_per_itr", [1, 2])
def test_uniform_mixing_weights(peers_per_itr):
    graph = sgp.DynamicDirectedExponentialGraph(3, 8, peers_per_itr=peers_per_itr)
    mixing = sgp.UniformMixing(graph, torch.device("cpu"))
    assert mixing.is_uniform() and mixing.is_regular()
    assert mixing.core_mixing == gossip_ext.UniformMixing()
    out_peers, _ = graph.get_peers()
    lo = torch.tensor([1.0 / (peers_per_itr + 1)])
    weights = mixing.get_mixing_weights()
    assert list(weights) == ["lo", "uniform", *out_peers]
    torch.testing.assert_close(weights["lo"], lo)
    for key in ["uniform", *out_peers]:  # relative to the kept share (residual-adjusted)
        torch.testing.assert_close(weights[key], torch.ones(1))
    plain = mixing.get_mixing_weights(residual_adjusted=False)
    for key in ["lo", "uniform", *out_peers]:
        torch.testing.assert_close(plain[key], lo)
        assert plain[key].device == torch.device("cpu")


def test_bad_graph_and_mixing_arguments():
    with pytest.raises(ValueError, match=r"rank must be < 4, got 4"):
        sgp.RingGraph(4, 4)
    with pytest.raises(ValueError, match=r"local_rank must be < 2, got 2"):
        sgp.RingGraph(0, 4, nprocs_per_node=2, local_rank=2)
    with pytest.raises(TypeError, match=r"world_size must be an int, got float 4.0"):
        sgp.RingGraph(0, 4.0)
    with pytest.raises(ValueError, match=r"peers_per_itr must be < world_size \(4\), got 4"):
        sgp.DynamicDirectedExponentialGraph(0, 4, peers_per_itr=4)
    with pytest.raises(ValueError, match=r"needs an even world size"):
        sgp.DynamicBipartiteLinearGraph(0, 5)
    graph = sgp.RingGraph(0, 4)
    with pytest.raises(ValueError, match=r"peers_per_itr must be 1 or 2, got 3"):
        graph.peers_per_itr = 3
    assert graph.peers_per_itr == 1  # unchanged
    with pytest.raises(TypeError, match=r"rotate must be a bool"):
        graph.get_peers(1)
    with pytest.raises(TypeError, match=r"graph must be a gossip_ext.compat.sgp graph"):
        sgp.UniformMixing(gossip_ext.RingGraph(), "cpu")
    with pytest.raises(NotImplementedError, match=r"_make_graph\(\)"):
        sgp.GraphManager(0, 4)
    with pytest.raises(TypeError, match=r"has no gossip_ext equivalent"):
        sgp.MixingManager(graph).core_mixing  # noqa: B018


# ----------------------------------------------------------------------------- the training loop

FEATURES, HIDDEN, CLASSES = 8, 16, 4
SAMPLES, BATCH = 64, 8  # 8 steps per epoch
EPOCHS = 4
PPI_SCHEDULE = {0: 1, 2: 2}  # the script's --peers_per_itr_schedule 0 1 2 2
SEED = 47  # the script's default --seed
SAVE_AFTER = 1  # the checkpoint written after this epoch is resumed from
MODES = ("sync", "overlap")  # gossip_sgd.py --overlap False / True
# 8*16 + 16 + 16*4 + 4 float32 parameters: the bytes one out-peer receives per round.
MODEL_BYTES = 4 * (FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def _teacher() -> torch.Tensor:
    return torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))


def _shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's data: inputs centred on a worker-specific point, labelled by one shared
    teacher, so that workers training alone drift apart."""
    g = torch.Generator().manual_seed(1000 + rank)
    centre = torch.randn(FEATURES, generator=g) * 2
    x = torch.randn(SAMPLES, FEATURES, generator=g) + centre
    return x, (x @ _teacher()).argmax(dim=1)


def _validation_set() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, FEATURES, generator=torch.Generator().manual_seed(99)) * 2
    return x, (x @ _teacher()).argmax(dim=1)


def _criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The script's: KL divergence to the one-hot target.
    kl_target = torch.zeros(target.shape[0], CLASSES).scatter_(1, target.view(-1, 1), 1)
    return nn.KLDivLoss(reduction="batchmean")(nn.LogSoftmax(dim=1)(output), kl_target)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # The script's defaults: --momentum 0.9 --weight_decay 1e-4 --nesterov False.
    return torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=False
    )


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _update_peers_per_itr(model, epoch: int) -> None:
    """As the script's: the entry of the schedule with the largest epoch not after ``epoch``."""
    ppi = PPI_SCHEDULE[max(e for e in PPI_SCHEDULE if e <= epoch)]
    model.update_gossiper("peers_per_itr", ppi)


def _train(model, module, optimizer, shard, epoch: int, gossip: str | None, log: dict) -> None:
    """The script's train(): forward, backward, step, and transfer_params() unless overlap."""
    model.train()
    x, y = shard
    # DistributedSampler.set_epoch(epoch + seed * 90): the same order on a resumed run.
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch + SEED * 90))
    for i in range(0, SAMPLES, BATCH):
        batch = order[i : i + BATCH]
        loss = _criterion(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if gossip == "sync":
            log["transferred"].append(model.transfer_params())
        log["params"].append(_flat(module))


def _validate(model) -> float:
    """The script's validate(): eval(), then top-1 accuracy without gradients."""
    model.eval()
    x, y = _validation_set()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item() * 100


def _run(rank: int, world_size: int, gossip: str | None, epochs, ckpt: str | None) -> dict:
    """The script's main() for one mode: gossip None trains every worker alone (no wrapper)."""
    torch.manual_seed(SEED)
    module = _model()
    model = module
    if gossip is not None:
        graph = sgp.NPeerDynamicDirectedExponentialGraph(
            rank, world_size, peers_per_itr=PPI_SCHEDULE[0]
        )
        model = sgp.GossipDataParallel(
            module,
            graph=graph,
            mixing=sgp.UniformMixing(graph, torch.device("cpu")),
            comm_device=torch.device("cpu"),
            push_sum=True,
            overlap=gossip == "overlap",
            synch_freq=0,
            verbose=False,
            use_streams=True,
        )
    optimizer = _optimizer(model)
    log = {"params": [], "transferred": [], "rounds": [], "accuracy": []}
    path = None if ckpt is None else os.path.join(ckpt, f"{gossip}-rank{rank}.pt")
    if gossip is not None and epochs[0] > 0:  # --resume True
        checkpoint = torch.load(path, weights_only=False)
        assert checkpoint["epoch"] == epochs[0]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    shard = _shard(rank)
    for epoch in epochs:
        if gossip is not None:
            _update_peers_per_itr(model, epoch)
            model.block()
        _train(model, module, optimizer, shard, epoch, gossip, log)
        state = None
        if gossip is not None:  # the script's update_state(): a deep copy, before validate()
            state = copy.deepcopy(
                {
                    "epoch": epoch + 1,
                    "state_dict": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                }
            )
        log["accuracy"].append(_validate(model))
        if gossip is not None:
            log["rounds"].append((model.gossip_round, model.bytes_sent, graph.peers_per_itr))
            if epoch == SAVE_AFTER and path is not None:
                torch.save(state, path)
    if gossip is None:
        distance = consensus.consensus_distance(
            list(module.parameters()), dist.group.WORLD, True, world_size, relative=True
        )
    else:
        distance = model.consensus_distance(relative=True)  # after eval(): nothing in flight
    log["consensus"] = distance
    log["final"] = _flat(module)
    return log


def _full_runs(rank: int, world_size: int, ckpt: str) -> dict:
    epochs = range(EPOCHS)
    results = {mode: _run(rank, world_size, mode, epochs, ckpt) for mode in MODES}
    results["alone"] = _run(rank, world_size, None, epochs, None)
    return results


def _resumed_runs(rank: int, world_size: int, ckpt: str) -> dict:
    return {
        mode: _run(rank, world_size, mode, range(SAVE_AFTER + 1, EPOCHS), ckpt) for mode in MODES
    }


WORLD_SIZE = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("sgp_checkpoints"))
    full = run_ranks(WORLD_SIZE, _full_runs, ckpt)
    # A new process group (new processes) resumes from the files, as --resume True does.
    resumed = run_ranks(WORLD_SIZE, _resumed_runs, ckpt)
    return {"full": full, "resumed": resumed, "ckpt": ckpt}


@pytest.mark.parametrize("mode", MODES)
def test_the_script_loop_gossips_and_reaches_consensus(runs, mode):
    full = [r[mode] for r in runs["full"]]
    steps = EPOCHS * SAMPLES // BATCH
    for log in full:
        # overlap: the forward starts every round, and the script never calls transfer_params.
        assert log["transferred"] == ([True] * steps if mode == "sync" else [])
        assert log["rounds"][-1][0] == steps
    distance = full[0]["consensus"]
    alone = runs["full"][0]["alone"]["consensus"]
    assert all(log["consensus"] == distance for log in full)
    # Measured (deterministic: one thread, a fixed summation order): relative consensus
    # distance 0.0171 (sync) and 0.0239 (overlap) after 32 steps of the script's loop at 4
    # workers, against 1.13 for the same loop with no gossip at all.
    assert distance < 0.05, distance
    assert distance < alone / 10, (distance, alone)


@pytest.mark.parametrize("mode", MODES)
def test_the_peers_schedule_changes_the_peers_used(runs, mode):
    per_epoch = SAMPLES // BATCH
    for log in (r[mode] for r in runs["full"]):
        previous_round, previous_bytes = 0, 0
        for epoch, (round_, sent, ppi) in enumerate(log["rounds"]):
            expected_ppi = 1 if epoch < 2 else 2
            assert ppi == expected_ppi  # update_gossiper() also moves the script's graph
            assert round_ - previous_round == per_epoch
            # One message per out-peer: the bytes of a round double at peers_per_itr=2.
            assert (sent - previous_bytes) == per_epoch * expected_ppi * MODEL_BYTES
            previous_round, previous_bytes = round_, sent


def test_the_checkpoint_is_sgps_format(runs):
    checkpoint = torch.load(os.path.join(runs["ckpt"], "sync-rank0.pt"), weights_only=False)
    state = checkpoint["state_dict"]
    assert set(state) == {"state_dict", "ps_weight", "is_ps_numerator"}
    assert state["is_ps_numerator"] is False
    assert torch.equal(state["ps_weight"], torch.ones(1, dtype=torch.float64))
    assert {"module.0.weight", "_extra_state"} <= set(state["state_dict"])


@pytest.mark.parametrize("mode", MODES)
def test_resuming_from_the_checkpoint_continues_the_run_exactly(runs, mode):
    start = (SAVE_AFTER + 1) * SAMPLES // BATCH
    for rank in range(WORLD_SIZE):
        full, resumed = runs["full"][rank][mode], runs["resumed"][rank][mode]
        assert len(resumed["params"]) == len(full["params"]) - start
        for step, (want, got) in enumerate(zip(full["params"][start:], resumed["params"])):
            assert torch.equal(got, want), (rank, start + step, (got - want).abs().max())
        assert torch.equal(resumed["final"], full["final"]), rank
        # The gossip round and peers_per_itr go on (bytes_sent counts this process's messages).
        rounds = [(r, ppi) for r, _, ppi in full["rounds"][SAVE_AFTER + 1 :]]
        assert [(r, ppi) for r, _, ppi in resumed["rounds"]] == rounds, rank
    # Not vacuous: the workers differ, and the steps move the parameters.
    full = [r[mode]["params"][start] for r in runs["full"]]
    assert not torch.equal(full[0], full[1])
    assert not torch.equal(runs["full"][0][mode]["params"][start - 1], full[0])


# ----------------------------------------------------------------------------- bad input


def _at_four(rank: int, world_size: int) -> dict:
    """Bad input, and the other cases that need no training loop: one 4-rank run."""

    def build(**kwargs):
        return sgp.GossipDataParallel(nn.Linear(2, 1), **kwargs)

    # Collectives, before any case: every rank creates every group.
    everyone = dist.new_group(list(range(world_size)))
    singles = [dist.new_group([r]) for r in range(world_size)]
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world_size // 2)]
    other = (rank + 1) % world_size
    node, other_node = rank // 2, (rank // 2 + 1) % 2
    errors = {
        "rank": error_of(lambda: build(rank=other)),
        "world_size": error_of(lambda: build(world_size=world_size + 1)),
        "graph_rank": error_of(lambda: build(graph=sgp.RingGraph(other, world_size))),
        "graph_world_size": error_of(lambda: build(graph=sgp.RingGraph(rank, 2 * world_size))),
        "graph_nprocs": error_of(
            lambda: build(graph=sgp.RingGraph(rank, world_size, nprocs_per_node=2, local_rank=1))
        ),
        "local_node_group": error_of(lambda: build(local_node_group=everyone)),
        "not_a_member": error_of(lambda: build(local_node_group=singles[other])),
        "mixing": error_of(lambda: build(mixing="uniform")),
        "other_node": error_of(
            lambda: build(nprocs_per_node=2, local_node_group=pairs[other_node])
        ),
    }
    # Accepted: the arguments that mean nothing here, and a node group that is this node's.
    model = build(
        device_ids=[torch.device("cpu")], use_streams=False, local_node_group=singles[rank]
    )
    errors["accepted_process_rank"] = (model.process_rank, model.local_rank)
    errors["attr"] = error_of(lambda: model.update_gossiper("passive", True))
    errors["ppi_too_large"] = error_of(lambda: model.update_gossiper("peers_per_itr", 4))
    errors["mix"] = error_of(lambda: model.transfer_params(mix=1))
    errors["finish_gossip"] = error_of(lambda: model.state_dict(finish_gossip=None))
    model.eval()
    errors["eval_transfer"] = model.transfer_params()  # SGP's eval() stops gossip
    model = build(overlap=True)
    errors["overlap_transfer"] = model.transfer_params()  # the forward starts rounds
    # Two nodes of two processes, with SGP's graph for the node and the node's own group.
    graph = sgp.RingGraph(node, world_size // 2, 2, rank % 2)
    model = build(graph=graph, nprocs_per_node=2, local_node_group=pairs[node])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    errors["node_transfers"] = []
    for _ in range(2):
        model(torch.full((1, 2), float(rank))).sum().backward()
        optimizer.step()
        errors["node_transfers"].append(model.transfer_params())
    model.eval()
    errors["node"] = (model.local_rank, model.gossip_round, graph.get_peers())
    # A checkpoint of SGP itself, its parameters saved as push-sum numerators x = w z.
    model = build()
    model.load_state_dict(
        {
            "state_dict": {"module.weight": torch.full((1, 2), 2.0), "module.bias": torch.ones(1)},
            "ps_weight": torch.tensor([0.5]),
            "is_ps_numerator": True,
        }
    )
    errors["sgp_checkpoint"] = [p.detach().clone() for p in model.module.parameters()]
    return errors


@pytest.fixture(scope="module")
def bad():
    results = run_ranks(4, _at_four)
    return {case: [r[case] for r in results] for case in results[0]}


def _assert_raised(errors: list, error_type: type, *fragments: str) -> None:
    for rank, got in enumerate(errors):
        assert got is not None, f"rank {rank} raised nothing"
        assert issubclass(got[0], error_type), f"rank {rank}: {got[0].__name__}: {got[1]}"
        for fragment in fragments:
            assert fragment in got[1], f"rank {rank}: {fragment!r} not in {got[1]!r}"


def test_rank_or_world_size_that_disagree_with_torch_distributed(bad):
    _assert_raised(bad["rank"], ValueError, "disagrees with torch.distributed")
    assert bad["rank"][0][1].startswith("rank=1 ")
    _assert_raised(bad["world_size"], ValueError, "world_size=5 disagrees")


def test_a_graph_built_for_another_process(bad):
    _assert_raised(bad["graph_rank"], ValueError, "graph=RingGraph(rank=", "another process")
    assert "RingGraph(0, 4, 1, 0, peers_per_itr=1)" in bad["graph_rank"][0][1]
    _assert_raised(bad["graph_world_size"], ValueError, "world_size=8", "world_size=4")
    _assert_raised(bad["graph_nprocs"], ValueError, "nprocs_per_node=2", "nprocs_per_node=1")


def test_a_local_node_group_that_is_not_this_node(bad):
    _assert_raised(bad["local_node_group"], ValueError, "must hold", "got [0, 1, 2, 3]")
    assert "this node's processes [1]" in bad["local_node_group"][1][1]
    for case in ("not_a_member", "other_node"):
        _assert_raised(bad[case], ValueError, "local_node_group must hold", "without this process")
    assert "this node's processes [2, 3] (nprocs_per_node=2" in bad["other_node"][2][1]


def test_a_mixing_without_equivalent(bad):
    _assert_raised(bad["mixing"], TypeError, "mixing must be", "'uniform'")


def test_accepted_arguments_and_calls_on_a_built_model(bad):
    assert bad["accepted_process_rank"] == [(r, 0) for r in range(4)]
    _assert_raised(bad["attr"], ValueError, "attr must be 'peers_per_itr'", "'passive'")
    _assert_raised(bad["ppi_too_large"], ValueError, "peers_per_itr must be < world_size (4)")
    _assert_raised(bad["mix"], TypeError, "mix must be a bool, got int 1")
    _assert_raised(bad["finish_gossip"], TypeError, "finish_gossip must be a bool")
    assert bad["eval_transfer"] == bad["overlap_transfer"] == [False] * 4


def test_several_processes_per_node(bad):
    # Only each node's first process gossips; peers are process ranks (node * nprocs_per_node).
    assert bad["node_transfers"] == [[True, True], [False, False]] * 2
    assert bad["node"] == [
        (0, 2, ([2], [2])),
        (1, 0, ([2], [2])),
        (0, 2, ([0], [0])),
        (1, 0, ([0], [0])),
    ]


def test_loading_a_checkpoint_of_sgp_itself(bad):
    for weight, bias in bad["sgp_checkpoint"]:
        assert torch.equal(weight, torch.full((1, 2), 4.0))  # de-biased: x / w
        assert torch.equal(bias, torch.full((1,), 2.0))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device_ids": [0, 1]}, ValueError, r"device_ids must be .* one process per GPU"),
        ({"device_ids": [0]}, ValueError, r"device_ids=\[0\] names cuda:0, but .* on cpu"),
        ({"device_ids": "cpu"}, TypeError, r"device_ids must be None or a list"),
        ({"use_streams": "yes"}, TypeError, r"use_streams must be a bool, got str 'yes'"),
        ({"graph": "ring"}, TypeError, r"graph must be .* got str 'ring'"),
        ({"mixing": gossip_ext.RingGraph()}, TypeError, r"mixing must be .* got RingGraph"),
        ({}, RuntimeError, r"init_process_group\(\) first"),
    ],
)
def test_arguments_checked_before_torch_distributed(kwargs, error, match):
    assert not dist.is_initialized()
    with pytest.raises(error, match=match):
        sgp.GossipDataParallel(nn.Linear(2, 1), **kwargs)
