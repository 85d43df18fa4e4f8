"""A whole-model outer step averaged by one push-sum round of the inner gossip's engine.

The round mixes each worker's parameters with the round's peers; push-sum keeps the mean over
workers, so the rule stepping each worker's own ``theta_global`` with ``theta_global - z`` moves
their mean as an exact average would, with no collective over every worker: the round's peers are
all it waits for. The engine keeps the failure contract itself (a dead or stalled peer named
within the timeout, a failed round changing nothing, a non-finite message named by its sender);
a non-finite message it detects as it absorbs it, so the step keeps the parameters it started
from and puts them back then.
"""

from __future__ import annotations

from gossip_ext.averagings.interface import Averaging, Contribution, Mean, ParameterMean
from gossip_ext.errors import NonFiniteError


class RoundMean(Averaging):
    """One gossip round of the contribution's ``mix``, run to its end at the step (under
    LocalSGD, the only round of the period); the mean is this worker's mixed parameters."""

    def start(self, contribution: Contribution) -> Contribution:
        return contribution

    def finish(self, contribution: Contribution) -> Mean:
        before = contribution.parameters()  # what a round that absorbed NaN leaves them as
        try:
            contribution.gossip_mix().run_round()
        except NonFiniteError:
            for b, values in enumerate(before):
                contribution.parameter_buckets().write(b, values)
            raise
        return ParameterMean(contribution.parameters())

    def bytes_per_step(self, round_bytes: int = 0) -> int:
        """One round of the engine."""
        return round_bytes

    def before_whole_step(self, mix) -> None:
        """The round itself absorbs what is in flight."""

    def after_whole_step(self, mix) -> None:
        """The workers are apart after one round: push-sum goes on with its weight."""
