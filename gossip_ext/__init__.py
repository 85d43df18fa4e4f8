"""gossip_ext: decentralized data-parallel training for PyTorch.

Stochastic Gradient Push (SGP) and its relatives as a compiled C++/CUDA engine with a thin Python
layer: :class:`GossipDataParallel` (the module wrapper), the gossip graphs and mixing weights,
the fused push-sum kernels (``torch.ops.gossip_ext``) and :func:`simulate`.

The shape of a training step, and where each part lives::

    forward -> backward -> optimizer.step() -> transfer_params()
                                                 |
                      an outer step is due? -- no --> the inner mix: this step's gossip round
                                 | yes
                      the outer step takes the round's place

- ``algorithms``: what the wrapper does, as objects (``gossip=SGP(...) | PushPull(...) | None``,
  ``outer=Average(...) | SlowMo(...) | DiLoCo(...) | None``, ``membership=Elastic(...)``), each
  checking its own arguments; ``flat_keywords``: the flat keywords of earlier releases (and of
  SGP and fairscale, through ``compat``) translated into them.
- ``distributed``: the wrapper, what faces the module (forward, the optimizer hook, train/eval,
  the checkpoint); it composes the parts below and holds no algorithm.
- ``inner``: the inner mix, the compiled engine's gossip rounds (push-sum or push-pull, on any
  graph and mixing) and when they start and are absorbed (``_schedule``); or none (LocalSGD).
- ``outer``: the outer steps, every few steps, exact (one all-reduce) or by one gossip round;
  ``outer_rules``: what an outer step makes of the average (SlowMo's heavy ball, DiLoCo's outer
  optimizer; a plain average needs no rule); ``streaming``: Streaming DiLoCo's fragments.
- ``membership_runtime``: who trains with whom (a static process group, or an elastic job's
  epochs); ``membership``, ``epochs``, ``elastic``: the elastic job's service, its epochs, a
  worker's moves between them, the handoff of the state to a joining worker.
- ``_buffers``: what happens to module buffers; ``_hierarchy``: several processes per machine.
- ``graphs``, ``mixing``: who talks to whom, with which weights; ``errors``: the typed failures;
  ``csrc/``: the engine.

Where a new algorithm goes: a new frozen class in ``algorithms`` that checks its arguments and
says which settings it stands for, and the runtime part it selects: a graph, a mixing or an
engine mode (``inner``) for a new way to mix between steps; a rule in ``outer_rules`` (``start``,
``update``, its state) for a new outer update; a method of ``outer.OuterSteps`` for a new way to
average at the outer step.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

# gossip_ext._C (it registers torch.ops.gossip_ext), refused before anything runs in it if it was
# built against another torch than the running one.
from gossip_ext._torch_check import _C
from gossip_ext.algorithms import (
    SGP,
    Average,
    ByCollective,
    ByCompressedGossip,
    ByGossip,
    DiLoCo,
    Elastic,
    Exact,
    OuterAverage,
    PushPull,
    SlowMo,
)
from gossip_ext.distributed import GossipDataParallel
from gossip_ext.epochs import RemovedError
from gossip_ext.errors import NonFiniteError, PeerTimeoutError
from gossip_ext.graphs import (
    CustomGraph,
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    GraphBase,
    HypercubeGraph,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)
from gossip_ext.mixing import MixingBase, MixingWeights, SelfWeightMixing, UniformMixing
from gossip_ext.simulate import simulate
from gossip_ext.sparse_average import TopK

__version__ = "0.1.0"

# The CPU kernels' instruction set, decided now rather than at the first op (possibly on the
# engine's thread), so that a bad GOSSIP_EXT_MAX_CPU_ISA is reported here, by name.
_C.cpu_kernels_isa()

__all__ = [
    "SGP",
    "Average",
    "ByCollective",
    "ByCompressedGossip",
    "ByGossip",
    "CustomGraph",
    "DiLoCo",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "Elastic",
    "Exact",
    "OuterAverage",
    "GossipDataParallel",
    "GraphBase",
    "HypercubeGraph",
    "MixingBase",
    "MixingWeights",
    "NPeerDynamicDirectedExponentialGraph",
    "NonFiniteError",
    "PeerTimeoutError",
    "PushPull",
    "RemovedError",
    "RingGraph",
    "SelfWeightMixing",
    "SlowMo",
    "TopK",
    "UniformMixing",
    "simulate",
]
