"""fairscale's ``SlowMoDistributedDataParallel`` on gossip_ext's engine: change the import only.

``from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel`` takes the place of
``fairscale.experimental.nn.data_parallel``'s (SlowMo over LocalSGD or SGP): same constructor
(argument names, order and defaults), same ``perform_slowmo(optimizer)`` after every
``optimizer.step()``, same attributes, same ``state_dict()`` keys (and ``_extra_state``, with
what resuming exactly needs). It is a
:class:`gossip_ext.GossipDataParallel`, which does the work; nothing here communicates by itself.

What is mapped:

* ``slowmo_base_algorithm``: LOCALSGD runs no gossip and averages exactly every
  ``localsgd_frequency`` calls of ``perform_slowmo`` (the core's ``global_avg_freq``); SGP runs
  one gossip round per call and finishes it before returning, as fairscale does.
* SlowMo is on iff ``slowmo_lr != 1`` or ``slowmo_momentum != 0`` (fairscale's rule); it averages
  exactly and takes the slow momentum step every ``slowmo_frequency`` calls, with the learning
  rates of the optimizer given to ``perform_slowmo``. ``slowmo_memory_efficient`` and
  ``slowmo_num_shards`` shard the slow state as fairscale does.
* ``nprocs_per_node``: gradients are averaged inside a node and one process per node takes part
  in LocalSGD or SGP. With a single node, LocalSGD and SGP are off (fairscale: "a local allreduce
  will suffice") and training is DDP inside the node, plus SlowMo if on.
* ``graph`` and ``mixing``: the SGP-signature classes of :mod:`gossip_ext.compat.sgp`, re-exported
  here as fairscale's gossip package exports its own, or gossip_ext's own graphs and mixings.
* ``global_group`` is the group trained in; ``process_rank``, ``process_world_size``,
  ``master_group`` and ``local_node_group``, when given, are checked against it and the node
  layout (the engine builds the node and leader groups itself).
* ``broadcast_buffers``, ``push_sum``, ``verbose`` and ``comm_device`` (default: CPU messages on a
  gloo process group, as fairscale chooses) go to the engine.

Accepted and without effect: ``use_streams`` and ``profile_mode`` (the engine has its own
streams and no profiler switch); ``synch_freq`` (fairscale's bounded asynchrony only acts with
``overlap``, which it disables); ``slowmo_sgp_average_params`` (every SlowMo step here starts from
the exact average, which is what True asks for).

What raises: ``overlap=True`` (fairscale asserts it off; use ``GossipDataParallel(overlap=True)``),
``perform_slowmo(..., fp32_params=...)`` and apex amp's fp16 optimizer (fairscale's fp16
error feedback; wrap 16-bit parameters directly instead), an unknown ``slowmo_base_algorithm``,
ranks or groups that do not match the node layout, and wrongly typed arguments: ValueError or
TypeError naming the argument and its value, on every rank at once.

.. note::
    A SlowMo step always averages exactly, in place of that step's LocalSGD average or SGP round.
    fairscale does the same with ``slowmo_memory_efficient`` (the default); without it, fairscale
    runs the step's SGP round (or its LocalSGD average, when one is due) and then takes the slow
    momentum step on each rank's own parameters, which are not averaged unless
    ``slowmo_sgp_average_params`` or the LocalSGD average made them so. At two workers one
    uniform gossip round is the exact average, so the two agree.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _validation
from gossip_ext.compat._fairscale_checks import (
    SlowMoBaseAlgorithm,
    _check_arguments,
    _check_layout,
    _check_optimizer,
    _check_positive,
    _check_type,
    _core_graph,
    _core_mixing,
    _raise_on_every_rank,
)
from gossip_ext.compat.sgp import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphManager,
    MixingManager,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
    UniformMixing,
)
from gossip_ext.distributed import GossipDataParallel
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase

__all__ = [
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GraphManager",
    "MixingManager",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "SlowMoBaseAlgorithm",
    "SlowMoDistributedDataParallel",
    "UniformMixing",
]

logger = logging.getLogger(__name__)


class SlowMoDistributedDataParallel(GossipDataParallel):
    """fairscale's SlowMo data parallelism (SlowMo over LocalSGD or SGP) with its exact API.

    Every worker takes its own optimizer steps; after each, :meth:`perform_slowmo` averages the
    workers approximately with the base algorithm (LocalSGD: an exact average every
    ``localsgd_frequency`` steps; SGP: one gossip round every step) and, every
    ``slowmo_frequency`` steps, averages them exactly and takes the slow momentum step of SlowMo
    (Wang et al., ICLR 2020): ``u <- slowmo_momentum * u + (x_slow - x_avg) / lr``,
    ``x_slow <- x_slow - slowmo_lr * lr * u``, the parameters set to ``x_slow``.

    .. note::
        Call ``perform_slowmo(optimizer)`` after every ``optimizer.step()``. It finishes its
        communication before returning: the parameters are the model when it returns.

    .. note::
        SlowMo is on iff ``slowmo_lr != 1`` or ``slowmo_momentum != 0``. The slow parameters
        start at the first :meth:`perform_slowmo` (after the first optimizer step), or when
        :meth:`_init_global_momentum_buffers` is called before it, as in fairscale.

    .. note::
        With ``slowmo_memory_efficient`` (the default), a step that is due both a SlowMo step and
        a LocalSGD average or an SGP round only takes the SlowMo step, which averages: keep
        ``slowmo_frequency`` a multiple of ``localsgd_frequency``.

    .. note::
        Construction broadcasts the parameters of the group's first rank (fairscale assumes every
        rank seeded alike). Buffers are broadcast before every training forward with
        ``broadcast_buffers`` (fairscale also before evaluation forwards), and averaged with the
        parameters at every exact average.

    Args:
        module (nn.Module): the model; its parameters must be floating point, on one device.
        nprocs_per_node (int): processes per node, all on one node ranked consecutively.
        broadcast_buffers (bool): broadcast rank 0's buffers before every forward
            (default: True).
        slowmo_base_algorithm (SlowMoBaseAlgorithm): LOCALSGD or SGP
            (default: SlowMoBaseAlgorithm.LOCALSGD).
        slowmo_momentum (float): SlowMo's slow momentum, in [0, 1) (default: 0.5).
        slowmo_memory_efficient (bool): shard SlowMo's slow parameters and momentum over
            ``min(world size, slowmo_num_shards)`` ranks, and skip the base algorithm's
            averaging on SlowMo steps (default: True).
        slowmo_frequency (int): optimizer steps per SlowMo step (default: 48).
        slowmo_lr (float): SlowMo's slow learning rate, > 0 (default: 1.0).
        slowmo_num_shards (int): the most ranks the slow state is sharded over (default: 32).
        localsgd_frequency (int): optimizer steps per LocalSGD average (default: 3).
        graph (GraphManager or GraphBase, optional): SGP's gossip graph (default:
            ``NPeerDynamicDirectedExponentialGraph`` with one peer per round).
        mixing (MixingManager or MixingBase, optional): SGP's mixing weights (default: uniform).
        push_sum (bool): push-sum if True, push-pull if False (default: True).
        overlap (bool): must be False, as in fairscale (default: False).
        synch_freq (int): >= 0; without effect, as in fairscale without overlap (default: 0).
        use_streams (bool): accepted, without effect (default: True).
        slowmo_sgp_average_params (bool): accepted; SlowMo steps always average exactly
            (default: False).
        verbose (bool): log every gossip round (default: False).
        profile_mode (bool): accepted, without effect (default: False).
        process_rank (int, optional): this process's rank in ``global_group``; checked
            (default: None, read from it).
        process_world_size (int, optional): the size of ``global_group``; checked
            (default: None, read from it).
        global_group (ProcessGroup, optional): the group to train in (default: the default group).
        master_group (ProcessGroup, optional): the first process of every node; checked
            (default: None).
        local_node_group (ProcessGroup, optional): this node's processes; checked
            (default: None).
        comm_device (torch.device, optional): where messages travel from (default: the CPU on a
            gloo process group, the parameters' device otherwise).

    Example::

        >>> from gossip_ext.compat.fairscale import SlowMoDistributedDataParallel
        >>> model = SlowMoDistributedDataParallel(net, nprocs_per_node=8)
        >>> loss = criterion(model(inputs), targets)
        >>> loss.backward()
        >>> optimizer.step()
        >>> model.zero_grad(set_to_none=True)
        >>> model.perform_slowmo(optimizer)
    """

    def __init__(
        self,
        module: nn.Module,
        nprocs_per_node: int,
        broadcast_buffers: bool = True,
        slowmo_base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD,
        slowmo_momentum: float = 0.5,
        slowmo_memory_efficient: bool = True,
        slowmo_frequency: int = 48,
        slowmo_lr: float = 1.0,
        slowmo_num_shards: int = 32,
        localsgd_frequency: int = 3,
        graph: GraphManager | GraphBase | None = None,
        mixing: MixingManager | MixingBase | None = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        use_streams: bool = True,
        slowmo_sgp_average_params: bool = False,
        verbose: bool = False,
        profile_mode: bool = False,
        process_rank: int | None = None,
        process_world_size: int | None = None,
        global_group: dist.ProcessGroup | None = None,
        master_group: dist.ProcessGroup | None = None,
        local_node_group: dist.ProcessGroup | None = None,
        comm_device: torch.device | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SlowMoDistributedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group() first"
            )
        error = layout = algorithm = None
        try:
            _check_type("global_group", global_group, (dist.ProcessGroup, type(None)))
            algorithm = _check_arguments(
                nprocs_per_node=nprocs_per_node,
                broadcast_buffers=broadcast_buffers,
                slowmo_base_algorithm=slowmo_base_algorithm,
                slowmo_momentum=slowmo_momentum,
                slowmo_memory_efficient=slowmo_memory_efficient,
                slowmo_frequency=slowmo_frequency,
                slowmo_lr=slowmo_lr,
                slowmo_num_shards=slowmo_num_shards,
                localsgd_frequency=localsgd_frequency,
                push_sum=push_sum,
                overlap=overlap,
                synch_freq=synch_freq,
                use_streams=use_streams,
                slowmo_sgp_average_params=slowmo_sgp_average_params,
                verbose=verbose,
                profile_mode=profile_mode,
            )
            # fairscale's rule: SlowMo off is SlowMo with slowmo_lr = 1 and slowmo_momentum = 0.
            slowmo = slowmo_lr != 1 or slowmo_momentum != 0
            layout = _check_layout(
                nprocs_per_node,
                process_rank,
                process_world_size,
                global_group,
                master_group,
                local_node_group,
            )
            # fairscale's LocalSGD and SGP need a second node; its SlowMo does not.
            localsgd = algorithm == SlowMoBaseAlgorithm.LOCALSGD and not layout.single_node
            sgp = algorithm == SlowMoBaseAlgorithm.SGP and not layout.single_node
            if slowmo:
                _check_positive("slowmo_frequency", slowmo_frequency)
                if slowmo_memory_efficient:
                    _check_positive("slowmo_num_shards", slowmo_num_shards)
            if localsgd:
                _check_positive("localsgd_frequency", localsgd_frequency)
            core_graph = _core_graph(graph, layout) if sgp else None
            core_mixing = _core_mixing(mixing) if sgp else None
        except (TypeError, ValueError) as caught:
            error = caught
        # Ranks can disagree (a process_rank or a group is checked against this rank's place),
        # and a rank that raised alone would leave the others waiting in the engine's setup.
        _raise_on_every_rank(error, global_group)

        if layout.single_node:
            logger.warning("Disabling LocalSGD and SGP since a local allreduce will suffice")
        if slowmo and not localsgd and not sgp:
            logger.warning("SlowMo is being used without LocalSGD and SGP")
        if comm_device is None and dist.get_backend(global_group) == "gloo":
            comm_device = torch.device("cpu")  # fairscale's choice on gloo
        # One node: no gossip at all (the core's LocalSGD with nothing to average but SlowMo's
        # steps, if on), and the node's processes average gradients, as fairscale does.
        base_algorithm = "sgp" if sgp else "localsgd"
        super().__init__(
            module,
            graph=core_graph,
            mixing=core_mixing,
            push_sum=push_sum,
            base_algorithm=base_algorithm,
            nprocs_per_node=nprocs_per_node,
            process_group=global_group,
            comm_device=comm_device,
            broadcast_buffers=broadcast_buffers,
            global_avg_freq=localsgd_frequency if localsgd else None,
            slowmo_freq=slowmo_frequency if slowmo else None,
            slowmo_momentum=slowmo_momentum if slowmo else 0.5,
            slowmo_lr=slowmo_lr if slowmo else 1.0,
            slowmo_memory_efficient=slowmo_memory_efficient,
            slowmo_num_shards=slowmo_num_shards if slowmo_memory_efficient else None,
            verbose=verbose,
        )
        # fairscale starts the slow parameters at the first perform_slowmo(): the core's start at
        # the first forward is redone there (before any SlowMo step, so with the same result).
        self.global_momentum_buffers_initialized = False

        self.process_rank = layout.process_rank
        self.process_world_size = layout.process_world_size
        self.logical_rank = layout.logical_rank
        self.logical_world_size = layout.logical_world_size
        self.local_rank = layout.local_rank
        self.global_group = self.process_group
        # fairscale's groups: None for the leaders of a single node and the node of a single
        # process; otherwise the ones given, or the engine's own.
        if layout.single_node:
            self.master_group = None
        elif master_group is None:
            self.master_group = self.gossip_group
        else:
            self.master_group = master_group
        if self.node_group is None:
            self.local_node_group = None
        else:
            self.local_node_group = (
                self.node_group if local_node_group is None else local_node_group
            )
        self.broadcast_buffers = broadcast_buffers
        self.slowmo = slowmo
        self.slowmo_lr = slowmo_lr if slowmo else 1
        self.slowmo_momentum = slowmo_momentum if slowmo else 0
        self.slowmo_frequency = slowmo_frequency
        self.slowmo_memory_efficient = slowmo_memory_efficient
        self.slowmo_num_shards = (
            min(layout.process_world_size, slowmo_num_shards) if slowmo_memory_efficient else 1
        )
        self.is_current_node_a_slowmo_shard = (
            layout.process_rank < self.slowmo_num_shards if slowmo_memory_efficient else True
        )
        self.slowmo_sgp_average_params = slowmo_sgp_average_params
        self.localsgd = localsgd
        self.sgp = sgp
        self.localsgd_frequency = localsgd_frequency
        self.use_streams = use_streams
        self.profile_mode = profile_mode
        # The parameters always hold de-biased values here, never push-sum numerators.
        self.is_sgp_ps_numerator = False

    @property
    def num_updates(self) -> int:
        """Calls of :meth:`perform_slowmo` so far: the clock of the LocalSGD and SlowMo steps."""
        return self.step_count

    @num_updates.setter
    def num_updates(self, value: int) -> None:
        _check_type("num_updates", value, int)
        if value < 0:
            raise ValueError(f"num_updates must be >= 0, got {value}")
        self.step_count = value

    def perform_slowmo(
        self, optimizer: torch.optim.Optimizer, fp32_params: torch.Tensor | None = None
    ) -> None:
        """Averages after ``optimizer.step()``: the base algorithm's step when one is due (an
        exact average for LocalSGD, a gossip round for SGP), then the SlowMo step when due.

        Call it once after every ``optimizer.step()`` on every rank (it is collective when it
        averages). It returns with its communication finished. Calling
        ``model.zero_grad(set_to_none=True)`` before it frees the gradients' memory first.

        Args:
            optimizer (torch.optim.Optimizer): the optimizer that took the step; SlowMo reads
                its param groups' learning rates.
            fp32_params (torch.Tensor, optional): fairscale's fp32 master copy for fp16 training
                with error feedback: not supported, must be None (default: None).
        """
        _check_optimizer(optimizer, fp32_params)
        if not self.global_momentum_buffers_initialized:
            self._init_global_momentum_buffers(optimizer)
        self.transfer_params(optimizer)
        # fairscale's SGP round is over when perform_slowmo() returns, and the node's other
        # processes hold the result.
        self.sync_comms()

    def _init_global_momentum_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """Starts SlowMo's slow parameters at the current parameters (fairscale's name; its
        tests call it before training). :meth:`perform_slowmo` calls it if nobody did."""
        _check_optimizer(optimizer, None)
        self.global_momentum_buffers_initialized = True
        if not self.slowmo:
            return
        _validation.check_learning_rates(optimizer)
        self.start_outer_state()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """fairscale's checkpoint: the module's state under ``module.``, plus with SGP the
        push-sum weight (``ps_weight``, a one-element tensor on the CPU) and
        ``is_sgp_ps_numerator`` (always False: the parameters are de-biased).

        .. note::
            One key more than fairscale's: ``_extra_state`` holds what resuming exactly needs
            (the step count that schedules LocalSGD and SlowMo, SlowMo's slow parameters and
            momentum, the gossip round), which fairscale does not save. fairscale's own class
            loads the checkpoint once it is removed (``state.pop("_extra_state")``); this class
            loads fairscale's checkpoints as they are.
        """
        state = super().state_dict(*args, **kwargs)
        if self.sgp:
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            dtype = next(self.module.parameters()).dtype
            state[prefix + "ps_weight"] = torch.tensor([self.ps_weight], dtype=dtype)
            state[prefix + "is_sgp_ps_numerator"] = self.is_sgp_ps_numerator
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign=False):
        """Loads a checkpoint of :meth:`state_dict`, or of fairscale's class (whose SGP
        parameters may be push-sum numerators; the step count and slow state stay as they are,
        as fairscale's own loading leaves them). The dict is left unchanged."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        # Slow parameters missing from the checkpoint start again at the next perform_slowmo(),
        # as fairscale's (the core's start at the next forward is redone there).
        self.global_momentum_buffers_initialized = self.outer_state_started
        return result
