"""A checkpoint loads whole or not at all (``GossipDataParallel.load_state_dict``).

Everything is checked before anything is written: a checkpoint of another shape, with a key
missing or too many, with an outer state of another layout, or of other algorithms (DiLoCo's
into SGP, SGP's into DiLoCo), raises and leaves the module's tensors, the step count, the
push-sum and outer state and the optimizer as they were; with ``strict=False`` another
algorithm's checkpoint loads with a warning naming what restarts. A write that fails all the same
(a module's own loading raising) is undone.

One process: a one-rank gloo group in this process (a HashStore), so that each test takes well
under a second; the checkpoint is saved and loaded through ``torch.save`` / ``torch.load(...,
weights_only=True)``, as a user's would be.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gossip_ext

STEPS = 5


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if dist.is_initialized():  # another module's group, in this process: use it
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    _trained("sgp", steps=1)  # the first wrapper of a process starts its transport: seconds
    yield
    dist.destroy_process_group()


class _Counted(nn.Module):
    """A module with an extra state of its own, whose loading refuses a negative count: a write
    that no check of the wrapper can foresee."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def get_extra_state(self) -> dict:
        return {"count": self.count}

    def set_extra_state(self, state: dict) -> None:
        if state["count"] < 0:
            raise ValueError(f"count must be >= 0, got {state['count']}")
        self.count = state["count"]


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2), _Counted())


def _diloco(**kwargs) -> gossip_ext.DiLoCo:
    return gossip_ext.DiLoCo(
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True), every=2, **kwargs
    )


def _model(kind: str, seed: int = 0) -> gossip_ext.GossipDataParallel:
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one gossiping process: gossip does nothing
        if kind == "sgp":
            return gossip_ext.GossipDataParallel(_net(), gossip=gossip_ext.SGP())
        if kind == "diloco":
            return gossip_ext.GossipDataParallel(_net(), gossip=None, outer=_diloco())
        average = gossip_ext.ByCollective(dtype=torch.bfloat16)  # kept residuals
        return gossip_ext.GossipDataParallel(_net(), gossip=None, outer=_diloco(average=average))


def _trained(kind: str, seed: int = 0, steps: int = STEPS):
    """A model of ``kind`` and its registered optimizer (SGD with momentum: it has state), after
    ``steps`` steps."""
    model = _model(kind, seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.register_optimizer(optimizer)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 3, generator=g)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def _saved(model) -> dict:
    """``model.state_dict()`` as a file gives it back: a copy, read as tensors and plain values."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _equal(a, b) -> bool:
    """Whether two states (dicts, lists, tensors, values) are the same, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _everything(model, optimizer) -> dict:
    """What a failed load must leave as it was."""
    return {
        "state": _saved(model),  # the module's tensors, the step count, push-sum, outer state
        "params": list(model.module.parameters()),  # the tensors themselves
        "optimizer": _copy_optimizer(optimizer),
    }


def _copy_optimizer(optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_unchanged(before: dict, model, optimizer) -> None:
    after = _everything(model, optimizer)
    for key, value in before["state"].items():
        assert _equal(value, after["state"][key]), key
    assert after["state"].keys() == before["state"].keys()
    assert after["state"]["_extra_state"]["steps"] == STEPS
    # The same tensors, which the optimizer (and the engine) hold.
    assert all(p is q for p, q in zip(after["params"], before["params"], strict=True))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(p is q for p, q in zip(held, before["params"], strict=True))
    assert _equal(after["optimizer"], before["optimizer"])


def _tampered(model) -> dict:
    """The model's own checkpoint with what a half load would show: another bias, another step
    count."""
    state = _saved(model)
    state["module.0.bias"] = torch.full((2,), 7.0)
    state["_extra_state"]["steps"] = 999
    return state


# ----------------------------------------------------------------------------- refused, unchanged


def test_a_shape_mismatch_raises_and_changes_nothing():
    model, optimizer = _trained("sgp")
    before = _everything(model, optimizer)
    state = _tampered(model)
    state["module.0.weight"] = torch.zeros(5, 5)
    with pytest.raises(RuntimeError, match=r"size mismatch for module\.0\.weight"):
        model.load_state_dict(state)
    _assert_unchanged(before, model, optimizer)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("missing", 'Missing key\\(s\\) in state_dict: "module.1.running_mean"'),
        ("unexpected", 'Unexpected key\\(s\\) in state_dict: "module.3.weight"'),
    ],
)
def test_a_missing_or_unexpected_key_raises_and_changes_nothing(change, words):
    model, optimizer = _trained("sgp")
    before = _everything(model, optimizer)
    state = _tampered(model)
    if change == "missing":
        del state["module.1.running_mean"]
    else:
        state["module.3.weight"] = torch.ones(2)
    with pytest.raises(RuntimeError, match=words):
        model.load_state_dict(state)
    _assert_unchanged(before, model, optimizer)


@pytest.mark.parametrize(
    ("entry", "value", "words"),
    [
        ("residuals", [torch.zeros(3)], "outer residuals has buckets"),
        ("world_size", 3, "over 3 workers"),
    ],
)
def test_an_outer_state_of_another_layout_raises_and_changes_nothing(entry, value, words):
    """The outer rule's state (theta_global) is valid, the averaging's residuals are not: the
    rule's must not be written before the residuals are refused."""
    model, optimizer = _trained("compressed")
    before = _everything(model, optimizer)
    state = _tampered(_trained("compressed", seed=1)[0])
    state["_extra_state"]["outer_residuals"][entry] = value
    with pytest.raises(ValueError, match=words):
        model.load_state_dict(state)
    _assert_unchanged(before, model, optimizer)


def test_a_failing_write_is_undone():
    """A submodule's own set_extra_state refuses its state while the module is written, after
    the step count, the push-sum and outer state were: all of it is put back."""
    model, optimizer = _trained("diloco")
    before = _everything(model, optimizer)
    state = _tampered(_trained("diloco", seed=1)[0])
    state["module.2._extra_state"] = {"count": -1}
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        model.load_state_dict(state)
    _assert_unchanged(before, model, optimizer)


def test_a_load_that_would_replace_the_tensors_is_undone():
    """assign=True would put the checkpoint's tensors in place of those gossip and the optimizer
    work on: refused, and the module keeps its own."""
    model, optimizer = _trained("sgp")
    before = _everything(model, optimizer)
    with pytest.raises(RuntimeError, match="parameters changed after the module was wrapped"):
        model.load_state_dict(_tampered(model), assign=True)
    _assert_unchanged(before, model, optimizer)


def test_a_foreign_checkpoint_of_another_shape_raises_and_changes_nothing():
    model, optimizer = _trained("sgp")
    before = _everything(model, optimizer)
    ddp = {k: v for k, v in _tampered(model).items() if k.startswith("module.")}
    ddp["module.0.weight"] = torch.zeros(5, 5)
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight"):
        model.load_state_dict(ddp)
    _assert_unchanged(before, model, optimizer)


# ----------------------------------------------------------------------------- other algorithms


@pytest.mark.parametrize(("saved_by", "loaded_by"), [("diloco", "sgp"), ("sgp", "diloco")])
def test_a_checkpoint_of_another_algorithm_is_refused_naming_both(saved_by, loaded_by):
    model, optimizer = _trained(loaded_by)
    before = _everything(model, optimizer)
    state = _tampered(_trained(saved_by, seed=1)[0])
    with pytest.raises(ValueError, match="the checkpoint was saved by") as error:
        model.load_state_dict(state)
    saved, runs = str(error.value).split("but this model runs")
    assert "gossip=None, outer=DiLoCo(every=2" in (saved if saved_by == "diloco" else runs)
    assert "gossip=SGP(" in (saved if saved_by == "sgp" else runs)
    assert "strict=False" in str(error.value)
    _assert_unchanged(before, model, optimizer)


def test_a_checkpoint_that_names_no_algorithm_is_told_by_its_outer_state():
    """A checkpoint of an earlier release names no algorithm: DiLoCo's still holds its outer
    state, which an SGP model does not keep."""
    model, optimizer = _trained("sgp")
    before = _everything(model, optimizer)
    state = _tampered(_trained("diloco", seed=1)[0])
    del state["_extra_state"]["algorithm"]
    with pytest.raises(ValueError, match=r"holds outer state \['outer'\], but this model"):
        model.load_state_dict(state)
    _assert_unchanged(before, model, optimizer)


def test_with_strict_false_a_diloco_checkpoint_loads_into_sgp_and_push_sum_restarts():
    model, _ = _trained("sgp")
    state = _saved(_trained("diloco", seed=1)[0])
    with pytest.warns(UserWarning, match=r"the push-sum state \(round 0, weight 1\) starts from"):
        result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = _saved(model)
    for key, value in state.items():
        if key != "_extra_state":
            assert _equal(loaded[key], value), key
    assert loaded["_extra_state"]["steps"] == STEPS
    assert (model.gossip_round, model.ps_weight) == (0, 1.0)


def test_with_strict_false_an_sgp_checkpoint_loads_into_diloco_and_its_outer_state_restarts():
    model, optimizer = _trained("diloco")
    state = _saved(_trained("sgp", seed=1)[0])
    with pytest.warns(UserWarning, match=r"the outer state \['outer'\] starts from scratch"):
        model.load_state_dict(state, strict=False)
    assert model.step_count == STEPS and not model.outer_state_started
    # theta_global starts again at the next forward, from the loaded parameters.
    model(torch.randn(4, 3))
    theta = model.state_dict()["_extra_state"]["outer"]["global"][0]
    loaded = torch.cat([state[f"module.{k}"].reshape(-1) for k in ("0.weight", "0.bias")])
    loaded = torch.cat([loaded, state["module.1.weight"], state["module.1.bias"]])
    assert torch.equal(theta, loaded)


# ----------------------------------------------------------------------------- valid


@pytest.mark.parametrize("kind", ["sgp", "diloco", "compressed"])
def test_a_valid_checkpoint_loads_exactly(kind):
    state = _saved(_trained(kind, seed=1)[0])
    model, _ = _trained(kind, steps=2)
    result = model.load_state_dict(state)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert _equal(_saved(model), state)
    assert model.module[2].count == 0


def test_with_strict_false_the_keys_that_did_not_match_are_returned():
    model, _ = _trained("sgp")
    state = _saved(_trained("sgp", seed=1)[0])
    del state["module.1.running_mean"]
    state["module.3.weight"] = torch.ones(2)
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["module.1.running_mean"]
    assert result.unexpected_keys == ["module.3.weight"]
    assert torch.equal(model.module[0].weight, state["module.0.weight"])
