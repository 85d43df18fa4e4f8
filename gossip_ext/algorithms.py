"""What GossipDataParallel does, as objects: the inner mix, the outer step, the membership.

    model = GossipDataParallel(
        net,
        gossip=SGP(graph=RingGraph(), overlap=True, message_dtype="int8"),  # or PushPull(), None
        outer=DiLoCo(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                     every=64, average=Exact(dtype="int4"), fragments=4, delay=1),
        membership=Elastic("10.0.0.1:29600", min_workers=3),  # or None: a static job
    )

- ``gossip``: what happens between steps. :class:`SGP` (push-sum over a directed graph, the
  default), :class:`PushPull` (D-PSGD: symmetric pairs, no weights), or ``None``: no gossip, the
  workers train alone between outer steps (LocalSGD, DiLoCo).
- ``outer``: what happens every few steps. :class:`Average` (an exact average), :class:`SlowMo`
  (SlowMo's heavy ball on the average), :class:`DiLoCo` (an outer optimizer on the averaged
  pseudo-gradient, streamed in fragments when ``fragments > 1``), or ``None``.
  :class:`Exact` and :class:`ByGossip` say how an outer step averages.
- ``membership``: :class:`Elastic` (workers come and go; gossip_ext.membership) or ``None``.

Each object checks its own arguments when it is made, naming the argument and the value it got;
what no single object can check (a combination of them, the module, the process group) is checked
by the wrapper. Objects are frozen values: equal objects configure the same training, and every
rank must be given equal ones (the wrapper compares them across ranks).

The flat keywords of earlier releases, and SGP's and fairscale's through gossip_ext.compat, are
translated by :func:`from_flat` into these objects; :func:`to_flat` is its inverse, the
configuration the runtime parts are built from.

Adding an algorithm: a new frozen class here with its checks and its ``flat()`` (the settings it
stands for), and the runtime part it selects in ``inner`` (a way to mix) or ``outer`` /
``outer_rules`` (an outer step); register it in :func:`from_flat` if a flat spelling exists.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gossip_ext.epochs import parse_address
from gossip_ext.graphs import GraphBase
from gossip_ext.mixing import MixingBase

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
    "fragments": 1,
    "fragment_delay": 0,
    "fragment_alpha": 0.0,
    "membership": None,
    "min_workers": 1,
}

MESSAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, "int8", "int4")


def _where(obj: Any, name: str) -> str:
    return f"{type(obj).__name__}({name}=...)"


def _check_type(obj: Any, name: str, value: Any, expected, what: str) -> None:
    # bool is an int to isinstance, never to these arguments.
    allowed = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in allowed:
        raise TypeError(f"{_where(obj, name)}: {name} must be {what}, got {value!r}")
    if not isinstance(value, expected):
        raise TypeError(
            f"{_where(obj, name)}: {name} must be {what}, got {type(value).__name__} {value!r}"
        )


def _check_every(obj: Any, value: Any) -> None:
    _check_type(obj, "every", value, int, "an int")
    if value < 1:
        raise ValueError(f"{_where(obj, 'every')}: every must be >= 1 (steps), got {value}")


def _check_message_dtype(obj: Any, name: str, value: Any) -> None:
    if value is None or (
        isinstance(value, (str, torch.dtype)) and any(value == d for d in MESSAGE_DTYPES)
    ):
        return
    raise ValueError(
        f"{_where(obj, name)}: {name} must be torch.bfloat16, torch.float16, "
        f"torch.float8_e4m3fn, 'int8', 'int4' or None (full precision), got {value!r}"
    )


# ----------------------------------------------------------------------------- the inner mix


@dataclasses.dataclass(frozen=True)
class SGP:
    """Stochastic Gradient Push: after every optimizer step, a push-sum round over ``graph``
    (default: :class:`~gossip_ext.NPeerDynamicDirectedExponentialGraph`) with ``mixing``'s
    weights (default: uniform). ``overlap``: the round runs during the next step and is absorbed
    after it (``start_in_forward``: started by the forward, as SGP's reference does);
    ``synch_freq``: up to that many steps may go on while a round is late; ``message_dtype``:
    what a message is sent as (bfloat16, float16, float8_e4m3fn, 'int8', 'int4', with the
    rounding error kept and sent later); ``check_finite``: a NaN or Inf received raises, naming
    the sender."""

    graph: GraphBase | None = None
    mixing: MixingBase | None = None
    overlap: bool = False
    synch_freq: int = 0
    message_dtype: torch.dtype | str | None = None
    check_finite: bool = True
    start_in_forward: bool = False

    push_sum = True  # what sets PushPull apart

    def __post_init__(self) -> None:
        if self.graph is not None:
            _check_type(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
        if self.mixing is not None:
            _check_type(self, "mixing", self.mixing, MixingBase, "a gossip_ext mixing")
        for name in ("overlap", "check_finite", "start_in_forward"):
            _check_type(self, name, getattr(self, name), bool, "a bool")
        _check_type(self, "synch_freq", self.synch_freq, int, "an int")
        if self.synch_freq < 0:
            raise ValueError(f"{_where(self, 'synch_freq')}: must be >= 0, got {self.synch_freq}")
        if self.overlap and self.synch_freq > 0:
            raise ValueError(
                f"{type(self).__name__}: overlap=True and synch_freq={self.synch_freq} are two "
                "different schedules for absorbing rounds; choose one"
            )
        if self.start_in_forward and not self.overlap:
            raise ValueError(
                f"{type(self).__name__}: start_in_forward=True needs overlap=True: a "
                "synchronous round is absorbed by the same forward that would start it"
            )
        _check_message_dtype(self, "message_dtype", self.message_dtype)

    def flat(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "mixing": self.mixing,
            "push_sum": self.push_sum,
            "overlap": self.overlap,
            "synch_freq": self.synch_freq,
            "message_dtype": self.message_dtype,
            "check_finite": self.check_finite,
            "start_in_forward": self.start_in_forward,
            "base_algorithm": "sgp",
        }


@dataclasses.dataclass(frozen=True)
class PushPull(SGP):
    """D-PSGD: every round averages with peers that send back (a graph whose rounds pair ranks
    symmetrically: DynamicBipartiteExponentialGraph, DynamicBipartiteLinearGraph,
    HypercubeGraph, RingGraph(peers_per_itr=2)), with no push-sum weights. Same arguments as
    :class:`SGP`."""

    push_sum = False


# ----------------------------------------------------------------------------- outer steps


@dataclasses.dataclass(frozen=True)
class Exact:
    """An outer step's average by one all-reduce, of ``dtype`` (DiLoCo's pseudo-gradients only:
    bfloat16, float16, float8_e4m3fn, 'int8', 'int4', the rounding error kept; None: full
    precision), DiLoCo's global parameters kept on ``device`` ('cpu' or the parameters')."""

    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        _check_message_dtype(self, "dtype", self.dtype)
        if self.device is not None:
            _check_type(self, "device", self.device, (str, torch.device), "a torch.device or str")
            try:
                torch.device(self.device)
            except RuntimeError as error:
                raise ValueError(
                    f"{_where(self, 'device')}: {self.device!r} is not a device ({error})"
                ) from None


@dataclasses.dataclass(frozen=True)
class ByGossip:
    """An outer step's average by one gossip round of the inner mix's engine (DiLoCo's
    pseudo-gradients mixed with a few peers instead of all). With ``gossip=None`` the round
    needs a graph, mixing and message dtype of its own, given here."""

    graph: GraphBase | None = None
    mixing: MixingBase | None = None
    message_dtype: torch.dtype | str | None = None

    def __post_init__(self) -> None:
        if self.graph is not None:
            _check_type(self, "graph", self.graph, GraphBase, "a gossip_ext graph (a GraphBase)")
        if self.mixing is not None:
            _check_type(self, "mixing", self.mixing, MixingBase, "a gossip_ext mixing")
        _check_message_dtype(self, "message_dtype", self.message_dtype)

    @property
    def own_engine(self) -> bool:
        return (self.graph, self.mixing, self.message_dtype) != (None, None, None)


@dataclasses.dataclass(frozen=True)
class Average:
    """Every ``every`` steps, the parameters' exact average in place of that step's gossip round
    (with gossip: SGP's global averaging; without: LocalSGD)."""

    every: int

    def __post_init__(self) -> None:
        _check_every(self, self.every)

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {"global_avg_freq": self.every} if gossips else {"sync_every": self.every}


@dataclasses.dataclass(frozen=True)
class SlowMo:
    """SlowMo: every ``every`` steps, the exact average, then heavy-ball steps on it with
    ``momentum`` and ``lr`` scaled by the inner optimizer's learning rate (register_optimizer()
    names that optimizer). ``memory_efficient``: the slow step from the start of the period
    recomputed instead of stored; ``num_shards``: the slow state split over that many ranks."""

    every: int
    momentum: float = 0.5
    lr: float = 1.0
    memory_efficient: bool = False
    num_shards: int | None = None

    def __post_init__(self) -> None:
        _check_every(self, self.every)
        _check_type(self, "momentum", self.momentum, (int, float), "a float")
        _check_type(self, "lr", self.lr, (int, float), "a float")
        _check_type(self, "memory_efficient", self.memory_efficient, bool, "a bool")
        # beta = 1 never forgets a slow step and diverges; NaN fails both comparisons.
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{_where(self, 'momentum')}: must be in [0, 1), got {self.momentum}")
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"{_where(self, 'lr')}: must be positive and finite, got {self.lr}")
        if self.num_shards is not None:
            _check_type(self, "num_shards", self.num_shards, int, "an int or None")
            if self.num_shards < 1:
                raise ValueError(
                    f"{_where(self, 'num_shards')}: must be >= 1 (None: every rank), got "
                    f"{self.num_shards}"
                )

    def flat(self, gossips: bool) -> dict[str, Any]:
        return {
            "slowmo_freq": self.every,
            "slowmo_momentum": self.momentum,
            "slowmo_lr": self.lr,
            "slowmo_memory_efficient": self.memory_efficient,
            "slowmo_num_shards": self.num_shards,
        }


@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """DiLoCo: every ``every`` steps, the pseudo-gradient (global parameters minus local) is
    averaged (``average``: :class:`Exact` or :class:`ByGossip`) and ``optimizer`` (a callable
    that builds a torch.optim.Optimizer from a list of tensors, e.g. Nesterov SGD) steps the
    global parameters with it. ``fragments > 1``: Streaming DiLoCo, each of that many fragments
    synced at its own step of the period, its average overlapping ``delay`` steps of training
    and merged with weight ``alpha`` on the local parameters."""

    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    every: int
    average: Exact | ByGossip = dataclasses.field(default_factory=Exact)
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    def __post_init__(self) -> None:
        if not callable(self.optimizer):
            raise TypeError(
                f"{_where(self, 'optimizer')}: optimizer must be a callable that builds a "
                "torch.optim.Optimizer from a list of tensors (e.g. `lambda params: "
                "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`), got "
                f"{type(self.optimizer).__name__} {self.optimizer!r}"
            )
        _check_every(self, self.every)
        _check_type(self, "average", self.average, (Exact, ByGossip), "Exact(...) or ByGossip(...)")
        for name in ("fragments", "delay"):
            _check_type(self, name, getattr(self, name), int, "an int")
        _check_type(self, "alpha", self.alpha, (int, float), "a float")
        if self.fragments < 1 or self.fragments > self.every:
            raise ValueError(
                f"{_where(self, 'fragments')}: must be in [1, every={self.every}] (a step per "
                f"fragment), got {self.fragments}"
            )
        if not 0 <= self.delay < self.every // self.fragments:
            raise ValueError(
                f"{_where(self, 'delay')}: must be in [0, every // fragments = "
                f"{self.every // self.fragments}) (a fragment's average must end before the next "
                f"one starts), got {self.delay}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"{_where(self, 'alpha')}: must be in [0, 1], got {self.alpha}")

    def flat(self, gossips: bool) -> dict[str, Any]:
        settings = {
            "outer_optimizer": self.optimizer,
            "sync_every": self.every,
            "fragments": self.fragments,
            "fragment_delay": self.delay,
            "fragment_alpha": self.alpha,
        }
        if isinstance(self.average, ByGossip):
            settings["outer_average"] = "gossip"
        else:
            settings.update(outer_dtype=self.average.dtype, outer_device=self.average.device)
        return settings


# ----------------------------------------------------------------------------- membership


@dataclasses.dataclass(frozen=True)
class Elastic:
    """An elastic job: workers join and leave through the membership service at ``address``
    ('HOST:PORT', ``python -m gossip_ext.membership``); training goes on while at least
    ``min_workers`` are left."""

    address: str
    min_workers: int = 1

    def __post_init__(self) -> None:
        _check_type(self, "address", self.address, str, "a str 'HOST:PORT'")
        parse_address(self.address)
        _check_type(self, "min_workers", self.min_workers, int, "an int")
        if self.min_workers < 1:
            raise ValueError(f"{_where(self, 'min_workers')}: must be >= 1, got {self.min_workers}")


# ----------------------------------------------------------------------------- translation

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
        average = getattr(outer, "average", None)
        if isinstance(average, ByGossip) and average.own_engine:
            if gossip is not None:
                raise ValueError(
                    "ByGossip(graph=..., mixing=..., message_dtype=...) gives the outer round an "
                    "engine of its own, but gossip is set: the outer round then runs on the "
                    "inner mix's engine; give those settings to the gossip object"
                )
            flat.update(
                graph=average.graph, mixing=average.mixing, message_dtype=average.message_dtype
            )
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
        )
    elif f["outer_optimizer"] is not None:
        if f["outer_average"] == "gossip":
            average = (
                ByGossip()
                if gossips
                else ByGossip(
                    graph=f["graph"], mixing=f["mixing"], message_dtype=f["message_dtype"]
                )
            )
        else:
            average = Exact(dtype=f["outer_dtype"], device=f["outer_device"])
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
