"""Streaming DiLoCo (Douillard et al., 2025): DiLoCo's outer step in fragments, each overlapped with
training.

The parameters are split, in module order, into ``k`` contiguous fragments of about equal bytes
(whole parameters). Within each period of ``H`` inner steps, fragment ``j`` is synchronised at
step ``s_j = floor(H (j + 1) / k)``, as torchft schedules its fragments:

- at step ``s_j - tau`` (``fragment_delay``) its pseudo-gradient ``theta_global_j - theta_j`` is
  taken and the averaging started, as asynchronous collectives that the process group's own thread
  runs while training goes on;
- at step ``s_j`` the mean arrives, the fragment's own outer optimizer steps its ``theta_global``
  with it, and the fragment's parameters become ``alpha * local + (1 - alpha) * theta_global``
  (``fragment_alpha``; 0: the ``tau`` steps taken in flight are dropped, as in the paper).

The communication of a period is the same as DiLoCo's, spread over ``k`` moments instead of one,
so a network that DiLoCo would saturate in bursts carries ``1 / k`` of a model at a time, hidden
behind ``tau`` steps of training. A fragment's mean is formed by the same interface as the whole
model's (``gossip_ext.averagings``): started at the prepare, finished and committed at the apply.
The exact all-reduce, a compressed or sparse exact mean (whose all-to-all or all-gather travels
during the ``tau`` steps), or one gossip exchange with the peers of a round of the graph
(``averagings.gossip_exchange.GossipMean``, each worker then stepping its own ``theta_global``).

The apply is the commit point (Note [The parameters are the model] in the engine): a collective
that failed raises there, before the fragment's parameters, ``theta_global`` or its optimizer
state change. A checkpoint taken while a fragment is in flight holds the pseudo-gradient it sent;
a run resumed from it sends it again before its next step, so that the apply sees the same mean.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gossip_ext.averagings import Averaging, Contribution
from gossip_ext.averagings.buckets import ParameterBuckets, check_saved
from gossip_ext.averagings.failures import DEFAULT_TIMEOUT
from gossip_ext.outer.interface import RuleState, StepContext
from gossip_ext.outer.outer_steps import LockstepOuterSteps
from gossip_ext.outer.rules import OuterOptimizer, OuterOptimizerFactory

# Builds a fragment's averaging over its buckets.
AveragingFactory = Callable[[ParameterBuckets], Averaging]


def fragment_bounds(sizes: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """[start, end) ranges of parameter indices cutting parameters of ``sizes`` bytes into
    ``fragments`` contiguous runs of about equal bytes, none empty: a fragment ends at the first
    parameter whose end reaches its share of the total."""
    if fragments > len(sizes):
        raise ValueError(
            f"fragments must be at most the number of parameters ({len(sizes)}), got {fragments}"
        )
    total = sum(sizes)
    bounds: list[tuple[int, int]] = []
    start, running = 0, 0
    for i, size in enumerate(sizes):
        running += size
        left = fragments - len(bounds) - 1  # fragments still to cut after this one
        ends_share = running * fragments >= total * (len(bounds) + 1)
        if len(bounds) < fragments - 1 and (ends_share or len(sizes) - i - 1 == left):
            bounds.append((start, i + 1))
            start = i + 1
    bounds.append((start, len(sizes)))
    return bounds


class Schedule:
    """When each fragment is prepared and applied: at steps ``s_j - tau`` and ``s_j`` of every
    period of ``sync_every`` steps (1-based within the period)."""

    def __init__(self, sync_every: int, fragments: int, delay: int):
        self.sync_every = sync_every
        self.apply_at = [sync_every * (j + 1) // fragments for j in range(fragments)]
        self.prepare_at = [s - delay for s in self.apply_at]

    def in_flight(self, step: int) -> dict[int, int]:
        """The fragments in flight once the actions of optimizer step ``step`` ran: each with the
        step of its prepare (prepared, not yet applied; none before the first step)."""
        if step < 1:
            return {}
        i = (step - 1) % self.sync_every + 1
        return {
            j: step - (i - prepare)
            for j, (prepare, apply) in enumerate(zip(self.prepare_at, self.apply_at))
            if prepare <= i < apply
        }

    def actions(self, step: int) -> list[tuple[str, int]]:
        """("prepare" or "apply", fragment) due after optimizer step ``step`` (1-based), in the
        order to run them: a fragment prepared and applied at one step (tau = 0) is prepared
        first."""
        i = (step - 1) % self.sync_every + 1
        due = [("prepare", j) for j, at in enumerate(self.prepare_at) if at == i]
        return due + [("apply", j) for j, at in enumerate(self.apply_at) if at == i]


@dataclass
class _InFlight:
    """A fragment between its prepare and its apply."""

    contribution: Contribution  # what was sent: its pseudo-gradients kept for a checkpoint
    pending: object  # the averaging's start's handle, its own business


class Fragment:
    """One fragment: its parameters, its ``theta_global`` and outer optimizer, its averaging
    (built by ``averaging``; its state, as a compressed mean's residuals, with it), and the
    synchronisation in flight."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        factory: OuterOptimizerFactory,
        device: torch.device | str | None,
        averaging: AveragingFactory,
    ):
        self.buckets = ParameterBuckets(params)
        self.rule = OuterOptimizer(params, self.buckets, factory, device)
        self.averaging = averaging(self.buckets)
        self.in_flight: _InFlight | None = None

    @torch.no_grad()
    def prepare(self, weight: float | None, round: int) -> None:
        """Takes the pseudo-gradient ``theta_global - theta`` and starts averaging it (over the
        peers of the graph's ``round``, by gossip)."""
        contribution = Contribution(self.buckets, self.rule.theta_global, weight, round)
        contribution.pseudo_gradients()  # taken now: the parameters move on while it travels
        self._send(contribution)

    @torch.no_grad()
    def send(self, pseudo_gradients: list[torch.Tensor], weight: float | None, round: int) -> None:
        """Starts averaging ``pseudo_gradients`` taken earlier (a checkpoint's in flight)."""
        self._send(Contribution.of_pseudo_gradients(pseudo_gradients, weight, round))

    def _send(self, contribution: Contribution) -> None:
        self.in_flight = _InFlight(contribution, self.averaging.start(contribution))

    @torch.no_grad()
    def apply(self, alpha: float) -> None:
        """Waits for the mean, steps ``theta_global`` with it and sets the fragment's parameters
        to ``alpha * local + (1 - alpha) * theta_global``. Raises, changing nothing, if a
        collective failed."""
        assert self.in_flight is not None, "the schedule applies only a fragment it prepared"
        mean = self.averaging.finish(self.in_flight.pending)
        # Every collective has succeeded: from here on the step is kept.
        theta = self.rule.step(mean, self.buckets)
        self.averaging.commit(mean)
        for b, (n, dtype) in enumerate(self.buckets.layout()):
            result = theta[b].to(self.buckets.device(b), copy=True)
            if alpha != 0.0:
                local = self.buckets.read(b, torch.empty(n, dtype=dtype, device=result.device))
                result.lerp_(local, alpha)
            self.buckets.write(b, result)
        self.in_flight = None

    def state_dict(self) -> dict[str, object]:
        flight = self.in_flight
        return {
            "outer": self.rule.state_dict(),
            "residuals": self.averaging.state_dict(),
            "in_flight": None
            if flight is None
            else {
                "pseudo_gradients": [d.clone() for d in flight.contribution.pseudo_gradients()],
                "weight": flight.contribution.weight,
                "round": flight.contribution.round,
            },
        }


class StreamingOuter(RuleState):
    """The outer state of Streaming DiLoCo (see the module's docstring): ``k`` fragments, each
    with its own outer optimizer built by ``factory`` over its global parameters, on ``schedule``;
    each averaged by the averaging that ``averaging`` builds over its buckets."""

    state_key = "streaming"
    eager = True

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        factory: OuterOptimizerFactory,
        device: torch.device | str | None,
        averaging: AveragingFactory,
        *,
        sync_every: int,
        fragments: int,
        delay: int,
        alpha: float,
        sizes: Sequence[int] | None = None,
    ):
        # A sharded module's shards are cut where its whole parameters are (``sizes``: their
        # bytes), so that every process of a replica streams the same parameters at once.
        if sizes is None:
            sizes = [p.numel() * p.element_size() for p in params]
        self.bounds = fragment_bounds(sizes, fragments)
        self.fragments = [
            Fragment(params[lo:hi], factory, device, averaging) for lo, hi in self.bounds
        ]
        self.schedule = Schedule(sync_every, fragments, delay)
        self.delay = delay
        self.alpha = alpha
        self._started = False
        # Fragments whose in-flight pseudo-gradient a checkpoint restored: sent again before the
        # next step's actions (resend_restored), on every rank alike. None in place of the
        # pseudo-gradients: prepared then, from the parameters (see align_in_flight).
        self._restored: dict[int, tuple[list[torch.Tensor] | None, float | None, int]] = {}

    @property
    def started(self) -> bool:
        return self._started

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [f.rule.optimizer for f in self.fragments]

    def describe(self) -> tuple[object, ...]:
        """What every rank must agree on: the fragments and their optimizers, the schedule."""
        return (
            "StreamingDiLoCo",
            self.bounds,
            self.delay,
            self.alpha,
            [f.rule.describe() for f in self.fragments],
        )

    def bytes_per_period(self, round_bytes: int) -> int | None:
        """Every fragment is averaged once a period, each by its own averaging."""
        total = 0
        for fragment in self.fragments:
            sent = fragment.averaging.bytes_per_step(round_bytes)
            if sent is None:
                return None
            total += sent
        return total

    def has_action(self, step: int) -> bool:
        return bool(self.schedule.actions(step))

    def start(self, buckets: ParameterBuckets, means: Sequence[torch.Tensor] | None = None) -> None:
        """Every fragment's ``theta_global`` becomes its parameters (equal on every rank)."""
        for fragment in self.fragments:
            fragment.rule.start(fragment.buckets)
        self._started = True

    def resend_restored(self, weight: float | None) -> None:
        """Sends again the pseudo-gradients in flight when the loaded checkpoint was taken, and
        prepares those that an elastic epoch found due (with ``weight``)."""
        for j, (pseudo_gradients, saved_weight, round) in sorted(self._restored.items()):
            if pseudo_gradients is None:
                self.fragments[j].prepare(weight, round)
            else:
                self.fragments[j].send(pseudo_gradients, saved_weight, round)
        self._restored.clear()

    def align_in_flight(self, step: int) -> None:
        """An elastic epoch begins at optimizer step ``step`` (its members' latest): the
        fragments in flight are made those the schedule has in flight there, the same on every
        member, so that every member sends the same collectives. A member that noticed the change
        before it prepared one of them (it was a step behind) prepares it with its next step's
        actions; one that holds a fragment the schedule has applied by ``step`` (the apply failed
        with the epoch, or this member was a step ahead) drops it: that fragment's outer step is
        lost for this period, as a DiLoCo outer step that fails with its epoch. A fragment in
        flight is sent again over the new members, with its pseudo-gradient as it was taken."""
        if not self._started:
            self._restored.clear()
            return
        due = self.schedule.in_flight(step)
        restored = {j: self._restored.get(j, (None, None)) for j in due}
        # Every member names the round of a gossip mean alike: the step of the prepare.
        self._restored = {j: (*restored[j][:2], prepared) for j, prepared in due.items()}

    def run(self, step: int, weight: float | None) -> None:
        """The prepares and applies due after optimizer step ``step``. Collective."""
        self.resend_restored(weight)
        for action, j in self.schedule.actions(step):
            if action == "prepare":
                self.fragments[j].prepare(weight, step)
            else:
                self.fragments[j].apply(self.alpha)

    def state_dict(self) -> dict[str, object]:
        fragments = [f.state_dict() for f in self.fragments]
        # Restored and not sent again yet: still in flight, as far as a checkpoint is concerned.
        for j, (pseudo_gradients, weight, round) in self._restored.items():
            fragments[j]["in_flight"] = {
                "pseudo_gradients": None
                if pseudo_gradients is None
                else [d.clone() for d in pseudo_gradients],
                "weight": weight,
                "round": round,
            }
        return {"bounds": self.bounds, "fragments": fragments}

    def check_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """The fragments' bounds, and every fragment's state as its rule and averaging check it:
        a fragment refused after others were written would leave the model's halves apart."""
        if state is None:
            return
        if not isinstance(state, Mapping):
            raise ValueError(
                f"load_state_dict: the checkpoint's Streaming DiLoCo state is a "
                f"{type(state).__name__}, not the mapping of its fragments"
            )
        bounds = [tuple(b) for b in state.get("bounds", ())]
        fragments = state.get("fragments")
        if (
            not isinstance(fragments, Sequence)
            or bounds != self.bounds
            or len(fragments) != len(self.fragments)
        ):
            raise ValueError(
                f"load_state_dict: the checkpoint's fragments cover parameters {bounds}, but "
                f"this model's fragments cover {self.bounds}"
            )
        for j, (fragment, saved) in enumerate(zip(self.fragments, fragments)):
            fragment.rule.check_state_dict(saved.get("outer"), fragment.buckets)
            fragment.averaging.check_state_dict(saved.get("residuals"), members_changed)
            flight = saved.get("in_flight")
            if flight is not None and flight.get("pseudo_gradients") is not None:
                check_saved(
                    f"pseudo-gradient in flight of fragment {j}",
                    flight["pseudo_gradients"],
                    fragment.buckets.layout(),
                )

    def load_state_dict(
        self, state: object, buckets: ParameterBuckets, members_changed: bool = False
    ) -> None:
        """A checkpoint without this state leaves ``theta_global`` to start again at the next
        forward. ``members_changed``: the state of this worker's previous elastic epoch (see
        ``CompressedMean.load_state_dict``)."""
        self.check_state_dict(state, buckets, members_changed)
        if not isinstance(state, Mapping):  # None: checked above
            self._started = False
            return
        self._restored.clear()
        for j, (fragment, saved) in enumerate(zip(self.fragments, state["fragments"])):
            fragment.rule.load_state_dict(saved["outer"], fragment.buckets)
            fragment.averaging.load_state_dict(saved["residuals"], members_changed)
            fragment.in_flight = None
            if saved["in_flight"] is not None:
                flight = saved["in_flight"]
                pseudo_gradients = flight["pseudo_gradients"]
                self._restored[j] = (
                    None
                    if pseudo_gradients is None
                    else [d.detach().clone() for d in pseudo_gradients],
                    flight["weight"],
                    flight.get("round", 0),
                )
        self._started = True

    def for_joiner(self, state: object) -> object:
        """A donor's state without its fragments' compressed means' residuals: they are what the
        donor still owes the others, not the joiner's to send again."""
        if not isinstance(state, Mapping):
            return state
        return {
            **state,
            "fragments": [{**f, "residuals": None} for f in state["fragments"]],
        }


class StreamingSteps(LockstepOuterSteps[StreamingOuter]):
    """Streaming DiLoCo's outer steps: after every optimizer step, the fragments' prepares and
    applies that ``rule``'s schedule has due, then the step's gossip round as usual."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        rule: StreamingOuter,
        sync_every: int,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ):
        super().__init__(params, buffers, group, rule=rule, sync_every=sync_every, timeout=timeout)
        self.fragments = rule  # the rule, typed as never None

    def end_step(self, step: int, make_context: Callable[[], StepContext]) -> bool:
        self.raise_if_failed()
        if self.fragments.has_action(step):
            context = make_context()
            self._guarded(lambda: self.fragments.run(step, context.weight()))
        return True

    def bytes_per_step(self, round_bytes: int) -> float | None:
        period = self.fragments.bytes_per_period(round_bytes)
        return None if period is None else period / self.sync_every
