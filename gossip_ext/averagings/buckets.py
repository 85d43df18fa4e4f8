"""Exact averaging across workers: the parameters as flat buckets, and their exact average.

Gossip only drives the workers' models towards their average. :func:`exact_average` reaches it
exactly, with one all-reduce of the parameters per dtype, for what gossip cannot give: the outer
steps of ``gossip_ext.outer.outer_steps`` (a periodic reset of the drift between workers, SlowMo's
and DiLoCo's steps) and one model for evaluation or a checkpoint (``average_parameters()``).

The average is push-sum's consensus value ``sum_i w_i z_i / sum_i w_i``: what gossip itself
converges to, and the only average that keeps the push-sum mass (the sums of x = w z and of w)
unchanged when every weight is reset to 1 afterwards. Whenever the weights are 1 (lazy mixing:
uniform mixing on any built-in graph) it is the plain mean of the de-biased parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums and the slow state of half-precision parameters are kept in float32, as the
    kernels accumulate them; other dtypes keep their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def layout_of(tensors: Sequence[torch.Tensor]) -> list[tuple[int, torch.dtype]]:
    """(elements, dtype) of each of ``tensors``: the layout a saved state of them must have."""
    return [(t.numel(), t.dtype) for t in tensors]


def weighted_message_bytes(layout: Sequence[tuple[int, torch.dtype]]) -> int:
    """The bytes of one message of every bucket of ``layout``: its values and one element more,
    the push-sum weight (the exact all-reduce's and the gossip exchange's messages)."""
    return sum((n + 1) * torch.empty((), dtype=d).element_size() for n, d in layout)


def check_saved(
    what: str, saved: object, layout: Sequence[tuple[int, torch.dtype]]
) -> list[torch.Tensor]:
    """``saved`` (a checkpoint's state kept per bucket) as a list of tensors; raises ValueError
    naming ``what`` unless it is one of ``layout``'s (elements, dtype): checked before any of it
    is written, so that a checkpoint of another model loads nothing rather than part of itself."""
    found: list[tuple[int, torch.dtype]] | str = type(saved).__name__
    tensors: list[torch.Tensor] = []
    if isinstance(saved, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in saved):
        tensors = list(saved)
        found = [(t.numel(), t.dtype) for t in tensors]
    if found != list(layout):
        raise ValueError(
            f"load_state_dict: the checkpoint's {what} has buckets (elements, dtype) {found}, "
            f"but this model's parameters give {list(layout)}"
        )
    return tensors


class ParameterBuckets:
    """Tensors grouped by dtype in order of first appearance (the engine's flat-buffer order), each
    group read and written as one flat vector in its accumulation dtype without a flat copy of
    its own: ranges of it are copied straight between the tensors and a caller's buffer."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            buckets.setdefault(t.dtype, []).append(t)
        self.params = list(buckets.values())

    def __len__(self) -> int:
        return len(self.params)

    def numel(self, bucket: int) -> int:
        return sum(t.numel() for t in self.params[bucket])

    def dtype(self, bucket: int) -> torch.dtype:
        return accumulation_dtype(self.params[bucket][0].dtype)

    def device(self, bucket: int) -> torch.device:
        return self.params[bucket][0].device

    def layout(self) -> list[tuple[int, torch.dtype]]:
        """(elements, accumulation dtype) of each bucket: what a saved slow state must match."""
        return [(self.numel(b), self.dtype(b)) for b in range(len(self))]

    def _pieces(self, bucket: int, lo: int, hi: int):
        """(tensor's flat view, start in it, start in [lo, hi), length) of every tensor of the
        bucket that overlaps the flat range [lo, hi)."""
        offset = 0
        for t in self.params[bucket]:
            start, end = max(lo, offset), min(hi, offset + t.numel())
            if start < end:
                yield t.detach().view(-1), start - offset, start - lo, end - start
            offset += t.numel()

    @torch.no_grad()
    def read(self, bucket: int, out: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """Copies the flat range [lo, lo + len(out)) of the bucket into ``out``."""
        for flat, at, to, n in self._pieces(bucket, lo, lo + out.numel()):
            out[to : to + n].copy_(flat[at : at + n])
        return out

    @torch.no_grad()
    def write(self, bucket: int, values: torch.Tensor, lo: int = 0) -> None:
        """Copies ``values`` into the flat range [lo, lo + len(values)) of the bucket."""
        for flat, at, to, n in self._pieces(bucket, lo, lo + values.numel()):
            flat[at : at + n].copy_(values[to : to + n])


@torch.no_grad()
def exact_average(
    buckets: ParameterBuckets, bucket: int, weight: float | None, group: dist.ProcessGroup
) -> torch.Tensor:
    """``sum_i w_i z_i / sum_i w_i`` of one bucket over the ranks of ``group``, in a new flat
    tensor (the parameters are left as they are); collective, and every rank gets the same bits.

    The result is the only copy of the bucket this takes: the message is built in it and
    all-reduced in place. ``weight`` is this rank's push-sum weight, or None on a rank that holds
    no gossip state of its own (a non-leader of ``nprocs_per_node > 1``): it contributes zeros,
    so the whole group can take part and receive the result while only the gossiping ranks are
    averaged. The weight rides as one extra element of the message, so the sum of the weights
    needs no collective of its own (and counts the contributing ranks when every weight is 1).
    """
    numel = buckets.numel(bucket)
    message = torch.empty(numel + 1, dtype=buckets.dtype(bucket), device=buckets.device(bucket))
    if weight is None:
        message.zero_()
    else:
        buckets.read(bucket, message[:numel])
        message[numel] = 1.0
        if weight != 1.0:
            message.mul_(weight)
    dist.all_reduce(message, group=group)
    return message[:numel].div_(message[numel])
