"""What GossipDataParallel tells of its membership, and how a worker leaves an elastic job:
``elastic``, ``worker_id``, ``epoch``, ``leave()``.

A mixin of the wrapper, reading its configuration and its membership runtime (``_members``:
``membership.runtime.StaticMembership`` or ``ElasticMembership``).
"""

from __future__ import annotations


class MembershipView:
    """The wrapper's membership (see the module docstring)."""

    @property
    def elastic(self) -> bool:
        """Whether this worker belongs to an elastic job (``membership=Elastic(...)``)."""
        return self.configuration.membership is not None

    @property
    def worker_id(self) -> int | None:
        """This worker's id in an elastic job (ids are handed out in order of registration);
        None without ``membership``."""
        return self._members.worker_id

    @property
    def epoch(self) -> int | None:
        """The membership epoch this worker trains in; None without ``membership``."""
        return self._members.epoch

    def leave(self) -> None:
        """Leaves an elastic job cleanly: this worker's last round is delivered, and the others
        drop it at their next step boundary, without waiting for a timeout. Runs by itself when
        the process exits or the wrapper is collected; after it, the wrapper no longer trains (its
        module keeps the model)."""
        self._members.leave()
