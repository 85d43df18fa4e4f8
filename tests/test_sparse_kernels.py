"""The compiled sparse top-k kernels (torch.ops.gossip_ext.topk_encode, topk_add_into) against
the plain-PyTorch reference of the same format (tests/sparse_reference.py), byte for byte and bit
for bit, on data full of what a selection gets wrong: ties, zeros, a short last chunk; and the
errors that name the bad argument."""

from __future__ import annotations

import math

import pytest
import sparse_reference as reference
import torch
from sparse_reference import tricky

import gossip_ext  # noqa: F401  (registers torch.ops.gossip_ext)
from gossip_ext.averagings.sparse import TopK, _Codec

pytestmark = pytest.mark.extension

ops = torch.ops.gossip_ext


# (numel, chunk, k): chunks of 1 and 7, a short last chunk, SparseLoCo's 4096 at 1/64 and at
# density 1 (every value kept), k not a multiple of the codes a byte (codes of two chunks share a
# byte).
CASES = [
    (1, 1, 1),
    (10, 1, 1),
    (50, 7, 1),
    (50, 7, 3),
    (50, 7, 7),
    (100, 16, 2),
    (10_000, 4096, 64),
    (10_000, 4096, 4096),
    (9_000, 4096, 1),
    (4096, 4096, 63),
]


@pytest.mark.parametrize("numel,chunk,k", CASES)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encode_and_add_into_equal_the_reference(numel, chunk, k, bits, dtype):
    values = tricky(numel, dtype, seed=numel + k)
    message = ops.topk_encode(values, k, bits, chunk)
    want = reference.encode(values, k, bits, chunk)
    assert message.dtype == torch.uint8
    assert message.numel() == reference.message_bytes(numel, k, bits, chunk)
    assert torch.equal(message, want)

    chunks = math.ceil(numel / chunk)
    total = tricky(chunks * chunk, dtype, seed=1).view(chunks, chunk)
    expected = total.clone()
    ops.topk_add_into(total, message, k, bits, chunk)
    reference.add_into(expected, want, k, bits, chunk)
    assert torch.equal(total.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_keep_the_lower_positions_in_ascending_order(dtype):
    # Every magnitude equal: the first k positions of every chunk, whatever their signs.
    values = torch.tensor([1.0, -1.0] * 12, dtype=dtype)
    scale, positions, codes = reference.decode(ops.topk_encode(values, 5, 2, 8), 3, 5, 2)
    assert positions.tolist() == [[0, 1, 2, 3, 4]] * 3
    assert scale.view(-1).tolist() == [1.0] * 3
    assert codes.tolist() == [[3, 0, 3, 0, 3], [3, 0, 3, 0, 3], [3, 0, 3, 0, 3]]
    # One larger value, then ties for the rest: the larger wins, then the lowest positions.
    values = torch.tensor([0.5, 0.5, -0.5, 2.0, 0.5, 0.5], dtype=dtype)
    _, positions, _ = reference.decode(ops.topk_encode(values, 3, 4, 6), 1, 3, 4)
    assert positions.tolist() == [[0, 1, 3]]


def test_a_chunk_of_zeros_has_scale_zero_and_adds_nothing():
    message = ops.topk_encode(torch.zeros(10), 2, 2, 5)
    scale, positions, codes = reference.decode(message, 2, 2, 2)
    assert scale.view(-1).tolist() == [0.0, 0.0]
    assert positions.tolist() == [[0, 1], [0, 1]]
    total = torch.zeros(10)
    ops.topk_add_into(total, message, 2, 2, 5)
    # Code round(1.5) = 2, decoded (2 * 2/3 - 1) * 0 = 0.
    assert total.abs().sum().item() == 0.0 and codes.tolist() == [[2, 2], [2, 2]]


def test_a_float64_scale_is_rounded_to_float32_and_codes_clamp():
    # 1 + 2^-40 rounds to 1.0 in float32: the value sits above the scale and its code clamps.
    values = torch.tensor([1 + 2**-40, -0.25], dtype=torch.float64)
    message = ops.topk_encode(values, 2, 4, 2)
    assert torch.equal(message, reference.encode(values, 2, 4, 2))
    scale, _, codes = reference.decode(message, 1, 2, 4)
    assert scale.item() == 1.0 and codes[0, 0].item() == 15


def test_a_message_at_any_byte_offset_decodes_alike():
    values = tricky(1000, torch.float32)
    message = ops.topk_encode(values, 5, 2, 64)
    buffer = torch.zeros(message.numel() + 3, dtype=torch.uint8)
    buffer[3:] = message
    a, b = torch.zeros(16, 64), torch.zeros(16, 64)
    ops.topk_add_into(a, message, 5, 2, 64)
    ops.topk_add_into(b, buffer[3:], 5, 2, 64)
    assert torch.equal(a, b)


def test_an_empty_tensor_has_an_empty_message():
    assert ops.topk_encode(torch.zeros(0), 1, 2, 16).numel() == 0
    ops.topk_add_into(torch.zeros(0), torch.zeros(0, dtype=torch.uint8), 1, 2, 16)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_codec_sends_what_the_reference_sends(bits):
    f = TopK(density=1 / 64, bits=bits, chunk=4096)
    values = tricky(20_000, torch.float32, seed=3)
    codec = _Codec(f, values.numel())
    message = codec.encode(values)
    assert message.numel() == codec.bytes
    assert torch.equal(message, reference.encode(values, f.k, bits, f.chunk))


def test_the_meta_kernels_give_the_message_size():
    values = torch.empty(10_000, device="meta")
    assert ops.topk_encode(values, 64, 2, 4096).shape == (3 * (4 + 128) + 48,)
    ops.topk_add_into(
        torch.empty(3 * 4096, device="meta"),
        torch.empty(3 * (4 + 128) + 48, dtype=torch.uint8, device="meta"),
        64,
        2,
        4096,
    )


def _floats(n, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype)


def _bytes(n):
    return torch.zeros(n, dtype=torch.uint8)


BAD_ARGUMENTS = [
    ("topk_encode", (_floats(8), 2, 3, 4), ValueError, "bits must be 2 or 4, got 3"),
    ("topk_encode", (_floats(8), 5, 2, 4), ValueError, r"k must be in \[1, chunk=4\], got 5"),
    ("topk_encode", (_floats(8), 0, 2, 4), ValueError, "k must be .*, got 0"),
    ("topk_encode", (_floats(8), 1, 2, 40000), ValueError, "chunk must be .*, got 40000"),
    (
        "topk_encode",
        (_floats(8, torch.float16), 1, 2, 4),
        TypeError,
        "values must be float32 or float64, got Half",
    ),
    ("topk_encode", (_floats(16).view(8, 2).t(), 1, 2, 4), ValueError, "values must be contiguous"),
    (
        "topk_add_into",
        (_floats(10), _bytes(1), 1, 2, 4),
        ValueError,
        "total has 10 values, not a whole number of chunks of chunk=4",
    ),
    ("topk_add_into", (_floats(8), _floats(13), 1, 2, 4), TypeError, "message must be a uint8"),
    (
        "topk_add_into",
        (_floats(8), _bytes(14), 1, 2, 4),
        ValueError,
        "message has 14 bytes but a message of 2 chunks of k=1 codes of bits=2 has 13",
    ),
    (
        "topk_add_into",
        (_floats(8, torch.int32), _bytes(13), 1, 2, 4),
        TypeError,
        "total must be float32 or float64, got Int",
    ),
]


@pytest.mark.parametrize("op,args,error,match", BAD_ARGUMENTS)
def test_bad_arguments_are_named_with_their_values(op, args, error, match):
    with pytest.raises(error, match=match):
        getattr(ops, op)(*args)


def test_a_position_outside_the_chunk_is_refused_and_nothing_is_added():
    message = ops.topk_encode(torch.arange(8.0), 1, 2, 4)
    message[8:10] = torch.tensor([9, 0], dtype=torch.uint8)  # chunk 0's position: 9
    total = torch.zeros(8)
    with pytest.raises(ValueError, match=r"position 9 in chunk 0, outside \[0, chunk=4\)"):
        ops.topk_add_into(total, message, 1, 2, 4)
    assert total.abs().sum().item() == 0.0
