"""The exact mean of the workers' pseudo-gradients in compressed messages (``outer_dtype``).

An all-reduce sums its messages as it forwards them, which a block-quantized message does not
allow: two ranks' int4 blocks have different scales, and no sum of their codes means anything. So
the mean is taken in two steps over shards, as a reduce-scatter and an all-gather would:

1. Every rank cuts its pseudo-gradient into ``world_size`` shards (whole blocks of 128 values),
   compresses each with error feedback (what rounding took off stays in its residual ``e``, added
   to the next outer step's pseudo-gradient) and sends shard ``j`` to rank ``j`` (all-to-all).
2. Rank ``j`` reads the ``world_size`` messages of its shard in float32 (float64 for float64
   parameters), sums them, divides by the total push-sum weight and compresses the mean, keeping
   its rounding in its owner residual ``r`` (added to the next mean of that shard), and every rank
   gathers every shard's message (all-gather).

Every rank then reads the same bytes, so every ``theta_global`` stays bit for bit the same. Bytes
each rank sends per outer step: ``2 (n - 1) / n`` of the model at the message's width (the scales
included), where a ring all-reduce of float32 sends ``2 (n - 1) / n`` at 4 bytes a value: int8 and
float8 e4m3 cost 0.258 of it, int4 0.133, bfloat16 and float16 0.5. With both residuals the sum of
the means applied over many outer steps is the sum of the true means, less what the residuals
hold at the end (at most a message's rounding each): no error accumulates.

Every collective of a step runs before anything is kept: :meth:`CompressedMean.mean` returns the
mean with the residuals it would leave, and :meth:`CompressedMean.commit` keeps them once the
outer step has succeeded (Note [The parameters are the model] in the engine).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C
from gossip_ext.averagings.buckets import check_saved, layout_of
from gossip_ext.averagings.failures import DEFAULT_TIMEOUT, SenderCheck, wait_for_every_worker
from gossip_ext.averagings.interface import Averaging, Contribution, Mean, PseudoGradientMean

BLOCK = 128  # kQuantBlock of csrc/kernels/block_format.h: shards are whole blocks
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
BLOCK_FORMATS: dict[torch.dtype | str, str] = {
    "int8": "int8",
    "int4": "int4",
    torch.float8_e4m3fn: "float8_e4m3fn",
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
):
    # all_gather_single where torch has it (2.13 deprecates all_gather_into_tensor).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def shard_values(numel: int, world_size: int) -> int:
    """Values in each of the ``world_size`` shards of a bucket of ``numel``: whole blocks, so that
    no block straddles two ranks' shards (the last shards are padded with zeros)."""
    return _ceil_div(_ceil_div(numel, world_size), BLOCK) * BLOCK


def bytes_per_step(numels: Sequence[int], world_size: int, message_dtype) -> int:
    """Bytes each rank sends per outer step for buckets of ``numels`` values: one message of a
    shard to each other rank (all-to-all), then its shard of the mean to each (all-gather)."""
    codec = _Codec(message_dtype)
    element = torch.empty((), dtype=codec.dtype).element_size()
    per_shard = sum(codec.message_numel(shard_values(n, world_size)) for n in numels)
    return 2 * (world_size - 1) * per_shard * element


class _Codec:
    """One message format: how many bytes a shard's message takes, how a shard is compressed into
    it, and how messages are read back into a float accumulator."""

    def __init__(self, message_dtype: torch.dtype | str):
        # A 16-bit message is the values in that dtype; a block format's, bytes.
        self.sixteen_bit = message_dtype in SIXTEEN_BIT
        self.dtype, self.format = torch.uint8, ""
        if isinstance(message_dtype, torch.dtype) and self.sixteen_bit:
            self.dtype = message_dtype
        else:
            self.format = BLOCK_FORMATS[message_dtype]

    def message_numel(self, values: int) -> int:
        if self.sixteen_bit:
            return values
        return _C.quantized_message_bytes(values, self.format)

    def encode(self, values: torch.Tensor, message: torch.Tensor) -> None:
        """``message`` <- ``values`` compressed; then ``values`` <- what rounding took off."""
        if self.sixteen_bit:
            torch.ops.gossip_ext.compress_into_(values, message, 1.0)
            torch.ops.gossip_ext.absorb_(values, [], 1.0, None, None, None, message, -1.0)
        else:
            torch.ops.gossip_ext.quantize_into_(values, message, self.format, 1.0)
            torch.ops.gossip_ext.absorb_quantized_(
                values, [], self.format, 1.0, None, None, None, message, -1.0
            )

    def accumulate(self, total: torch.Tensor, messages: Sequence[torch.Tensor]) -> None:
        """``total`` += the sum of the values of ``messages``, in one pass."""
        if self.sixteen_bit:
            torch.ops.gossip_ext.absorb_(total, list(messages), 1.0)
        else:
            torch.ops.gossip_ext.absorb_quantized_(total, list(messages), self.format, 1.0)


@dataclass
class _Pending:
    """A mean between :meth:`CompressedMean.start` and :meth:`CompressedMean.finish`."""

    works: list[Any]
    flags: torch.Tensor  # SenderCheck's: which workers sent NaN or Inf
    total_weight: torch.Tensor
    received: list[tuple[torch.Tensor, torch.Tensor]]  # per bucket: (receive, send) buffers
    residuals: list[torch.Tensor]


@dataclass
class _Kept:
    """What a mean leaves once it is committed: the residuals after the step."""

    residuals: list[torch.Tensor]
    owner_residuals: list[torch.Tensor]


class CompressedMean(Averaging[_Pending]):
    """The exact mean over ``group`` of per-bucket float vectors (pseudo-gradients), sent in
    ``message_dtype`` (torch.bfloat16, torch.float16, torch.float8_e4m3fn, "int8" or "int4") by
    the two-step scheme of this module, with its two error-feedback residuals per bucket.

    ``layout`` is each bucket's (elements, float dtype): float32, or float64 (whose values travel
    compressed as well, and are summed in float64)."""

    state_key = "outer_residuals"
    averages_buffers = True
    what = "the outer step's compressed mean"

    def __init__(
        self,
        layout: Sequence[tuple[int, torch.dtype]],
        device: torch.device,
        message_dtype: torch.dtype | str,
        group: dist.ProcessGroup,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ):
        self.timeout = timeout
        # The total push-sum weight rides ahead of the flags, in float64 on the host as before.
        self.check = SenderCheck(group, torch.device("cpu"), torch.float64)
        self.codec = _Codec(message_dtype)
        self.message_dtype = message_dtype
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = group.rank()
        self.layout = list(layout)
        self.device = device
        self.shard = [shard_values(n, self.world_size) for n, _ in layout]
        self.residuals = [torch.zeros(n, dtype=d, device=device) for n, d in self.layout]
        self.owner_residuals = [
            torch.zeros(s, dtype=d, device=device) for s, (_, d) in zip(self.shard, self.layout)
        ]

    def bytes_per_step(self, round_bytes: int = 0) -> int:
        """Bytes this rank sends per outer step, message padding included."""
        return bytes_per_step([n for n, _ in self.layout], self.world_size, self.message_dtype)

    def mean(self, values: Sequence[torch.Tensor], weight: float | None) -> PseudoGradientMean:
        """The weighted mean ``sum_i w_i v_i / sum_i w_i`` over the group of each bucket's
        ``values`` (read, not written), as every rank reads it from the same messages; the
        residuals it would leave. ``weight``: this rank's push-sum weight, or None on a rank that
        contributes nothing (it still receives the mean). Collective; keeps nothing."""
        return self.finish(self.start(Contribution.of_pseudo_gradients(values, weight)))

    @torch.no_grad()
    def start(self, contribution: Contribution) -> _Pending:
        """The first half of :meth:`mean`: compresses this rank's shards of its pseudo-gradient
        and starts sending them (asynchronous collectives, run by the process group's own
        thread); :meth:`finish` waits for them. Streaming DiLoCo trains on while they travel."""
        n = self.world_size
        weight = contribution.weight
        values = None if weight is None else contribution.pseudo_gradients()
        flags, total_weight, work = self.check.post_with_weight(values, weight)
        works = [work]
        residuals, received = [], []
        for b, (numel, dtype) in enumerate(self.layout):
            shard = self.shard[b]
            size = self.codec.message_numel(shard)
            # This rank's contribution, padded to whole shards, its residual added.
            padded = torch.zeros(shard * n, dtype=dtype, device=self.device)
            if values is not None and weight is not None:  # None both on a non-contributor
                padded[:numel].copy_(values[b]).add_(self.residuals[b])
                if weight != 1.0:
                    padded[:numel].mul_(weight)
            send = torch.empty(n * size, dtype=self.codec.dtype, device=self.device)
            for j in range(n):
                self.codec.encode(
                    padded[j * shard : (j + 1) * shard], send[j * size : (j + 1) * size]
                )
            receive = torch.empty_like(send)
            works.append(dist.all_to_all_single(receive, send, group=self.group, async_op=True))
            residual = padded[:numel]
            if weight is None:
                residual = self.residuals[b]
            elif weight != 1.0:
                residual.div_(weight)
            residuals.append(residual)
            received.append((receive, send))  # the send buffer lives until the work completes
        return _Pending(works, flags, total_weight, received, residuals)

    @torch.no_grad()
    def finish(self, pending: _Pending) -> PseudoGradientMean:
        """The second half of :meth:`mean`: waits for :meth:`start`'s messages, reduces this
        rank's shard, sends it to every rank and reads every shard's mean. Collective."""
        wait_for_every_worker(pending.works, self.what, self.group, self.timeout)
        self.check.raise_if_flagged(pending.flags, self.what)
        n = self.world_size
        total_weight = pending.total_weight.item()
        kept = _Kept(pending.residuals, [])
        staged = PseudoGradientMean([], kept)
        for b, (numel, dtype) in enumerate(self.layout):
            shard = self.shard[b]
            size = self.codec.message_numel(shard)
            received = pending.received[b][0]
            # This rank's shard of the mean, its owner residual added, compressed once more.
            mine = torch.zeros(shard, dtype=dtype, device=self.device)
            self.codec.accumulate(mine, received.split(size))
            mine.div_(total_weight).add_(self.owner_residuals[b])
            mean_message = torch.empty(size, dtype=self.codec.dtype, device=self.device)
            self.codec.encode(mine, mean_message)
            gathered = torch.empty(n * size, dtype=self.codec.dtype, device=self.device)
            work = _all_gather(gathered, mean_message, self.group, async_op=True)
            wait_for_every_worker([work], self.what, self.group, self.timeout)
            mean = torch.zeros(shard * n, dtype=dtype, device=self.device)
            for j, message in enumerate(gathered.split(size)):
                self.codec.accumulate(mean[j * shard : (j + 1) * shard], [message])
            staged.values.append(mean[:numel])
            kept.owner_residuals.append(mine)
        return staged

    def commit(self, mean: Mean) -> None:
        """Keeps the residuals of a step whose every collective succeeded."""
        kept = mean.kept_as(_Kept)
        self.residuals, self.owner_residuals = kept.residuals, kept.owner_residuals

    def describe(self) -> dict[str, Any]:
        return {"kind": "CompressedMean", "message_dtype": str(self.message_dtype)}

    # ----------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "message_dtype": str(self.message_dtype),
            "world_size": self.world_size,
            "residuals": [t.clone() for t in self.residuals],
            "owner_residuals": [t.clone() for t in self.owner_residuals],
        }

    def check_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        if state is None:
            return
        if not members_changed:
            saved = (state.get("message_dtype"), state.get("world_size"))
            if saved != (str(self.message_dtype), self.world_size):
                raise ValueError(
                    f"load_state_dict: the checkpoint's outer residuals are for outer_dtype="
                    f"{saved[0]} over {saved[1]} workers, but this run has outer_dtype="
                    f"{self.message_dtype} over {self.world_size}"
                )
            check_saved(
                "outer residuals of its shards",
                state.get("owner_residuals"),
                layout_of(self.owner_residuals),
            )
        check_saved("outer residuals", state.get("residuals"), layout_of(self.residuals))

    def load_state_dict(
        self, state: Mapping[str, object] | None, members_changed: bool = False
    ) -> None:
        """A checkpoint without residuals (saved by a run that sent full precision) starts them at
        zero. ``members_changed`` (an elastic job's new epoch): this worker's own residuals are
        kept, and the shard owners' start at zero, their shards being other ones now (what they
        held, at most one message's rounding of the mean, is dropped)."""
        self.check_state_dict(state, members_changed)
        if state is None:
            for t in self.residuals + self.owner_residuals:
                t.zero_()
            return
        residuals = check_saved("outer residuals", state["residuals"], layout_of(self.residuals))
        self.residuals = [t.detach().to(self.device).clone() for t in residuals]
        if members_changed:
            for t in self.owner_residuals:
                t.zero_()
        else:
            owner = check_saved(
                "outer residuals of its shards",
                state["owner_residuals"],
                layout_of(self.owner_residuals),
            )
            self.owner_residuals = [t.detach().to(self.device).clone() for t in owner]
