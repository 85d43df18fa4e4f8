"""The engine's push-sum state while a round is in flight, with and without sending in place.

Two ranks of the in-process transport driven from one thread: a send never blocks, so both can
start a round before either finishes it.
"""

import pytest
import torch

import gossip_ext
from gossip_ext import _C


def _two_engines(send_in_place: bool):
    hub = _C.InProcHub(2)
    options = _C.EngineOptions(
        gossip_ext.NPeerDynamicDirectedExponentialGraph()._options(),
        gossip_ext.UniformMixing()._options(),
        send_in_place=send_in_place,
    )
    params = [torch.tensor([2.0, 4.0], dtype=torch.float64), torch.tensor([6.0, 0.0]).double()]
    engines = [
        _C.GossipEngine([p], [f"p{r}"], _C.InProcTransport(hub, r), options)
        for r, p in enumerate(params)
    ]
    return engines, params


@pytest.mark.parametrize("send_in_place", [False, True])
def test_state_in_flight_and_after(send_in_place):
    engines, params = _two_engines(send_in_place)
    for engine in engines:
        engine.start_round()
    # In flight, each rank keeps half its mass: numerator 1/2 * z and weight 1/2.
    assert engines[0].ps_weight().item() == 0.5
    torch.testing.assert_close(engines[0].ps_numerators()[0], torch.tensor([1.0, 2.0]).double())
    assert engines[0].params_hold_numerators == send_in_place
    expected_param = [1.0, 2.0] if send_in_place else [2.0, 4.0]
    assert params[0].tolist() == expected_param
    for engine in engines:
        engine.finish_round()
    # Two ranks, weights 1/2: exact averaging, weight back to 1, parameters de-biased again.
    for engine, p in zip(engines, params):
        assert p.tolist() == [4.0, 2.0]
        assert engine.ps_weight().item() == 1.0
        assert not engine.params_hold_numerators
