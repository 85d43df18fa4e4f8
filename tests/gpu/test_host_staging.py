"""GossipDataParallel on one GPU with several processes, gossiping over gloo through pinned host
buffers (comm_device='cpu'), against the same training on CPU parameters. Skipped, visibly,
without a GPU."""

import torch
from multiprocess import run_ranks
from small_task import assert_runs_agree, needs_gpu, net, train

import gossip_ext

pytestmark = needs_gpu("CUDA parameters staged to the host")

STEPS = 6


def _train(rank: int, world_size: int, device: str) -> dict:
    module = net(device)
    model = gossip_ext.GossipDataParallel(module, comm_device="cpu")
    train(model, rank, device, STEPS, transfer=True)
    model.sync_comms()
    return {
        "params": [p.detach().cpu().double() for p in module.parameters()],
        "rounds": model.gossip_round,
    }


def test_cuda_parameters_gossip_over_gloo_like_cpu_parameters():
    on_gpu = run_ranks(3, _train, "cuda")
    on_cpu = run_ranks(3, _train, "cpu")
    # gloo sends CPU tensors only: CUDA parameters that gossiped over it went through the host
    # staging transport (which transport the wrapper picks: tests/test_transport_choice.py).
    assert [r["rounds"] for r in on_gpu] == [r["rounds"] for r in on_cpu] == [STEPS] * 3
    # Only the GPU's matmul rounding separates the two runs.
    assert_runs_agree(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)


def _diverge_on_gpu(rank: int, world_size: int) -> str:
    module = torch.nn.Linear(4, 1).cuda()
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
