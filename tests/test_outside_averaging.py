"""A way to average written outside the package, as a user writes one: a coordinate-wise median
of the workers' pseudo-gradients (robust to one worker's outlier), trained on 3 gloo processes
with DiLoCo and checked against DiLoCo with that median written out in plain PyTorch. Nothing in
gossip_ext knows of it: it is an OuterAverage that builds an Averaging."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import gossip_ext
from gossip_ext.averagings import Averaging, Contribution, PseudoGradientMean
from gossip_ext.averagings.failures import wait_for_every_worker

H, STEPS, LR = 3, 10, 0.05


class MedianMean(Averaging):
    """Every worker gathers every worker's pseudo-gradient and takes the median of each
    coordinate: the same bits on every worker, so every theta_global stays one."""

    def __init__(self, group, timeout):
        self.group, self.timeout = group, timeout

    def start(self, contribution: Contribution):
        world_size = dist.get_world_size(self.group)
        pending = []
        for d in contribution.pseudo_gradients():
            gathered = torch.empty(world_size * d.numel(), dtype=d.dtype)
            work = dist.all_gather_into_tensor(gathered, d, group=self.group, async_op=True)
            pending.append((gathered, work, world_size))
        return pending

    def finish(self, pending) -> PseudoGradientMean:
        wait_for_every_worker([w for _, w, _ in pending], "the median", self.group, self.timeout)
        return PseudoGradientMean([g.view(n, -1).median(dim=0).values for g, _, n in pending])


@dataclasses.dataclass(frozen=True)
class ByMedian(gossip_ext.OuterAverage):
    def averaging(self, buckets, group, *, streamed, graph, mixing, timeout) -> Averaging:
        return MedianMean(group, timeout)


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True) * (1 + rank)  # the workers' data disagree


def _train(rank: int, world_size: int) -> list[torch.Tensor]:
    model = gossip_ext.GossipDataParallel(
        _net(), gossip=None, outer=gossip_ext.DiLoCo(_outer_sgd, every=H, average=ByMedian())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.register_optimizer(optimizer)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.module.parameters()]


def _median(deltas: torch.Tensor) -> torch.Tensor:
    return deltas.median(dim=0).values


def _mean(deltas: torch.Tensor) -> torch.Tensor:
    return deltas.mean(dim=0)


def _reference(world_size: int, reduce=_median) -> list[list[torch.Tensor]]:
    """DiLoCo with ``reduce`` over the workers, in plain PyTorch: a copy of the model per
    worker."""
    workers = [_net() for _ in range(world_size)]
    inner = [torch.optim.SGD(w.parameters(), lr=LR) for w in workers]
    theta = [p.detach().clone() for p in workers[0].parameters()]
    outer = _outer_sgd(theta)
    for step in range(STEPS):
        for rank, (w, opt) in enumerate(zip(workers, inner)):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(w(x), y).backward()
            opt.step()
        if (step + 1) % H == 0:
            with torch.no_grad():
                for i, t in enumerate(theta):
                    deltas = torch.stack([t - list(w.parameters())[i] for w in workers])
                    t.grad = reduce(deltas)
                outer.step()
                for w in workers:
                    for p, t in zip(w.parameters(), theta):
                        p.copy_(t)
    return [[p.detach() for p in w.parameters()] for w in workers]


def test_a_median_written_outside_the_package_trains_as_its_reference():
    found = run_ranks(3, _train)
    expected = _reference(3)
    for rank in range(3):
        for p, q in zip(found[rank], expected[rank]):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    # The median is not the mean here: the test would notice the library averaging its own way.
    by_mean = _reference(3, _mean)
    assert not torch.allclose(found[0][0], by_mean[0][0], rtol=1e-6, atol=1e-6)
