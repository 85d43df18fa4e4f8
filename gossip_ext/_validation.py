"""Checks of GossipDataParallel's arguments, module and call order.

Every check that can fail at construction runs on every rank before any communication, so bad
input raises everywhere at once instead of leaving the other ranks waiting in a collective. Each
message names the argument (or the parameter) and the value it got.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossip_ext import _C
from gossip_ext.epochs import parse_address
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase

# ----------------------------------------------------------------------------- arguments


# What a message may be besides full precision: 16-bit floats, or block-quantized formats with a
# float32 scale per block of 128 values (Note [Quantized messages] in csrc/kernels/block_format.h).
MESSAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, "int8", "int4")


def check_message_dtype(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is None or one of MESSAGE_DTYPES."""
    if value is None or (
        isinstance(value, (str, torch.dtype)) and any(value == d for d in MESSAGE_DTYPES)
    ):
        return
    raise ValueError(
        f"{name} must be torch.bfloat16, torch.float16, torch.float8_e4m3fn, 'int8', 'int4' or "
        f"None (full precision), got {value!r}"
    )


def check_type(name: str, value, expected, what: str) -> None:
    # bool is an int to isinstance: push_sum=1 or synch_freq=True are mistakes worth naming.
    if isinstance(value, bool) and expected is not bool:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def check_arguments(
    *,
    module,
    process_group,
    comm_device,
    timeout,
    nprocs_per_node,
    broadcast_buffers,
    gossip_buffers,
    log_every,
    verbose,
    **flat,
) -> None:
    """The constructor's arguments on their own (``flat``: the algorithm's settings, as
    flat_keywords.to_flat gives them), then that torch.distributed is set up (or that an elastic
    job's membership service is named instead)."""
    check_type("module", module, nn.Module, "an nn.Module")
    check_type("nprocs_per_node", nprocs_per_node, int, "an int")
    if process_group is not None:
        check_type("process_group", process_group, dist.ProcessGroup, "a ProcessGroup or None")
    if comm_device is not None:
        check_type("comm_device", comm_device, (str, torch.device), "a torch.device, str or None")
    check_type("timeout", timeout, timedelta, "a datetime.timedelta")
    check_type("verbose", verbose, bool, "a bool")
    check_type("log_every", log_every, int, "an int")
    if log_every < 0:
        raise ValueError(f"log_every must be >= 0 (0: off), got {log_every}")
    if nprocs_per_node < 1:
        raise ValueError(f"nprocs_per_node must be >= 1, got {nprocs_per_node}")
    for name, value in (
        ("broadcast_buffers", broadcast_buffers),
        ("gossip_buffers", gossip_buffers),
    ):
        check_type(name, value, bool, "a bool")
    if broadcast_buffers and gossip_buffers:
        raise ValueError(
            "broadcast_buffers=True and gossip_buffers=True: the broadcast before every forward "
            "would overwrite what gossip averaged; choose one"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout}")
    check_flat(flat, nprocs_per_node=nprocs_per_node, process_group=process_group)
    if flat["membership"] is None and (not dist.is_available() or not dist.is_initialized()):
        raise RuntimeError(
            "GossipDataParallel needs torch.distributed: call "
            "torch.distributed.init_process_group() first (torchrun sets it up), or name an "
            "elastic job's membership service (membership='HOST:PORT')"
        )


def check_flat(flat: Mapping[str, Any], *, nprocs_per_node: int = 1, process_group=None) -> None:
    """The algorithm's settings in the flat keywords of earlier releases (every key of
    flat_keywords.FLAT_DEFAULTS), alone and together, each error naming the keyword."""
    f = flat
    check_type("graph", f["graph"], GraphBase, "a gossip_ext graph (a GraphBase)")
    check_type("mixing", f["mixing"], MixingBase, "a gossip_ext mixing (a MixingBase)")
    for name in (
        "push_sum",
        "overlap",
        "check_finite",
        "slowmo_memory_efficient",
        "start_in_forward",
    ):
        check_type(name, f[name], bool, "a bool")
    check_type("synch_freq", f["synch_freq"], int, "an int")
    check_message_dtype("message_dtype", f["message_dtype"])
    for name in ("global_avg_freq", "slowmo_freq"):
        if f[name] is not None:
            check_type(name, f[name], int, "an int or None")
            if f[name] < 0:
                raise ValueError(f"{name} must be >= 0 (0 or None: off), got {f[name]}")
    check_type("slowmo_momentum", f["slowmo_momentum"], (int, float), "a float")
    check_type("slowmo_lr", f["slowmo_lr"], (int, float), "a float")
    # beta = 1 never forgets a slow step and diverges; NaN fails both comparisons.
    if not 0.0 <= f["slowmo_momentum"] < 1.0:
        raise ValueError(f"slowmo_momentum must be in [0, 1), got {f['slowmo_momentum']}")
    if not 0.0 < f["slowmo_lr"] < math.inf:
        raise ValueError(f"slowmo_lr must be positive and finite, got {f['slowmo_lr']}")
    if f["synch_freq"] < 0:
        raise ValueError(f"synch_freq must be >= 0, got {f['synch_freq']}")
    if f["overlap"] and f["synch_freq"] > 0:
        raise ValueError(
            f"overlap=True and synch_freq={f['synch_freq']} are two different schedules for "
            "absorbing rounds; choose one"
        )
    if f["slowmo_num_shards"] is not None:
        check_type("slowmo_num_shards", f["slowmo_num_shards"], int, "an int or None")
        if f["slowmo_num_shards"] < 1:
            raise ValueError(
                f"slowmo_num_shards must be >= 1 (None: every rank), got {f['slowmo_num_shards']}"
            )
    if f["base_algorithm"] not in ("sgp", "localsgd"):
        raise ValueError(f"base_algorithm must be 'sgp' or 'localsgd', got {f['base_algorithm']!r}")
    check_outer(
        f["outer_optimizer"],
        f["sync_every"],
        f["outer_device"],
        f["global_avg_freq"],
        f["slowmo_freq"],
    )
    check_outer_average(f["outer_average"], f["outer_optimizer"], nprocs_per_node)
    check_outer_dtype(f["outer_dtype"], f["outer_optimizer"], f["outer_average"])
    check_fragments(
        f["fragments"],
        f["fragment_delay"],
        f["fragment_alpha"],
        f["outer_optimizer"],
        f["sync_every"],
    )
    if f["start_in_forward"] and not f["overlap"]:
        raise ValueError(
            "start_in_forward=True needs overlap=True: a synchronous round is absorbed by the "
            "same forward that would start it"
        )
    if f["start_in_forward"] and f["slowmo_freq"]:
        raise ValueError(
            f"start_in_forward=True cannot be combined with slowmo_freq={f['slowmo_freq']}: "
            "SlowMo reads the learning rate of the optimizer given to register_optimizer(), whose "
            "hook would start a second round after every step"
        )
    check_membership(f["membership"], f["min_workers"], process_group, nprocs_per_node)


def check_membership(membership, min_workers, process_group, nprocs_per_node) -> None:
    """An elastic job (gossip_ext.elastic) builds its own process groups, one machine a worker."""
    check_type("min_workers", min_workers, int, "an int")
    if min_workers < 1:
        raise ValueError(f"min_workers must be >= 1, got {min_workers}")
    if membership is None:
        if min_workers != 1:
            raise ValueError(
                f"min_workers={min_workers} applies to an elastic job, but membership is None"
            )
        return
    check_type("membership", membership, str, "a str 'HOST:PORT' or None")
    parse_address(membership)
    if process_group is not None:
        raise ValueError(
            f"membership={membership!r} with a process_group: an elastic job builds a process "
            "group per membership epoch itself; pass one or the other"
        )
    if nprocs_per_node > 1:
        raise ValueError(
            f"membership={membership!r} with nprocs_per_node={nprocs_per_node}: an elastic job's "
            "workers are one process each (launch one per GPU or machine)"
        )


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


# The transports GossipDataParallel builds (csrc/transport).
NCCL = "nccl"
PROCESS_GROUP = "process_group"
HOST_STAGING = "host_staging"


def check_outer(outer_optimizer, sync_every, outer_device, global_avg_freq, slowmo_freq) -> None:
    """DiLoCo's outer step: its own arguments, and the schedules it cannot share a step with."""
    if outer_optimizer is not None and not callable(outer_optimizer):
        raise TypeError(
            "outer_optimizer must be a callable that builds a torch.optim.Optimizer from a list "
            "of tensors (e.g. `lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, "
            f"nesterov=True)`), got {type(outer_optimizer).__name__} {outer_optimizer!r}"
        )
    if sync_every is not None:
        check_type("sync_every", sync_every, int, "an int or None")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 (None: no outer step), got {sync_every}")
    if outer_optimizer is not None and sync_every is None:
        raise ValueError(
            "outer_optimizer needs sync_every, the inner steps between two outer steps, got "
            "sync_every=None"
        )
    if sync_every and global_avg_freq:
        raise ValueError(
            f"sync_every={sync_every} and global_avg_freq={global_avg_freq} both schedule exact "
            "averages (sync_every without outer_optimizer is LocalSGD's plain average); choose one"
        )
    if sync_every and slowmo_freq:
        raise ValueError(
            f"sync_every={sync_every} and slowmo_freq={slowmo_freq} both schedule an outer step; "
            "choose one (SlowMo is the outer step of heavy-ball SGD scaled by the inner lr)"
        )
    if outer_device is not None:
        if outer_optimizer is None:
            raise ValueError(
                f"outer_device={outer_device!r} places the outer optimizer's state, but "
                "outer_optimizer is None"
            )
        check_type("outer_device", outer_device, (str, torch.device), "a torch.device, str or None")
        try:
            torch.device(outer_device)
        except RuntimeError as error:
            raise ValueError(f"outer_device: {outer_device!r} is not a device ({error})") from None


def check_outer_average(outer_average, outer_optimizer, nprocs_per_node: int) -> None:
    if outer_average not in ("allreduce", "gossip"):
        raise ValueError(f"outer_average must be 'allreduce' or 'gossip', got {outer_average!r}")
    if outer_average == "gossip" and outer_optimizer is None:
        raise ValueError(
            "outer_average='gossip' mixes the pseudo-gradients of an outer step, but "
            "outer_optimizer is None (without one, sync_every is LocalSGD's exact average)"
        )
    if outer_average == "gossip" and nprocs_per_node > 1:
        raise ValueError(
            f"outer_average='gossip' with nprocs_per_node={nprocs_per_node}: the outer step "
            "over gossip keeps one theta_global per gossiping process, which the other processes "
            "of its machine would not share; use outer_average='allreduce' with nprocs_per_node"
        )


def check_outer_dtype(outer_dtype, outer_optimizer, outer_average) -> None:
    check_message_dtype("outer_dtype", outer_dtype)
    if outer_dtype is None:
        return
    if outer_optimizer is None:
        raise ValueError(
            f"outer_dtype={outer_dtype!r} compresses DiLoCo's pseudo-gradients, but "
            "outer_optimizer is None"
        )
    if outer_average != "allreduce":
        raise ValueError(
            f"outer_dtype={outer_dtype!r} compresses the exact outer average; with "
            f"outer_average={outer_average!r} the outer step is a gossip round, whose messages "
            "message_dtype compresses"
        )


def check_fragments(fragments, fragment_delay, fragment_alpha, outer_optimizer, sync_every) -> None:
    """Streaming DiLoCo's arguments (gossip_ext.streaming)."""
    check_type("fragments", fragments, int, "an int")
    check_type("fragment_delay", fragment_delay, int, "an int")
    check_type("fragment_alpha", fragment_alpha, (int, float), "a float")
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if fragment_delay < 0:
        raise ValueError(f"fragment_delay must be >= 0, got {fragment_delay}")
    if not 0.0 <= fragment_alpha <= 1.0:
        raise ValueError(f"fragment_alpha must be in [0, 1], got {fragment_alpha}")
    if (fragments, fragment_delay, fragment_alpha) == (1, 0, 0.0):
        return
    asked = (
        f"fragments={fragments}, fragment_delay={fragment_delay}, fragment_alpha={fragment_alpha}"
    )
    if outer_optimizer is None or not sync_every:
        raise ValueError(
            f"{asked} configure Streaming DiLoCo's outer steps, which need outer_optimizer and "
            f"sync_every (got sync_every={sync_every!r})"
        )
    if fragments > sync_every:
        raise ValueError(
            f"fragments must be at most sync_every={sync_every} (a step per fragment), got "
            f"{fragments}"
        )
    if fragment_delay >= sync_every // fragments:
        raise ValueError(
            f"fragment_delay must be < sync_every // fragments = {sync_every // fragments} (a "
            f"fragment's averaging must end before the next one starts), got {fragment_delay}"
        )


def check_outer_device(outer_device, device: torch.device) -> None:
    """theta_global lives beside the parameters or in host memory."""
    if outer_device is None:
        return
    where = torch.device(outer_device)
    if where.type != "cpu" and where != device:
        raise ValueError(
            f"outer_device must be 'cpu' or the parameters' device {device}, got {outer_device!r}"
        )


def check_localsgd(
    base_algorithm: str, global_avg_freq, slowmo_freq, sync_every, gossip_world_size: int
):
    """LocalSGD without exact averages would train every machine alone, unless there is only one
    (one machine whose processes average gradients, as fairscale's single-node case)."""
    if (
        base_algorithm == "localsgd"
        and not (global_avg_freq or slowmo_freq or sync_every)
        and gossip_world_size > 1
    ):
        raise ValueError(
            "base_algorithm='localsgd' runs no gossip, so it needs exact averages: set "
            f"sync_every (DiLoCo's outer period, with outer_optimizer; LocalSGD's without), "
            f"global_avg_freq or slowmo_freq, got sync_every={sync_every!r}, "
            f"global_avg_freq={global_avg_freq!r}, slowmo_freq={slowmo_freq!r}"
        )


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


def choose_transport(device: torch.device, comm_device, backend: str) -> str:
    """NCCL for CUDA parameters; the process-group transport for CPU parameters; host buffers
    over the process group for CUDA parameters with ``comm_device='cpu'``.

    ``backend`` is the process group's (``dist.get_backend``): host tensors need one that carries
    them, gloo in practice.
    """
    requested = None if comm_device is None else torch.device(comm_device)
    if device.type == "cpu":
        if requested is not None and requested.type != "cpu":
            raise ValueError(
                f"comm_device={comm_device!r} needs CUDA parameters, but they are on the CPU"
            )
        kind = PROCESS_GROUP
    elif device.type != "cuda":
        raise ValueError(f"parameters are on {device}; gossip_ext supports CPU and CUDA")
    elif requested is not None and requested.type == "cpu":
        kind = HOST_STAGING
    elif not hasattr(_C, "NcclTransport"):
        raise ValueError(
            f"parameters are on {device} but this gossip_ext build has no CUDA support; "
            "reinstall it with a CUDA build of torch"
        )
    else:
        return NCCL
    if backend == "nccl":
        what = "CPU parameters" if kind == PROCESS_GROUP else f"comm_device={comm_device!r}"
        raise ValueError(
            f"{what} gossip host tensors, which the process group's backend {backend!r} cannot "
            "carry; initialize it with init_process_group('cpu:gloo,cuda:nccl') or pass "
            "process_group=dist.new_group(backend='gloo')"
        )
    return kind


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


def check_dense_gradients(
    named_grads: list[tuple[str, torch.Tensor]], nprocs_per_node: int
) -> None:
    # Sparse gradients that no module announced (F.embedding(..., sparse=True) in a custom
    # forward) are only seen here, at the end of backward.
    for name, grad in named_grads:
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"parameter '{name}' got a {grad.layout} gradient, but nprocs_per_node="
                f"{nprocs_per_node} averages gradients inside a node, which needs dense ones: "
                "produce dense gradients (sparse=False), or use nprocs_per_node=1"
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
        if not ParameterWatch._hooked:
            ParameterWatch._hooked = True
            nn.modules.module.register_module_parameter_registration_hook(ParameterWatch._count)
            nn.modules.module.register_module_module_registration_hook(ParameterWatch._count)
            nn.modules.module.register_module_buffer_registration_hook(ParameterWatch._count)
        self._params = dict(named)
        # gossip_buffers=True: a buffer assigned anew (module.running_mean = t) would leave gossip.
        self._buffers = dict(gossiped_buffers)
        self._seen = ParameterWatch._registrations

    @staticmethod
    def _count(*_: Any) -> None:
        ParameterWatch._registrations += 1

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
    arguments: Mapping[str, Any],
    *,
    global_avg_freq: int,
    parameters: list[tuple[str, torch.Tensor]],
    buffers: list[tuple[str, tuple[int, ...], str]],
    outer: Any,
) -> dict[str, Any]:
    """What every rank of a GossipDataParallel must agree on (``check_ranks_agree``): the
    schedule of rounds and outer steps, and the layout of what they exchange."""
    a = arguments
    return {
        "graph": repr(a["graph"]),
        # The mixing's kind must agree, its weights need not: push-sum allows every node its
        # own column-stochastic share.
        "mixing": type(a["mixing"]).__name__,
        **{k: a[k] for k in ("push_sum", "overlap", "synch_freq", "nprocs_per_node")},
        # A 16-bit message read as 32 bits would be garbage.
        "message_dtype": str(a["message_dtype"]),
        **{k: a[k] for k in ("base_algorithm", "start_in_forward")},
        **{k: a[k] for k in ("broadcast_buffers", "gossip_buffers")},
        # Outer steps are collectives: ranks on different schedules would hang.
        "global_avg_freq": global_avg_freq,
        "outer": None
        if outer is None
        else (
            a["slowmo_freq"] or a["sync_every"],
            a["outer_average"],
            outer,
            str(a["outer_device"]),
            str(a["outer_dtype"]),
            (a["fragments"], a["fragment_delay"], float(a["fragment_alpha"])),
        ),
        "parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in parameters],
        # Averaged or gossiped with the parameters: their layout must agree too.
        "buffers": buffers,
    }


def check_ranks_agree(config: dict[str, Any], group: dist.ProcessGroup, rank: int) -> None:
    """One all-gather at construction: ranks that disagree on the schedule or the model would
    otherwise exchange mismatched messages or wait for rounds that never come."""
    configs = [None] * dist.get_world_size(group)
    dist.all_gather_object(configs, config, group=group)
    for other, theirs in enumerate(configs):
        diff = sorted(k for k in config if theirs[k] != configs[0][k])
        if diff:
            details = "; ".join(
                f"{k}: rank 0 has {configs[0][k]!r}, rank {other} has {theirs[k]!r}"
                for k in diff
                if k != "parameters"
            )
            if "parameters" in diff:
                details += "; the parameters (names, shapes or dtypes) differ"
            raise ValueError(
                f"GossipDataParallel: rank {other} was configured differently from rank 0 "
                f"(seen on rank {rank}): {details.lstrip('; ')}"
            )


def check_checkpoint(state: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """A push-sum state is only meaningful on the schedule that produced it."""
    for key, value in mine.items():
        if state.get(key) != value:
            raise ValueError(
                f"load_state_dict: the checkpoint was saved with {key}={state.get(key)!r}, "
                f"but this model has {key}={value!r}"
            )
