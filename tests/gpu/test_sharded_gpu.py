"""Sharded replicas with CUDA parameters on one GPU: two replicas of one shard each, FSDP2 inside
each replica over NCCL (a communicator of one process), gossip between the replicas over gloo
through host buffers (comm_device='cpu'), against the same training on CPU parameters. Skipped,
visibly, without a GPU."""

import pytest
import torch
from multiprocess import run_ranks
from small_task import assert_runs_agree, needs_gpu, net, train

import gossip_ext

pytestmark = needs_gpu("sharded replicas with CUDA parameters")

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
    module = net(device)
    fully_shard(module, mesh=mesh["shard"])
    model = gossip_ext.GossipDataParallel(
        module,
        process_group=mesh["replicate"].get_group(),
        comm_device="cpu" if device == "cuda" else None,
        **ALGORITHMS[algorithm](),
    )
    train(model, rank, device, STEPS)
    model.sync_comms()
    module.reshard()
    return {"params": [p.full_tensor().detach().cpu().double() for p in module.parameters()]}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_sharded_cuda_replicas_train_like_cpu_ones(algorithm):
    on_gpu = run_ranks(2, _train, "cuda", algorithm)
    on_cpu = run_ranks(2, _train, "cpu", algorithm)
    # Only the GPU's matmul rounding separates the two runs.
    assert_runs_agree(on_gpu, on_cpu, rtol=1e-4, atol=1e-5)
