"""The exact mean of the workers' pseudo-gradients in sparse messages: top-k of every chunk, its
values in 2 or 4 bits, with error feedback (SparseLoCo's message;
``ByCollective(dtype=TopK(...))``).

Every rank adds its residual ``e`` (times ``feedback_decay``, SparseLoCo's ``beta``: 1 keeps every
value left out until it is sent; below 1, old residuals fade, and the residual acts as a local
momentum of the pseudo-gradients) to its pseudo-gradient ``v``, cuts the sum into chunks of
``chunk`` values and keeps the ``k = round(density * chunk)`` of largest magnitude in each (the
lower position first among equal magnitudes): their positions in the chunk (int16, ascending)
and their values quantized to ``bits`` bits against the chunk's largest kept magnitude (one
float32 scale a chunk), ``2^bits`` levels evenly from ``-scale`` to ``scale``. What the message
does not carry, the values left out and the rounding of those kept, stays in ``e`` for the next
outer step, so at ``feedback_decay=1`` nothing is lost: over many outer steps the sum of the
means applied is the sum of the true means, less what the residuals hold at the end. Compiled
kernels encode and decode the messages, on the CPU or the GPU where the buckets are (the byte
layout: Note [Sparse top-k messages] in csrc/kernels/sparse_topk.h).

Sparse messages cannot be summed on their way (their positions differ), so every rank gathers
every rank's message (an all-gather) and decodes them all, in rank order: every rank then holds
the same mean, bit for bit, and so the same ``theta_global``. Bytes each rank sends per outer
step: ``(n - 1)`` messages of ``chunks * (4 + 2 k + k bits / 8)`` bytes, where an all-reduce of
float32 sends ``2 (n - 1) / n * 4`` bytes a value: at density 1/64 with 2-bit values (4096-value
chunks) a message is 0.0090 of float32 (111x smaller; 0.0100 with 4-bit values), and the
all-gather's ``(n - 1)`` copies leave the step at 0.0090 n / 2 of the all-reduce's (55x less
traffic at 4 workers, 28x at 8).

Like :class:`gossip_ext.averagings.compressed.CompressedMean`, :meth:`SparseMean.mean` keeps
nothing: :meth:`SparseMean.commit` keeps the residuals once the outer step succeeded.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C  # noqa: F401  (registers torch.ops.gossip_ext)
from gossip_ext.averagings.buckets import check_saved, layout_of
from gossip_ext.averagings.compressed import _all_gather
from gossip_ext.averagings.failures import DEFAULT_TIMEOUT, SenderCheck, wait_for_every_worker
from gossip_ext.averagings.interface import Averaging, Contribution, Mean, PseudoGradientMean


@dataclasses.dataclass(frozen=True)
class TopK:
    """A sparse message format for an outer step's exact average: the ``density`` largest
    magnitudes of every ``chunk`` values (at least one), their values in ``bits`` bits (2 or 4)
    with one float32 scale a chunk, the rest kept by error feedback, whose residual is scaled by
    ``feedback_decay`` at each outer step (SparseLoCo; see :mod:`gossip_ext.averagings.sparse`).
    ``ByCollective(dtype=TopK(density=1/64, bits=2))``."""

    density: float = 1 / 64
    bits: int = 2
    chunk: int = 4096
    feedback_decay: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)):
            raise TypeError(f"TopK(density=...): must be a float, got {self.density!r}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"TopK(density=...): must be in (0, 1], got {self.density}")
        if self.bits not in (2, 4) or isinstance(self.bits, bool):
            raise ValueError(f"TopK(bits=...): must be 2 or 4, got {self.bits!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int):
            raise TypeError(f"TopK(chunk=...): must be an int, got {self.chunk!r}")
        if not 1 <= self.chunk <= 32768:
            # Positions in a chunk travel as int16.
            raise ValueError(f"TopK(chunk=...): must be in [1, 32768], got {self.chunk}")
        decay = self.feedback_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError(f"TopK(feedback_decay=...): must be a float, got {decay!r}")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"TopK(feedback_decay=...): must be in [0, 1], got {decay}")

    @property
    def k(self) -> int:
        """Values kept per chunk."""
        return max(1, round(self.density * self.chunk))

    def message_bytes(self, numel: int) -> int:
        """Bytes of one rank's message for a bucket of ``numel`` values."""
        chunks = math.ceil(numel / self.chunk)
        return chunks * (4 + 2 * self.k) + math.ceil(chunks * self.k * self.bits / 8)

    def bytes_per_step(self, numels: Sequence[int], world_size: int) -> int:
        """Bytes each rank sends per outer step: its message to every other rank."""
        return (world_size - 1) * sum(self.message_bytes(n) for n in numels)

    def describe(self) -> dict[str, Any]:
        """Plain values, for the cross-rank configuration check and ``json.dumps``."""
        return {"kind": "TopK", **dataclasses.asdict(self)}

    def mean_over(self, layout, device, group, timeout=DEFAULT_TIMEOUT) -> SparseMean:
        """The exact mean that sends this format (``outer.OuterSteps`` asks for it)."""
        return SparseMean(layout, device, self, group, timeout)


class _Codec:
    """Encoding and decoding one bucket's message in a :class:`TopK` format, by the compiled
    kernels of the values' device (``torch.ops.gossip_ext.topk_encode`` and ``topk_add_into``;
    the byte layout is Note [Sparse top-k messages] in csrc/kernels/sparse_topk.h)."""

    def __init__(self, format: TopK, numel: int):
        self.format, self.numel = format, numel
        self.chunks = math.ceil(numel / format.chunk)
        self.bytes = format.message_bytes(numel)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The message of ``values`` (one bucket)."""
        f = self.format
        return torch.ops.gossip_ext.topk_encode(values, f.k, f.bits, f.chunk)

    def holds_nonfinite(self, message: torch.Tensor) -> bool:
        """Whether ``message`` carries NaN or Inf: its chunks' float32 scales, which lead the
        message, are the largest kept magnitudes, and NaN and Inf rank above every finite one."""
        scales = message[: 4 * self.chunks].clone().view(torch.float32)  # aligned to 4 bytes
        return not bool(torch.isfinite(scales).all())

    def add_into(self, total: torch.Tensor, message: torch.Tensor) -> None:
        """``total`` (the bucket, padded to whole chunks, as chunks) += the message's values."""
        f = self.format
        torch.ops.gossip_ext.topk_add_into(total, message, f.k, f.bits, f.chunk)


@dataclasses.dataclass
class _Pending:
    """A mean between :meth:`SparseMean.start` and :meth:`SparseMean.finish`."""

    works: list[Any]
    flags: torch.Tensor  # SenderCheck's: which workers sent NaN or Inf
    total_weight: torch.Tensor
    weight: float | None
    contributions: list[torch.Tensor]  # per bucket: w (v + e)
    messages: list[torch.Tensor]  # per bucket: this rank's message (kept alive while sent)
    gathered: list[torch.Tensor]  # per bucket: every rank's message


class SparseMean(Averaging[_Pending]):
    """The exact weighted mean over ``group`` of per-bucket float vectors (pseudo-gradients),
    sent in the sparse ``format`` (a :class:`TopK`) with an error-feedback residual per bucket,
    each wait bounded by ``timeout``."""

    state_key = "outer_residuals"
    averages_buffers = True
    what = "the outer step's sparse mean"

    def __init__(
        self,
        layout,
        device: torch.device,
        format: TopK,
        group: dist.ProcessGroup,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ):
        self.timeout = timeout
        # The total push-sum weight rides ahead of the flags, in float64 on the host as before.
        self.check = SenderCheck(group, torch.device("cpu"), torch.float64)
        self.format = format
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.layout = list(layout)
        self.device = device
        self.codecs = [_Codec(format, n) for n, _ in self.layout]
        self.residuals = [torch.zeros(n, dtype=d, device=device) for n, d in self.layout]

    def bytes_per_step(self, round_bytes: int = 0) -> int:
        return self.format.bytes_per_step([n for n, _ in self.layout], self.world_size)

    def mean(self, values: Sequence[torch.Tensor], weight: float | None) -> PseudoGradientMean:
        """``sum_i w_i v_i / sum_i w_i`` over the group, per bucket, as every rank decodes it from
        the same messages; and the residuals it would leave. ``weight``: this rank's push-sum
        weight, or None on a rank that contributes nothing. Collective; keeps nothing."""
        return self.finish(self.start(Contribution.of_pseudo_gradients(values, weight)))

    @torch.no_grad()
    def start(self, contribution: Contribution) -> _Pending:
        """The first half of :meth:`mean`: encodes this rank's messages of its pseudo-gradient
        and starts gathering every rank's (asynchronous collectives); :meth:`finish` waits and
        decodes them."""
        n = self.world_size
        weight = contribution.weight
        values = None if weight is None else contribution.pseudo_gradients()
        flags, total_weight, work = self.check.post_with_weight(values, weight)
        works = [work]
        pending = _Pending(works, flags, total_weight, weight, [], [], [])
        for b, ((numel, dtype), codec) in enumerate(zip(self.layout, self.codecs)):
            mine = torch.zeros(numel, dtype=dtype, device=self.device)
            if values is not None and weight is not None:  # None both on a non-contributor
                mine.copy_(values[b])
                mine.add_(self.residuals[b], alpha=self.format.feedback_decay)
                mine.mul_(weight)
            message = codec.encode(mine)
            gathered = torch.empty(n * codec.bytes, dtype=torch.uint8, device=self.device)
            works.append(_all_gather(gathered, message, self.group, async_op=True))
            pending.contributions.append(mine)
            pending.messages.append(message)
            pending.gathered.append(gathered)
        return pending

    @torch.no_grad()
    def finish(self, pending: _Pending) -> PseudoGradientMean:
        """The second half of :meth:`mean`: waits for every rank's messages and decodes them, in
        rank order, into the mean; this rank's residuals are what its messages left out."""
        wait_for_every_worker(pending.works, self.what, self.group, self.timeout)
        self.check.raise_if_flagged(pending.flags, self.what)
        total_weight, weight = pending.total_weight.item(), pending.weight
        kept: list[torch.Tensor] = []  # the residuals after the step
        staged = PseudoGradientMean([], kept)
        for b, ((numel, dtype), codec) in enumerate(zip(self.layout, self.codecs)):
            chunks = (codec.chunks, self.format.chunk)
            total = torch.zeros(chunks, dtype=dtype, device=self.device)
            for other in pending.gathered[b].split(codec.bytes):  # the same sum on every rank
                codec.add_into(total, other)
            staged.values.append(total.view(-1)[:numel].div_(total_weight))
            if weight is None:
                kept.append(self.residuals[b])
                continue
            carried = torch.zeros(chunks, dtype=dtype, device=self.device)
            codec.add_into(carried, pending.messages[b])
            residual = pending.contributions[b].sub_(carried.view(-1)[:numel]).div_(weight)
            kept.append(residual)
        return staged

    def commit(self, mean: Mean) -> None:
        """Keeps the residuals of a step whose every collective succeeded."""
        self.residuals = mean.kept_as(list)

    def describe(self) -> dict[str, Any]:
        return {"kind": "SparseMean", "message_dtype": self.format.describe()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "message_dtype": repr(self.format),
            "world_size": self.world_size,
            "residuals": [t.clone() for t in self.residuals],
        }

    def check_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        if state is None:
            return
        saved = (state.get("message_dtype"), state.get("world_size"))
        if not members_changed and saved != (repr(self.format), self.world_size):
            raise ValueError(
                f"load_state_dict: the checkpoint's outer residuals are for {saved[0]} over "
                f"{saved[1]} workers, but this run sends {self.format!r} over {self.world_size}"
            )
        check_saved("outer residuals", state.get("residuals"), layout_of(self.residuals))

    def load_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        """A checkpoint without residuals starts them at zero; an elastic epoch keeps this
        worker's own (they are its, whoever its peers are)."""
        self.check_state_dict(state, members_changed)
        if state is None:
            for t in self.residuals:
                t.zero_()
            return
        residuals = check_saved("outer residuals", state["residuals"], layout_of(self.residuals))
        self.residuals = [t.detach().to(self.device).clone() for t in residuals]
