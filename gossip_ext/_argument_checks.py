"""Checks of the algorithm's settings in the flat keywords of earlier releases
(gossip_ext.flat_keywords), alone and together, each error naming the keyword and the value it
got; and the small checks every argument check uses. GossipDataParallel runs them on every rank
before any communication (``_validation.check_arguments``), so that bad input raises everywhere
at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gossip_ext.graphs import GraphBase
from gossip_ext.membership.epochs import parse_address
from gossip_ext.mixing import MixingBase

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


def check_outer_message_format(name: str, value) -> None:
    """An outer step's exact average may send what a gossip message may (MESSAGE_DTYPES), or
    sparse messages (a ``sparse_average.TopK``)."""
    from gossip_ext.averagings.sparse import TopK

    if isinstance(value, TopK):
        return
    try:
        check_message_dtype(name, value)
    except ValueError as error:
        raise ValueError(f"{error}; or sparse messages, TopK(density=..., bits=...)") from None


def check_type(name: str, value, expected, what: str) -> None:
    # bool is an int to isinstance: push_sum=1 or synch_freq=True are mistakes worth naming.
    if isinstance(value, bool) and expected is not bool:
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


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
    from gossip_ext.averagings.sparse_gossip import DEFAULT_CONSENSUS_STEP

    own = (f["outer_consensus_step"], f["outer_graph"])
    if f["outer_average"] != "compressed_gossip" and own != (DEFAULT_CONSENSUS_STEP, None):
        raise ValueError(
            f"outer_consensus_step={own[0]!r} and outer_graph={own[1]!r} configure "
            f"outer_average='compressed_gossip', but outer_average is {f['outer_average']!r}"
        )
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
    if f["membership"] is not None and f["outer_average"] == "compressed_gossip":
        raise ValueError(
            f"membership={f['membership']!r} with outer_average='compressed_gossip' "
            "(ByCompressedGossip): a worker's public copy is held by its neighbours on a fixed "
            "graph, which every membership epoch changes; an elastic job averages its outer steps "
            "exactly (Exact, sparse messages included) or by ByGossip"
        )


def check_membership(membership, min_workers, process_group, nprocs_per_node) -> None:
    """An elastic job (gossip_ext.membership.elastic) builds its own process groups, one machine a
    worker."""
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
    if outer_average not in ("allreduce", "gossip", "compressed_gossip"):
        raise ValueError(
            "outer_average must be 'allreduce', 'gossip' or 'compressed_gossip', got "
            f"{outer_average!r}"
        )
    if outer_average != "allreduce" and outer_optimizer is None:
        raise ValueError(
            f"outer_average={outer_average!r} mixes the pseudo-gradients of an outer step, but "
            "outer_optimizer is None (without one, sync_every is LocalSGD's exact average)"
        )
    if outer_average != "allreduce" and nprocs_per_node > 1:
        raise ValueError(
            f"outer_average={outer_average!r} with nprocs_per_node={nprocs_per_node}: the outer "
            "step over gossip keeps one theta_global per gossiping process, which the other "
            "processes of its machine would not share; use outer_average='allreduce' with "
            "nprocs_per_node"
        )


def check_outer_dtype(outer_dtype, outer_optimizer, outer_average) -> None:
    from gossip_ext.averagings.sparse import TopK

    check_outer_message_format("outer_dtype", outer_dtype)
    if outer_average == "compressed_gossip" and not isinstance(outer_dtype, TopK):
        raise ValueError(
            "outer_average='compressed_gossip' sends sparse messages: outer_dtype must be a "
            f"TopK(...), got {outer_dtype!r}"
        )
    if outer_dtype is None:
        return
    if outer_optimizer is None:
        raise ValueError(
            f"outer_dtype={outer_dtype!r} compresses DiLoCo's pseudo-gradients, but "
            "outer_optimizer is None"
        )
    if outer_average == "compressed_gossip":
        return
    if outer_average != "allreduce":
        raise ValueError(
            f"outer_dtype={outer_dtype!r} compresses the exact outer average; with "
            f"outer_average={outer_average!r} the outer step is a gossip round, whose messages "
            "message_dtype compresses"
        )


def check_fragments(fragments, fragment_delay, fragment_alpha, outer_optimizer, sync_every) -> None:
    """Streaming DiLoCo's arguments (gossip_ext.outer.streaming)."""
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
