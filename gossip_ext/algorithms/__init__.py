"""What GossipDataParallel does, as objects: the inner mix, the outer step, the membership.

    model = GossipDataParallel(
        net,
        gossip=SGP(graph=RingGraph(), overlap=True, message_dtype="int8"),  # or PushPull(), None
        outer=DiLoCo(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                     every=64, average=ByCollective(dtype="int4"), fragments=4, delay=1),
        membership=Elastic("10.0.0.1:29600", min_workers=3),  # or None: a static job
    )

- ``gossip``: what happens between steps. :class:`SGP` (push-sum over a directed graph, the
  default), :class:`PushPull` (D-PSGD: symmetric pairs, no weights), or ``None``: no gossip, the
  workers train alone between outer steps (LocalSGD, DiLoCo).
- ``outer``: what happens every few steps. :class:`Average` (an exact average), :class:`SlowMo`
  (SlowMo's heavy ball on the average), :class:`DiLoCo` (an outer optimizer on the averaged
  pseudo-gradient, streamed in fragments when ``fragments > 1``), or ``None``.
  :class:`ByCollective` (``Exact``, its former name), :class:`ByGossip` and
  :class:`ByCompressedGossip` say how an outer step averages; an :class:`OuterAverage` of one's
  own can say it too.
- ``membership``: :class:`Elastic` (workers come and go; gossip_ext.membership.service) or ``None``.

Each object checks its own arguments when it is made, naming the argument and the value it got;
what no single object can check (a combination of them, the module, the process group) is checked
by the wrapper. Objects are frozen values: equal objects configure the same training, and every
rank must be given equal ones (the wrapper compares them across ranks).

The flat keywords of earlier releases, and SGP's and fairscale's through gossip_ext.compat, are
translated into these objects by :func:`gossip_ext.flat_keywords.from_flat`; ``to_flat`` is its
inverse, the settings the wrapper's checks read.

An outer step builds its own runtime part: ``steps(params, buffers, group, ...)``, an
``outer.OuterSteps`` running its ``rule(params, group, ...)`` (SlowMo's heavy ball, DiLoCo's
outer optimizer or Streaming DiLoCo's fragments, none for a plain average) on its schedule.

A gossip object builds its runtime part too (``mix(named, link, graph)``: the engine and its
schedule, an ``inner.InnerMix``), and every object describes itself (``describe()``) for the
check that every rank was configured alike.

Adding an algorithm: a new frozen class here (an ``algorithms._base.Algorithm``; a way to mix in
``_gossip``, an outer step in ``_outer``, registered in ``__all__``) with its checks,
its ``flat()`` (the settings it stands for) and its runtime part: for an outer step a ``rule``
(an ``outer_rules.OuterRule``); for a way to mix, its ``mix``. Translate its flat spelling, if
one exists, in ``flat_keywords``.
"""

from __future__ import annotations

from typing import Any

from gossip_ext.algorithms._averages import (
    ByCollective,
    ByCompressedGossip,
    ByGossip,
    Exact,
    OuterAverage,
)
from gossip_ext.algorithms._gossip import SGP, PushPull, default_graph
from gossip_ext.algorithms._membership import Elastic
from gossip_ext.algorithms._outer import Average, DiLoCo, SlowMo
from gossip_ext.outer import outer_steps as _outer_steps

__all__ = [
    "SGP",
    "Average",
    "ByCollective",
    "ByCompressedGossip",
    "ByGossip",
    "DiLoCo",
    "Elastic",
    "Exact",
    "OuterAverage",
    "PushPull",
    "SlowMo",
    "default_graph",
    "engine_owner",
    "outer_steps",
]


def engine_owner(gossip: SGP | None, outer: Any) -> SGP | ByGossip | None:
    """Which object builds the engine (its ``mix``): the gossip object, else the ByGossip of an
    outer step averaged by gossip, else none (no round ever runs)."""
    if gossip is not None:
        return gossip
    average = getattr(outer, "average", None)  # DiLoCo's; a plain average or SlowMo has none
    return average if average is not None and average.needs_engine else None


def outer_steps(outer: Any, params, buffers, group, *, graph, mixing, timeout, sizes=None):
    """The runtime part of ``outer`` (an outer step's object, or None: no outer step, though
    ``average_parameters()`` may still ask for an exact average), an ``outer.OuterSteps`` over
    ``params`` and the floating-point ``buffers`` on ``group``; an outer step averaged by gossip
    rounds on ``graph`` with ``mixing``, each given up after ``timeout``. ``sizes``: each whole
    parameter's bytes, where ``params`` are a sharded module's local shards."""
    if outer is None:
        return _outer_steps.OuterSteps(params, buffers, group)
    return outer.steps(
        params, buffers, group, graph=graph, mixing=mixing, timeout=timeout, sizes=sizes
    )
