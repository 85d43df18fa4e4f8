"""Asynchronous DiLoCo: every worker takes its outer step at its own pace on the pseudo-gradients
that reached it (``outer.asynchronous``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from gossip_ext.algorithms._base import check_argument, check_dtype_argument, check_every, where
from gossip_ext.algorithms._outer import Outer
from gossip_ext.outer.asynchronous import AsyncOuterSteps


@dataclasses.dataclass(frozen=True)
class AsyncDiLoCo(Outer):
    """Asynchronous DiLoCo: a slow worker costs its share of the outer steps, not every worker's
    time (docs/algorithms.md, "Asynchronous outer steps").

    After its ``every`` inner steps a worker sends its pseudo-gradient ``theta_global - theta_i``
    to every other worker, waits at most ``grace`` seconds for theirs, and steps its own copy of
    ``theta_global`` with ``sum_j g_j / K`` over the pseudo-gradients that have arrived, its own
    included (K workers); it goes on from there. No step waits for every worker; a
    pseudo-gradient that arrives late counts in a later step. Runs with ``gossip=None``, its
    messages over gloo: on GPUs, as AsyncSGP, the pseudo-gradients and the outer state stay on the
    device and only the messages cross to the host (the process group must carry host tensors:
    gloo, or ``init_process_group("cpu:gloo,cuda:nccl")``).

    Args:
        every (int): H, the inner steps between a worker's outer steps.
        lr (float): the outer learning rate (default: 0.5).
        momentum (float): the outer Nesterov momentum, in [0, 1) (default: 0.5). Staleness asks
            for less than synchronous DiLoCo's 0.7 and 0.9: on the comparison's task at H = 4,
            lr 0.5 with momentum 0.5 reached 3.370 bits per byte where lr 0.1 with momentum 0.9
            reached 3.715 (docs/algorithms.md, "Asynchronous outer steps").
        delayed (bool): delayed Nesterov momentum: each merge moves ``theta_global`` by its
            gradient term at once, and the momentum takes what was merged once per round's worth
            of inner steps (every worker's ``every``), as the synchronous step it replaces
            (default: True). False: every merge is a full Nesterov step.
        grace (float or "learned"): the seconds a worker's outer step waits for the other
            workers' pseudo-gradients since its last one; 0 never waits (default: 0.0).
            ``"learned"``: it waits for each peer until that peer's next message is due, learned
            from its arrival times (the median interval plus three median absolute deviations),
            where that comes within half this worker's own period; a later message counts at
            the next outer step.
        paced (bool): each worker's H is as many inner steps as the slowest worker's ``every``
            take, learned from the seconds per step every message carries, so that a faster
            worker takes more steps between outer steps (default: False).
        message_dtype (torch.dtype or str, optional): ``torch.bfloat16``, ``torch.float16``,
            ``"int8"``, ``"int4"`` or ``torch.float8_e4m3fn`` send the pseudo-gradients
            compressed, the rounding carried into the worker's next one. None: full precision
            (default).
        check_finite (bool): raise naming the worker whose pseudo-gradient holds NaN or Inf
            before it spreads (default: True).
    """

    every: int
    lr: float = 0.5
    momentum: float = 0.5
    delayed: bool = True
    grace: float | str = 0.0
    paced: bool = False
    message_dtype: torch.dtype | str | None = None
    check_finite: bool = True

    def __post_init__(self) -> None:
        check_every(self, self.every)
        for name in ("lr", "momentum"):
            check_argument(self, name, getattr(self, name), (int, float), "a float")
        if self.grace != "learned":
            check_argument(self, "grace", self.grace, (int, float), 'a float or "learned"')
        for name in ("delayed", "paced", "check_finite"):
            check_argument(self, name, getattr(self, name), bool, "a bool")
        check_dtype_argument(self, "message_dtype", self.message_dtype)
        if not 0.0 < self.lr < math.inf:
            raise ValueError(f"{where(self, 'lr')} must be positive and finite, got {self.lr}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{where(self, 'momentum')} must be in [0, 1), got {self.momentum}")
        if not isinstance(self.grace, str) and not 0.0 <= self.grace < math.inf:
            raise ValueError(
                f"{where(self, 'grace')} must be >= 0 seconds and finite, got {self.grace}"
            )

    def check_combination(self, gossip, membership, nprocs_per_node: int, spelling) -> None:
        outer = spelling.object(self, "outer")
        if gossip is not None:
            raise ValueError(
                f"{outer} with {spelling.object(gossip, 'gossip')}: the workers of an "
                "asynchronous outer step train alone between their outer steps; use gossip=None"
            )
        if membership is not None:
            raise ValueError(
                f"{outer} with {spelling.object(membership, 'membership')}: an elastic job's "
                "epochs restart every worker at one step; use DiLoCo(...) in elastic jobs"
            )
        if nprocs_per_node > 1:
            raise ValueError(
                f"{outer} with nprocs_per_node={nprocs_per_node}: a machine's processes would "
                "each keep a theta_global; launch one process per machine"
            )

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        del described["check_finite"]  # each rank's own
        return described

    def steps(
        self, params, buffers, group, *, graph, mixing, timeout, sizes=None
    ) -> AsyncOuterSteps:
        """Its runtime part: an ``AsyncOuterSteps`` over ``params`` and ``buffers``."""
        return AsyncOuterSteps(
            params,
            buffers,
            group,
            every=self.every,
            lr=float(self.lr),
            momentum=float(self.momentum),
            delayed=self.delayed,
            grace=self.grace if self.grace == "learned" else float(self.grace),
            paced=self.paced,
            message_dtype=self.message_dtype,
            check_finite=self.check_finite,
            timeout=timeout,
        )

    def flat(self, gossips: bool) -> dict[str, Any]:
        raise TypeError(
            "AsyncDiLoCo has no flat keywords: earlier releases had no asynchronous outer step; "
            "give outer=AsyncDiLoCo(...)"
        )
