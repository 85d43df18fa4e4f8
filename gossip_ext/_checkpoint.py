"""Checkpoints written by other data-parallel wrappers, recognised so that they load here.

- The reference SGP (facebookresearch/stochastic_gradient_push): ``{'state_dict': <wrapper's
  state dict>, 'ps_weight': tensor([w]), 'is_ps_numerator': bool}``; the parameters hold
  ``x = w z`` when ``is_ps_numerator``.
- fairscale's SlowMoDistributedDataParallel: the wrapper's flat state dict (``module.*``) plus
  ``ps_weight`` and ``is_sgp_ps_numerator`` when its base algorithm is SGP.
- DistributedDataParallel, and fairscale with LocalSGD: the wrapper's ``module.*`` keys only.

This wrapper's own checkpoints carry ``_extra_state`` (the gossip round, the push-sum weight,
the averaging schedule); those are left to ``nn.Module.load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

_PREFIX = "module."
_EXTRA = "_extra_state"


@dataclass
class ForeignCheckpoint:
    module_state: dict[str, Any]  # for the wrapped module itself (no "module." prefix)
    ps_weight: float
    is_numerator: bool  # the parameters hold push-sum numerators x = w z


def parse(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], ForeignCheckpoint | None]:
    """Splits a checkpoint into (this wrapper's own state dict, None) or (None, a foreign one).

    The SGP and fairscale layouts may also wrap this wrapper's own state dict (the compat layers
    save it so): it is then unwrapped, and its ``_extra_state`` is what counts.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict must be a mapping, got {type(state).__name__}")
    if {"state_dict", "ps_weight", "is_ps_numerator"} <= state.keys():  # SGP
        inner = state["state_dict"]
        weight, numerator = state["ps_weight"], state["is_ps_numerator"]
    elif {"ps_weight", "is_sgp_ps_numerator"} <= state.keys():  # fairscale with SGP
        inner = {k: v for k, v in state.items() if k not in ("ps_weight", "is_sgp_ps_numerator")}
        weight, numerator = state["ps_weight"], state["is_sgp_ps_numerator"]
    elif _EXTRA not in state and state and all(k.startswith(_PREFIX) for k in state):
        inner, weight, numerator = state, 1.0, False  # DDP, fairscale with LocalSGD
    else:
        return state, None
    if _EXTRA in inner:
        return inner, None
    foreign = ForeignCheckpoint(
        module_state={_strip(k): v for k, v in inner.items()},
        ps_weight=_weight(weight),
        is_numerator=bool(numerator),
    )
    return None, foreign


def _strip(key: str) -> str:
    if not key.startswith(_PREFIX):
        raise ValueError(
            f"load_state_dict: a wrapper's checkpoint names every entry 'module.<name>', "
            f"got {key!r}"
        )
    return key[len(_PREFIX) :]


def _weight(value: Any) -> float:
    weight = float(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
    if not weight > 0.0:
        raise ValueError(f"load_state_dict: the checkpoint's ps_weight must be > 0, got {weight}")
    return weight
