"""torch.ops.gossip_ext.scale_into and absorb_ against plain-PyTorch references computed in fp64."""

import pytest
import torch
from torch.library import opcheck

import gossip_ext  # noqa: F401  (registers torch.ops.gossip_ext)

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

scale_into = torch.ops.gossip_ext.scale_into
absorb_ = torch.ops.gossip_ext.absorb_
compress_into_ = torch.ops.gossip_ext.compress_into_

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Sizes around the CPU kernels' block (512) and parallel grain (32768 elements).
SIZES = [1, 7, 1023, 70001]
# (rtol, atol) against the fp64 reference: one rounding to the storage dtype, fp32 accumulation
# for 16-bit types, values of magnitude a few units.
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-6, 2e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _randn(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, dtype=torch.float64, generator=generator).to(dtype)


def _weight(value: float, dtype) -> torch.Tensor | None:
    return None if dtype is None else torch.tensor([value], dtype=dtype)


def _value(weight: torch.Tensor | None) -> float:
    return 1.0 if weight is None else weight.item()


def reference_scale_into(src, alpha, weight) -> torch.Tensor:
    return (alpha * _value(weight)) * src.to(torch.float64)


def reference_absorb(x, received, alpha, self_weight, new_weight) -> torch.Tensor:
    acc = alpha * _value(self_weight) * x.to(torch.float64)
    for r in received:
        acc = acc + r.to(torch.float64)
    return acc / _value(new_weight)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "weight_dtype",
    [None, torch.float32, torch.float64],
    ids=lambda d: "noweight" if d is None else f"w{_name(d)}",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_scale_into_matches_reference(numel, dtype, weight_dtype):
    src = _randn(numel, dtype, seed=numel)
    src_before = src.clone()
    out = torch.full((numel,), float("nan"), dtype=dtype)
    weight = _weight(0.7, weight_dtype)
    alpha = 1.0 / 3.0
    scale_into(src, out, alpha, weight)
    _assert_close(out, reference_scale_into(src, alpha, weight), dtype)
    assert torch.equal(src, src_before)
    if weight is not None:
        assert weight.item() == torch.tensor(0.7, dtype=weight_dtype).item()


def test_scale_into_identity_is_exact():
    # alpha = 1 and no weight: a plain copy, bit for bit, in every dtype.
    for dtype in DTYPES:
        src = _randn(1023, dtype, seed=3)
        out = torch.empty_like(src)
        scale_into(src, out, 1.0)
        assert torch.equal(out, src), dtype


@pytest.mark.parametrize(
    "weights",
    [
        (None, None),
        (torch.float32, None),
        (None, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.float32, torch.float64),
    ],
    ids=lambda w: "-".join("none" if d is None else _name(d) for d in w),
)
@pytest.mark.parametrize("num_received", [0, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_absorb_matches_reference(numel, dtype, num_received, weights):
    x = _randn(numel, dtype, seed=numel)
    x_before = x.clone()
    received = [_randn(numel, dtype, seed=100 + numel + j) for j in range(num_received)]
    received_before = [r.clone() for r in received]
    self_weight = _weight(0.7, weights[0])
    new_weight = _weight(1.3, weights[1])
    alpha = 0.6
    absorb_(x, received, alpha, self_weight, new_weight)
    expected = reference_absorb(x_before, received_before, alpha, self_weight, new_weight)
    _assert_close(x, expected, dtype)
    for r, before in zip(received, received_before):
        assert torch.equal(r, before)


def test_absorb_keyword_arguments_and_scalar_weights():
    x = _randn(129, torch.float64, seed=1)
    expected_input = x.clone()
    received = [_randn(129, torch.float64, seed=2)]
    # Zero-dimensional weights hold one element too.
    sw = torch.tensor(0.25, dtype=torch.float64)
    nw = torch.tensor(2.0, dtype=torch.float32)
    absorb_(x, received, alpha=1.0, self_weight=sw, new_weight=nw)
    expected = reference_absorb(expected_input, received, 1.0, sw, nw)
    torch.testing.assert_close(x, expected, rtol=1e-14, atol=1e-14)


def test_contiguous_buffers_of_any_shape_are_flat():
    src = _randn(15, torch.float32, seed=4).reshape(3, 5)
    out = torch.empty(15, dtype=torch.float32)
    scale_into(src, out, 2.0)
    torch.testing.assert_close(out, 2.0 * src.reshape(-1), rtol=0, atol=0)
    x = torch.ones(15, dtype=torch.float32)
    absorb_(x, [src], 0.5)
    torch.testing.assert_close(x, 0.5 + src.reshape(-1), rtol=0, atol=0)


def test_absorb_16bit_accumulates_in_float32():
    # 1 + 4 * 2^-12 is 1 in float16 if each addition rounds to float16 (half an ulp each time),
    # but 1 + 2^-10 (exactly representable) when the sum is accumulated in float32.
    x = torch.ones(8, dtype=torch.float16)
    tiny = torch.full((8,), 2.0**-12, dtype=torch.float16)
    absorb_(x, [tiny, tiny, tiny, tiny], 1.0)
    assert torch.equal(x, torch.full((8,), 1 + 2.0**-10, dtype=torch.float16))


# --- argument errors ---------------------------------------------------------------------------


def _f32(numel: int = 7) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (
            (_f32(), _f32().double(), 1.0),
            ValueError,
            r"gossip_ext: out has dtype Double but expected Float",
        ),
        ((_f32(), _f32(6), 1.0), ValueError, r"gossip_ext: out has 6 elements but expected 7"),
        (
            (_f32(), torch.empty(7, device="meta"), 1.0),
            ValueError,
            r"gossip_ext: out is on meta but expected cpu",
        ),
        ((_f32(14)[::2], _f32(), 1.0), ValueError, r"gossip_ext: src must be contiguous"),
        ((_f32(), _f32(14)[::2], 1.0), ValueError, r"gossip_ext: out must be contiguous"),
        (
            (torch.zeros(7, dtype=torch.int32), torch.zeros(7, dtype=torch.int32), 1.0),
            TypeError,
            r"gossip_ext: src must be float32, float64, float16 or bfloat16, got Int",
        ),
        (
            (torch.zeros(7, dtype=torch.complex64), _f32(), 1.0),
            TypeError,
            r"gossip_ext: src must be float32, float64, float16 or bfloat16, got ComplexFloat",
        ),
        (
            (_f32(), _f32(), 1.0, torch.ones(2)),
            ValueError,
            r"gossip_ext: weight must have one element, got 2",
        ),
        (
            (_f32(), _f32(), 1.0, torch.ones(0)),
            ValueError,
            r"gossip_ext: weight must have one element, got 0",
        ),
        (
            (_f32(), _f32(), 1.0, torch.ones(1, dtype=torch.float16)),
            TypeError,
            r"gossip_ext: weight must be float32 or float64, got Half",
        ),
        (
            (_f32(), _f32(), 1.0, torch.ones(1, dtype=torch.int64)),
            TypeError,
            r"gossip_ext: weight must be float32 or float64, got Long",
        ),
        (
            (_f32(), _f32(), 1.0, torch.ones(1, device="meta")),
            ValueError,
            r"gossip_ext: weight is on meta but the buffers are on cpu",
        ),
    ],
    ids=lambda v: None,
)
def test_scale_into_argument_errors(args, error, pattern):
    with pytest.raises(error, match=pattern):
        scale_into(*args)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (
            (torch.zeros(7, dtype=torch.int64), [], 1.0),
            TypeError,
            r"gossip_ext: x must be float32, float64, float16 or bfloat16, got Long",
        ),
        ((_f32(14)[::2], [], 1.0), ValueError, r"gossip_ext: x must be contiguous"),
        (
            (_f32(), [_f32(), _f32().double()], 1.0),
            ValueError,
            r"gossip_ext: received\[.*\] has dtype Double but expected Float",
        ),
        (
            (_f32(), [_f32(8)], 1.0),
            ValueError,
            r"gossip_ext: received\[.*\] has 8 elements but expected 7",
        ),
        (
            (_f32(), [torch.empty(7, device="meta")], 1.0),
            ValueError,
            r"gossip_ext: received\[.*\] is on meta but expected cpu",
        ),
        (
            (_f32(), [_f32(14)[::2]], 1.0),
            ValueError,
            r"gossip_ext: received\[.*\] must be contiguous",
        ),
        (
            (_f32(), [], 1.0, torch.ones(2)),
            ValueError,
            r"gossip_ext: self_weight must have one element, got 2",
        ),
        (
            (_f32(), [], 1.0, None, torch.ones(2)),
            ValueError,
            r"gossip_ext: new_weight must have one element, got 2",
        ),
        (
            (_f32(), [], 1.0, None, torch.ones(1, dtype=torch.bfloat16)),
            TypeError,
            r"gossip_ext: new_weight must be float32 or float64, got BFloat16",
        ),
        (
            (_f32(), [], 1.0, torch.ones(1, device="meta")),
            ValueError,
            r"gossip_ext: self_weight is on meta but the buffers are on cpu",
        ),
    ],
    ids=lambda v: None,
)
def test_absorb_argument_errors(args, error, pattern):
    x_before = args[0].clone()
    with pytest.raises(error, match=pattern):
        absorb_(*args)
    if args[0].device.type == "cpu" and args[0].is_contiguous():
        assert torch.equal(args[0], x_before)  # nothing written before the checks failed


# --- non-finite flag ---------------------------------------------------------------------------


def _flag(value: int = 0) -> torch.Tensor:
    return torch.full((1,), value, dtype=torch.int32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["x", "received[0]", "received[2]"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_absorb_flags_every_nonfinite_value_it_reads(numel, dtype, where, bad):
    # The last element sits in the scalar tail, the first in the first block, the middle in
    # another thread's range for the large size.
    for position in sorted({0, numel // 2, numel - 1}):
        x = _randn(numel, dtype, seed=numel)
        received = [_randn(numel, dtype, seed=200 + j) for j in range(3)]
        target = x if where == "x" else received[int(where[-2])]
        target[position] = bad
        flag = _flag()
        absorb_(x, received, 0.5, None, None, flag)
        assert flag.item() == 1, f"{where}[{position}] = {bad} was not flagged"


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_absorb_with_flag_is_bitwise_the_same_op_on_finite_values(numel, dtype):
    x = _randn(numel, dtype, seed=numel)
    received = [_randn(numel, dtype, seed=300 + j) for j in range(3)]
    # Extremes of the dtype are still finite.
    received[0][0] = torch.finfo(dtype).max
    received[1][0] = -torch.finfo(dtype).max
    received[2][-1] = torch.finfo(dtype).tiny
    unchecked = x.clone()
    absorb_(unchecked, received, 0.5, _weight(0.7, torch.float64), _weight(1.3, torch.float64))
    flag = _flag()
    absorb_(x, received, 0.5, _weight(0.7, torch.float64), _weight(1.3, torch.float64), flag)
    assert flag.item() == 0
    assert torch.equal(x, unchecked)


def test_absorb_never_clears_the_flag():
    # One flag covers every dtype group of a round: a later clean call must not reset it.
    flag = _flag(1)
    absorb_(
        _randn(7, torch.float32, seed=1), [_randn(7, torch.float32, seed=2)], 1.0, None, None, flag
    )
    assert flag.item() == 1


@pytest.mark.parametrize(
    "flag, error, pattern",
    [
        (torch.zeros(1, dtype=torch.int64), TypeError, r"nonfinite must be int32, got Long"),
        (torch.zeros(1, dtype=torch.bool), TypeError, r"nonfinite must be int32, got Bool"),
        (torch.zeros(2, dtype=torch.int32), ValueError, r"nonfinite must have one element, got 2"),
        (
            torch.zeros(1, dtype=torch.int32, device="meta"),
            ValueError,
            r"nonfinite is on meta but the buffers are on cpu",
        ),
    ],
    ids=["int64", "bool", "two-elements", "meta"],
)
def test_absorb_nonfinite_argument_errors(flag, error, pattern):
    with pytest.raises(error, match=f"gossip_ext: {pattern}"):
        absorb_(_f32(), [_f32()], 1.0, None, None, flag)


# --- compressed messages -----------------------------------------------------------------------

MESSAGE_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_compress_into_rounds_the_message_and_keeps_the_error(
    numel, dtype, message_dtype, weight_dtype
):
    # A node with k = 3 out-peers and uniform shares 1/4: it keeps 1/4 and sends 1/4 to each.
    k, share = 3, 0.25
    z = _randn(numel, dtype, seed=numel)
    z_before = z.clone()
    w = _weight(0.8, weight_dtype)
    message = torch.empty(numel, dtype=message_dtype)
    compress_into_(z, message, share, w, k / share)
    exact = share * _value(w) * z_before.to(torch.float64)
    # The message is the exact value rounded once to 16 bits (from the state's opmath).
    expected = (share * _value(w) * z_before).to(message_dtype)
    assert torch.equal(message, expected)
    # Kept numerator (share * w * z) plus the k copies sent is the sender's whole numerator.
    total = share * _value(w) * z.to(torch.float64) + k * message.to(torch.float64)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(total, _value(w) * z_before.to(torch.float64), rtol=rtol, atol=atol)
    # And the state moved by exactly what rounding took off, scaled back to the kept share.
    moved = z.to(torch.float64) - z_before.to(torch.float64)
    torch.testing.assert_close(
        moved, (k / share) * (exact - message.to(torch.float64)) / _value(w), rtol=1e-3, atol=atol
    )


@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_absorb_compressed_messages_matches_reference(numel, dtype, message_dtype):
    x = _randn(numel, dtype, seed=numel)
    x_before = x.clone()
    received = [_randn(numel, message_dtype, seed=400 + j) for j in range(3)]
    flag = _flag()
    absorb_(x, received, 0.6, _weight(0.7, torch.float64), _weight(1.3, torch.float64), flag)
    expected = reference_absorb(
        x_before, received, 0.6, _weight(0.7, torch.float64), _weight(1.3, torch.float64)
    )
    _assert_close(x, expected, dtype)
    assert flag.item() == 0
    received[1][numel // 2] = float("nan")
    absorb_(x, received, 1.0, None, None, flag)
    assert flag.item() == 1


@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_compress_into_without_feedback_only_reads_the_state(numel, dtype, message_dtype):
    z = _randn(numel, dtype, seed=numel)
    z_before = z.clone()
    message = torch.empty(numel, dtype=message_dtype)
    compress_into_(z, message, 0.25, _weight(0.8, torch.float64), 0.0)
    assert torch.equal(z, z_before)
    assert torch.equal(message, (0.25 * 0.8 * z_before).to(message_dtype))


@pytest.mark.parametrize("num_received", [0, 1, 3])
@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES, ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_name)
@pytest.mark.parametrize("numel", SIZES)
def test_absorb_folds_the_sent_message(numel, dtype, message_dtype, num_received):
    # The synchronous compressed absorb: x = (w * z - k * q + sum(received)) / w_new, where q is
    # what this node sent to each of its k peers (Note [Compressed messages]).
    k = 2
    x = _randn(numel, dtype, seed=numel)
    x_before = x.clone()
    received = [_randn(numel, message_dtype, seed=500 + j) for j in range(num_received)]
    sent = (0.3 * x_before).to(message_dtype)
    self_weight, new_weight = _weight(0.9, torch.float64), _weight(1.4, torch.float64)
    flag = _flag()
    absorb_(x, received, 1.0, self_weight, new_weight, flag, sent, -float(k))
    expected = (
        0.9 * x_before.double()
        + sum((r.double() for r in received), torch.zeros(numel, dtype=torch.float64))
        - k * sent.double()
    ) / 1.4
    _assert_close(x, expected, dtype)
    assert flag.item() == 0
    if numel > 0:
        sent[numel - 1] = float("inf")  # the node's own message is checked too
        absorb_(x, received, 1.0, None, None, flag, sent, -float(k))
        assert flag.item() == 1


def test_absorb_sent_must_be_a_message_of_the_others_dtype():
    with pytest.raises(ValueError, match=r"sent has dtype Half but the other messages have"):
        absorb_(_f32(), [_f32().bfloat16()], 1.0, None, None, None, _f32().half(), -1.0)
    with pytest.raises(ValueError, match=r"sent has 6 elements but expected 7"):
        absorb_(_f32(), [], 1.0, None, None, None, torch.zeros(6, dtype=torch.bfloat16), -1.0)


@pytest.mark.parametrize(
    "args, error, pattern",
    [
        (
            (_f32(), _f32(), 0.5),
            TypeError,
            r"gossip_ext: out must be float16 or bfloat16, got Float",
        ),
        (
            (_f32().half(), _f32().bfloat16(), 0.5),
            TypeError,
            r"gossip_ext: src must be float32 or float64 to be compressed, got Half",
        ),
        (
            (_f32(), torch.zeros(6, dtype=torch.bfloat16), 0.5),
            ValueError,
            r"gossip_ext: out has 6 elements but expected 7",
        ),
        (
            (_f32(), torch.zeros(7, dtype=torch.bfloat16), 0.5, torch.ones(2)),
            ValueError,
            r"gossip_ext: weight must have one element, got 2",
        ),
    ],
    ids=["full-precision-out", "16bit-src", "size", "weight"],
)
def test_compress_into_argument_errors(args, error, pattern):
    with pytest.raises(error, match=pattern):
        compress_into_(*args)


def test_absorb_refuses_mixed_or_unrelated_message_dtypes():
    with pytest.raises(ValueError, match=r"received\[1\] has dtype Half but the other messages"):
        absorb_(_f32(), [_f32().bfloat16(), _f32().half()], 1.0)
    with pytest.raises(ValueError, match=r"received\[0\] has dtype BFloat16 but expected Half"):
        absorb_(_f32().half(), [_f32().bfloat16()], 1.0)


# --- opcheck -----------------------------------------------------------------------------------

# opcheck's default set, one at a time so that a failure names the sub-test. Every input below is
# a plain tensor that does not require grad (the ops have no autograd formula by design: gossip
# runs under no_grad).
OPCHECK_UTILS = [
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_static",
    "test_aot_dispatch_dynamic",
]


def _scale_into_samples():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        src = _randn(33, dtype, seed=5)
        yield (src, torch.empty_like(src), 0.5)
        yield (src, torch.empty_like(src), 0.5, torch.tensor([0.75]))
        yield (src, torch.empty_like(src), 2.0, torch.tensor([0.75], dtype=torch.float64))


def _compress_into_samples():
    for dtype in (torch.float32, torch.float64):
        for message_dtype in MESSAGE_DTYPES:
            src = _randn(33, dtype, seed=8)
            out = torch.empty(33, dtype=message_dtype)
            yield (src, out, 0.5)
            yield (src, out, 0.25, torch.tensor([0.75], dtype=torch.float64), 12.0)


def _absorb_samples():
    for dtype in (torch.float32, torch.float64, torch.float16):
        received = [_randn(33, dtype, seed=7 + j) for j in range(3)]
        yield (_randn(33, dtype, seed=6), [], 0.5)
        yield (_randn(33, dtype, seed=6), received[:1], 0.5)
        yield (_randn(33, dtype, seed=6), received, 1.0, torch.tensor([0.7]), torch.tensor([1.3]))
        yield (
            _randn(33, dtype, seed=6),
            received,
            1.0,
            None,
            torch.tensor([2.0], dtype=torch.float64),
        )
        yield (
            _randn(33, dtype, seed=6),
            received,
            0.5,
            None,
            None,
            torch.zeros(1, dtype=torch.int32),
        )
    received = [_randn(33, torch.bfloat16, seed=9 + j) for j in range(2)]
    sent = _randn(33, torch.bfloat16, seed=8)
    yield (_randn(33, torch.float32, seed=6), received, 1.0, None, None, None, sent, -2.0)


@pytest.mark.parametrize("test_util", OPCHECK_UTILS)
def test_opcheck_scale_into(test_util):
    for args in _scale_into_samples():
        opcheck(scale_into.default, args, test_utils=test_util)


@pytest.mark.parametrize("test_util", OPCHECK_UTILS)
def test_opcheck_compress_into(test_util):
    for args in _compress_into_samples():
        opcheck(compress_into_.default, args, test_utils=test_util)


@pytest.mark.parametrize("test_util", OPCHECK_UTILS)
def test_opcheck_absorb(test_util):
    for args in _absorb_samples():
        opcheck(absorb_.default, args, test_utils=test_util)
