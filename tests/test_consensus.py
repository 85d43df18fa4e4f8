"""Consensus distance: the exact, collective consensus_distance() against the definition computed
here from every rank's parameters, and the running estimate of log_every against the exact
value, on real processes over gloo."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext._torch_check import _C

D = 8


def _snapshot(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _set_distinct(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))


def _definition(values: list[list[torch.Tensor]]) -> tuple[float, float]:
    """sqrt(mean_i ||z_i - z_mean||^2) and that over ||z_mean||, in float64."""
    z = torch.stack([torch.cat([t.double().reshape(-1) for t in v]) for v in values])
    mean = z.mean(0)
    distance = (z - mean).square().sum(1).mean().sqrt().item()
    return distance, distance / mean.norm().item()


class _TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, D))
        self.bias = nn.Parameter(torch.zeros(3, dtype=torch.float64))


# ----------------------------------------------------------------------------- exact


def _exact(rank: int, world_size: int) -> dict:
    out = {}
    for mode, kwargs in (("flat", {}), ("hierarchical", {"nprocs_per_node": 2})):
        module = _TwoDtypes()
        model = gossip_ext.GossipDataParallel(module, **kwargs)
        # Every process its own values, non-gossiping ones included: they must not count.
        _set_distinct(module, seed=rank)
        out[mode] = {
            "values": _snapshot(module),
            "leader": model.is_gossip_leader,
            "distance": model.consensus_distance(),
            "relative": model.consensus_distance(relative=True),
        }
        model.average_parameters()
        out[mode]["after_average"] = model.consensus_distance()
    return out


def test_consensus_distance_is_the_rms_distance_to_the_mean_of_the_gossiping_workers():
    per_rank = run_ranks(4, _exact)
    for mode in ("flat", "hierarchical"):
        results = [r[mode] for r in per_rank]
        leaders = [r["values"] for r in results if r["leader"]]
        assert len(leaders) == (4 if mode == "flat" else 2)
        distance, relative = _definition(leaders)
        assert distance > 1.0
        for r in results:
            assert r["distance"] == pytest.approx(distance, rel=1e-12)
            assert r["relative"] == pytest.approx(relative, rel=1e-12)
            # Identical float32 models give exactly 0 (the metric sums in float64).
            assert r["after_average"] == 0.0


def _train(rank: int, kwargs: dict, measure: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    model = gossip_ext.GossipDataParallel(module, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, D), float(rank + 1))
    for _ in range(5):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        model.transfer_params()
        if measure:
            model.consensus_distance()
    model.sync_comms()
    return _snapshot(module)


def _with_and_without_measuring(rank: int, world_size: int) -> dict:
    # Bounded asynchrony is left out: which forward absorbs a round depends on timing there, so
    # two runs differ whatever they measure (consensus_distance() never absorbs in that mode).
    kinds = {"sync": {}, "overlap": {"overlap": True}}
    return {
        mode: (_train(rank, kwargs, measure=False), _train(rank, kwargs, measure=True))
        for mode, kwargs in kinds.items()
    }


def test_measuring_the_consensus_distance_does_not_change_the_training():
    for r in run_ranks(3, _with_and_without_measuring):
        for mode, (plain, measured) in r.items():
            assert all(torch.equal(a, b) for a, b in zip(plain, measured)), mode


# ----------------------------------------------------------------------------- running estimate

LOG_EVERY = 2


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _estimate_on_two(rank: int, world_size: int) -> dict:
    records = _Records()
    # The estimate's own logger (the package's other INFO lines, as the first line a wrapper
    # logs at rank 0, are not this test's).
    logging.getLogger("gossip_ext.gossip.consensus").addHandler(records)
    logging.getLogger("gossip_ext").setLevel(logging.INFO)
    torch.manual_seed(0)
    module = nn.Linear(D, 1).double()
    model = gossip_ext.GossipDataParallel(module, log_every=LOG_EVERY)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    exact, estimates = [], []
    for _ in range(8):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        exact.append(model.consensus_distance())  # before this step's round
        model.transfer_params()
        model(x)  # absorbs the round: an armed one is measured
        estimates.append(model.consensus_estimate)
    model.sync_comms()

    off = gossip_ext.GossipDataParallel(nn.Linear(D, 1), log_every=0)
    before_off = len(records.messages)
    off(x.float()).sum().backward()
    off.transfer_params()
    off.sync_comms()
    return {
        "exact": exact,
        "estimates": estimates,
        "messages": records.messages[:before_off],
        "off_messages": records.messages[before_off:],
        "off_estimate": off.consensus_estimate,
        # log_every=0 leaves the compiled engine bare: nothing on the hot path.
        "off_engine_is_bare": type(off.runtime.mix.engine) is _C.GossipEngine,
    }


def test_the_estimate_equals_the_exact_distance_on_two_workers_and_is_logged():
    # Two workers with weights 1/2: absorbing moves each by half the gap, which is exactly the
    # distance of each to the mean.
    for rank, r in enumerate(run_ranks(2, _estimate_on_two)):
        for step, (exact, estimate) in enumerate(zip(r["exact"], r["estimates"]), start=1):
            if step < LOG_EVERY:
                assert estimate is None
            if step % LOG_EVERY == 0:  # measured at the absorb of this step's round
                assert exact > 1e-3
                assert estimate == pytest.approx(exact, rel=1e-9), (rank, step)
        assert len(r["messages"]) == 8 // LOG_EVERY
        assert all(f"rank {rank}, step " in m for m in r["messages"])
        assert all("consensus distance estimate" in m for m in r["messages"])
        assert r["off_messages"] == [] and r["off_estimate"] is None
        assert r["off_engine_is_bare"]


STEPS = 30


def _pure_gossip(rank: int, world_size: int) -> dict:
    out = {}
    for name, graph in (("exponential", None), ("ring", gossip_ext.RingGraph())):
        torch.manual_seed(0)
        module = nn.Linear(D, 4).double()
        model = gossip_ext.GossipDataParallel(module, graph=graph, log_every=1)
        _set_distinct(module, seed=rank)  # workers start far apart
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x = torch.ones(1, D, dtype=torch.float64)
        exact, estimates = [], []
        for _ in range(STEPS):
            model(x).sum().backward()
            opt.step()
            exact.append(model.consensus_distance())
            model.transfer_params()
            model(x)
            estimates.append(model.consensus_estimate)
        model.sync_comms()
        out[name] = {"exact": exact, "estimates": estimates}
    return out


def test_the_estimate_tracks_the_exact_distance_under_pure_gossip():
    world_size = 8
    per_rank = run_ranks(world_size, _pure_gossip)
    for name in ("exponential", "ring"):
        exact = per_rank[0][name]["exact"]
        # The root mean square over workers is what the estimate's scale makes unbiased.
        rms = [
            math.sqrt(sum(r[name]["estimates"][s] ** 2 for r in per_rank) / world_size)
            for s in range(STEPS)
        ]
        assert exact[0] > 1.0 and rms[0] > 1.0  # large when the workers start apart
        # Within a factor of 2 on the default exponential graph. A ring mixes slowly: neighbours
        # agree more than random workers do, and the local estimate reads low (by about half on a
        # ring of 8), as MeasuredEngine documents.
        low = 0.5 if name == "exponential" else 0.4
        for e, est in zip(exact, rms):
            if e > 1e-9:
                assert low < est / e < 2.0, (name, exact, rms)
        if name == "exponential":
            # One peer per round on 8 workers: exact consensus after log2(8) = 3 rounds.
            assert all(e < 1e-12 for e in exact[3:]) and all(v < 1e-12 for v in rms[3:])
        else:
            # A ring contracts geometrically: both fall by orders of magnitude.
            assert exact[-1] < exact[0] / 10 and rms[-1] < rms[0] / 10
            assert all(b < a for a, b in zip(rms, rms[1:]))
