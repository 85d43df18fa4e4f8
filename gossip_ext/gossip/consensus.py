"""Consensus distance: how far apart gossip lets the workers' models drift.

Two measures of the same thing:

- :func:`consensus_distance`, exact and collective (two all-reduces): the root mean square over
  the gossiping workers of ``||z_i - z_mean||``, with ``z_mean`` the plain mean of the de-biased
  parameters ``z_i`` (Kong et al., ICML 2021, "Consensus Control for Decentralized Deep
  Learning", call its square Xi^2).
- :class:`MeasuredEngine`, a running estimate that needs no communication of its own: every
  ``log_every`` steps, the absorb of one gossip round measures how far the models this worker
  received are from its own, scaled to estimate the exact distance.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from gossip_ext.gossip.engine import EngineWrapper, FlatEngine
from gossip_ext.graphs import GraphBase

logger = logging.getLogger(__name__)
T = TypeVar("T")


@torch.no_grad()
def consensus_distance(
    params: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    contributes: bool,
    count: int,
    relative: bool = False,
    shard_group: dist.ProcessGroup | None = None,
) -> float:
    """``sqrt(mean_i ||z_i - z_mean||^2)`` over the ``count`` ranks of ``group`` that contribute
    (the others, non-leaders of ``nprocs_per_node > 1``, take part in the collectives with zeros);
    divided by ``||z_mean||`` if ``relative``. Collective; every rank gets the same value.
    ``shard_group``: ``params`` are shards of a model held by that group's processes (sharded
    replicas), whose squared norms add up to the whole model's.

    Two passes (the mean, then the distances to it) rather than ``mean ||z||^2 - ||z_mean||^2``,
    whose cancellation would drown the small distances that matter most. Computed in float64, so
    that identical models give exactly 0 at any world size.
    """
    if contributes:
        z = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])
    else:
        numel = sum(p.numel() for p in params)
        z = torch.zeros(numel, dtype=torch.float64, device=params[0].device)
    mean = z.clone()
    dist.all_reduce(mean, group=group)
    mean.div_(count)
    squared = (z - mean).square().sum() if contributes else torch.zeros((), dtype=torch.float64)
    # The squared distance, and the mean's squared norm, summed over the shards.
    sums = torch.stack([squared.to(mean.device), mean.square().sum()])
    dist.all_reduce(sums[:1], group=group)
    if shard_group is not None:
        dist.all_reduce(sums, group=shard_group)
    distance = math.sqrt(sums[0].item() / count)
    if not relative:
        return distance
    norm = math.sqrt(sums[1].item())
    return distance / norm if norm > 0 else math.inf if distance > 0 else 0.0


def estimate_scale(in_peers: int, world_size: int) -> float:
    """Turns ``||z_i - m_i||`` (``m_i``: the mean of ``k`` in-peers' models) into an estimate of
    the consensus distance Xi.

    For k distinct peers drawn at random, ``E ||z_i - m_i||^2 = Xi^2 n (k+1) / (k (n-1))``
    (write ``z_j - z_mean = e_j``, with ``sum_j e_j = 0``, so ``E e_i . e_j = -Xi^2 / (n-1)``).
    Multiplying by the inverse root makes the mean square over workers unbiased; it is exact for
    two workers, and for every worker when each receives from all the others.
    """
    k, n = in_peers, world_size
    return math.sqrt(k * (n - 1) / (n * (k + 1)))


class MeasuredEngine(EngineWrapper):
    """The gossip engine, with the running consensus estimate taken when an armed round is
    absorbed. GossipDataParallel uses it only when ``log_every > 0``: otherwise it holds the bare
    engine, so the estimate costs nothing.

    What it measures: absorbing a round sets ``z_i <- z_i + f (m_i - z_i)``, where ``m_i`` is the
    (push-sum weighted) mean of the models received from the ``k`` in-peers and ``f = 1 -
    w_kept / w_new`` the share of mass that arrived. So ``||z_after - z_before|| / f`` is the
    distance from this worker to its in-peers' mean, read off the absorb with one model copy and
    no communication. Scaled by :func:`estimate_scale` it estimates the exact
    :func:`consensus_distance` (its root mean square over workers does): equal to it for two
    workers, 0 exactly when the workers agree, and within tens of percent on the exponential
    graphs, which mix fast (tests/test_consensus.py). It is a local measure, so on a graph that
    mixes slowly it reads low: on a ring, neighbours agree more than random workers do (about
    half the exact value on a ring of 8 with one peer). Under overlap the in-peers' models are
    one step older than this worker's, so the estimate also counts one step of local drift.
    """

    def __init__(self, engine: FlatEngine, graph: GraphBase, every: int):
        super().__init__(engine)
        self.graph = graph  # replaced when the peers schedule changes
        self._every = every
        self._armed_step: int | None = None  # the step whose next absorb is measured
        self.estimate: float | None = None  # of the last measured round
        self.relative: float | None = None  # estimate / ||z|| after that round

    def arm(self, step: int) -> None:
        """Called for every optimizer step: every ``log_every``-th one measures the next absorb
        (the round that step starts in synchronous SGP; the one it absorbs under overlap)."""
        if step % self._every == 0:
            self._armed_step = step

    def finish_round(self) -> None:
        self._measured(self.engine.finish_round)

    def try_finish_round(self) -> bool:
        return self._measured(self.engine.try_finish_round)

    def _measured(self, absorb: Callable[[], T]) -> T:
        engine = self.engine
        if self._armed_step is None or not engine.in_flight:
            return absorb()
        round_ = engine.round
        kept = float(engine.kept_ps_weight().item())
        # z before absorbing: the parameters hold it while the round is in flight (Note [The
        # parameters are the model]).
        before = [flat.clone() for flat in engine.flat_buffers()]
        result = absorb()
        if engine.in_flight:  # try_finish_round() found the round unfinished: try again later
            return result
        step, self._armed_step = self._armed_step, None
        arrived = 1.0 - kept / float(engine.ps_weight().item())
        in_peers = len(self.graph.in_peers(engine.rank, engine.world_size, round_))
        if arrived <= 0.0 or in_peers == 0:
            return result
        moved = 0.0
        norm = 0.0
        for flat, old in zip(engine.flat_buffers(), before):
            moved += torch.linalg.vector_norm(flat - old, dtype=torch.float64).item() ** 2
            norm += torch.linalg.vector_norm(flat, dtype=torch.float64).item() ** 2
        to_peers = math.sqrt(moved) / arrived
        self.estimate = to_peers * estimate_scale(in_peers, engine.world_size)
        self.relative = self.estimate / math.sqrt(norm) if norm > 0 else math.inf
        logger.info(
            "rank %d, step %d, gossip round %d: consensus distance estimate %.3e "
            "(relative %.3e; distance to the %d in-peer(s)' mean %.3e)",
            engine.rank,
            step,
            round_,
            self.estimate,
            self.relative,
            in_peers,
            to_peers,
        )
        return result
