"""A Streaming DiLoCo fragment's pseudo-gradients averaged by one gossip exchange
(``outer_average="gossip"`` with ``fragments``).

The exact mean is a collective over every worker; gossip asks only the round's peers. At the
fragment's prepare, worker ``i`` splits the push-sum pair ``(w_i d_i, w_i)`` of its pseudo-gradient
``d_i`` by the mixing weights of the graph's round: it keeps ``self_weight`` of it and sends
``peer_weight`` of it to each out-peer, as point-to-point messages that the process group's thread
moves while training goes on. At the apply it adds what its in-peers sent, and its fragment's
outer optimizer steps with the ratio ``sum (w d) / sum w``. The mixing is column-stochastic, so the
sums of ``w d`` and of ``w`` over the workers are conserved: on the built-in graphs (regular, so
the mixing is doubly stochastic) the mean of the workers' ratios is the mean pseudo-gradient, as
the exact average's, and each worker's ``theta_global`` drifts from it by what one round leaves
of the workers' disagreement. The round of the graph is the optimizer step of the prepare, the
same on every worker and different for consecutive fragments, so a dynamic graph sends each
fragment to other peers.

The messages travel at the parameters' precision (``message_dtype`` compresses the inner rounds,
``outer_dtype`` the exact mean); their tags are the outer exchanges' range of the compiled
engine's tag registry, so these messages never meet its rounds'.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.averagings.buckets import weighted_message_bytes
from gossip_ext.averagings.failures import check_received, post_for_peer, wait_for_peer
from gossip_ext.averagings.interface import Averaging, Contribution, PseudoGradientMean
from gossip_ext.gossip import transport

# These messages' tags are the outer exchanges' range of the tag registry
# (transport.outer_exchange_tag), apart from every round's.
MAX_BUCKETS = 16  # tags per round: one per bucket (one bucket per parameter dtype)


@dataclass
class _Exchange:
    """One fragment's exchange between its start and its finish."""

    own: list[torch.Tensor]  # per bucket: this worker's pseudo-gradient
    kept: list[torch.Tensor]  # per bucket: self_weight * [w d | w]
    received: list[list[tuple[int, torch.Tensor]]]  # per bucket: (in-peer, its message)
    works: list[tuple[str, int, Any]]  # ("from" or "to", peer, work)
    round: int


class GossipMean(Averaging):
    """The gossip estimate of the mean of per-bucket pseudo-gradients (``layout``: (elements,
    dtype) per bucket) over ``group``: one exchange with the peers of ``graph``'s round (the
    contribution's), weighted by ``mixing``, each wait bounded by ``timeout``."""

    what = "Streaming DiLoCo's gossip exchange"

    def __init__(
        self,
        layout: Sequence[tuple[int, torch.dtype]],
        graph: Any,
        mixing: Any,
        group: dist.ProcessGroup,
        timeout: datetime.timedelta,
    ):
        if len(layout) > MAX_BUCKETS:
            raise ValueError(
                f"outer_average='gossip' with fragments: at most {MAX_BUCKETS} parameter dtypes "
                f"in a fragment, got {len(layout)}"
            )
        self.layout = list(layout)
        self.graph = graph
        self.mixing = mixing
        self.group = group
        self.transport = f"process_group({dist.get_backend(group)})"  # named in errors
        self.rank = group.rank()
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout

    def peers(self, round: int) -> tuple[list[int], list[int]]:
        """(out-peers, in-peers) of this worker in ``round``, as ranks of the group."""
        if self.world_size == 1:
            return [], []
        return (
            self.graph.out_peers(self.rank, self.world_size, round),
            self.graph.in_peers(self.rank, self.world_size, round),
        )

    def bytes_per_step(self, round_bytes: int = 0) -> int:
        """One message of every bucket (its values and the weight) to each out-peer of a round
        (the built-in graphs send to as many in every round)."""
        return len(self.peers(0)[0]) * weighted_message_bytes(self.layout)

    def _tag(self, round: int, bucket: int) -> int:
        return transport.outer_exchange_tag(round * MAX_BUCKETS + bucket)

    @torch.no_grad()
    def start(self, contribution: Contribution) -> _Exchange:
        """Posts the receives from the round's in-peers and the sends to its out-peers."""
        pseudo_gradients, weight, round = (
            contribution.pseudo_gradients(),
            contribution.weight,
            contribution.round,
        )
        if weight is None:
            raise ValueError(
                "GossipMean: every worker contributes to a gossip average (a process that "
                "contributes nothing has no in-peers to hand it the mean)"
            )
        out_peers, in_peers = self.peers(round)
        self_weight, peer_weight = self.mixing.weights(len(out_peers)) if out_peers else (1.0, 0.0)
        kept, received, works = [], [], []
        for b, d in enumerate(pseudo_gradients):
            message = torch.empty(d.numel() + 1, dtype=d.dtype, device=d.device)
            message[:-1].copy_(d).mul_(weight)
            message[-1] = weight
            tag = self._tag(round, b)
            inbox = []
            for peer in in_peers:
                buffer = torch.empty_like(message)
                source = dist.get_global_rank(self.group, peer)
                receive = functools.partial(dist.irecv, buffer, source, self.group, tag=tag)
                works.append(("from", peer, self._post(receive, "from", peer, round)))
                inbox.append((peer, buffer))
            if out_peers:
                share = message * peer_weight
                for peer in out_peers:
                    target = dist.get_global_rank(self.group, peer)
                    send = functools.partial(dist.isend, share, target, self.group, tag=tag)
                    works.append(("to", peer, self._post(send, "to", peer, round)))
            kept.append(message.mul_(self_weight))
            received.append(inbox)
        return _Exchange(list(pseudo_gradients), kept, received, works, round)

    def _post(self, post, direction: str, peer: int, round: int):  # noqa: A002
        return post_for_peer(post, direction, peer, self.what, round, self.group, self.timeout)

    @torch.no_grad()
    def finish(self, exchange: _Exchange) -> PseudoGradientMean:
        """Waits for every message of the exchange; returns the mean estimate per bucket. Raises
        PeerTimeoutError naming the peer whose message did not arrive (or could not be sent),
        NonFiniteError naming the peers whose messages hold NaN or Inf."""
        for direction, peer, work in exchange.works:
            wait_for_peer(
                work, direction, peer, self.what, exchange.round, self.group, self.timeout
            )
        received = [pair for inbox in exchange.received for pair in inbox]
        check_received(received, exchange.own, self.group, self.what, exchange.round)
        means = []
        for total, inbox in zip(exchange.kept, exchange.received):
            for _, message in inbox:
                total.add_(message)
            means.append(total[:-1].div_(total[-1]))
        return PseudoGradientMean(means)

    def describe(self) -> dict[str, Any]:
        return {"kind": "GossipMean", "graph": repr(self.graph), "mixing": repr(self.mixing)}
