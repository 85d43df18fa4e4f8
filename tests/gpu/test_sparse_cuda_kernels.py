"""The CUDA sparse top-k kernels (topk_encode, topk_add_into) against their CPU twins, byte for
byte and bit for bit. Skipped, visibly, where there is no GPU."""

from __future__ import annotations

import math

import pytest
import torch
from sparse_reference import tricky

import gossip_ext  # noqa: F401  (registers torch.ops.gossip_ext)

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ops = torch.ops.gossip_ext

# (numel, chunk, k): chunks of 1 and 7, short last chunks, SparseLoCo's 4096 at 1/64, density 1,
# the largest chunk (a thread's run of 128 positions), and more chunks than one grid holds.
CASES = [
    (1, 1, 1),
    (1000, 1, 1),
    (50, 7, 3),
    (50, 7, 7),
    (10_000, 4096, 64),
    (10_000, 4096, 4096),
    (9_000, 4096, 1),
    (100_000, 32768, 512),
    (4_000_003, 4096, 64),
]


@pytest.mark.parametrize("numel,chunk,k", CASES)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encode_matches_cpu_byte_for_byte(numel, chunk, k, bits, dtype):
    values = tricky(numel, dtype, seed=numel + k)
    want = ops.topk_encode(values, k, bits, chunk)
    got = ops.topk_encode(values.cuda(), k, bits, chunk)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("numel,chunk,k", CASES)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("offset", [0, 3])
def test_add_into_matches_cpu_bit_for_bit(numel, chunk, k, bits, dtype, offset):
    chunks = math.ceil(numel / chunk)
    message = ops.topk_encode(tricky(numel, dtype, seed=numel), k, bits, chunk)
    want = tricky(chunks * chunk, dtype, seed=1)
    total = want.cuda()
    # The message at `offset` bytes into a device buffer: another rank's, in a gathered one.
    buffer = torch.zeros(message.numel() + offset, dtype=torch.uint8, device="cuda")
    buffer[offset:].copy_(message)
    for _ in range(2):  # two messages into one total
        ops.topk_add_into(want, message, k, bits, chunk)
        ops.topk_add_into(total, buffer[offset:], k, bits, chunk)
    assert torch.equal(total.cpu().view(torch.uint8), want.view(torch.uint8))


def test_a_position_outside_the_chunk_is_skipped_on_the_gpu():
    message = ops.topk_encode(torch.arange(8.0), 1, 2, 4)
    message[8:10] = torch.tensor([9, 0], dtype=torch.uint8)
    total = torch.zeros(8, device="cuda")
    ops.topk_add_into(total, message.cuda(), 1, 2, 4)
    assert total[:4].abs().sum().item() == 0.0 and total[4:].abs().sum().item() > 0


def test_the_sparse_mean_on_the_gpu_equals_the_cpu():
    from gossip_ext.averagings.sparse import TopK, _Codec

    f = TopK(density=1 / 64, bits=2)
    values = tricky(442_000, torch.float32, seed=5)
    codec = _Codec(f, values.numel())
    totals = [torch.zeros(codec.chunks, f.chunk, device=d) for d in ("cpu", "cuda")]
    for total in totals:
        codec.add_into(total, codec.encode(values.to(total.device)))
    assert torch.equal(totals[1].cpu(), totals[0])
