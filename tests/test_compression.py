"""GossipDataParallel with compressed messages (message_dtype: 16-bit floats, and int8, int4 and
float8 e4m3fn blocks): training converges within a stated tolerance of full-precision gossip, on
real gloo processes, in every absorbing schedule; the engine posts the bytes the format says.
Mass conservation over 1,000 rounds is tested in test_simulate.py and test_quantized_gossip.py."""

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
# Block-quantized messages carry the parameters themselves (up to 6 here) at a level of 1/127
# (int8), 1/16 relative (float8) or 1/7 (int4) of a block's largest value: the workers stay
# apart by about a level (Note [Quantized messages]). Measured, the largest over ranks and modes:
# parameters 0.064 (int8), 0.16 (float8), 0.46 (int4) from full precision's; the loss 1.0%,
# 11% and 147% above it, where training started 300 times higher. Stated with some margin:
QUANTIZED_PARAM_TOLERANCE = {"int8": 0.1, "float8_e4m3fn": 0.3, "int4": 0.8}
QUANTIZED_LOSS_TOLERANCE = {"int8": 0.03, "float8_e4m3fn": 0.25, "int4": 2.5}
FORMATS = {
    "float32": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": "int8",
    "int4": "int4",
    "float8_e4m3fn": torch.float8_e4m3fn,
}
# The parameters (7 float32 values, one block): bytes per message in each format.
MESSAGE_BYTES = {
    "float32": 28,
    "bfloat16": 14,
    "float16": 14,
    "int8": 11,
    "int4": 8,
    "float8_e4m3fn": 11,
}


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
    for name, message_dtype in FORMATS.items():
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
        for name in FORMATS:
            if name == "float32":
                continue
            # Stated tolerance: the full-batch loss within LOSS_TOLERANCE of full-precision
            # gossip's, and the parameters within PARAM_TOLERANCE; a block format's rounding and
            # bounded asynchrony's timing are separate causes, so their tolerances add (float8
            # under bounded asynchrony, in a full run of the suite: 27% above full precision).
            loss_tolerance = LOSS_TOLERANCE[mode] + QUANTIZED_LOSS_TOLERANCE.get(name, 0.0)
            param_tolerance = PARAM_TOLERANCE[mode] + QUANTIZED_PARAM_TOLERANCE.get(name, 0.0)
            assert abs(r[name]["loss"] - full["loss"]) <= loss_tolerance * full["loss"] + 1e-3, (
                rank,
                name,
                r[name]["loss"],
                full["loss"],
            )
            torch.testing.assert_close(
                r[name]["params"],
                full["params"],
                rtol=0,
                atol=param_tolerance,
                msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}",
            )
            # The format's bytes per message, for as many messages: lazy mixing sends no weight.
            messages = full["bytes"] // MESSAGE_BYTES["float32"]
            assert r[name]["bytes"] == messages * MESSAGE_BYTES[name], (rank, name, r[name])
