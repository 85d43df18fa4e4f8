"""How an outer step forms its mean over workers: one interface (:mod:`.interface`), its
failure contract (:mod:`.failures`; who is missing after a collective failed,
:mod:`.store_check_in`), and every way there is: the full-precision all-reduce
(:mod:`.all_reduce`), the compressed and sparse exact means (:mod:`.compressed`,
:mod:`.sparse`), one round of the inner gossip (:mod:`.round`), a fragment's gossip exchange
(:mod:`.gossip_exchange`) and the compressed gossip on fixed neighbours (:mod:`.sparse_gossip`);
the parameters they read, as flat buckets (:mod:`.buckets`)."""

from gossip_ext.averagings.all_reduce import AllReduceMean, AllReducePseudoGradientMean
from gossip_ext.averagings.interface import (
    Averaging,
    Contribution,
    Mean,
    ParameterMean,
    PseudoGradientMean,
)
from gossip_ext.averagings.round import RoundMean

__all__ = [
    "AllReduceMean",
    "AllReducePseudoGradientMean",
    "Averaging",
    "Contribution",
    "Mean",
    "ParameterMean",
    "PseudoGradientMean",
    "RoundMean",
]
