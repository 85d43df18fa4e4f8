"""A plain-PyTorch replay of asynchronous DiLoCo's outer steps, in float64: given what one worker
merged in each of its outer steps (the pseudo-gradients that had arrived, as read, and the inner
steps behind them), the ``theta_global`` it must hold; and the sums of what every worker sent and
what one received, which agree once every message has arrived. Written from
docs/algorithms.md ("Asynchronous outer steps"), not from the engine."""

from __future__ import annotations

import torch


def sent_by(results: list[dict]) -> dict[int, torch.Tensor]:
    """Each rank's pseudo-gradients summed, from its recorded sends."""
    return {
        rank: sum(e[2].double() for e in result["history"] if e[0] == "send")
        for rank, result in enumerate(results)
    }


def received_by(history: list[tuple]) -> dict[int, torch.Tensor]:
    """What one worker merged of each rank's pseudo-gradients, summed, from its merges."""
    received: dict[int, torch.Tensor] = {}
    for event in (e for e in history if e[0] == "merge"):
        for (peer, _), values in zip(event[1], event[3]):
            received[peer] = received.get(peer, 0) + values.double()
    return received


def replay(
    history: list[tuple],
    theta0: torch.Tensor,
    *,
    world_size: int,
    every: int,
    lr: float,
    momentum: float,
    delayed: bool,
) -> torch.Tensor:
    """The theta_global after the merges of ``history`` (one worker's: each merge's arrivals
    and the values they carried), from ``theta0``."""
    theta = theta0.double().clone()
    velocity = torch.zeros_like(theta)
    pending = torch.zeros_like(theta)
    pending_steps = 0
    for event in history:
        if event[0] != "merge":
            continue
        merged = sum(values.double() for values in event[3]) / world_size
        steps = event[2]
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
