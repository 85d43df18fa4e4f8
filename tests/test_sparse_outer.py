"""DiLoCo's exact outer average in sparse messages (gossip_ext.averagings.sparse.TopK): the message
format against its definition, the bytes against the formula, and DiLoCo on real processes over
gloo against a plain-PyTorch reference of the same algorithm, written here from the module's
docstring: top-k of every chunk of ``v + beta e``, the kept values in ``bits`` bits against the
chunk's largest, ``e`` what the message left out, the mean of every rank's decoded message."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from multiprocess import run_ranks
from sparse_reference import carried
from torch import nn

import gossip_ext
from gossip_ext.averagings.sparse import TopK, _Codec

FORMAT = TopK(density=1 / 8, bits=2, chunk=16)
# SparseLoCo's decayed error feedback: the residual fades by beta = feedback_decay a step.
DECAYED = dataclasses.replace(FORMAT, feedback_decay=0.9)
D, H, STEPS, INNER_LR = 6, 3, 3 * 3 + 1, 0.05
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


@pytest.mark.parametrize("bits", [2, 4])
def test_a_message_carries_the_top_k_of_every_chunk_in_its_bits(bits):
    f = TopK(density=1 / 8, bits=bits, chunk=16)
    v = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    codec = _Codec(f, v.numel())
    message = codec.encode(v.clone())
    assert (
        message.numel() == f.message_bytes(v.numel()) == 7 * (4 + 2 * 2) + math.ceil(14 * bits / 8)
    )
    decoded = torch.zeros(codec.chunks, f.chunk, dtype=torch.float64)
    codec.add_into(decoded, message)
    torch.testing.assert_close(decoded.view(-1)[:100], carried(v, f), rtol=0, atol=1e-12)


def test_a_bad_format_is_refused_naming_the_argument():
    refused = r"TopK\(feedback_decay=...\): must be in \[0, 1\], got 1.5"
    with pytest.raises(ValueError, match=refused):
        TopK(feedback_decay=1.5)
    with pytest.raises(TypeError, match=r"TopK\(feedback_decay=...\): must be a float, got '0.9'"):
        TopK(feedback_decay="0.9")


def test_the_bytes_per_outer_step_are_the_formula():
    numels, f = [1_000_000, 4096], TopK()  # density 1/64, 2 bits, 4096-value chunks
    per_message = [245 * (4 + 2 * 64) + math.ceil(245 * 64 * 2 / 8), 1 * (4 + 128) + 16]
    assert [f.message_bytes(n) for n in numels] == per_message
    assert f.bytes_per_step(numels, 8) == 7 * sum(per_message)
    # Against a float32 all-reduce's 2 (n - 1) / n of 4 bytes a value: 28x less at 8 workers.
    all_reduce = 2 * 7 / 8 * 4 * sum(numels)
    assert all_reduce / f.bytes_per_step(numels, 8) > 27


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(
        4, 1, generator=g, dtype=torch.float64
    )


def _reference(world_size: int, f: TopK) -> list[torch.Tensor]:
    """theta_global after STEPS steps of DiLoCo in TopK messages, in one process."""
    nets = [_net() for _ in range(world_size)]
    inner = [torch.optim.SGD(n.parameters(), lr=INNER_LR) for n in nets]
    theta = [p.detach().clone() for p in nets[0].parameters()]
    outer = torch.optim.SGD(theta, **OUTER)
    residual = [torch.zeros(sum(p.numel() for p in theta), dtype=torch.float64)] * world_size
    for step in range(STEPS):
        for rank, (net, opt) in enumerate(zip(nets, inner)):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        if (step + 1) % H == 0:
            flat_theta = torch.cat([t.reshape(-1) for t in theta])
            decoded = []
            for rank, net in enumerate(nets):
                v = flat_theta - torch.cat([p.detach().reshape(-1) for p in net.parameters()])
                v = v + f.feedback_decay * residual[rank]
                decoded.append(carried(v, f))
                residual[rank] = v - decoded[-1]
            mean = torch.stack(decoded).sum(0) / world_size
            offset = 0
            for t in theta:
                t.grad = mean[offset : offset + t.numel()].view(t.shape).clone()
                offset += t.numel()
            outer.step()
            with torch.no_grad():
                for net in nets:
                    for p, t in zip(net.parameters(), theta):
                        p.copy_(t)
    return [t.detach() for t in theta]


def _train(rank: int, world_size: int, fragments: int, f: TopK = FORMAT) -> dict:
    model = gossip_ext.GossipDataParallel(
        _net(),
        gossip=None,
        outer=gossip_ext.DiLoCo(
            lambda ps: torch.optim.SGD(ps, **OUTER),
            every=H if fragments == 1 else 4,
            average=gossip_ext.Exact(dtype=f),
            fragments=fragments,
        ),
    )
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    model.register_optimizer(opt)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {
        "theta": [
            t.detach().clone() for o in model.outer_optimizers for t in o.param_groups[0]["params"]
        ],
        "bytes": model.runtime.outer.averaging.bytes_per_step() if fragments == 1 else None,
    }


@pytest.mark.parametrize("f", [FORMAT, DECAYED], ids=["feedback", "decayed_feedback"])
def test_diloco_in_sparse_messages_matches_the_reference(f):
    results = run_ranks(3, _train, 1, f)
    want = _reference(3, f)
    for rank, result in enumerate(results):
        for got, expected in zip(result["theta"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12, msg=f"rank {rank}")
        numel = sum(t.numel() for t in want)
        assert result["bytes"] == f.bytes_per_step([numel], 3)


def test_streaming_diloco_in_sparse_messages_keeps_every_rank_on_one_theta_global():
    results = run_ranks(3, _train, 2)
    for other in results[1:]:
        for a, b in zip(results[0]["theta"], other["theta"], strict=True):
            assert torch.equal(a, b)
