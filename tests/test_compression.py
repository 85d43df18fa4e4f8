"""GossipDataParallel with 16-bit messages (message_dtype): training converges within a stated
tolerance of full-precision gossip, on real gloo processes, in every absorbing schedule; the wire
carries half the bytes. Mass conservation over 1,000 rounds is tested in test_simulate.py."""

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

STEPS = 120
WORLD_SIZE = 4
MODES = {"sync": {}, "overlap": {"overlap": True}, "bounded-async": {"synch_freq": 2}}
# How far the parameters and the loss may end from full-precision gossip's: 16-bit rounding of
# the messages (parameters measured up to 1.3e-2, loss within 0.7%). Under bounded asynchrony the
# two runs also absorb different rounds at different forwards, as timing decides in each run: on
# a machine loaded by other jobs that alone moved the parameters by up to 6.4e-2 and the loss by
# up to 9.8%, whichever run had the 16-bit messages.
PARAM_TOLERANCE = {"sync": 2e-2, "overlap": 2e-2, "bounded-async": 1.5e-1}
LOSS_TOLERANCE = {"sync": 0.02, "overlap": 0.02, "bounded-async": 0.15}


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Each rank sees its own slice of one regression problem: gossip must pull the ranks to the
    # solution of the whole.
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 6, generator=generator, dtype=torch.float64).float()
    true_w = torch.arange(1.0, 7.0).unsqueeze(1)
    return x, x @ true_w + 0.5 * rank


def _train(rank: int, world_size: int, mode: str) -> dict:
    full_batch = [_data(r) for r in range(world_size)]
    x_all = torch.cat([x for x, _ in full_batch])
    y_all = torch.cat([y for _, y in full_batch])
    results = {}
    for name, message_dtype in (
        ("float32", None),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
    ):
        torch.manual_seed(0)
        module = nn.Linear(6, 1)
        model = gossip_ext.GossipDataParallel(module, message_dtype=message_dtype, **MODES[mode])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = full_batch[rank]
        for _ in range(STEPS):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            model.transfer_params()
        model.sync_comms()
        with torch.no_grad():
            results[name] = {
                "loss": nn.functional.mse_loss(module(x_all), y_all).item(),
                "params": torch.cat([p.reshape(-1) for p in module.parameters()]).clone(),
                "bytes": model.bytes_sent,
            }
    return results


@pytest.mark.parametrize("mode", list(MODES))
def test_16_bit_messages_train_like_full_precision_gossip(mode):
    per_rank = run_ranks(WORLD_SIZE, _train, mode)
    for rank, r in enumerate(per_rank):
        full = r["float32"]
        assert full["loss"] < 1.0, (rank, full["loss"])  # it trained: the start is ~100
        for name in ("bfloat16", "float16"):
            # Stated tolerance: the full-batch loss within LOSS_TOLERANCE of full-precision
            # gossip's, and the parameters within PARAM_TOLERANCE.
            assert (
                abs(r[name]["loss"] - full["loss"]) <= LOSS_TOLERANCE[mode] * full["loss"] + 1e-3
            ), (
                rank,
                name,
                r[name]["loss"],
                full["loss"],
            )
            torch.testing.assert_close(
                r[name]["params"],
                full["params"],
                rtol=0,
                atol=PARAM_TOLERANCE[mode],
                msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}",
            )
            # Exactly half the bytes: lazy mixing sends no weight slot.
            assert 2 * r[name]["bytes"] == full["bytes"], (rank, name, r[name]["bytes"])
