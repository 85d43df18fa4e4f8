"""The block-quantized cases of benchmarks/kernels.py: quantize_into_ and absorb_quantized_,
fused, against the chain of torch ops a plain-PyTorch implementation runs.

A message of n values is a float32 scale per block of 128 values, then the codes (Note [Quantized
messages] in csrc/kernels/block_format.h): int8 and float8 send n bytes, int4 n / 2.
"""

from __future__ import annotations

import torch

import gossip_ext

ALPHA = 0.5  # the uniform mixing share of one out-peer


class Case:
    """One op at one (dtype, size): the fused and unfused callables and the bytes they move."""

    def __init__(self, name: str, fused, unfused, passes: float, outputs: list[torch.Tensor]):
        self.name = name
        self.fused = fused
        self.unfused = unfused
        self.passes = passes  # bytes read + written, in units of the state's n * element size
        self.outputs = outputs  # what both write: compared before timing


BLOCK = 128
LEVELS = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0}


def quantize_chain(state, message, fmt: str, scale: float, fold: float) -> None:
    """quantize_into_ as the chain of torch ops a plain-PyTorch implementation runs: scale, pad to
    whole blocks, block maxima, divide, clamp, round (or cast to float8), pack, error feedback."""
    n, dtype, q = state.numel(), state.dtype, LEVELS[fmt]
    blocks = -(-n // BLOCK)
    v = state * scale
    padded = torch.zeros(blocks * BLOCK, dtype=dtype, device=state.device)
    padded[:n] = v
    per_block = padded.view(blocks, BLOCK)
    scales = (per_block.abs().amax(1) / q).float()
    divisor = torch.where(scales > 0, scales.to(dtype), torch.ones((), dtype=dtype))
    y = (per_block / divisor[:, None]).float().clamp_(-q, q)
    if fmt == "float8_e4m3fn":
        codes = y.to(torch.float8_e4m3fn)
        values = codes.float()
        payload = codes.view(torch.uint8).flatten()[:n]
    else:
        values = y.round_()
        ints = values.to(torch.int8).flatten()[:n]
        if fmt == "int8":
            payload = ints.view(torch.uint8)
        else:
            nibbles = (ints & 0xF).view(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
            payload = nibbles[0::2] | (nibbles[1::2] << 4)
    message[: 4 * blocks].copy_(scales.view(torch.uint8))
    message[4 * blocks :].copy_(payload)
    if fold:
        sent = (values * scales[:, None]).flatten()[:n].to(dtype)
        state.add_((v - sent) * fold)


def dequantize_chain(message, n: int, fmt: str, device) -> torch.Tensor:
    blocks = -(-n // BLOCK)
    scales = message[: 4 * blocks].view(torch.float32)
    payload = message[4 * blocks :]
    if fmt == "int8":
        codes = payload.view(torch.int8).float()
    elif fmt == "int4":
        low = (payload & 0xF).view(torch.int8)
        high = (payload >> 4).view(torch.int8)
        nibbles = torch.stack([low, high], dim=1).flatten()[:n]
        codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).float()
    else:
        codes = payload.view(torch.float8_e4m3fn).float()
    return codes * scales.repeat_interleave(BLOCK)[:n]


def quantized_cases(n: int, dtype, device, buffer, w) -> list[Case]:
    """quantize_into_ (with error feedback) in int8, int4 and float8 e4m3fn, and
    absorb_quantized_ (k = 1 and 3 received messages, the de-bias) in int8 and int4. Each reads
    and writes the state once; quantize_into_ writes one message, absorb_quantized_ reads k, each
    about a quarter (int8, float8) or an eighth (int4) of float32's bytes."""
    ops = torch.ops.gossip_ext
    cases = []
    for fmt, short in (("int8", "int8"), ("int4", "int4"), ("float8_e4m3fn", "fp8")):
        size = gossip_ext._C.quantized_message_bytes(n, fmt)
        message = torch.zeros(size, dtype=torch.uint8, device=device)
        state = buffer()
        passes = 2 + size / (n * size_of(dtype))
        scale = ALPHA * w.item()

        def quantize_fused(state=state, message=message, fmt=fmt):
            ops.quantize_into_(state, message, fmt, ALPHA, w, 2.0)

        def quantize_unfused(state=state, message=message, fmt=fmt, scale=scale):
            quantize_chain(state, message, fmt, scale, 2.0 / w.item())

        cases.append(
            Case(
                f"quantize_into_ {short}",
                quantize_fused,
                quantize_unfused,
                passes,
                [state, message],
            )
        )
        if fmt == "float8_e4m3fn":
            continue
        messages = [torch.zeros_like(message) for _ in range(3)]
        for m in messages:
            ops.quantize_into_(buffer(), m, fmt, 1.0)
        for k in (1, 3):
            x = buffer()
            ws, wn = torch.full_like(w, 0.5), torch.full_like(w, 0.5 + 0.5 * k)

            def absorb_fused(x=x, ms=messages[:k], fmt=fmt, ws=ws, wn=wn):
                ops.absorb_quantized_(x, ms, fmt, ALPHA, ws, wn)

            def absorb_unfused(x=x, ms=messages[:k], fmt=fmt, k=k):
                x.mul_(0.5 * ALPHA)
                for m in ms:
                    x.add_(dequantize_chain(m, n, fmt, device).to(dtype))
                x.div_(0.5 + 0.5 * k)

            cases.append(
                Case(
                    f"absorb_quantized_ {short} k={k}",
                    absorb_fused,
                    absorb_unfused,
                    2 + k * size / (n * size_of(dtype)),
                    [x],
                )
            )
    return cases


def size_of(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()
