"""GossipDataParallel: data-parallel training by gossip instead of all-reduce. The wrapper faces
the module (forward, the optimizer hook, train/eval, the checkpoint); ``assembly`` builds the parts
it owns, from the layers below (see the package docstring)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _buffers, _checkpoint, _validation, algorithms, assembly
from gossip_ext import flat_keywords as _flat
from gossip_ext._gossip_view import GossipView
from gossip_ext._membership_view import MembershipView
from gossip_ext._outer_view import OuterView
from gossip_ext.membership import runtime as membership_runtime
from gossip_ext.sharded import replicas as sharded
from gossip_ext.sharded.elastic import ShardedElasticMembership

__all__ = ["GossipDataParallel"]


class GossipDataParallel(nn.Module, GossipView, MembershipView, OuterView):
    """Data-parallel training where workers average parameters with a few peers per step.

    Instead of an all-reduce of gradients every step (DistributedDataParallel), every worker
    takes its own optimizer step and then gossips: it sends a share of its parameters to one or
    a few peers of a rotating graph and absorbs what its in-peers sent before its next forward
    (Stochastic Gradient Push, Assran et al., ICML 2019). The compiled engine holds the
    parameters in one flat buffer per dtype, so a round needs no copies.

    What users may rely on (docs/design.md has the why):

    - Call :meth:`transfer_params` after every ``optimizer.step()``, or let
      :meth:`register_optimizer` do it; the round is absorbed by the next forward (synchronous),
      the next :meth:`transfer_params` (``overlap``), or the first forward that finds it done
      (``synch_freq``).
    - The parameters are always a valid model: whenever you read them between steps
      (``model.module``, its ``state_dict()``, after ``eval()``, after catching an error) they
      hold the last absorbed model or the latest optimizer step's, never a share in flight;
      ``eval()``, :meth:`sync_comms` and ``state_dict()`` absorb the round in flight first. Copy
      into a parameter, never replace its storage, and do not write it between
      :meth:`transfer_params` and the next forward (synchronous modes send it in place).
    - A failed round (a peer timed out or died: :class:`gossip_ext.PeerTimeoutError`, a
      TimeoutError; a non-finite message: :class:`gossip_ext.NonFiniteError`) stays raised by
      every later call, naming the peers and the round; one that timed out or lost a peer
      changed nothing (a non-finite one was absorbed when detected). A failed exact average
      writes nothing.
    - Construction broadcasts rank 0's parameters (as DDP does). With ``nprocs_per_node > 1``,
      :meth:`sync_comms`, ``eval()`` and ``state_dict()`` are collective over a machine's
      processes, as the forward is.

    Args:
        module (nn.Module): the model; its parameters floating point, on one device.
        gossip (SGP, PushPull, AsyncSGP or None): what happens between steps (default
            ``SGP()``: push-sum over a 1-peer exponential graph, synchronous, full precision);
            ``AsyncSGP()``: every worker at its own pace; None: no gossip (LocalSGD, DiLoCo).
            See :mod:`gossip_ext.algorithms`.
        outer (Average, SlowMo, DiLoCo, AsyncDiLoCo or None): what takes a round's place every
            few steps (default: nothing); ``AsyncDiLoCo`` with ``gossip=None``.
        membership (Elastic, optional): an elastic job: no ``init_process_group`` (a module
            sharded by FSDP2: only its replica's own, each replica a worker); workers that die,
            stall or leave are survived and joiners receive the state. Not with
            ``process_group`` nor ``nprocs_per_node > 1``.
        nprocs_per_node (int): processes per machine: gradients averaged inside a machine, one
            process a machine gossips (default: 1).
        process_group (ProcessGroup, optional): the group to train in (default: the default one).
        comm_device (torch.device, optional): where messages travel from (default: the
            parameters' device: NCCL for CUDA, gloo for CPU); ``'cpu'`` with CUDA parameters
            stages them through pinned host buffers over a gloo group.
        timeout (timedelta): how long a round waits for a peer before raising
            :class:`gossip_ext.PeerTimeoutError` naming it; a closed connection raises at once
            (default: 5 minutes).
        broadcast_buffers (bool): rank 0's buffers to every rank before each training forward,
            as DDP does (default: False).
        gossip_buffers (bool): floating-point buffers travel with the parameters in every round;
            exact averages average them whatever this says (default: False).
        log_every (int): every ``log_every`` steps, log a free estimate of the consensus distance
            to the ``gossip_ext.gossip.consensus`` logger (:attr:`consensus_estimate`); 0: never.
        verbose (bool): log every round at INFO level (default: False).
        **flat_keywords: the flat spelling of earlier releases, SGP's and fairscale's names
            (``overlap=``, ``global_avg_freq=``, ``sync_every=``, ``membership="HOST:PORT"``,
            ...), translated into the objects by :mod:`gossip_ext.flat_keywords`; not beside them.

    Attributes:
        module (nn.Module): the wrapped module.
        runtime (gossip_ext.assembly.Runtime): what the wrapper runs on, as DDP's ``reducer``:
            the inner mix and its engine, the outer steps, the step clock. Read it; its parts
            change only through the wrapper's calls.

    Example::

        >>> dist.init_process_group("gloo")
        >>> model = gossip_ext.GossipDataParallel(net, gossip_ext.SGP(overlap=True))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model.register_optimizer(opt)  # transfer_params() after every opt.step()
        >>> for x, y in loader:
        ...     loss = nn.functional.mse_loss(model(x), y)
        ...     opt.zero_grad(); loss.backward(); opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        gossip: algorithms.Gossip | None | object = _flat.DEFAULT_GOSSIP,
        outer: algorithms.Outer | None = None,
        membership: algorithms.Elastic | str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        comm_device: torch.device | str | None = None,
        timeout: timedelta = timedelta(minutes=5),
        nprocs_per_node: int = 1,
        broadcast_buffers: bool = False,
        gossip_buffers: bool = False,
        log_every: int = 0,
        verbose: bool = False,
        **flat_keywords: Any,
    ):
        super().__init__()
        _validation.check_module(module)
        # The objects, given as objects or as flat keywords, and the settings every part shares:
        # all that the runtime reads, checked on every rank before any communication.
        config = _flat.configuration(
            gossip,
            outer,
            membership,
            flat_keywords,
            nprocs_per_node=nprocs_per_node,
            comm_device=comm_device,
            timeout=timeout,
            broadcast_buffers=broadcast_buffers,
            gossip_buffers=gossip_buffers,
            log_every=log_every,
            verbose=verbose,
        )
        config.check_group(process_group)
        self.configuration, self.module = config, module
        self.algorithms = (config.gossip, config.outer, config.membership)
        # The settings SGP's scripts read from its wrapper, by their names there.
        self.overlap, self.synch_freq = config.overlap, config.synch_freq
        self.push_sum, self.mixing = config.push_sum, config.mixing
        self.start_in_forward, self.nprocs_per_node = config.start_in_forward, nprocs_per_node
        # A module sharded by FSDP2 in its replica gossips its local shards
        # (gossip_ext.sharded.replicas); the group of the replica's processes, or None.
        shard_group = sharded.replica_layout(
            module, process_group, nprocs_per_node, config.membership, gossip_buffers
        )
        named = sharded.local_shards(module)
        device = _validation.check_parameters(module, named)
        buffer_policy = _buffers.BufferPolicy(
            module, device, broadcast_buffers=broadcast_buffers, gossip_buffers=gossip_buffers
        )
        _validation.check_no_sparse_gradients(module, nprocs_per_node)
        config.check_device(device)
        # nprocs_per_node > 1: whether the gossiping process may hold parameters that the machine's
        # other processes have not received. Every process of the machine tracks it alike (it
        # changes with transfer_params() and the forward), so they agree on when to broadcast.
        self._node_behind = False
        self._order = _validation.CallOrder(module, config.overlap, config.start_in_forward)
        # What the wrapper runs on, and what runs over its group (built by the membership).
        self.runtime = assembly.Runtime(
            module, config, named, buffer_policy, device, shard_group, self._order
        )
        self._members = membership_runtime.of_job(self.runtime, config.membership,
            process_group, timeout, comm_device,
            replica_membership=ShardedElasticMembership)  # fmt: skip
        self._members.start()
        if self.runtime.hierarchy is not None:
            self.runtime.hierarchy.hook_gradients([p for _, p in named])

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group this worker trains in (an elastic job's: its epoch's; None between
        epochs)."""
        return self.runtime.process_group

    # ----------------------------------------------------------------------------- training

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._members.check_member()
        if self.runtime.shard_group is not None:
            sharded.reshard(self.module)
        self.runtime.watch.check(self.module)
        self._order.forward(self.training, self.runtime.steps)
        self._members.guard(self.runtime.raise_if_failed)  # a failed round or outer step
        self._members.guard(self.runtime.mix.before_forward, self.training)
        if self.runtime.hierarchy is not None:
            self.runtime.hierarchy.receive_parameters()
            self._node_behind = False
        self.runtime.outer.before_forward()
        if self.training:
            self.runtime.buffer_policy.before_training_forward(self.runtime.group)
            if self.start_in_forward:
                self._transfer(_validation.BY_FORWARD)
        self._order.module_runs(self.training, self.runtime.steps)
        return self._members.run_module(self.module, *inputs, **kwargs)

    def transfer_params(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Starts a gossip round with the parameters the optimizer step just produced, or runs
        the outer step that takes its place. Call it after every ``optimizer.step()`` (or use
        :meth:`register_optimizer`); ``optimizer``: the one that stepped, whose learning rates
        SlowMo reads, where it is not the registered one.

        Raises RuntimeError under ``start_in_forward=True`` (the forward starts the rounds), and,
        before any communication, if it was already called in this step (by hand and by the
        hook, or twice under ``overlap=True``): two rounds would run in one step.
        """
        if self.start_in_forward:
            raise RuntimeError(
                "start_in_forward=True: every training forward starts the gossip round, so do "
                "not call transfer_params() (nor register_optimizer())"
            )
        if optimizer is not None:
            _validation.check_type(
                "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer"
            )
            if self.runtime.outer.needs_inner_lr:
                _validation.check_learning_rates(optimizer)
            self.runtime.optimizer_ref = weakref.ref(optimizer)
        self._transfer(_validation.BY_HAND)

    def _transfer(self, caller: str) -> None:
        self._members.check_member()
        # Checked on every rank, gossiping or not, so that all of them raise alike.
        self.runtime.watch.check(self.module)
        # A failed round or exact average, before this step counts; also where no round would
        # start (LocalSGD has no engine).
        self._members.guard(self.runtime.raise_if_failed)
        self._order.transfer(caller)
        if self.runtime.outer.needs_inner_lr:
            _validation.check_slowmo_optimizer(
                self.runtime.outer.sync_every, self.runtime.optimizer
            )
        self._members.at_step_boundary()  # where a membership change takes effect
        self.runtime.steps += 1
        self._members.guard(self._end_step)
        self._node_behind = True
        self._order.transferred(caller)

    def register_optimizer(self, optimizer: torch.optim.Optimizer):
        """Calls :meth:`transfer_params` after every ``optimizer.step()``; returns the hook's
        handle (``handle.remove()`` undoes it). SlowMo (``slowmo_freq``) reads the learning rates
        of this optimizer's param groups."""
        _validation.check_type(
            "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer"
        )
        if self.start_in_forward:
            raise RuntimeError(
                "start_in_forward=True: every training forward starts the gossip round, so "
                "register_optimizer() would start a second one after every step"
            )
        if self.runtime.outer.needs_inner_lr:
            _validation.check_learning_rates(optimizer)
        self.runtime.optimizer_ref = weakref.ref(optimizer)
        self._members.optimizer_registered(optimizer)  # a joiner's: the donor's state
        return optimizer.register_step_post_hook(
            lambda *_: self._transfer(_validation.BY_OPTIMIZER)
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside skip the node-local gradient averaging of
        ``nprocs_per_node > 1`` (as DDP's no_sync). Do not step the optimizer inside."""
        with (
            contextlib.nullcontext()
            if self.runtime.hierarchy is None
            else self.runtime.hierarchy.no_sync()
        ):
            yield

    def sync_comms(self) -> None:
        """Waits for the round in flight, and any round still owed, and absorbs them (under
        ``AsyncSGP``: the messages that have arrived; :meth:`settle` waits for all). Raises the
        error of a failed round (naming the peer and the round). With ``nprocs_per_node > 1`` the
        machine's other processes receive the result (collective over the machine)."""
        self._order.step_finished()
        self._members.check_member()
        self._members.guard(self.runtime.raise_if_failed)
        self._members.guard(self.runtime.mix.drain)
        if self.runtime.hierarchy is not None and self._node_behind:
            self.runtime.hierarchy.receive_parameters()
            self._node_behind = False

    def train(self, mode: bool = True) -> GossipDataParallel:
        """As ``nn.Module.train``; ``train(False)`` (``eval()``) also absorbs the gossip in flight
        (:meth:`sync_comms`), so that the module is the model the moment it returns."""
        if not isinstance(mode, bool):
            raise TypeError(f"mode must be a bool, got {mode!r}")
        super().train(mode)
        if not mode:
            self.sync_comms()
        return self

    def _end_step(self) -> None:
        """The gossip round, or the outer step in its place, that ends the step just counted."""
        self.runtime.mix.arm(self.runtime.steps)
        if self.runtime.outer.end_step(self.runtime.steps, self._step_context):
            self.runtime.mix.after_step()

    # ----------------------------------------------------------------------------- checkpoint

    def get_extra_state(self) -> dict[str, Any]:
        self.sync_comms()
        return _checkpoint.extra_state(self)

    def set_extra_state(self, state: Mapping[str, Any]) -> None:
        _checkpoint.restore_extra_state(self, state)

    def state_dict(self, *args, **kwargs):
        """The module's state under ``module.`` after finishing gossip in flight, plus what
        resuming needs under ``_extra_state`` (the push-sum state, the step count, the outer
        state). Resuming from it on every rank, with the optimizer's state and the data position,
        continues the run exactly; under ``overlap=True`` saving absorbs the round in flight, so
        it is itself a step of the trajectory. The plain module's weights are the ``module.``
        keys, without the prefix.
        """
        self.sync_comms()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ):
        """As ``nn.Module.load_state_dict``, for this wrapper's own checkpoints, and also for the
        formats of the reference SGP (``{'state_dict', 'ps_weight', 'is_ps_numerator'}``), of
        fairscale's SlowMoDistributedDataParallel (``module.*`` keys with ``ps_weight`` and
        ``is_sgp_ps_numerator``) and of DistributedDataParallel (``module.*`` keys).

        It loads whole or not at all: every key, shape and the extra state are checked before
        anything is written, and a load that raises leaves the module, the step count, the
        push-sum and outer state (and the optimizer over the parameters) as they were. A
        checkpoint of other algorithms (DiLoCo's into SGP) is refused naming both; with
        ``strict=False`` it loads with a warning naming what restarts from scratch.

        A foreign checkpoint carries no gossip round: the schedule restarts at round 0 on every
        rank, with the saved push-sum weight (1 under lazy mixing), and parameters saved as
        push-sum numerators are de-biased.
        """
        return _checkpoint.load(self, state_dict, strict=strict, assign=assign)
