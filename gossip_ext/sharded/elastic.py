"""Elastic sharded replicas: an elastic job whose workers are replicas of S processes, each
holding one shard of the model (FSDP2 over the replica's own process group).

The job's members are replicas, not processes. Shard 0 of each replica (its leader) is the job's
worker: it registers, beats, watches and forms the epochs (:mod:`gossip_ext.membership.elastic`)
with the other replicas' leaders, under a replica id that its processes share (told them over the
replica's group once it registered). At each epoch it tells them which replicas the epoch holds,
through the membership store, where they wait for it as long as its heartbeat goes on (forming
an epoch can take longer than the replica group's own timeout), and process s of each replica
builds the group of the replicas' processes s for that epoch: the same replicas in the same
order, so that shard s gossips (and hands over) only with shard s.

A replica changes epoch as a whole. Its processes notice a change at different moments (a
leader's watch sees a registration, a process's round fails because a peer died), and one that
went off to form an epoch alone would leave its siblings waiting in FSDP2's next all-gather while
it waits for another replica's process, which may be waiting in that replica's all-gather for a
sibling waiting on the first: a cycle, broken only by the timeout. So a failure is kept until
the step boundary, where the replica's processes agree (one all-reduce of a flag over the
replica's group) whether to change; all of them do, or none. A step boundary is after the
optimizer step: never during a forward, a backward or a reshard.

A replica whose process dies leaves: its other processes find the replica's group broken in one
of FSDP2's collectives, forward or backward (:mod:`gossip_ext.sharded.replica_collectives`), or
at the step boundary, and stop with :class:`ReplicaLostError`; the survivors form an epoch
without the replica. A new replica joins
with as many processes as the others (another number is refused, naming both), and each of its
processes receives its shard (parameters, optimizer state, outer state, step count) from the
same shard process of one live replica: no process ever holds the whole model.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gossip_ext import _plain_messages
from gossip_ext.gossip.transport import Sealing
from gossip_ext.membership import elastic as elastic_worker
from gossip_ext.membership import epochs, runtime, trust
from gossip_ext.membership.epochs import Epoch, MembershipClient, RemovedError, Watch
from gossip_ext.sharded import replica_collectives, replica_messages, replicas


class ReplicaLostError(RemovedError):
    """A process of this replica died or left, so the replica left the job: its other processes
    stop with this error, and the other replicas train on. Start a whole new replica (all of its
    shard processes) to replace it: it receives the model shard by shard from a live one."""


class ReplicaMember:
    """This process's part in the epochs of an elastic job of sharded replicas (see the module
    docstring): the interface of :class:`~gossip_ext.membership.elastic.ElasticWorker` that
    :class:`~gossip_ext.membership.runtime.ElasticMembership` uses, over the group of this
    process's shard in each epoch. ``shard_group``: the replica's processes (its shard mesh)."""

    def __init__(
        self,
        address: str,
        min_workers: int,
        timeout: datetime.timedelta,
        shard_group: dist.ProcessGroup,
        device: torch.device,
        *,
        secret: bytes | None = None,
        fingerprint: Mapping[str, object] | None = None,
        messages: str = epochs.SEALED,
    ):
        self.shard_group, self.timeout = shard_group, timeout
        self.messages = messages  # how the shard groups' messages travel (Elastic(messages=...))
        self.shard, self.shards = shard_group.rank(), shard_group.size()
        self.device = device  # of the replica group's collectives (FSDP2's device)
        self.leader = None
        if self.shard == 0:
            self.leader = elastic_worker.ElasticWorker(
                address,
                min_workers,
                timeout,
                "gloo",
                shards=self.shards,
                secret=secret,
                fingerprint=fingerprint,
                messages=messages,
            )
            self.client = self.leader.client
        else:
            # Admitted through its leader; it reads what the leader writes, sealed alike.
            self.client = MembershipClient(address, timeout, secret)
        self.epoch: Epoch | None = None
        # A follower's group of its shard in this epoch (the leader's is its worker's: one
        # reference held here too would keep it, and its connections, open after release).
        self._group: dist.ProcessGroup | None = None
        self.left = False
        self._received = False  # this process received its shard in the epoch being entered
        self._messages = 0  # the leader's messages to the others (replica/ID/told/N), so far
        self._on_silent: Callable[[str], None] = lambda why: None

    @property
    def worker(self) -> int:
        """The replica's id in the job, the same on each of its processes."""
        return self.client.worker

    @property
    def group(self) -> dist.ProcessGroup | None:
        """This process's group of the epoch: the replicas' processes of its shard."""
        return self._group if self.leader is None else self.leader.group

    @property
    def on_silent(self) -> Callable[[str], None]:
        return self._on_silent

    @on_silent.setter
    def on_silent(self, abandon: Callable[[str], None]) -> None:
        self._on_silent = abandon
        if self.leader is not None:
            self.leader.on_silent = abandon

    # ----------------------------------------------------------------------------- epochs

    def join(self) -> elastic_worker.Change:
        """Joins as a process of a replica: its leader registers the replica (and tells the
        others its id, over the replica's group: registering takes no wait) and waits for an
        epoch; every process then builds its shard's group of that epoch."""
        message = None
        if self.leader is not None:
            try:
                message = ("registered", self.leader.register())
            except Exception as error:
                self._broadcast(("stopped", type(error).__name__, str(error)))
                raise
        message = self._broadcast(message)
        replica_messages.raise_if_stopped(message)
        self.client.worker = message[1]
        return self._next(lambda: self.leader.join())

    def next_epoch(self, failure: elastic_worker.Failure | None) -> elastic_worker.Change:
        """The next epoch, as ElasticWorker.next_epoch: the leader lets go of its group there;
        a follower here, before waiting for the leader (its peers, still waiting on it in the
        epoch's rounds, must see its connections close)."""
        self._release(in_background=failure is not None)
        return self._next(lambda: self.leader.next_epoch(failure))

    def changed(self) -> bool:
        return self.leader is not None and self.leader.changed()

    def agree(self, wants_change: bool, failure: elastic_worker.Failure | None):
        """Whether this replica changes epoch at this step boundary, the same answer on each of
        its processes, and the failures that call for it (the leader accuses their peers: the
        ranks of every shard's group are the epoch's). Collective over the replica's group;
        ReplicaLostError (after leaving) if a process of the replica is gone."""
        flag = torch.tensor([int(wants_change)], dtype=torch.int32, device=self.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.shard_group)
            if not flag.item():
                return False, None
            mine = None if failure is None else {"text": failure.text, "peers": failure.peers}
            failures = _plain_messages.all_gather(
                mine,
                self.shard_group,
                "a shard process's failure",
                replica_messages.FAILURE,
                self.device,
            )
        except Exception as error:
            if not elastic_worker.is_peer_failure(error):
                raise
            self.lose_replica(error)
        known = [f for f in failures if f is not None]
        if not known:
            return True, None
        peers = tuple(dict.fromkeys(p for f in known for p in f["peers"]))
        return True, elastic_worker.Failure("; ".join(f["text"] for f in known), peers)

    def _next(self, leader_forms: Callable[[], elastic_worker.Change]) -> elastic_worker.Change:
        """The leader forms the epoch (``leader_forms``) and tells the others; each process builds
        its shard's group; again until every process of the replica has its group."""
        while True:
            change = self._share(leader_forms if self.leader is not None else None)
            if change is not None:
                return change
            # A process of another replica did not build its group (it died meanwhile): every
            # replica finds the same and forms the next epoch.
            failure = elastic_worker.Failure(
                f"a shard's group of epoch {self.epoch.number} was not built"
            )
            self.leaving_epoch()
            self._release(in_background=True)

            def leader_forms(failure=failure):
                return self.leader.next_epoch(failure)

    def _share(self, leader_forms) -> elastic_worker.Change | None:
        """The leader forms an epoch and tells the others through the membership store (not a
        collective of the replica's group: forming may wait for other replicas for as long as
        the membership's timeout, which the group's own timeout need not cover); the others
        wait as long as the leader's heartbeat goes on."""
        if leader_forms is not None:
            try:
                change = leader_forms()
                message = ("epoch", change.epoch, change.left, change.joined)
            except Exception as error:
                self._tell(["stopped", type(error).__name__, str(error)])
                raise
            self._tell(replica_messages.epoch_message(change))
        else:
            message = self._told()
        replica_messages.raise_if_stopped(message)
        _, epoch, left, joined = message
        replica = self.worker
        self.epoch = epoch
        built = 1
        if self.leader is None:
            try:
                self._group = self.client.build_group(
                    epoch, epoch.rank(replica), "gloo", part=f"/shard{self.shard}"
                )
            except Exception:  # noqa: BLE001 - a member died, or a connection failed its proof
                built = 0
        every = torch.tensor([built], dtype=torch.int32, device=self.device)
        self._replica_collective(dist.all_reduce, every, op=dist.ReduceOp.MIN)
        if not every.item():
            return None
        others = [m for m in epoch.members if m != replica]
        self._watch().follow(epoch, others, self.on_silent, self.answering)
        rank = epoch.rank(replica)
        return elastic_worker.Change(epoch, self.group, rank, list(left), list(joined), 0.0)

    def _tell(self, message: list) -> None:
        """The leader's side: ``message`` (``replica_messages.TOLD``) to the replica's other
        processes."""
        self._messages += 1
        key = f"replica/{self.worker}/told/{self._messages}"
        self.client.put(key, _plain_messages.encode(message).decode())

    def _told(self) -> tuple:
        """Another process's side: the leader's next message; ReplicaLostError if its heartbeat
        stops first."""
        self._messages += 1
        key = f"replica/{self.worker}/told/{self._messages}"
        try:
            data = self.client.wait_while_beating(key, self.worker)
        except TimeoutError as error:
            self.lose_replica(error)
        return replica_messages.read_told(
            data, f"the replica leader's message {key!r}", self.worker
        )

    def _broadcast(self, message: tuple | None) -> list:
        """The leader's ``message`` (``replica_messages.REGISTERED``) on every process of the
        replica."""
        leader = dist.get_global_rank(self.shard_group, 0)
        return self._replica_collective(
            _plain_messages.broadcast,
            message,
            leader,
            what="the replica leader's registration",
            shape=replica_messages.REGISTERED,
            device=self.device,
        )

    def _replica_collective(self, collective, *args, **kwargs) -> Any:
        try:
            return collective(*args, group=self.shard_group, **kwargs)
        except Exception as error:
            if not elastic_worker.is_peer_failure(error):
                raise
            self.lose_replica(error)

    def _watch(self) -> Watch:
        """The watch of the other replicas' heartbeats: the leader's own; the others' a watch of
        their own (no heartbeat: the replica beats through its leader), so that a round of any
        shard is given up as soon as a replica is found silent."""
        if self.leader is not None:
            return self.client.watch
        if self.client.watch is None:
            watcher = MembershipClient(self.client.address, self.timeout, self.client.secret)
            watcher.worker = self.worker  # its announcements claim in this replica's name
            self.client.watch = Watch(watcher)
        return self.client.watch

    # ----------------------------------------------------------------------------- leaving

    def leaving_epoch(self) -> None:
        if self.leader is not None:
            self.leader.leaving_epoch()
            return
        if self.client.watch is not None:
            self.client.watch.pause()
        if self.epoch is not None:
            self.client.mark_leaving(self.epoch)

    def mark_ready(self) -> None:
        """This process received its shard: the replica holds the job's state once each of its
        processes did (:meth:`confirm_ready`), not before (a replica half received would
        otherwise count as a donor in the next epoch)."""
        self._received = True

    def confirm_ready(self) -> None:
        """Every process of the replica received its shard (agreed over the replica's group)."""
        if self._received and self.leader is not None:
            self.leader.mark_ready()
        self._received = False

    def leave(self) -> None:
        if self.left:
            return
        self.left = True
        if self.leader is not None:
            self.leader.leave()
            return
        try:
            self.leaving_epoch()
        finally:
            self._release()
            if self.client.watch is not None:
                self.client.watch.stop()

    def lose_replica(self, error: BaseException):
        """A process of this replica is gone (``error``, from a collective of the replica's
        group): this process leaves the job, saying the replica is gone so that the others need
        not wait for its leader's heartbeat to stop, and raises ReplicaLostError."""
        text = f"{type(error).__name__}: {error}"
        if self.worker >= 0 and not self.left:
            try:
                self.client.announce_gone([self.worker], "a process of the replica is gone")
            finally:
                self.leave()
        raise ReplicaLostError(
            f"gossip_ext: a process of this replica (worker {self.worker}, {self.shards} shard "
            f"processes; this is shard {self.shard}) is gone, so the replica left the job and "
            "the other replicas train on without it; start a new replica (all of its shard "
            f"processes) to replace it. The replica's group said: {text}"
        ) from None

    def _release(self, *, in_background: bool = False) -> None:
        if self.leader is not None:
            return  # the leader's group is its worker's: released there
        holder, self._group = [self._group], None
        elastic_worker.let_go(holder, in_background=in_background)

    def answering(self, workers: Sequence[int]) -> list[int]:
        """Those of ``workers`` (replicas) whose leader answers over the leaders' epoch group
        (Note [A silence is confirmed over the group]); none asked from another process of the
        replica, which holds no responder's group: its watch goes by the store alone."""
        return self.leader.answering(workers) if self.leader is not None else []

    def message_sealing(self) -> Sealing | None:
        """How this epoch's gossip messages of this shard are sealed on the wire."""
        return self.client.link_sealing(self.epoch, self.messages, part=f"/shard{self.shard}")

    def nccl_rendezvous(self) -> tuple[dist.Store, str]:
        prefix = f"epoch/{self.epoch.number}/nccl/shard{self.shard}"
        return dist.PrefixStore(prefix, self.client.rendezvous_store), "unique_id"


class ShardedElasticMembership(runtime.ElasticMembership):
    """ElasticMembership for a process of a sharded replica: epochs change for the whole replica
    at once (a failure waits for the step boundary), and a handoff carries this process's shard
    of the model and of the optimizer state."""

    def __init__(self, host: runtime.Host, membership, timeout, comm_device, shard_group):
        member = ReplicaMember(
            membership.address,
            membership.min_workers,
            timeout,
            shard_group,
            host.device,
            secret=trust.job_secret(membership.secret),
            fingerprint=runtime.fingerprint_of(host, membership, shard_group.size()),
            messages=membership.messages,
        )
        super().__init__(host, membership, timeout, comm_device, worker=member)
        # A peer's failure seen by this process, until the replica agrees to change epoch.
        self._failure: elastic_worker.Failure | None = None
        # FSDP2's all-gathers and reduce-scatters, forward and backward: a lost process of the
        # replica raises ReplicaLostError from whichever meets it.
        replica_collectives.install(host.module, self._lose_replica)

    def guard(self, fn: Callable, *args) -> Any:
        """``fn(*args)``; a peer's failure is kept for the step boundary (the epoch's later
        rounds are dropped until then: the failed one changed nothing)."""
        if self._failure is not None:
            return None
        try:
            return fn(*args)
        except Exception as error:
            if not elastic_worker.is_peer_failure(error):
                raise
            self._failure = elastic_worker.Failure.of(error)
        return None

    def run_module(self, module: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Any:
        """The forward, whose FSDP2 all-gathers are the replica's first collectives of a step: a
        failure there is a process of the replica gone (ReplicaLostError, after leaving)."""
        return replica_collectives.run_or_lose(self._lose_replica, module, *inputs, **kwargs)

    def _lose_replica(self, error: BaseException) -> NoReturn:
        """A process of the replica is gone (``error``): leaves, and raises ReplicaLostError, the
        same on every later call."""
        try:
            self.worker.lose_replica(error)
        except ReplicaLostError as lost:
            self._stopped = lost
            raise

    def at_step_boundary(self) -> None:
        wants = self._failure is not None or self.worker.changed()
        try:
            change, failure = self.worker.agree(wants, self._failure)
        except ReplicaLostError as error:
            self._stopped = error
            raise
        if change:
            self._failure = None
            self._change_epoch(failure)

    def leave(self) -> None:
        self._failure = None  # leaving: nothing to change to
        super().leave()

    def _try_to_enter(self, change, outer_state=None) -> elastic_worker.Failure | None:
        """Enters the epoch on every process of the replica, or on none: a handoff that failed
        on one shard (its donor or joiner died) sends the whole replica to the next epoch, as
        the other replicas' processes of that shard go there too."""
        failure = super()._try_to_enter(change, outer_state)
        try:
            retry, failure = self.worker.agree(failure is not None, failure)
        except ReplicaLostError as error:
            self._stopped = error
            raise
        if not retry:
            self.worker.confirm_ready()
        return failure if retry else None

    # ----------------------------------------------------------------------------- handoff

    def _model_state(self, module: torch.nn.Module) -> dict[str, Any]:
        return {
            "shards": dict(replicas.local_shards(module)),
            "buffers": dict(module.named_buffers()),
        }

    @torch.no_grad()
    def _load_model_state(self, module: torch.nn.Module, state: Mapping[str, Any]) -> None:
        shards = dict(replicas.local_shards(module))
        if shards.keys() != state["shards"].keys():
            raise RuntimeError(
                "gossip_ext: the donor replica's parameters are not this replica's: "
                f"{sorted(state['shards'])} against {sorted(shards)}"
            )
        for name, shard in shards.items():
            shard.copy_(state["shards"][name])
        for name, buffer in module.named_buffers():
            buffer.copy_(state["buffers"][name])

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return replicas.local_optimizer_state(optimizer.state_dict())

    def _load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        optimizer.load_state_dict(replicas.sharded_optimizer_state(optimizer, state))
