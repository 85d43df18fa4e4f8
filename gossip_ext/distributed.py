"""GossipDataParallel: data-parallel training by gossip instead of all-reduce."""

from __future__ import annotations

import contextlib
import itertools
import logging
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _C
from gossip_ext.graphs import GraphBase, NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import MixingBase, UniformMixing

__all__ = ["GossipDataParallel"]

logger = logging.getLogger(__name__)

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # DDP's bucket size for module-state broadcasts


# Numbers the NCCL transports of this process, for their store prefixes (see _nccl_transport).
_NCCL_TRANSPORTS = itertools.count()


def _choose_nccl(device: torch.device, comm_device) -> bool:
    """NCCL for CUDA parameters; the process-group transport (gloo) for CPU parameters."""
    requested = None if comm_device is None else torch.device(comm_device)
    if device.type == "cpu":
        if requested is not None and requested.type != "cpu":
            raise ValueError(
                f"comm_device={comm_device!r} needs CUDA parameters, but they are on the CPU"
            )
        return False
    if device.type != "cuda":
        raise ValueError(f"parameters are on {device}; gossip_ext supports CPU and CUDA")
    if requested is not None and requested.type == "cpu":
        raise ValueError(
            "comm_device='cpu' (gossip of CUDA parameters through host buffers over gloo) is "
            "not supported by this release; leave comm_device=None to gossip over NCCL"
        )
    if not hasattr(_C, "NcclTransport"):
        raise ValueError(
            f"parameters are on {device} but this gossip_ext build has no CUDA support; "
            "reinstall it with a CUDA build of torch"
        )
    return True


def _check_type(name: str, value, expected, what: str) -> None:
    if isinstance(value, bool) and expected is not bool:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


class GossipDataParallel(nn.Module):
    """Data-parallel training where workers average parameters with a few peers per step.

    Instead of an all-reduce of gradients every step (DistributedDataParallel), every worker
    takes its own optimizer step and then gossips: it sends a share of its parameters to one or
    a few peers of a rotating graph and absorbs what its in-peers sent before its next forward
    (Stochastic Gradient Push, Assran et al., ICML 2019). The compiled engine holds the
    parameters in one flat buffer per dtype, so a round needs no copies.

    .. note::
        Call :meth:`transfer_params` after every ``optimizer.step()``, or let
        :meth:`register_optimizer` do it through the optimizer's step hook. The round is then
        absorbed by the next forward (synchronous SGP), by the next :meth:`transfer_params`
        (``overlap=True``), or by the first forward that finds it finished (``synch_freq > 0``).

    .. note::
        The parameters always hold the de-biased values ``z = x / w`` that forward and the
        optimizer use. Do not replace a parameter's storage (``param.data = t``) after wrapping:
        gossip would no longer reach it, and the next round raises. Copy into it instead.

    .. note::
        Synchronous modes send the parameters in place, which saves a model copy: between
        :meth:`transfer_params` and the next forward they hold the share being gossiped.
        :meth:`sync_comms`, ``state_dict()`` and evaluation forwards absorb the round first; call
        :meth:`sync_comms` before reading the parameters yourself in that window.

    .. note::
        Construction broadcasts the parameters of rank 0 to every rank (as DDP does), so that all
        workers start from the same point.

    Args:
        module (nn.Module): the model; its parameters must be floating point, on one device.
        graph (GraphBase, optional): the gossip graph
            (default: ``NPeerDynamicDirectedExponentialGraph(peers_per_itr=1)``).
        mixing (MixingBase, optional): mixing weights (default: ``UniformMixing()``).
        push_sum (bool): push-sum (SGP) if True; push-pull averaging (D-PSGD) if False, which
            needs a graph that pairs nodes symmetrically (default: True).
        overlap (bool): absorb each round one step later, so that it runs during the next
            forward, backward and step (default: False).
        synch_freq (int): bounded asynchrony: a forward absorbs a finished round without waiting,
            and blocks only after ``synch_freq`` consecutive forwards found it unfinished; 0 is
            synchronous (default: 0).
        nprocs_per_node (int): processes per machine: gradients are averaged inside each machine,
            one process per machine gossips, and the others receive its parameters before every
            forward (default: 1).
        process_group (ProcessGroup, optional): the group to train in (default: the default
            group). Gossip runs over it with point-to-point messages (gloo: CPU tensors).
        comm_device (torch.device, optional): where messages travel from. Default: the
            parameters' device, i.e. NCCL for CUDA parameters, gloo for CPU ones.
        timeout (timedelta): how long a round waits for a peer before raising TimeoutError
            naming the peers (default: 5 minutes).
        verbose (bool): log every round at INFO level (default: False).

    Example::

        >>> dist.init_process_group("gloo")
        >>> model = gossip_ext.GossipDataParallel(nn.Linear(10, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for x, y in loader:
        ...     loss = nn.functional.mse_loss(model(x), y)
        ...     opt.zero_grad(); loss.backward(); opt.step()
        ...     model.transfer_params()
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        graph: GraphBase | None = None,
        mixing: MixingBase | None = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        nprocs_per_node: int = 1,
        process_group: dist.ProcessGroup | None = None,
        comm_device: torch.device | str | None = None,
        timeout: timedelta = timedelta(minutes=5),
        verbose: bool = False,
    ):
        super().__init__()
        graph = NPeerDynamicDirectedExponentialGraph() if graph is None else graph
        mixing = UniformMixing() if mixing is None else mixing
        _check_type("module", module, nn.Module, "an nn.Module")
        _check_type("graph", graph, GraphBase, "a gossip_ext graph")
        _check_type("mixing", mixing, MixingBase, "a gossip_ext mixing")
        _check_type("push_sum", push_sum, bool, "a bool")
        _check_type("overlap", overlap, bool, "a bool")
        _check_type("synch_freq", synch_freq, int, "an int")
        _check_type("nprocs_per_node", nprocs_per_node, int, "an int")
        _check_type("timeout", timeout, timedelta, "a datetime.timedelta")
        if synch_freq < 0:
            raise ValueError(f"synch_freq must be >= 0, got {synch_freq}")
        if overlap and synch_freq > 0:
            raise ValueError(
                f"overlap=True and synch_freq={synch_freq} are two different schedules for "
                "absorbing rounds; choose one"
            )
        if nprocs_per_node < 1:
            raise ValueError(f"nprocs_per_node must be >= 1, got {nprocs_per_node}")
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "GossipDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets it up)"
            )

        self.module = module
        self.graph = graph
        self.mixing = mixing
        self.push_sum = push_sum
        self.overlap = overlap
        self.synch_freq = synch_freq
        self.nprocs_per_node = nprocs_per_node
        self.verbose = verbose
        self.process_group = dist.group.WORLD if process_group is None else process_group

        named = list(module.named_parameters())
        params = [p for _, p in named]
        if not params:
            raise ValueError("module has no parameters; there is nothing to gossip")
        device = params[0].device
        self._use_nccl = _choose_nccl(device, comm_device)

        world_size = dist.get_world_size(self.process_group)
        rank = dist.get_rank(self.process_group)
        if world_size % nprocs_per_node != 0:
            raise ValueError(
                f"nprocs_per_node ({nprocs_per_node}) must divide the world size ({world_size})"
            )
        self.gossip_world_size = world_size // nprocs_per_node
        # Validates the graph for this world size on every rank, before any communication.
        graph.schedule(self.gossip_world_size)
        if not push_sum and not graph.pairs_symmetrically(self.gossip_world_size):
            raise ValueError(
                f"push_sum=False (push-pull averaging, D-PSGD) needs a graph that pairs nodes "
                f"symmetrically in every round, but {graph!r} does not at world size "
                f"{self.gossip_world_size}"
            )

        self._check_ranks_agree(named, rank)

        self._node_group = None
        gossip_group = self.process_group
        self.is_gossip_leader = True
        if nprocs_per_node > 1:
            gossip_group = self._make_hierarchy(rank, world_size)

        with torch.no_grad():
            for p in params:
                dist.broadcast(
                    p, dist.get_global_rank(self.process_group, 0), group=self.process_group
                )

        self._engine = None
        if self.is_gossip_leader:
            # Synchronous modes leave the parameters alone while a round is in flight, so the
            # engine may send them in place (no send buffer; Note [Sending in place]).
            options = _C.EngineOptions(
                graph._options(),
                mixing._options(),
                push_sum=push_sum,
                send_in_place=not overlap and synch_freq == 0,
                timeout=timeout,
            )
            transport = (
                self._nccl_transport(gossip_group, device, timeout)
                if self._use_nccl
                else _C.ProcessGroupTransport(gossip_group)
            )
            self._engine = _C.GossipEngine(params, [n for n, _ in named], transport, options)
        if self.gossip_world_size == 1:
            warnings.warn(
                "GossipDataParallel: there is one gossiping process, so gossip does nothing "
                "and this trains like a single process",
                stacklevel=2,
            )

        self._unfinished_forwards = 0  # bounded asynchrony: forwards that found a round running
        self._start_deferred = False  # bounded asynchrony: a round owed by transfer_params()
        self._sync_gradients = True
        self._backward_callback_queued = False
        if self._node_group is not None:
            for p in params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _check_ranks_agree(self, named: list, rank: int) -> None:
        """One all-gather at construction: ranks that disagree on the schedule or the model
        would otherwise exchange mismatched messages or wait for rounds that never come.

        The mixing's kind must agree, its weights need not: push-sum allows every node its own
        column-stochastic share."""
        config = {
            "graph": repr(self.graph),
            "mixing": type(self.mixing).__name__,
            "push_sum": self.push_sum,
            "overlap": self.overlap,
            "synch_freq": self.synch_freq,
            "nprocs_per_node": self.nprocs_per_node,
            "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in named],
        }
        configs = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(configs, config, group=self.process_group)
        for other, theirs in enumerate(configs):
            diff = sorted(k for k in config if theirs[k] != configs[0][k])
            if diff:
                details = "; ".join(
                    f"{k}: rank 0 has {configs[0][k]!r}, rank {other} has {theirs[k]!r}"
                    for k in diff
                    if k != "parameters"
                )
                if "parameters" in diff:
                    details += "; the parameters (names, shapes or dtypes) differ"
                raise ValueError(
                    f"GossipDataParallel: rank {other} was configured differently from rank 0 "
                    f"(seen on rank {rank}): {details.lstrip('; ')}"
                )

    @staticmethod
    def _nccl_transport(group: dist.ProcessGroup, device: torch.device, timeout: timedelta):
        # Every wrapper gets its own key space in the store; wrappers are built in the same order
        # on every rank (construction is collective), so the counters agree.
        prefix = f"gossip_ext/nccl/{next(_NCCL_TRANSPORTS)}"
        store = dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())
        return _C.NcclTransport(
            store, dist.get_rank(group), dist.get_world_size(group), device.index, timeout
        )

    # ----------------------------------------------------------------------------- hierarchy

    def _make_hierarchy(self, rank: int, world_size: int) -> dist.ProcessGroup:
        m = self.nprocs_per_node
        to_global = [dist.get_global_rank(self.process_group, r) for r in range(world_size)]
        # new_group is collective: every rank creates every group, in the same order.
        for node in range(world_size // m):
            group = dist.new_group([to_global[node * m + i] for i in range(m)])
            if rank // m == node:
                self._node_group = group  # its group rank 0 is the node's gossiping process
        leaders = dist.new_group([to_global[node * m] for node in range(world_size // m)])
        self.is_gossip_leader = rank % m == 0
        return leaders

    def _on_grad_ready(self, _param: torch.Tensor) -> None:
        # The first gradient of a backward queues one callback that runs when the whole backward
        # has finished: the end of backward, detected by the autograd engine itself.
        if self._sync_gradients and not self._backward_callback_queued:
            self._backward_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average_node_gradients)

    def _average_node_gradients(self) -> None:
        self._backward_callback_queued = False
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._node_group)
        flat.div_(self.nprocs_per_node)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _receive_node_parameters(self) -> None:
        # One coalesced broadcast (as DDP syncs module states) instead of one per tensor.
        tensors = [p.detach() for p in self.module.parameters()]
        tensors += [b.detach() for b in self.module.buffers()]
        dist._broadcast_coalesced(self._node_group, tensors, _BROADCAST_BUCKET_BYTES, 0)

    # ----------------------------------------------------------------------------- training

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._engine is not None:
            if not self.training:
                # Evaluation sees every message sent so far (the reference forgets to absorb).
                self._engine.finish_round()
            elif self.synch_freq > 0:
                self._absorb_bounded()
            elif not self.overlap:
                self._engine.finish_round()
        if self._node_group is not None:
            self._receive_node_parameters()
        return self.module(*inputs, **kwargs)

    # Bounded asynchrony (synch_freq > 0). A round is owed for every transfer_params() call, on
    # every rank alike, so all ranks run the same rounds and nobody waits for a round its peer
    # skipped; only when a round starts and when it is absorbed depend on timing. A start that
    # finds the previous round unfinished is deferred to the first forward that finds it done.

    def _absorb_bounded(self) -> None:
        if self._engine.in_flight:
            if self._engine.try_finish_round():
                self._unfinished_forwards = 0
            else:
                self._unfinished_forwards += 1
                if self._unfinished_forwards > self.synch_freq:
                    self._engine.finish_round()
                    self._unfinished_forwards = 0
        if self._start_deferred and not self._engine.in_flight:
            self._start_deferred = False
            self._engine.start_round()

    def _transfer_bounded(self) -> None:
        if self._start_deferred:  # a round is already owed: wait, and start it now
            self._engine.finish_round()
            self._engine.start_round()
        self._start_deferred = not self._engine.try_finish_round()
        if not self._start_deferred:
            self._engine.start_round()

    def transfer_params(self) -> None:
        """Starts a gossip round with the parameters the optimizer step just produced.

        Call it after every ``optimizer.step()`` (or use :meth:`register_optimizer`). Under
        ``overlap=True`` it first absorbs the round started one step earlier; under
        ``synch_freq > 0``, if the previous round is still in flight, the new round starts at the
        first forward that finds the previous one finished.
        """
        if self._engine is None:
            return
        if self.synch_freq > 0:
            self._transfer_bounded()
        else:
            self._engine.finish_round()
            self._engine.start_round()
        if self.verbose:
            logger.info("gossip round %d in flight", self._engine.round)

    def register_optimizer(self, optimizer: torch.optim.Optimizer):
        """Calls :meth:`transfer_params` after every ``optimizer.step()``; returns the hook's
        handle (``handle.remove()`` undoes it)."""
        _check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
        return optimizer.register_step_post_hook(lambda *_: self.transfer_params())

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backwards inside skip the node-local gradient averaging of
        ``nprocs_per_node > 1`` (as DDP's no_sync). Do not step the optimizer inside."""
        previous = self._sync_gradients
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = previous

    def sync_comms(self) -> None:
        """Waits for the round in flight, and any round still owed, and absorbs them."""
        if self._engine is None:
            return
        self._engine.finish_round()
        if self._start_deferred:
            self._start_deferred = False
            self._engine.start_round()
            self._engine.finish_round()

    def block(self) -> None:
        """Absorbs the round in flight and waits until every rank has done the same."""
        self.sync_comms()
        dist.barrier(group=self.process_group)

    def unbias(self) -> None:
        """Kept for SGP compatibility. The parameters here always hold de-biased values, so
        there is nothing to do."""

    # ----------------------------------------------------------------------------- push-sum state

    @property
    def ps_weight(self) -> float:
        """This worker's push-sum weight ``w`` (1 under lazy mixing when no round is in flight)."""
        return 1.0 if self._engine is None else float(self._engine.ps_weight().item())

    @property
    def round_in_flight(self) -> bool:
        """Whether a gossip round has been started and not yet absorbed."""
        return self._engine is not None and bool(self._engine.in_flight)

    @property
    def bytes_sent(self) -> int:
        """Bytes of gossip messages this worker has sent so far (0 on a non-gossiping process)."""
        return 0 if self._engine is None else int(self._engine.bytes_sent)

    @property
    def gossip_round(self) -> int:
        """Gossip rounds completed by this worker."""
        return 0 if self._engine is None else int(self._engine.round)

    def ps_numerator(self) -> dict[str, torch.Tensor]:
        """The push-sum numerators ``x = w * z``, one new tensor per parameter name."""
        if self._engine is not None and self._engine.params_hold_numerators:
            return {name: p.detach().clone() for name, p in self.module.named_parameters()}
        weight = self.ps_weight
        return {name: p.detach() * weight for name, p in self.module.named_parameters()}

    def get_extra_state(self) -> dict[str, Any]:
        self.sync_comms()
        return {
            "gossip_round": self.gossip_round,
            "ps_weight": self.ps_weight,
            "gossip_world_size": self.gossip_world_size,
            "graph": repr(self.graph),
            "mixing": repr(self.mixing),
        }

    def set_extra_state(self, state: Mapping[str, Any]) -> None:
        for key, mine in (
            ("gossip_world_size", self.gossip_world_size),
            ("graph", repr(self.graph)),
            ("mixing", repr(self.mixing)),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"load_state_dict: the checkpoint was saved with {key}={state.get(key)!r}, "
                    f"but this model has {key}={mine!r}"
                )
        if self._engine is not None:
            self._engine.finish_round()
            self._engine.restore(int(state["gossip_round"]), float(state["ps_weight"]))

    def state_dict(self, *args, **kwargs):
        """The module's state under ``module.`` after finishing gossip in flight, plus the
        push-sum state under ``_extra_state`` needed to resume.

        To load the weights into the plain module::

            sd = {k.removeprefix("module."): v for k, v in state.items()
                  if k.startswith("module.")}
            plain_model.load_state_dict(sd)
        """
        self.sync_comms()
        return super().state_dict(*args, **kwargs)
