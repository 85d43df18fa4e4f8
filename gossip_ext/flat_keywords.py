"""The flat keywords of earlier releases (``GossipDataParallel(net, overlap=True,
sync_every=64, outer_optimizer=...)``, and SGP's and fairscale's names through
gossip_ext.compat), translated once, at the edge, into the algorithm objects the runtime reads.

:func:`from_flat` gives the objects a flat configuration stands for, each made in the flat
spelling, so that its own checks name the keyword the user wrote (``slowmo_momentum must be in
[0, 1)``, not ``SlowMo(momentum=...)``); :func:`to_flat` gives the keywords objects stand for.
What is checked here is only what the flat spelling itself can get wrong: a keyword's "off"
values, keywords that configure an object no other keyword asked for, and two keywords that
schedule the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gossip_ext.algorithms import (
    SGP,
    Average,
    ByCollective,
    ByCompressedGossip,
    ByGossip,
    Configuration,
    DiLoCo,
    Elastic,
    PushPull,
    SlowMo,
)
from gossip_ext.algorithms._base import Algorithm, Spelling, check_type, spelled
from gossip_ext.averagings.sparse_gossip import DEFAULT_CONSENSUS_STEP

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

# Which keyword sets which object's argument ("Class.argument"; a subclass finds its base's).
_KEYWORDS = {
    "SlowMo.every": "slowmo_freq",
    "SlowMo.momentum": "slowmo_momentum",
    "SlowMo.lr": "slowmo_lr",
    "SlowMo.memory_efficient": "slowmo_memory_efficient",
    "SlowMo.num_shards": "slowmo_num_shards",
    "SlowMo.average_every": "global_avg_freq",
    "DiLoCo.optimizer": "outer_optimizer",
    "DiLoCo.every": "sync_every",
    "DiLoCo.average": "outer_average",
    "DiLoCo.delay": "fragment_delay",
    "DiLoCo.alpha": "fragment_alpha",
    "ByCollective.dtype": "outer_dtype",
    "ByCollective.device": "outer_device",
    "ByCompressedGossip.message": "outer_dtype",
    "ByCompressedGossip.consensus_step": "outer_consensus_step",
    "ByCompressedGossip.graph": "outer_graph",
    "Elastic.address": "membership",
}
OUTER_AVERAGES = ("allreduce", "gossip", "compressed_gossip")

Gossip = SGP | None  # PushPull is an SGP
Outer = Average | SlowMo | DiLoCo | None


class FlatSpelling(Spelling):
    """Errors about objects that flat keywords stood for name those keywords (``flat``: every
    keyword of FLAT_DEFAULTS, as given or defaulted)."""

    def __init__(self, flat: Mapping[str, Any]):
        self._flat = flat
        # One object, two keywords: name the one that was written.
        every = "global_avg_freq" if flat["global_avg_freq"] else "sync_every"
        self._keywords = dict(_KEYWORDS, **{"Average.every": every})

    def _keyword(self, owner: Any, name: str) -> str:
        for cls in type(owner).__mro__:
            keyword = self._keywords.get(f"{cls.__name__}.{name}")
            if keyword is not None:
                return keyword
        return name  # the same word in both spellings (overlap, fragments, min_workers, ...)

    def argument(self, owner: Any, name: str) -> str:
        return self._keyword(owner, name)

    def setting(self, owner: Any, name: str) -> str:
        return f"{self._keyword(owner, name)}={getattr(owner, name)!r}"

    def value(self, owner: Any, name: str) -> str:
        return self.setting(owner, name)

    def object(self, obj: Any, role: str) -> str:
        if role == "average":
            return f"outer_average={obj.flat(gossips=True).get('outer_average', 'allreduce')!r}"
        if role == "membership":
            return f"membership={obj.address!r}"
        return super().object(obj, role)

    def nothing_averages(self, gossip: Any, outer: Any) -> str:
        f = self._flat
        return (
            "base_algorithm='localsgd' runs no gossip, so it needs exact averages: set "
            "sync_every (DiLoCo's outer period, with outer_optimizer; LocalSGD's without), "
            f"global_avg_freq or slowmo_freq, got sync_every={f['sync_every']!r}, "
            f"global_avg_freq={f['global_avg_freq']!r}, slowmo_freq={f['slowmo_freq']!r}"
        )


def from_flat(flat: Mapping[str, Any]) -> tuple[Gossip, Outer, Elastic | None]:
    """The objects that a flat configuration (keywords of FLAT_DEFAULTS, the others defaulted)
    stands for, each checked as it is made, its errors naming the flat keywords."""
    unknown = set(flat) - set(FLAT_DEFAULTS)
    if unknown:
        raise TypeError(f"from_flat: unknown settings {sorted(unknown)}")
    f = dict(FLAT_DEFAULTS, **flat)
    _check_flat_spelling(f)
    with spelled(FlatSpelling(f)):
        return _objects(f)


def _objects(f: Mapping[str, Any]) -> tuple[Gossip, Outer, Elastic | None]:
    gossips = f["base_algorithm"] == "sgp"
    gossip = None
    if gossips:
        gossip = (SGP if f["push_sum"] else PushPull)(
            graph=f["graph"],
            mixing=f["mixing"],
            overlap=f["overlap"],
            synch_freq=f["synch_freq"],
            message_dtype=f["message_dtype"],
            check_finite=f["check_finite"],
            start_in_forward=f["start_in_forward"],
        )
    # fairscale's slowmo_* keywords are checked even where slowmo_freq leaves SlowMo off, as
    # fairscale checks them: a typo shows before the run that would use it.
    slowmo = SlowMo(
        every=f["slowmo_freq"] or 1,
        momentum=f["slowmo_momentum"],
        lr=f["slowmo_lr"],
        memory_efficient=f["slowmo_memory_efficient"],
        num_shards=f["slowmo_num_shards"],
        average_every=f["global_avg_freq"] or None,
    )
    outer = None
    if f["slowmo_freq"]:
        outer = slowmo
    elif f["outer_optimizer"] is not None:
        outer = DiLoCo(
            optimizer=f["outer_optimizer"],
            every=f["sync_every"],
            average=_average(f, gossips),
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


def _average(f: Mapping[str, Any], gossips: bool):
    if f["outer_average"] == "compressed_gossip":
        return ByCompressedGossip(
            message=f["outer_dtype"],
            consensus_step=f["outer_consensus_step"],
            graph=f["outer_graph"],
        )
    if f["outer_average"] == "gossip":
        if gossips:
            return ByGossip()  # on the inner mix's engine, with its graph and messages
        return ByGossip(graph=f["graph"], mixing=f["mixing"], message_dtype=f["message_dtype"])
    return ByCollective(dtype=f["outer_dtype"], device=f["outer_device"])


def _check_flat_spelling(f: Mapping[str, Any]) -> None:
    """What only the flat spelling can get wrong: "off" values, keywords that configure an object
    no other keyword asked for, and two keywords for one step. Every object's own arguments are
    checked by the object (in ``_objects``)."""
    check_type("push_sum", f["push_sum"], bool, "a bool")
    if f["base_algorithm"] not in ("sgp", "localsgd"):
        raise ValueError(f"base_algorithm must be 'sgp' or 'localsgd', got {f['base_algorithm']!r}")
    for name in ("global_avg_freq", "slowmo_freq"):
        if f[name] is not None:
            check_type(name, f[name], int, "an int or None")
            if f[name] < 0:
                raise ValueError(f"{name} must be >= 0 (0 or None: off), got {f[name]}")
    optimizer, sync_every = f["outer_optimizer"], f["sync_every"]
    if sync_every is not None:
        check_type("sync_every", sync_every, int, "an int or None")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 (None: no outer step), got {sync_every}")
    if optimizer is not None and sync_every is None:
        raise ValueError(
            "outer_optimizer needs sync_every, the inner steps between two outer steps, got "
            "sync_every=None"
        )
    for other in ("global_avg_freq", "slowmo_freq"):
        if sync_every and f[other]:
            raise ValueError(
                f"sync_every={sync_every} and {other}={f[other]} both schedule an outer step "
                "(sync_every without outer_optimizer is LocalSGD's plain average); choose one"
            )
    _check_outer_keywords(f)
    if f["membership"] is None and f["min_workers"] != 1:
        raise ValueError(
            f"min_workers={f['min_workers']!r} applies to an elastic job, but membership is None"
        )


def _check_outer_keywords(f: Mapping[str, Any]) -> None:
    """The keywords of DiLoCo's averaging and fragments, which only outer_optimizer turns on."""
    optimizer, average, dtype = f["outer_optimizer"], f["outer_average"], f["outer_dtype"]
    if average not in OUTER_AVERAGES:
        raise ValueError(
            f"outer_average must be 'allreduce', 'gossip' or 'compressed_gossip', got {average!r}"
        )
    if average != "allreduce" and optimizer is None:
        raise ValueError(
            f"outer_average={average!r} mixes the pseudo-gradients of an outer step, but "
            "outer_optimizer is None (without one, sync_every is LocalSGD's exact average)"
        )
    if f["outer_device"] is not None and optimizer is None:
        raise ValueError(
            f"outer_device={f['outer_device']!r} places the outer optimizer's state, but "
            "outer_optimizer is None"
        )
    own = (f["outer_consensus_step"], f["outer_graph"])
    if average != "compressed_gossip" and own != (DEFAULT_CONSENSUS_STEP, None):
        raise ValueError(
            f"outer_consensus_step={own[0]!r} and outer_graph={own[1]!r} configure "
            f"outer_average='compressed_gossip', but outer_average is {average!r}"
        )
    if average == "compressed_gossip" and dtype is None:
        raise ValueError(
            "outer_average='compressed_gossip' sends sparse messages: outer_dtype must be a "
            f"TopK(...), got {dtype!r}"
        )
    if dtype is not None and optimizer is None:
        raise ValueError(
            f"outer_dtype={dtype!r} compresses DiLoCo's pseudo-gradients, but outer_optimizer "
            "is None"
        )
    if dtype is not None and average == "gossip":
        raise ValueError(
            f"outer_dtype={dtype!r} compresses the exact outer average; with "
            f"outer_average={average!r} the outer step is a gossip round, whose messages "
            "message_dtype compresses"
        )
    streaming = (f["fragments"], f["fragment_delay"], f["fragment_alpha"])
    if streaming != (1, 0, 0.0) and (optimizer is None or not f["sync_every"]):
        raise ValueError(
            f"fragments={streaming[0]}, fragment_delay={streaming[1]}, fragment_alpha="
            f"{streaming[2]} configure Streaming DiLoCo's outer steps, which need outer_optimizer "
            f"and sync_every (got sync_every={f['sync_every']!r})"
        )


def to_flat(gossip: Gossip, outer: Outer, membership: Elastic | None) -> dict[str, Any]:
    """The flat keywords the objects stand for (FLAT_DEFAULTS where they say nothing), after
    checking that they go together."""
    Configuration(gossip, outer, membership)
    flat = dict(FLAT_DEFAULTS)
    if gossip is None:
        flat["base_algorithm"] = "localsgd"
    else:
        flat.update(gossip.flat())
    if outer is not None:
        flat.update(outer.flat(gossips=gossip is not None))
    if membership is not None:
        # No flat keyword sets a job's name or its timings: refused rather than dropped.
        unspellable = {
            name: value
            for name, value in membership.describe().items()
            if name in ("job", "heartbeat_s", "silent_s")
            and value != getattr(type(membership), name, value)
        }
        if unspellable:
            settings = ", ".join(f"{name}={value!r}" for name, value in unspellable.items())
            raise ValueError(
                f"membership={type(membership).__name__}(..., {settings}): no flat keyword "
                "sets these; pass the Elastic object itself"
            )
        flat.update(membership=membership.address, min_workers=membership.min_workers)
    return flat


# What GossipDataParallel's gossip= defaults to when not given: SGP(), unless flat keywords say
# otherwise.
DEFAULT_GOSSIP = object()


def configuration(gossip, outer, membership, flat: dict[str, Any], **common: Any) -> Configuration:
    """GossipDataParallel's configuration: the (gossip, outer, membership) objects, given as
    objects or as flat keywords (not both), with the ``common`` settings, checked together."""
    if membership is not None and not isinstance(membership, Algorithm):
        # The flat spelling, "HOST:PORT" (whose check names anything else given there).
        flat = dict(flat, membership=membership)
        membership = None
    unknown = sorted(set(flat) - set(FLAT_DEFAULTS))
    if unknown:
        raise TypeError(f"GossipDataParallel got unexpected keyword arguments {unknown}")
    if not flat:
        gossip = SGP() if gossip is DEFAULT_GOSSIP else gossip
        return Configuration(gossip, outer, membership, **common)
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
    objects = from_flat(flat)
    return Configuration(*objects, **common, spelling=FlatSpelling(dict(FLAT_DEFAULTS, **flat)))
