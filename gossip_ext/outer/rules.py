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

Every rule is an ``interface.OuterRule``: one call, ``step(mean, buckets, optimizer)``, makes the
new parameters of the workers' mean, asking the mean for the form it steps with
(``mean.parameters`` or ``mean.pseudo_gradients``). A rule is local: the outer step runs every
collective before calling it, so that one that fails leaves the rule's state as it was (SlowMo's
sharded form, which sends its slices after the update, is the exception: see
``slow_momentum.SlowMomentum``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from gossip_ext.averagings import Mean
from gossip_ext.averagings.buckets import ParameterBuckets, check_saved
from gossip_ext.outer.interface import OuterRule


class PlainAverage(OuterRule):
    """A plain average: the parameters become the mean, and nothing is kept (LocalSGD's step,
    SlowMo's ``average_every`` steps in between, ``average_parameters()``)."""

    state_key = "average"

    @property
    def started(self) -> bool:
        return True

    def start(self, buckets: ParameterBuckets, means: Sequence[torch.Tensor] | None = None) -> None:
        """Nothing to start."""

    def describe(self) -> str:
        return "PlainAverage"

    def step(
        self, mean: Mean, buckets: ParameterBuckets, optimizer: torch.optim.Optimizer | None
    ) -> list[torch.Tensor]:
        return list(mean.parameters(None))

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
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
        self._started = False

    @property
    def started(self) -> bool:
        return self._started

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """``theta_global`` and the outer optimizer's tensors, one per parameter; None before
        the rule started, or if the optimizer keeps state that is not one tensor per parameter
        of its shape."""
        if not self.started:
            return None
        found: dict[str, list[torch.Tensor | None]] = {"global": list(self.global_params)}
        for i, view in enumerate(self.global_params):
            for key, value in self.optimizer.state.get(view, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == view.shape:
                    found.setdefault(f"optimizer.{key}", [None] * len(self.global_params))[i] = (
                        value
                    )
        state = {name: [t for t in ts if t is not None] for name, ts in found.items()}
        if any(len(ts) != len(self.global_params) for ts in state.values()):
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
        self._started = True

    def describe(self) -> str:
        """What every rank must agree on: the outer optimizer's kind and hyperparameters."""
        groups = [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]
        return f"{type(self.optimizer).__name__}{groups!r}"

    @torch.no_grad()
    def start(self, buckets: ParameterBuckets, means: Sequence[torch.Tensor] | None = None) -> None:
        """``theta_global`` becomes the parameters (or ``means``); every rank's are equal when
        it is called. The optimizer's state is left as it is."""
        for b, flat in enumerate(self.flat):
            if means is not None:
                flat.copy_(means[b])
            elif flat.device == buckets.device(b):
                buckets.read(b, flat)
            else:
                flat.copy_(buckets.read(b, torch.empty_like(flat, device=buckets.device(b))))
        self._started = True

    # Note [DiLoCo's outer step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # Every worker took its pseudo-gradient theta_global - theta_i from the same theta_global, so
    # the mean of the pseudo-gradients is theta_global minus the mean of the parameters, whichever
    # of the two the averaging formed. The outer optimizer (SGD with Nesterov momentum in the
    # paper) steps theta_global with it as its gradient, exactly as torch steps a module's
    # parameters, and the workers' parameters become theta_global: the outer steps write it once
    # this returns, after the averaging committed (OuterSteps._whole_step).
    @torch.no_grad()
    def step(
        self,
        mean: Mean,
        buckets: ParameterBuckets | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> list[torch.Tensor]:
        """Steps ``theta_global`` with the workers' mean pseudo-gradient (Note [DiLoCo's outer
        step]) and returns it: the new parameters, per bucket."""
        for b, grad in enumerate(mean.pseudo_gradients(self.flat)):
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

    def state_dict(self) -> dict[str, object]:
        """A snapshot: torch's optimizers hand out their live state tensors, cloned here, as
        ``theta_global`` is, so that a checkpoint kept in memory does not move on with training."""
        return {
            "global": [t.clone() for t in self.flat],
            "optimizer": _cloned(self.optimizer.state_dict()),
        }

    def check_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """``theta_global``'s layout, and the optimizer's groups as torch's ``load_state_dict``
        checks them, so that neither refuses once the other was written."""
        if state is None:
            return
        if not isinstance(state, Mapping):
            raise ValueError(
                f"load_state_dict: the checkpoint's outer state is a {type(state).__name__}, "
                "not the mapping of theta_global and the outer optimizer's state"
            )
        check_saved("theta_global", state.get("global"), buckets.layout())
        saved = state.get("optimizer")
        groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
        found = None if groups is None else [len(g.get("params", ())) for g in groups]
        mine = [len(g["params"]) for g in self.optimizer.param_groups]
        held = saved.get("state") if isinstance(saved, Mapping) else None
        if found != mine or not isinstance(held, Mapping):
            raise ValueError(
                f"load_state_dict: the checkpoint's outer optimizer has parameter groups of "
                f"{found} parameters, but this model's {type(self.optimizer).__name__} has {mine}"
            )

    @torch.no_grad()
    def load_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """A checkpoint without this state (saved by a run without an outer optimizer) leaves
        ``theta_global`` to start again at the next forward."""
        self.check_state_dict(state, buckets, members_changed)
        if not isinstance(state, Mapping):  # None: checked above
            self._started = False
            return
        for flat, saved in zip(self.flat, state["global"]):
            flat.copy_(saved)
        # torch's optimizers keep the tensors they load: a copy, or training would move the
        # checkpoint's.
        self.optimizer.load_state_dict(_cloned(state["optimizer"]))
        self._started = True


def _cloned(optimizer_state: Mapping[str, object]) -> dict[str, object]:
    """An optimizer's ``state_dict()`` whose state tensors are copies."""
    state = optimizer_state["state"]
    assert isinstance(state, Mapping)  # torch's format, checked by check_state_dict
    return {
        **optimizer_state,
        "state": {
            index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for index, entry in state.items()
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

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buckets: ParameterBuckets,
        device: torch.device | str | None = None,
    ):
        super().__init__(params, buckets, _plain_step, device)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def describe(self) -> str:
        return "GlobalAverage"
