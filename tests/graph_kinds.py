"""Which reference.py graph kind each gossip_ext graph class implements."""

from gossip_ext import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    HypercubeGraph,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)

KIND_OF = {
    NPeerDynamicDirectedExponentialGraph: "npeer_exponential",
    DynamicDirectedExponentialGraph: "directed_exponential",
    DynamicBipartiteExponentialGraph: "bipartite_exponential",
    DynamicDirectedLinearGraph: "directed_linear",
    DynamicBipartiteLinearGraph: "bipartite_linear",
    RingGraph: "ring",
    HypercubeGraph: "hypercube",
}
