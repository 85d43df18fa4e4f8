"""GossipStrategy: Lightning's ``Trainer`` training with gossip_ext in place of DDP's all-reduce.

It is Lightning's DDP strategy (its launcher, torchrun, the process group, ``sync_dist``'s
reductions, barriers and broadcasts) with the model wrapped in
:class:`gossip_ext.GossipDataParallel` instead of ``DistributedDataParallel``: every worker takes
its own optimizer step, then the wrapper's algorithm runs (a gossip round, or the outer step that
takes its place), started by a hook on the optimizer's step. With an elastic membership each
worker is a run of its own, and the membership service makes the job (module ``jobs``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from .. import algorithms
from ..distributed import GossipDataParallel
from . import checkpoints, jobs

_DEFAULT_GOSSIP = algorithms.SGP()


class GossipStrategy(DDPStrategy):
    """Trains with gossip_ext under ``pytorch_lightning.Trainer``.

    ``Trainer(strategy=GossipStrategy(gossip=SGP(overlap=True, message_dtype="int8")))``, or
    ``Trainer(strategy="gossip")`` (SGP's defaults) once :mod:`gossip_ext.lightning` is imported.

    Args:
        gossip, outer: the wrapper's algorithm objects (:class:`gossip_ext.GossipDataParallel`):
            ``SGP``, ``PushPull`` or ``AsyncSGP``, or None with ``outer`` (``Average``,
            ``SlowMo``, ``DiLoCo``, ``AsyncDiLoCo``).
        membership: ``Elastic(...)``: this worker joins an elastic job (docs/elastic.md), started
            on its own with ``Trainer(devices=1)``; workers may die, stall, leave and join. Each
            draws the whole dataset in an order seeded by its worker id, validates and
            checkpoints its own model (to ``PATH.workerN``), ``sync_dist`` reduces over itself
            alone, it leaves the job when ``fit`` ends, and ``ckpt_path`` is refused (a joiner
            takes the members' model). Asynchronous outer steps are refused, as without Lightning.
        validate_on: ``"average"`` (default without a membership): validation and testing run on
            the workers' average (push-sum's consensus value, the model a checkpoint saves for
            inference), computed for the evaluation and then put back; ``"worker"`` (the default
            and the only choice with a membership): each worker evaluates its own model (log
            with ``sync_dist=True`` to see their mean).
        timeout: how long a round waits for a peer (:class:`gossip_ext.PeerTimeoutError`) and
            the process group's timeout.
        **wrapper_kwargs: the wrapper's other keywords (``broadcast_buffers``,
            ``gossip_buffers``, ``log_every``, ``verbose``).

    Refused, naming why: ``nprocs_per_node`` (Lightning's devices are the workers), more than
    one optimizer (each step would start a round of its own), and ``precision="16-mixed"`` (its
    gradient scaler skips a step on one worker alone, which would put that worker a round behind
    the others).
    """

    strategy_name = "gossip"

    def __init__(
        self,
        gossip: algorithms.Gossip | None = _DEFAULT_GOSSIP,
        outer: algorithms.Outer | None = None,
        membership: algorithms.Elastic | None = None,
        *,
        validate_on: jobs.ValidateOn | None = None,
        timeout: timedelta = timedelta(minutes=5),
        **wrapper_kwargs: Any,
    ) -> None:
        self._job = jobs.LaunchedJob() if membership is None else jobs.ElasticJob(membership)
        if validate_on is None:
            validate_on = self._job.default_validate_on
        if validate_on not in ("average", "worker"):
            raise ValueError(f"validate_on must be 'average' or 'worker', got {validate_on!r}")
        self._job.check_validate_on(validate_on)
        for name, why in _REFUSED_KEYWORDS.items():
            if name in wrapper_kwargs:
                raise ValueError(f"GossipStrategy: {name}={wrapper_kwargs[name]!r}: {why}")
        super().__init__(timeout=timeout)
        self._gossip, self._outer, self._gossip_timeout = gossip, outer, timeout
        self._wrapper_kwargs = wrapper_kwargs
        self.validate_on = validate_on
        self._own_during_evaluation: dict[str, torch.Tensor] | None = None
        self._step_hook: torch.utils.hooks.RemovableHandle | None = None
        self._failed = False  # the run raised (on_exception): teardown absorbs nothing

    # ----------------------------------------------------------------------------- the model

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # A worker's own state is loaded into the wrapper, which exists only after setup (and whose
        # construction broadcasts rank 0's parameters).
        return True

    def setup_distributed(self) -> None:
        self._job.setup_distributed(super().setup_distributed, self.set_world_ranks)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._job.sampler_kwargs(super().distributed_sampler_kwargs, self._wrapper)

    def _setup_model(self, model: nn.Module) -> GossipDataParallel:
        return GossipDataParallel(
            model,
            self._gossip,
            self._outer,
            self._job.membership,
            timeout=self._gossip_timeout,
            **self._wrapper_kwargs,
        )

    def setup(self, trainer: pl.Trainer) -> None:
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler:
            raise ValueError(
                "GossipStrategy: precision='16-mixed' is refused: its gradient scaler skips the "
                "optimizer step on a worker whose gradients overflowed, and that worker alone "
                "would fall a gossip round behind; use precision='bf16-mixed'"
            )
        self._job.check_world_size(self.world_size)
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"GossipStrategy: configure_optimizers() gave {len(self.optimizers)} optimizers; "
                "gossip takes one (each optimizer's step would start a round of its own)"
            )
        # After every optimizer.step(): by Lightning's loop, or by the user's own under manual
        # optimization; gradient accumulation steps it once every few batches.
        self._step_hook = self.model.register_optimizer(self.optimizers[0])

    def teardown(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        wrapper = self._wrapper
        if wrapper is not None:
            if not self._failed:
                # The last step's round is part of the model; after an error it stays out (the
                # module holds the last absorbed model or the last step's).
                self._job.finish(wrapper)
            self.model = self.lightning_module  # drops the wrapper and its engine
        super().teardown()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @property
    def _wrapper(self) -> GossipDataParallel | None:
        return self.model if isinstance(self.model, GossipDataParallel) else None

    # ----------------------------------------------------------------------------- evaluation

    def on_validation_start(self) -> None:
        self._evaluate_on_choice()

    def on_validation_end(self) -> None:
        self._put_back_own_model()

    def on_test_start(self) -> None:
        self._evaluate_on_choice()

    def on_test_end(self) -> None:
        self._put_back_own_model()

    def _evaluate_on_choice(self) -> None:
        # Lightning has put the wrapper in eval mode, which absorbed the round in flight.
        wrapper = self._wrapper
        if self.validate_on != "average" or wrapper is None:
            return
        self._job.at_rest(wrapper)
        module = self.lightning_module
        self._own_during_evaluation = {k: v.clone() for k, v in module.state_dict().items()}
        module.load_state_dict(self._job.inference_state(self._own_during_evaluation, wrapper))

    def _put_back_own_model(self) -> None:
        if self._own_during_evaluation is not None:
            self.lightning_module.load_state_dict(self._own_during_evaluation)
            self._own_during_evaluation = None

    # ----------------------------------------------------------------------------- checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The workers' average, for inference (collective: every rank saves)."""
        wrapper = self._wrapper
        if wrapper is None or self._own_during_evaluation is not None:
            return self.lightning_module.state_dict()
        self._job.at_rest(wrapper)
        return self._job.inference_state(self.lightning_module.state_dict(), wrapper)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        wrapper = self._wrapper
        entry = None if wrapper is None else self._job.worker_entry(
            self.global_rank, self.world_size, wrapper
        )  # fmt: skip
        if entry is not None:
            checkpoint = {**checkpoint, checkpoints.WORKER_KEY: entry}
        path = self._job.worker_file(filepath, self.global_rank, wrapper)
        if path is not None:
            self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        self._job.check_resume(checkpoint_path)
        own = checkpoints.worker_path(checkpoint_path, self.global_rank)
        path = own if Path(own).exists() else checkpoint_path
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        own = checkpoints.own_state(checkpoint, self.global_rank, self.world_size)
        if self._wrapper is not None and own is not None:
            self._wrapper.load_state_dict(own, strict=strict)
        elif self._wrapper is not None:
            # Another job's checkpoint, or a plain one: every worker starts from its average.
            prefixed = {f"module.{k}": v for k, v in checkpoint["state_dict"].items()}
            self._wrapper.load_state_dict(prefixed, strict=strict)
        else:
            super().load_model_state_dict(checkpoint, strict=strict)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        path = self._job.worker_file(filepath, self.global_rank, self._wrapper)
        if path is not None and (self.global_rank == 0 or os.path.exists(path)):
            self.checkpoint_io.remove_checkpoint(path)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Names this strategy ``"gossip"`` (SGP's defaults) in Lightning's registry; it leaves
        DDP's names, which its parent class would register, to DDP."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="gossip_ext: push-sum gossip (SGP) in place of DDP's all-reduce",
            )


_REFUSED_KEYWORDS = {
    "nprocs_per_node": "Lightning's devices are the workers: each process gossips",
    "process_group": "the strategy trains in Lightning's process group",
}
