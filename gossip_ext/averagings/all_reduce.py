"""The exact mean over every worker in full precision: one all-reduce per dtype bucket.

The mean is push-sum's consensus value ``sum_i w_i v_i / sum_i w_i``: what gossip converges to,
and the only average that keeps the push-sum mass unchanged when every weight restarts at 1.
Whenever the weights are 1 (uniform mixing on any built-in graph) it is the plain mean. The
weight rides as one more element of each bucket's message, so its sum needs no collective of its
own (and counts the contributing workers when every weight is 1); a process that contributes
nothing (weight None: a non-leader of ``nprocs_per_node > 1``) sends zeros and receives the mean
with everyone, so no broadcast inside the machine is needed.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gossip_ext.averagings.buckets import weighted_message_bytes
from gossip_ext.averagings.failures import DEFAULT_TIMEOUT, SenderCheck, wait_for_every_worker
from gossip_ext.averagings.interface import (
    Averaging,
    Contribution,
    Mean,
    ParameterMean,
    PseudoGradientMean,
)


class AllReduceMean(Averaging):
    """The exact mean of the parameters over ``group`` (a plain average, SlowMo's, and DiLoCo's
    whole-model step, whose ``theta_global - mean`` is the mean pseudo-gradient since
    ``theta_global`` is the same bits on every worker); each wait bounded by ``timeout``."""

    averages_buffers = True
    what = "the outer step's all-reduce"
    # Whether start waits for the senders' flags before it sends: one collective in flight at a
    # time, as a plain all-reduce has (the whole model's step, which waits at once anyway).
    flags_before_sending = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
        layout: Sequence[tuple[int, torch.dtype]] | None = None,
    ):
        self.group = group
        self.timeout = timeout
        self.layout = None if layout is None else list(layout)  # (elements, dtype) per bucket

    def bytes_per_step(self, round_bytes: int = 0) -> int | None:
        """What a ring all-reduce (gloo's and NCCL's algorithm for these sizes) sends from each
        worker: 2 (n - 1) / n of every bucket's message (its values and the weight's element);
        the senders' flags add a few bytes. None where the layout was not given."""
        if self.layout is None:
            return None
        n = dist.get_world_size(self.group)
        return 2 * (n - 1) * weighted_message_bytes(self.layout) // n

    def _read(self, contribution: Contribution, bucket: int, out: torch.Tensor) -> None:
        """This worker's values of ``bucket``, into ``out`` (the message: no copy of its own)."""
        contribution.parameter_buckets().read(bucket, out)

    def _layout(self, contribution: Contribution) -> list[tuple[int, torch.dtype, torch.device]]:
        buckets = contribution.parameter_buckets()
        return [(n, d, buckets.device(b)) for b, (n, d) in enumerate(buckets.layout())]

    def _mean(self, values: list[torch.Tensor]) -> Mean:
        return ParameterMean(values)

    @torch.no_grad()
    def start(self, contribution: Contribution):
        weight = contribution.weight
        layout = self._layout(contribution)
        messages = []
        for b, (numel, dtype, device) in enumerate(layout):
            message = torch.zeros(numel + 1, dtype=dtype, device=device)
            if weight is not None:
                self._read(contribution, b, message[:numel])
                message[numel] = 1.0
            messages.append(message)
        # The flags go first, and alone: one collective in flight at a time, as a plain
        # all-reduce would have, so a worker that fails fails the others' same collective.
        device = layout[0][2] if layout else torch.device("cpu")
        senders = SenderCheck(self.group, device)
        flags, flags_work = senders.post(None if weight is None else [m[:-1] for m in messages])
        works = [flags_work]
        check: SenderCheck | None = senders  # None: the flags were read before sending
        if self.flags_before_sending:
            wait_for_every_worker(works, self.what, self.group, self.timeout)
            senders.raise_if_flagged(flags, self.what)
            works, check = [], None
        for message in messages:
            if weight is not None and weight != 1.0:
                message.mul_(weight)
            works.append(dist.all_reduce(message, group=self.group, async_op=True))
        return works, messages, check, flags

    @torch.no_grad()
    def finish(self, pending) -> Mean:
        works, messages, check, flags = pending
        wait_for_every_worker(works, self.what, self.group, self.timeout)
        if check is not None:
            check.raise_if_flagged(flags, self.what)
        return self._mean([m[:-1].div_(m[-1]) for m in messages])

    def describe(self):
        return {"kind": "AllReduceMean"}


class AllReducePseudoGradientMean(AllReduceMean):
    """The exact mean of the pseudo-gradients ``theta_global - theta_i`` over ``group``: a
    Streaming DiLoCo fragment's, taken at its prepare and averaged while training goes on (its
    flags travel beside it, and a failure raises at the apply)."""

    flags_before_sending = False

    def _read(self, contribution: Contribution, bucket: int, out: torch.Tensor) -> None:
        out.copy_(contribution.pseudo_gradients()[bucket])

    def _layout(self, contribution: Contribution) -> list[tuple[int, torch.dtype, torch.device]]:
        return [(d.numel(), d.dtype, d.device) for d in contribution.pseudo_gradients()]

    def _mean(self, values: list[torch.Tensor]) -> Mean:
        return PseudoGradientMean(values)
