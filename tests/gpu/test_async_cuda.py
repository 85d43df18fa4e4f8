"""The asynchronous modes with CUDA parameters: AsyncSGP (the compiled engine's path) and
AsyncDiLoCo encode and absorb on the GPU and send their messages from host memory over gloo
(Note [Asynchronous gossip on GPUs] in gossip_ext/gossip/messages.py), against the same
training on CPU parameters. Skipped, visibly, without a GPU."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from small_task import assert_runs_agree, needs_gpu, net, train

import gossip_ext
from gossip_ext.gossip import messages

pytestmark = needs_gpu("asynchronous messages encoded on the GPU, sent from the host")

STEPS = 8
EVERY = 2  # AsyncDiLoCo's H


@pytest.mark.parametrize("message_dtype", [None, torch.bfloat16, "int8", "int4"])
def test_a_message_encoded_on_the_gpu_reads_as_the_cpu_codec_reads_it(message_dtype):
    numel = 1000  # eight blocks, the last one partial
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    on_cpu = messages.codec(numel, torch.float32, message_dtype)
    on_gpu = messages.codec(numel, torch.float32, message_dtype, "cuda")
    kept_cpu, kept_gpu = values.clone(), values.cuda()
    sent_cpu = on_cpu.encode([kept_cpu], 0.25, 3, feedback=2.0)
    sent_gpu = on_gpu.encode([kept_gpu], 0.25, 3, feedback=2.0)
    assert sent_gpu.device.type == "cpu" and sent_gpu.numel() == on_cpu.nbytes
    # The CUDA kernels round as their CPU twins: the same bytes, the same rounding kept.
    assert torch.equal(sent_gpu, sent_cpu)
    torch.testing.assert_close(kept_gpu.cpu(), kept_cpu, rtol=0, atol=1e-6)
    x_cpu = torch.linspace(-1, 1, numel)
    x_gpu = x_cpu.cuda()
    on_cpu.absorb([x_cpu], sent_cpu, 3.0, 4.0)
    on_gpu.absorb([x_gpu], sent_gpu, 3.0, 4.0)
    torch.testing.assert_close(x_gpu.cpu(), x_cpu, rtol=1e-6, atol=1e-6)
    assert on_gpu.values_finite(sent_gpu)
    torch.testing.assert_close(on_gpu.read(sent_gpu)[0].cpu(), on_cpu.read(sent_cpu)[0])


def _train(rank: int, world_size: int, device: str, algorithm: str) -> dict:
    module = net(device)
    if algorithm == "async_sgp":
        # Equal speeds and no staleness: each round absorbs exactly its partners' round, as
        # synchronous SGP's, so both runs see the same arrivals.
        options = {"gossip": gossip_ext.AsyncSGP(staleness=0, message_dtype="int8")}
    else:
        # A grace longer than any step: every merge takes every worker's pseudo-gradient; and
        # a barrier after each outer step (below) keeps a worker from sending its next one
        # before all have merged, so that both runs merge the same groups.
        outer = gossip_ext.AsyncDiLoCo(every=EVERY, lr=0.5, momentum=0.5, grace=30.0)
        options = {"gossip": None, "outer": outer}
    model = gossip_ext.GossipDataParallel(module, timeout=timedelta(seconds=60), **options)
    for period in range(STEPS // EVERY):  # plain SGD: a new optimizer a period changes nothing
        train(model, rank, device, EVERY, transfer=True, seed=rank + 1000 * period)
        dist.barrier()
    model.average_parameters()  # every message absorbed or merged, then one model
    return {"params": [p.detach().cpu().double() for p in module.parameters()]}


@pytest.mark.parametrize("algorithm", ["async_sgp", "async_diloco"])
def test_cuda_parameters_train_asynchronously_like_cpu_parameters(algorithm):
    on_gpu = run_ranks(3, _train, "cuda", algorithm)
    on_cpu = run_ranks(3, _train, "cpu", algorithm)
    # Only the GPU's matmul rounding, and the int8 codes it may tip, separate the runs.
    assert_runs_agree(on_gpu, on_cpu, rtol=1e-3, atol=1e-3)
