"""benchmarks/kernels.py's check on a GPU: every fused CUDA op matches its CPU twin before it is
timed, at sizes with partial blocks and odd tails. Skipped, visibly, without a GPU."""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BENCHMARKS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1001, (1 << 20) + 3])
def test_the_kernel_benchmark_finds_every_cuda_op_equal_to_its_cpu_twin(monkeypatch, dtype, n):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import kernels

    cases, _ = kernels.make_cases(n, dtype, torch.device("cuda"), "scalar")  # raises if not
    assert cases
