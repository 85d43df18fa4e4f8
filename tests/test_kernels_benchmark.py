"""benchmarks/kernels.py checks each fused op before it times it: against the unfused chain on the
CPU, against the op's CPU twin on a GPU (where the chain rounds differently). On the GPU the
twin check runs in tests/gpu/test_gpu_benchmarks.py; here the same check runs with CPU twins."""

import os

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
N = 1001  # a partial quantization block, an odd int4 tail


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import kernels

    return kernels


def _cases(kernels, dtype=torch.float32):
    return kernels.make_cases(N, dtype, torch.device("cpu"), "scalar", check=False)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fused_op_matches_the_unfused_chain_on_the_cpu(kernels, dtype):
    kernels.check_equivalence(_cases(kernels, dtype), dtype)


def test_the_twin_check_compares_the_fused_ops_and_leaves_the_buffers(kernels):
    cases, twins = _cases(kernels), _cases(kernels)
    before = [[t.clone() for t in case.outputs] for case in cases]
    kernels.check_equivalence(cases, torch.float32, twins)
    for case, outputs in zip(cases, before):
        for got, want in zip(case.outputs, outputs):
            # Timing starts from the same buffers; bytes, since a message buffer starts unset.
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), case.name


def test_a_fused_op_unlike_its_twin_is_named(kernels):
    cases, twins = _cases(kernels), _cases(kernels)
    names = [case.name for case in cases]
    index = names.index("quantize_into_ int8")
    twin = twins[index]
    run, message = twin.fused, twin.outputs[1]

    def one_level_off():
        run()
        message[-1:].bitwise_xor_(1)  # the last code, one quantization level away

    twin.fused = one_level_off
    with pytest.raises(RuntimeError, match=r"quantize_into_ int8 \(torch.float32\): fused and "
                       r"the CPU twin's results differ by up to 1\b"):  # fmt: skip
        kernels.check_equivalence(cases, torch.float32, twins)
