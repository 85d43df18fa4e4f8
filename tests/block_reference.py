"""Block-quantized messages in plain PyTorch: the independent reference of the quantize_into_ and
absorb_quantized_ kernels (Note [Quantized messages] in csrc/kernels/block_format.h), written from
the format's definition with torch's own rounding (torch.round, ties to even; torch's float8
e4m3fn conversion)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
LEVELS = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0}
FORMATS = tuple(LEVELS)


def message_bytes(numel: int, fmt: str) -> int:
    blocks = -(-numel // BLOCK)
    payload = (numel + 1) // 2 if fmt == "int4" else numel
    return 4 * blocks + payload


@dataclass
class Quantized:
    scales: torch.Tensor  # float32, one per block (NaN for a block holding NaN or Inf)
    codes: torch.Tensor  # float32 code values (levels), one per value, unscaled
    payload: torch.Tensor  # uint8, as on the wire
    values: torch.Tensor  # float32: what the receiver reads, codes * scales
    finite_blocks: torch.Tensor  # bool, per value: its block held no NaN or Inf

    def message(self) -> torch.Tensor:
        return torch.cat([self.scales.view(torch.uint8), self.payload])


def quantize(v: torch.Tensor, fmt: str) -> Quantized:
    """v (float32 or float64, 1-D), as a message of format fmt."""
    q = LEVELS[fmt]
    n = v.numel()
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=v.dtype)
    padded[:n] = v
    per_block = padded.view(blocks, BLOCK)
    finite = torch.isfinite(per_block).all(dim=1)
    amax = per_block.abs().amax(dim=1)
    scales = (amax / q).float()
    scales = torch.where(finite, scales, torch.tensor(float("nan")))
    divisor = torch.where(scales > 0, scales.to(v.dtype), torch.ones((), dtype=v.dtype))
    y = (per_block / divisor[:, None]).float().clamp(-q, q)
    y = torch.where(finite[:, None], y, torch.zeros(()))
    if fmt == "float8_e4m3fn":
        fp8 = y.to(torch.float8_e4m3fn)
        codes = fp8.float()
        payload = fp8.view(torch.uint8).flatten()[:n]
    else:
        codes = torch.round(y)
        ints = codes.to(torch.int8).flatten()[:n]
        if fmt == "int8":
            payload = ints.view(torch.uint8)
        else:
            nibbles = (ints.to(torch.int16) & 0xF).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, torch.zeros(1, dtype=torch.uint8)])
            payload = nibbles[0::2] | (nibbles[1::2] << 4)
    values = (codes * scales[:, None]).flatten()[:n]
    finite_values = finite[:, None].expand(blocks, BLOCK).flatten()[:n]
    return Quantized(scales, codes.flatten()[:n], payload, values, finite_values)


def quantize_into(z: torch.Tensor, fmt: str, scale: float, fold: float):
    """(message bytes, z after error feedback) for v = scale * z, as quantize_into_ does it with
    scale = alpha * w and fold = feedback / w, in z's dtype."""
    s = torch.tensor(scale, dtype=z.dtype)
    f = torch.tensor(fold, dtype=z.dtype)
    v = s * z
    quantized = quantize(v, fmt)
    new_z = z.clone()
    if fold != 0.0:
        kept = z + f * (v - quantized.values.to(z.dtype))
        new_z = torch.where(quantized.finite_blocks, kept, z)
    return quantized.message(), new_z


def dequantize(message: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """The float32 values a receiver reads from a message of numel values."""
    blocks = -(-numel // BLOCK)
    scales = message[: 4 * blocks].clone().view(torch.float32)  # clone: the bytes may be unaligned
    payload = message[4 * blocks :]
    if fmt == "int8":
        codes = payload.view(torch.int8).float()
    elif fmt == "int4":
        low = (payload & 0xF).to(torch.int16)
        high = (payload >> 4).to(torch.int16)
        nibbles = torch.stack([low, high], dim=1).flatten()[:numel]
        codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()
    else:
        codes = payload.view(torch.float8_e4m3fn).float()
    return codes * scales.repeat_interleave(BLOCK)[:numel]


def absorb(x, messages, fmt, self_scale, sent=None, sent_scale=0.0, out_scale=1.0):
    """absorb_quantized_'s arithmetic in x's dtype, in its order."""
    dtype = x.dtype
    acc = torch.tensor(self_scale, dtype=dtype) * x
    for m in messages:
        acc = acc + dequantize(m, x.numel(), fmt).to(dtype)
    if sent is not None:
        acc = acc + torch.tensor(sent_scale, dtype=dtype) * dequantize(sent, x.numel(), fmt).to(
            dtype
        )
    return acc * torch.tensor(out_scale, dtype=dtype)
