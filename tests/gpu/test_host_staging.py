"""GossipDataParallel on one GPU with several processes, gossiping over gloo through pinned host
buffers (comm_device='cpu'), against the same training on CPU parameters. Skipped, visibly,
without a GPU."""

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (CUDA parameters staged to the host)",
    ),
]

STEPS = 6


def _train(rank: int, world_size: int, device: str) -> dict:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    model = gossip_ext.GossipDataParallel(module, comm_device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.transfer_params()
    model.sync_comms()
    return {
        "params": [p.detach().cpu().double() for p in module.parameters()],
        "rounds": model.gossip_round,
    }


def test_cuda_parameters_gossip_over_gloo_like_cpu_parameters():
    on_gpu = run_ranks(3, _train, "cuda")
    on_cpu = run_ranks(3, _train, "cpu")
    for rank, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu)):
        # gloo sends CPU tensors only: CUDA parameters that gossiped over it went through the host
        # staging transport (which transport the wrapper picks: tests/test_transport_choice.py).
        assert gpu["rounds"] == cpu["rounds"] == STEPS
        for got, want in zip(gpu["params"], cpu["params"]):
            # Only the GPU's matmul rounding separates the two runs.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")


def _diverge_on_gpu(rank: int, world_size: int) -> str:
    module = nn.Linear(4, 1).cuda()
    model = gossip_ext.GossipDataParallel(module, comm_device="cpu")
    if rank == 1:
        with torch.no_grad():
            module.weight[0, 2] = float("nan")
    try:
        model.transfer_params()
        model(torch.ones(1, 4, device="cuda"))  # absorbs; on a GPU the flag is read one call later
        model.transfer_params()
        model.sync_comms()
    except FloatingPointError as error:
        return str(error)
    return ""


def test_a_nonfinite_message_raises_on_the_gpu_one_call_later_naming_the_sender():
    errors = run_ranks(2, _diverge_on_gpu)
    assert "the messages from peers [1] hold NaN or Inf" in errors[0], errors[0]
    assert "the parameters of this rank (rank 1)" in errors[1], errors[1]
