"""What GossipDataParallel shows of its outer steps: ``average_parameters()``, the outer
optimizers, whether their state started, ``step_count``; and the context it lends an outer step
(``outer.interface.StepContext``).

A mixin of the wrapper, reading its runtime (``assembly.Runtime``: the inner mix, the outer
steps, the clock).
"""

from __future__ import annotations

import torch

from gossip_ext import _validation
from gossip_ext.outer.interface import StepContext


class OuterView:
    """The outer steps' public face (see the module)."""

    def _step_context(self) -> StepContext:
        # Only gossiping processes hold push-sum state; the others contribute nothing and receive
        # the mean with everyone, so no broadcast inside the machine is needed.
        return StepContext(
            mix=self.runtime.mix,
            weight=lambda: self.runtime.mix.ps_weight if self.is_gossip_leader else None,
            buffer_weight=self.runtime.buffer_policy.weight,
            optimizer=self.runtime.optimizer,
        )

    def average_parameters(self) -> None:
        """Sets every rank's parameters to the exact average of the workers' de-biased
        parameters (one all-reduce per dtype): one model for evaluation or a checkpoint.

        Collective: every rank must call it. It first absorbs the gossip in flight (as
        :meth:`sync_comms`), so that every message sent counts; the push-sum weights then restart
        at 1. The average is push-sum's consensus value ``sum_i w_i z_i / sum_i w_i``, which
        gossip converges to: the plain mean of the ``z_i`` whenever the weights are 1 (uniform
        mixing). Floating-point buffers (BatchNorm's running statistics) are averaged too. With
        ``nprocs_per_node > 1`` it averages the gossiping processes, one per machine, and every
        process receives the result.

        It holds one transient copy of the parameters and writes them only once every
        all-reduce has succeeded, so a peer that fails in the middle leaves them as they were;
        the error then stays raised by every later call, as a failed round's
        (``tests/test_faults.py``).
        """
        self.sync_comms()
        self.runtime.outer.average_now(self.runtime.steps, self._step_context())

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that ``outer_optimizer`` built over the global parameters (None without
        one): give it an outer learning-rate scheduler, and step that after every outer step.
        With ``fragments > 1`` each fragment has its own: see :attr:`outer_optimizers`."""
        optimizers = self.outer_optimizers
        if len(optimizers) > 1:
            raise ValueError(
                f"fragments={len(optimizers)}: each fragment has an outer optimizer of its own; "
                "use model.outer_optimizers (a list, one per fragment in module order)"
            )
        return optimizers[0] if optimizers else None

    @property
    def outer_optimizers(self) -> list[torch.optim.Optimizer]:
        """The outer optimizers, one per fragment (``fragments``; one without), in module order;
        empty without ``outer_optimizer``."""
        return self.runtime.outer.outer_optimizers()

    @property
    def outer_state_started(self) -> bool:
        """Whether SlowMo's slow parameters or DiLoCo's ``theta_global`` exist: SlowMo's start at
        the first forward, DiLoCo's at construction (and again at the first forward)."""
        return self.runtime.outer.started

    def start_outer_state(self) -> None:
        """Starts SlowMo's slow parameters (momentum at 0) or DiLoCo's ``theta_global`` (the
        outer optimizer's state is kept) at the current parameters, which must be equal on every
        rank. The first forward does it; call it to start them elsewhere."""
        self.runtime.outer.start()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (:meth:`transfer_params` calls): the clock of the outer steps.
        Saved in the checkpoint; set it to move the schedule (every rank alike)."""
        return self.runtime.steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        _validation.check_type("step_count", value, int, "an int")
        if value < 0:
            raise ValueError(f"step_count must be >= 0, got {value}")
        self.runtime.steps = value
