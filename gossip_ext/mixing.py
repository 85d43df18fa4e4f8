"""Mixing weights: how a node splits its value between itself and its out-peers in a round."""

from __future__ import annotations

import math
from typing import NamedTuple

from gossip_ext._torch_check import _C

__all__ = ["MixingBase", "MixingWeights", "SelfWeightMixing", "UniformMixing"]


class MixingWeights(NamedTuple):
    """The share a node keeps (``self_weight``) and the share each out-peer gets."""

    self_weight: float
    peer_weight: float


class MixingBase:
    """Mixing weights as a pure function of the number of out-peers in a round.

    Every weighting here is column-stochastic (``self_weight + k * peer_weight == 1`` for ``k``
    out-peers), so push-sum conserves the sum of values and weights.
    """

    is_uniform = False

    def compiled_options(self) -> _C.MixingOptions:
        """These weights as the compiled engine takes them (``_C.EngineOptions``)."""
        raise NotImplementedError

    def weights(self, num_out_peers: int) -> MixingWeights:
        """The weights of a round in which the node sends to ``num_out_peers`` peers."""
        if isinstance(num_out_peers, bool) or not isinstance(num_out_peers, int):
            raise TypeError(f"num_out_peers must be an int, got {num_out_peers!r}")
        return MixingWeights(*_C.mixing_weights(self.compiled_options(), num_out_peers))

    def weights_for(self, graph, rank: int, world_size: int, round: int) -> MixingWeights:
        """The weights ``rank`` uses in ``round`` of ``graph`` at ``world_size``."""
        return self.weights(len(graph.out_peers(rank, world_size, round)))

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.__dict__.items()))))


class UniformMixing(MixingBase):
    """Every out-peer and the node itself get ``1 / (num_out_peers + 1)``.

    .. note::
        On a regular graph (every built-in graph) this keeps every push-sum weight at exactly 1,
        so the weight is not sent and de-biasing is skipped ("lazy mixing").
    """

    is_uniform = True

    def compiled_options(self) -> _C.MixingOptions:
        return _C.MixingOptions(_C.MixingKind.Uniform)

    def __repr__(self) -> str:
        return "UniformMixing()"


class SelfWeightMixing(MixingBase):
    """The node keeps ``self_weight``; each of its ``k`` out-peers gets ``(1 - self_weight) / k``.

    Non-uniform: push-sum weights then change from round to round and travel with every message,
    and the model computes with the de-biased parameters ``x / w``.

    Args:
        self_weight (float): the share the node keeps, in (0, 1) (default: 0.5).
    """

    def __init__(self, self_weight: float = 0.5):
        if isinstance(self_weight, bool) or not isinstance(self_weight, (int, float)):
            raise TypeError(f"self_weight must be a float, got {self_weight!r}")
        if not (math.isfinite(self_weight) and 0.0 < self_weight < 1.0):
            raise ValueError(f"SelfWeightMixing: self_weight must be in (0, 1), got {self_weight}")
        self.self_weight = float(self_weight)

    def compiled_options(self) -> _C.MixingOptions:
        return _C.MixingOptions(_C.MixingKind.SelfWeight, self.self_weight)

    def __repr__(self) -> str:
        return f"SelfWeightMixing(self_weight={self.self_weight})"
