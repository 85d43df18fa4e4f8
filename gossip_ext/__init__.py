"""gossip_ext: decentralized data-parallel training for PyTorch.

Stochastic Gradient Push (SGP) and its relatives as a compiled C++/CUDA engine with a thin Python
layer: :class:`GossipDataParallel` (the module wrapper), the gossip graphs and mixing weights,
the fused push-sum kernels (``torch.ops.gossip_ext``) and :func:`simulate`.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

from gossip_ext import _C  # noqa: F401  (registers torch.ops.gossip_ext)
from gossip_ext.distributed import GossipDataParallel
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

__version__ = "0.1.0"

# The CPU kernels' instruction set, decided now rather than at the first op (possibly on the
# engine's thread), so that a bad GOSSIP_EXT_MAX_CPU_ISA is reported here, by name.
_C.cpu_kernels_isa()

__all__ = [
    "CustomGraph",
    "DynamicBipartiteExponentialGraph",
    "DynamicBipartiteLinearGraph",
    "DynamicDirectedExponentialGraph",
    "DynamicDirectedLinearGraph",
    "GossipDataParallel",
    "GraphBase",
    "HypercubeGraph",
    "MixingBase",
    "MixingWeights",
    "NPeerDynamicDirectedExponentialGraph",
    "RingGraph",
    "SelfWeightMixing",
    "UniformMixing",
    "simulate",
]
