"""An outer step's average by gossip in sparse messages, on a fixed graph
(``DiLoCo(average=ByCompressedGossip(TopK(...)))``).

A sparse message is a difference from a value that both ends hold. The exact sparse mean
(:mod:`gossip_ext.averagings.sparse`) has one, ``theta_global``, the same bits on every worker;
under gossip every worker's model is its own. So every worker keeps a *public copy* ``xhat_i`` of
its parameters: the sum of every message it has sent, which each of its neighbours on a fixed,
symmetric graph also holds, having received the same messages. Each worker also keeps the weighted
sum of its neighbourhood's public copies, ``s_i = w (xhat_i + sum_{j in N(i)} xhat_j)`` with ``w = 1
/ (d + 1)`` for ``d`` neighbours (uniform mixing, doubly stochastic on a regular graph). An outer
step, on worker ``i`` with parameters ``x_i`` (CHOCO-gossip, Koloskova et al.,
ICML 2019):

1. ``q_i = TopK(x_i - xhat_i)``: the largest differences of every chunk, in 2 or 4 bits. What the
   message leaves out stays in ``x_i - xhat_i`` and goes out with a later step: error feedback
   with no residual of its own.
2. ``q_i`` goes to every neighbour; ``q_j`` comes from each.
3. ``xhat_i += q_i``; ``s_i += w (q_i + sum_j q_j)``.
4. The mixed parameters are ``z_i = x_i + gamma (s_i - xhat_i)`` (``gamma``: ``consensus_step``).

Every worker adds the same decoded values to the copies it holds, so ``sum_i (s_i - xhat_i)``
stays 0 and ``sum_i z_i = sum_i x_i``: the mean over the workers is kept, as push-sum keeps it,
and the outer optimizer stepping each worker's own ``theta_global`` with ``theta_global - z_i``
moves their mean as the exact average would (for SGD, exactly). Each worker's ``z_i`` differs
from the mean by what the step did not mix; later steps go on pulling them together.

The copies start at the parameters of the outer step's start, equal on every worker (the job's
start broadcasts them), so the first message carries only what training changed. Each worker
sends its one message to its ``d`` neighbours: ``d`` messages of
``TopK.message_bytes(n)`` bytes per outer step, whatever the number of workers (the exact sparse
mean gathers ``n - 1``). Two copies of the model per worker hold the state.

Like the other averagings, :meth:`SparseGossip.finish` keeps nothing; :meth:`SparseGossip.commit`
keeps the copies once the step has succeeded, so that a failed exchange changes nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from gossip_ext.averagings.buckets import check_saved, layout_of
from gossip_ext.averagings.failures import (
    holds_nonfinite,
    post_for_peer,
    raise_nonfinite,
    wait_for_peer,
)
from gossip_ext.averagings.interface import Averaging, Contribution, Mean, ParameterMean
from gossip_ext.averagings.sparse import TopK, _Codec
from gossip_ext.gossip import transport

# gamma's default. On the byte-level language model of benchmarks/lm_compare.py (4 workers, H = 8,
# density 1/32, 2 bits, outer SGD at lr 1), the final held-out bits per byte after 480 steps were
# 3.785 at gamma 1, 3.563 at 0.5, 3.340 at 0.25, 3.364 at 0.1 and 3.403 at 0.05: a large step
# moves the parameters towards copies that lag them by what the messages left out.
DEFAULT_CONSENSUS_STEP = 0.25


def fixed_neighbours(graph: Any, rank: int, world_size: int) -> list[int]:
    """The neighbours of ``rank``: its out-peers on ``graph``, which must be static and pair
    symmetrically (every neighbour of a worker has it as a neighbour), or ValueError."""
    if world_size == 1:
        return []
    if graph.is_dynamic or not graph.pairs_symmetrically(world_size):
        raise ValueError(
            f"ByCompressedGossip(graph=...): the graph must be fixed and symmetric (each worker's "
            f"neighbours hold its public copy, so they cannot change, and each must have it as a "
            f"neighbour), got {graph!r} over {world_size} workers; e.g. RingGraph(peers_per_itr=2)"
        )
    return sorted(set(graph.phone_book(rank, world_size)))


@dataclasses.dataclass
class _Pending:
    """An exchange between :meth:`SparseGossip.start` and :meth:`SparseGossip.finish`."""

    values: list[torch.Tensor]  # per bucket: x_i
    own: list[torch.Tensor]  # per bucket: this worker's message
    inbox: list[torch.Tensor]  # per neighbour: its message
    works: list[tuple[str, int, Any]]  # ("from" or "to", peer, work)
    round: int


@dataclasses.dataclass
class _Kept:
    """The copies a step leaves once committed."""

    public: list[torch.Tensor]  # per bucket: xhat_i after the step
    neighbourhood: list[torch.Tensor]  # per bucket: s_i after the step


class SparseGossip(Averaging[_Pending]):
    """CHOCO-gossip of per-bucket parameter vectors (``layout``: (elements, dtype) per bucket)
    with this worker's ``neighbours`` on ``group``, in ``format`` messages, each wait bounded by
    ``timeout`` (see the module)."""

    state_key = "outer_public_copies"
    what = "the outer step's sparse gossip exchange"

    def __init__(
        self,
        layout: Sequence[tuple[int, torch.dtype]],
        device: torch.device,
        format: TopK,
        consensus_step: float,
        neighbours: Sequence[int],
        group: dist.ProcessGroup,
        timeout: datetime.timedelta,
    ):
        self.layout = list(layout)
        self.device = device
        self.format = format
        self.consensus_step = consensus_step
        self.neighbours = list(neighbours)
        self.group = group
        self.timeout = timeout
        self.transport = f"process_group({dist.get_backend(group)})"  # named in errors
        self.world_size = dist.get_world_size(group)
        self.codecs = [_Codec(format, n) for n, _ in self.layout]
        self.message_bytes = sum(codec.bytes for codec in self.codecs)
        self.public = [torch.zeros(n, dtype=d, device=device) for n, d in self.layout]
        self.neighbourhood = [torch.zeros(n, dtype=d, device=device) for n, d in self.layout]
        self.steps = 0  # outer steps mixed: the round in errors and tags

    def bytes_per_step(self, round_bytes: int = 0) -> int:
        """Bytes this worker sends per outer step: its message to each neighbour."""
        return len(self.neighbours) * self.message_bytes

    @torch.no_grad()
    def begin(self, buckets) -> None:
        """The copies start with the rule, at the parameters of ``buckets``, equal on every
        worker."""
        for b in range(len(buckets)):
            buckets.read(b, self.public[b])
            self.neighbourhood[b].copy_(self.public[b])

    def after_whole_step(self, mix) -> None:
        """The workers are apart after one exchange: push-sum goes on with its weight."""

    @torch.no_grad()
    def start(self, contribution: Contribution) -> _Pending:
        """Encodes this worker's message, the difference of its parameters (``x_i``, per bucket)
        from its public copy, and posts the exchange with every neighbour."""
        values = contribution.parameters()
        own = [self.codecs[b].encode(v - self.public[b]) for b, v in enumerate(values)]
        message = torch.cat(own) if own else torch.empty(0, dtype=torch.uint8)
        inbox, works = self._post(message, self.steps)
        return _Pending(values, own, inbox, works, self.steps)

    @torch.no_grad()
    def finish(self, pending: _Pending) -> ParameterMean:
        """The mixed parameters ``z_i`` and the copies the step would leave; keeps nothing."""
        for direction, peer, work in pending.works:
            wait_for_peer(work, direction, peer, self.what, pending.round, self.group, self.timeout)
        self._check_finite(pending)
        values, own, inbox = pending.values, pending.own, pending.inbox
        weight = 1.0 / (len(self.neighbours) + 1)
        kept = _Kept([], [])
        staged = ParameterMean([], kept)
        offset = 0
        for b, ((numel, dtype), codec) in enumerate(zip(self.layout, self.codecs)):
            # Whole chunks: this worker's message, then, added into the same buffer once the public
            # copy has read it, its neighbours' in order (every holder adds the same values).
            arrived = self._decoded(codec, own[b], dtype)
            public = self.public[b] + arrived.view(-1)[:numel]
            for theirs in inbox:
                codec.add_into(arrived, theirs[offset : offset + codec.bytes])
            offset += codec.bytes
            neighbourhood = self.neighbourhood[b].add(arrived.view(-1)[:numel], alpha=weight)
            mixed = values[b].add(neighbourhood - public, alpha=self.consensus_step)
            staged.values.append(mixed)
            kept.public.append(public)
            kept.neighbourhood.append(neighbourhood)
        return staged

    def _check_finite(self, pending: _Pending) -> None:
        """Raises NonFiniteError naming the neighbours whose messages carry NaN or Inf (a chunk's
        scale, ``_Codec.holds_nonfinite``), or this worker, if its own parameters hold them."""
        senders = []
        for peer, theirs in zip(self.neighbours, pending.inbox):
            offsets = [0]
            for codec in self.codecs:
                offsets.append(offsets[-1] + codec.bytes)
            if any(
                codec.holds_nonfinite(theirs[lo:hi])
                for codec, lo, hi in zip(self.codecs, offsets, offsets[1:])
            ):
                senders.append(peer)
        if holds_nonfinite(pending.values):
            senders.append(self.group.rank())
        if senders:
            raise_nonfinite(senders, self.group, self.what, pending.round)

    def _decoded(self, codec: _Codec, message: torch.Tensor, dtype) -> torch.Tensor:
        """``message``'s values, as whole chunks (chunks x chunk)."""
        total = torch.zeros((codec.chunks, self.format.chunk), dtype=dtype, device=self.device)
        codec.add_into(total, message)
        return total

    def _post(self, message: torch.Tensor, round_: int):
        """Posts the receives of every neighbour's message and the sends of ``message`` to each;
        returns (their buffers in neighbour order, the works)."""
        tag = transport.outer_exchange_tag(round_)
        works, inbox = [], []
        for peer in self.neighbours:
            buffer = torch.empty_like(message)
            source = dist.get_global_rank(self.group, peer)
            receive = functools.partial(dist.irecv, buffer, source, self.group, tag=tag)
            works.append(("from", peer, self._post_one(receive, "from", peer, round_)))
            inbox.append(buffer)
        for peer in self.neighbours:
            target = dist.get_global_rank(self.group, peer)
            send = functools.partial(dist.isend, message, target, self.group, tag=tag)
            works.append(("to", peer, self._post_one(send, "to", peer, round_)))
        return inbox, works

    def _post_one(self, post, direction: str, peer: int, round_: int):
        return post_for_peer(post, direction, peer, self.what, round_, self.group, self.timeout)

    def commit(self, mean: Mean) -> None:
        """Keeps the copies of a step whose exchange succeeded."""
        kept = mean.kept_as(_Kept)
        self.public, self.neighbourhood = kept.public, kept.neighbourhood
        self.steps += 1

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "SparseGossip",
            "message_dtype": self.format.describe(),
            "consensus_step": self.consensus_step,
            "neighbours": list(self.neighbours),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "message_dtype": repr(self.format),
            "world_size": self.world_size,
            "neighbours": list(self.neighbours),
            "steps": self.steps,
            "public": [t.clone() for t in self.public],
            "neighbourhood": [t.clone() for t in self.neighbourhood],
        }

    def check_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        if state is None:
            return
        neighbours = state.get("neighbours")
        if isinstance(neighbours, (list, tuple)):
            neighbours = list(neighbours)
        saved = (state.get("message_dtype"), state.get("world_size"), neighbours)
        if saved != (repr(self.format), self.world_size, self.neighbours):
            raise ValueError(
                f"load_state_dict: the checkpoint's public copies are for {saved[0]} over "
                f"{saved[1]} workers with neighbours {saved[2]}, but this run sends "
                f"{self.format!r} over {self.world_size} with neighbours {self.neighbours}"
            )
        check_saved("public copies", state.get("public"), layout_of(self.public))
        check_saved(
            "neighbourhood copies", state.get("neighbourhood"), layout_of(self.neighbourhood)
        )
        if not isinstance(state.get("steps"), int):
            raise ValueError(
                "load_state_dict: the checkpoint's sparse gossip state holds no step count "
                f"(steps), got {state.get('steps')!r}"
            )

    def load_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        """Puts back :meth:`state_dict`. A checkpoint without copies (saved by a run that averaged
        otherwise) starts them at zero on every worker: consistent whatever the parameters, but
        the first messages then carry the whole model, a chunk's top values at a time."""
        self.check_state_dict(state, members_changed)
        if state is None:
            for t in (*self.public, *self.neighbourhood):
                t.zero_()
            self.steps = 0
            return
        public = check_saved("public copies", state["public"], layout_of(self.public))
        neighbourhood = check_saved(
            "neighbourhood copies", state["neighbourhood"], layout_of(self.neighbourhood)
        )
        steps = cast(int, state["steps"])  # an int: checked above
        self.public = [t.detach().to(self.device).clone() for t in public]
        self.neighbourhood = [t.detach().to(self.device).clone() for t in neighbourhood]
        self.steps = steps
