"""Who trains with whom, inside GossipDataParallel: a static job's fixed process group, or an
elastic job's membership epochs (``membership=Elastic(...)``).

The wrapper asks its membership three things, whatever the job: to run every call that
communicates (:meth:`StaticMembership.guard`: an elastic worker survives a peer's failure there),
whether it may still train (:meth:`check_member`), and, at each step boundary, whether the
members changed (:meth:`at_step_boundary`). A static job answers trivially; an elastic one moves
the wrapper to the next epoch, keeping the model, the optimizer, the step count and the outer
state, and hands that state to the workers that joined.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gossip_ext.averagings import failures
from gossip_ext.errors import ConfigurationMismatch
from gossip_ext.gossip.inner import InnerMix
from gossip_ext.gossip.transport import Sealing, available_sealing, choose_transport
from gossip_ext.membership import admission, handoff, trust
from gossip_ext.membership import elastic as _elastic_worker
from gossip_ext.membership.epochs import ENCRYPTED, PLAIN
from gossip_ext.membership.heartbeats import DEFAULT_TIMINGS


class OuterState(Protocol):
    """What an epoch change does with the outer steps' state (``outer.interface.OuterRuntime``,
    a layer above): kept across the change, handed to a joiner, aligned to the step count."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(
        self, state: Mapping[str, object], members_changed: bool = False
    ) -> None: ...

    def load_donor_state(self, state: Mapping[str, object]) -> None: ...

    def align_in_flight(self, step: int) -> None: ...


class Described(Protocol):
    """A configuration that describes itself in plain values (``algorithms.Configuration``)."""

    def describe(self, rule: object) -> Mapping[str, object]: ...


class Host(Protocol):
    """The membership's view of the wrapper: its runtime (``assembly.Runtime``), which the
    membership asks to build what runs over each epoch's group and to let go of it, and whose
    model, clock, optimizer and outer state an epoch change keeps and a joiner receives."""

    steps: int
    mix: InnerMix

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def configuration(self) -> Described: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def shard_group(self) -> dist.ProcessGroup | None: ...

    @property
    def outer(self) -> OuterState: ...

    @property
    def process_group(self) -> dist.ProcessGroup | None: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    def build(
        self,
        group: dist.ProcessGroup,
        initial: bool,
        peers_per_itr: int | None = None,
        rendezvous: tuple[dist.Store, str] | None = None,
        sealing: Sealing | None = None,
    ) -> None: ...

    def close_mix(self) -> None: ...

    def drop_epoch_parts(self) -> None: ...

    def parameters_loaded(self) -> None: ...


def check_messages(messages: str, secret: bytes | None) -> None:
    """Refuses, before joining, an ``Elastic(messages=...)`` this job or build cannot keep."""
    if messages == ENCRYPTED and secret is None:
        raise ValueError(
            "Elastic(messages='encrypted') needs the job's secret to key the messages with: set "
            f"{trust.SECRET_ENV} (or {trust.SECRET_FILE_ENV}), or Elastic(..., secret=...)"
        )
    if messages != PLAIN and secret is not None and not available_sealing():
        raise ValueError(
            f"Elastic(messages={messages!r}): this gossip_ext build has no sealed messages (it "
            "was built without OpenSSL's libcrypto): install libssl-dev (or openssl-devel) and "
            "rebuild, or pass messages='plain' on a network you trust"
        )


def of_job(
    host: Host,
    membership,
    process_group,
    timeout,
    comm_device,
    *,
    replica_membership: Callable[..., ElasticMembership],
):
    """The wrapper's membership: a static job's group, an elastic job's epochs, or, for a module
    sharded over ``shard_group`` (its replica), the epochs of an elastic job of replicas, which
    ``replica_membership(host, membership, timeout, comm_device, shard_group)`` builds
    (the wrapper hands the class down: gossip_ext.sharded.elastic builds on this module)."""
    shard_group = host.shard_group
    if membership is None:
        return StaticMembership(host, process_group)
    if shard_group is not None:
        if membership.timings != DEFAULT_TIMINGS:
            # A replica's processes build their membership clients in gossip_ext.sharded.elastic,
            # at the default timings: refused rather than silently kept at the defaults.
            raise ValueError(
                f"membership={membership!r}: a sharded replica keeps the default heartbeat_s="
                f"{DEFAULT_TIMINGS.heartbeat_s:g} and silent_s={DEFAULT_TIMINGS.silent_s:g}"
            )
        return replica_membership(host, membership, timeout, comm_device, shard_group)
    return ElasticMembership(host, membership, timeout, comm_device)


class StaticMembership:
    """A job whose members are its process group's ranks, for its whole life."""

    worker_id = None
    epoch = None

    def __init__(self, host: Host, process_group: dist.ProcessGroup | None):
        self._host = weakref.ref(host)
        self._process_group = process_group

    def start(self) -> None:
        """Builds the wrapper's runtime over the group, every rank from rank 0's parameters."""
        host = self._host()
        if host is None:  # the wrapper was collected before it started: nothing to build
            return
        group = dist.group.WORLD if self._process_group is None else self._process_group
        if group is None:
            raise RuntimeError(
                "GossipDataParallel: no process group: call torch.distributed."
                "init_process_group() first, or pass process_group="
            )
        host.build(group, initial=True)
        # The engine's threads must not outlive the interpreter: at exit, it is let go of first.
        weakref.finalize(host, self._close_at_end)

    def _close_at_end(self) -> None:
        host = self._host()
        if host is not None:
            host.close_mix()

    def guard(self, fn: Callable, *args) -> Any:
        return fn(*args)

    def run_module(self, module: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward (a sharded replica's process: its failures are the replica's)."""
        return module(*inputs, **kwargs)

    def check_member(self) -> None:
        pass

    def at_step_boundary(self) -> None:
        pass

    def optimizer_registered(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def leave(self) -> None:
        raise RuntimeError("leave() is for an elastic job's workers (membership=Elastic(...))")


class ElasticMembership:
    """An elastic job's worker (gossip_ext.membership.elastic): it joins, trains in epochs with a
    process group per epoch over the live workers, moves to the next epoch when a member dies,
    stalls or leaves (the failed round or outer step changed nothing: Note [The parameters are the
    model]) and hands its state to the workers that join. Holds the wrapper's runtime (``host``)
    weakly: the elastic watch's thread must not keep it alive."""

    def __init__(self, host: Host, membership, timeout, comm_device, worker=None):
        # Before joining, so that a worker that cannot gossip is refused without disturbing the
        # job: an epoch's group is gloo; CUDA parameters gossip over an own NCCL communicator of
        # the epoch, or host buffers over the group (comm_device="cpu").
        choose_transport(host.device, comm_device, "gloo")
        secret = trust.job_secret(membership.secret)
        check_messages(membership.messages, secret)
        self._host = weakref.ref(host)
        # ``worker``: this process's part in the epochs, where it is not a whole worker (a
        # process of a sharded replica: gossip_ext.sharded.elastic).
        self.worker = worker or _elastic_worker.ElasticWorker(
            membership.address,
            membership.min_workers,
            timeout,
            "gloo",
            secret=secret,
            fingerprint=fingerprint_of(host, membership),
            timings=membership.timings,
            messages=membership.messages,
        )
        # The donor's optimizer state, until register_optimizer() hands it to the optimizer.
        self._handed_optimizer_state = None
        self._holds_state = False
        # Why this worker stopped (removed, or too few workers left): raised by every call.
        self._stopped: BaseException | None = None
        self.worker.on_silent = _abandon_rounds_of(self._host)

    def start(self) -> None:
        """Joins the job: the first epoch this worker is a member of, and the state of a live
        member if the job was already training."""
        change = self.worker.join()
        failure = self._try_to_enter(change)
        del change
        if failure is not None:
            self._change_epoch(failure)  # the donor died during the handoff: another one
        # Leaves when the process exits or the wrapper is collected, whichever is first, as
        # leave() does: a script that returns without calling it is seen to leave, not to die.
        weakref.finalize(self._live_host(), self._leave_at_end)

    def _live_host(self) -> Host:
        """The wrapper's runtime, which lives as long as the wrapper that calls in here."""
        host = self._host()
        if host is None:
            raise RuntimeError("gossip_ext: this elastic worker's GossipDataParallel was collected")
        return host

    @property
    def worker_id(self) -> int:
        return self.worker.worker

    @property
    def epoch(self) -> int | None:
        """The epoch this worker trains in; None before it joined one."""
        epoch = self.worker.epoch
        return None if epoch is None else epoch.number

    def nccl_rendezvous(self):
        return self.worker.nccl_rendezvous()

    def check_member(self) -> None:
        if self._stopped is not None:
            raise self._stopped
        if self.worker.left:
            raise RuntimeError(
                f"gossip_ext: worker {self.worker.worker} left the job (leave()); its module "
                "holds its last model. A new GossipDataParallel joins as a new worker"
            )

    def guard(self, fn: Callable, *args) -> Any:
        """``fn(*args)``; a peer's failure (it died, stalled or left) moves this worker to the
        next epoch instead of raising. The failed round or outer step changed nothing and is
        dropped."""
        try:
            return fn(*args)
        except Exception as error:
            if not _elastic_worker.is_peer_failure(error):
                raise
            # Only its text and peers leave this block: the traceback's frames hold the failed
            # engine, whose transport would keep the epoch's group, and its connections, open.
            failure = _elastic_worker.Failure.of(error)
        del fn, args  # a bound method of the old inner mix holds its engine, too
        self._change_epoch(failure)
        return None

    def run_module(self, module: torch.nn.Module, *inputs: Any, **kwargs: Any) -> Any:
        return module(*inputs, **kwargs)

    def at_step_boundary(self) -> None:
        """Where a membership change takes effect."""
        if self.worker.changed():
            self._change_epoch(None)

    def optimizer_registered(self, optimizer: torch.optim.Optimizer) -> None:
        if self._handed_optimizer_state is not None:
            # The donor's, on joining.
            self._load_optimizer_state(optimizer, self._handed_optimizer_state)
            self._handed_optimizer_state = None

    def leave(self) -> None:
        """This worker's last round is delivered, and the others drop it at their next step
        boundary, without waiting for a timeout."""
        if self.worker.left:
            return
        host = self._live_host()
        try:
            host.mix.drain()
        except Exception as error:  # noqa: BLE001 - leaving anyway; the model is as it was
            if not _elastic_worker.is_peer_failure(error):
                raise
        self.worker.leaving_epoch()
        host.close_mix()
        self.worker.leave()

    def _leave_at_end(self) -> None:
        """The process exits, or the wrapper was collected, without leave(): leaves as leave()
        does where the wrapper is still there to deliver its last round, and lets go of the
        engine, whose threads must not outlive the interpreter; else only leaves."""
        if self.worker.left:
            return
        if self._host() is None:
            self.worker.leave()
            return
        try:
            self.leave()
        finally:
            self.worker.leave()  # whatever the drain met: leaving anyway

    # ----------------------------------------------------------------------------- epochs

    @staticmethod
    def _let_go_of_the_epoch(host: Host) -> None:
        """Nothing may keep the epoch's group alive: gloo closes its connections only when the
        group is freed, and a peer still waiting on this worker's messages must see them close
        now rather than time out. A round in flight is dropped, never absorbed."""
        host.drop_epoch_parts()

    def _change_epoch(self, failure: _elastic_worker.Failure | None) -> None:
        """Moves to the next epoch, keeping the model, the optimizer, the step count and the
        outer state; the push-sum weight restarts at 1. Retries while members fail during the
        change itself."""
        host = self._live_host()
        self.worker.leaving_epoch()
        outer_state = host.outer.state_dict() if self._holds_state else None
        self._let_go_of_the_epoch(host)
        while True:
            try:
                change = self.worker.next_epoch(failure)
            except Exception as error:
                self._stopped = error  # raised again by every later call
                raise
            failure = self._try_to_enter(change, outer_state)
            if failure is None:
                return
            # A member failed while the epoch was being entered: let go of its group as above.
            change = None
            self.worker.leaving_epoch()
            self._let_go_of_the_epoch(host)

    def _try_to_enter(
        self, change: _elastic_worker.Change, outer_state=None
    ) -> _elastic_worker.Failure | None:
        """Enters the epoch of ``change``; the failure of a member that died meanwhile (a donor
        during its handoff, a joiner while it received), or None."""
        try:
            self._enter_epoch(change, outer_state)
        except ConfigurationMismatch as error:
            return self._without_the_differing(error, change)
        except Exception as error:
            if not _elastic_worker.is_peer_failure(error):
                raise
            return _elastic_worker.Failure.of(error)
        return None

    def _without_the_differing(
        self, error: ConfigurationMismatch, change: _elastic_worker.Change
    ) -> _elastic_worker.Failure:
        """A member configured unlike the epoch's rank 0 (the oldest member, whose configuration
        is the job's) got past admission (a difference the fingerprint does not hold, such as an
        outer optimizer's hyperparameters): it leaves the job and raises, and the others form the
        next epoch without it. Never the others: one bad worker must not end the job."""
        if change.rank in error.ranks:
            self._stopped = error
            self.worker.leave()
            raise error
        differing = [change.epoch.members[r] for r in error.ranks]
        return _elastic_worker.Failure(f"worker(s) {differing} refused: {error}", error.ranks)

    def _enter_epoch(self, change: _elastic_worker.Change, outer_state=None) -> None:
        """Builds everything over the epoch's group; then the donor hands its state to the
        workers that joined, and a joiner loads it before anything else happens."""
        host = self._live_host()
        first = not self._holds_state
        # The members noticed the change at different steps (a neighbour of the dead worker one
        # step before the others): they go on from the latest, so that every outer step of the
        # epoch comes at the same step on all of them. They also keep the peers per round that
        # set_peers_per_itr() gave them, which a joiner (0: none of its own) takes on.
        held = torch.tensor(
            [host.steps, host.mix.graph.peers_per_itr] if self._holds_state else [0, 0],
            dtype=torch.int64,
        )
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=change.group)
        host.steps = int(held[0])
        host.build(
            change.group,
            initial=first and change.epoch.number == 0,
            peers_per_itr=int(held[1]) or None,
            rendezvous=self.nccl_rendezvous(),
            sealing=self.worker.message_sealing(),
        )
        if outer_state is not None:
            host.outer.load_state_dict(outer_state, members_changed=True)
        joined = [change.epoch.rank(j) for j in change.joined]
        donor = change.donor  # None: nobody joined
        if donor is not None and self.worker.worker in change.joined:
            limit = handoff.handoff_limit(host.module)
            state = handoff.receive_state(donor, change.group, host.device, limit)
            self._take_handoff(host, state)
            self.worker.mark_ready()
        elif donor is not None and change.rank == donor:
            handoff.send_state(self._handoff(host), joined, change.group)
        host.outer.align_in_flight(host.steps)
        self._holds_state = True
        host.parameters_loaded()

    def _handoff(self, host: Host) -> dict[str, Any]:
        """What a joiner receives from its donor: the model (parameters and buffers), the step
        count, the outer state and the registered optimizer's state (the peers per round it
        learned with every member when the epoch began)."""
        optimizer = host.optimizer
        return {
            "module": self._model_state(host.module),
            "steps": host.steps,
            "outer": host.outer.state_dict(),
            "optimizer": None if optimizer is None else self._optimizer_state(optimizer),
        }

    # What of the model and the optimizer a handoff carries, and how a joiner loads it: their
    # state dicts (a sharded replica's process: its shards, gossip_ext.sharded.elastic).

    def _model_state(self, module: torch.nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def _load_model_state(self, module: torch.nn.Module, state: Mapping[str, Any]) -> None:
        module.load_state_dict(state)

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def _load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        optimizer.load_state_dict(dict(state))

    def _take_handoff(self, host: Host, state: Mapping[str, Any]) -> None:
        self._load_model_state(host.module, state["module"])
        host.steps = int(state["steps"])
        host.outer.load_donor_state(state["outer"])
        self._handed_optimizer_state = state["optimizer"]
        optimizer = host.optimizer
        if optimizer is not None and state["optimizer"] is not None:
            self._load_optimizer_state(optimizer, state["optimizer"])
            self._handed_optimizer_state = None


def fingerprint_of(host: Host, membership, shards: int = 1) -> dict[str, object]:
    """What a worker of ``host``'s job must share with it before it may join
    (:mod:`gossip_ext.membership.admission`): its configuration, the membership's timings (a
    worker that waited longer for a silent one than the others would accuse no one they do) and
    its parameters' layout (a sharded module's whole parameters: every replica's are the same)."""
    named = host.module.named_parameters()
    return admission.fingerprint(
        job=membership.job,
        shards=shards,
        configuration=host.configuration.describe(None),
        membership=dataclasses.asdict(membership.timings),
        parameters=[(n, tuple(p.shape), str(p.dtype)) for n, p in named],
    )


def _abandon_rounds_of(hosts: weakref.ref[Host]) -> Callable[[str], None]:
    """What an elastic worker's watch calls, from its thread, when a member's heartbeat stopped:
    the wrapper's round in flight, and its outer step's collective, fail at once (a TimeoutError
    saying why), instead of waiting out the timeout for that member. Holds the wrapper's runtime
    weakly: the watch must not keep it alive."""

    def abandon(why: str) -> None:
        host = hosts()
        if host is None:
            return
        host.mix.abandon(why)
        # The outer steps' collectives over the epoch's group, in flight or still to come.
        if host.process_group is not None:
            failures.give_up_waits_on(host.process_group, why)

    return abandon
