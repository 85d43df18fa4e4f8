"""What a sharded replica's leader tells its replica's other processes, and how a shard process's
failure travels among them: as JSON of checked shapes (``gossip_ext._plain_messages``), never a
pickle, since a value of the store or a process's bytes are only ever parsed."""

from __future__ import annotations

from gossip_ext import _plain_messages
from gossip_ext.membership import elastic as elastic_worker
from gossip_ext.membership.epochs import Epoch, RemovedError

# What a leader tells its replica's other processes about an error that stopped it, by name.
STOPPING_ERRORS = {e.__name__: e for e in (RemovedError, TimeoutError, ValueError)}


def raise_if_stopped(message: tuple | list) -> None:
    """Raises what stopped the leader, as it was raised there, on the replica's other processes."""
    if message[0] == "stopped":
        _, kind, text = message
        raise STOPPING_ERRORS.get(kind, RuntimeError)(text)


# The leader's messages to its replica's other processes, as JSON (never a pickle: a value of
# the store or a process's bytes are only ever parsed): the replica's id once it registered, the
# epoch it formed with who left and joined, or what stopped it. And a shard process's failure.
STOPPED = ("stopped", str, str)
REGISTERED = _plain_messages.OneOf(("registered", int), STOPPED)
TOLD = _plain_messages.OneOf(
    ("epoch", {"number": int, "members": [int], "events": int}, [int], [int]), STOPPED
)
FAILURE = _plain_messages.OneOf(None, {"text": str, "peers": [int]})


def epoch_message(change: elastic_worker.Change) -> list:
    epoch = change.epoch
    described = {"number": epoch.number, "members": list(epoch.members), "events": epoch.events}
    return ["epoch", described, list(change.left), list(change.joined)]


def read_told(data: bytes | str, what: str, replica: int) -> tuple:
    """A message of the leader (:data:`TOLD`), its epoch an :class:`Epoch` again, checked: the
    epoch must hold this replica."""
    message = _plain_messages.decode(data, what, TOLD)
    if message[0] != "epoch":
        return tuple(message)
    _, described, left, joined = message
    epoch = Epoch(described["number"], tuple(described["members"]), described["events"])
    if replica not in epoch.members:
        raise _plain_messages.MalformedMessage(
            f"{what}: epoch {epoch.number}'s members {list(epoch.members)} do not hold this "
            f"replica (worker {replica})"
        )
    return "epoch", epoch, left, joined
