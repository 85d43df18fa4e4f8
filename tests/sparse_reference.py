"""Sparse top-k messages in plain PyTorch: the independent reference of the topk_encode and
topk_add_into kernels (Note [Sparse top-k messages] in csrc/kernels/sparse_topk.h), written from
the format's definition with torch's own ops: a stable sort picks each chunk's k largest
magnitudes (the lower position first among equals), torch rounds the codes (ties to even), and
scatter_add_ adds the decoded values."""

from __future__ import annotations

import math

import torch


def message_bytes(numel: int, k: int, bits: int, chunk: int) -> int:
    chunks = math.ceil(numel / chunk)
    return chunks * (4 + 2 * k) + math.ceil(chunks * k * bits / 8)


def encode(values: torch.Tensor, k: int, bits: int, chunk: int) -> torch.Tensor:
    """The message of ``values`` (float32 or float64, read flat)."""
    values = values.reshape(-1)
    chunks = math.ceil(values.numel() / chunk)
    levels = 2**bits - 1
    padded = values.new_zeros(chunks * chunk)
    padded[: values.numel()] = values
    rows = padded.view(chunks, chunk)
    # Stable: among equal magnitudes the lower position comes first (and NaN above everything).
    order = rows.abs().sort(dim=1, descending=True, stable=True).indices
    positions = order[:, :k].sort(dim=1).values
    kept = rows.gather(1, positions)
    scale = kept.abs().amax(dim=1, keepdim=True).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(values.dtype)
    codes = ((kept / safe + 1) * (levels / 2)).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8).reshape(-1)
    return torch.cat(
        [
            scale.reshape(-1).view(torch.uint8),
            positions.to(torch.int16).reshape(-1).view(torch.uint8),
            pack(codes, bits),
        ]
    )


def decode(message: torch.Tensor, chunks: int, k: int, bits: int):
    """(scale per chunk, positions, codes) of a message, each with a row per chunk."""
    message = message.clone()  # aligned for the views
    scale_end = 4 * chunks
    positions_end = scale_end + 2 * chunks * k
    scale = message[:scale_end].view(torch.float32).view(chunks, 1)
    positions = message[scale_end:positions_end].view(torch.int16).view(chunks, k)
    codes = unpack(message[positions_end:], chunks * k, bits).view(chunks, k)
    return scale, positions.long(), codes


def add_into(total: torch.Tensor, message: torch.Tensor, k: int, bits: int, chunk: int) -> None:
    """``total`` (chunks rows of ``chunk``) += the message's values."""
    rows = total.view(-1, chunk)
    scale, positions, codes = decode(message, rows.shape[0], k, bits)
    levels = 2**bits - 1
    values = (codes.to(total.dtype) * (2 / levels) - 1) * scale.to(total.dtype)
    rows.scatter_add_(1, positions, values)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    padded = codes.new_zeros(math.ceil(codes.numel() / per_byte) * per_byte)
    padded[: codes.numel()] = codes
    lanes = padded.view(-1, per_byte)
    packed = torch.zeros_like(lanes[:, 0])
    for lane in range(per_byte):
        packed |= lanes[:, lane] << (lane * bits)
    return packed


def unpack(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    mask = 2**bits - 1
    lanes = [(packed >> (lane * bits)) & mask for lane in range(8 // bits)]
    return torch.stack(lanes, dim=1).reshape(-1)[:count]


def tricky(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values, a third of them zero or negative zero, many repeated magnitudes (of either
    sign), a few values a tie apart from the largest: what the kernels' selection must order the
    same way as the reference (test_sparse_kernels.py, gpu/test_sparse_cuda_kernels.py)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(numel, generator=g, dtype=torch.float64)
    pick = torch.randint(0, 6, (numel,), generator=g)
    v[pick == 0] = 0.0
    v[pick == 1] = -0.0
    v[pick == 2] = torch.randint(-3, 4, (int((pick == 2).sum()),), generator=g).double() / 2
    return v.to(dtype)


def carried(v: torch.Tensor, f) -> torch.Tensor:
    """What a TopK message of the flat vector ``v`` carries, decoded (``f``: a gossip_ext.TopK),
    written from its definition: the ``k`` largest magnitudes of every chunk, each rounded to
    the nearest of ``2^bits`` levels evenly from ``-scale`` to ``scale``, ``scale`` the chunk's
    largest kept magnitude."""
    chunks = math.ceil(v.numel() / f.chunk)
    padded = torch.zeros(chunks * f.chunk, dtype=v.dtype)
    padded[: v.numel()] = v
    out = torch.zeros_like(padded)
    levels = 2**f.bits - 1
    for c in range(chunks):
        piece = padded[c * f.chunk : (c + 1) * f.chunk]
        kept = piece.abs().topk(f.k).indices
        scale = float(piece[kept].abs().max().to(torch.float32))
        for i in kept.tolist():
            code = min(max(round((float(piece[i]) / scale + 1) * levels / 2), 0), levels)
            out[c * f.chunk + i] = (code * 2 / levels - 1) * scale
    return out[: v.numel()]
