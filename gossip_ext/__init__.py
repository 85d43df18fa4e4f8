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

The package in layers, each importing only from those below it:

- ``algorithms``: what the wrapper does, as objects (``gossip=SGP(...) | PushPull(...) |
  AsyncSGP(...) | None``, ``outer=Average(...) | SlowMo(...) | DiLoCo(...,
  average=ByCollective(...) | ByGossip(...) | ByCompressedGossip(...)) | AsyncDiLoCo(...) |
  None``,
  ``membership=Elastic(...)``), each checking its own arguments and building its runtime
  part; ``flat_keywords``: the flat keywords of earlier releases (and of SGP and fairscale,
  through ``compat``) translated into them.
- ``distributed``: the wrapper, what faces the module (forward, the optimizer hook, train/eval,
  the checkpoint); it composes the parts below (``assembly`` builds them) and holds no algorithm.
- ``membership``: who trains with whom (a static process group, or an elastic job's epochs, its
  service, its protocol and the handoff to a joining worker).
- ``outer``: the outer steps, every few steps: the one place where a rule (``outer.rules``: a
  plain average, SlowMo's heavy ball, DiLoCo's outer optimizer) meets an averaging, and
  Streaming DiLoCo's fragments; and asynchronous DiLoCo's (``outer.asynchronous``), each
  worker's at its own pace.
- ``averagings``: how an outer step forms the mean over workers, one interface (start, finish,
  commit) and its failure contract, implemented by every way there is; a user's own is a
  subclass (``OuterAverage`` builds it).
- ``gossip``: the inner mix, the compiled engine's rounds (push-sum or push-pull, on any graph
  and mixing) and when they start and are absorbed; several processes per machine.
- ``sharded``: a module sharded by FSDP2 inside each replica, and its checkpoints.
- ``graphs``, ``mixing``: who talks to whom, with which weights; ``errors``: the typed failures;
  ``_torch_check``: loads the compiled engine (``csrc/``), ``gossip_ext._C``.

Where a new algorithm goes: a new frozen class in ``algorithms`` that checks its arguments and
builds the runtime part it selects: a graph, a mixing or an engine mode (``gossip``) for a new
way to mix between steps; a rule in ``outer.rules`` (``start``, ``update``, its state) for a new
outer update; an ``averagings.Averaging``, built by an ``OuterAverage``, for a new way to average
at the outer step (no change in the package: docs/design.md, "Extending gossip_ext").
"""

import torch  # noqa: F401  (loads libtorch before the extension)

# gossip_ext._C (it registers torch.ops.gossip_ext), refused before anything runs in it if it was
# built against another torch than the running one.
from gossip_ext._torch_check import _C
from gossip_ext.algorithms import (
    SGP,
    AsyncDiLoCo,
    AsyncSGP,
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
from gossip_ext.averagings.sparse import TopK
from gossip_ext.distributed import GossipDataParallel
from gossip_ext.errors import ConfigurationMismatch, NonFiniteError, PeerTimeoutError
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
from gossip_ext.membership.admission import JobMismatchError
from gossip_ext.membership.epochs import RemovedError
from gossip_ext.mixing import MixingBase, MixingWeights, SelfWeightMixing, UniformMixing
from gossip_ext.sharded.elastic import ReplicaLostError
from gossip_ext.simulate import simulate

__version__ = "0.1.0"

# The CPU kernels' instruction set, decided now rather than at the first op (possibly on the
# engine's thread), so that a bad GOSSIP_EXT_MAX_CPU_ISA is reported here, by name.
_C.cpu_kernels_isa()


def __getattr__(name: str):
    """``gossip_ext.sharded_checkpoint``, where earlier releases had it (now
    ``gossip_ext.sharded.checkpoint``), imported when first asked for."""
    if name == "sharded_checkpoint":
        from gossip_ext.sharded import checkpoint

        return checkpoint
    raise AttributeError(f"module 'gossip_ext' has no attribute {name!r}")


__all__ = [
    "SGP",
    "AsyncDiLoCo",
    "AsyncSGP",
    "Average",
    "ByCollective",
    "ByCompressedGossip",
    "ByGossip",
    "ConfigurationMismatch",
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
    "JobMismatchError",
    "MixingBase",
    "MixingWeights",
    "NPeerDynamicDirectedExponentialGraph",
    "NonFiniteError",
    "PeerTimeoutError",
    "PushPull",
    "RemovedError",
    "ReplicaLostError",
    "RingGraph",
    "SelfWeightMixing",
    "SlowMo",
    "TopK",
    "UniformMixing",
    "simulate",
]
