"""Push-sum kernels: gossip_ext's fused ops against the unfused torch op chain and a plain copy.

    python benchmarks/kernels.py --device cpu --sizes 1e6 1e7 2.5e7 --dtypes float32 float16

For every dtype and size (elements of the flat buffer), in the same run, this times:

- fused: the op a gossip round runs, ``torch.ops.gossip_ext.scale_into`` (out = alpha * w * src,
  the send buffer) or ``torch.ops.gossip_ext.absorb_`` with k received messages and the de-bias
  (x = (alpha * ws * x + sum r) / wn), one pass over memory;
- unfused: the same arithmetic as the chain of torch ops a plain-PyTorch push-sum runs
  (scale_into: ``torch.mul(src, w, out=out); out.mul_(alpha)``; absorb: ``x.mul_(ws * alpha)``,
  ``x.add_(r)`` for each r, ``x.div_(wn)``), one pass per op, the weights as 0-dim tensors
  (torch's scalar fast path; ``--weight-shape 1`` passes the engine's [1]-shaped ones);
- copy: ``dst.copy_(src)`` of the same n elements, which reads n and writes n: the bandwidth
  ceiling of a one-pass op.

Bandwidth counts the bytes the op must move, for a state of n elements of s bytes:

| op | reads | writes |
|---|---|---|
| scale_into | n s | n s |
| absorb_, k messages (of the state's dtype) | (k + 1) n s | n s |
| compress_into_ (bf16 message, error feedback) | n s | n s + 2n |
| quantize_into_ (error feedback) | n s | n s + m |
| absorb_quantized_, k messages | n s + k m | n s |

where m is a quantized message's bytes: n (int8, float8) or n / 2 (int4) plus 4 bytes a block
of 128. "fused/copy" is the fused op's GB/s over the copy's GB/s; "speedup" is the unfused
chain's time over the fused op's. Times are medians over interleaved rounds of
torch.utils.benchmark.Timer.blocked_autorange medians (which synchronizes the GPU).

Goals: fused >= 0.9x the copy's bandwidth on a GPU (0.8x on a CPU) and >= 2x faster than the
unfused chain. With every op bandwidth-bound, the chain moves 2x (scale_into), 7/3 = 2.33x
(absorb_, k = 1) and 13/5 = 2.6x (absorb_, k = 3) the fused op's bytes: those are its speedup
ceilings. The three are timed in interleaved rounds (--rounds), so that a drift of the machine's
memory bandwidth (other tenants) hits them alike.

What held the CUDA kernels below a copy (an H100, 25M float32 elements, Nsight Compute), and
what each does now (csrc/kernels/cuda/):
- absorb_ (0.58x with one message): one 16-byte vector a thread and 24,415 blocks; each warp
  waited 49 of its 68 cycles on a load. Now each thread issues the loads of 4 vectors at once,
  in a grid that fills the GPU once and strides.
- quantize_into_ (0.66-0.75x): compute-bound; a thread a value, so each value paid a block-wide
  max through shared memory and two barriers. Now a warp a block of 128, four values a lane in
  one 16-byte load, the max in five shuffles, the codes stored as one word.
- absorb_quantized_ (0.32-0.48x): L2 at 91% while DRAM sat at 42%: each value read its block's
  scale a byte at a time and its code a byte at a time. Now a lane reads its four values in one
  16-byte load, its four codes as one word and the scale as one word the warp shares, every
  message's loads issued before the first is used.
The weights are divided in double once per thread, as the CPU twins do on the host, so that the
quantized ops keep the CPU's bits.

On CPUs the kernels run the best instruction set the CPU has (base, avx2, avx512, avx512_bf16,
or zen4: avx512_bf16 as AMD Zen 4 runs it best), capped by torch's CPU capability and by
``GOSSIP_EXT_MAX_CPU_ISA``, and the header names it: on Zen 4,
``GOSSIP_EXT_MAX_CPU_ISA=avx512_bf16`` times the kernels other CPUs with AVX512_BF16 run,
``=avx512`` those of AVX-512 CPUs without AVX512_BF16, ``=avx2`` the avx2 ones, ``=base`` the
baseline ones.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from quantized_cases import ALPHA, Case, quantized_cases, size_of
from results import machine, record
from torch.utils.benchmark import Timer

import gossip_ext  # registers torch.ops.gossip_ext

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
# Fused op's GB/s over a copy's: a one-pass op on a GPU moves its bytes as a copy does; on a CPU
# the kernels' arithmetic and the copy's streaming stores leave more between them.
GOAL_COPY_FRACTION = {"cpu": 0.8, "cuda": 0.9}
GOAL_SPEEDUP = 2.0


def make_cases(
    n: int, dtype: torch.dtype, device: torch.device, weight_shape: str, check: bool = True
) -> tuple[list[Case], object]:
    """Buffers of n elements and the cases that run over them; returns (cases, copy callable).
    ``check``: compare each fused op with its reference first (:func:`check_equivalence`)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def buffer() -> torch.Tensor:
        return torch.randn(n, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    def weight(value: float) -> torch.Tensor:
        # The engine's push-sum weight: a one-element float32 tensor on the buffers' device.
        return torch.full((1,), value, dtype=torch.float32, device=device)

    def scalar(w: torch.Tensor) -> torch.Tensor:
        # The unfused chain gets the weight as a 0-dim view: torch then treats it as a scalar, so
        # a bfloat16 buffer stays bfloat16 (a [1]-shaped float32 weight would promote every op of
        # the chain to a float32 result cast back on store, a slow path: see --weight-shape).
        return w if weight_shape == "1" else w.view(())

    src, out, x = buffer(), torch.empty(n, dtype=dtype, device=device), buffer()
    received = [buffer() for _ in range(3)]
    w = weight(0.75)
    w_chain = scalar(w)
    ops = torch.ops.gossip_ext

    def scale_fused():
        ops.scale_into(src, out, ALPHA, w)

    def scale_unfused():
        torch.mul(src, w_chain, out=out)
        out.mul_(ALPHA)

    cases = [Case("scale_into", scale_fused, scale_unfused, passes=2, outputs=[out])]
    for k in (1, 3):
        rs = received[:k]
        ws = weight(0.5)  # the kept share of the weight
        wn = weight(0.5 + 0.5 * k)  # kept share + k received weights: x stays O(1) when repeated

        def absorb_fused(rs=rs, ws=ws, wn=wn):
            ops.absorb_(x, rs, ALPHA, ws, wn)

        def absorb_unfused(rs=rs, ws=scalar(ws), wn=scalar(wn)):  # noqa: B008 (bound per k)
            x.mul_(ws * ALPHA)
            for r in rs:
                x.add_(r)
            x.div_(wn)

        cases.append(
            Case(f"absorb_ k={k}", absorb_fused, absorb_unfused, passes=k + 2, outputs=[x])
        )

    # The non-finite check (check_finite=True, the default) rides on absorb_'s pass; without it
    # a caller would scan every received buffer with isfinite after the chain.
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ws, wn = weight(0.5), weight(1.0)

    def checked_fused():
        ops.absorb_(x, received[:1], ALPHA, ws, wn, flag)

    def checked_unfused(ws=scalar(ws), wn=scalar(wn)):  # noqa: B008 (bound once)
        x.mul_(ws * ALPHA).add_(received[0]).div_(wn)
        flag.fill_(int(not torch.isfinite(received[0]).all()))

    cases.append(
        Case("absorb_ k=1 checked", checked_fused, checked_unfused, passes=3, outputs=[x, flag])
    )

    if dtype in (torch.float32, torch.float64):
        # A compressed send: the bfloat16 message and the error kept in the state, one pass.
        message = torch.empty(n, dtype=torch.bfloat16, device=device)
        state = buffer()

        def compress_fused():
            ops.compress_into_(state, message, ALPHA, w, 2.0)

        def compress_unfused():
            exact = state * (w_chain * ALPHA)
            message.copy_(exact)
            state.add_((exact - message.to(dtype)).div_(w_chain), alpha=2.0)

        # Reads the state, writes it and a message of half (float32) or a quarter of its bytes.
        passes = 2 + torch.tensor([], dtype=torch.bfloat16).element_size() / size_of(dtype)
        cases.append(
            Case(
                "compress_into_ bf16",
                compress_fused,
                compress_unfused,
                passes=passes,
                outputs=[state, message],
            )
        )

    if dtype in (torch.float32, torch.float64):
        cases += quantized_cases(n, dtype, device, buffer, w)

    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    if check:
        # On a GPU the reference is the CPU twin: the same cases built on the CPU from the same
        # numbers (the generator above is a CPU one), run through the CPU kernels.
        twins = None
        if device.type != "cpu":
            twins = make_cases(n, dtype, torch.device("cpu"), weight_shape, check=False)[0]
        check_equivalence(cases, dtype, twins)
    return cases, copy


def check_equivalence(cases: list[Case], dtype, twins: list[Case] | None = None) -> None:
    """Fused and unfused must compute the same thing before their times are compared.

    On the CPU the fused op is checked against the unfused chain. On a GPU it is checked against
    its CPU twin (``twins``: the same cases on the CPU): the CUDA kernels compute what the CPU
    kernels do, the quantized ones bit for bit (tests/gpu/test_cuda_kernels.py), whereas the
    unfused chain's torch ops round differently there (the int8 quantization chain lands one
    level off for some values). The chain is the same code on both devices, and the CPU run checks
    it against the fused op.
    """
    tol = (
        {"atol": 1e-5, "rtol": 1e-5}
        if dtype in (torch.float32, torch.float64)
        else {"atol": 3e-2, "rtol": 3e-2}
    )
    reference_name = "unfused results" if twins is None else "the CPU twin's results"
    for i, case in enumerate(cases):
        fused = _outputs_of(case.fused, case.outputs)
        if twins is None:
            reference = _outputs_of(case.unfused, case.outputs)
        else:
            reference = _outputs_of(twins[i].fused, twins[i].outputs)
        for a, b in zip(fused, reference):
            # 16-bit messages may differ by one rounding where the chain rounds twice.
            loose = {"atol": 1e-2, "rtol": 1e-2} if a.dtype == torch.bfloat16 else tol
            a, b = a.double().cpu(), b.double().cpu()
            if not torch.allclose(a, b, **loose):
                diff = (a - b).abs().max().item()
                raise RuntimeError(
                    f"{case.name} ({dtype}): fused and {reference_name} differ by up to {diff:g}"
                )


def _outputs_of(fn, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Runs fn and returns copies of what it wrote to ``outputs``, which it then restores."""
    start = [t.clone() for t in outputs]
    fn()
    written = [t.clone() for t in outputs]
    for t, s in zip(outputs, start):
        t.copy_(s)
    return written


def median_seconds(fn, threads: int, min_run_time: float) -> float:
    timer = Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median


def interleaved_medians(fns: dict, threads: int, min_run_time: float, rounds: int) -> dict:
    """Times every callable in turn, `rounds` times over, and returns each one's median over the
    rounds: a slow drift of the machine (other tenants' memory traffic) then hits fused, unfused
    and copy alike instead of whichever happened to run during it."""
    for fn in fns.values():
        fn()  # warm-up: first touch of the output pages, lazy initialisation
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(median_seconds(fn, threads, min_run_time / rounds))
    return {name: statistics.median(times) for name, times in samples.items()}


def run(args) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        size = torch.tensor([], dtype=dtype).element_size()
        for n in args.sizes:
            # Progress, so that a run stopped by a time limit shows where it was.
            print(f"{dtype_name} {format_elements(n)}: building and checking the cases", flush=True)
            cases, copy = make_cases(n, dtype, device, args.weight_shape)
            print(f"{dtype_name} {format_elements(n)}: timing {len(cases)} ops", flush=True)
            fns = {"copy": copy}
            for case in cases:
                fns[(case.name, "fused")] = case.fused
                fns[(case.name, "unfused")] = case.unfused
            t = interleaved_medians(fns, args.threads, args.min_run_time, args.rounds)
            copy_gbs = 2 * n * size / t["copy"] / 1e9
            for case in cases:
                fused_s, unfused_s = t[(case.name, "fused")], t[(case.name, "unfused")]
                fused_gbs = case.passes * n * size / fused_s / 1e9
                rows.append(
                    {
                        "op": case.name,
                        "dtype": dtype_name,
                        "n": n,
                        "fused_ms": 1e3 * fused_s,
                        "unfused_ms": 1e3 * unfused_s,
                        "copy_ms": 1e3 * t["copy"],
                        "fused_gbs": fused_gbs,
                        "unfused_gbs": case.passes * n * size / unfused_s / 1e9,
                        "copy_gbs": copy_gbs,
                        "of_copy": fused_gbs / copy_gbs,
                        "speedup": unfused_s / fused_s,
                    }
                )
            del cases, copy, fns
    return rows


def format_elements(n: int) -> str:
    return f"{n / 1e6:g}M" if n >= 1e6 else f"{n / 1e3:g}K" if n >= 1e3 else str(n)


def format_table(rows: list[dict], goal: float) -> str:
    header = (
        "| op | dtype | elements | fused ms | unfused ms | copy ms | fused GB/s | unfused GB/s "
        f"| copy GB/s | fused/copy BW (goal >= {goal}) "
        f"| speedup over unfused (goal >= {GOAL_SPEEDUP:g}) | goals |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        met = [r["of_copy"] >= goal, r["speedup"] >= GOAL_SPEEDUP]
        verdict = (
            "met"
            if all(met)
            else "missed: "
            + ", ".join(what for what, ok in zip(("bandwidth", "speedup"), met) if not ok)
        )
        lines.append(
            f"| {r['op']} | {r['dtype']} | {format_elements(r['n'])} | {r['fused_ms']:.3f} "
            f"| {r['unfused_ms']:.3f} | {r['copy_ms']:.3f} | {r['fused_gbs']:.1f} "
            f"| {r['unfused_gbs']:.1f} | {r['copy_gbs']:.1f} | {r['of_copy']:.2f}x "
            f"| {r['speedup']:.2f}x | {verdict} |"
        )
    return "\n".join(lines)


def short_table(rows: list[dict], goal: float) -> str:
    """RESULTS.md's form of the table: a row per op and dtype, a column per size, each cell the
    fused op's time, its bandwidth over the copy's and its speedup over the unfused chain; a
    ``copy`` row per dtype with the copy's time and bandwidth."""
    sizes = list(dict.fromkeys(r["n"] for r in rows))
    by_op = {}
    for r in rows:
        copy = f"{r['copy_ms']:.3f} ms; {r['copy_gbs']:.1f} GB/s"
        by_op.setdefault(("copy", r["dtype"]), {})[r["n"]] = copy
        by_op.setdefault((r["op"], r["dtype"]), {})[r["n"]] = (
            f"{r['fused_ms']:.3f} ms; {r['of_copy']:.2f}x; {r['speedup']:.2f}x"
        )
    lines = [
        f"Each cell: the fused op's time; its bandwidth over a plain copy's (goal >= {goal}x); "
        f"its speedup over the unfused chain of torch ops (goal >= {GOAL_SPEEDUP:g}x). A `copy` "
        "row: a plain copy of the state, its time and bandwidth.",
        "",
        "| op | dtype | " + " | ".join(format_elements(n) for n in sizes) + " |",
        "|" + "---|" * (2 + len(sizes)),
    ]
    for (op, dtype), cells in by_op.items():
        row = [cells.get(n, "not run") for n in sizes]
        lines.append(f"| {op} | {dtype} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], goal: float) -> str:
    bw = sum(r["of_copy"] >= goal for r in rows)
    sp = sum(r["speedup"] >= GOAL_SPEEDUP for r in rows)
    return (
        f"Goals: fused >= {goal}x copy bandwidth in {bw}/{len(rows)} rows "
        f"({'met' if bw == len(rows) else 'missed'}); fused >= {GOAL_SPEEDUP:g}x the unfused "
        f"chain in {sp}/{len(rows)} rows ({'met' if sp == len(rows) else 'missed'}).\n"
        "Speedup ceilings if every op is bandwidth-bound: scale_into 2x (the chain moves 4n "
        "against 2n), absorb_ k=1 2.33x (7n/3n), k=3 2.6x (13n/5n)."
    )


def record_results(table: str, goals: str, args) -> None:
    device = torch.device(args.device)
    where = device.type
    if device.type == "cpu":
        where += f", {args.threads} thread{'s' if args.threads > 1 else ''}"
        where += f", {gossip_ext._C.cpu_kernels_isa()} kernels"
    record(f"Push-sum kernels, {where}", f"{table}\n\n{goals}", device)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Times gossip_ext's fused push-sum kernels against the unfused torch op "
        "chain and a plain copy of the same bytes, and prints the ratios.",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda (a CUDA build and a GPU) (default: cpu)"
    )
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=[1e6, 1e7, 2.5e7],
        help="buffer sizes in elements (default: 1e6 1e7 2.5e7)",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16", "float16"],
        choices=sorted(DTYPES),
        help="buffer dtypes (default: float32 bfloat16 float16)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads for every op, torch.set_num_threads (default: %(default)s, torch's)",
    )
    parser.add_argument(
        "--weight-shape",
        choices=["scalar", "1"],
        default="scalar",
        help="how the unfused chain gets the push-sum weights: 0-dim tensors, which torch "
        "treats as scalars (its fast path), or the engine's one-element [1] tensors, which make "
        "a bfloat16 chain compute in float32 and cast back (default: scalar)",
    )
    parser.add_argument(
        "--min-run-time",
        type=float,
        default=0.5,
        help="seconds each measurement runs at least, split over the rounds (default: 0.5)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved rounds of fused, unfused and copy; each time is the median over the "
        "rounds of blocked_autorange medians (default: 5)",
    )
    parser.add_argument(
        "--no-record",
        action="store_true",
        help="do not append the results to benchmarks/RESULTS.md",
    )
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes]
    if any(s < 1 for s in args.sizes):
        parser.error(f"--sizes must be >= 1, got {args.sizes}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.min_run_time <= 0:
        parser.error(f"--min-run-time must be positive, got {args.min_run_time}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA GPU")
    return args


def check_build(device: torch.device) -> None:
    """Exits with a clear message when this build of the extension has no kernels for device."""
    probe = torch.zeros(1, device=device)
    try:
        torch.ops.gossip_ext.scale_into(probe, torch.empty_like(probe), 1.0, None)
    except NotImplementedError:
        sys.exit(
            f"benchmarks/kernels.py: this build of gossip_ext has no {device.type} kernels "
            "(rebuild with a CUDA torch and nvcc, see setup.py)"
        )


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_build(torch.device(args.device))
    torch.set_num_threads(args.threads)
    rows = run(args)
    goal = GOAL_COPY_FRACTION[torch.device(args.device).type]
    table = format_table(rows, goal)
    device = torch.device(args.device)
    kernels = f", {gossip_ext._C.cpu_kernels_isa()} kernels" if device.type == "cpu" else ""
    print(
        f"\nPush-sum kernels on {device.type} ({machine(device)}), torch {torch.__version__}"
        f"{kernels}"
    )
    print(table)
    goals = summary(rows, goal)
    print("\n" + goals)
    if not args.no_record:
        record_results(short_table(rows, goal), goals, args)
    return rows


if __name__ == "__main__":
    main()
