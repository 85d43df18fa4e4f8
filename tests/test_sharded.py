"""Sharded replicas (gossip_ext.sharded.replicas): 2 replicas x 2 shards, each replica's module
sharded by FSDP2 over its shard mesh, gossip or outer steps between the replicas' processes of the
same shard; real processes over gloo.

Two references, each in float64:
- the simulator of tests/training_reference.py (written from docs/design.md, independently of
  the engine), replaying synchronous and overlap SGP on two nodes whose gradient is a replica's:
  FSDP2 averages its processes' gradients, so a replica steps with the mean of its two batches'
  gradients;
- the same algorithm through gossip_ext on 2 unsharded replicas x 1 process, each on both of its
  shards' batches (one batch of twice the size, whose mean loss has that mean gradient), for
  every algorithm: SGP, overlap SGP, D-PSGD, LocalSGD, SlowMo, DiLoCo averaged exactly (in full
  precision and in int8 messages) and by gossip, Streaming DiLoCo.
Equal to float64 rounding: sharding changes where each value is computed, not the algorithm.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import error_of, run_ranks
from torch import nn
from training_reference import overlap_events, replay, synchronous_events

import gossip_ext

REPLICAS, SHARDS = 2, 2
STEPS = 7
LR = 0.05
BATCH = 3
# Float64 on both sides: what differs is the order of a few sums (FSDP2's reduce-scatter).
TOLERANCE = {"rtol": 1e-11, "atol": 1e-12}


def _net() -> nn.Module:
    torch.manual_seed(0)
    # The first layer's 1 x 6 weight and its bias are sharded unevenly: the second shard holds
    # nothing of them. Its shards' bytes are then in other proportions than the whole
    # parameters': Streaming DiLoCo must still cut its fragments where the whole model's are.
    return nn.Sequential(nn.Linear(6, 1), nn.Tanh(), nn.Linear(1, 6)).double()


def _batch(replica: int, shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica + shard)
    x = torch.randn(BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, 6, generator=g, dtype=torch.float64)


def _replica_batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both shards' batches: one batch whose mean loss has the replica's gradient."""
    xs, ys = zip(*(_batch(replica, s, step) for s in range(SHARDS)))
    return torch.cat(xs), torch.cat(ys)


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


ALGORITHMS = {
    "sgp": lambda: {"gossip": gossip_ext.SGP()},
    "overlap_sgp": lambda: {"gossip": gossip_ext.SGP(overlap=True)},
    "diloco": lambda: {"gossip": None, "outer": gossip_ext.DiLoCo(_outer_sgd, every=3)},
    "diloco_by_gossip": lambda: {
        "gossip": None,
        "outer": gossip_ext.DiLoCo(_outer_sgd, every=3, average=gossip_ext.ByGossip()),
    },
    "localsgd": lambda: {"gossip": None, "outer": gossip_ext.Average(every=3)},
    "slowmo": lambda: {"outer": gossip_ext.SlowMo(every=3, momentum=0.5)},
    "diloco_int8": lambda: {
        "gossip": None,
        "outer": gossip_ext.DiLoCo(_outer_sgd, every=3, average=gossip_ext.Exact(dtype="int8")),
    },
    "push_pull": lambda: {"gossip": gossip_ext.PushPull(graph=gossip_ext.RingGraph())},
    "streaming_diloco": lambda: {
        "gossip": None,
        "outer": gossip_ext.DiLoCo(_outer_sgd, every=4, fragments=2, delay=1),
    },
}


def _train(model: gossip_ext.GossipDataParallel, batch_of) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(opt)
    for step in range(STEPS):
        x, y = batch_of(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()  # a forward outside training sees every round: absorb the last one
    model(torch.zeros(1, 6, dtype=torch.float64))


def _replica_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def _sharded(mesh, rank: int, algorithm: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    replica, shard = divmod(rank, SHARDS)
    net = _net()
    init = [p.detach().clone() for p in net.parameters()]
    fully_shard(net, mesh=mesh["shard"])
    model = gossip_ext.GossipDataParallel(
        net, process_group=mesh["replicate"].get_group(), **ALGORITHMS[algorithm]()
    )
    _train(model, lambda step: _batch(replica, shard, step))
    net.reshard()
    return {
        "distance": model.consensus_distance(),
        "relative": model.consensus_distance(relative=True),
        "init": init,
        "final": [p.full_tensor().detach().clone() for p in net.parameters()],
        "round": model.gossip_round,
    }


def _sharded_job(rank: int, world_size: int) -> dict:
    """One set of 2 x 2 processes for every algorithm's training and every checkpoint's resume,
    one model after the other on the same mesh (each model's rounds are over when the next is
    built)."""
    mesh = _replica_mesh()
    return {
        "trained": {a: _sharded(mesh, rank, a) for a in ALGORITHMS},
        "resumed": {a: _resumed(mesh, rank, a) for a in RESUMED},
    }


def _unsharded(rank: int, world_size: int) -> dict:
    results = {}
    for algorithm in ALGORITHMS:
        model = gossip_ext.GossipDataParallel(_net(), **ALGORITHMS[algorithm]())
        _train(model, lambda step: _replica_batch(rank, step))
        results[algorithm] = {
            "distance": model.consensus_distance(),
            "relative": model.consensus_distance(relative=True),
            "final": [p.detach().clone() for p in model.module.parameters()],
        }
    return results


@pytest.fixture(scope="module")
def unsharded():
    """Every algorithm on 2 unsharded replicas, by algorithm and replica."""
    per_rank = run_ranks(REPLICAS, _unsharded)
    return {a: [per_rank[r][a] for r in range(REPLICAS)] for a in ALGORITHMS}


@pytest.fixture(scope="module")
def sharded():
    """Every algorithm's and every checkpoint's run on 2 x 2 processes, by rank."""
    return run_ranks(REPLICAS * SHARDS, _sharded_job)


# int8 messages quantize blocks of 128 values of the flat pseudo-gradient with one scale each: a
# shard's blocks hold other values than the whole model's, so the rounding differs. Error
# feedback keeps each worker within about a message's rounding of the full-precision step.
QUANTIZED_TOLERANCE = {"rtol": 0.0, "atol": 2e-3}


def _assert_equal(got, want, what: str, tolerance=TOLERANCE) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"{what}: {m}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_sharded_replicas_train_as_unsharded_ones(algorithm, unsharded, sharded):
    for rank, ranks_runs in enumerate(sharded):
        result = ranks_runs["trained"][algorithm]
        replica = rank // SHARDS
        want = unsharded[algorithm][replica]
        tolerance = QUANTIZED_TOLERANCE if algorithm == "diloco_int8" else TOLERANCE
        _assert_equal(result["final"], want["final"], f"{algorithm}, rank {rank}", tolerance)
        if algorithm == "diloco_int8":
            # The int8 messages really round: the unsharded run differs from full precision.
            exact = unsharded["diloco"][replica]["final"]
            assert max((a - b).abs().max().item() for a, b in zip(want["final"], exact)) > 0
        # The whole model's distance between replicas, from the shards' parts (DiLoCo's
        # replicas are a step past their outer step, apart).
        assert "diloco" not in algorithm or want["distance"] > 1e-6
        for kind in ("distance", "relative"):
            rel = 0.05 if algorithm == "diloco_int8" else 1e-9
            assert result[kind] == pytest.approx(want[kind], rel=rel, abs=1e-15), kind


@pytest.mark.parametrize(
    "algorithm, events", [("sgp", synchronous_events), ("overlap_sgp", overlap_events)]
)
def test_sharded_sgp_matches_the_simulator(algorithm, events, sharded):
    per_rank = [ranks_runs["trained"][algorithm] for ranks_runs in sharded]

    def grad_fn(replica, z):
        net = _net()
        with torch.no_grad():
            for p, t in zip(net.parameters(), z):
                p.copy_(t)
        x, y = _replica_batch(replica, step_of[replica])
        step_of[replica] += 1
        nn.functional.mse_loss(net(x), y).backward()
        return [p.grad for p in net.parameters()]

    step_of = [0] * REPLICAS
    expected = replay(
        init=[per_rank[0]["init"]] * REPLICAS,
        grad_fn=grad_fn,
        lr=LR,
        events=[events(STEPS)] * REPLICAS,
        out_peers=lambda i, r: [1 - i],
    )
    for rank, result in enumerate(per_rank):
        assert result["round"] == STEPS
        _assert_equal(result["final"], expected[rank // SHARDS], f"{algorithm}, rank {rank}")


# ----------------------------------------------------------------------------- bad layouts


def _misuse(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    net = _net()
    fully_shard(net, mesh=mesh["shard"])
    replicas = mesh["replicate"].get_group()
    wrap = gossip_ext.GossipDataParallel
    return {
        "no_group": error_of(lambda: wrap(net)),
        "shard_group": error_of(lambda: wrap(net, process_group=mesh["shard"].get_group())),
        "world": error_of(lambda: wrap(net, process_group=dist.group.WORLD)),
        # In an elastic job the epochs build the replica groups (tests/test_sharded_elastic.py).
        "elastic": error_of(lambda: wrap(net, membership="127.0.0.1:1", process_group=replicas)),
        "hierarchy": error_of(lambda: wrap(net, nprocs_per_node=2, process_group=replicas)),
    }


def _misuses_then_a_failed_round(rank: int, world_size: int) -> dict:
    """The wrong layouts, then a round that fails: one set of processes, the failure last."""
    mesh = _replica_mesh()
    return {"misuse": _misuse(mesh), "failed_round": _failed_round(mesh, rank)}


@pytest.fixture(scope="module")
def misuses_then_a_failed_round():
    return run_ranks(REPLICAS * SHARDS, _misuses_then_a_failed_round)


def test_a_sharded_module_with_a_wrong_layout_raises_naming_it(misuses_then_a_failed_round):
    for ranks_run in misuses_then_a_failed_round:
        errors = ranks_run["misuse"]
        assert errors["no_group"][0] is ValueError
        assert 'mesh["replicate"].get_group()' in errors["no_group"][1]
        for case in ("shard_group", "world"):
            assert errors[case][0] is ValueError, errors[case]
            assert "must hold one process per replica" in errors[case][1], errors[case]
        assert errors["elastic"][0] is ValueError, errors["elastic"]
        assert "process_group" in errors["elastic"][1], errors["elastic"]
        assert (
            errors["hierarchy"][0] is ValueError and "nprocs_per_node=2" in errors["hierarchy"][1]
        )


# ----------------------------------------------------------------------------- failures


def _failed_round(mesh, rank: int) -> dict:
    """Replica 1's second process (rank 3) poisons its shard and sends it: replica 0's second
    process (rank 1) refuses the message. Its shards must stay what they were, the error raised
    again on every call; the sender learns that its own parameters diverged."""
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    replica, shard = divmod(rank, SHARDS)
    net = _net()
    fully_shard(net, mesh=mesh["shard"])
    model = gossip_ext.GossipDataParallel(
        net, process_group=mesh["replicate"].get_group(), timeout=timedelta(seconds=2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(opt)
    shards = [t for _, t in gossip_ext.sharded.replicas.local_shards(net)]
    result = {}
    for step in range(2):
        x, y = _batch(replica, shard, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == 1 and rank == 3:
            with torch.no_grad():
                shards[2].fill_(float("nan"))  # the last weight: half of it on every shard
            opt.step()
            result["poisoned"] = error_of(model.sync_comms)
            return result
        opt.step()
    if rank == 1:
        before = [t.clone() for t in shards]
        x, _ = _batch(replica, shard, 2)
        result["absorb"] = error_of(model.sync_comms)
        result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, shards))
        result["again"] = error_of(lambda: model(x))  # raised before FSDP2 gathers anything
        result["again_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, shards))
    return result


def test_a_failed_round_leaves_the_shards_as_they_were_and_stays_raised(
    misuses_then_a_failed_round,
):
    per_rank = [ranks_run["failed_round"] for ranks_run in misuses_then_a_failed_round]
    kind, message = per_rank[3]["poisoned"]
    assert kind is gossip_ext.NonFiniteError, message
    # Named by its rank in the replica group: replica 1's.
    kind, message = per_rank[1]["absorb"]
    assert kind is gossip_ext.NonFiniteError and "from peers [1]" in message, message
    assert per_rank[1]["unchanged"] and per_rank[1]["again_unchanged"]
    assert per_rank[1]["again"][0] is kind


# ----------------------------------------------------------------------------- checkpoints


RESUMED = ["sgp", "diloco", "streaming_diloco"]


def _resumed(mesh, rank: int, algorithm: str) -> dict:
    """Trains STEPS steps straight, and again from a checkpoint saved after 3 of them (every
    process its own file, as torch.save of the wrapper's state_dict: its shards, the push-sum
    state, the outer state) into a freshly built model."""
    import io

    from torch.distributed.fsdp import fully_shard

    replica, shard = divmod(rank, SHARDS)

    def build():
        net = _net()
        fully_shard(net, mesh=mesh["shard"])
        model = gossip_ext.GossipDataParallel(
            net, process_group=mesh["replicate"].get_group(), **ALGORITHMS[algorithm]()
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model.register_optimizer(opt)
        return net, model, opt

    def steps(model, opt, first, last):
        for step in range(first, last):
            x, y = _batch(replica, shard, step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.sync_comms()

    net, model, opt = build()
    steps(model, opt, 0, 3)
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    steps(model, opt, 3, STEPS)
    straight = [t.clone() for _, t in gossip_ext.sharded.replicas.local_shards(net)]
    del model, opt

    net, model, opt = build()
    saved.seek(0)
    model.load_state_dict(torch.load(saved, weights_only=False))
    steps(model, opt, 3, STEPS)
    resumed = [t.clone() for _, t in gossip_ext.sharded.replicas.local_shards(net)]
    return {"equal": all(torch.equal(a, b) for a, b in zip(straight, resumed))}


@pytest.mark.parametrize("algorithm", RESUMED)
def test_a_sharded_checkpoint_resumes_bit_for_bit(algorithm, sharded):
    assert all(ranks_runs["resumed"][algorithm]["equal"] for ranks_runs in sharded)
