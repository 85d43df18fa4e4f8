"""The CPU kernels' instruction set follows torch's CPU capability and GOSSIP_EXT_MAX_CPU_ISA, and
every instruction set gives the same bits.

Each capability torch can be set to (ATEN_CPU_CAPABILITY=default, avx2, avx512), and each cap
gossip_ext's own variable sets under torch's AVX512 (GOSSIP_EXT_MAX_CPU_ISA=base, avx2, avx512,
avx512_bf16: on Zen 4, the set other CPUs with AVX512_BF16 run),
runs the push-sum ops in a process of its own, on data full of the values conversions get wrong
(NaN, infinities, signed zeros, subnormals, float16 overflow), and the outputs are compared bit for
bit across the instruction sets they ran on (NaN against NaN: which NaN an operation on two NaNs
returns depends on the order of its operands).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)

# gossip_ext's, each needing those before it; zen4 is avx512_bf16 as Zen 4 runs it best.
ISAS = ["base", "avx2", "avx512", "avx512_bf16", "zen4"]
# A process each: (ATEN_CPU_CAPABILITY, GOSSIP_EXT_MAX_CPU_ISA or None).
SETTINGS = [("default", None), ("avx2", None), ("avx512", None)] + [
    ("avx512", cap) for cap in ISAS[:-1]
]

# Runs in each capability's process: reads the inputs (made once, in the test's process: torch's
# own random kernels differ between capabilities) and writes what every op made of them.
RUN = r"""
import sys
import torch
import gossip_ext

ops = torch.ops.gossip_ext
inputs = torch.load(sys.argv[1])
w, w_new = torch.tensor([0.7]), torch.tensor([1.37])
out = {}
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    v = [t.clone() for t in inputs[dtype]]
    dst = torch.empty_like(v[0])
    ops.scale_into(v[0], dst, 0.37, w)
    out[f"scale_into {dtype}"] = dst
    for k in (1, 3):
        x = v[0].clone()
        flag = torch.zeros(1, dtype=torch.int32)
        ops.absorb_(x, v[1 : 1 + k], 0.83, w, w_new, flag, v[4], -0.5)
        out[f"absorb_ k={k} {dtype}"] = x
        out[f"absorb_ k={k} {dtype} flag"] = flag
for message in (torch.bfloat16, torch.float16):
    state = inputs[torch.float32][0].clone()
    msg = torch.empty_like(state, dtype=message)
    ops.compress_into_(state, msg, 0.61, w, 2.0)
    out[f"compress_into_ {message}"] = msg
    out[f"compress_into_ {message} state"] = state
    x = inputs[torch.float32][1].clone()
    ops.absorb_(x, [inputs[message][2]], 0.83, w, w_new)
    out[f"absorb_ float32 <- {message}"] = x
torch.save({"isa": gossip_ext._C.cpu_kernels_isa(),
            "torch": torch.backends.cpu.get_cpu_capability(), "outputs": out}, sys.argv[2])
"""


def _inputs() -> dict[torch.dtype, list[torch.Tensor]]:
    """Five buffers of each dtype: ordinary values over 60 binades, a tenth of them special."""
    gen = torch.Generator().manual_seed(0)
    n = 70001  # three parallel grains and a tail
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-8, 65504.0, 65520.0]
        + [1.00390625, 3.0e38]  # a bfloat16 tie; near float32's largest
    )
    inputs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buffers = []
        for _ in range(5):
            v = torch.randn(n, generator=gen, dtype=torch.float64)
            v = v * torch.exp2(torch.randint(-30, 30, (n,), generator=gen).double())
            where = torch.randint(0, n, (n // 10,), generator=gen)
            v[where] = specials[torch.randint(0, len(specials), (n // 10,), generator=gen)].double()
            buffers.append(v.to(dtype))
        inputs[dtype] = buffers
    return inputs


def _cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    if "flags" not in fields:
        pytest.skip("needs /proc/cpuinfo to know this CPU's instruction sets")
    return fields


@pytest.fixture(scope="module")
def processes(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("capabilities")
    torch.save(_inputs(), folder / "inputs.pt")
    # The processes run side by side: each spends most of its time importing torch on one core.
    running = {}
    for capability, cap in SETTINGS:
        path = folder / f"{capability}-{cap}.pt"
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        env.pop("GOSSIP_EXT_MAX_CPU_ISA", None)
        if cap is not None:
            env["GOSSIP_EXT_MAX_CPU_ISA"] = cap
        command = [sys.executable, "-c", RUN, str(folder / "inputs.pt"), str(path)]
        running[(capability, cap)] = (subprocess.Popen(command, env=env), path)
    # Beside them, an import under a cap that does not exist (read by the test below).
    env = dict(os.environ, GOSSIP_EXT_MAX_CPU_ISA="avx1024")
    unknown = subprocess.Popen(
        [sys.executable, "-c", "import gossip_ext"], env=env, stderr=subprocess.PIPE, text=True
    )
    results = {}
    try:
        for setting, (process, path) in running.items():
            assert process.wait(timeout=120) == 0, f"the run under {setting} failed"
            results[setting] = torch.load(path)
        _, stderr = unknown.communicate(timeout=120)
        unknown_cap = (unknown.returncode, stderr)
    finally:
        for process in [p for p, _ in running.values()] + [unknown]:
            if process.poll() is None:
                process.kill()
    return {"settings": results, "unknown cap": unknown_cap}


@pytest.fixture(scope="module")
def runs(processes) -> dict[tuple, dict]:
    """What each setting's process made, by (ATEN_CPU_CAPABILITY, GOSSIP_EXT_MAX_CPU_ISA)."""
    return processes["settings"]


def test_each_setting_picks_the_instruction_set_it_allows(runs):
    info = _cpu_info()
    flags = set(info["flags"].split())
    has_avx2 = {"avx2", "fma", "f16c"} <= flags
    has_avx512 = has_avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    has_avx512_bf16 = has_avx512 and "avx512_bf16" in flags
    # AMD's family 25 (19h) is Zen 3 and Zen 4; only Zen 4 has AVX-512.
    zen4 = has_avx512_bf16 and info.get("vendor_id") == "AuthenticAMD"
    zen4 = zen4 and info.get("cpu family") == "25"
    for (capability, cap), run in runs.items():
        torch_capability = run["torch"]  # what torch made of the request on this CPU
        if torch_capability == "AVX512" and zen4:
            best = "zen4"
        elif torch_capability == "AVX512" and has_avx512_bf16:
            best = "avx512_bf16"
        elif torch_capability == "AVX512" and has_avx512:
            best = "avx512"
        elif torch_capability in ("AVX512", "AVX2") and has_avx2:
            best = "avx2"
        else:
            best = "base"
        expected = best if cap is None else min(best, cap, key=ISAS.index)
        assert run["isa"] == expected, (capability, cap, torch_capability)
    assert runs[("default", None)]["isa"] == "base"
    assert runs[("avx512", "base")]["isa"] == "base"


def test_an_unknown_cap_is_named_at_import(processes):
    returncode, stderr = processes["unknown cap"]
    assert returncode != 0
    assert "GOSSIP_EXT_MAX_CPU_ISA='avx1024'" in stderr
    assert "base, avx2, avx512, avx512_bf16 or zen4" in stderr


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.int32:
        return torch.equal(a, b)
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return bool(((a.view(bits) == b.view(bits)) | both_nan).all())


def test_every_instruction_set_gives_the_same_bits(runs):
    by_isa = {run["isa"]: run["outputs"] for run in runs.values()}
    if len(by_isa) < 2:
        pytest.skip(f"this CPU runs one instruction set only ({next(iter(by_isa))})")
    base = by_isa.pop("base")
    for isa, outputs in by_isa.items():
        for name, tensor in outputs.items():
            assert _same_bits(tensor, base[name]), f"{name}: {isa} differs from base"
