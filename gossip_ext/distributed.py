"""GossipDataParallel: data-parallel training by gossip instead of all-reduce.

The wrapper is what faces the module: forward, the optimizer hook, train/eval, the checkpoint,
argument checks. What it composes lives beside it, one module each (see the package docstring):
the inner mix of gossip rounds (``inner``), the outer steps and their rules (``outer``,
``outer_rules``), the buffer policy (``_buffers``), several processes per machine
(``_hierarchy``); argument checks in ``_validation``, the consensus metric in ``consensus``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import (
    _buffers,
    _checkpoint,
    _validation,
    algorithms,
    assembly,
    consensus,
    inner,
    membership_runtime,
    outer,
)
from gossip_ext import flat_keywords as _flat
from gossip_ext.graphs import GraphBase, NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import UniformMixing

__all__ = ["GossipDataParallel"]

# What gossip= defaults to when not given: SGP(), unless flat keywords say otherwise.
_DEFAULT_GOSSIP = object()


def _parameter_versions(module: nn.Module) -> int:
    """The sum of the parameters' version counters: it changes when anything writes them in
    place, as every optimizer step does."""
    return sum(p._version for p in module.parameters())


class GossipDataParallel(nn.Module):
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
        module (nn.Module): the model; its parameters must be floating point, on one device.
        gossip (SGP, PushPull or None): what happens between steps: a push-sum round over a
            graph after every step (:class:`~gossip_ext.SGP`, the default ``SGP()``: a 1-peer
            exponential graph, uniform mixing, synchronous, full precision), push-pull averaging
            (:class:`~gossip_ext.PushPull`, D-PSGD), or ``None``: no gossip, the workers train
            alone between outer steps (LocalSGD, DiLoCo). Their arguments (graph, mixing,
            overlap, synch_freq, message_dtype, check_finite, start_in_forward) are documented on
            the classes.
        outer (Average, SlowMo, DiLoCo or None): what happens every few steps in place of that
            step's round: an exact average (:class:`~gossip_ext.Average`), SlowMo's heavy ball
            on it (:class:`~gossip_ext.SlowMo`, which reads the learning rate of the optimizer
            given to :meth:`register_optimizer`), or DiLoCo's outer optimizer on the averaged
            pseudo-gradients (:class:`~gossip_ext.DiLoCo`, streamed in fragments, averaged
            exactly or by gossip: :class:`~gossip_ext.Exact`, :class:`~gossip_ext.ByGossip`).
            None: none (default).
        membership (Elastic, optional): an elastic job (:class:`~gossip_ext.Elastic`): the worker
            then needs no ``init_process_group``; it registers with the membership service,
            trains in epochs with a process group per epoch over the live workers, survives
            workers that die, stall or leave, and a worker started later receives the model,
            the optimizer state, the outer state and the step count from a live member before
            its first forward. Not with ``process_group`` nor ``nprocs_per_node > 1``.
        nprocs_per_node (int): processes per machine: gradients are averaged inside each machine,
            one process per machine gossips, and the others receive its parameters before every
            forward (default: 1).
        process_group (ProcessGroup, optional): the group to train in (default: the default
            group). Gossip runs over it with point-to-point messages (gloo: CPU tensors).
        comm_device (torch.device, optional): where messages travel from. Default: the
            parameters' device, i.e. NCCL for CUDA parameters, gloo for CPU ones.
            ``'cpu'`` with CUDA parameters gossips through pinned host buffers over the process
            group, which then needs gloo (``init_process_group('cpu:gloo,cuda:nccl')``): for
            networks where NCCL is not available or not the bottleneck's answer.
        timeout (timedelta): how long a round waits for a peer before raising TimeoutError
            naming the peers; a peer whose connection closes (it died) raises TimeoutError at
            once (default: 5 minutes).
        broadcast_buffers (bool): before every training forward, set every rank's buffers to rank
            0's (as DDP and fairscale's SlowMo do): one broadcast of the buffers per step
            (default: False).
        gossip_buffers (bool): floating-point buffers (BatchNorm's running statistics) travel with
            the parameters in every gossip round, so that each worker's statistics follow its
            averaged weights. Every exact average (:meth:`average_parameters`,
            ``global_avg_freq``, SlowMo) averages floating-point buffers whatever this says
            (default: False).
        log_every (int): every ``log_every`` steps, log a running estimate of the consensus
            distance at INFO level to the ``gossip_ext.consensus`` logger, read off the next
            absorbed round without communication (see :attr:`consensus_estimate`); 0: never
            (default: 0).
        verbose (bool): log every round at INFO level (default: False).
        **flat_keywords: the flat spelling of earlier releases, which SGP's and fairscale's
            scripts also use through :mod:`gossip_ext.compat` (``graph=``, ``overlap=``,
            ``message_dtype=``, ``global_avg_freq=``, ``slowmo_freq=``, ``base_algorithm=``,
            ``outer_optimizer=``, ``sync_every=``, ``fragments=``, ``membership="HOST:PORT"``,
            ...): translated into the objects above by :func:`gossip_ext.flat_keywords.from_flat`
            (every name in ``flat_keywords.FLAT_DEFAULTS``); not beside them.

    Example::

        >>> dist.init_process_group("gloo")
        >>> model = gossip_ext.GossipDataParallel(nn.Linear(10, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for x, y in loader:
        ...     loss = nn.functional.mse_loss(model(x), y)
        ...     opt.zero_grad(); loss.backward(); opt.step()
        ...     model.transfer_params()

    SlowMo over gossip (the optimizer's hook then calls :meth:`transfer_params`)::

        >>> model = gossip_ext.GossipDataParallel(net, outer=gossip_ext.SlowMo(every=48))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model.register_optimizer(opt)
    """

    def __init__(
        self,
        module: nn.Module,
        gossip: algorithms.SGP | None | object = _DEFAULT_GOSSIP,
        outer: algorithms.Average | algorithms.SlowMo | algorithms.DiLoCo | None = None,
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
        gossip, outer, membership = _algorithms_of(gossip, outer, membership, flat_keywords)
        self.algorithms = (gossip, outer, membership)
        # Every setting by name, for the checks and for the configuration the ranks compare.
        arguments = dict(
            _flat.to_flat(gossip, outer, membership),
            module=module,
            process_group=process_group,
            comm_device=comm_device,
            timeout=timeout,
            nprocs_per_node=nprocs_per_node,
            broadcast_buffers=broadcast_buffers,
            gossip_buffers=gossip_buffers,
            log_every=log_every,
            verbose=verbose,
        )
        if arguments["graph"] is None:
            arguments["graph"] = NPeerDynamicDirectedExponentialGraph()
        if arguments["mixing"] is None:
            arguments["mixing"] = UniformMixing()
        _validation.check_arguments(**arguments)
        a = arguments
        graph, mixing, push_sum, overlap = a["graph"], a["mixing"], a["push_sum"], a["overlap"]
        synch_freq, base_algorithm = a["synch_freq"], a["base_algorithm"]
        outer_average, start_in_forward = a["outer_average"], a["start_in_forward"]
        outer_device, membership, min_workers = a["outer_device"], a["membership"], a["min_workers"]

        self.module = module
        self.mixing = mixing
        self.push_sum = push_sum
        self.overlap = overlap
        self.synch_freq = synch_freq
        self.nprocs_per_node = nprocs_per_node
        self.base_algorithm = base_algorithm
        self.outer_average = outer_average
        self.start_in_forward = start_in_forward
        self.broadcast_buffers = broadcast_buffers
        self.gossip_buffers = gossip_buffers
        self.verbose = verbose
        named = list(module.named_parameters())
        device = _validation.check_parameters(module, named)
        self._buffer_policy = _buffers.BufferPolicy(
            module, device, broadcast_buffers=broadcast_buffers, gossip_buffers=gossip_buffers
        )
        _validation.check_no_sparse_gradients(module, nprocs_per_node)
        _validation.check_outer_device(outer_device, device)
        self._arguments = arguments
        self._named = named
        self._gossiped = named + self._buffer_policy.gossiped
        self._device = device
        # nprocs_per_node > 1: whether the gossiping process may hold parameters that the machine's
        # other processes have not received. Every process of the machine tracks it alike (it
        # changes with transfer_params() and the forward), so they agree on when to broadcast.
        self._node_behind = False
        # Parameter versions at the last training forward, until the first transfer_params():
        # a step taken without it is reported (see _check_rounds_started).
        self._versions_at_forward: int | None = None
        # Who called transfer_params() in this step, if anyone: a second caller is a bug.
        self._transferred = None
        self._steps = 0  # transfer_params() calls: the clock of the outer steps
        # The last optimizer given to register_optimizer() or transfer_params(), whose learning
        # rates SlowMo reads. A weak reference: its step hook refers to this wrapper, and a cycle
        # would keep both (and the engine's transport thread) alive until the garbage collector
        # runs, or past exit.
        self._optimizer_ref = None
        # The graph as constructed (what a checkpoint must match).
        self._constructed_graph = graph
        self._hierarchy = None
        self._mix = None
        if membership is None:
            self._members = membership_runtime.StaticMembership(self, process_group)
        else:
            self._members = membership_runtime.ElasticMembership(
                self, membership, min_workers, timeout, device, comm_device
            )
        self._members.start()
        if self._hierarchy is not None:
            self._hierarchy.hook_gradients([p for _, p in named])

    def _build(self, initial: bool, peers_per_itr: int | None = None) -> None:
        """Everything that runs over ``self.process_group`` (:func:`assembly.build`): at the
        start of a job, and again at every elastic epoch."""
        assembly.build(self, initial, peers_per_itr)

    # ----------------------------------------------------------------------------- training

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._members.check_member()
        self._watch.check(self.module)
        if self.training:
            self._check_rounds_started()
        self._transferred = None
        self._members.guard(self._mix.before_forward, self.training)
        if self._hierarchy is not None:
            self._hierarchy.receive_parameters()
            self._node_behind = False
        self._outer.before_forward()
        if self.training:
            self._buffer_policy.before_training_forward(self.process_group)
            if self.start_in_forward:
                self._transfer(_validation.BY_FORWARD)
            elif self._steps == 0:
                self._versions_at_forward = _parameter_versions(self.module)
        return self.module(*inputs, **kwargs)

    def _check_rounds_started(self) -> None:
        """Raises if an optimizer step changed the parameters since the last training forward
        while transfer_params() was never called: such a loop would train every worker alone
        with no gossip at all. Checked only until the first transfer_params(), on every rank
        alike (every rank steps its optimizer)."""
        if self._steps or self._versions_at_forward is None or self.start_in_forward:
            return
        if _parameter_versions(self.module) != self._versions_at_forward:
            self._versions_at_forward = None  # raise once
            overlap = (
                "; with overlap=True, start_in_forward=True starts every round from the forward "
                "instead, as the reference SGP does"
                if self.overlap
                else ""
            )
            raise RuntimeError(
                "GossipDataParallel: the parameters changed since the last forward (an optimizer "
                "step) but transfer_params() was never called, so no gossip round ran and every "
                "worker trains alone. Call model.transfer_params() after every optimizer.step(), "
                f"or model.register_optimizer(optimizer) once{overlap}"
            )

    def transfer_params(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Starts a gossip round with the parameters the optimizer step just produced, or runs
        the outer step that takes its place.

        Call it after every ``optimizer.step()`` (or use :meth:`register_optimizer`). Under
        ``overlap=True`` it first absorbs the round started one step earlier; under
        ``synch_freq > 0``, if the previous round is still in flight, the new round starts at the
        first forward that finds the previous one finished.

        Args:
            optimizer (torch.optim.Optimizer, optional): the optimizer that just stepped, whose
                learning rates SlowMo reads, where it is not the one given to
                :meth:`register_optimizer`.

        Raises RuntimeError under ``start_in_forward=True`` (the forward starts the rounds), and,
        before any communication, if it was already called in this step
        (since the last forward or :meth:`sync_comms`) under ``overlap=True``, or once by hand
        and once by :meth:`register_optimizer`'s hook: either way two rounds would run in one
        step.
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
            if self._outer.needs_inner_lr:
                _validation.check_learning_rates(optimizer)
            self._optimizer_ref = weakref.ref(optimizer)
        self._transfer(_validation.BY_HAND)

    def _transfer(self, caller: str) -> None:
        self._members.check_member()
        # Checked on every rank, gossiping or not, so that all of them raise alike.
        self._watch.check(self.module)
        # A failed round or exact average, before this step counts; also where no round would
        # start (LocalSGD has no engine).
        self._members.guard(self._mix.raise_if_failed)
        _validation.check_transfer(self._transferred, caller, self.overlap)
        if self._outer.needs_inner_lr:
            _validation.check_slowmo_optimizer(self._outer.sync_every, self._optimizer)
        self._members.at_step_boundary()  # where a membership change takes effect
        self._steps += 1
        self._members.guard(self._end_step)
        self._node_behind = True
        self._transferred = caller

    def _end_step(self) -> None:
        """The gossip round or outer step that ends optimizer step ``self._steps``."""
        self._mix.arm(self._steps)
        kind = self._outer.kind(self._steps)
        if kind == outer.STREAM:
            self._stream_fragments()
            self._mix.after_step()
        elif kind == outer.OUTER and self._outer.by_gossip:
            self._outer_step_by_gossip()
        elif kind is not None:
            # The exact average takes the place of this step's gossip round.
            self._average_exactly(kind)
        else:
            self._mix.after_step()

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
        if self._outer.needs_inner_lr:
            _validation.check_learning_rates(optimizer)
        self._optimizer_ref = weakref.ref(optimizer)
        self._members.optimizer_registered(optimizer)  # a joiner's: the donor's state
        return optimizer.register_step_post_hook(
            lambda *_: self._transfer(_validation.BY_OPTIMIZER)
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside skip the node-local gradient averaging of
        ``nprocs_per_node > 1`` (as DDP's no_sync). Do not step the optimizer inside."""
        with contextlib.nullcontext() if self._hierarchy is None else self._hierarchy.no_sync():
            yield

    def sync_comms(self) -> None:
        """Waits for the round in flight, and any round still owed, and absorbs them: the
        parameters are then the model with every message sent so far. Raises the error of a
        failed round (naming the peer and the round). With ``nprocs_per_node > 1`` the machine's
        other processes receive the result (collective over the machine)."""
        self._transferred = None
        self._members.check_member()
        self._members.guard(self._mix.drain)
        if self._hierarchy is not None and self._node_behind:
            self._hierarchy.receive_parameters()
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

    def block(self) -> None:
        """Absorbs the round in flight and waits until every rank has done the same."""
        self.sync_comms()
        dist.barrier(group=self.process_group)

    def unbias(self) -> None:
        """Kept for SGP compatibility. The parameters here always hold de-biased values, so
        there is nothing to do."""

    # ----------------------------------------------------------------------------- elastic

    @property
    def elastic(self) -> bool:
        """Whether this worker belongs to an elastic job (``membership=Elastic(...)``)."""
        return isinstance(self._members, membership_runtime.ElasticMembership)

    @property
    def worker_id(self) -> int | None:
        """This worker's id in an elastic job (ids are handed out in order of registration);
        None without ``membership``."""
        return self._members.worker_id

    @property
    def epoch(self) -> int | None:
        """The membership epoch this worker trains in; None without ``membership``."""
        return self._members.epoch

    def leave(self) -> None:
        """Leaves an elastic job cleanly: this worker's last round is delivered, and the others
        drop it at their next step boundary, without waiting for a timeout. Runs by itself when
        the process exits or the wrapper is collected; after it, the wrapper no longer trains (its
        module keeps the model)."""
        self._members.leave()

    # ----------------------------------------------------------------------------- outer steps

    def average_parameters(self) -> None:
        """Sets every rank's parameters to the exact average of the workers' de-biased
        parameters (one all-reduce per dtype): one model for evaluation or a checkpoint.

        Collective: every rank must call it. It first absorbs the gossip in flight (as
        :meth:`sync_comms`), so that every message sent counts; the push-sum weights then restart
        at 1. The average is push-sum's consensus value ``sum_i w_i z_i / sum_i w_i``, which
        gossip converges to: the plain mean of the ``z_i`` whenever the weights are 1 (uniform
        mixing). Floating-point buffers (BatchNorm's running statistics) are averaged too. With
        ``nprocs_per_node > 1`` it averages the gossiping processes, one per machine, and every
        process receives the result.

        It holds one transient copy of the parameters and writes them only once every
        all-reduce has succeeded, so a peer that fails in the middle leaves them as they were;
        the error then stays raised by every later call, as a failed round's
        (``tests/test_faults.py``).
        """
        self.sync_comms()
        self._average_exactly(outer.AVERAGE)

    def _average_exactly(self, kind: str) -> None:
        self._mix.restart()
        # Only gossiping processes hold push-sum state; the others join the all-reduce with zeros
        # and receive the average with everyone, so no broadcast inside the machine is needed.
        weight = self._mix.ps_weight if self.is_gossip_leader else None
        try:
            self._outer.run(kind, weight, self._buffer_policy.weight(weight), self._optimizer)
        except Exception as error:
            # Left as they were here, but perhaps written on ranks whose collectives succeeded.
            self._mix.fail(error)
            raise
        # Every worker holds the consensus value now, with x = z: push-sum restarts at 1.
        self._mix.reset_weight()

    def _stream_fragments(self) -> None:
        """Streaming DiLoCo's prepares and applies of this step (:mod:`gossip_ext.streaming`).
        A failed collective raises at the apply, before anything changes, and stays raised."""
        weight = self._mix.ps_weight if self.is_gossip_leader else None
        try:
            self._outer.run_streaming(self._steps, weight)
        except Exception as error:
            self._mix.fail(error)
            raise

    def _outer_step_by_gossip(self) -> None:
        """The outer step with ``outer_average="gossip"``: this step's gossip round (under
        LocalSGD, the only one of the period) runs to its end at once, and the rule steps with
        the mixed parameters. No collective over every worker: the round's peers are all it
        waits for. A failed round raises from ``run_round`` and changes nothing (the engine's
        promise), before the outer state is touched."""
        self._mix.run_round()
        self._outer.run_on_mixed()

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that ``outer_optimizer`` built over the global parameters (None without
        one): give it an outer learning-rate scheduler, and step that after every outer step.
        With ``fragments > 1`` each fragment has its own: see :attr:`outer_optimizers`."""
        optimizers = self.outer_optimizers
        if len(optimizers) > 1:
            raise ValueError(
                f"fragments={len(optimizers)}: each fragment has an outer optimizer of its own; "
                "use model.outer_optimizers (a list, one per fragment in module order)"
            )
        return optimizers[0] if optimizers else None

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The outer optimizers, one per fragment (``fragments``; one without), in module order;
        empty without ``outer_optimizer``."""
        return [] if self._outer.rule is None else self._outer.rule.optimizers

    @property
    def outer_state_started(self) -> bool:
        """Whether SlowMo's slow parameters or DiLoCo's ``theta_global`` exist: SlowMo's start at
        the first forward, DiLoCo's at construction (and again at the first forward)."""
        return self._outer.started

    def start_outer_state(self) -> None:
        """Starts SlowMo's slow parameters (momentum at 0) or DiLoCo's ``theta_global`` (the
        outer optimizer's state is kept) at the current parameters, which must be equal on every
        rank. The first forward does it; call it to start them elsewhere."""
        self._outer.start()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (:meth:`transfer_params` calls): the clock of the outer steps.
        Saved in the checkpoint; set it to move the schedule (every rank alike)."""
        return self._steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        _validation.check_type("step_count", value, int, "an int")
        if value < 0:
            raise ValueError(f"step_count must be >= 0, got {value}")
        self._steps = value

    @property
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return None if self._optimizer_ref is None else self._optimizer_ref()

    # ----------------------------------------------------------------------------- peers schedule

    @property
    def graph(self) -> GraphBase:
        """The gossip graph, with the number of peers per round now."""
        return self._mix.graph

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
            {"peers_per_itr": peers_per_itr, "steps": self._steps},
            self.process_group,
            self.process_group.rank(),
        )
        self._mix.set_graph(graph)

    @property
    def gossip_group(self) -> dist.ProcessGroup:
        """The process group gossip runs over: the process group, or with ``nprocs_per_node >
        1`` one process per machine."""
        return self.process_group if self._hierarchy is None else self._hierarchy.leaders

    @property
    def node_group(self) -> dist.ProcessGroup | None:
        """The processes of this machine (``nprocs_per_node > 1``), else None."""
        return None if self._hierarchy is None else self._hierarchy.node_group

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
        self._mix.raise_if_failed()
        return consensus.consensus_distance(
            list(self.module.parameters()),
            self.process_group,
            self.is_gossip_leader,
            self.gossip_world_size,
            relative,
        )

    @property
    def consensus_estimate(self) -> float | None:
        """The running estimate of :meth:`consensus_distance` taken by this worker's last measured
        round (``log_every > 0``; see :class:`gossip_ext.consensus.MeasuredEngine`); None before
        the first one, without ``log_every`` and on processes that do not gossip."""
        return self._mix.estimate

    # ----------------------------------------------------------------------------- push-sum state

    @property
    def ps_weight(self) -> float:
        """This worker's push-sum weight ``w``: the weight of the model its parameters hold (always
        1 under lazy mixing)."""
        return self._mix.ps_weight

    @property
    def round_in_flight(self) -> bool:
        """Whether a gossip round has been started and not yet absorbed."""
        return self._mix.in_flight

    @property
    def bytes_sent(self) -> int:
        """Bytes of gossip messages this worker has sent so far (0 on a non-gossiping process)."""
        return self._mix.bytes_sent

    @property
    def gossip_round(self) -> int:
        """Gossip rounds completed by this worker."""
        return self._mix.round

    def ps_numerator(self) -> dict[str, torch.Tensor]:
        """The push-sum numerators ``x = w * z``, one new tensor per parameter name."""
        weight = self.ps_weight
        return {name: p.detach() * weight for name, p in self.module.named_parameters()}

    # ----------------------------------------------------------------------------- checkpoint

    def get_extra_state(self) -> dict[str, Any]:
        self.sync_comms()
        return _checkpoint.extra_state(self)

    def set_extra_state(self, state: Mapping[str, Any]) -> None:
        _checkpoint.restore_extra_state(self, state)

    def state_dict(self, *args, **kwargs):
        """The module's state under ``module.`` after finishing gossip in flight, plus what
        resuming needs under ``_extra_state``: the push-sum state, the step count that schedules
        the outer steps, and their state (SlowMo's slow parameters and momentum; DiLoCo's
        ``theta_global`` and the outer optimizer's state).

        Resuming from it on every rank (``load_state_dict`` with the optimizer's state and the
        data position) continues the run exactly as if it had not stopped. Under
        ``overlap=True`` taking the checkpoint is itself a step of the trajectory: the round in
        flight is absorbed now rather than after the next optimizer step, so a run that saves at
        step k differs slightly from one that never saves, and a resumed run equals the former.

        To load the weights into the plain module::

            sd = {k.removeprefix("module."): v for k, v in state.items()
                  if k.startswith("module.")}
            plain_model.load_state_dict(sd)
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

        A foreign checkpoint carries no gossip round: the schedule restarts at round 0 on every
        rank, with the saved push-sum weight (1 under lazy mixing), and parameters saved as
        push-sum numerators are de-biased.
        """
        own, foreign = _checkpoint.parse(state_dict)
        if foreign is None:
            return super().load_state_dict(own, strict=strict, assign=assign)
        return _checkpoint.load_foreign(self, foreign, strict=strict, assign=assign)


def _algorithms_of(gossip, outer, membership, flat: dict[str, Any]) -> tuple:
    """The (gossip, outer, membership) objects, from the objects given or from the flat keywords
    of earlier releases (translated by algorithms.from_flat after the flat checks, so that their
    errors read as before); not from both."""
    if membership is not None and not isinstance(membership, algorithms.Elastic):
        # The flat spelling, "HOST:PORT" (whose check names anything else given there).
        flat = dict(flat, membership=membership)
        membership = None
    unknown = sorted(set(flat) - set(_flat.FLAT_DEFAULTS))
    if unknown:
        raise TypeError(f"GossipDataParallel got unexpected keyword arguments {unknown}")
    if not flat:
        return (algorithms.SGP() if gossip is _DEFAULT_GOSSIP else gossip), outer, membership
    given = [
        name
        for name, value in (("gossip", gossip), ("outer", outer), ("membership", membership))
        if value is not None and value is not _DEFAULT_GOSSIP
    ]
    if given:
        raise TypeError(
            f"GossipDataParallel: {', '.join(given)} given as objects beside the flat keywords "
            f"{sorted(flat)}: give the algorithm one way (see gossip_ext.algorithms)"
        )
    settings = dict(_flat.FLAT_DEFAULTS, **flat)
    if settings["graph"] is None:
        settings["graph"] = NPeerDynamicDirectedExponentialGraph()
    if settings["mixing"] is None:
        settings["mixing"] = UniformMixing()
    _validation.check_flat(settings)
    return _flat.from_flat(flat)
