"""Which mode, how fast and how well on a cluster: a cost model of every mode of gossip_ext beside
DDP's, from the model's step time, its size and the cluster's links, slowness and failures.

    from gossip_ext.plan import Cluster, Model, every_mode
    model = Model(params=7e9, step_seconds=0.9, param_bytes=2)
    cluster = Cluster(workers=256, link_bits=10e9, latency=0.03, mtbf=6 * 3600)
    for mode in every_mode(every=100):
        print(mode.predict(model, cluster))

or ``python -m gossip_ext.plan --workers 256 --params 7e9 --link 10gbit --latency 30ms
--step-ms 900``. The formulas and their sources are in docs/scaling.md; what they leave out (a
model's quality under each mode) is said there too.
"""

from gossip_ext.plan.cost import Cluster, Mode, Model, Prediction, StepTime, message_bytes
from gossip_ext.plan.modes import DDP, SGP, AsyncSGP, Sharded, every_mode
from gossip_ext.plan.outer_modes import ChocoGossip, Periodic, SparseLoCo, StreamingDiLoCo

__all__ = [
    "DDP",
    "SGP",
    "AsyncSGP",
    "ChocoGossip",
    "Cluster",
    "Mode",
    "Model",
    "Periodic",
    "Prediction",
    "Sharded",
    "SparseLoCo",
    "StepTime",
    "StreamingDiLoCo",
    "every_mode",
    "message_bytes",
]
