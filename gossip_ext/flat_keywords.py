"""The flat keywords of earlier releases (``GossipDataParallel(net, overlap=True,
sync_every=64, outer_optimizer=...)``, and SGP's and fairscale's names through
gossip_ext.compat) and the algorithm objects of gossip_ext.algorithms: one translation each way.

:func:`from_flat` gives the objects a flat configuration stands for; :func:`to_flat` gives the
flat settings objects stand for, the configuration the runtime parts (``inner``, ``outer``,
``elastic``) are built from and the ranks compare.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gossip_ext import _validation
from gossip_ext.algorithms import (
    SGP,
    Average,
    ByCollective,
    ByCompressedGossip,
    ByGossip,
    DiLoCo,
    Elastic,
    PushPull,
    SlowMo,
)
from gossip_ext.averagings.sparse_gossip import DEFAULT_CONSENSUS_STEP
from gossip_ext.graphs import NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import UniformMixing

# The flat keywords an object can stand for, with the wrapper's defaults: to_flat() starts here.
FLAT_DEFAULTS: dict[str, Any] = {
    "graph": None,
    "mixing": None,
    "push_sum": True,
    "overlap": False,
    "synch_freq": 0,
    "check_finite": True,
    "message_dtype": None,
    "start_in_forward": False,
    "base_algorithm": "sgp",
    "global_avg_freq": None,
    "slowmo_freq": None,
    "slowmo_momentum": 0.5,
    "slowmo_lr": 1.0,
    "slowmo_memory_efficient": False,
    "slowmo_num_shards": None,
    "outer_optimizer": None,
    "sync_every": None,
    "outer_average": "allreduce",
    "outer_device": None,
    "outer_dtype": None,
    # ByCompressedGossip's, with outer_average="compressed_gossip"
    "outer_consensus_step": DEFAULT_CONSENSUS_STEP,
    "outer_graph": None,
    "fragments": 1,
    "fragment_delay": 0,
    "fragment_alpha": 0.0,
    "membership": None,
    "min_workers": 1,
}

Gossip = SGP | None  # PushPull is an SGP
Outer = Average | SlowMo | DiLoCo | None


def to_flat(gossip: Gossip, outer: Outer, membership: Elastic | None) -> dict[str, Any]:
    """The flat settings the objects stand for (FLAT_DEFAULTS where they say nothing)."""
    if gossip is not None and not isinstance(gossip, SGP):
        raise TypeError(
            f"gossip must be SGP(...), PushPull(...) or None, got {type(gossip).__name__} "
            f"{gossip!r}"
        )
    if outer is not None and not isinstance(outer, (Average, SlowMo, DiLoCo)):
        raise TypeError(
            f"outer must be Average(...), SlowMo(...), DiLoCo(...) or None, got "
            f"{type(outer).__name__} {outer!r}"
        )
    if membership is not None and not isinstance(membership, Elastic):
        raise TypeError(
            f"membership must be Elastic(...) or None, got {type(membership).__name__} "
            f"{membership!r}"
        )
    flat = dict(FLAT_DEFAULTS)
    if gossip is None:
        flat["base_algorithm"] = "localsgd"
    else:
        flat.update(gossip.flat())
    if outer is not None:
        flat.update(outer.flat(gossips=gossip is not None))
    if membership is not None:
        flat.update(membership=membership.address, min_workers=membership.min_workers)
    return flat


def from_flat(flat: Mapping[str, Any]) -> tuple[Gossip, Outer, Elastic | None]:
    """The objects that a flat configuration (keywords of FLAT_DEFAULTS, the others defaulted)
    stands for. The flat configuration must be valid (_validation.check_arguments)."""
    unknown = set(flat) - set(FLAT_DEFAULTS)
    if unknown:
        raise TypeError(f"from_flat: unknown settings {sorted(unknown)}")
    f = dict(FLAT_DEFAULTS, **flat)
    gossips = f["base_algorithm"] == "sgp"
    gossip = None
    if gossips:
        kind = SGP if f["push_sum"] else PushPull
        gossip = kind(
            graph=f["graph"],
            mixing=f["mixing"],
            overlap=f["overlap"],
            synch_freq=f["synch_freq"],
            message_dtype=f["message_dtype"],
            check_finite=f["check_finite"],
            start_in_forward=f["start_in_forward"],
        )
    outer = None
    if f["slowmo_freq"]:
        outer = SlowMo(
            every=f["slowmo_freq"],
            momentum=f["slowmo_momentum"],
            lr=f["slowmo_lr"],
            memory_efficient=f["slowmo_memory_efficient"],
            num_shards=f["slowmo_num_shards"],
            average_every=f["global_avg_freq"] or None,
        )
    elif f["outer_optimizer"] is not None:
        if f["outer_average"] == "compressed_gossip":
            average = ByCompressedGossip(
                message=f["outer_dtype"],
                consensus_step=f["outer_consensus_step"],
                graph=f["outer_graph"],
            )
        elif f["outer_average"] == "gossip":
            average = (
                ByGossip()
                if gossips
                else ByGossip(
                    graph=f["graph"], mixing=f["mixing"], message_dtype=f["message_dtype"]
                )
            )
        else:
            average = ByCollective(dtype=f["outer_dtype"], device=f["outer_device"])
        outer = DiLoCo(
            optimizer=f["outer_optimizer"],
            every=f["sync_every"],
            average=average,
            fragments=f["fragments"],
            delay=f["fragment_delay"],
            alpha=f["fragment_alpha"],
        )
    elif f["global_avg_freq"] or f["sync_every"]:
        outer = Average(every=f["global_avg_freq"] or f["sync_every"])
    membership = None
    if f["membership"] is not None:
        membership = Elastic(f["membership"], min_workers=f["min_workers"])
    return gossip, outer, membership


# What GossipDataParallel's gossip= defaults to when not given: SGP(), unless flat keywords say
# otherwise.
DEFAULT_GOSSIP = object()


def settings(gossip, outer, membership, flat: dict[str, Any], **common: Any) -> tuple:
    """GossipDataParallel's (objects, settings): the (gossip, outer, membership) objects, given
    as objects or as flat keywords, and every setting by name (their flat settings with the
    default graph and mixing, and the ``common`` arguments), checked on their own and together
    (``_validation.check_arguments``)."""
    objects = _objects_of(gossip, outer, membership, flat)
    every = _with_default_graph(dict(to_flat(*objects), **common))
    _validation.check_arguments(**every)
    return objects, every


def _objects_of(gossip, outer, membership, flat: dict[str, Any]) -> tuple:
    """The (gossip, outer, membership) objects, from the objects given or from the flat keywords
    of earlier releases (translated by from_flat after the flat checks, so that their
    errors read as before); not from both."""
    if membership is not None and not isinstance(membership, Elastic):
        # The flat spelling, "HOST:PORT" (whose check names anything else given there).
        flat = dict(flat, membership=membership)
        membership = None
    unknown = sorted(set(flat) - set(FLAT_DEFAULTS))
    if unknown:
        raise TypeError(f"GossipDataParallel got unexpected keyword arguments {unknown}")
    if not flat:
        return (SGP() if gossip is DEFAULT_GOSSIP else gossip), outer, membership
    given = [
        name
        for name, value in (("gossip", gossip), ("outer", outer), ("membership", membership))
        if value is not None and value is not DEFAULT_GOSSIP
    ]
    if given:
        raise TypeError(
            f"GossipDataParallel: {', '.join(given)} given as objects beside the flat keywords "
            f"{sorted(flat)}: give the algorithm one way (see gossip_ext.algorithms)"
        )
    _validation.check_flat(_with_default_graph(dict(FLAT_DEFAULTS, **flat)))
    return from_flat(flat)


def _with_default_graph(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with the graph and mixing a gossip object leaves unsaid: the 1-peer
    exponential graph and uniform mixing."""
    if settings["graph"] is None:
        settings["graph"] = NPeerDynamicDirectedExponentialGraph()
    if settings["mixing"] is None:
        settings["mixing"] = UniformMixing()
    return settings
