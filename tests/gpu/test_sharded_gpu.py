"""Sharded replicas with CUDA parameters on one GPU: two replicas of one shard each, FSDP2 inside
each replica over NCCL (a communicator of one process), gossip between the replicas over gloo
through host buffers (comm_device='cpu'), against the same training on CPU parameters. Skipped,
visibly, without a GPU."""

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

pytestmark = [
    pytest.mark.extension,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (sharded replicas with CUDA parameters)",
    ),
]

STEPS = 6


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


ALGORITHMS = {
    "overlap_sgp": lambda: {"gossip": gossip_ext.SGP(overlap=True)},
    "diloco": lambda: {"gossip": None, "outer": gossip_ext.DiLoCo(_outer_sgd, every=3)},
}


def _train(rank: int, world_size: int, device: str, algorithm: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device == "cuda":
        torch.cuda.set_device(0)
        # One process per replica shard: its FSDP2 group is a communicator of one, on the GPU.
        mesh = init_device_mesh(
            "cuda",
            (2, 1),
            mesh_dim_names=("replicate", "shard"),
            backend_override={"shard": "nccl"},
        )
    else:
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    fully_shard(net, mesh=mesh["shard"])
    model = gossip_ext.GossipDataParallel(
        net,
        process_group=mesh["replicate"].get_group(),
        comm_device="cpu" if device == "cuda" else None,
        **ALGORITHMS[algorithm](),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.register_optimizer(opt)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(32, 8, generator=generator).to(device)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.sync_comms()
    net.reshard()
    return {"params": [p.full_tensor().detach().cpu().double() for p in net.parameters()]}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_sharded_cuda_replicas_train_like_cpu_ones(algorithm):
    on_gpu = run_ranks(2, _train, "cuda", algorithm)
    on_cpu = run_ranks(2, _train, "cpu", algorithm)
    for rank, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu)):
        for got, want in zip(gpu["params"], cpu["params"]):
            # Only the GPU's matmul rounding separates the two runs.
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
