"""The types and argument checks of :mod:`gossip_ext.compat.fairscale`: fairscale's
``SlowMoBaseAlgorithm``, the machine layout, and the checks that name fairscale's arguments.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gossip_ext import _plain_messages
from gossip_ext.compat.sgp import GraphManager, MixingManager
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase


class SlowMoBaseAlgorithm(str, Enum):
    """The approximate averaging between SlowMo steps: LocalSGD or Stochastic Gradient Push."""

    LOCALSGD = "localsgd"
    SGP = "sgp"


class _Layout(NamedTuple):
    """Where this process sits: fairscale's ``logical`` values count one process per node."""

    process_rank: int
    process_world_size: int
    logical_rank: int
    logical_world_size: int
    local_rank: int

    @property
    def nprocs_per_node(self) -> int:
        return self.process_world_size // self.logical_world_size

    @property
    def single_node(self) -> bool:
        return self.process_world_size > self.logical_world_size == 1


# ----------------------------------------------------------------------------- argument checks


def _check_type(
    name: str, value: Any, expected: type | tuple[type, ...], what: str | None = None
) -> None:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if what is None:
        what = " or ".join("None" if t is type(None) else f"a {t.__name__}" for t in kinds)
    # bool is an int to isinstance: slowmo_frequency=True is a mistake worth naming.
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_arguments(**arguments: Any) -> SlowMoBaseAlgorithm:
    """The arguments on their own; returns the base algorithm."""
    for name in (
        "broadcast_buffers",
        "slowmo_memory_efficient",
        "push_sum",
        "overlap",
        "use_streams",
        "slowmo_sgp_average_params",
        "verbose",
        "profile_mode",
    ):
        _check_type(name, arguments[name], bool)
    for name in (
        "nprocs_per_node",
        "slowmo_frequency",
        "slowmo_num_shards",
        "localsgd_frequency",
        "synch_freq",
    ):
        _check_type(name, arguments[name], int)
    for name in ("slowmo_momentum", "slowmo_lr"):
        _check_type(name, arguments[name], (int, float))
    _check_positive("nprocs_per_node", arguments["nprocs_per_node"])
    if arguments["synch_freq"] < 0:
        raise ValueError(f"synch_freq must be >= 0, got {arguments['synch_freq']}")
    if arguments["overlap"]:
        raise ValueError(
            "overlap=True: SlowMoDistributedDataParallel runs synchronous SGP only, as fairscale "
            "does (it asserts overlap is False); use gossip_ext.GossipDataParallel(overlap=True) "
            "for gossip that overlaps the next step"
        )
    algorithm = arguments["slowmo_base_algorithm"]
    try:
        return SlowMoBaseAlgorithm(algorithm)
    except ValueError:
        raise ValueError(
            f"slowmo_base_algorithm must be SlowMoBaseAlgorithm.LOCALSGD or "
            f"SlowMoBaseAlgorithm.SGP, got {algorithm!r}"
        ) from None


def _check_layout(
    nprocs_per_node: int,
    process_rank: int | None,
    process_world_size: int | None,
    global_group: dist.ProcessGroup | None,
    master_group: Any,
    local_node_group: Any,
) -> _Layout:
    """This process's place, with the ranks and groups given checked against it."""
    rank = dist.get_rank(global_group)
    world_size = dist.get_world_size(global_group)
    if rank < 0:
        raise ValueError("global_group does not contain this process")
    for name, given, actual in (
        ("process_rank", process_rank, rank),
        ("process_world_size", process_world_size, world_size),
    ):
        if given is not None:
            _check_type(name, given, int)
            if given != actual:
                raise ValueError(
                    f"{name}={given}, but this process has {name.removeprefix('process_')} "
                    f"{actual} in {'global_group' if global_group else 'the default group'}"
                )
    m = nprocs_per_node
    if world_size % m != 0:
        raise ValueError(
            f"nprocs_per_node ({m}) must divide the world size ({world_size}): every node runs "
            "the same number of processes"
        )
    members = dist.get_process_group_ranks(global_group or dist.group.WORLD)
    node = rank // m
    if m > 1:
        _check_group("local_node_group", local_node_group, members[node * m : (node + 1) * m])
    leaders = members[::m]
    _check_group("master_group", master_group, leaders, member=rank % m == 0)
    return _Layout(rank, world_size, node, world_size // m, rank % m)


def _check_group(name: str, group: Any, expected: list[int], member: bool = True) -> None:
    """A group given must hold ``expected`` (global ranks); a process outside it holds the
    placeholder ``dist.new_group`` gives non-members."""
    if group is None:
        return
    if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
        if member:
            raise ValueError(
                f"{name} does not contain this process (rank {dist.get_rank()}), but the node "
                f"layout needs {expected} (consecutive ranks per node, the first process of each "
                "node leading it)"
            )
        return
    _check_type(name, group, dist.ProcessGroup)
    ranks = dist.get_process_group_ranks(group)
    if ranks != expected:
        raise ValueError(
            f"{name} holds ranks {ranks}, but the node layout needs {expected} (consecutive "
            "ranks per node, the first process of each node leading it)"
        )


_GRAPHS = "a gossip_ext.compat.sgp graph (a GraphManager), a gossip_ext graph or None"
_MIXINGS = "a gossip_ext.compat.sgp mixing (UniformMixing), a gossip_ext mixing or None"


def _core_graph(graph: Any, layout: _Layout) -> GraphBase | None:
    if graph is None or isinstance(graph, GraphBase):
        return graph
    _check_type("graph", graph, GraphManager, _GRAPHS)
    mine = (layout.logical_rank, layout.logical_world_size, layout.nprocs_per_node)
    if (graph.rank, graph.world_size, graph.nprocs_per_node) != mine:
        raise ValueError(
            f"graph={graph!r} was built for another process: this is node {mine[0]} of "
            f"{mine[1]} with nprocs_per_node={mine[2]}; build it as "
            f"{type(graph).__name__}({mine[0]}, {mine[1]}, {mine[2]}, {layout.local_rank})"
        )
    return graph.core_graph


def _core_mixing(mixing: Any) -> MixingBase | None:
    if mixing is None or isinstance(mixing, MixingBase):
        return mixing
    _check_type("mixing", mixing, MixingManager, _MIXINGS)
    return mixing.core_mixing  # raises TypeError for a mixing without an equivalent


def _check_optimizer(optimizer: Any, fp32_params: Any) -> None:
    _check_type("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if fp32_params is not None:
        raise ValueError(
            f"fp32_params={type(fp32_params).__name__}: fairscale's fp16 error feedback is not "
            "supported; wrap the 16-bit parameters directly (averages and SlowMo accumulate "
            "them in float32) or train in float32 under torch.autocast"
        )
    stash = getattr(optimizer, "_amp_stash", None)
    if stash is not None and hasattr(stash, "fp16_groups"):
        raise ValueError(
            f"optimizer {type(optimizer).__name__} is apex amp's fp16 optimizer, whose float32 "
            "master weights fairscale corrects with error feedback, which is not supported; use "
            "torch.autocast, or wrap the 16-bit parameters directly"
        )


# A rank's error in _raise_on_every_rank: none, or (its type's name, its message).
_ERROR = _plain_messages.OneOf(None, (str, str))


def _raise_on_every_rank(error: Exception | None, group: Any) -> None:
    """Raises on every rank of ``group`` when any rank found an error (one all-gather)."""
    if not isinstance(group, dist.ProcessGroup):
        group = None  # a global_group of the wrong type is an error every rank found
    elif dist.get_rank(group) < 0:
        raise error  # outside global_group: no one to tell
    mine = None if error is None else (type(error).__name__, str(error))
    # JSON, never a pickle: what another process sends is only ever parsed.
    errors = _plain_messages.all_gather(mine, group, "an argument check's error", _ERROR)
    if error is not None:
        raise error
    for rank, theirs in enumerate(errors):
        if theirs is not None:
            kind = TypeError if theirs[0] == "TypeError" else ValueError
            raise kind(f"SlowMoDistributedDataParallel on rank {rank}: {theirs[1]}")
