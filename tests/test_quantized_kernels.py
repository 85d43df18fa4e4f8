"""The block-quantized message kernels (quantize_into_, absorb_quantized_) against the plain-PyTorch
reference of tests/block_reference.py, bit for bit, on random blocks and on the blocks that
quantizers get wrong; the error feedback's bookkeeping; argument errors. The instruction sets
against each other: tests/cpp/block_kernels_test.cpp."""

import math

import block_reference as ref
import pytest
import torch

import gossip_ext  # noqa: F401  (registers the ops)
from gossip_ext._torch_check import _C

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

quantize_into_ = torch.ops.gossip_ext.quantize_into_
absorb_quantized_ = torch.ops.gossip_ext.absorb_quantized_

SIZES = [1, 2, 127, 128, 129, 1000, 70_001]  # odd sizes, partial blocks, several threads' ranges
DTYPES = [torch.float32, torch.float64]


def _blocks_of_every_kind(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random normal blocks at magnitudes from 1e-6 to 1e3, a block of zeros, a block with one
    large outlier, a block of subnormals, a block of exact int8 ties."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(numel, generator=g, dtype=torch.float64)
    blocks = -(-numel // ref.BLOCK)
    for b in range(blocks):
        lo, hi = b * ref.BLOCK, min((b + 1) * ref.BLOCK, numel)
        kind = b % 6
        if kind == 1:
            v[lo:hi] = 0.0
        elif kind == 2:
            v[lo:hi] *= 1e-3
            v[lo] = 1e4
        elif kind == 3:
            v[lo:hi] = torch.arange(hi - lo, dtype=torch.float64) * 1e-45
        elif kind == 4:
            v[lo:hi] = (torch.arange(hi - lo, dtype=torch.float64) % 255 - 127 + 0.5) / 128
            v[lo] = 127.0 / 128
        else:
            v[lo:hi] *= 10.0 ** (b % 10 - 6)
    return v.to(dtype)


def _message(numel: int, fmt: str) -> torch.Tensor:
    return torch.zeros(_C.quantized_message_bytes(numel, fmt), dtype=torch.uint8)


def test_message_size_is_the_scales_and_the_payload():
    for fmt in ref.FORMATS:
        for n in [0, *SIZES]:
            assert _C.quantized_message_bytes(n, fmt) == ref.message_bytes(n, fmt)
    # Per value of a long message: int8 0.258 and int4 0.133 of float32's 4 bytes.
    n = 1 << 20
    assert _C.quantized_message_bytes(n, "int8") / (4 * n) == pytest.approx(0.2578, abs=1e-4)
    assert _C.quantized_message_bytes(n, "int4") / (4 * n) == pytest.approx(0.1328, abs=1e-4)


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("fold", [0.0, 3.0])
def test_quantize_into_matches_reference(fmt, dtype, numel, fold):
    z = _blocks_of_every_kind(numel, dtype, seed=numel)
    w = torch.tensor([0.8], dtype=torch.float64)
    alpha, feedback = 0.25, fold
    want_message, want_z = ref.quantize_into(z, fmt, alpha * 0.8, feedback / 0.8)
    message = _message(numel, fmt)
    quantize_into_(z, message, fmt, alpha, w, feedback)
    assert torch.equal(message, want_message)
    assert torch.equal(z, want_z)


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [129, 1000, 70_001])
@pytest.mark.parametrize("with_sent", [False, True])
def test_absorb_quantized_matches_reference(fmt, dtype, numel, with_sent):
    messages = []
    for k in range(3):
        src = _blocks_of_every_kind(numel, dtype, seed=10 + k)
        m = _message(numel, fmt)
        quantize_into_(src, m, fmt, 1.0)
        messages.append(m)
    sent = messages.pop() if with_sent else None
    x = torch.randn(numel, dtype=dtype)
    self_w = torch.tensor([0.6], dtype=torch.float64)
    new_w = torch.tensor([1.7], dtype=torch.float64)
    want = ref.absorb(x, messages, fmt, 0.5 * 0.6, sent, -2.0, 1.0 / 1.7)
    flag = torch.zeros(1, dtype=torch.int32)
    absorb_quantized_(x, messages, fmt, 0.5, self_w, new_w, flag, sent, -2.0)
    assert torch.equal(x, want)
    assert flag.item() == 0


def _rounding_bound(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """How far from v (float32) its message's values may be: half a level of the block scale for
    the integer formats; half a unit of float8 e4m3's 3-bit mantissa (or of its subnormal step).
    A block whose scale underflows to 0 (every |v| < Q * 2^-150) sends zeros: its error is v."""
    q = ref.quantize(v, fmt)
    scale = q.scales.repeat_interleave(ref.BLOCK)[: v.numel()]
    if fmt == "float8_e4m3fn":
        bound = torch.maximum(v.abs() / 16, scale * 2.0**-10)
    else:
        bound = scale / 2
    return torch.where(scale > 0, bound, v.abs()) * (1 + 1e-6)


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_error_is_within_half_a_level_of_the_block_scale(fmt):
    v = _blocks_of_every_kind(10_000, torch.float32, seed=3)
    err = (v - ref.quantize(v, fmt).values).abs()
    assert bool((err <= _rounding_bound(v, fmt)).all())


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_out", [1, 2, 5])
def test_feedback_keeps_what_rounding_took_off(fmt, dtype, num_out):
    # A gossip send (Note [Compressed messages]): share p of w * z to each of k peers, self share
    # s = 1 - k p kept with feedback k / s. What the sender keeps, s * w * z_new, plus what it
    # sent, k * value, is its whole numerator w * z again, to the state's rounding.
    z = _blocks_of_every_kind(5000, dtype, seed=num_out)
    w = 0.7
    p = 1.0 / (num_out + 1)
    s = 1.0 - num_out * p
    original = z.clone()
    m = _message(z.numel(), fmt)
    quantize_into_(z, m, fmt, p, torch.tensor([w], dtype=torch.float64), num_out / s)
    sent = ref.dequantize(m, z.numel(), fmt).double()
    total = s * w * z.double() + num_out * sent
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert torch.allclose(total, w * original.double(), rtol=tol, atol=tol * 1e-3)


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_conserves_the_sum_over_many_sends(fmt, dtype):
    # A sender that carries each message's error into the next (residual = m - value, formed by
    # absorbing its own message with sent_scale -1) has sent, over T messages of a signal g, T * g
    # minus its final residual: the sum is off by one message's rounding, not by T of them.
    numel, sends = 1000, 50
    g = _blocks_of_every_kind(numel, dtype, seed=7) * 1e-2
    residual = torch.zeros(numel, dtype=dtype)
    total = torch.zeros(numel, dtype=torch.float64)
    for _ in range(sends):
        state = residual + g
        last = state.clone()
        m = _message(numel, fmt)
        quantize_into_(state, m, fmt, 1.0)
        total += ref.dequantize(m, numel, fmt).double()
        absorb_quantized_(state, [], fmt, 1.0, None, None, None, m, -1.0)
        residual = state
    want = g.double() * sends
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(total + residual.double(), want, rtol=tol, atol=tol * 1e-3)
    bound = _rounding_bound(last.float(), fmt).double()
    assert bool(((total - want).abs() <= bound + tol * want.abs() + 1e-30).all())


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_travel_as_a_nan_scale_and_keep_the_state(fmt, bad):
    z = torch.randn(300)
    z[130] = bad  # block 1
    kept = z.clone()
    m = _message(300, fmt)
    quantize_into_(z, m, fmt, 1.0, None, 2.0)
    scales = m[:12].view(torch.float32)
    assert math.isnan(scales[1].item())
    assert bool(torch.isfinite(scales[[0, 2]]).all())
    # Block 1 keeps its values (NaN included); the others take their error feedback.
    assert torch.equal(z[128:256], kept[128:256]) or bool(
        (z[128:256] == kept[128:256]).logical_or(z[128:256].isnan()).all()
    )
    x = torch.zeros(300)
    flag = torch.zeros(1, dtype=torch.int32)
    absorb_quantized_(x, [m], fmt, 1.0, None, None, flag)
    assert flag.item() == 1
    assert bool(x[128:256].isnan().all()) and bool(torch.isfinite(x[:128]).all())


def test_absorb_flags_its_own_nonfinite_state():
    m = _message(200, "int8")
    quantize_into_(torch.randn(200), m, "int8", 1.0)
    x = torch.randn(200)
    x[199] = math.inf
    flag = torch.zeros(1, dtype=torch.int32)
    absorb_quantized_(x, [m], "int8", 1.0, None, None, flag)
    assert flag.item() == 1


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_unaligned_views(fmt):
    # A state that starts one element into its storage and a message one byte into its own.
    n = 1000
    big = _blocks_of_every_kind(n + 1, torch.float32, seed=5)
    z = big[1:]
    storage = torch.zeros(_C.quantized_message_bytes(n, fmt) + 1, dtype=torch.uint8)
    m = storage[1:]
    want_message, want_z = ref.quantize_into(z.clone(), fmt, 1.0, 1.0)
    quantize_into_(z, m, fmt, 1.0, None, 1.0)
    assert torch.equal(m, want_message)
    assert torch.equal(z, want_z)
    x_storage = torch.randn(n + 1)
    x = x_storage[1:]
    want = ref.absorb(x.clone(), [m], fmt, 1.0)
    absorb_quantized_(x, [m], fmt, 1.0)
    assert torch.equal(x, want)


def test_without_feedback_the_state_is_only_read():
    z = torch.randn(500)
    kept = z.clone()
    quantize_into_(z, _message(500, "int4"), "int4", 0.5, torch.tensor([2.0]), 0.0)
    assert torch.equal(z, kept)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (
            lambda: quantize_into_(torch.zeros(10), _message(10, "int8"), "int3", 1.0),
            ValueError,
            r"format must be 'int8', 'int4' or 'float8_e4m3fn' .*got 'int3'",
        ),
        (
            lambda: quantize_into_(
                torch.zeros(10, dtype=torch.half), _message(10, "int8"), "int8", 1.0
            ),
            TypeError,
            r"src must be float32 or float64 to travel in a quantized message, got Half",
        ),
        (
            lambda: quantize_into_(torch.zeros(10), torch.zeros(14, dtype=torch.int8), "int8", 1.0),
            TypeError,
            r"out must be a uint8 tensor \(a quantized message\), got Char",
        ),
        (
            lambda: quantize_into_(torch.zeros(10), _message(11, "int8"), "int8", 1.0),
            ValueError,
            r"out has 15 bytes but a int8 message of 10 values has 14",
        ),
        (
            lambda: absorb_quantized_(torch.zeros(10), [_message(10, "int8")], "int4", 1.0),
            ValueError,
            r"received\[0\] has 14 bytes but a int4 message of 10 values has 9",
        ),
        (
            lambda: absorb_quantized_(torch.zeros(10), [], "int8", 1.0, None, None, torch.zeros(1)),
            TypeError,
            r"nonfinite must be int32",
        ),
        (
            lambda: _C.quantized_message_bytes(10, "float8"),
            ValueError,
            r"format must be 'int8', 'int4' or 'float8_e4m3fn'",
        ),
    ],
)
def test_argument_errors(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_opcheck():
    from torch.library import opcheck

    z = torch.randn(300)
    m = _message(300, "int4")
    opcheck(quantize_into_.default, (z, m, "int4", 0.5, torch.tensor([1.5]), 1.0))
    opcheck(absorb_quantized_.default, (torch.randn(300), [m, m.clone()], "int4", 0.5))
