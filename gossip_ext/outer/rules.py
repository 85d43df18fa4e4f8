"""The rules of an outer step: what the workers' average becomes, and the state that remembers.

An outer step (``gossip_ext.outer.outer_steps.OuterSteps``) averages the workers' parameters and
hands the
average to its rule, which returns the new parameters:
- ``slow_momentum.SlowMomentum``: SlowMo's heavy-ball step scaled by the inner learning rate
  (Wang et al., ICLR 2020; fairscale's SlowMoDistributedDataParallel), ``slowmo_*`` arguments;
- :class:`OuterOptimizer`: any torch optimizer stepped with ``theta_global - average`` as its
  gradient: DiLoCo (Douillard et al., 2023) with SGD-Nesterov, ``outer_optimizer``.
- :class:`PlainAverage`: the parameters become the average, nothing kept (LocalSGD); and
  :class:`GlobalAverage`, the same from differences to the model of the last average, for
  compressed or sparse messages.

A rule is local: the outer step runs every collective before calling it, so that one that fails
leaves the rule's state as it was (SlowMo's sharded form, which sends its slices after the update,
is the exception: see :class:`SlowMomentum`). Each rule says how it starts (``start``), whether it
starts at construction (``eager``) or at the first forward, and what its checkpoint entry is
(``state_key``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gossip_ext.averagings import Averaging
from gossip_ext.averagings.buckets import ParameterBuckets, check_saved


class OuterRule:
    """What every outer step's rule is, to ``outer.OuterSteps`` and the wrapper: Streaming
    DiLoCo's (``streaming.StreamingOuter``) like SlowMo's and DiLoCo's below. A new outer update
    is a subclass; nothing outside its module asks which one it is.

    - ``state_key``: its entry in the checkpoint; ``state_dict()`` / ``load_state_dict(state,
      buckets, members_changed)`` (None: saved before it started; ``members_changed``: the state
      comes from this worker's previous elastic epoch), which writes nothing unless
      ``check_state_dict`` with the same arguments passes;
    - ``eager``: whether it starts at construction as well as at the first forward (``start``);
      ``started``, ``describe()`` (what every rank must agree on);
    - ``needs_inner_lr``: whether it reads the inner optimizer's learning rates (``update``'s
      ``optimizer``);
    - ``own_schedule``: False for a step every ``sync_every`` steps, with the average
      (``update(buckets, averages, optimizer)``); True for a rule that runs its own prepares and
      applies (``has_action(step)``, ``run(step, weight)``), whose work may be in flight between
      steps (``align_in_flight``);
    - ``optimizers``: the torch optimizers a user may schedule (an outer learning rate);
    - ``per_parameter_state()`` / ``load_per_parameter_state(state)``: its state as tensors
      shaped like each parameter (a sharded replica's: like each local shard), which a checkpoint
      may cut anew under another mesh (gossip_ext.sharded.checkpoint); None where its state is not
      all per parameter.
    """

    state_key: str
    eager = False
    needs_inner_lr = False
    own_schedule = False
    # The global parameters, one flat tensor per bucket, whose difference from a worker's
    # parameters is its pseudo-gradient; None for a rule without them.
    theta_global: list[torch.Tensor] | None = None

    def bytes_per_period(self, averaging: Averaging, round_bytes: int) -> int | None:
        """Bytes this worker sends in one period of ``sync_every`` steps: one outer step's
        ``averaging`` (default; None where it does not know). ``round_bytes``: what one round
        of the inner engine sends."""
        return averaging.bytes_per_step(round_bytes)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def align_in_flight(self, step: int) -> None:
        """An elastic epoch begins at optimizer step ``step``. Only a rule of its own schedule
        has anything in flight between steps."""

    def check_state_dict(self, state, buckets, members_changed: bool = False) -> None:
        """Raises ValueError, writing nothing, where ``load_state_dict`` would refuse ``state``
        (default: a rule that keeps nothing accepts anything)."""

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        return None

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no per-parameter state")


class PlainAverage(OuterRule):
    """A plain average: the parameters become the mean, and nothing is kept (LocalSGD's step,
    SlowMo's ``average_every`` steps in between, ``average_parameters()``)."""

    state_key = "average"
    started = True

    def start(self, buckets, averages=None) -> None:
        """Nothing to start."""

    def describe(self) -> str:
        return "PlainAverage"

    def update(self, buckets, averages, optimizer=None) -> list[torch.Tensor]:
        return list(averages)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state, buckets, members_changed: bool = False) -> None:
        """Nothing to load."""

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]]:
        return {}


OuterOptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _build(factory: OuterOptimizerFactory, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``factory(tensors)``, checked: a torch optimizer over exactly those tensors."""
    optimizer = factory(tensors)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "outer_optimizer must build a torch.optim.Optimizer from the list of global "
            f"parameters it is given, but it returned {type(optimizer).__name__} {optimizer!r}"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if held != {id(t) for t in tensors}:
        raise ValueError(
            "outer_optimizer must build its optimizer over the tensors it is given (the global "
            "parameters, one per module parameter), but the optimizer it returned holds "
            f"{len(held)} tensors of which {len(held - {id(t) for t in tensors})} are others "
            "(for example the module's own parameters): "
            "use `lambda params: torch.optim.SGD(params, ...)`"
        )
    return optimizer


class OuterOptimizer(OuterRule):
    """DiLoCo's outer step: ``theta_global`` and a torch optimizer over it, stepped with
    ``theta_global - average`` as its gradient (the mean of the workers' pseudo-gradients, since
    ``theta_global`` is the same on every rank under exact averaging); the parameters become
    ``theta_global``.

    ``theta_global`` is one flat tensor per dtype bucket of the parameters (the engine's order);
    the outer optimizer sees it as one view per module parameter, shaped like it, in
    ``module.parameters()`` order, so its per-parameter state and its ``state_dict()`` read as
    they would over the module. It lives on ``device`` (default: the parameters'), and so does the
    optimizer's state; ``'cpu'`` keeps both in host memory for GPU parameters.

    Memory, in model copies of the accumulation dtype: ``theta_global`` one, the optimizer's
    state what it keeps (SGD with momentum one, Adam two); during a step the average, which
    becomes the gradient in place. It starts at construction (``eager``), from the parameters
    every rank holds after the broadcast, and again at the first forward.
    """

    state_key = "outer"
    eager = True
    needs_inner_lr = False

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def theta_global(self) -> list[torch.Tensor]:
        return self.flat

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buckets: ParameterBuckets,
        factory: OuterOptimizerFactory,
        device: torch.device | str | None = None,
    ):
        self.device = buckets.device(0) if device is None else torch.device(device)
        self.flat = [
            torch.zeros(buckets.numel(b), dtype=buckets.dtype(b), device=self.device)
            for b in range(len(buckets))
        ]
        self._views: list[list[torch.Tensor]] = []  # per bucket, per parameter
        for b, ps in enumerate(buckets.params):
            offset, views = 0, []
            for p in ps:
                views.append(self.flat[b][offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            self._views.append(views)
        by_id = {id(p): v for ps, vs in zip(buckets.params, self._views) for p, v in zip(ps, vs)}
        self.global_params = [by_id[id(p)] for p in params]
        self.optimizer = _build(factory, self.global_params)
        self.started = False

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """``theta_global`` and the outer optimizer's tensors, one per parameter; None before
        the rule started, or if the optimizer keeps state that is not one tensor per parameter
        of its shape."""
        if not self.started:
            return None
        state = {"global": list(self.global_params)}
        for i, view in enumerate(self.global_params):
            for key, value in self.optimizer.state.get(view, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == view.shape:
                    state.setdefault(f"optimizer.{key}", [None] * len(self.global_params))[i] = (
                        value
                    )
        if any(t is None for ts in state.values() for t in ts):
            return None
        return state

    @torch.no_grad()
    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Puts back what :meth:`per_parameter_state` gave, under another cut of the parameters;
        the optimizer's scalar state (Adam's ``step``) stays as it is."""
        for view, saved in zip(self.global_params, state["global"]):
            view.copy_(saved)
        for name, tensors in state.items():
            if name.startswith("optimizer."):
                key = name[len("optimizer.") :]
                for view, saved in zip(self.global_params, tensors):
                    slot = self.optimizer.state.setdefault(view, {})
                    slot[key] = saved.to(view.device, view.dtype).clone()
        self.started = True

    def describe(self) -> str:
        """What every rank must agree on: the outer optimizer's kind and hyperparameters."""
        groups = [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]
        return f"{type(self.optimizer).__name__}{groups!r}"

    @torch.no_grad()
    def start(
        self, buckets: ParameterBuckets, averages: Sequence[torch.Tensor] | None = None
    ) -> None:
        """``theta_global`` becomes the parameters (or ``averages``); every rank's are equal when
        it is called. The optimizer's state is left as it is."""
        for b, flat in enumerate(self.flat):
            if averages is not None:
                flat.copy_(averages[b])
            elif flat.device == buckets.device(b):
                buckets.read(b, flat)
            else:
                flat.copy_(buckets.read(b, torch.empty_like(flat, device=buckets.device(b))))
        self.started = True

    @torch.no_grad()
    def update(
        self,
        buckets: ParameterBuckets,
        averages: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> list[torch.Tensor]:
        """Steps ``theta_global`` with ``theta_global - average`` as its gradient (computed in
        ``averages``, which it overwrites) and returns it, per bucket: the new parameters."""
        return self.step_with(
            [
                average.to(self.device).neg_().add_(self.flat[b])
                for b, average in enumerate(averages)
            ]
        )

    @torch.no_grad()
    def step_with(
        self, mean_pseudo_gradients: Sequence[torch.Tensor], buckets=None, optimizer=None
    ) -> list[torch.Tensor]:
        """Steps ``theta_global`` with the workers' mean pseudo-gradient (per bucket; read, and
        kept as the gradient during the step) and returns it: the new parameters."""
        for b, mean in enumerate(mean_pseudo_gradients):
            grad = mean.to(self.device)
            offset = 0
            for view in self._views[b]:
                view.grad = grad[offset : offset + view.numel()].view(view.shape)
                offset += view.numel()
        try:
            self.optimizer.step()
        finally:
            for view in self.global_params:
                view.grad = None
        return self.flat

    def state_dict(self) -> dict[str, Any]:
        """A snapshot: torch's optimizers hand out their live state tensors, cloned here, as
        ``theta_global`` is, so that a checkpoint kept in memory does not move on with training."""
        return {
            "global": [t.clone() for t in self.flat],
            "optimizer": _cloned(self.optimizer.state_dict()),
        }

    def check_state_dict(self, state, buckets, members_changed: bool = False) -> None:
        """``theta_global``'s layout, and the optimizer's groups as torch's ``load_state_dict``
        checks them, so that neither refuses once the other was written."""
        if state is None:
            return
        check_saved("theta_global", state.get("global"), buckets.layout())
        saved = state.get("optimizer")
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        found = None if groups is None else [len(g.get("params", ())) for g in groups]
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        if found != mine or not isinstance(saved.get("state"), Mapping):
            raise ValueError(
                f"load_state_dict: the checkpoint's outer optimizer has parameter groups of "
                f"{found} parameters, but this model's {type(self.optimizer).__name__} has {mine}"
            )

    @torch.no_grad()
    def load_state_dict(
        self,
        state: Mapping[str, Any] | None,
        buckets: ParameterBuckets,
        members_changed: bool = False,
    ) -> None:
        """A checkpoint without this state (saved by a run without an outer optimizer) leaves
        ``theta_global`` to start again at the next forward."""
        self.check_state_dict(state, buckets, members_changed)
        if state is None:
            self.started = False
            return
        for flat, saved in zip(self.flat, state["global"]):
            flat.copy_(saved)
        # torch's optimizers keep the tensors they load: a copy, or training would move the
        # checkpoint's.
        self.optimizer.load_state_dict(_cloned(state["optimizer"]))
        self.started = True


def _cloned(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` whose state tensors are copies."""
    return {
        **optimizer_state,
        "state": {
            index: {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items()}
            for index, entry in optimizer_state["state"].items()
        },
    }


def _plain_step(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)


class GlobalAverage(OuterOptimizer):
    """A plain average formed from differences: every worker keeps the model of the last average
    (``theta_global``) and sends its difference from it (compressed or sparse messages, whose
    error feedback is kept against it); the new model is ``theta_global`` minus their mean. That
    is DiLoCo's outer step with plain SGD at learning rate 1, and is computed as one, bit for
    bit; it has no optimizer for a user to schedule."""

    state_key = "average"

    def __init__(self, params, buckets: ParameterBuckets, device=None):
        super().__init__(params, buckets, _plain_step, device)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def describe(self) -> str:
        return "GlobalAverage"
