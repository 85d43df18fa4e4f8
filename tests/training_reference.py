"""A plain-PyTorch, single-process simulator of gossip training: the oracle of the multi-process
tests of GossipDataParallel.

Written from docs/design.md section 1, independently of the engine. Every node holds push-sum
numerators x and a weight w; the model computes with z = x / w and the optimizer (plain SGD)
updates z, so after a step x = w * z. Rounds are replayed from per-node event logs, so the same
code covers synchronous SGP, overlap SGP and bounded asynchrony, where which forward absorbs which
round depends on timing: a node absorbs round r only once every in-peer has sent it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Events of one node, in its program order.
STEP = "step"  # forward + backward + optimizer step on the node's own data
START = "start"  # start the next round
ABSORB = "absorb"  # absorb the round in flight


def mixing(num_out: int, self_weight: float | None) -> tuple[float, float]:
    """(kept share, share per out-peer): uniform 1/(k+1), or self_weight and (1-a)/k."""
    if num_out == 0:
        return 1.0, 0.0
    if self_weight is None:
        return 1.0 / (num_out + 1), 1.0 / (num_out + 1)
    return self_weight, (1.0 - self_weight) / num_out


def replay(
    init: Sequence[list[torch.Tensor]],
    grad_fn: Callable[[int, list[torch.Tensor]], list[torch.Tensor]],
    lr: float,
    events: Sequence[Sequence[str]],
    out_peers: Callable[[int, int], list[int]],
    self_weight: Sequence[float] | None = None,
    complete: Sequence[int] | None = None,
) -> list[list[torch.Tensor]]:
    """Replays every node's event log and returns each node's final de-biased parameters.

    Args:
        init: init[i] = node i's initial parameter tensors.
        grad_fn: grad_fn(i, z_i) = the gradients of node i's loss at its parameters z_i.
        lr: the SGD learning rate.
        events: events[i] = node i's events (STEP, START, ABSORB) in order.
        out_peers: out_peers(i, r) = the nodes i sends to in round r.
        self_weight: None for uniform mixing, else self_weight[i] = node i's kept share under
            SelfWeightMixing (nodes may differ: then the push-sum weights change).
        complete: the nodes whose logs must run to their end (default: all). A node whose log is
            cut short stops sending, so others may wait on it for good; they are then returned
            where they stopped.
    """
    n = len(init)
    x = [[t.detach().to(torch.float64).clone() for t in node] for node in init]
    w = [1.0] * n
    rounds_started = [0] * n
    sent: dict[tuple[int, int], list[tuple[list[torch.Tensor], float]]] = {}  # (dst, round)
    in_flight: list[int | None] = [None] * n
    pc = [0] * n

    def in_degree(i: int, r: int) -> int:
        return sum(i in out_peers(j, r) for j in range(n))

    progressed = True
    while progressed:
        progressed = False
        for i in range(n):
            while pc[i] < len(events[i]):
                event = events[i][pc[i]]
                if event == STEP:
                    z = [t / w[i] for t in x[i]]
                    grads = grad_fn(i, [t.clone() for t in z])
                    x[i] = [w[i] * (zt - lr * g.to(torch.float64)) for zt, g in zip(z, grads)]
                elif event == START:
                    r = rounds_started[i]
                    peers = out_peers(i, r)
                    keep, give = mixing(len(peers), None if self_weight is None else self_weight[i])
                    for j in peers:
                        sent.setdefault((j, r), []).append(([give * t for t in x[i]], give * w[i]))
                    x[i] = [keep * t for t in x[i]]
                    w[i] *= keep
                    in_flight[i] = r
                    rounds_started[i] += 1
                elif event == ABSORB:
                    r = in_flight[i]
                    if r is not None:
                        messages = sent.get((i, r), [])
                        if len(messages) < in_degree(i, r):
                            break  # wait for the other nodes to send
                        for values, weight in messages:
                            x[i] = [a + b for a, b in zip(x[i], values)]
                            w[i] += weight
                        in_flight[i] = None
                else:
                    raise ValueError(f"unknown event {event!r}")
                pc[i] += 1
                progressed = True
    stuck = [i for i in (range(n) if complete is None else complete) if pc[i] < len(events[i])]
    if stuck:
        raise RuntimeError(f"event logs deadlock at nodes {stuck}")
    return [[t / w[i] for t in x[i]] for i in range(n)]


def synchronous_events(steps: int) -> list[str]:
    """Synchronous SGP: absorb before each forward, start a round after each step."""
    events: list[str] = []
    for _ in range(steps):
        events += [ABSORB, STEP, START]
    return events + [ABSORB]


def overlap_events(steps: int) -> list[str]:
    """Overlap SGP: the round started after step k is absorbed after step k + 1."""
    events: list[str] = []
    for _ in range(steps):
        events += [STEP, ABSORB, START]
    return events + [ABSORB]


def log_gossip(model, call, events: list[str], step: bool = False):
    """Runs call() on a GossipDataParallel and appends the gossip it did to ``events``, in order:
    STEP first if ``step`` (an optimizer step whose hook transfers), then absorbing the round that
    was in flight, then any rounds started (and, when sync_comms drains missed rounds, absorbed)
    during it. Returns call()'s result."""
    round_before, in_flight_before = model.gossip_round, model.round_in_flight
    result = call()
    if step:
        events.append(STEP)
    absorbed = model.gossip_round - round_before
    started = (model.gossip_round + model.round_in_flight) - (round_before + in_flight_before)
    if in_flight_before and absorbed > 0:
        events.append(ABSORB)
        absorbed -= 1
    for _ in range(started):
        events.append(START)
        if absorbed > 0:
            events.append(ABSORB)
            absorbed -= 1
    assert absorbed == 0, "absorbed a round that was never started"
    return result
