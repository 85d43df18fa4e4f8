"""Checkpoints written by other data-parallel wrappers, recognised so that they load here.

- The reference SGP (facebookresearch/stochastic_gradient_push): ``{'state_dict': <wrapper's
  state dict>, 'ps_weight': tensor([w]), 'is_ps_numerator': bool}``; the parameters hold
  ``x = w z`` when ``is_ps_numerator``.
- fairscale's SlowMoDistributedDataParallel: the wrapper's flat state dict (``module.*``) plus
  ``ps_weight`` and ``is_sgp_ps_numerator`` when its base algorithm is SGP.
- DistributedDataParallel, and fairscale with LocalSGD: the wrapper's ``module.*`` keys only.

This wrapper's own checkpoints carry ``_extra_state`` (the gossip round, the push-sum weight,
the step count that schedules the outer steps, the outer state: :func:`extra_state`), which
``nn.Module.load_state_dict`` hands back to :func:`restore_extra_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gossip_ext import _validation
from gossip_ext.gossip import inner

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


# ----------------------------------------------------------------------------- the wrapper's own


def extra_state(model) -> dict[str, Any]:
    """What resuming a GossipDataParallel needs beside its module's state, after its gossip in
    flight was absorbed: the push-sum state, what the checkpoint must match (the world, the
    graph as constructed, the mixing), the step count and the outer state."""
    return {
        "gossip_round": model.gossip_round,
        "ps_weight": model.ps_weight,
        "gossip_world_size": model.gossip_world_size,
        "graph": repr(model.configuration.graph),
        "peers_per_itr": model.graph.peers_per_itr,
        "mixing": repr(model.mixing),
        "steps": model._steps,
        **model._outer.state_dict(),
    }


def restore_extra_state(model, state: Mapping[str, Any]) -> None:
    mine = {
        "gossip_world_size": model.gossip_world_size,
        "graph": repr(model.configuration.graph),
        "mixing": repr(model.mixing),
    }
    _validation.check_checkpoint(state, mine)
    model._outer.load_state_dict(state)
    # The outer schedule goes on where it stopped (0: a checkpoint from before it).
    model.step_count = int(state.get("steps", 0))
    model._mix.restore(int(state["gossip_round"]), float(state["ps_weight"]))
    peers = int(state.get("peers_per_itr", model.configuration.graph.peers_per_itr))
    if peers != model.graph.peers_per_itr:
        model._mix.set_graph(inner.with_peers(model.graph, peers))


def load_foreign(model, foreign: ForeignCheckpoint, *, strict: bool, assign: bool):
    """Another wrapper's checkpoint into a GossipDataParallel: it carries no gossip round, so the
    schedule restarts at round 0 on every rank, with the saved push-sum weight (1 under lazy
    mixing); parameters saved as push-sum numerators are de-biased."""
    result = model.module.load_state_dict(foreign.module_state, strict=strict, assign=assign)
    model._watch.check(model.module)
    weight = foreign.ps_weight
    if foreign.is_numerator and weight != 1.0:
        with torch.no_grad():
            for p in model.module.parameters():
                p.div_(weight)
    model._mix.restore(0, 1.0 if model._mix.lazy_mixing else weight)
    model._parameters_loaded()
    return result
