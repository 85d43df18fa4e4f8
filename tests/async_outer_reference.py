"""A plain-PyTorch replay of asynchronous DiLoCo's outer steps, in float64: given what every
worker sent (its pseudo-gradients, as read, and the inner steps behind each) and the order in
which one worker merged them, the ``theta_global`` that worker must hold. Written from
docs/algorithms.md ("Asynchronous outer steps"), not from the engine."""

from __future__ import annotations

import torch


def sent_by(results: list[dict]) -> dict[tuple[int, int], tuple[torch.Tensor, int]]:
    """(rank, period) -> (pseudo-gradient, inner steps), from every rank's recorded sends."""
    return {
        (rank, period): (values.double(), steps)
        for rank, result in enumerate(results)
        for kind, period, values, steps in (e for e in result["history"] if e[0] == "send")
    }


def replay(
    history: list[tuple],
    sent: dict[tuple[int, int], tuple[torch.Tensor, int]],
    theta0: torch.Tensor,
    *,
    world_size: int,
    every: int,
    lr: float,
    momentum: float,
    delayed: bool,
) -> torch.Tensor:
    """The theta_global after the merges of ``history`` (one worker's), from ``theta0``."""
    theta = theta0.double().clone()
    velocity = torch.zeros_like(theta)
    pending = torch.zeros_like(theta)
    pending_steps = 0
    for event in history:
        if event[0] != "merge":
            continue
        keys = event[1]
        merged = sum(sent[key][0] for key in keys) / world_size
        steps = sum(sent[key][1] for key in keys)
        assert steps == event[2]
        if not delayed:
            velocity = momentum * velocity + merged
            theta = theta - lr * (merged + momentum * velocity)
            continue
        theta = theta - lr * merged
        pending = pending + merged
        pending_steps += steps
        if pending_steps >= world_size * every:
            pending_steps -= world_size * every
            velocity = momentum * velocity + pending
            theta = theta - lr * momentum * velocity
            pending = torch.zeros_like(theta)
    return theta
