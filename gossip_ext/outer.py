"""Outer steps: what happens every few optimizer steps, beyond the inner mix's gossip.

Three kinds, each taking the place of that step's gossip round:
- a plain exact average (LocalSGD's, ``global_avg_freq``; also ``sync_every`` without an outer
  optimizer, and :meth:`GossipDataParallel.average_parameters` on demand);
- SlowMo's step (``slowmo_freq``): the exact average, then the heavy-ball rule of
  ``outer_rules.SlowMomentum``;
- DiLoCo's step (``outer_optimizer`` with ``sync_every``): the average of the workers'
  pseudo-gradients ``theta_global - theta_i``, then any torch optimizer on ``theta_global``
  (``outer_rules.OuterOptimizer``). Averaged exactly (``outer_average="allreduce"``), or by that
  step's gossip round (``"gossip"``): each worker mixes its parameters with its peers' and steps
  its own ``theta_global`` with ``theta_global - z``; push-sum keeps the mean over workers, so
  their mean moves as under exact averaging, with no collective over every worker. Or by sparse
  messages to fixed neighbours (``ByCompressedGossip``, ``compressed_gossip.SparseGossip``): the
  same step with the parameters mixed by CHOCO-gossip instead of a push-sum round.

The exact average is push-sum's consensus value ``sum_i w_i z_i / sum_i w_i``
(``averaging.exact_average``), read straight from the parameters into the message. DiLoCo's
exact step with ``outer_dtype`` averages the pseudo-gradients themselves, in compressed messages
with error feedback (``compressed_average.CompressedMean``: an all-reduce cannot sum them). Every
collective of a step runs before anything is written: one that fails leaves the parameters and
the rule's state as they were (Note [The parameters are the model] in the engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.averaging import ParameterBuckets, exact_average
from gossip_ext.compressed_average import exact_mean

# What a training step ends with (OuterSteps.kind); None: the inner mix's round, as usual.
AVERAGE = "average"
OUTER = "outer"
# Streaming DiLoCo's prepares and applies (gossip_ext.streaming), followed by the round as usual.
STREAM = "stream"


class OuterSteps:
    """The outer steps of one GossipDataParallel: their schedule, their collectives, the rule's
    state in the checkpoint.

    ``rule`` (an ``outer_rules.SlowMomentum`` or ``OuterOptimizer``, or None) runs every
    ``sync_every`` steps; a plain average every ``average_every`` steps (0: never) where no rule
    runs. Floating-point ``buffers`` (BatchNorm's running statistics) are averaged with the
    parameters by every exact step.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        average_every: int = 0,
        rule: Any = None,
        sync_every: int = 0,
        by_gossip: bool = False,
        outer_dtype: torch.dtype | str | None = None,
        sparse_gossip: Any = None,
    ):
        self.buckets = ParameterBuckets(params)
        # DiLoCo's pseudo-gradients in compressed messages (the rule is an OuterOptimizer).
        self.compressed = None
        self.streaming = rule is not None and rule.own_schedule
        if outer_dtype is not None and not self.streaming:  # fragments keep their own
            self.compressed = exact_mean(
                outer_dtype, self.buckets.layout(), self.buckets.device(0), group
            )
        self.buffer_buckets = ParameterBuckets(buffers)
        self.group = group
        self.average_every = average_every
        self.rule = rule
        self.sync_every = sync_every if rule is not None else 0
        self.by_gossip = by_gossip
        # ByCompressedGossip's exchange (a compressed_gossip.SparseGossip), or None.
        self.sparse_gossip = sparse_gossip
        # The rule starts (again) at the first forward, after any weights loaded by hand.
        self._start_at_forward = rule is not None

    def kind(self, step: int) -> str | None:
        """What the ``step``-th optimizer step (1-based) ends with: the rule's step takes
        precedence over a plain AVERAGE."""
        if self.streaming:
            return STREAM if self.rule.has_action(step) else None
        if self.sync_every and step % self.sync_every == 0:
            return OUTER
        if self.average_every and step % self.average_every == 0:
            return AVERAGE
        return None

    @property
    def needs_inner_lr(self) -> bool:
        """Whether the rule reads the base optimizer's learning rates (SlowMo)."""
        return self.rule is not None and self.rule.needs_inner_lr

    # ----------------------------------------------------------------------------- starting

    @property
    def started(self) -> bool:
        """Whether the rule's state exists (SlowMo's starts at the first forward)."""
        return self.rule is not None and self.rule.started

    def start_eagerly(self) -> None:
        """At construction, once every rank holds the same parameters: rules whose state must
        exist before any step (the outer optimizer's) start here, and again at the forward."""
        if self.rule is not None and self.rule.eager:
            self.rule.start(self.buckets)
            self._start_public_copies()

    def before_forward(self) -> None:
        if self._start_at_forward:
            self.start()

    def start(self) -> None:
        """The rule's state starts at the current parameters (SlowMo's momentum at 0; the outer
        optimizer's state is kept)."""
        if self.rule is not None:
            self.rule.start(self.buckets)
            self._start_public_copies()
        self._start_at_forward = False

    def _start_public_copies(self) -> None:
        """ByCompressedGossip's public copies start with the rule, at the same parameters."""
        if self.sparse_gossip is not None:
            self.sparse_gossip.start(self._read_all())

    def _read_all(self) -> list[torch.Tensor]:
        """A copy of the parameters, a flat tensor per bucket."""
        return [
            self.buckets.read(b, torch.empty(n, dtype=dtype, device=self.buckets.device(b)))
            for b, (n, dtype) in enumerate(self.buckets.layout())
        ]

    # ----------------------------------------------------------------------------- steps

    def run(
        self,
        kind: str,
        weight: float | None,
        buffer_weight: float | None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """An exact step of ``kind``: sets the parameters to the exact average (see
        :func:`exact_average`; ``weight`` is this rank's push-sum weight, None where it gossips
        not), or to what the rule makes of it for OUTER (SlowMo reads ``optimizer``'s learning
        rates), and the floating buffers to their average (weighted by ``buffer_weight``).
        Collective."""
        if kind == OUTER and self.compressed is not None:
            self._run_compressed(weight, buffer_weight)
            return
        # Every bucket is averaged before any is written: one failed collective changes nothing.
        results = [
            exact_average(self.buckets, b, weight, self.group) for b in range(len(self.buckets))
        ]
        buffer_results = [
            exact_average(self.buffer_buckets, b, buffer_weight, self.group)
            for b in range(len(self.buffer_buckets))
        ]
        if kind == OUTER:
            if not self.rule.started:
                # No forward ran before this step (a loop without one): the rule starts from the
                # average, which makes this step a plain average.
                self.rule.start(self.buckets, results)
            results = self.rule.update(self.buckets, results, optimizer)
        for b, result in enumerate(results):
            self.buckets.write(b, result)
        for b, result in enumerate(buffer_results):
            self.buffer_buckets.write(b, result)

    @torch.no_grad()
    def _run_compressed(self, weight: float | None, buffer_weight: float | None) -> None:
        """DiLoCo's exact step with ``outer_dtype``: the mean of the pseudo-gradients
        ``theta_global - theta_i`` in compressed messages, then the outer optimizer; the residuals
        are kept once every collective has succeeded."""
        pseudo_gradients = [
            local.neg_().add_(self.rule.flat[b].to(local.device))
            for b, local in enumerate(self._read_all())
        ]
        staged = self.compressed.mean(pseudo_gradients, weight)
        buffer_results = [
            exact_average(self.buffer_buckets, b, buffer_weight, self.group)
            for b in range(len(self.buffer_buckets))
        ]
        results = self.rule.step_with(staged.means)
        self.compressed.commit(staged)
        for b, result in enumerate(results):
            self.buckets.write(b, result)
        for b, result in enumerate(buffer_results):
            self.buffer_buckets.write(b, result)

    def run_streaming(self, step: int, weight: float | None) -> None:
        """Streaming DiLoCo's prepares and applies due after optimizer step ``step``."""
        self.rule.run(step, weight)

    def align_in_flight(self, step: int) -> None:
        """An elastic epoch begins at optimizer step ``step``: Streaming DiLoCo's fragments in
        flight become those its schedule has in flight there (``StreamingOuter.align_in_flight``).
        Nothing else of the outer steps is ever in flight between steps."""
        if self.rule is not None:
            self.rule.align_in_flight(step)

    def run_on_mixed(self) -> None:
        """The rule's step with this worker's own parameters in place of the exact average:
        ``outer_average="gossip"``, whose round has just mixed them with the round's peers.
        Local; one transient copy of the parameters."""
        for b, result in enumerate(self.rule.update(self.buckets, self._read_all())):
            self.buckets.write(b, result)

    @torch.no_grad()
    def run_sparse_gossip(self) -> None:
        """The rule's step with the parameters mixed by ByCompressedGossip's exchange with the
        neighbours; the public copies are kept once the exchange has succeeded, and nothing is
        written before it has."""
        if not self.rule.started:
            self.start()  # no forward ran before this step: the copies start here
        staged = self.sparse_gossip.mix(self._read_all())
        results = self.rule.update(self.buckets, staged.mixed)
        self.sparse_gossip.commit(staged)
        for b, result in enumerate(results):
            self.buckets.write(b, result)

    # ----------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        if self.rule is None:
            return {}
        state = {self.rule.state_key: self.rule.state_dict() if self.rule.started else None}
        for part in (self.compressed, self.sparse_gossip):
            if part is not None:
                state[part.state_key] = part.state_dict()
        return state

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """The rule's state as one tensor per parameter (``OuterRule.per_parameter_state``);
        an empty dict without a rule (nothing to save), None where it cannot be put so."""
        if self.rule is None:
            return {}
        if self.compressed is not None or self.sparse_gossip is not None:
            return None  # the residuals are cut by shards; the public copies are whole buckets
        return self.rule.per_parameter_state()

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Puts back :meth:`per_parameter_state` (the rule started: the next forward keeps it)."""
        if self.rule is not None and state:
            self.rule.load_per_parameter_state(state)
            self._start_at_forward = False

    def load_state_dict(self, state: Mapping[str, Any], members_changed: bool = False) -> None:
        """A checkpoint without the rule's state (saved before it started, or by a run without
        it) leaves it to start again at the next forward. ``members_changed``: the state of this
        worker's previous elastic epoch (see ``CompressedMean.load_state_dict``)."""
        if self.rule is None:
            return
        saved = state.get(self.rule.state_key)
        self.rule.load_state_dict(saved, self.buckets, members_changed)
        self._start_at_forward = saved is None
        if self.compressed is not None:
            self.compressed.load_state_dict(
                state.get(self.compressed.state_key), members_changed=members_changed
            )
        if self.sparse_gossip is not None:
            self.sparse_gossip.load_state_dict(state.get(self.sparse_gossip.state_key))
