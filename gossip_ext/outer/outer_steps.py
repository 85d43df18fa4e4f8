"""Outer steps: what happens every few optimizer steps, beyond the inner mix's gossip.

A whole-model step (:class:`OuterSteps`) takes the place of that step's gossip round: a plain
exact average (LocalSGD's, SlowMo's ``average_every``, and
:meth:`GossipDataParallel.average_parameters` on demand), or the outer rule's step (SlowMo's heavy
ball, DiLoCo's outer optimizer on ``theta_global``) on the mean its averaging forms. Streaming
DiLoCo's fragments (``streaming.StreamingSteps``) run their own prepares and applies instead, and
the step's gossip round follows as usual; both share :class:`LockstepOuterSteps`.

Every way to average is one :class:`gossip_ext.averagings.Averaging`, asked the same three
things (start, finish, commit); every collective of a step runs before anything is written, so
one that fails leaves the parameters and the rule's state as they were (Note [The parameters are
the model] in the engine), and these steps keep the error raised (Note [A failed outer step]).

A whole-model step reads top to bottom in :meth:`LockstepOuterSteps._whole_step`: what is
averaged (the contribution: the parameters or the pseudo-gradients, with the push-sum weight),
how (the averaging's start and finish), what the rule makes of the mean (``rule.step``: for
DiLoCo, Note [DiLoCo's outer step] in ``rules``), the commit, then the one write; its failure is
kept here.
"""

from __future__ import annotations

import abc
import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from gossip_ext.averagings import AllReduceMean, Averaging, Contribution
from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.averagings.failures import DEFAULT_TIMEOUT
from gossip_ext.outer.interface import OuterRule, RuleState, StepContext
from gossip_ext.outer.rules import PlainAverage

_PLAIN = PlainAverage()

# What a whole-model step ends with (OuterSteps.kind); None: the inner mix's round, as usual.
AVERAGE = "average"
OUTER = "outer"

Rule = TypeVar("Rule", bound=RuleState)
Result = TypeVar("Result")


class LockstepOuterSteps(abc.ABC, Generic[Rule]):
    """What the outer steps of one GossipDataParallel share, whichever schedule they run: the
    parameters' buckets, the exact average (the buffers', and a plain average on demand), the
    rule's state (its start and its checkpoint), and a failed step's error.

    ``rule`` runs every ``sync_every`` steps, on the mean ``averaging`` forms (default: the exact
    all-reduce). Floating-point ``buffers`` (BatchNorm's running statistics) are averaged exactly
    with every averaging over all workers.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        rule: Rule | None = None,
        sync_every: int = 0,
        averaging: Averaging | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ):
        self.buckets = ParameterBuckets(params)
        self.buffer_buckets = ParameterBuckets(buffers)
        self.group = group
        # Plain averages and the buffers.
        self.exact = AllReduceMean(group, timeout, self.buckets.layout())
        self.averaging = averaging if averaging is not None else self.exact
        self.rule = rule
        self.sync_every = sync_every if rule is not None else 0
        # The rule starts (again) at the first forward, after any weights loaded by hand.
        self._start_at_forward = rule is not None
        # A step that failed, raised again by every later call (Note [A failed outer step]).
        self._failure: Exception | None = None

    @property
    def needs_inner_lr(self) -> bool:
        """Whether the rule reads the base optimizer's learning rates (SlowMo)."""
        return self.rule is not None and self.rule.needs_inner_lr

    # ----------------------------------------------------------------------------- starting

    @property
    def started(self) -> bool:
        """Whether the rule's state exists (SlowMo's starts at the first forward)."""
        return self.rule is not None and self.rule.started

    def describe_rule(self) -> object:
        """The rule's hyperparameters as plain values; None without a rule."""
        return None if self.rule is None else self.rule.describe()

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that step ``theta_global`` (DiLoCo's; none for SlowMo's rule)."""
        return [] if self.rule is None else list(self.rule.optimizers)

    def start_eagerly(self) -> None:
        """At construction, once every rank holds the same parameters: rules whose state must
        exist before any step (the outer optimizer's) start here, and again at the forward."""
        if self.rule is not None and self.rule.eager:
            self.start()
            self._start_at_forward = True

    def before_forward(self) -> None:
        if self._start_at_forward:
            self.start()

    def start(self) -> None:
        """The rule's state starts at the current parameters (SlowMo's momentum at 0; the outer
        optimizer's state is kept), and the averaging's with it."""
        if self.rule is not None:
            self.rule.start(self.buckets)
            self.averaging.begin(self.buckets)
        self._start_at_forward = False

    # ----------------------------------------------------------------------------- steps

    @abc.abstractmethod
    def end_step(self, step: int, make_context: Callable[[], StepContext]) -> bool:
        """Runs what ends the ``step``-th optimizer step (1-based), asking ``make_context`` only
        where something runs. Returns whether the step's gossip round still runs. Collective
        where a step is due."""

    @abc.abstractmethod
    def bytes_per_step(self, round_bytes: int) -> float | None:
        """Bytes this worker sends per optimizer step for these steps, the mean over their
        period; None where an averaging does not know. ``round_bytes``: what one round of the
        inner engine sends (an averaging that runs one)."""

    def average_now(self, step: int, context: StepContext) -> None:
        """A plain exact average now (``average_parameters()``). Collective."""
        self.raise_if_failed()
        self._whole_step(self.exact, _PLAIN, step, context)

    def _whole_step(
        self, averaging: Averaging, rule: OuterRule, step: int, context: StepContext
    ) -> None:
        """One whole-model step, each stage here: the gossip round in flight is absorbed
        (``before_whole_step``); this worker's contribution (its parameters, or ``theta_global -
        theta``, with its push-sum weight) is averaged over the workers (``start``, ``finish``),
        the buffers exactly beside it; the rule makes the new parameters of the mean (DiLoCo's
        outer optimizer steps ``theta_global`` with the mean pseudo-gradient); the averaging keeps
        its state of a step that succeeded (``commit``); only then is anything written. A failure
        on the way writes nothing and is kept (Note [A failed outer step])."""
        averaging.before_whole_step(context.mix)
        weight = context.weight()

        def collect() -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
            contribution = Contribution(self.buckets, rule.theta_global, weight, step, context.mix)
            mean = averaging.finish(averaging.start(contribution))
            buffers = None
            if averaging.averages_buffers and len(self.buffer_buckets):
                of_buffers = Contribution(
                    self.buffer_buckets, None, context.buffer_weight(weight), step
                )
                buffers = self.exact.finish(self.exact.start(of_buffers)).values
            if not rule.started:
                # No forward ran before this step (a loop without one): the rule starts from
                # the mean, which makes this step a plain average.
                rule.start(self.buckets, mean.parameters(rule.theta_global))
            results = rule.step(mean, self.buckets, context.optimizer)
            averaging.commit(mean)
            return results, buffers

        results, buffers = self._guarded(collect)
        for b, result in enumerate(results):
            self.buckets.write(b, result)
        if buffers is not None:
            for b, result in enumerate(buffers):
                self.buffer_buckets.write(b, result)
        averaging.after_whole_step(context.mix)

    # Note [A failed outer step]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A step whose collective failed left this worker's parameters as they were, but perhaps
    # wrote them on ranks whose collectives succeeded: the ranks are at different collectives, so
    # no later one (an outer step's, a gossip round's) may run between them. The error stays
    # here, raised by every later call of these steps and, through the wrapper's runtime
    # (``assembly.Runtime.raise_if_failed``), by every call of the wrapper that communicates.
    def _guarded(self, run: Callable[[], Result]) -> Result:
        """``run()``; an error it raises is kept (Note [A failed outer step])."""
        try:
            return run()
        except Exception as error:
            self._failure = error
            raise

    def raise_if_failed(self) -> None:
        """Raises the error of a step that failed, if one did (Note [A failed outer step])."""
        if self._failure is not None:
            # The same error each time, with this call's traceback (not every earlier one's).
            raise self._failure.with_traceback(None)

    def align_in_flight(self, step: int) -> None:
        """An elastic epoch begins at optimizer step ``step``: what the rule has in flight
        becomes what its schedule has in flight there (``RuleState.align_in_flight``)."""
        if self.rule is not None:
            self.rule.align_in_flight(step)

    # ----------------------------------------------------------------------------- checkpoint

    def state_keys(self) -> list[str]:
        """The checkpoint entries :meth:`state_dict` writes: the rule's, then the averaging's."""
        if self.rule is None:
            return []
        keys = [self.rule.state_key]
        return keys if self.averaging.state_key is None else [*keys, self.averaging.state_key]

    def state_dict(self) -> dict[str, object]:
        if self.rule is None:
            return {}
        state: dict[str, object] = {
            self.rule.state_key: self.rule.state_dict() if self.rule.started else None
        }
        if self.averaging.state_key is not None:
            state[self.averaging.state_key] = self.averaging.state_dict()
        return state

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """The rule's state as one tensor per parameter (``OuterRule.per_parameter_state``);
        an empty dict without a rule (nothing to save), None where it cannot be put so."""
        if self.rule is None:
            return {}
        if self.averaging.state_key is not None:
            return None  # an averaging's state (residuals, public copies) is cut by buckets
        return self.rule.per_parameter_state()

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Puts back :meth:`per_parameter_state` (the rule started: the next forward keeps it)."""
        if self.rule is not None and state:
            self.rule.load_per_parameter_state(state)
            self._start_at_forward = False

    def check_state_dict(self, state: Mapping[str, object], members_changed: bool = False) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse
        ``state``: the rule's and the averaging's state both, before either is written."""
        if self.rule is None:
            return
        self.rule.check_state_dict(state.get(self.rule.state_key), self.buckets, members_changed)
        if self.averaging.state_key is not None:
            self.averaging.check_state_dict(
                _entry(state, self.averaging.state_key), members_changed
            )

    def load_state_dict(self, state: Mapping[str, object], members_changed: bool = False) -> None:
        """A checkpoint without the rule's state (saved before it started, or by a run without
        it) leaves it to start again at the next forward. ``members_changed``: the state of this
        worker's previous elastic epoch (see ``CompressedMean.load_state_dict``)."""
        self.check_state_dict(state, members_changed)
        if self.rule is None:
            return
        saved = state.get(self.rule.state_key)
        self.rule.load_state_dict(saved, self.buckets, members_changed)
        self._start_at_forward = saved is None
        if self.averaging.state_key is not None:
            self.averaging.load_state_dict(
                _entry(state, self.averaging.state_key), members_changed=members_changed
            )

    def load_donor_state(self, state: Mapping[str, object]) -> None:
        """Loads a donor's :meth:`state_dict` into a worker that joins an elastic job, without
        what the donor still owes the others: the error-feedback residuals of a compressed or
        sparse averaging, and whatever the rule keeps out (``RuleState.for_joiner``). A
        fragment in flight is sent again by the joiner too, with the donor's pseudo-gradient: its
        own would be the same, as its model is the donor's."""
        # "outer_residuals": the state_key of the averagings that keep residuals (CompressedMean,
        # TopK).
        handed = {k: v for k, v in state.items() if k != "outer_residuals"}
        if self.rule is not None and self.rule.state_key in handed:
            handed[self.rule.state_key] = self.rule.for_joiner(handed[self.rule.state_key])
        self.load_state_dict(handed)


def _entry(state: Mapping[str, object], key: str) -> Mapping[str, object] | None:
    """The checkpoint's entry ``key``: a mapping, or None where it has none."""
    entry = state.get(key)
    if entry is not None and not isinstance(entry, Mapping):
        raise ValueError(
            f"load_state_dict: the checkpoint's {key!r} is a {type(entry).__name__}, not a mapping"
        )
    return entry


class OuterSteps(LockstepOuterSteps[OuterRule]):
    """The whole-model outer steps: ``rule`` (a plain average, SlowMo's or DiLoCo's; None: none)
    every ``sync_every`` steps on the mean ``averaging`` forms, and a plain average every
    ``average_every`` steps (0: never) where no rule runs."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        average_every: int = 0,
        rule: OuterRule | None = None,
        sync_every: int = 0,
        averaging: Averaging | None = None,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ):
        super().__init__(
            params,
            buffers,
            group,
            rule=rule,
            sync_every=sync_every,
            averaging=averaging,
            timeout=timeout,
        )
        self.average_every = average_every

    def kind(self, step: int) -> str | None:
        """What the ``step``-th optimizer step (1-based) ends with: the rule's step takes
        precedence over a plain AVERAGE."""
        if self.sync_every and step % self.sync_every == 0:
            return OUTER
        if self.average_every and step % self.average_every == 0:
            return AVERAGE
        return None

    def end_step(self, step: int, make_context: Callable[[], StepContext]) -> bool:
        """The rule's step on its averaging's mean, or a plain average, in place of the step's
        gossip round (which runs where neither is due)."""
        self.raise_if_failed()
        kind = self.kind(step)
        if kind == OUTER and self.rule is not None:
            self._whole_step(self.averaging, self.rule, step, make_context())
        elif kind == AVERAGE:
            self._whole_step(self.exact, _PLAIN, step, make_context())
        return kind is None

    def bytes_per_step(self, round_bytes: int) -> float | None:
        sent = 0.0
        if self.sync_every:
            period = self.averaging.bytes_per_step(round_bytes)
            if period is None:
                return None
            sent += period / self.sync_every
        if self.average_every:
            # Plain averages on the steps no outer step takes.
            share = 1 / self.average_every
            if self.sync_every:
                share -= 1 / math.lcm(self.average_every, self.sync_every)
            exact = self.exact.bytes_per_step()
            if exact is None:
                return None
            sent += share * exact
        return sent
