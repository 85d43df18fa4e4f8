"""What GossipDataParallel tells of its gossip, and SGP's peers schedule: the push-sum state
(``ps_weight``, ``gossip_round``, ``bytes_sent``, ``round_in_flight``, ``ps_numerator()``), the
consensus distance, the graph and the groups gossip runs over, ``settle()``, and SGP's
``block()`` and ``unbias()``. SGP's scripts read these names.

A mixin of the wrapper, reading its runtime (``assembly.Runtime``: the inner mix, the process
group, the hierarchy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gossip_ext import _validation
from gossip_ext.gossip import consensus, inner
from gossip_ext.graphs import GraphBase


class GossipView:
    """The wrapper's gossip, as SGP's scripts read it (see the module docstring)."""

    def block(self) -> None:
        """Absorbs the round in flight and waits until every rank has done the same."""
        self.sync_comms()
        dist.barrier(group=self.process_group)

    def settle(self) -> None:
        """Brings the gossip to rest, every worker together (collective over the process group):
        absorbs the round in flight and, under ``AsyncSGP``, waits until every message any worker
        sent has been absorbed. Afterwards nothing is in flight: the weights (``ps_weight``) sum
        to the number of workers, and the weighted mean of the models is exactly the mean of what
        the workers held. Call it before evaluating or saving the job's average; in the
        synchronous modes it is :meth:`sync_comms` on every worker. Raises a failed round's error
        (a peer that died or stalled: PeerTimeoutError naming it, within the timeout)."""
        self._members.check_member()
        self._members.guard(self.runtime.raise_if_failed)
        self._members.guard(self.runtime.mix.settle)
        self._node_behind = True  # the gossiping process's parameters moved: its node's receive
        self.sync_comms()

    def unbias(self) -> None:
        """Kept for SGP compatibility. The parameters here always hold de-biased values, so
        there is nothing to do."""

    @property
    def graph(self) -> GraphBase:
        """The gossip graph, with the number of peers per round now."""
        return self.runtime.mix.graph

    @property
    def peers_per_itr(self) -> int:
        """Out-peers per gossip round now (see :meth:`set_peers_per_itr`)."""
        return self.graph.peers_per_itr

    def set_peers_per_itr(self, peers_per_itr: int) -> None:
        """Gossips with ``peers_per_itr`` out-peers per round from the next round on: SGP's peers
        schedule (more peers late in training tightens consensus as the learning rate falls).

        Collective over the process group: every rank must call it between the same two steps
        with the same value, which is checked (one all-gather). It first absorbs the round in
        flight (as :meth:`sync_comms`). The checkpoint keeps the value, and loading it restores
        it. Raises ValueError if the graph does not admit the value at this world size.
        """
        _validation.check_type("peers_per_itr", peers_per_itr, int, "an int")
        graph = inner.with_peers(self.graph, peers_per_itr)
        _validation.gossip_world_size(
            graph, self.push_sum, dist.get_world_size(self.process_group), self.nprocs_per_node
        )
        self.sync_comms()
        _validation.check_ranks_agree(
            {"peers_per_itr": peers_per_itr, "steps": self.runtime.steps},
            self.process_group,
            self.process_group.rank(),
        )
        self.runtime.mix.set_graph(graph)

    @property
    def gossip_world_size(self) -> int:
        """The number of gossiping processes: the workers, or one process per machine."""
        return self.runtime.gossip_world_size

    @property
    def is_gossip_leader(self) -> bool:
        """Whether this process gossips (with ``nprocs_per_node > 1``, one process a machine)."""
        return self.runtime.is_gossip_leader

    @property
    def wire_summary(self) -> str:
        """What this worker does, in one line: the mode, the graph, the message format and the
        bytes it sends per step (logged at rank 0 when a job starts)."""
        return self.runtime.summary

    @property
    def gossip_group(self) -> dist.ProcessGroup:
        """The process group gossip runs over: the process group, or with ``nprocs_per_node >
        1`` one process per machine."""
        return (
            self.process_group if self.runtime.hierarchy is None else self.runtime.hierarchy.leaders
        )

    @property
    def node_group(self) -> dist.ProcessGroup | None:
        """The processes of this machine (``nprocs_per_node > 1``), else None."""
        return None if self.runtime.hierarchy is None else self.runtime.hierarchy.node_group

    # ----------------------------------------------------------------------------- consensus

    def consensus_distance(self, *, relative: bool = False) -> float:
        """How far apart the workers' models are: ``sqrt(mean_i ||z_i - z_mean||^2)`` over the
        gossiping workers, with ``z_i`` all de-biased parameters as one vector and ``z_mean``
        their plain mean; over ``||z_mean||`` if ``relative``. 0: every worker has the same model.
        Right after an outer step averaged by gossip, it is how far the workers' ``theta_global``
        are apart.

        Exact and collective (two all-reduces, in float64): every rank must call it, and all get
        the same value. It leaves the training unchanged: messages in flight are not counted.
        ``log_every`` gives a free estimate.
        """
        _validation.check_type("relative", relative, bool, "a bool")
        self.runtime.raise_if_failed()
        return consensus.consensus_distance(
            [
                t for _, t in self.runtime.named
            ],  # the parameters, or a sharded module's local shards
            self.process_group,
            self.is_gossip_leader,
            self.gossip_world_size,
            relative,
            shard_group=self.runtime.shard_group,
        )

    @property
    def consensus_estimate(self) -> float | None:
        """The running estimate of :meth:`consensus_distance` taken by this worker's last measured
        round (``log_every > 0``; see :class:`gossip_ext.gossip.consensus.MeasuredEngine`); None
        before the first one, without ``log_every`` and on processes that do not gossip."""
        return self.runtime.mix.estimate

    # ----------------------------------------------------------------------------- push-sum state

    @property
    def ps_weight(self) -> float:
        """This worker's push-sum weight ``w``: the weight of the model its parameters hold (always
        1 under lazy mixing)."""
        return self.runtime.mix.ps_weight

    @property
    def round_in_flight(self) -> bool:
        """Whether a gossip round has been started and not yet absorbed."""
        return self.runtime.mix.in_flight

    @property
    def bytes_sent(self) -> int:
        """Bytes of gossip messages this worker has sent so far (0 on a non-gossiping process)."""
        return self.runtime.mix.bytes_sent

    @property
    def gossip_round(self) -> int:
        """Gossip rounds completed by this worker."""
        return self.runtime.mix.round

    def ps_numerator(self) -> dict[str, torch.Tensor]:
        """The push-sum numerators ``x = w * z``, one new tensor per parameter name."""
        weight = self.ps_weight
        return {name: p.detach() * weight for name, p in self.module.named_parameters()}
