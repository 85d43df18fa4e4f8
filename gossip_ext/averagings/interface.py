"""The one interface of every way an outer step forms its mean over workers.

An outer step (DiLoCo's, SlowMo's, a plain average's; the whole model's or one Streaming DiLoCo
fragment's) asks its :class:`Averaging` for a mean in three calls, the same whoever averages:

1. ``pending = averaging.start(contribution)`` reads what this worker brings (a
   :class:`Contribution`: its parameters or its pseudo-gradients, its push-sum weight) and posts
   the messages; training may go on while they travel (Streaming DiLoCo's delay).
2. ``mean = averaging.finish(pending)`` waits for them, each wait bounded by the wrapper's
   timeout, and returns a :class:`Mean`, writing nothing: the parameters and the averaging's own
   state are as they were. A peer that died, stalled or sent NaN raises here, typed
   (``gossip_ext.errors``; the contract, for every averaging, in ``failures``), or already in
   ``start``, where an averaging learns its senders' flags before it sends.
3. ``averaging.commit(mean)`` keeps the averaging's own state of a step that succeeded (error
   feedback residuals, public copies), once the rule has stepped with ``mean``.

So every collective of a step runs before anything is written (Note [The parameters are the
model] in the engine). A mean says what it is a mean of, :class:`ParameterMean` or
:class:`PseudoGradientMean`, and gives either form: the rule asks for the one it steps with (the
parameters for a plain average or SlowMo, the pseudo-gradients for DiLoCo's outer optimizer)
without anyone asking the averaging what it is.

A new way to average is a subclass, built by its configuration object's ``averaging()`` (see
docs/design.md, "Extending gossip_ext"); nothing else changes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

import torch

from gossip_ext.averagings.buckets import ParameterBuckets
from gossip_ext.gossip.inner import InnerMix

# What an averaging's start hands its finish: its own business (posted works, buffers).
Pending = TypeVar("Pending")
Kept = TypeVar("Kept")


class Contribution:
    """What this worker brings to one mean, read only by the averaging that needs it.

    ``buckets``: the parameters averaged (the whole model's, or a fragment's); ``theta_global``:
    the rule's global parameters, one flat tensor per bucket (None for a rule without them);
    ``weight``: this worker's push-sum weight, None on a process that contributes nothing but
    receives the mean (a non-leader of ``nprocs_per_node > 1``); ``round``: the step's clock
    (the optimizer step that started it), the same on every worker; ``mix``: the inner gossip
    (``inner.InnerMix``), for an averaging that runs its round.
    """

    def __init__(
        self,
        buckets: ParameterBuckets | None,
        theta_global: Sequence[torch.Tensor] | None,
        weight: float | None,
        round: int = 0,  # noqa: A002 - the step's round, as elsewhere in the package
        mix: InnerMix | None = None,
        *,
        pseudo_gradients: Sequence[torch.Tensor] | None = None,
    ):
        self.buckets = buckets
        self.theta_global = theta_global
        self.weight = weight
        self.round = round
        self.mix = mix
        self._pseudo_gradients = None if pseudo_gradients is None else list(pseudo_gradients)

    @classmethod
    def of_pseudo_gradients(
        cls, pseudo_gradients: Sequence[torch.Tensor], weight: float | None, round: int = 0
    ) -> Contribution:
        """A contribution whose pseudo-gradients are given (one flat tensor per bucket): one
        taken earlier (a fragment in flight, a checkpoint's), or a test's."""
        return cls(None, None, weight, round, pseudo_gradients=pseudo_gradients)

    def parameter_buckets(self) -> ParameterBuckets:
        """The parameters averaged, for an averaging that reads or writes them in place."""
        if self.buckets is None:
            raise ValueError(
                "this contribution was given as pseudo-gradients "
                "(Contribution.of_pseudo_gradients): it holds no parameters"
            )
        return self.buckets

    def gossip_mix(self) -> InnerMix:
        """The inner gossip, for an averaging that runs its round."""
        if self.mix is None:
            raise ValueError(
                "this contribution carries no inner gossip (mix): an averaging by a gossip "
                "round needs the wrapper's"
            )
        return self.mix

    @torch.no_grad()
    def parameters(self) -> list[torch.Tensor]:
        """A copy of the parameters, one flat tensor per bucket in its accumulation dtype."""
        buckets = self.parameter_buckets()
        return [
            buckets.read(b, torch.empty(n, dtype=dtype, device=buckets.device(b)))
            for b, (n, dtype) in enumerate(buckets.layout())
        ]

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """``theta_global - theta``, one flat tensor per bucket (taken once, then kept: a
        fragment in flight saves what it sent)."""
        if self._pseudo_gradients is None:
            if self.theta_global is None:
                raise ValueError(
                    "this averaging averages pseudo-gradients (theta_global - theta), which only "
                    "an outer rule with global parameters (DiLoCo's) has"
                )
            self._pseudo_gradients = [
                local.neg_().add_(self.theta_global[b].to(local.device))
                for b, local in enumerate(self.parameters())
            ]
        return self._pseudo_gradients


@dataclasses.dataclass
class Mean(abc.ABC):
    """A mean over workers, per bucket, before anything is written; ``kept``: what the averaging
    keeps at its commit (its own business)."""

    values: list[torch.Tensor]
    kept: object = None

    def kept_as(self, kind: type[Kept]) -> Kept:
        """``kept``, which the averaging that made this mean knows to be a ``kind``."""
        if not isinstance(self.kept, kind):
            raise TypeError(
                f"gossip_ext: a mean's kept state is a {type(self.kept).__name__}, where its "
                f"averaging's commit expects a {kind.__name__}: it was made by another averaging"
            )
        return self.kept

    @abc.abstractmethod
    def parameters(self, theta_global: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """The mean of the workers' parameters, per bucket (``theta_global``: the rule's global
        parameters, from which a mean of pseudo-gradients is taken; None where it has none)."""

    @abc.abstractmethod
    def pseudo_gradients(self, theta_global: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The mean of the workers' pseudo-gradients ``theta_global - theta_i``, per bucket, on
        ``theta_global``'s device."""


class ParameterMean(Mean):
    """The mean of the workers' parameters (or a worker's parameters mixed with its peers')."""

    def parameters(self, theta_global: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        return self.values

    def pseudo_gradients(self, theta_global: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``theta_global - mean``, computed in the mean's own tensors (which it overwrites)."""
        return [
            mean.to(theta.device).neg_().add_(theta)
            for mean, theta in zip(self.values, theta_global)
        ]


class PseudoGradientMean(Mean):
    """The mean of the workers' pseudo-gradients ``theta_global - theta_i``."""

    def parameters(self, theta_global: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
        """``theta_global`` minus the mean: the mean of the workers' parameters."""
        if theta_global is None:
            raise ValueError(
                "a mean of pseudo-gradients (theta_global - theta) makes parameters only with the "
                "global parameters of the rule that took them, and this rule has none"
            )
        return [theta - mean.to(theta.device) for theta, mean in zip(theta_global, self.values)]

    def pseudo_gradients(self, theta_global: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [mean.to(theta.device) for mean, theta in zip(self.values, theta_global)]


class Averaging(abc.ABC, Generic[Pending]):
    """How an outer step forms its mean over workers: the runtime part that an averaging's
    configuration object builds (see the module). Subclasses implement :meth:`start` and
    :meth:`finish`; those with state of their own also :meth:`commit`, :attr:`state_key`,
    :meth:`state_dict`, :meth:`check_state_dict` and :meth:`load_state_dict`."""

    # The checkpoint key of this averaging's own state; None: it keeps none.
    state_key: str | None = None
    # Whether the floating-point buffers (BatchNorm's statistics) are averaged with it: a mean over
    # every worker makes them one, as it makes the parameters one.
    averages_buffers: bool = False

    @abc.abstractmethod
    def start(self, contribution: Contribution) -> Pending:
        """Reads ``contribution`` and posts this worker's messages; returns what :meth:`finish`
        needs. Writes nothing this worker's model reads."""

    @abc.abstractmethod
    def finish(self, pending: Pending) -> Mean:
        """Waits for the messages (each wait bounded by the timeout) and returns the mean; writes
        nothing. Raises ``PeerTimeoutError`` for a dead or stalled peer and ``NonFiniteError``
        for a message holding NaN or Inf, naming the peers where they can be known."""

    def commit(self, mean: Mean) -> None:  # noqa: B027 - a hook: most averagings keep nothing
        """Keeps this averaging's state of a step whose every message arrived (default: none)."""

    def begin(self, buckets: ParameterBuckets) -> None:  # noqa: B027 - a hook, as commit
        """The outer rule started at the parameters of ``buckets`` (equal on every worker)."""

    def before_whole_step(self, mix: InnerMix) -> None:
        """Before a whole-model step, which takes the place of the step's gossip round: the round
        in flight is absorbed, and push-sum restarts from weight 1 (default)."""
        mix.restart()

    def after_whole_step(self, mix: InnerMix) -> None:
        """After a whole-model step: every worker holds the mean, so push-sum's weight is 1
        (default; an averaging that leaves workers apart keeps it)."""
        mix.reset_weight()

    def bytes_per_step(self, round_bytes: int = 0) -> int | None:
        """Bytes this worker sends per outer step, where known (None: not known).
        ``round_bytes``: what one round of the inner engine sends, for an averaging that runs
        one."""
        return None

    def state_dict(self) -> Mapping[str, object] | None:
        return None

    def check_state_dict(  # noqa: B027 - a hook, as commit
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse
        ``state``: its caller checks every part of a checkpoint before it writes any."""

    def load_state_dict(  # noqa: B027 - a hook, as commit
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        """Puts back :meth:`state_dict` (None: a checkpoint without it), checked first by
        :meth:`check_state_dict`. ``members_changed``: the state of this worker's previous
        elastic epoch."""

    def describe(self) -> Mapping[str, object]:
        """What every rank must agree on, as plain values."""
        return {"kind": type(self).__name__}
