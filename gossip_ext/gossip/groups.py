"""Process groups gossip_ext builds for itself from a store, beside the user's.

An elastic epoch's group (``membership.epoch_group``) and the group an asynchronous engine's
messages move on (:func:`messages_group`) are built the way ``init_process_group`` builds its own
(``_new_process_group_helper`` over a PrefixStore) and registered under their own names, with the
rank map the ``torch.distributed`` functions look up. ``dist.new_group`` would need every rank of
the default group (an epoch has none) and would split a default group that may hold the dead.

These are torch's private helpers, isolated here: the one place to change when torch moves them.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import struct
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gossip_ext.errors import UnprovenPeerError

CHALLENGE_BYTES = 32
ANSWER_BYTES = hashlib.sha256().digest_size
# The proof is a group's first exchange, before anything else is posted on it: no tag of the
# registry (csrc/transport/message_tags.h) is in use yet.
_CHALLENGE_TAG, _ANSWER_TAG = 0, 1


def build(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: datetime.timedelta,
    name: str,
    global_ranks: list[int] | None = None,
) -> dist.ProcessGroup:
    """A group of ``world_size`` ranks meeting in ``store`` (``backend``: "gloo" or "nccl"), as
    rank ``rank``; ``name`` unique in this process. ``global_ranks``: each group rank's rank in
    the default group, for the functions that translate them (none: the group's ranks are the
    only ranks, an epoch's). Collective over the group; raises if one does not join within
    ``timeout``."""
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=name,
        timeout=timeout,
        group_desc=name,
    )
    ranks = global_ranks if global_ranks is not None else list(range(world_size))
    c10d._world.pg_group_ranks[group] = {g: r for r, g in enumerate(ranks)}
    return group


def messages_group(
    group: dist.ProcessGroup, store: dist.Store, timeout: datetime.timedelta, name: str
) -> dist.ProcessGroup:
    """``group``'s ranks in a gloo group of their own for an asynchronous engine's messages,
    meeting in ``store`` (the engine's own: one group per engine).

    The engine keeps a receive posted for every in-peer's next message at all times. On the
    user's group those receives would share gloo's connections with the user's collectives, and
    anything that ends the engine's messages (a peer given up, the engine dropped) would end them
    for the user's barrier too; DDP's reducer never holds the user's group either. Collective over
    ``group``, as the engine's construction is."""
    ranks = [dist.get_global_rank(group, r) for r in range(group.size())]
    return build(
        dist.PrefixStore("messages-group", store),
        group.rank(),
        group.size(),
        "gloo",
        timeout,
        name,
        global_ranks=ranks,
    )


def encode_fields(*fields: bytes | str | int) -> bytes:
    """``fields`` in one unambiguous string of bytes: each as its 8-byte length, then itself
    (ints as their decimal digits), so that no two lists of fields encode alike (a separator
    inside a field could make two of them one)."""
    parts = []
    for field in fields:
        data = str(field).encode() if isinstance(field, (int, str)) else bytes(field)
        parts.append(struct.pack(">Q", len(data)) + data)
    return b"".join(parts)


def _answer(key: bytes, context: bytes, challenger: int, prover: int, challenge: bytes) -> bytes:
    message = encode_fields(b"gossip_ext/pair-proof", context, challenger, prover, challenge)
    return hmac.new(key, message, hashlib.sha256).digest()


def prove_pairs(
    group: dist.ProcessGroup, key: bytes, context: bytes, timeout: datetime.timedelta
) -> None:
    """Every connection of ``group`` proves, over the connection itself, that the process at its
    other end holds ``key`` (a key of this group's own, derived from the job's secret), before the
    group carries anything else. Collective over ``group``, right after it is built.

    Each rank sends every peer a fresh challenge and answers each peer's with
    ``HMAC(key, context | challenger | prover | challenge)``; a peer whose answer is wrong,
    malformed (gloo refuses a message of another size) or missing after ``timeout`` raises
    :class:`UnprovenPeerError` naming it. The group is then of no use (a wait that ran out closed
    its connections) and the caller drops it. An outsider who took a member's place on a gloo
    connection holds the connection, not the secret: it is refused before a byte of the model
    crosses."""
    rank, size = group.rank(), group.size()
    peers = [p for p in range(size) if p != rank]
    if not peers:
        return
    mine = {p: secrets.token_bytes(CHALLENGE_BYTES) for p in peers}
    theirs = {p: torch.zeros(CHALLENGE_BYTES, dtype=torch.uint8) for p in peers}
    answers = {p: torch.zeros(ANSWER_BYTES, dtype=torch.uint8) for p in peers}
    unproven: dict[int, str] = {}

    def exchange(receive: dict[int, torch.Tensor], send: dict[int, bytes], tag: int) -> None:
        """``send[p]`` to every peer p, ``receive[p]`` from it; a peer whose message does not
        come is unproven. Receives are posted first, as the engine's rounds post them."""
        posted, outgoing, sends = [], {}, []
        for p in peers:
            try:
                posted.append((p, group.recv([receive[p]], p, tag)))
            except Exception as error:  # noqa: BLE001 - a connection already closed
                unproven.setdefault(p, f"its connection failed: {error}")
        for p in peers:
            outgoing[p] = torch.frombuffer(bytearray(send[p]), dtype=torch.uint8)
            try:
                sends.append(group.send([outgoing[p]], p, tag))
            except Exception as error:  # noqa: BLE001 - a connection already closed
                unproven.setdefault(p, f"its connection failed: {error}")

        # Each wait on a thread of its own, so that they end in the order the messages come: the
        # first wait that runs out closes every connection of the group (gloo), and an honest
        # peer's message waited for after it would fail with the outsider's. (gloo completes a
        # point-to-point message only inside a wait: none can be polled.)
        def wait(p: int, work: dist.Work, is_recv: bool) -> None:
            try:
                work.wait(timeout)
            except Exception as error:  # noqa: BLE001 - the connection's failure is the finding
                if is_recv:
                    unproven.setdefault(p, f"no message: {error}")

        waits = [threading.Thread(target=wait, args=(p, w, True)) for p, w in posted]
        waits += [threading.Thread(target=wait, args=(-1, w, False)) for w in sends]
        for thread in waits:
            thread.start()
        for thread in waits:
            thread.join()

    # Each step names only those that failed it: a wait that ran out closes every connection of
    # the group, and the honest peers' next messages would fail after it.
    exchange(theirs, mine, _CHALLENGE_TAG)
    if not unproven:
        replies = {p: _answer(key, context, p, rank, bytes(theirs[p].tolist())) for p in peers}
        exchange(answers, replies, _ANSWER_TAG)
    if not unproven:
        for p in peers:
            expected = _answer(key, context, rank, p, mine[p])
            if not hmac.compare_digest(bytes(answers[p].tolist()), expected):
                unproven[p] = "a wrong answer"
    if unproven:
        failures = "; ".join(
            f"the connection to rank {p} did not prove it holds the job's secret ({why})"
            for p, why in sorted(unproven.items())
        )
        raise UnprovenPeerError(
            f"gossip_ext: rank {rank} refused its group ({context.decode(errors='replace')}): "
            f"{failures}. An outsider may have taken a member's place on it; the group carried "
            "nothing else",
            peers=sorted(unproven),
        )


def release(group: dist.ProcessGroup | None) -> None:
    """Shuts ``group`` down and forgets it (its pending operations are aborted); nothing if it
    is gone already (the interpreter's exit tore the groups down first)."""
    if group is None or group not in c10d._world.pg_map:
        return
    dist.destroy_process_group(group)
