"""The outer steps' interface: what the wrapper, its checkpoint and an elastic job's epochs ask of
whatever runs every few optimizer steps beyond the inner gossip.

Three objects implement :class:`OuterRuntime`: the whole-model steps (``outer_steps.OuterSteps``:
a plain average, SlowMo and DiLoCo, each on any averaging), Streaming DiLoCo's fragments
(``streaming.StreamingSteps``) and the asynchronous steps (``asynchronous.AsyncOuterSteps``:
AsyncDiLoCo). A type checker holds them to it (the typing stage of ``tools/run_tests.sh``); each is
built by its configuration object's ``outer_steps`` (``gossip_ext.algorithms``).

The contract: :meth:`OuterRuntime.end_step` after every optimizer step runs whatever that step
ends with, every collective before any write, so a step that fails leaves the parameters and the
state as they were and keeps its error, raised again by :meth:`OuterRuntime.raise_if_failed`.

What a whole-model step makes of the workers' mean is its :class:`OuterRule` (``rules``:
``PlainAverage``, ``OuterOptimizer`` for DiLoCo, ``GlobalAverage``; ``slow_momentum.SlowMomentum``),
one call, :meth:`OuterRule.step`; Streaming DiLoCo's ``StreamingOuter`` keeps its fragments' rules.
Both are :class:`RuleState`: what a checkpoint, an elastic epoch and the configuration check read
of an outer step's state.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from gossip_ext.averagings import Mean
from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.gossip.inner import InnerMix


@dataclasses.dataclass
class StepContext:
    """What the wrapper lends an outer step: its inner mix, this process's push-sum weight (read
    once the mix is drained; None where it contributes nothing), the floating buffers' weight
    given that, and the inner optimizer (SlowMo reads its rates)."""

    mix: InnerMix
    weight: Callable[[], float | None]
    buffer_weight: Callable[[float | None], float | None]
    optimizer: torch.optim.Optimizer | None = None


class OuterRuntime(Protocol):
    """One worker's outer steps (see the module docstring)."""

    @property
    def needs_inner_lr(self) -> bool:
        """Whether the rule reads the inner optimizer's learning rates (SlowMo)."""

    @property
    def sync_every(self) -> int:
        """The optimizer steps between two lockstep outer steps; 0: none on a fixed schedule."""

    # ------------------------------------------------------------------ starting

    @property
    def started(self) -> bool:
        """Whether the rule's state exists."""

    def start(self) -> None:
        """The rule's state starts at the current parameters."""

    def start_eagerly(self) -> None:
        """At construction, once every rank holds the same parameters."""

    def before_forward(self) -> None:
        """Before each forward: starts the rule where it starts at the first forward."""

    def describe_rule(self) -> object:
        """The rule's hyperparameters as plain values, which every rank must agree on; None
        without a rule."""

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that step ``theta_global`` (for a learning-rate scheduler)."""

    # ------------------------------------------------------------------ steps

    def end_step(self, step: int, make_context: Callable[[], StepContext]) -> bool:
        """Runs what ends the ``step``-th optimizer step (1-based), asking ``make_context`` only
        where something runs; whether the step's gossip round still runs."""

    def average_now(self, step: int, context: StepContext) -> None:
        """Every worker together: one model now (``average_parameters()``)."""

    def raise_if_failed(self) -> None:
        """Raises the error of a step that failed, if one did: a failed step is kept here and
        raised by every later call (Note [A failed outer step] in ``outer_steps``)."""

    def bytes_per_step(self, round_bytes: int) -> float | None:
        """Bytes this worker sends per optimizer step for these steps; None where unknown.
        ``round_bytes``: what one round of the inner engine sends."""

    def align_in_flight(self, step: int) -> None:  # noqa: B027 - a default: nothing in flight
        """An elastic epoch begins at optimizer step ``step``: what is in flight becomes what the
        schedule has in flight there."""

    # ------------------------------------------------------------------ checkpoint

    def state_keys(self) -> list[str]:
        """The checkpoint entries :meth:`state_dict` writes."""

    def state_dict(self) -> dict[str, object]:
        """The rule's (and the averaging's) state, by :meth:`state_keys`."""

    def check_state_dict(self, state: Mapping[str, object], members_changed: bool = False) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse."""

    def load_state_dict(self, state: Mapping[str, object], members_changed: bool = False) -> None:
        """Puts back a :meth:`state_dict` (``members_changed``: an elastic worker's own state,
        from its previous epoch)."""

    def load_donor_state(self, state: Mapping[str, object]) -> None:
        """Loads a donor's :meth:`state_dict` into a worker that joins an elastic job, without
        what the donor owes the others."""

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """The state as one tensor per parameter (a sharded checkpoint cuts it by shard); None
        where it cannot be put so."""

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Puts back :meth:`per_parameter_state`."""


class RuleState(abc.ABC):
    """An outer rule's state, as the outer steps, a checkpoint and an elastic job see it.

    ``state_key`` names its checkpoint entry; ``eager``: it starts at construction (once every
    rank holds the same parameters) as well as at the first forward; ``needs_inner_lr``: it reads
    the inner optimizer's learning rates. :meth:`load_state_dict` writes nothing unless
    :meth:`check_state_dict` with the same arguments passes.
    """

    state_key: str
    eager: bool = False
    needs_inner_lr: bool = False

    @property
    @abc.abstractmethod
    def started(self) -> bool:
        """Whether its state exists."""

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers a user may schedule (an outer learning rate); none by default."""
        return []

    @abc.abstractmethod
    def describe(self) -> object:
        """Its hyperparameters as plain values, which every rank must agree on."""

    @abc.abstractmethod
    def start(self, buckets: ParameterBuckets, means: Sequence[torch.Tensor] | None = None) -> None:
        """Its state starts at the parameters of ``buckets`` (or at ``means``, the workers' mean
        parameters per bucket), equal on every rank when it is called."""

    def align_in_flight(self, step: int) -> None:  # noqa: B027 - a default: nothing in flight
        """An elastic epoch begins at optimizer step ``step``: only a rule with work in flight
        between steps (Streaming DiLoCo's) has anything to align."""

    @abc.abstractmethod
    def state_dict(self) -> Mapping[str, object] | None:
        """A snapshot of its state (None: nothing to save yet)."""

    def check_state_dict(  # noqa: B027 - a default, for a rule that keeps nothing
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse
        ``state``; a rule that keeps nothing accepts anything."""

    @abc.abstractmethod
    def load_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """Puts back a :meth:`state_dict` (None: saved before it started, so it starts again at
        the next forward; ``members_changed``: this worker's own, from its previous epoch)."""

    def for_joiner(self, state: object) -> object:
        """A donor's :meth:`state_dict` as a worker joining an elastic job takes it: without
        what the donor still owes the others (default: all of it)."""
        return state

    def per_parameter_state(self) -> dict[str, list[torch.Tensor]] | None:
        """Its state as tensors shaped like each parameter (a sharded replica's: like each local
        shard), which a checkpoint may cut anew under another mesh; None where it cannot be."""
        return None

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Puts back :meth:`per_parameter_state`; only a rule that gives one is asked."""
        raise TypeError(f"{type(self).__name__} keeps no per-parameter state to load")


class OuterRule(RuleState):
    """What a whole-model outer step makes of the workers' mean: :meth:`step`, after every
    collective of the step succeeded, so that a failure leaves this state as it was.

    ``theta_global`` is the rule's global parameters, one flat tensor per bucket, from which a
    worker's pseudo-gradient is taken (an averaging of pseudo-gradients reads it); None for a rule
    without them.
    """

    @property
    def theta_global(self) -> list[torch.Tensor] | None:
        return None

    @abc.abstractmethod
    def step(
        self, mean: Mean, buckets: ParameterBuckets, optimizer: torch.optim.Optimizer | None
    ) -> list[torch.Tensor]:
        """The new parameters, per bucket, that this rule makes of ``mean`` (its state moves on;
        the caller writes them). ``optimizer``: the inner one, for a rule that reads its rates."""
