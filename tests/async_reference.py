"""Plain-PyTorch references for asynchronous push-sum, in float64, sharing no code with
gossip_ext.gossip.asynchronous.

:func:`replay` is an event-driven simulation of the algorithm: each worker's events (a local
step, a send of its round t to the peers the schedule names, an absorb of the messages it says
arrived) in the order that worker saw them, the workers interleaved as the messages allow. Fed a
real run's arrival order, it must end where the run's workers ended. :func:`synchronous_sgp` is
push-sum with every worker in the same round, as SGP runs it.
"""

from __future__ import annotations

import torch


def quadratic_step(z: torch.Tensor, target: torch.Tensor, lr: float) -> torch.Tensor:
    """The local step of the tests' workers: gradient descent on 0.5 * |z - target|^2."""
    return z - lr * (z - target)


def replay(initial, targets, lr: float, histories) -> tuple[list[torch.Tensor], list[float]]:
    """Each worker's (z, w) after replaying ``histories`` (one list of events per worker:
    ``("step",)``, ``("send", t, out_peers)``, ``("absorb", ((sender, t), ...))``)."""
    n = len(initial)
    z = [x.double().clone() for x in initial]
    w = [1.0] * n
    targets = [t.double() for t in targets]
    in_flight: dict[tuple[int, int, int], tuple[torch.Tensor, float]] = {}
    position = [0] * n
    while any(position[i] < len(histories[i]) for i in range(n)):
        progressed = False
        for i in range(n):
            while position[i] < len(histories[i]):
                event = histories[i][position[i]]
                if event[0] == "step":
                    z[i] = quadratic_step(z[i], targets[i], lr)
                elif event[0] == "send":
                    _, round_, out_peers = event
                    share = 1.0 / (len(out_peers) + 1)
                    for peer in out_peers:
                        in_flight[(i, peer, round_)] = (w[i] * share * z[i], w[i] * share)
                    w[i] *= share
                else:
                    keys = [(sender, i, round_) for sender, round_ in event[1]]
                    if any(key not in in_flight for key in keys):
                        break  # a message this absorb took is not sent yet in the replay
                    numerator, weight = w[i] * z[i], w[i]
                    for key in keys:
                        x, m = in_flight.pop(key)
                        numerator, weight = numerator + x, weight + m
                    z[i], w[i] = numerator / weight, weight
                position[i] += 1
                progressed = True
        if not progressed:
            raise AssertionError(f"the histories deadlock at positions {position}")
    assert not in_flight, f"messages never absorbed: {sorted(in_flight)}"
    return z, w


def synchronous_sgp(initial, targets, lr: float, steps: int, graph) -> list[torch.Tensor]:
    """SGP's synchronous loop: every worker steps, then every worker mixes round t with the
    same t (uniform mixing on a regular graph, so the weights stay 1)."""
    n = len(initial)
    z = [x.double().clone() for x in initial]
    for round_ in range(steps):
        z = [quadratic_step(z[i], targets[i].double(), lr) for i in range(n)]
        mixed = []
        for i in range(n):
            senders = [j for j in range(n) if i in graph.out_peers(j, n, round_)]
            share = 1.0 / (len(graph.out_peers(i, n, round_)) + 1)
            mixed.append(share * (z[i] + sum(z[j] for j in senders)))
        z = mixed
    return z
