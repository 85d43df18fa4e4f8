"""The CUDA kernels against their CPU twins. Skipped, visibly, where there is no GPU."""

import time

import pytest
import torch

import gossip_ext  # noqa: F401  (registers torch.ops.gossip_ext)

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1023, 70001, (1 << 20) + 3]
TOLERANCE = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _random(n, dtype, offset=0):
    # On the CPU: the oracle's input. Its GPU twin is made with _device_view(t, offset).
    return torch.randn(n + offset, dtype=torch.float64)[offset:].to(dtype)


def _device_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t`` copied to the GPU at ``offset`` elements into a larger device buffer: with offset 1
    the view is not 16-byte aligned on the device (copying an offset CPU view realigns it)."""
    buffer = torch.empty(t.numel() + offset, dtype=t.dtype, device="cuda")
    view = buffer[offset:]
    view.copy_(t)
    return view


def _weight(value, dtype):
    return torch.tensor([value], dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("weight_dtype", [None, torch.float32, torch.float64])
def test_scale_into_matches_cpu(dtype, n, offset, weight_dtype):
    src = _random(n, dtype, offset)
    weight = None if weight_dtype is None else _weight(0.7, weight_dtype)
    want = torch.empty_like(src)
    torch.ops.gossip_ext.scale_into(src, want, 0.25, weight)
    out = _device_view(torch.empty_like(src), offset)
    cuda_weight = None if weight is None else weight.cuda()
    torch.ops.gossip_ext.scale_into(_device_view(src, offset), out, 0.25, cuda_weight)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("num_received", [0, 1, 3, 8, 11])  # 11: more than one launch
@pytest.mark.parametrize("weighted", [False, True])
def test_absorb_matches_cpu(dtype, n, offset, num_received, weighted):
    x = _random(n, dtype, offset)
    received = [_random(n, dtype, offset) for _ in range(num_received)]
    self_weight = _weight(0.4, torch.float32) if weighted else None
    new_weight = _weight(0.4 + 0.3 * num_received, torch.float64) if weighted else None
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 0.5, self_weight, new_weight)
    got = _device_view(x, offset)
    torch.ops.gossip_ext.absorb_(
        got,
        [_device_view(r, offset) for r in received],
        0.5,
        None if self_weight is None else self_weight.cuda(),
        None if new_weight is None else new_weight.cuda(),
    )
    tol = TOLERANCE[dtype] * (num_received + 1)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


# Each op on a side stream held busy by a sleeping kernel: run on the current stream, it waits
# behind the sleep; run on any other stream, its result shows before the side stream is done.
# CUDA loads kernels lazily: the first launch of any kernel (the op's, the sleep's, the test's
# own comparison) synchronizes the whole context, which would wait out the sleep and hide where
# the op ran. Every kernel is launched once before the check. The op must also return to the host
# at once: a host synchronization inside it is a defect of its own.
STREAM_OPS = {
    "scale_into": lambda x, r: torch.ops.gossip_ext.scale_into(r, x, 1.5),
    "absorb_": lambda x, r: torch.ops.gossip_ext.absorb_(x, [r], 0.5),
    "compress_into_": lambda x, r: torch.ops.gossip_ext.compress_into_(r, x, 1.5),
}
HOST_RETURN_S = 0.1  # the sleep holds the side stream for about a second


def _launch_each_kernel_once(op: str, x: torch.Tensor, r: torch.Tensor) -> None:
    scratch = x.clone()
    torch.cuda._sleep(1)
    STREAM_OPS[op](scratch, r.clone())
    torch.all(scratch == 1.0).item()
    torch.cuda.synchronize()


@pytest.mark.parametrize("op", sorted(STREAM_OPS))
def test_kernels_run_on_the_current_stream_and_return_at_once(op):
    # compress_into_ writes a bfloat16 message from a float32 source; the others work in place.
    dtype = torch.bfloat16 if op == "compress_into_" else torch.float32
    x = torch.ones(1 << 20, dtype=dtype, device="cuda")
    r = torch.ones(1 << 20, device="cuda")
    _launch_each_kernel_once(op, x, r)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the fills above come first
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 31)  # about a second at GPU clocks: the side stream stays busy
        start = time.perf_counter()
        STREAM_OPS[op](x, r)
        host_s = time.perf_counter() - start
    assert host_s < HOST_RETURN_S, f"{op} held the host {host_s:.3f} s: a hidden synchronization"
    # The default stream is not ordered after the side stream: x is still all ones there, unless
    # the kernel ran on a stream other than the side stream (.item() waits for the default only).
    assert torch.all(x == 1.0).item(), f"{op} did not run on the current stream"
    side.synchronize()
    assert torch.all(x == 1.5).item()


MESSAGE_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("weight_dtype", [None, torch.float64])
def test_compress_into_matches_cpu(dtype, message_dtype, n, offset, weight_dtype):
    src = _random(n, dtype, offset)
    weight = None if weight_dtype is None else _weight(0.7, weight_dtype)
    want_src, want = src.clone(), torch.empty(n, dtype=message_dtype)
    torch.ops.gossip_ext.compress_into_(want_src, want, 0.25, weight, 12.0)
    got_src = _device_view(src, offset)
    got = torch.empty(n + offset, dtype=message_dtype, device="cuda")[offset:]
    cuda_weight = None if weight is None else weight.cuda()
    torch.ops.gossip_ext.compress_into_(got_src, got, 0.25, cuda_weight, 12.0)
    # One rounding of the same float value: the messages agree but for a rare tie.
    mismatched = (got.cpu() != want).sum().item()
    assert mismatched <= max(1, n // 10_000), mismatched
    tol = TOLERANCE[dtype] * 100
    torch.testing.assert_close(got_src.cpu(), want_src, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("message_dtype", MESSAGE_DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("num_received", [1, 3, 11])
def test_absorb_of_compressed_messages_matches_cpu(dtype, message_dtype, n, offset, num_received):
    x = _random(n, dtype, offset)
    received = [_random(n, message_dtype, offset) for _ in range(num_received)]
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 0.5)
    got = _device_view(x, offset)
    torch.ops.gossip_ext.absorb_(got, [_device_view(r, offset) for r in received], 0.5)
    tol = TOLERANCE[dtype] * (num_received + 1)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["x", "received"])
@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("offset", [0, 1])
def test_absorb_flags_nonfinite_values_like_cpu(dtype, where, position, offset):
    n = 70001
    index = {"first": 0, "middle": n // 2, "last": n - 1}[position]
    x = _device_view(_random(n, dtype), offset)
    received = [_device_view(_random(n, dtype), offset) for _ in range(9)]  # two launches
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.ops.gossip_ext.absorb_(x.clone(), received, 1.0, None, None, flag)
    assert flag.item() == 0
    (x if where == "x" else received[8])[index] = float("nan")
    torch.ops.gossip_ext.absorb_(x, received, 1.0, None, None, flag)
    assert flag.item() == 1


@pytest.mark.parametrize("message_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sent_offset", [0, 1])  # 1: the state aligned, the sent message not
@pytest.mark.parametrize("num_received", [0, 3, 11])
def test_absorb_with_sent_message_matches_cpu(dtype, message_dtype, n, sent_offset, num_received):
    x = _random(n, dtype)
    received = [_random(n, message_dtype) for _ in range(num_received)]
    sent = _random(n, message_dtype)
    self_weight, new_weight = _weight(0.9, torch.float64), _weight(1.4, torch.float64)
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 1.0, self_weight, new_weight, None, sent, -3.0)
    got = x.cuda()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.ops.gossip_ext.absorb_(
        got,
        [r.cuda() for r in received],
        1.0,
        self_weight.cuda(),
        new_weight.cuda(),
        flag,
        _device_view(sent, sent_offset),
        -3.0,
    )
    tol = TOLERANCE[message_dtype] * (num_received + 4)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    assert flag.item() == 0


@pytest.mark.parametrize("message_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_compress_into_without_feedback_leaves_the_state_on_the_gpu(message_dtype, n):
    z = _random(n, torch.float32).cuda()
    before = z.clone()
    message = torch.empty(n, dtype=message_dtype, device="cuda")
    torch.ops.gossip_ext.compress_into_(z, message, 0.25, None, 0.0)
    assert torch.equal(z, before)
    assert torch.equal(message, (0.25 * before).to(message_dtype))


def test_views_made_here_really_are_unaligned_on_the_device():
    view = _device_view(torch.ones(9), 1)
    assert view.data_ptr() % 16 != 0 and view.is_cuda


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unaligned", ["one message", "the state"])
def test_absorb_with_mixed_alignment_matches_cpu(dtype, unaligned):
    # One pointer off alignment sends the whole launch down the scalar path.
    n = 70001
    x = _random(n, dtype)
    received = [_random(n, dtype) for _ in range(3)]
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 0.5)
    got = _device_view(x, 1 if unaligned == "the state" else 0)
    on_device = [
        _device_view(r, 1 if (unaligned == "one message" and j == 1) else 0)
        for j, r in enumerate(received)
    ]
    torch.ops.gossip_ext.absorb_(got, on_device, 0.5)
    tol = TOLERANCE[dtype] * 4
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


# scale_into launches up to 65535 blocks of 256 threads, absorb_ enough to fill the GPU once (4
# vectors a thread a pass): either way sizes like these take several grid-stride passes, on the
# scalar path (one item per element) and the vectorized one (one per 4 float32 elements).
@pytest.mark.parametrize("n, offset", [((1 << 24) + 3, 1), ((1 << 26) + 5, 0)])
def test_absorb_and_scale_into_cover_several_grid_stride_passes(n, offset):
    x = _random(n, torch.float32)
    received = [_random(n, torch.float32) for _ in range(2)]
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 0.5)
    got = _device_view(x, offset)
    torch.ops.gossip_ext.absorb_(got, [_device_view(r, offset) for r in received], 0.5)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    out = _device_view(torch.empty(n), offset)
    torch.ops.gossip_ext.scale_into(got, out, 0.25, None)
    torch.testing.assert_close(out.cpu(), 0.25 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_many_messages_into_a_16bit_state_round_once(dtype):
    # 11 messages take two launches. Partial sums held in the state's dtype would round twice and,
    # for float16, overflow at 8 * 9000 = 72000 > 65504 although the result, 9000, fits.
    n = 4099
    x = torch.full((n,), 9000.0, dtype=dtype)
    received = [torch.full((n,), 9000.0, dtype=dtype) for _ in range(11)]
    new_weight = _weight(12.0, torch.float32)
    want = x.clone()
    torch.ops.gossip_ext.absorb_(want, received, 1.0, None, new_weight)
    got = x.cuda()
    torch.ops.gossip_ext.absorb_(got, [r.cuda() for r in received], 1.0, None, new_weight.cuda())
    assert torch.isfinite(got).all()
    assert torch.equal(got.cpu(), want)


# --- block-quantized messages (Note [Quantized messages]): the CUDA twins give the CPU's bits ----

QUANTIZED_FORMATS = ["int8", "int4", "float8_e4m3fn"]


def _quantizable(n, dtype, offset=0):
    # Normal values over several magnitudes, a block of zeros and one large outlier.
    v = torch.randn(n + offset, dtype=torch.float64)[offset:] * 10.0 ** (torch.arange(n) % 7 - 3)
    v[128:256] = 0.0
    v[300:301] = 1e4
    return v.to(dtype)


def _message(n, fmt, offset=0, device="cpu"):
    size = gossip_ext._C.quantized_message_bytes(n, fmt)
    return torch.zeros(size + offset, dtype=torch.uint8, device=device)[offset:]


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# (1 << 21) + 3: more blocks of 128 than the warps of a full GPU, so each warp takes several
@pytest.mark.parametrize("n", [1, 129, 1023, 70001, (1 << 21) + 3])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("feedback", [0.0, 2.0])
def test_quantize_into_matches_cpu_bit_for_bit(fmt, dtype, n, offset, feedback):
    src = _quantizable(max(n, 301), dtype, offset)[:n]
    weight = _weight(0.7, torch.float64)
    want_message = _message(n, fmt)
    want_src = src.clone()
    torch.ops.gossip_ext.quantize_into_(want_src, want_message, fmt, 0.25, weight, feedback)
    cuda_src = _device_view(src, offset)
    message = _message(n, fmt, offset, "cuda")
    torch.ops.gossip_ext.quantize_into_(cuda_src, message, fmt, 0.25, weight.cuda(), feedback)
    assert torch.equal(message.cpu(), want_message)
    assert torch.equal(cuda_src.cpu(), want_src)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [129, 70001, (1 << 21) + 3])
@pytest.mark.parametrize("num_received", [0, 1, 3, 11])  # 11: more than one launch
@pytest.mark.parametrize("with_sent", [False, True])
# offset 1: the state and every message unaligned, read a byte or a value at a time
@pytest.mark.parametrize("offset", [0, 1])
def test_absorb_quantized_matches_cpu_bit_for_bit(fmt, dtype, n, num_received, with_sent, offset):
    def message_of(seed):
        m = _message(n, fmt)
        torch.manual_seed(seed)
        torch.ops.gossip_ext.quantize_into_(
            _quantizable(max(n, 301), dtype)[:n].clone(), m, fmt, 1.0
        )
        return m

    received = [message_of(k) for k in range(num_received)]
    sent = message_of(99) if with_sent else None
    x = _random(n, dtype)
    self_weight, new_weight = _weight(0.4, torch.float32), _weight(1.9, torch.float64)
    want = x.clone()
    want_flag = torch.zeros(1, dtype=torch.int32)
    torch.ops.gossip_ext.absorb_quantized_(
        want, received, fmt, 0.5, self_weight, new_weight, want_flag, sent, -2.0
    )
    cuda_x = _device_view(x, offset)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.ops.gossip_ext.absorb_quantized_(
        cuda_x,
        [_device_view(m, offset) for m in received],
        fmt,
        0.5,
        self_weight.cuda(),
        new_weight.cuda(),
        flag,
        None if sent is None else _device_view(sent, offset),
        -2.0,
    )
    assert torch.equal(cuda_x.cpu(), want)
    assert flag.item() == want_flag.item() == 0


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_quantized_nonfinite_travels_as_a_nan_scale_on_the_gpu(fmt):
    src = torch.randn(500, device="cuda")
    src[200] = float("inf")
    message = _message(500, fmt, device="cuda")
    torch.ops.gossip_ext.quantize_into_(src, message, fmt, 1.0, None, 1.0)
    x = torch.zeros(500, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    torch.ops.gossip_ext.absorb_quantized_(x, [message], fmt, 1.0, None, None, flag)
    assert flag.item() == 1
    assert bool(x[128:256].isnan().all()) and bool(torch.isfinite(x[:128]).all())
