"""What the GPU tests that train share: their marks (skipped, visibly, without a GPU), the small
regression task they train on CUDA and on CPU parameters alike, and the comparison of the two
runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def needs_gpu(what: str) -> list:
    """The marks of a test file of ``what`` needs a GPU for."""
    return [
        pytest.mark.extension,
        pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU ({what})"),
    ]


def net(device: str) -> nn.Module:
    """The task's model, the same on every rank and device."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)


def train(
    model, rank: int, device: str, steps: int, transfer: bool = False, seed: int | None = None
) -> None:
    """``steps`` of SGD on ``model`` (a GossipDataParallel), on ``rank``'s own batches (drawn
    from ``seed``, default ``rank``);
    ``transfer``: the wrapper's round after each step (``transfer_params``), else the
    optimizer's hook (``register_optimizer``)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if not transfer:
        model.register_optimizer(opt)
    generator = torch.Generator().manual_seed(rank if seed is None else seed)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if transfer:
            model.transfer_params()


def assert_runs_agree(on_gpu: list[dict], on_cpu: list[dict], rtol: float, atol: float) -> None:
    """Every rank's ``params`` alike in both runs, within ``rtol`` and ``atol``."""
    for rank, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu)):
        for got, want in zip(gpu["params"], cpu["params"]):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=f"rank {rank}")
