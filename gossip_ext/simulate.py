"""Gossip without a cluster: the real engine, N ranks as threads of this process."""

from __future__ import annotations

from datetime import timedelta

import torch

from gossip_ext._torch_check import _C
from gossip_ext.graphs import GraphBase, NPeerDynamicDirectedExponentialGraph
from gossip_ext.mixing import MixingBase, UniformMixing

__all__ = ["simulate"]


def simulate(
    graph: GraphBase | None,
    values: torch.Tensor,
    rounds: int,
    push_sum: bool = True,
    mixing: MixingBase | None = None,
    timeout: timedelta = timedelta(minutes=1),
    check_finite: bool = True,
    message_dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Runs ``rounds`` rounds of pure gossip (no gradient steps) among ``values.shape[0]`` nodes.

    The compiled engine runs over the in-process transport, one thread per node, exactly as it
    runs across machines. Use it to study how fast a topology reaches consensus.

    Args:
        graph (GraphBase, optional): the communication graph
            (default: ``NPeerDynamicDirectedExponentialGraph()``).
        values (Tensor): ``[n, d]`` floating CPU tensor; row ``i`` is node ``i``'s initial value.
        rounds (int): gossip rounds to run, >= 0.
        push_sum (bool): push-sum (SGP) if True, push-pull averaging (D-PSGD) if False; push-pull
            needs a graph that pairs nodes symmetrically (default: True).
        mixing (MixingBase, optional): mixing weights (default: ``UniformMixing()``).
        timeout (timedelta): how long a node waits for a message before raising TimeoutError.
        check_finite (bool): raise FloatingPointError naming the sender when a message holds NaN
            or Inf; False lets them spread (default: True).
        message_dtype (torch.dtype or str, optional): ``torch.bfloat16`` or ``torch.float16``
            sends float32/float64 values in 16 bits; ``"int8"``, ``"int4"`` or
            ``torch.float8_e4m3fn`` block-quantized (a float32 scale per 128 values); the
            rounding error stays in the sender's state so that the mean is conserved (default:
            None, full precision).

    Returns:
        Tensor: ``[rounds + 1, n, d]``, the de-biased values ``z`` of every node after every
        round; entry 0 is ``values``.

    Example::

        >>> import torch, gossip_ext
        >>> z = gossip_ext.simulate(None, torch.arange(8.0).reshape(8, 1), rounds=3)
        >>> torch.allclose(z[-1], torch.full((8, 1), 3.5))
        True
    """
    graph = NPeerDynamicDirectedExponentialGraph() if graph is None else graph
    mixing = UniformMixing() if mixing is None else mixing
    if not isinstance(graph, GraphBase):
        raise TypeError(f"graph must be a gossip_ext graph, got {type(graph).__name__}")
    if not isinstance(mixing, MixingBase):
        raise TypeError(f"mixing must be a gossip_ext mixing, got {type(mixing).__name__}")
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if isinstance(rounds, bool) or not isinstance(rounds, int):
        raise TypeError(f"rounds must be an int, got {rounds!r}")
    if not isinstance(push_sum, bool):
        raise TypeError(f"push_sum must be a bool, got {push_sum!r}")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
    if values.dim() == 2:
        graph.schedule(values.shape[0])  # the graph's own ValueError for this world size
    # Each simulated rank finishes a round before touching its values again: the engine may send
    # them in place, as synchronous training does.
    options = _C.EngineOptions(
        graph.compiled_options(),
        mixing.compiled_options(),
        push_sum=push_sum,
        synchronous=True,
        timeout=timeout,
        check_finite=check_finite,
        message_dtype=message_dtype,
    )
    return _C.simulate(values, rounds, options)
