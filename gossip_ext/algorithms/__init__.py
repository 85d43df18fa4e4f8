"""What GossipDataParallel does, as objects: the inner mix, the outer step, the membership.

    model = GossipDataParallel(
        net,
        gossip=SGP(graph=RingGraph(), overlap=True, message_dtype="int8"),  # or PushPull(), None
        outer=DiLoCo(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
                     every=64, average=ByCollective(dtype="int4"), fragments=4, delay=1),
        membership=Elastic("10.0.0.1:29600", min_workers=3),  # or None: a static job
    )

- ``gossip``: what happens between steps. :class:`SGP` (push-sum over a directed graph, the
  default), :class:`PushPull` (D-PSGD: symmetric pairs, no weights), :class:`AsyncSGP` (push-sum
  with every worker at its own pace), or ``None``: no gossip, the workers train alone between
  outer steps (LocalSGD, DiLoCo).
- ``outer``: what happens every few steps. :class:`Average` (an exact average), :class:`SlowMo`
  (SlowMo's heavy ball on the average), :class:`DiLoCo` (an outer optimizer on the averaged
  pseudo-gradient, streamed in fragments when ``fragments > 1``), :class:`AsyncDiLoCo` (each
  worker's outer step at its own pace, on the pseudo-gradients that reached it), or ``None``.
  :class:`ByCollective` (``Exact``, its former name), :class:`ByGossip` and
  :class:`ByCompressedGossip` say how an outer step averages; an :class:`OuterAverage` of one's
  own can say it too.
- ``membership``: :class:`Elastic` (workers come and go; gossip_ext.membership.service) or ``None``.

Each object checks its own arguments when it is made, naming the argument and the value it got;
what no single object can check (a combination of them, the process group, the parameters'
device) is checked in one place, :class:`Configuration`, the wrapper's whole configuration as one
value, which is all its runtime reads. Objects are frozen values: equal objects configure the
same training, and every rank must be given equal ones (the wrapper compares them across ranks).

The flat keywords of earlier releases, and SGP's and fairscale's through gossip_ext.compat, are
translated into these objects once, by :func:`gossip_ext.flat_keywords.from_flat`, which makes
them in the flat spelling so that their errors name the keywords the user wrote.

Each object builds its own runtime part: an outer step its ``steps(params, buffers, group, ...)``,
an ``outer.OuterSteps`` running its ``rule(params, group, ...)`` (SlowMo's heavy ball, DiLoCo's
outer optimizer or Streaming DiLoCo's fragments, none for a plain average) on its schedule; an
``OuterAverage`` its ``averaging(...)``; a gossip object its ``mix(named, link, graph)`` (the
engine and its schedule, an ``inner.InnerMix``). Every object describes itself (``describe()``)
for the check that every rank was configured alike.

Adding an algorithm: a new frozen class here (an ``algorithms._base.Algorithm``; a way to mix in
``_gossip``, an outer step in ``_outer`` (an ``Outer``), a way to average in ``_averages``,
registered in ``__all__``) with its checks (``where(self, name)`` names an argument in the user's
spelling) and its runtime part. Translate its flat spelling, if one exists, in ``flat_keywords``.
"""

from __future__ import annotations

from gossip_ext.algorithms._async_outer import AsyncDiLoCo
from gossip_ext.algorithms._averages import (
    ByCollective,
    ByCompressedGossip,
    ByGossip,
    Exact,
    OuterAverage,
)
from gossip_ext.algorithms._configuration import Configuration
from gossip_ext.algorithms._gossip import SGP, AsyncSGP, Gossip, PushPull, default_graph
from gossip_ext.algorithms._membership import Elastic
from gossip_ext.algorithms._outer import Average, DiLoCo, Outer, SlowMo

__all__ = [
    "SGP",
    "AsyncDiLoCo",
    "AsyncSGP",
    "Average",
    "ByCollective",
    "ByCompressedGossip",
    "ByGossip",
    "Configuration",
    "DiLoCo",
    "Elastic",
    "Exact",
    "Gossip",
    "Outer",
    "OuterAverage",
    "PushPull",
    "SlowMo",
    "default_graph",
]
