"""The messages of asynchronous gossip, and the flat copies they are made of.

Both asynchronous modes send one host byte buffer of a size fixed for the job, written and read
by the compiled ``_C.MessageCodec`` (csrc/engine/message_codec.h): a header (the weight of the
share or the inner steps behind a pseudo-gradient, the sender's round, one more value of the
sender's) and the values, in full precision, in 16 bits, or block-quantized (int8, int4 or
float8 e4m3fn: Note [Quantized messages] in csrc/kernels/block_format.h), a lossy message's
rounding kept by its sender (error feedback). Asynchronous push-sum's messages never leave the
compiled engine (``_C.AsyncPushSum``); an asynchronous outer step's pseudo-gradients are made
here (``outer.asynchronous``) from :func:`flatten`'s copies. :func:`codec` builds the codec of
one flat buffer, and ``weight_of``, ``round_of`` and ``aux_of`` read a message's header.

Note [Asynchronous gossip on GPUs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Asynchronous messages travel over gloo from host memory, also between GPUs, by design rather
than NCCL's point-to-point calls: an NCCL receive is matched and stream-ordered, so a worker that
keeps one posted for each peer's next message (what never waiting takes) would hold a kernel
resident on the GPU per peer until that peer sends, stall every later call on the communicator
behind it, and could be released from a stopped peer only by aborting the communicator. Over gloo
a posted receive costs a host thread, and a timeout names the peer. What crosses PCIe is the
message, not the model: values are encoded and absorbed on the GPU by the same kernels as the
synchronous NCCL rounds, so an int8 message moves a quarter of the parameters' bytes each way,
where the network asynchronous gossip is for is the slower link.
"""

from __future__ import annotations

import torch

from gossip_ext._torch_check import _C

weight_of = _C.MessageCodec.weight_of
round_of = _C.MessageCodec.round_of
aux_of = _C.MessageCodec.aux_of


def codec(
    numel: int,
    dtype: torch.dtype,
    message_dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
) -> _C.MessageCodec:
    """The codec of messages of one flat ``dtype`` buffer of ``numel`` values on ``device``,
    travelling as ``message_dtype``: None (full precision), ``torch.bfloat16``,
    ``torch.float16``, ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn``."""
    if message_dtype is not None and not (
        isinstance(message_dtype, str)
        or message_dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    ):
        raise ValueError(
            "message_dtype must be torch.bfloat16, torch.float16, 'int8', 'int4', "
            f"torch.float8_e4m3fn or None (full precision), got {message_dtype!r}"
        )
    return _C.MessageCodec([(numel, dtype)], message_dtype, torch.device(device))


def flatten(tensors, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensors`` as one flat ``dtype`` copy, in order: the values a message is made of. Into
    ``out`` where given (a worker's buffer for every step: a fresh one each time costs ten times
    the copy, in the page faults of its first touch)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    if out is None:
        return torch.cat([t.to(dtype) for t in flat])
    if all(t.dtype == out.dtype for t in flat):
        return torch.cat(flat, out=out)
    for values, t in zip(out.split([t.numel() for t in flat]), flat):
        values.copy_(t)
    return out


def write_flat(tensors, flat: torch.Tensor) -> None:
    """Writes ``flat`` (as :func:`flatten` laid it out) back into ``tensors``, in place."""
    with torch.no_grad():
        for tensor, values in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(values.view_as(tensor))
