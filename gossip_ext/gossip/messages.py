"""The messages of asynchronous push-sum (``asynchronous.AsyncPushSum``: a worker's de-biased
model and the weight of the share it stands for) and of asynchronous outer steps
(``outer.asynchronous``: a pseudo-gradient and the inner steps behind it), as one byte buffer of a
size fixed for the job.

Layout: ``[weight | round | aux | values]``, the weight a float64, the sender's round an int64 and
one more float64 of the sender's (an outer step's: its seconds per inner step) at the head, where
every view of the bytes after it stays aligned; the whole of one size for the job, so that a
receiver's posted buffer fits any message of its sender and the mass of the weights is
conserved to float64 rounding whatever the values travel in. The values travel in full
precision, in 16 bits,
or block-quantized (int8, int4 or float8 e4m3fn, a float32 scale per block of 128 values: 0.258,
0.133 and 0.258 of float32's bytes, as the compiled engine's messages). A lossy message's rounding
stays with its sender (error feedback): the sender keeps its numerator minus what it really sent,
so the sum of all numerators (weight times values) is conserved to the state's rounding and the
error rides along in
later messages.
"""

from __future__ import annotations

import math

import torch

BLOCK = 128  # values per block scale, as in csrc/kernels/block_format.h
_HEADER_BYTES = 24  # the weight (float64), the sender's round (int64), aux (float64)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


class Codec:
    """Writes and reads the messages of ``numel`` values held in ``dtype`` (float32 or
    float64), travelling as ``message_dtype``: None (full precision), ``torch.bfloat16``,
    ``torch.float16``, ``"int8"`` or ``torch.float8_e4m3fn``."""

    def __init__(self, numel: int, dtype: torch.dtype, message_dtype=None):
        self.numel, self.dtype, self.message_dtype = numel, dtype, message_dtype
        self.blocks = math.ceil(numel / BLOCK)
        if message_dtype is None:
            body = numel * torch.empty((), dtype=dtype).element_size()
        elif message_dtype in (torch.bfloat16, torch.float16):
            body = numel * 2
        elif message_dtype in ("int8", torch.float8_e4m3fn):
            body = self.blocks * BLOCK + self.blocks * 4
        elif message_dtype == "int4":
            body = self.blocks * BLOCK // 2 + self.blocks * 4
        else:
            raise ValueError(
                "message_dtype must be torch.bfloat16, torch.float16, 'int8', 'int4', "
                f"torch.float8_e4m3fn or None (full precision), got {message_dtype!r}"
            )
        self.nbytes = body + _HEADER_BYTES

    @property
    def lossless(self) -> bool:
        return self.message_dtype is None

    def encode(
        self,
        values: torch.Tensor,
        weight: float,
        round: int,  # noqa: A002 - the sender's round
        aux: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The message of ``values`` (a flat ``dtype`` tensor), ``weight`` and ``aux`` from the
        sender's ``round``, and the values as the receiver will read them (the sender keeps the
        difference)."""
        header = torch.cat(
            [
                _as_bytes(torch.tensor([weight], dtype=torch.float64)),
                _as_bytes(torch.tensor([round], dtype=torch.int64)),
                _as_bytes(torch.tensor([aux], dtype=torch.float64)),
            ]
        )
        kind = self.message_dtype
        if kind is None:
            return torch.cat([header, _as_bytes(values)]), values
        if kind in (torch.bfloat16, torch.float16):
            rounded = values.to(kind)
            return torch.cat([header, _as_bytes(rounded)]), rounded.to(self.dtype)
        padded = torch.zeros(self.blocks * BLOCK, dtype=torch.float32)
        padded[: self.numel] = values
        blocks = padded.view(self.blocks, BLOCK)
        largest = blocks.abs().amax(dim=1, keepdim=True)
        # A NaN or Inf travels as a NaN scale, which the receiver's finiteness check names.
        finite = torch.isfinite(largest)
        limit = {"int8": 127.0, "int4": 7.0}.get(kind, 448.0)
        scales = torch.where(finite, largest / limit, torch.full_like(largest, math.nan))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        scaled = torch.where(finite, blocks / safe, torch.zeros_like(blocks))
        if kind in ("int8", "int4"):
            quantized = scaled.round().clamp_(-limit, limit).to(torch.int8)
        else:
            quantized = scaled.to(torch.float8_e4m3fn)
        read = (quantized.to(torch.float32) * scales).reshape(-1)[: self.numel]
        packed = _pack_nibbles(quantized) if kind == "int4" else quantized
        message = torch.cat([header, _as_bytes(packed), _as_bytes(scales)])
        return message, read.to(self.dtype)

    def decode(self, message: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The values (``dtype``) and the weight a message carries."""
        body = message[_HEADER_BYTES:]
        weight_value = float(message[:8].view(torch.float64)[0])
        kind = self.message_dtype
        if kind is None:
            return body.view(self.dtype), weight_value
        if kind in (torch.bfloat16, torch.float16):
            return body.view(kind).to(self.dtype), weight_value
        values = self.blocks * BLOCK // (2 if kind == "int4" else 1)
        if kind == "int4":
            quantized = _unpack_nibbles(body[:values])
        else:
            quantized = body[:values].view(torch.int8 if kind == "int8" else torch.float8_e4m3fn)
        scales = body[values:].view(torch.float32).view(self.blocks, 1)
        read = quantized.view(self.blocks, BLOCK).to(torch.float32) * scales
        return read.reshape(-1)[: self.numel].to(self.dtype), weight_value


def flatten(tensors, dtype: torch.dtype) -> torch.Tensor:
    """``tensors`` as one flat ``dtype`` copy, in order: the values a message is made of."""
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def write_flat(tensors, flat: torch.Tensor) -> None:
    """Writes ``flat`` (as :func:`flatten` laid it out) back into ``tensors``, in place."""
    with torch.no_grad():
        for tensor, values in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(values.view_as(tensor))


def round_of(message: torch.Tensor) -> int:
    """The sender's round a message (of any codec) carries."""
    return int(message[8:16].view(torch.int64)[0])


def aux_of(message: torch.Tensor) -> float:
    """The sender's ``aux`` value a message (of any codec) carries."""
    return float(message[16:_HEADER_BYTES].view(torch.float64)[0])


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7], two to a byte (offset by 8), the even-indexed in the low half."""
    biased = (values.reshape(-1, 2).to(torch.int16) + 8).to(torch.uint8)
    return biased[:, 0] | (biased[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).reshape(-1)
