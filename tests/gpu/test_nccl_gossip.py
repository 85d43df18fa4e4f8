"""GossipDataParallel on a GPU over the NCCL transport. Skipped, visibly, without a CUDA build
and a GPU. One GPU cannot hold two NCCL ranks, so this runs at world size 1; multi-rank NCCL
needs a machine with several GPUs."""

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

from gossip_ext import _C

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(_C, "NcclTransport")),
    reason="needs a CUDA GPU and a CUDA build of gossip_ext",
)


def _train_on_gpu(rank: int, world_size: int) -> dict:
    import gossip_ext

    torch.manual_seed(0)
    module = nn.Linear(8, 1).cuda()
    model = gossip_ext.GossipDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8, device="cuda"), torch.randn(16, 1, device="cuda")
    torch.manual_seed(0)
    ref = nn.Linear(8, 1).cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(5):
        for m, o in ((model, opt), (ref, ref_opt)):
            loss = ((m(x) - y) ** 2).mean()
            o.zero_grad()
            loss.backward()
            o.step()
        model.transfer_params()
    model.sync_comms()
    return {
        "gossip": [p.detach().cpu() for p in module.parameters()],
        "plain": [p.detach().cpu() for p in ref.parameters()],
        "rounds": model.gossip_round,
    }


def test_world_of_one_on_nccl_trains_like_plain_sgd():
    result = run_ranks(1, _train_on_gpu)[0]
    assert result["rounds"] == 5
    for got, want in zip(result["gossip"], result["plain"]):
        torch.testing.assert_close(got, want)
