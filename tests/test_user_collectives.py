"""A user's own collectives beside gossip_ext, as training scripts run them: a barrier and an
all_reduce on the default group right after the wrappers are built, between steps, after a pause
longer than the wrapper's timeout (every worker in the user's barrier or evaluating, so nobody
sends) and after ``average_parameters()``, under every mode, on 4 real processes over gloo.

Each must return within a second and leave the group whole, and every engine must train on after
the pause without naming a peer: no asynchronous message is due while nobody steps (Note [Silence
is measured while this worker trains] in csrc/transport/mailbox/mailbox.h), and the asynchronous
engines' receives move on a group of their own (``gossip.groups.messages_group``)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import gossip_ext

TIMEOUT = timedelta(seconds=2)
PAUSE_S = 1.5 * TIMEOUT.total_seconds()  # longer than the timeout: a silence, were it counted
PROMPT_S = 1.0  # what a collective may take once every rank is in it

MODES = {
    "sgp": lambda: {"gossip": gossip_ext.SGP()},
    "overlap_sgp": lambda: {"gossip": gossip_ext.SGP(overlap=True)},
    "bounded_sgp": lambda: {"gossip": gossip_ext.SGP(synch_freq=2)},
    "push_pull": lambda: {
        "gossip": gossip_ext.PushPull(graph=gossip_ext.DynamicBipartiteExponentialGraph())
    },
    "async_sgp": lambda: {"gossip": gossip_ext.AsyncSGP()},
    "bounded_async_sgp": lambda: {"gossip": gossip_ext.AsyncSGP(staleness=1)},
    "localsgd": lambda: {"gossip": None, "outer": gossip_ext.Average(every=2)},
    "streaming_diloco": lambda: {
        "gossip": None,
        "outer": gossip_ext.DiLoCo(
            lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9), every=2, fragments=2
        ),
    },
    "async_diloco": lambda: {"gossip": None, "outer": gossip_ext.AsyncDiLoCo(every=2)},
}


def _step(rank: int, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _collectives_around_steps(rank, world_size):
    models = {}
    for name, kwargs in MODES.items():
        torch.manual_seed(0)
        model = gossip_ext.GossipDataParallel(nn.Linear(8, 2), timeout=TIMEOUT, **kwargs())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model.register_optimizer(opt)
        models[name] = (model, opt)
    seconds: dict[str, tuple[float, float, float]] = {}

    def collectives(when: str) -> None:
        began = time.monotonic()
        dist.barrier()
        barrier = time.monotonic() - began
        total = torch.tensor([float(rank)])
        began = time.monotonic()
        dist.all_reduce(total)
        seconds[when] = (barrier, time.monotonic() - began, float(total))

    def steps(first: int, count: int) -> None:
        for step in range(first, first + count):
            for model, opt in models.values():
                _step(rank, step, model, opt)

    collectives("right after construction")
    time.sleep(PAUSE_S)  # every worker away: nobody steps, nobody sends
    collectives("after a pause past the timeout")
    for block in range(3):
        steps(2 * block, 2)
        collectives(f"between steps ({block})")
    time.sleep(PAUSE_S)
    collectives("between steps, after a pause past the timeout")
    steps(6, 4)  # every engine trains on after the pause, naming no peer
    for model, _ in models.values():
        model.average_parameters()  # settles the asynchronous modes, then the exact mean
    collectives("after average_parameters")
    finals = {
        name: torch.cat([p.detach().flatten() for p in model.module.parameters()])
        for name, (model, _) in models.items()
    }
    return seconds, finals


@pytest.mark.slow("nine modes on 4 ranks, with two pauses past the timeout in which nobody steps")
def test_a_users_barrier_and_all_reduce_return_promptly_under_every_mode_and_after_pauses():
    results = run_ranks(4, _collectives_around_steps)
    for rank, (seconds, _) in enumerate(results):
        for when, (barrier, all_reduce, total) in seconds.items():
            assert total == 0.0 + 1.0 + 2.0 + 3.0, (rank, when, total)
            assert barrier < PROMPT_S, f"rank {rank}: the barrier {when} took {barrier:.2f} s"
            assert all_reduce < PROMPT_S, (
                f"rank {rank}: the all_reduce {when} took {all_reduce:.2f} s"
            )
    # average_parameters is an exact mean: every rank holds the same model, and it trained.
    for name in MODES:
        finals = [finals[name] for _, finals in results]
        for rank in range(1, 4):
            torch.testing.assert_close(finals[rank], finals[0], msg=f"{name}, rank {rank}")
