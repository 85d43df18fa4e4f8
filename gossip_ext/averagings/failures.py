"""The failure contract every averaging keeps, written once.

- A wait is bounded by the wrapper's timeout. A collective over every worker (all-reduce,
  all-to-all, all-gather) that fails or times out raises ``PeerTimeoutError`` naming the workers
  that did not check in at the process group's store after it (:mod:`.store_check_in`; the error
  comes at most its short deadline later), and the message says so; with no store to check in
  at, or where an elastic job's watch gave the group up, it names none (the process group cannot
  tell which worker died or stalled). A message to or from one peer names that peer.
- A contribution holding NaN or Inf raises ``NonFiniteError`` on every worker, naming the sender:
  over every worker, each adds one flag to a small all-reduce of its own (:class:`SenderCheck`;
  the full-precision mean waits for it before it sends, so that one collective is in flight at a
  time, as a plain all-reduce has; the compressed means post it beside theirs); between peers,
  the receiver reads the message it got (:func:`check_received`). The sender's own error names no
  peer ("this rank's contribution").
- Either is raised by ``finish``, before anything is written; the wrapper keeps it raised.
"""

from __future__ import annotations

import datetime
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext.averagings.store_check_in import CollectiveCheckIn
from gossip_ext.errors import NonFiniteError, PeerTimeoutError

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)  # the wrapper's default
# How often a wait for a collective looks whether its group was given up (give_up_waits_on).
_GIVE_UP_POLL_S = 0.05
# The groups whose collectives are given up, with why: weakly, as each elastic epoch's group
# is dropped when the epoch ends.
_given_up: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


def give_up_waits_on(group: dist.ProcessGroup, why: str) -> None:
    """Fails every wait for a collective over ``group``, now and later, with ``why`` (any thread
    may call it: an elastic worker's watch, when a member's heartbeat stopped). A collective over
    every worker waits on whichever peers its algorithm pairs it with: a worker that is not paired
    with the dead one sees no connection close and would wait out the whole timeout."""
    _given_up[group] = why


def transport_name(group: dist.ProcessGroup) -> str:
    return f"process_group({dist.get_backend(group)})"


def wait_for_every_worker(
    works: Iterable[Any], what: str, group: dist.ProcessGroup, timeout: datetime.timedelta
) -> None:
    """Waits for the collectives ``works`` over every worker of ``group``, each at most
    ``timeout``; raises PeerTimeoutError for one that failed or did not complete, naming the
    workers that did not check in after it (the check-in's deadline later at most). Every rank
    of ``group`` calls it for its collectives in the order it posts them (the check-in's key
    counts them)."""
    check_in = CollectiveCheckIn(group, timeout)
    for work in works:
        try:
            _wait_bounded(work, timeout, group, check_in)
        except Exception as error:
            raise _every_worker_failed(error, what, group, timeout, check_in) from error


def _every_worker_failed(
    error: Exception,
    what: str,
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
    check_in: CollectiveCheckIn,
) -> PeerTimeoutError:
    # A group given up by an elastic job's watch: its heartbeats found who stopped, and told the
    # membership, so no check-in delays the error.
    missing = None if group in _given_up else check_in.missing()
    failed = (
        f"gossip_ext: rank {group.rank()}: {what} over all {group.size()} workers failed or did "
        f"not complete within {timeout.total_seconds():g} s"
    )
    if missing is None:
        why = (
            "a worker died, stalled or left (a collective over every worker cannot tell which; "
            f"{error})"
        )
    elif missing:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        why = (
            f"{who} died, stalled or left (not checked in at the process group's store within "
            f"{check_in.deadline.total_seconds():g} s of the failure; {error})"
        )
    else:
        why = (
            "every worker checked in at the process group's store after it, so none is named "
            f"({error})"
        )
    return PeerTimeoutError(
        f"{failed}: {why}",
        peers=missing or (),
        transport=transport_name(group),
        timeout=timeout,
    )


def _wait_bounded(
    work: Any, timeout: datetime.timedelta, group: dist.ProcessGroup, check_in: CollectiveCheckIn
) -> None:
    """``work.wait()``, given up after ``timeout``, once ``group`` is given up, or once another
    rank marked the collective failed at ``check_in``'s store. gloo's ``wait(timeout)`` is not
    woken by a collective that fails (a peer's connection closing): it would wait out the whole
    timeout where ``wait()`` raises at once. So the wait is on the work's future, which completes
    either way, and ``wait()`` then returns or raises the collective's own error."""
    try:
        future = work.get_future()
    except RuntimeError:  # a work without a future: its own bounded wait
        work.wait(timeout)
        return
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    now = time.monotonic()
    deadline = now + timeout.total_seconds()
    next_look = now + check_in.look_every_s
    while not done.wait(min(_GIVE_UP_POLL_S, max(0.0, deadline - time.monotonic()))):
        why = _given_up.get(group)
        if why is not None:
            raise TimeoutError(f"given up: {why}")
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError("the collective did not complete")
        if now >= next_look:
            # The ranks that the collective pairs with a dead worker fail at once; the others
            # would wait for them until the timeout, then find nobody at the check-in.
            if check_in.failed_elsewhere():
                raise TimeoutError("another worker saw the collective fail")
            next_look = now + check_in.look_every_s
    work.wait()


def wait_for_peer(
    work: Any,
    direction: str,
    peer: int,
    what: str,
    round: int,  # noqa: A002 - the step's round, as elsewhere in the package
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
) -> None:
    """Waits for one message ``direction`` ("from" or "to") ``peer``, at most ``timeout``;
    raises PeerTimeoutError naming the peer."""
    try:
        work.wait(timeout)
    except Exception as error:
        raise _peer_failed(error, direction, peer, what, round, group, timeout) from error


def post_for_peer(
    post: Callable[[], Any],
    direction: str,
    peer: int,
    what: str,
    round: int,  # noqa: A002
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
) -> Any:
    """Posts one message ``direction`` ``peer`` (``post``: a ``dist.isend`` or ``irecv``) and
    returns its work. A connection the peer already closed raises here rather than at the wait:
    the same PeerTimeoutError naming the peer."""
    try:
        return post()
    except Exception as error:
        raise _peer_failed(error, direction, peer, what, round, group, timeout) from error


def _peer_failed(error, direction, peer, what, round, group, timeout) -> PeerTimeoutError:  # noqa: A002
    return PeerTimeoutError(
        f"gossip_ext: rank {group.rank()}: {what} of round {round} failed: the message "
        f"{direction} rank {peer} did not complete within {timeout.total_seconds():g} s "
        f"({error})",
        peers=(peer,),
        round=round,
        transport=transport_name(group),
        timeout=timeout,
    )


# Values checked at a time: the check's own memory stays a few MB whatever the model's size.
_CHECK_CHUNK = 1 << 22


def holds_nonfinite(values: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``values`` (flat tensors) holds NaN or Inf."""
    for v in values:
        for start in range(0, v.numel(), _CHECK_CHUNK):
            if not bool(torch.isfinite(v[start : start + _CHECK_CHUNK]).all()):
                return True
    return False


class SenderCheck:
    """Which workers' contributions hold NaN or Inf, over every worker of a group: one flag per
    worker in a small all-reduce (the contributions' messages, and so their bits, are unchanged),
    which may carry a few sums of its own ahead of the flags (the compressed means' total
    push-sum weight), so that it adds no collective to theirs."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ):
        self.group = group
        self.device = device
        self.dtype = dtype

    def post(
        self, values: Sequence[torch.Tensor] | None, ahead: Sequence[float] = ()
    ) -> tuple[torch.Tensor, Any]:
        """Flags this worker if ``values`` (None: it contributes nothing) hold NaN or Inf and
        starts the all-reduce of ``[ahead | flags]``; returns (that tensor, the work)."""
        world_size = dist.get_world_size(self.group)
        sums = torch.zeros(len(ahead) + world_size, dtype=self.dtype, device=self.device)
        if len(ahead):
            sums[: len(ahead)] = torch.tensor(list(ahead), dtype=self.dtype)
        if values is not None and holds_nonfinite(values):
            sums[len(ahead) + self.group.rank()] = 1.0
        return sums, dist.all_reduce(sums, group=self.group, async_op=True)

    def post_with_weight(
        self, values: Sequence[torch.Tensor] | None, weight: float | None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """:meth:`post` with this worker's push-sum ``weight`` (None: it contributes nothing)
        ahead of the flags; returns (flags, total weight, work): views of one all-reduce."""
        sums, work = self.post(values, ahead=[0.0 if weight is None else float(weight)])
        return sums[1:], sums[:1], work

    def raise_if_flagged(self, flags: torch.Tensor, what: str) -> None:
        """Raises NonFiniteError naming the flagged workers (``flags``: the flags of what
        :meth:`post` returned, once its all-reduce completed)."""
        senders = [int(r) for r in torch.nonzero(flags.cpu()).view(-1)]
        if senders:
            raise_nonfinite(senders, self.group, what)


def check_received(
    messages: Iterable[tuple[int, torch.Tensor]],
    own: Sequence[torch.Tensor] | None,
    group: dist.ProcessGroup,
    what: str,
    round: int | None = None,  # noqa: A002 - the step's round, as elsewhere in the package
) -> None:
    """Raises NonFiniteError naming the peers whose (decoded) message holds NaN or Inf, or this
    rank if its own contribution ``own`` does."""
    senders = [peer for peer, message in messages if holds_nonfinite([message.view(-1)])]
    if own is not None and holds_nonfinite(own):
        senders.append(group.rank())
    if senders:
        raise_nonfinite(senders, group, what, round)


def raise_nonfinite(
    senders: Sequence[int], group: dist.ProcessGroup, what: str, round: int | None = None
) -> None:
    rank = group.rank()
    peers = [s for s in senders if s != rank]
    parts = []
    if peers:
        parts.append(f"the messages from peers {peers} hold NaN or Inf")
    if rank in senders:
        parts.append(f"the contribution of this rank (rank {rank}) holds NaN or Inf")
    raise NonFiniteError(
        f"gossip_ext: rank {rank}: {what}: {' and '.join(parts)}; nothing was changed (a "
        f"diverged worker: lower its learning rate, or restart it from a checkpoint)",
        peers=peers,
        round=round,
        transport=transport_name(group),
    )
