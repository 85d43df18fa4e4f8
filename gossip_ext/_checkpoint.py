"""Checkpoints written by other data-parallel wrappers, recognised so that they load here.

- The reference SGP (facebookresearch/stochastic_gradient_push): ``{'state_dict': <wrapper's
  state dict>, 'ps_weight': tensor([w]), 'is_ps_numerator': bool}``; the parameters hold
  ``x = w z`` when ``is_ps_numerator``.
- fairscale's SlowMoDistributedDataParallel: the wrapper's flat state dict (``module.*``) plus
  ``ps_weight`` and ``is_sgp_ps_numerator`` when its base algorithm is SGP.
- DistributedDataParallel, and fairscale with LocalSGD: the wrapper's ``module.*`` keys only.

This wrapper's own checkpoints carry ``_extra_state`` (the gossip round, the push-sum weight,
the step count that schedules the outer steps, the outer state, the algorithms that saved them:
:func:`extra_state`).

Every load (:func:`load`; :func:`restore_extra_state` for the extra state alone) loads whole or
not at all: it checks all of the checkpoint first (the module's keys and shapes as
``nn.Module.load_state_dict`` would, the extra state's keys and algorithms, the outer state's
layout), then writes; a write that fails all the same (a module's own loading hook) puts back
what was written before it raises.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gossip_ext import _validation
from gossip_ext.gossip import inner
from gossip_ext.graphs import GraphBase

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

# What every checkpoint of this wrapper holds besides the outer state; what older ones may lack
# (read with defaults; without ``algorithm`` only the outer state's keys tell the algorithm).
_PUSH_SUM = ("gossip_round", "ps_weight", "gossip_world_size", "graph", "mixing")
_OPTIONAL = ("peers_per_itr", "steps", "algorithm")

# A write's undo: what puts back one thing a load wrote, should a later write fail.
Undo = list[Callable[[], Any]]


def algorithm(model) -> dict[str, Any]:
    """What ``model`` runs, in the plain values a checkpoint keeps (``torch.load`` reads them with
    ``weights_only=True``): the gossip's and the outer step's descriptions, None for none."""
    config = model.configuration
    return {
        "gossip": None if config.gossip is None else config.gossip.describe(),
        "outer": None if config.outer is None else config.outer.describe(),
    }


def extra_state(model) -> dict[str, Any]:
    """What resuming a GossipDataParallel needs beside its module's state, after its gossip in
    flight was absorbed: the push-sum state, what the checkpoint must match (the world, the
    graph as constructed, the mixing, the algorithms), the step count and the outer state."""
    return {
        "gossip_round": model.gossip_round,
        "ps_weight": model.ps_weight,
        "gossip_world_size": model.gossip_world_size,
        "graph": repr(model.configuration.graph),
        "peers_per_itr": model.graph.peers_per_itr,
        "mixing": repr(model.mixing),
        "steps": model.runtime.steps,
        "algorithm": algorithm(model),
        **model.runtime.outer.state_dict(),
    }


def load(model, state: Mapping[str, Any], *, strict: bool, assign: bool):
    """``model.load_state_dict(state, strict, assign)``: a checkpoint of the wrapper's own (its
    module's state under ``module.``, ``_extra_state``) or a foreign one (:func:`parse`), checked
    whole before any of it is written (see the module)."""
    own, foreign = parse(state)
    if foreign is not None:
        return load_foreign(model, foreign, strict=strict, assign=assign)
    has_extra = _EXTRA in own
    _check_module(model.module, own, _PREFIX, type(model).__name__, strict, (_EXTRA,))
    extra = _Extra.checked(model, own[_EXTRA], strict) if has_extra else None
    # The module's part without the extra state, which is written by itself (first), keeping the
    # metadata (BatchNorm's version) that nn.Module's loading reads.
    module_state = copy.copy(own) if isinstance(own, dict) else dict(own)
    module_state.pop(_EXTRA, None)
    if extra is not None and extra.warning is not None:  # every check passed: it loads
        warnings.warn(extra.warning, stacklevel=3)  # at the caller of model.load_state_dict

    def write(undo: Undo):
        if extra is not None:
            extra.write(model, undo)
        result = nn.Module.load_state_dict(model, module_state, strict=False, assign=assign)
        model.runtime.watch.check(model.module)  # assign=True replaced the tensors gossip works on
        if has_extra and _EXTRA in result.missing_keys:  # written above, not missing
            result.missing_keys.remove(_EXTRA)
        return result

    result = _atomically(model.module, assign, write)
    model.runtime.parameters_loaded()
    return result


def restore_extra_state(model, state: Mapping[str, Any]) -> None:
    """``_extra_state`` alone (``set_extra_state``: a module holding the wrapper loads, or a
    sharded checkpoint), checked whole, then written; a checkpoint of other algorithms is
    refused."""
    extra = _Extra.checked(model, state, strict=True)
    undo: Undo = []
    try:
        extra.write(model, undo)
    except BaseException:
        _undo(undo)
        raise


def load_foreign(model, foreign: ForeignCheckpoint, *, strict: bool, assign: bool):
    """Another wrapper's checkpoint into a GossipDataParallel: it carries no gossip round, so the
    schedule restarts at round 0 on every rank, with the saved push-sum weight (1 under lazy
    mixing); parameters saved as push-sum numerators are de-biased."""
    module = model.module
    _check_module(module, foreign.module_state, "", type(module).__name__, strict)
    weight = foreign.ps_weight

    def write(undo: Undo):
        round_, kept = model.gossip_round, model.ps_weight
        # The round in flight is absorbed into the parameters it was sent from, before the
        # checkpoint's are loaded over them.
        model.runtime.mix.restore(0, 1.0 if model.runtime.mix.lazy_mixing else weight)
        undo.append(lambda: model.runtime.mix.restore(round_, kept))
        result = module.load_state_dict(foreign.module_state, strict=strict, assign=assign)
        model.runtime.watch.check(module)
        if foreign.is_numerator and weight != 1.0:
            with torch.no_grad():
                for p in module.parameters():
                    p.div_(weight)
        return result

    result = _atomically(module, assign, write)
    model.runtime.parameters_loaded()
    return result


# ----------------------------------------------------------------------------- checks


def _check_module(
    module: nn.Module,
    state: Mapping[str, Any],
    prefix: str,
    owner: str,
    strict: bool,
    also: tuple[str, ...] = (),
) -> None:
    """Raises RuntimeError, in ``nn.Module.load_state_dict``'s words, where it would refuse
    ``state`` for ``module`` (its entries under ``prefix``; ``also``: the owner's other keys): a
    tensor of another shape, and under ``strict`` a missing or unexpected key. It reads the
    module's own ``state_dict`` names, so a checkpoint that only a module's loading hook would
    complete is refused here (its writes are undone in any case)."""
    mine = {prefix + k: v for k, v in module.state_dict(keep_vars=True).items()}
    errors = []
    if strict:
        missing = [k for k in (*also, *mine) if k not in state]
        unexpected = [k for k in state if k not in mine and k not in also]
        for what, keys in (("Missing", missing), ("Unexpected", unexpected)):
            if keys:
                named = ", ".join(f'"{k}"' for k in keys)
                errors.append(f"{what} key(s) in state_dict: {named}. ")
    for key, param in mine.items():
        if key not in state or not isinstance(param, torch.Tensor):
            continue  # a submodule's extra state is its own to check
        value = state[key]
        if not torch.overrides.is_tensor_like(value):
            errors.append(
                f'While copying the parameter named "{key}", expected torch.Tensor or '
                f"Tensor-like object from checkpoint but received {type(value)}"
            )
            continue
        shape = value.shape
        if param.dim() == 0 and shape == (1,):
            shape = param.shape  # as nn.Module: a 1-element tensor of torch 0.3 loads into a scalar
        if not nn.parameter.is_lazy(param) and shape != param.shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {param.shape}."
            )
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {owner}:\n\t" + "\n\t".join(errors))


@dataclass
class _Extra:
    """A checked ``_extra_state``: what loading it writes (``outer``: for the outer steps'
    ``load_state_dict``, ``{}`` restarting their state)."""

    steps: int
    round: int
    weight: float
    graph: GraphBase
    outer: dict[str, Any]
    warning: str | None  # what a strict=False load of other algorithms restarts

    @classmethod
    def checked(cls, model, state: Any, strict: bool) -> _Extra:
        """Checks all of ``state`` against ``model``, writing nothing: its keys, the algorithms
        that saved it (another's is refused, or under ``strict=False`` loaded with a warning
        naming what restarts), the world, graph and mixing of its push-sum state, the outer
        state's layout."""
        if not isinstance(state, Mapping):
            raise ValueError(
                "load_state_dict: the checkpoint's _extra_state must be a dict (this wrapper's "
                f"get_extra_state()), got {type(state).__name__}"
            )
        lacking = [k for k in _PUSH_SUM if k not in state]
        if lacking:
            raise ValueError(
                f"load_state_dict: the checkpoint's _extra_state lacks {lacking} (it holds "
                f"{sorted(state)}): it is not this wrapper's get_extra_state()"
            )
        other_gossip, outer, warning = _compare_algorithms(model, state, strict)
        configured = model.configuration.graph.peers_per_itr
        if other_gossip:  # the push-sum state restarts
            round_, weight, peers = 0, 1.0, configured
        else:
            mine = {
                "gossip_world_size": model.gossip_world_size,
                "graph": repr(model.configuration.graph),
                "mixing": repr(model.mixing),
            }
            _validation.check_checkpoint(state, mine)
            round_ = _count(state, "gossip_round", 0, least=0)
            weight = _weight(state["ps_weight"])
            peers = _count(state, "peers_per_itr", configured, least=1)
        graph = model.graph
        if peers != graph.peers_per_itr:
            graph = inner.with_peers(graph, peers)
        model.runtime.outer.check_state_dict(outer)
        steps = _count(state, "steps", 0, least=0)  # 0: a checkpoint from before the count
        return cls(steps, round_, weight, graph, outer, warning)

    def write(self, model, undo: Undo) -> None:
        """Writes it; ``undo`` receives, for each write made, what puts it back."""
        round_, weight, graph = model.gossip_round, model.ps_weight, model.graph
        steps = model.step_count
        # The push-sum state first: restore() absorbs the round in flight into the parameters it
        # was sent from, before the checkpoint's are loaded over them.
        model.runtime.mix.restore(self.round, self.weight)
        undo.append(lambda: model.runtime.mix.restore(round_, weight))
        if self.graph is not graph:
            model.runtime.mix.set_graph(self.graph)
            undo.append(lambda: model.runtime.mix.set_graph(graph))
        model.step_count = self.steps  # the outer schedule goes on where it stopped
        undo.append(lambda: setattr(model, "step_count", steps))
        kept = (
            model.runtime.outer.state_dict()
        )  # a copy: the rules' state_dicts clone their tensors
        undo.append(lambda: model.runtime.outer.load_state_dict(kept))
        model.runtime.outer.load_state_dict(self.outer)


def _compare_algorithms(
    model, state: Mapping[str, Any], strict: bool
) -> tuple[bool, dict[str, Any], str | None]:
    """Whether the checkpoint's gossip is another than ``model``'s (its push-sum state then
    restarts), the outer state to load, and the warning to give. A checkpoint of other
    algorithms, or whose outer state has other entries than ``model`` keeps, is refused naming
    both; with ``strict=False`` it loads, with a warning naming what restarts and what goes
    unused."""
    mine, saved = algorithm(model), state.get("algorithm")
    if saved is not None and not isinstance(saved, Mapping):
        raise ValueError(f"load_state_dict: the checkpoint's algorithm is {saved!r}, not a dict")
    keys = [k for k in state if k not in _PUSH_SUM + _OPTIONAL]
    wanted = model.runtime.outer.state_keys()
    other_gossip = saved is not None and _kind(saved.get("gossip")) != _kind(mine["gossip"])
    other_outer = saved is not None and _kind(saved.get("outer")) != _kind(mine["outer"])
    outer = {} if other_outer else {k: state[k] for k in wanted if k in state}
    if not (other_gossip or other_outer or sorted(keys) != sorted(wanted)):
        return False, outer, None
    restarts = []
    if other_gossip and model.configuration.gossip is not None:
        restarts.append("the push-sum state (round 0, weight 1)")
    if [k for k in wanted if k not in outer]:
        restarts.append(f"the outer state {[k for k in wanted if k not in outer]}")
    unused = [k for k in keys if k not in outer]
    restarts_text = " and ".join(restarts) or "nothing"
    unused_text = f"; the checkpoint's outer state {unused} goes unused" if unused else ""
    if saved is not None and (other_gossip or other_outer):
        mismatch = f"was saved by {_named(saved)}, but this model runs {_named(mine)}"
    else:
        mismatch = f"holds outer state {keys}, but this model ({_named(mine)}) keeps {wanted}"
    if strict:
        raise ValueError(
            f"load_state_dict: the checkpoint {mismatch}. With strict=False the module's state "
            f"and the step count load, and {restarts_text} starts from scratch{unused_text}"
        )
    warning = (
        f"load_state_dict(strict=False): the checkpoint {mismatch}. The module's state and the "
        f"step count load, and {restarts_text} starts from scratch{unused_text}"
    )
    return other_gossip, outer, warning


def _kind(described: Any) -> Any:
    return described.get("kind") if isinstance(described, Mapping) else described


def _named(described: Any) -> str:
    """An algorithm's description (:func:`algorithm`) as it is spelled: ``DiLoCo(every=8,
    ...)``; both of them as ``gossip=..., outer=...``."""
    if isinstance(described, Mapping) and "kind" in described:
        args = ", ".join(f"{k}={_named(v)}" for k, v in described.items() if k != "kind")
        return f"{described['kind']}({args})"
    if isinstance(described, Mapping) and described.keys() == {"gossip", "outer"}:
        return f"gossip={_named(described['gossip'])}, outer={_named(described['outer'])}"
    return repr(described)


def _count(state: Mapping[str, Any], key: str, default: int, *, least: int) -> int:
    value = state.get(key, default)
    try:
        count = operator.index(value)
    except TypeError:
        count = None
    if count is None or count < least:
        raise ValueError(
            f"load_state_dict: the checkpoint's {key} must be an int >= {least}, got {value!r}"
        )
    return count


# ----------------------------------------------------------------------------- writing


def _atomically(module: nn.Module, assign: bool, write: Callable[[Undo], Any]) -> Any:
    """``write(undo)``, whose every write appends to ``undo`` what puts it back; should one fail
    (after the checks, only what they cannot foresee: a module's loading hook), what was written
    is put back, ``module``'s state from a copy taken first, and the error raised.

    The copy is one of the module's tensors (with ``assign=True``, which replaces them instead
    of writing them, the tensors themselves, which the optimizer holds)."""
    state = module.state_dict(keep_vars=True)
    kept = copy.copy(state)  # with the metadata (BatchNorm's version) its loading reads
    if not assign:
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                kept[key] = value.detach().clone()
    undo: Undo = [lambda: nn.Module.load_state_dict(module, kept, strict=False, assign=assign)]
    try:
        return write(undo)
    except BaseException:
        _undo(undo)
        raise


def _undo(undo: Undo) -> None:
    """Puts back the writes of ``undo``, the latest first."""
    for step in reversed(undo):
        step()
