"""Checks of what GossipDataParallel is given beside its configuration: the module, the order of
calls, and that every rank was configured alike. (Its arguments are checked by the algorithm
objects and ``algorithms.Configuration``.)

Every check that can fail at construction runs on every rank before any communication, so bad
input raises everywhere at once instead of leaving the other ranks waiting in a collective. Each
message names the argument (or the parameter) and the value it got.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _plain_messages
from gossip_ext.algorithms._base import check_type  # noqa: F401  (the wrapper's checks use it)
from gossip_ext.errors import ConfigurationMismatch
from gossip_ext.graphs import GraphBase


def gossip_world_size(
    graph: GraphBase, push_sum: bool, world_size: int, nprocs_per_node: int
) -> int:
    """The number of gossiping processes, after checking that the graph can schedule them."""
    if world_size % nprocs_per_node != 0:
        raise ValueError(
            f"nprocs_per_node ({nprocs_per_node}) must divide the world size ({world_size})"
        )
    n = world_size // nprocs_per_node
    # The graph sees one node per machine, not the world size the user launched: say both.
    nodes = f"{n} gossiping processes" + (
        f" ({world_size} processes / nprocs_per_node={nprocs_per_node})"
        if nprocs_per_node > 1
        else ""
    )
    try:
        graph.schedule(n)
    except ValueError as error:
        raise ValueError(f"graph={graph!r} cannot schedule {nodes}: {error}") from error
    if not push_sum and not graph.pairs_symmetrically(n):
        raise ValueError(
            f"push_sum=False (push-pull averaging, D-PSGD) needs a graph that pairs nodes "
            f"symmetrically in every round, but graph={graph!r} does not with {nodes}"
        )
    return n


# ----------------------------------------------------------------------------- the module


def check_module(module: nn.Module) -> None:
    """An nn.Module, not already wrapped by another data-parallel wrapper: DDP's or FSDP's would
    all-reduce every gradient, or shard the parameters, behind the gossip's back."""
    check_type("module", module, nn.Module, "an nn.Module")
    wrappers: tuple[type, ...] = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    # Whoever wrapped the module in FSDP imported FSDP: look for its class only then. Importing
    # torch.distributed.fsdp here costs every process seconds of CPU for a check of nothing.
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        wrappers += (fsdp.FullyShardedDataParallel,)
    if isinstance(module, wrappers):
        raise TypeError(
            f"module is already wrapped in {type(module).__name__}, whose all-reduce would run "
            "beside the gossip (every worker averaged twice, at all-reduce's cost): give "
            "GossipDataParallel the model itself (module.module), not the wrapper"
        )


def check_parameters(module: nn.Module, named: list[tuple[str, torch.Tensor]]) -> torch.device:
    """Parameters the engine can flatten and gossip; returns their device.

    The engine checks the same, but only after the initial broadcast: here it fails on every
    rank before any communication.
    """
    if not named:
        raise ValueError(
            f"module ({type(module).__name__}) has no parameters; there is nothing to gossip"
        )
    first_name, first = named[0]
    for name, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"parameter '{name}' is not initialized yet (a lazy module): run one forward "
                "before wrapping the module"
            )
        if p.layout != torch.strided:
            raise TypeError(
                f"parameter '{name}' has layout {p.layout}; only dense (strided) parameters "
                "can gossip"
            )
        if not p.is_floating_point():
            hint = (
                "store it as a real tensor (torch.view_as_real) to gossip it"
                if p.is_complex()
                else "keep it in a buffer (module.register_buffer) if it is state, not weights"
            )
            raise TypeError(
                f"parameter '{name}' has dtype {p.dtype}; only floating-point parameters can be "
                f"averaged by gossip: {hint}"
            )
        if p.device != first.device:
            raise ValueError(
                f"parameter '{name}' is on {p.device} but parameter '{first_name}' is on "
                f"{first.device}; all parameters must be on one device"
            )
    return first.device


def check_buffers(
    named: list[tuple[str, torch.Tensor]], device: torch.device, gossip_buffers: bool
) -> None:
    """Floating-point buffers are averaged (and gossiped, if asked) with the parameters: they
    must live where the parameters do."""
    for name, b in named:
        if b.device != device:
            raise ValueError(
                f"buffer {name!r} is on {b.device} but the parameters are on {device}: exact "
                "averaging and gossip_buffers=True need the buffers beside the parameters"
            )
        if gossip_buffers and b.requires_grad:
            raise ValueError(
                f"buffer {name!r} requires grad; gossip_buffers=True cannot flatten it"
            )


_SPARSE_GRADIENT_MODULES = (nn.Embedding, nn.EmbeddingBag)


def check_no_sparse_gradients(module: nn.Module, nprocs_per_node: int) -> None:
    """Node-local gradient averaging flattens gradients into one all-reduced buffer, which a
    sparse gradient cannot join. With one process per node the optimizer consumes sparse
    gradients directly and gossip averages the (dense) parameters, so they are fine."""
    if nprocs_per_node == 1:
        return
    for prefix, sub in module.named_modules():
        if isinstance(sub, _SPARSE_GRADIENT_MODULES) and sub.sparse and sub.weight.requires_grad:
            name = f"{prefix}.weight" if prefix else "weight"
            raise ValueError(
                f"parameter '{name}' gets sparse gradients ({type(sub).__name__}(sparse=True)), "
                f"but nprocs_per_node={nprocs_per_node} averages gradients inside a node, "
                "which needs dense ones: use sparse=False, or nprocs_per_node=1"
            )


class ParameterWatch:
    """Notices parameters registered in the wrapped module after wrapping.

    The engine gossips the parameters it was given; a parameter added later (``module.new =
    nn.Linear(...)``) would silently train alone on every rank. Walking the module at every
    forward would cost a traversal per step, so a process-wide count of parameter and module
    registrations (torch's global registration hooks) says when a walk is needed at all.
    """

    _registrations = 0
    _hooked = False

    def __init__(
        self,
        named: list[tuple[str, torch.Tensor]],
        gossiped_buffers: list[tuple[str, torch.Tensor]] = (),
    ):
        self._hook_once()
        self._params = dict(named)
        # gossip_buffers=True: a buffer assigned anew (module.running_mean = t) would leave gossip.
        self._buffers = dict(gossiped_buffers)
        self._seen = ParameterWatch._registrations

    @classmethod
    def _hook_once(cls) -> None:
        """torch's global registration hooks, installed by the first watch of the process."""
        if not cls._hooked:
            cls._hooked = True
            nn.modules.module.register_module_parameter_registration_hook(cls._count)
            nn.modules.module.register_module_module_registration_hook(cls._count)
            nn.modules.module.register_module_buffer_registration_hook(cls._count)

    @classmethod
    def _count(cls, *_: Any) -> None:
        cls._registrations += 1

    def check(self, module: nn.Module) -> None:
        if self._seen == ParameterWatch._registrations:
            return
        current = dict(module.named_parameters())
        added = [n for n in current if n not in self._params]
        replaced = [n for n, p in current.items() if n in self._params and self._params[n] is not p]
        if self._buffers:
            buffers = dict(module.named_buffers())
            replaced += [n for n, b in self._buffers.items() if buffers.get(n) is not b]
        if added or replaced:
            changes = [f"added {added}"] if added else []
            changes += [f"replaced {replaced}"] if replaced else []
            raise RuntimeError(
                f"parameters changed after the module was wrapped in GossipDataParallel "
                f"({'; '.join(changes)}): gossip does not reach them, so they would train alone "
                "on every rank. Build the whole model before wrapping it"
            )
        # Only a walk that found nothing wrong is remembered, so the error repeats until fixed.
        self._seen = ParameterWatch._registrations


# ----------------------------------------------------------------------------- call order

BY_HAND = "by hand"
BY_OPTIMIZER = "by register_optimizer() after optimizer.step()"
BY_FORWARD = "by the forward (start_in_forward=True)"


def parameter_versions(module: nn.Module) -> int:
    """The sum of the parameters' version counters: it changes when anything writes them in
    place, as every optimizer step does."""
    return sum(p._version for p in module.parameters())


class CallOrder:
    """The order of a training step's calls, where a mistake would otherwise train silently
    wrong: a second gossip round in one step (:func:`check_transfer`), and a loop whose optimizer
    steps while ``transfer_params()`` is never called, which would train every worker alone.
    Every rank tracks it alike, so that all raise alike."""

    def __init__(self, module: nn.Module, overlap: bool, start_in_forward: bool):
        self._module, self._overlap, self._start_in_forward = module, overlap, start_in_forward
        self._caller: str | None = None  # who called transfer_params() in this step
        # Parameter versions at the last training forward, until the first transfer_params().
        self._versions: int | None = None

    def forward(self, training: bool, steps: int) -> None:
        """A forward begins a step; a training one first checks that the last optimizer step,
        if any, was followed by ``transfer_params()``."""
        if training:
            self._check_rounds_started(steps)
        self._caller = None

    def module_runs(self, training: bool, steps: int) -> None:
        """The module's own forward is next: what the parameters are now is what the wrapper
        made them (a round absorbed, a machine's leader's received), before the optimizer's
        step."""
        if training and steps == 0 and not self._start_in_forward:
            self._versions = parameter_versions(self._module)

    def transfer(self, caller: str) -> None:
        """``transfer_params()`` is called by ``caller`` (BY_HAND, BY_OPTIMIZER, BY_FORWARD)."""
        check_transfer(self._caller, caller, self._overlap)

    def transferred(self, caller: str) -> None:
        self._caller = caller

    def step_finished(self) -> None:
        """The step's round was finished on purpose (``sync_comms()``)."""
        self._caller = None

    def parameters_loaded(self) -> None:
        """The parameters were loaded or handed over, not stepped."""
        self._versions = None

    def _check_rounds_started(self, steps: int) -> None:
        """Checked only until the first transfer_params(): an optimizer step since the last
        training forward with no round started means the loop never gossips."""
        if steps or self._versions is None or self._start_in_forward:
            return
        if parameter_versions(self._module) != self._versions:
            self._versions = None  # raise once
            overlap = (
                "; with overlap=True, start_in_forward=True starts every round from the forward "
                "instead, as the reference SGP does"
                if self._overlap
                else ""
            )
            raise RuntimeError(
                "GossipDataParallel: the parameters changed since the last forward (an optimizer "
                "step) but transfer_params() was never called, so no gossip round ran and every "
                "worker trains alone. Call model.transfer_params() after every optimizer.step(), "
                f"or model.register_optimizer(optimizer) once{overlap}"
            )


def check_transfer(previous: str | None, now: str, overlap: bool) -> None:
    """A second round in one step (no forward since the last transfer_params()) is a bug when
    the step hook and a manual call both gossip, or under overlap=True, where it would absorb
    the round just started before it overlapped anything. Manual back-to-back rounds without
    overlap stay legal: a gossip-only loop (transfer_params(); sync_comms()) is one."""
    if previous is None:
        return
    if BY_OPTIMIZER in (previous, now) and previous != now:
        raise RuntimeError(
            f"transfer_params() was called {now} in a step where it was already called "
            f"{previous}: that gossips twice per step. register_optimizer() calls it after "
            "every optimizer.step(); do not also call it by hand (or remove the hook with the "
            "handle register_optimizer() returned)"
        )
    if overlap:
        raise RuntimeError(
            f"overlap=True: transfer_params() was called twice with no forward in between "
            f"({previous}, then {now}); the second call would absorb the round the first one "
            "started before it overlapped anything, and start a second round in the same step. "
            "Call it once per optimizer step (call sync_comms() first to finish a round early)"
        )


def check_learning_rates(optimizer: torch.optim.Optimizer) -> None:
    """SlowMo divides by every param group's learning rate, read at each SlowMo step."""
    for index, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(
                f"optimizer: slowmo_freq needs a learning rate >= 0 in every param group, but "
                f"param group {index} has lr={lr!r}"
            )


def check_slowmo_optimizer(slowmo_freq: int, optimizer) -> None:
    """Raised by transfer_params() on every rank alike, before any communication."""
    if slowmo_freq and optimizer is None:
        raise RuntimeError(
            f"slowmo_freq={slowmo_freq}: the SlowMo step scales by the base optimizer's "
            "learning rate, so call model.register_optimizer(optimizer), which also calls "
            "transfer_params() after every optimizer.step() (then stop calling it by hand)"
        )


# ----------------------------------------------------------------------------- across ranks


def configuration(
    described: Mapping[str, Any],
    parameters: list[tuple[str, torch.Tensor]],
    buffers: list[tuple[str, tuple[int, ...], str]],
) -> dict[str, Any]:
    """What every rank of a GossipDataParallel must agree on (``check_ranks_agree``): its
    ``described`` configuration (``algorithms.Configuration.describe``) and the layout of what
    its rounds exchange."""
    return {
        **described,
        "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in parameters],
        # Averaged or gossiped with the parameters: their layout must agree too.
        "buffers": buffers,
    }


def check_ranks_agree(config: dict[str, Any], group: dist.ProcessGroup, rank: int) -> None:
    """One exchange at construction: ranks that disagree on the schedule or the model would
    otherwise exchange mismatched messages or wait for rounds that never come.

    Each rank's ``config`` travels as JSON text, never a pickle (a rank's bytes are only ever
    parsed), and every rank compares the same decoded configurations, so that all raise
    :class:`~gossip_ext.errors.ConfigurationMismatch` alike, naming the ranks that differ."""
    try:
        gathered = _plain_messages.all_gather_bytes(_plain_messages.encode(config), group)
    except _plain_messages.MalformedMessage as error:  # a size no configuration has
        raise _mismatch(error.rank, str(error), rank, [error.rank]) from None
    configs: list[dict[str, Any] | None] = []
    unreadable = {}
    for other, data in enumerate(gathered):
        try:
            configs.append(
                _plain_messages.flat_settings(
                    _plain_messages.decode(data, f"rank {other}'s configuration", dict)
                )
            )
        except _plain_messages.MalformedMessage as error:
            configs.append(None)
            unreadable[other] = str(error)
    if 0 in unreadable:  # nothing to compare with: rank 0 is the one that differs
        raise _mismatch(0, unreadable[0], rank, [0])
    first = configs[0]
    details = {}
    for other, theirs in enumerate(configs):
        if other in unreadable:
            details[other] = unreadable[other]
            continue
        diff = sorted(k for k in first.keys() | theirs.keys() if theirs.get(k) != first.get(k))
        if diff:
            text = "; ".join(
                f"{k}: rank 0 has {first.get(k)!r}, rank {other} has {theirs.get(k)!r}"
                for k in diff
                if k != "parameters"
            )
            if "parameters" in diff:
                text += "; the parameters (names, shapes or dtypes) differ"
            details[other] = text.lstrip("; ")
    if details:
        other = min(details)
        raise _mismatch(other, details[other], rank, sorted(details))


def _mismatch(other: int, details: str, rank: int, ranks: list[int]) -> ConfigurationMismatch:
    """The error every rank raises when ``ranks`` differ from rank 0; ``details`` are the first
    one's (``other``: 0 when rank 0's own configuration could not be read)."""
    if other == 0:
        what, listed = "rank 0's configuration could not be read", ""
    else:
        what = f"rank {other} was configured differently from rank 0"
        listed = ". Ranks configured differently from rank 0: " + ", ".join(map(str, ranks))
    return ConfigurationMismatch(
        f"GossipDataParallel: {what} (seen on rank {rank}): {details}{listed}", ranks=ranks
    )


def check_checkpoint(state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """A push-sum state is only meaningful on the schedule that produced it."""
    for key, value in mine.items():
        if state.get(key) != value:
            raise ValueError(
                f"load_state_dict: the checkpoint was saved with {key}={state.get(key)!r}, "
                f"but this model has {key}={value!r}"
            )
