"""The engine's push-sum state while a round is in flight, synchronous (sent in place) or not.

Two ranks of the in-process transport driven from one thread: a send never blocks, so both can
start a round before either finishes it. Note [The parameters are the model]: in flight, the
parameters and ps_weight() are still the last model's; the share kept is kept_ps_weight().
"""

import pytest
import torch

import gossip_ext
from gossip_ext._torch_check import _C

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)


def _two_engines(synchronous: bool):
    hub = _C.InProcHub(2)
    options = _C.EngineOptions(
        gossip_ext.NPeerDynamicDirectedExponentialGraph().compiled_options(),
        gossip_ext.UniformMixing().compiled_options(),
        synchronous=synchronous,
    )
    params = [torch.tensor([2.0, 4.0], dtype=torch.float64), torch.tensor([6.0, 0.0]).double()]
    engines = [
        _C.GossipEngine([p], [f"p{r}"], _C.InProcTransport(hub, r), options)
        for r, p in enumerate(params)
    ]
    return engines, params


@pytest.mark.parametrize("synchronous", [False, True])
def test_state_in_flight_and_after(synchronous):
    engines, params = _two_engines(synchronous)
    for engine in engines:
        engine.start_round()
    # In flight: the model is unchanged (weight 1, numerators = z); each rank keeps half its mass.
    assert engines[0].ps_weight().item() == 1.0
    assert engines[0].kept_ps_weight().item() == 0.5
    torch.testing.assert_close(engines[0].ps_numerators()[0], torch.tensor([2.0, 4.0]).double())
    assert params[0].tolist() == [2.0, 4.0]
    for engine in engines:
        engine.finish_round()
    # Two ranks, weights 1/2: exact averaging, weight back to 1, parameters de-biased again.
    for engine, p in zip(engines, params):
        assert p.tolist() == [4.0, 2.0]
        assert engine.ps_weight().item() == 1.0
        assert engine.kept_ps_weight().item() == 1.0
