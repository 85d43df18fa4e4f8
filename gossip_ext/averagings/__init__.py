"""How an outer step forms its mean over workers: one interface (:mod:`.interface`), its
failure contract (:mod:`.failures`), and the ways that do not belong to a message format of
their own (the full-precision all-reduce, one round of the inner gossip)."""

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
