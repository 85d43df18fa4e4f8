"""The rules of an outer step: what the workers' average becomes, and the state that remembers.

An outer step (``gossip_ext.outer.outer_steps.OuterSteps``) averages the workers' parameters and
hands the
average to its rule, which returns the new parameters:
- :class:`SlowMomentum`: SlowMo's heavy-ball step scaled by the inner learning rate (Wang et al.,
  ICLR 2020; fairscale's SlowMoDistributedDataParallel), ``slowmo_*`` arguments;
- :class:`OuterOptimizer`: any torch optimizer stepped with ``theta_global - average`` as its
  gradient: DiLoCo (Douillard et al., 2023) with SGD-Nesterov, ``outer_optimizer``.
A plain average (LocalSGD, ``global_avg_freq``) needs no rule and no state.

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
import torch.distributed as dist

from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.sharded import replicas as sharded


class OuterRule:
    """What every outer step's rule is, to ``outer.OuterSteps`` and the wrapper: Streaming
    DiLoCo's (``streaming.StreamingOuter``) like SlowMo's and DiLoCo's below. A new outer update
    is a subclass; nothing outside its module asks which one it is.

    - ``state_key``: its entry in the checkpoint; ``state_dict()`` / ``load_state_dict(state,
      buckets, members_changed)`` (None: saved before it started; ``members_changed``: the state
      comes from this worker's previous elastic epoch);
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

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def align_in_flight(self, step: int) -> None:
        """An elastic epoch begins at optimizer step ``step``. Only a rule of its own schedule
        has anything in flight between steps."""

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        return None

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no per-parameter state")


class PlainAverage(OuterRule):
    """A plain average: the parameters become the mean, and nothing is kept (LocalSGD's step,
    SlowMo's ``average_every`` steps in between, ``average_parameters()``)."""

    state_key = "average"
    started = True

    def update(self, buckets, averages, optimizer=None) -> list[torch.Tensor]:
        return list(averages)


def learning_rates(
    optimizer: torch.optim.Optimizer, buckets: ParameterBuckets
) -> list[list[float | None]]:
    """The current learning rate of every parameter's param group, None for a parameter the
    optimizer does not update; read at every SlowMo step, so schedulers are followed. A
    parameter is known by its storage: the optimizer of a sharded module holds DTensors, the
    buckets their local shards."""
    lr_of = {
        sharded.storage_key(p): float(group["lr"])
        for group in optimizer.param_groups
        for p in group["params"]
    }
    return [[lr_of.get(sharded.storage_key(p)) for p in ps] for ps in buckets.params]


def _segments(sizes: Sequence[int], lrs: Sequence[float | None]):
    """(start, end, lr) runs of consecutive parameters with one learning rate: usually a single
    run per bucket, so the update is a few whole-buffer operations."""
    start = 0
    run_start, run_lr = 0, None
    for i, (size, lr) in enumerate(zip(sizes, lrs)):
        if i > 0 and lr != run_lr:
            yield run_start, start, run_lr
            run_start = start
        run_lr = lr
        start += size
    if start > run_start:
        yield run_start, start, run_lr


def shard_ranges(numel: int, shards: int, index: int | None) -> tuple[int, int]:
    """The flat range [lo, hi) of shard ``index`` of ``numel`` elements cut into ``shards``
    near-equal parts (the last may be shorter or empty); (0, 0) for ``index`` None."""
    if index is None:
        return 0, 0
    length = -(-numel // shards)
    return min(index * length, numel), min((index + 1) * length, numel)


class SlowMomentum(OuterRule):
    """SlowMo's outer update (Wang et al., ICLR 2020, Algorithm 1; fairscale's
    SlowMoDistributedDataParallel), identical on every rank.

    With ``x_avg`` the exact average, ``gamma`` the base optimizer's current learning rate,
    ``beta`` the slow momentum and ``alpha`` the slow learning rate::

        u      <- beta * u + (x_slow - x_avg) / gamma
        x_slow <- x_slow - alpha * gamma * u

    and the parameters become ``x_slow``. Dividing by ``gamma`` makes ``u`` a sum of gradients
    (the base steps undone), so a learning-rate schedule does not rescale the momentum. A
    parameter that no param group holds, or whose group has ``lr == 0`` (nothing to take
    momentum on), is set to ``x_avg`` with ``u`` unchanged.

    The state (``x_slow`` and ``u``) is two model copies. Sharded (``shards > 1``, fairscale's
    ``slowmo_memory_efficient``), rank ``s < shards`` of the averaging group keeps and updates
    only the ``s``-th slice of every bucket, and sends its result to the others: ``2 / shards``
    model copies per rank for one all-gather's worth of extra traffic per SlowMo step. The
    owners send their slices after updating them, so a failure of those sends is not atomic.

    It starts at the first forward (``eager`` False), or, where a step comes first, at that
    step's average, which makes the first SlowMo step a plain average.
    """

    state_key = "slowmo"
    eager = False
    needs_inner_lr = True

    def __init__(
        self,
        momentum: float,
        lr: float,
        group: dist.ProcessGroup,
        shards: int = 1,
        shard: int | None = 0,
    ):
        self.momentum = momentum
        self.lr = lr
        self.group = group
        self.shards = shards
        self.shard = shard  # this rank's shard; None: it keeps none
        self.slow: list[torch.Tensor] | None = None
        self.buffer: list[torch.Tensor] | None = None

    @property
    def started(self) -> bool:
        return self.slow is not None

    def describe(self) -> tuple:
        return ("SlowMo", self.momentum, self.lr, self.shards)

    def update(
        self,
        buckets: ParameterBuckets,
        averages: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> list[torch.Tensor]:
        """The SlowMo step from the exact ``averages`` (full flat buckets), written into them:
        the new parameters. ``optimizer`` is the base optimizer, whose learning rates scale it."""
        lrs = learning_rates(optimizer, buckets)
        for b, ((lo, _), average) in enumerate(zip(self.ranges(buckets), averages)):
            sizes = [p.numel() for p in buckets.params[b]]
            self.step(b, average, lo, sizes, lrs[b])
            if self.shards > 1:
                # Every shard's owner sends its slice of x_slow to the others.
                for shard in range(self.shards):
                    s_lo, s_hi = shard_ranges(average.numel(), self.shards, shard)
                    if s_lo < s_hi:
                        owner = dist.get_global_rank(self.group, shard)
                        dist.broadcast(average[s_lo:s_hi], owner, group=self.group)
        return averages

    def ranges(self, buckets: ParameterBuckets) -> list[tuple[int, int]]:
        """This rank's slice of every bucket."""
        return [
            shard_ranges(buckets.numel(b), self.shards, self.shard) for b in range(len(buckets))
        ]

    @torch.no_grad()
    def start(self, buckets: ParameterBuckets, averages: Sequence[torch.Tensor] | None = None):
        """x_slow starts at the parameters (or at ``averages``, full flat buckets), u at 0."""
        self.slow, self.buffer = [], []
        for b, (lo, hi) in enumerate(self.ranges(buckets)):
            slow = torch.empty(hi - lo, dtype=buckets.dtype(b), device=buckets.device(b))
            if averages is None:
                buckets.read(b, slow, lo)
            else:
                slow.copy_(averages[b][lo:hi])
            self.slow.append(slow)
            self.buffer.append(torch.zeros_like(slow))

    @torch.no_grad()
    def step(
        self,
        bucket: int,
        average: torch.Tensor,
        lo: int,
        sizes: Sequence[int],
        lrs: Sequence[float | None],
    ) -> None:
        """Updates this rank's slice [lo, ...) of ``bucket`` from its exact ``average`` (the full
        flat bucket; ``sizes`` and ``lrs``: its parameters' elements and learning rates) and
        writes x_slow into that slice of ``average``. In place: no temporary."""
        slow, buffer = self.slow[bucket], self.buffer[bucket]
        hi = lo + slow.numel()
        for start, end, gamma in _segments(sizes, lrs):
            start, end = max(start, lo), min(end, hi)
            if start >= end:
                continue
            x = slow[start - lo : end - lo]
            u = buffer[start - lo : end - lo]
            a = average[start:end]
            if not gamma:
                x.copy_(a)
                continue
            u.mul_(self.momentum).add_(x, alpha=1.0 / gamma).sub_(a, alpha=1.0 / gamma)
            x.add_(u, alpha=-self.lr * gamma)
            a.copy_(x)

    def state_dict(self) -> dict[str, Any] | None:
        if self.slow is None:
            return None
        return {
            "slow": [t.clone() for t in self.slow],
            "momentum": [t.clone() for t in self.buffer],
            "shards": self.shards,
            "shard": self.shard,
        }

    def load_state_dict(
        self,
        state: Mapping[str, Any] | None,
        buckets: ParameterBuckets,
        members_changed: bool = False,
    ) -> None:
        """A checkpoint without SlowMo state (saved before it started) starts it again at the
        next forward."""
        if state is None:
            self.slow = self.buffer = None
            return
        saved = (state.get("shards", 1), state.get("shard", 0))
        if saved != (self.shards, self.shard):
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state is shard {saved[1]} of "
                f"{saved[0]}, but this rank keeps shard {self.shard} of {self.shards} "
                "(slowmo_memory_efficient, slowmo_num_shards and the rank must match)"
            )
        expected = [(hi - lo, buckets.dtype(b)) for b, (lo, hi) in enumerate(self.ranges(buckets))]
        found = [(t.numel(), t.dtype) for t in state["slow"]]
        if found != expected:
            raise ValueError(
                f"load_state_dict: the checkpoint's SlowMo state has buckets (elements, dtype) "
                f"{found}, but this model's parameters give {expected}"
            )
        self.slow = [t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["slow"])]
        self.buffer = [
            t.detach().to(buckets.device(b)).clone() for b, t in enumerate(state["momentum"])
        ]


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
    def step_with(self, mean_pseudo_gradients: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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

    @torch.no_grad()
    def load_state_dict(
        self,
        state: Mapping[str, Any] | None,
        buckets: ParameterBuckets,
        members_changed: bool = False,
    ) -> None:
        """A checkpoint without this state (saved by a run without an outer optimizer) leaves
        ``theta_global`` to start again at the next forward."""
        if state is None:
            self.started = False
            return
        found = [(t.numel(), t.dtype) for t in state["global"]]
        if found != buckets.layout():
            raise ValueError(
                f"load_state_dict: the checkpoint's theta_global has buckets (elements, dtype) "
                f"{found}, but this model's parameters give {buckets.layout()}"
            )
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
