"""Checkpoints of the reference SGP, of fairscale's SlowMoDistributedDataParallel and of
DistributedDataParallel load into GossipDataParallel; real processes over gloo.

The checkpoints are written here in each project's documented layout (SGP's and fairscale's
``state_dict`` methods; DDP's ``module.`` prefix), not produced by this library.
"""

from __future__ import annotations

import pytest
import torch
from multiprocess import run_ranks
from torch import nn

import gossip_ext

D = 3


def _values() -> dict[str, torch.Tensor]:
    return {"weight": torch.tensor([[1.0, -2.0, 4.0]]), "bias": torch.tensor([0.5])}


def _layout(name: str, weight: float, numerator: bool) -> dict:
    scale = weight if numerator else 1.0
    module_state = {f"module.{k}": v * scale for k, v in _values().items()}
    if name == "sgp":
        return {
            "state_dict": module_state,
            "ps_weight": torch.tensor([weight]),
            "is_ps_numerator": numerator,
        }
    if name == "fairscale":
        return {
            **module_state,
            "ps_weight": torch.tensor([weight]),
            "is_sgp_ps_numerator": numerator,
        }
    return module_state  # DDP


def _load(
    rank: int, world_size: int, name: str, weight: float, numerator: bool, lazy: bool
) -> dict:
    mixing = gossip_ext.UniformMixing() if lazy else gossip_ext.SelfWeightMixing(0.5)
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1), mixing=mixing)
    model.load_state_dict(_layout(name, weight, numerator))
    loaded = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    result = {"loaded": loaded, "ps_weight": model.ps_weight, "round": model.gossip_round}
    model.transfer_params()  # and it trains on from there
    model.sync_comms()
    result["after_round"] = model.gossip_round
    return result


@pytest.mark.parametrize(
    ("name", "weight", "numerator", "lazy"),
    [
        ("sgp", 0.25, True, False),
        ("sgp", 0.25, False, False),
        ("sgp", 1.0, False, True),
        ("fairscale", 0.5, True, False),
        ("fairscale", 1.0, False, True),
        ("ddp", 1.0, False, True),
    ],
)
def test_a_foreign_checkpoint_loads_the_de_biased_model_and_weight(name, weight, numerator, lazy):
    for result in run_ranks(2, _load, name, weight, numerator, lazy):
        for key, value in _values().items():
            torch.testing.assert_close(result["loaded"][key], value)
        assert result["ps_weight"] == pytest.approx(1.0 if lazy else weight)
        assert result["round"] == 0 and result["after_round"] == 1


def _wrong_prefix(rank: int, world_size: int) -> str:
    model = gossip_ext.GossipDataParallel(nn.Linear(D, 1))
    bad = {
        "state_dict": {"weight": torch.zeros(1, D)},
        "ps_weight": torch.ones(1),
        "is_ps_numerator": False,
    }
    try:
        model.load_state_dict(bad)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_nested_checkpoint_without_the_module_prefix_says_so():
    for message in run_ranks(2, _wrong_prefix):
        assert "'module.<name>'" in message and "'weight'" in message
