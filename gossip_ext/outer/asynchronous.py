"""Asynchronous outer steps: every worker takes its outer step at its own pace, on the
pseudo-gradients that have reached it, and no step waits for every worker (docs/algorithms.md,
"Asynchronous outer steps").

Worker i holds its parameters, its own copy of ``theta_global`` and the outer rule's state
(``delayed_nesterov.NesterovOuter``). After its ``H_i``-th inner step since its last outer step:

1. *Send.* Its pseudo-gradient ``g = theta_global - theta_i``, with the inner steps behind it,
   is owed to every other worker, and sent to each whose link is free (Note [Owed
   pseudo-gradients]).
2. *Grace.* It waits, at most ``grace`` seconds, until every other live worker's pseudo-gradient
   has arrived since its last merge; never longer, and not at all with ``grace=0``.
3. *Merge* whatever has arrived, its own included: ``G = sum_j g_j / K`` over K workers (a
   pseudo-gradient is the sum of its inner steps' updates, so each enters in proportion to the
   samples behind it; K pseudo-gradients of ``every`` steps make synchronous DiLoCo's mean).
   The outer rule steps ``theta_global`` with ``G``; the parameters become ``theta_global``.

A pseudo-gradient that arrives late is merged late, never dropped: each is applied exactly once by
every worker, in whatever grouping it arrived, and the rule is linear in them, so the copies of
``theta_global`` agree once the momentum has forgotten the timing (at once without momentum).
``H_i`` is ``every``, or, ``paced``, as many steps as the slowest worker's ``every`` take (each
message carries its sender's seconds per inner step), so that a faster worker takes more.

Note [Owed pseudo-gradients]: a worker applies its own pseudo-gradient exactly, and owes every
other worker the same. What it owes a peer is one sum; each message sends the whole sum and keeps
what the message failed to carry (a lossy message's rounding). A peer that has not yet taken the
last message (a slow link, a stopped process) is sent nothing this time: its sum grows, and one
message carries it later. So a slow link carries at most its own rate's worth, never a queue
that ages, and each pseudo-gradient still reaches every worker once (the rule is linear: a sum
merged is its terms merged). The price is memory: up to a model copy per peer.

A peer whose connection closes, or that is silent for longer than the timeout, raises a
:class:`~gossip_ext.errors.PeerTimeoutError` naming it; a peer that finished its training says so
and is let go. A NaN or Inf in this worker's parameters raises a
:class:`~gossip_ext.errors.NonFiniteError` before anything is sent, and one in a peer's message
before it is merged, naming the peer; the parameters keep the model they held.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.errors import NonFiniteError, PeerTimeoutError
from gossip_ext.gossip import mailbox, messages, transport
from gossip_ext.outer.delayed_nesterov import NesterovOuter
from gossip_ext.outer.interface import StepContext

_EVERYONE = mailbox.Everyone()
# Messages to one peer posted and not yet taken by it beyond which what it is owed waits and
# grows (Note [Owed pseudo-gradients]).
MAX_BACKLOG = 1
# A learned grace waits for a peer whose message is due within this share of the worker's own
# period, and no longer: a peer much slower than this worker is never waited for.
LEARNED_GRACE_SHARE = 0.5


class AsyncOuterSteps:
    """One worker's asynchronous outer steps over ``params`` and the floating-point ``buffers``
    (on one device, CPU or CUDA, worked on in place) with the ranks of ``group`` (gloo, Note
    [Asynchronous gossip on GPUs] in ``gossip.messages``), as the wrapper drives
    an ``outer_steps.OuterSteps``: :meth:`end_step` after every optimizer step.

    ``every``: H, the inner steps between outer steps (of the slowest worker, ``paced``);
    ``lr``, ``momentum``, ``delayed``: the outer rule; ``grace``: the seconds a merge waits for
    the others' pseudo-gradients, or ``"learned"`` (each peer until its message is due);
    ``record``: keep every send and merge in :attr:`history` (the tests replay it through a
    reference)."""

    needs_inner_lr = False
    sync_every = 0

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        group: dist.ProcessGroup,
        *,
        every: int,
        lr: float,
        momentum: float,
        delayed: bool,
        grace: float | str,
        paced: bool,
        message_dtype=None,
        check_finite: bool = True,
        timeout: timedelta = timedelta(minutes=5),
        store: dist.Store | None = None,
        record: bool = False,
    ):
        self._params, self._buffers = list(params), list(buffers)
        self._device = transport.host_messages_device(
            self._params + self._buffers, "AsyncDiLoCo", group
        )
        self._group, self.rank, self.world_size = group, group.rank(), group.size()
        self.every, self.grace, self.paced = every, grace, paced
        self.check_finite, self.timeout = check_finite, timeout
        wide = any(t.dtype == torch.float64 for t in self._params + self._buffers)
        self._dtype = torch.float64 if wide else torch.float32
        self._sizes = [t.numel() for t in self._params]
        self._buffer_sizes = [t.numel() for t in self._buffers]
        self._numel = sum(self._sizes)
        self._codec = messages.codec(
            self._numel + sum(self._buffer_sizes), self._dtype, message_dtype, self._device
        )
        self.outer = NesterovOuter(
            self._numel,
            self._dtype,
            lr=lr,
            momentum=momentum,
            delayed=delayed,
            round_samples=every * self.world_size,
            device=self._device,
        )
        # What each peer is owed and not yet sent: pseudo-gradients this worker applied
        # itself, and the rounding of lossy messages (Note [Owed pseudo-gradients]).
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        self._owed = {
            peer: torch.zeros(self._numel, dtype=self._dtype, device=self._device) for peer in peers
        }
        self._owed_steps = dict.fromkeys(peers, 0)
        self.started = False
        self._start_at_forward = True
        self._period = 0  # pseudo-gradients sent
        self._steps_in_period = 0
        self._period_steps = every
        self._period_began = time.monotonic()
        self._step_seconds = {self.rank: 0.0}  # each worker's seconds per inner step
        self._merged = dict.fromkeys(range(self.world_size), 0)  # messages merged, per peer
        self._failure: BaseException | None = None
        self.history: list[tuple] | None = [] if record else None
        # The generation tells these steps' messages from another asynchronous engine's on the
        # same ranks.
        instance = transport.next_instance(group, "async-tags")
        self._channels = mailbox.Channels(
            group,
            transport.gossip_store(group, None, "async-outer") if store is None else store,
            instance * 8,
            timeout,
            transport.engine_group_name(group, "async-outer", instance),
        )
        peers = _EVERYONE.phone_book(self.rank, self.world_size)
        self._outboxes = {peer: self._channels.outbox(peer) for peer in peers}
        self._mailboxes = {
            peer: self._channels.mailbox(_EVERYONE, peer, self._codec.nbytes) for peer in peers
        }
        # The finalizer holds the channels, not these steps, so dropped steps are collected and
        # the finalizer (or the interpreter's exit) lets the threads go, as AsyncPushSum's.
        self._finalizer = weakref.finalize(self, self._channels.leave, "it was dropped")

    # ------------------------------------------------------------------------- starting

    def start_eagerly(self) -> None:
        """At construction, once every rank holds the same parameters."""
        self.start()
        self._start_at_forward = True

    def before_forward(self) -> None:
        if self._start_at_forward:
            self.start()

    def describe_rule(self) -> object:
        """The outer rule's hyperparameters, which every rank must agree on."""
        return self.outer.describe()

    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """None: the outer rule is delayed Nesterov on a flat ``theta_global``, no torch
        optimizer (``delayed_nesterov``)."""
        return []

    def start(self) -> None:
        """``theta_global`` starts at the current parameters, the momentum at rest."""
        self.outer.start(messages.flatten(self._params, self._dtype))
        for owed in self._owed.values():
            owed.zero_()
        self._period_began = time.monotonic()
        self._steps_in_period = 0
        self.started = True
        self._start_at_forward = False

    # ------------------------------------------------------------------------- steps

    def end_step(self, step: int, make_context: Callable[[], StepContext]) -> bool:
        """After the ``step``-th optimizer step: the outer step, once this worker's period is
        done. Never waits for a peer beyond ``grace``. Returns whether the step's gossip round
        runs (there is none beside an asynchronous outer step)."""
        self.raise_if_failed()
        self._guarded(self._channels.check_silence)
        self._steps_in_period += 1
        if self._steps_in_period < self._period_steps:
            return True
        self._guarded(self._outer_step)
        return False

    def average_now(self, step: int, context: StepContext) -> None:
        """Every worker together: an outer step on every pseudo-gradient sent so far, then the
        workers' ``theta_global`` averaged exactly (one model, for evaluation or a checkpoint)."""

        def everything():
            self._outer_step(settle=True)
            theta = self.outer.theta.clone()
            dist.all_reduce(theta, group=self._group)
            theta /= self.world_size
            self.outer.theta.copy_(theta)
            messages.write_flat(self._params, theta)

        self._guarded(everything)

    def _outer_step(self, settle: bool = False) -> None:
        self.raise_if_failed()
        arrived = [self._send()]
        if settle:
            self._settle()
        else:
            self._wait_grace()
        for peer, box in self._mailboxes.items():
            taken = box.take(None)
            self._merged[peer] += len(taken)
            for period, buffer in taken:
                steps = int(messages.weight_of(buffer))
                self._step_seconds[peer] = messages.aux_of(buffer)
                arrived.append((peer, period, self._codec.read(buffer)[0], steps))
        arrived.sort(key=lambda item: (item[0], item[1]))
        self._merge(arrived)
        self._next_period()

    def _send(self) -> tuple[int, int, torch.Tensor, int]:
        """Adds this worker's pseudo-gradient to what it owes each live peer and posts what a
        peer is owed where its link is free; returns its own contribution, as an arrival."""
        flat = messages.flatten(self._params, self._dtype)
        if self.check_finite and not bool(torch.isfinite(flat).all()):
            self._raise_nonfinite([])
        pseudo = self.outer.theta - flat
        buffers = messages.flatten(self._buffers, self._dtype) if self._buffers else None
        steps, period = self._steps_in_period, self._period
        seconds = (time.monotonic() - self._period_began) / max(1, steps)
        self._step_seconds[self.rank] = seconds
        for peer, box in self._outboxes.items():
            if box.ended:  # a peer that left is owed nothing more
                continue
            self._owed[peer].add_(pseudo)
            self._owed_steps[peer] += steps
            if box.backlog < MAX_BACKLOG:
                self._post(peer, buffers, seconds)
        if self.history is not None:
            self.history.append(("send", period, pseudo.clone(), steps))
        self._period += 1
        own = pseudo if buffers is None else torch.cat([pseudo, buffers])
        return (self.rank, period, own, steps)

    def _post(self, peer: int, buffers: torch.Tensor | None, seconds: float) -> None:
        """Sends ``peer`` all it is owed, as one message (Note [Owed pseudo-gradients])."""
        owed = self._owed[peer]
        values = owed if buffers is None else torch.cat([owed, buffers])
        message = self._codec.encode([values], self._owed_steps[peer], self._period, seconds)
        if self._outboxes[peer].post(self._period, message):
            # What was sent is paid; a lossy message's rounding stays owed.
            owed.sub_(self._codec.read(message)[0][: self._numel])
            self._owed_steps[peer] = 0

    def _wait_grace(self) -> None:
        """Waits for the peers' pseudo-gradients since the last merge: up to ``grace`` seconds,
        or, ``"learned"``, for each peer until its next message is due (``mailbox.next_due``) where
        that is soon enough (LEARNED_GRACE_SHARE of this worker's period)."""
        if isinstance(self.grace, str):  # "learned"
            now = time.monotonic()
            soon = now + LEARNED_GRACE_SHARE * (now - self._period_began)
            for peer, box in self._mailboxes.items():
                due = mailbox.next_due(box.arrival_times())
                if due is not None and due <= soon:
                    box.wait_for_before(self._merged[peer] + 1, due - time.monotonic())
            return
        if self.grace <= 0:
            return
        deadline = time.monotonic() + self.grace
        for peer, box in self._mailboxes.items():
            box.wait_for_before(self._merged[peer] + 1, deadline - time.monotonic())

    def _settle(self) -> None:
        """Every worker together: sends every peer all it is owed, then waits until every
        message sent so far has arrived."""
        buffers = messages.flatten(self._buffers, self._dtype) if self._buffers else None
        for peer, box in self._outboxes.items():
            if not box.ended and (self._owed_steps[peer] or bool(self._owed[peer].any())):
                self._post(peer, buffers, self._step_seconds[self.rank])
        sent = torch.zeros(self.world_size, dtype=torch.int64)
        for peer, outbox in self._outboxes.items():
            sent[peer] = outbox.sent
        counts = [torch.zeros_like(sent) for _ in range(self.world_size)]
        dist.all_gather(counts, sent, group=self._group)
        for peer, inbox in self._mailboxes.items():
            inbox.wait_for(int(counts[peer][self.rank]))
        for outbox in self._outboxes.values():
            outbox.wait_until_past(None)

    def _merge(self, arrived: list[tuple[int, int, torch.Tensor, int]]) -> None:
        """The outer rule on the mean of the pseudo-gradients ``arrived`` (rank, period, values,
        inner steps), in (rank, period) order on every worker; the buffers become the mean of
        the latest ones, weighted by the steps behind them. Writes only once all were read."""
        if self.check_finite:
            bad = [
                peer
                for peer, _, values, _ in arrived
                if peer != self.rank and not bool(torch.isfinite(values).all())
            ]
            if bad:
                self._raise_nonfinite(bad)
        merged = torch.zeros(self._numel, dtype=self._dtype, device=self._device)
        for _, _, values, _ in arrived:
            merged.add_(values[: self._numel])
        merged /= self.world_size
        samples = sum(steps for _, _, _, steps in arrived)
        self.outer.step(merged, samples)
        messages.write_flat(self._params, self.outer.theta)
        if self._buffers:
            latest = {peer: (values, steps) for peer, _, values, steps in arrived}
            total = sum(steps for _, steps in latest.values()) or 1
            mean = torch.zeros(sum(self._buffer_sizes), dtype=self._dtype, device=self._device)
            for values, steps in latest.values():
                mean += values[self._numel :] * (max(steps, 0) / total)
            messages.write_flat(self._buffers, mean)
        if self.history is not None:
            self.history.append(
                (
                    "merge",
                    tuple((peer, period) for peer, period, _, _ in arrived),
                    samples,
                    [values[: self._numel].clone() for _, _, values, _ in arrived],
                )
            )

    def _next_period(self) -> None:
        """The next period's inner steps: ``every``, or, paced, as many as the slowest
        worker's ``every`` steps take at this worker's pace."""
        if self.paced and self._step_seconds[self.rank] > 0:
            slowest = max(self._step_seconds.values())
            self._period_steps = max(1, round(self.every * slowest / self._step_seconds[self.rank]))
        self._steps_in_period = 0
        self._period_began = time.monotonic()

    def _raise_nonfinite(self, senders: list[int]) -> None:
        whose = f"from peers {senders}" if senders else f"in rank {self.rank}'s own parameters"
        raise NonFiniteError(
            f"gossip_ext: rank {self.rank} found NaN or Inf in its asynchronous outer step "
            f"{self._period}, {whose}; the outer step would spread them, so none goes on, and "
            "the parameters keep the model they hold",
            peers=senders,
            round=self._period,
            transport="process_group(gloo)",
        )

    # ------------------------------------------------------------------------- failures

    def _guarded(self, body: Callable[[], None]) -> None:
        """``body()``; an error it raises stays raised by every later call (Note [A failed outer
        step] in ``outer_steps``)."""
        self.raise_if_failed()
        try:
            body()
        except (PeerTimeoutError, NonFiniteError) as error:
            self._failure = error
            raise

    def raise_if_failed(self) -> None:
        """Raises the error of an outer step that failed, if one did."""
        if self._failure is not None:
            raise self._failure.with_traceback(None)

    def close(self) -> None:
        """Leaves: says so to the peers, who then neither wait for this worker nor take its
        silence for a failure, and ends the message threads."""
        self._finalizer.detach()
        self._channels.leave("it was closed", self._period)

    def bytes_per_step(self, round_bytes: int) -> float:
        """At most what this worker sends per inner step: its pseudo-gradient to every other
        worker once a period of ``every`` steps (a peer still busy with the last one is sent
        nothing, and the next message carries both: Note [Owed pseudo-gradients])."""
        return (self.world_size - 1) * self._codec.nbytes / self.every

    def align_in_flight(self, step: int) -> None:
        """Nothing to align: each worker's period is its own, counted from its own steps, and
        nothing is in flight at a step count (an elastic job refuses these steps)."""

    # ------------------------------------------------------------------------- checkpoint

    @property
    def period(self) -> int:
        """Pseudo-gradients this worker has sent."""
        return self._period

    @property
    def period_steps(self) -> int:
        """The inner steps of this worker's current period (H_i)."""
        return self._period_steps

    def state_dict(self) -> dict[str, Any]:
        """The rule's state. Messages in flight, and what is owed to peers, are in no
        checkpoint (each worker's own copy of ``theta_global`` holds what it merged)."""
        state = self.outer.state_dict()
        state.update(period_steps=self._period_steps)
        return {self.outer.state_key: state}

    def state_keys(self) -> list[str]:
        """The checkpoint entries :meth:`state_dict` writes."""
        return [self.outer.state_key]

    def check_state_dict(self, state: Mapping[str, Any], members_changed: bool = False) -> None:
        """Raises ValueError, writing nothing, where :meth:`load_state_dict` would refuse it."""
        saved = state.get(self.outer.state_key)
        if saved is None:
            return
        self.outer.check_state_dict(saved)
        if not isinstance(saved.get("period_steps"), int):
            raise ValueError(
                "load_state_dict: the asynchronous outer step's checkpoint holds no period_steps "
                f"(the inner steps of its period), got {saved.get('period_steps')!r}"
            )

    def load_state_dict(self, state: Mapping[str, Any], members_changed: bool = False) -> None:
        self.check_state_dict(state, members_changed)
        saved = state.get(self.outer.state_key)
        if saved is None:
            self._start_at_forward = True
            return
        self.outer.load_state_dict(saved)
        self._period_steps = int(saved["period_steps"])
        self._steps_in_period = 0
        self.started, self._start_at_forward = True, False

    def load_donor_state(self, state: Mapping[str, object]) -> None:
        """Loads a donor's :meth:`state_dict` into a worker that joins an elastic job: it holds
        nothing owed to peers, so all of it."""
        self.load_state_dict(state)

    def per_parameter_state(self) -> None:
        """None: one flat state for the whole model, which no shard's cut can hold."""
        return None

    def load_per_parameter_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        raise ValueError(
            f"AsyncDiLoCo keeps one flat outer state for the whole model, not one per parameter "
            f"(got a per-parameter state of {sorted(state)})"
        )
