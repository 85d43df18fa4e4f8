"""gossip_ext's DiLoCo against torchft's (torchft.local_sgd.DiLoCo 0.2.0) on CPU over gloo: the
same model, data, seeds, H, inner AdamW and outer SGD-Nesterov give the same parameters after
three outer steps (the test command installs torchft; the test starts its lighthouse)."""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

pytest.importorskip(
    "torchft", reason="torchft is installed by the test command (tools/run_tests.sh)"
)

H = 3
STEPS = 3 * H
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _inner(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _gossip_ext(rank: int, world_size: int) -> list[torch.Tensor]:
    model = gossip_ext.GossipDataParallel(
        _net(),
        base_algorithm="localsgd",
        sync_every=H,
        outer_optimizer=lambda params: torch.optim.SGD(params, **OUTER),
    )
    opt = _inner(model.parameters())
    model.register_optimizer(opt)
    _train(model, opt, rank)
    return [p.detach().clone() for p in model.module.parameters()]


def _torchft(rank: int, world_size: int, lighthouse: str) -> list[torch.Tensor]:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    module = _net()
    opt = _inner(module.parameters())
    timeout = timedelta(seconds=60)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: module.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": module.state_dict()},
        min_replica_size=world_size,
        use_async_quorum=False,
        replica_id=f"replica_{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        init_sync=False,  # the same seed everywhere: nothing to heal at step 0
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    outer = torch.optim.SGD(module.parameters(), **OUTER)
    try:
        with DiLoCo(manager, [module], opt, outer, sync_every=H):
            _train(module, opt, rank)
    finally:
        manager.shutdown(wait=False)
    return [p.detach().clone() for p in module.parameters()]


def test_three_outer_steps_give_torchfts_parameters():
    from harness.compare import runner

    world_size = 2
    os.environ.setdefault("RUST_LOG", "warn")
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(runner.lighthouse(world_size))
        theirs = run_ranks(world_size, _torchft, address)
    ours = run_ranks(world_size, _gossip_ext)
    alone = _net()
    for rank in range(world_size):
        for got, want, start in zip(ours[rank], theirs[rank], alone.parameters()):
            assert not torch.allclose(want, start, atol=1e-3), "training must move the parameters"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Every worker ends its last period on theta_global, the same model everywhere.
    for got, want in zip(ours[0], ours[1]):
        assert torch.equal(got, want)
