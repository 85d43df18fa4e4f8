"""The errors a peer's failure raises, with what it is about as attributes.

The compiled engine raises them (csrc/bindings.cpp sets the attributes from the C++ exception's
data, csrc/common/error.h), and so do the Python layer's own exchanges. Code that handles a
failure reads ``peers`` and ``round``, never the message, whose wording may change.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable


def _each_once(peers: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(p) for p in peers))


class PeerTimeoutError(TimeoutError):
    """A gossip round (or a check-in) failed because of peers: they did not answer within the
    timeout, their connection closed (the peer died or left), or the round was given up.

    A :class:`TimeoutError`: ``except TimeoutError`` catches it. Its message names the peers and
    the round, as the attributes do.

    Attributes:
        peers (tuple[int, ...]): the ranks, in the gossip's process group, that the failure is
            about, each once; empty where none is known (a round given up from another thread).
        round (int | None): the gossip round that failed; None where the failure is not a
            round's (ranks that did not check in).
        transport (str | None): the transport that saw it (``"process_group(gloo)"``,
            ``"nccl"``, ``"inproc"``); None where unknown.
        timeout (datetime.timedelta | None): the timeout that passed; None where the failure
            came without waiting one out (a closed connection, a round given up).

    Example::

        try:
            model(batch)
        except gossip_ext.PeerTimeoutError as error:
            print(f"round {error.round} failed; peers {error.peers} did not answer")
    """

    def __init__(
        self,
        message: str,
        *,
        peers: Iterable[int] = (),
        round: int | None = None,  # noqa: A002 - the gossip round, as elsewhere in the package
        transport: str | None = None,
        timeout: datetime.timedelta | None = None,
    ):
        super().__init__(message)
        self.peers = _each_once(peers)
        self.round = round
        self.transport = transport
        self.timeout = timeout


class NonFiniteError(FloatingPointError):
    """NaN or Inf arrived in a message, or sat in this rank's parameters, when a gossip round
    was absorbed (``check_finite=True``).

    A :class:`FloatingPointError`: ``except FloatingPointError`` catches it.

    Attributes:
        peers (tuple[int, ...]): the ranks whose messages held the values, each once; empty
            when no message did and this rank's own parameters hold them.
        round (int | None): the gossip round whose messages were absorbed.
        transport (str | None): the transport the round went over; None where unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        peers: Iterable[int] = (),
        round: int | None = None,  # noqa: A002 - the gossip round, as elsewhere in the package
        transport: str | None = None,
    ):
        super().__init__(message)
        self.peers = _each_once(peers)
        self.round = round
        self.transport = transport


class ConfigurationMismatch(ValueError):
    """The ranks of one GossipDataParallel were not configured alike (the algorithm, the graph,
    the parameters' names, shapes or dtypes, ...), or one rank's configuration could not be read.
    Every rank raises it, at construction (or at ``set_peers_per_itr``), before any gossip.

    A :class:`ValueError`: ``except ValueError`` catches it. Its message names each setting in
    which the first differing rank differs, with rank 0's value and that rank's, and every rank
    that differs.

    Attributes:
        ranks (tuple[int, ...]): the ranks, in the process group, whose configuration differs
            from rank 0's (or could not be read), each once, in order.
    """

    def __init__(self, message: str, *, ranks: Iterable[int] = ()):
        super().__init__(message)
        self.ranks = _each_once(ranks)


class UnprovenPeerError(PermissionError):
    """A connection of a group gossip_ext built did not prove that the process at its other end
    holds the job's secret (its answer to a fresh challenge was wrong, malformed or missing), so
    the group was refused before it carried a byte of the model: an outsider may have taken a
    member's place on it (gloo hands a pair's connection to whoever first presents the pair's
    number, which the membership store shows). The members form their next epoch; no honest
    member is removed for it.

    A :class:`PermissionError`: ``except PermissionError`` catches it.

    Attributes:
        peers (tuple[int, ...]): the group's ranks whose connection failed the proof, each once.
    """

    def __init__(self, message: str, *, peers: Iterable[int] = ()):
        super().__init__(message)
        self.peers = _each_once(peers)


class TamperedStoreError(TimeoutError):
    """A wait on the membership store ended at the timeout because a value it needed kept being
    overwritten, deleted or replaced by one not sealed with the job's secret (a process outside
    the job at the store's port), not because a member was slow.

    A :class:`TimeoutError`: ``except TimeoutError`` catches it.

    Attributes:
        key (str): the store key that looked tampered with.
    """

    def __init__(self, message: str, *, key: str):
        super().__init__(message)
        self.key = key
