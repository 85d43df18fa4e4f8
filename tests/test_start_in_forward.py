"""Overlap rounds started by the forward (start_in_forward, the reference SGP's way), and the
error a loop gets when it steps without ever calling transfer_params(); real processes on gloo.

The oracle for start_in_forward is the transfer_params()-driven overlap schedule, whose
trajectory tests/test_model_validity.py checks against the plain-PyTorch simulator: a forward
that starts the round sends the same parameters as a transfer_params() right after the step
before it (nothing writes them in between), plus one round of the initial parameters at the
first forward, which transfer_params() before the first step reproduces.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

D = 4
STEPS = 6


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(3, D, generator=g), torch.randn(3, 1, generator=g)


def _train(rank: int, world_size: int, driven_by: str) -> dict:
    torch.manual_seed(0)
    module = nn.Linear(D, 1)
    by_forward = driven_by == "forward"
    model = gossip_ext.GossipDataParallel(module, overlap=True, start_in_forward=by_forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    if not by_forward:
        model.transfer_params()  # the round the first forward starts under start_in_forward
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not by_forward and step < STEPS - 1:  # the next forward's round
            model.transfer_params()
    rounds_before_eval = model.gossip_round
    model.eval()  # absorbs the round in flight
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "rounds": rounds_before_eval,
        "bytes": model.bytes_sent,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_rounds_started_by_the_forward_follow_the_overlap_schedule(world_size):
    by_forward = run_ranks(world_size, _train, "forward")
    by_hand = run_ranks(world_size, _train, "transfer_params")
    for f, h in zip(by_forward, by_hand):
        assert f["rounds"] == STEPS - 1 and f["bytes"] == h["bytes"] > 0
        for a, b in zip(f["params"], h["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _forgetful(rank: int, world_size: int, overlap: bool, explicit_error: bool) -> str:
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1), overlap=overlap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(3):
            x, y = _batch(rank, step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()  # no transfer_params(): SGP's overlap loop
            if explicit_error and step == 1:
                model.transfer_params()
    except RuntimeError as error:
        return str(error)
    return f"no error; rounds={model.gossip_round}"


@pytest.mark.parametrize("overlap", [False, True])
def test_stepping_without_transfer_params_raises_on_every_rank(overlap):
    for message in run_ranks(2, _forgetful, overlap, False):
        assert "transfer_params() was never called" in message
        assert ("start_in_forward=True" in message) == overlap


def _accumulating(rank: int, world_size: int) -> int:
    # Gradient accumulation: several forwards per step change nothing and must not raise.
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for micro in range(3):
            x, y = _batch(rank, 3 * step + micro)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        model.transfer_params()
    model.sync_comms()
    return model.gossip_round


def test_gradient_accumulation_is_not_mistaken_for_a_forgotten_transfer():
    assert run_ranks(2, _accumulating) == [3, 3]


def _misuse(rank: int, world_size: int) -> list[str]:
    errors = []
    try:
        gossip_ext.GossipDataParallel(nn.Linear(D, 1), start_in_forward=True)
    except ValueError as error:
        errors.append(str(error))
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1), overlap=True, start_in_forward=True)
    for call in (
        model.transfer_params,
        lambda: model.register_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
    ):
        try:
            call()
        except RuntimeError as error:
            errors.append(str(error))
    return errors


def test_start_in_forward_misuse_says_what_to_do():
    for errors in run_ranks(2, _misuse):
        assert len(errors) == 3, errors
        assert "needs overlap=True" in errors[0]
        assert all("start_in_forward=True" in e for e in errors[1:])
