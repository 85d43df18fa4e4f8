"""Choosing the engine's transport (:func:`choose_transport`) and building it.

The engine sends through one of three transports: NCCL between CUDA devices, the training process
group's point-to-point calls, or that process group from pinned host buffers (host staging). Only
NCCL needs more than its constructor: a store and a key of its own there, under which its ranks
exchange the communicator's unique id. A static job's transports use the default store, under
:func:`nccl_unique_id_key`; an elastic epoch's use the membership store, under a key of the epoch.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C

# The transports GossipDataParallel builds (csrc/transport).
NCCL = "nccl"
PROCESS_GROUP = "process_group"
HOST_STAGING = "host_staging"


def choose_transport(device: torch.device, comm_device, backend: str) -> str:
    """NCCL for CUDA parameters; the process-group transport for CPU parameters; host buffers
    over the process group for CUDA parameters with ``comm_device='cpu'``.

    ``backend`` is the process group's (``dist.get_backend``): host tensors need one that carries
    them, gloo in practice.
    """
    requested = None if comm_device is None else torch.device(comm_device)
    if device.type == "cpu":
        if requested is not None and requested.type != "cpu":
            raise ValueError(
                f"comm_device={comm_device!r} needs CUDA parameters, but they are on the CPU"
            )
        kind = PROCESS_GROUP
    elif device.type != "cuda":
        raise ValueError(f"parameters are on {device}; gossip_ext supports CPU and CUDA")
    elif requested is not None and requested.type == "cpu":
        kind = HOST_STAGING
    elif not hasattr(_C, "NcclTransport"):
        raise ValueError(
            f"parameters are on {device} but this gossip_ext build has no CUDA support; "
            "reinstall it with a CUDA build of torch"
        )
    else:
        return NCCL
    if backend == "nccl":
        what = "CPU parameters" if kind == PROCESS_GROUP else f"comm_device={comm_device!r}"
        raise ValueError(
            f"{what} gossip host tensors, which the process group's backend {backend!r} cannot "
            "carry; initialize it with init_process_group('cpu:gloo,cuda:nccl') or pass "
            "process_group=dist.new_group(backend='gloo')"
        )
    return kind


def host_messages_device(tensors, who: str, group: dist.ProcessGroup) -> torch.device:
    """The one device of ``tensors``, which ``who`` (an asynchronous algorithm's name, for
    errors) gossips in messages from host memory over ``group``: its backend must carry host
    tensors, gloo in practice (Note [Asynchronous gossip on GPUs] in ``messages``)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(
            f"{who}: the parameters are on several devices, {sorted(map(str, devices))}"
        )
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}: parameters on {device}; gossip_ext supports CPU and CUDA")
    backend = dist.get_backend(group)
    if backend == "nccl":
        raise ValueError(
            f"{who} sends its messages from host memory over the process group, whose backend "
            f"{backend!r} cannot carry them (Note [Asynchronous gossip on GPUs] in "
            "gossip_ext/gossip/messages.py); initialize it with "
            "init_process_group('cpu:gloo,cuda:nccl') or pass "
            "process_group=dist.new_group(backend='gloo')"
        )
    return device


# How many NCCL transports this process has built per group, keyed by the group's global ranks.
_NCCL_TRANSPORTS: collections.Counter[tuple[int, ...]] = collections.Counter()
_STORES: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Sealing:
    """How an epoch's point-to-point messages are sealed on the wire (Note [Sealed messages] in
    csrc/transport/sealed/sealed_transport.h): ``key(sender, receiver)``, the 32-byte key of one
    direction of a link (ranks of the epoch's group); ``encrypt``: the bodies too."""

    key: Callable[[int, int], bytes]
    encrypt: bool = False

    def wrap(self, inner: Any, group: dist.ProcessGroup) -> Any:
        """``inner`` (a transport of host buffers over ``group``) with every message sealed."""
        if not available_sealing():
            raise ValueError(
                "this gossip_ext build has no sealed messages (it was built without OpenSSL's "
                "libcrypto): install libssl-dev (or openssl-devel) and rebuild, or pass "
                "Elastic(..., messages='plain')"
            )
        rank = group.rank()
        keys = {
            peer: (self.key(rank, peer), self.key(peer, rank))
            for peer in range(group.size())
            if peer != rank
        }
        return _C.SealedTransport(inner, keys, self.encrypt)


def available_sealing() -> bool:
    """Whether this build seals messages (built where OpenSSL's libcrypto was found)."""
    return hasattr(_C, "SealedTransport")


def make_transport(
    kind: str,
    group: dist.ProcessGroup,
    device: torch.device,
    timeout: timedelta,
    rendezvous: tuple[dist.Store, str] | None = None,
    sealing: Sealing | None = None,
) -> Any:
    """The transport of ``kind`` (``NCCL``, ``PROCESS_GROUP`` or ``HOST_STAGING``)
    over ``group``, its messages sealed by ``sealing`` (host messages only: an NCCL transport's
    cannot be, and is refused). Collective for NCCL: every rank of ``group`` builds its transport
    together, its ranks meeting in the ``rendezvous`` store under its key (default: the default
    store, under :func:`nccl_unique_id_key`)."""
    if kind == NCCL:
        if sealing is not None:
            raise ValueError(
                "sealed messages travel from host memory, and an NCCL transport's cannot be "
                "sealed: pass comm_device='cpu' (host buffers over gloo, sealed), or "
                "Elastic(..., messages='plain') on a network you trust"
            )
        if rendezvous is None:
            rendezvous = (dist.distributed_c10d._get_default_store(), nccl_unique_id_key(group))
        store, key = rendezvous
        return _C.NcclTransport(store, key, group.rank(), group.size(), device.index, timeout)
    transport = _C.ProcessGroupTransport(group)
    if sealing is not None:
        transport = sealing.wrap(transport, group)
    if kind == HOST_STAGING:
        transport = _C.HostStagingTransport(transport)
    return transport


def gossip_store(
    group: dist.ProcessGroup, rendezvous: tuple[dist.Store, str] | None, purpose: str
) -> dist.Store:
    """A store of ``group``'s own for ``purpose``: under the rendezvous key where one is given
    (an elastic epoch's), else in the default store under a key unique to the group and to this
    use of it (as :func:`nccl_unique_id_key`'s)."""
    if rendezvous is not None:
        store, key = rendezvous
        return dist.PrefixStore(f"{key}/{purpose}", store)
    ranks = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    instance = _STORES[(purpose, ranks)]
    _STORES[(purpose, ranks)] += 1
    prefix = f"gossip_ext/{purpose}/ranks={','.join(map(str, ranks))}/{instance}"
    return dist.PrefixStore(prefix, dist.distributed_c10d._get_default_store())


def next_instance(group: dist.ProcessGroup, purpose: str) -> int:
    """How many times this process asked before for ``purpose`` on ``group``'s ranks: the same
    on every rank of the group, since construction is collective (every rank builds its wrappers
    in the same order)."""
    ranks = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    instance = _STORES[(f"instance/{purpose}", ranks)]
    _STORES[(f"instance/{purpose}", ranks)] += 1
    return instance


def engine_group_name(group: dist.ProcessGroup, purpose: str, instance: int) -> str:
    """The name of the group of its own that an engine's ``instance`` (:func:`next_instance`)
    for ``purpose`` builds over ``group``'s ranks: unique in this process, whose groups may
    share an instance number but never their ranks."""
    ranks = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    return f"gossip_ext_{purpose}_messages_ranks={','.join(map(str, ranks))}_{instance}"


def nccl_unique_id_key(group: dist.ProcessGroup) -> str:
    """The store key under which ``group``'s next NCCL transport publishes its unique id.

    Unique to the group and to the transport: the group's global ranks tell groups apart (two
    wrappers on ranks {0, 1} and {2, 3} build their transports at the same time), and a count of
    the transports this process has built on those ranks tells apart the wrappers of one group.
    The count agrees across the group because construction is collective: every rank of a group
    builds its wrappers in the same order.
    """
    ranks = tuple(dist.get_global_rank(group, r) for r in range(dist.get_world_size(group)))
    instance = _NCCL_TRANSPORTS[ranks]
    _NCCL_TRANSPORTS[ranks] += 1
    return f"gossip_ext/nccl/ranks={','.join(map(str, ranks))}/{instance}"


# ----------------------------------------------------------------------------- message tags

# The compiled engine's tag registry (csrc/transport/message_tags.h), read once: every message
# asks for its tag.
_OUTER_EXCHANGE_TAGS = _C.MESSAGE_TAGS["outer_exchange"]


def outer_exchange_tag(sequence: int) -> int:
    """The tag of an outer step's exchange by gossip numbered ``sequence`` (its round and bucket),
    in that kind's range of the compiled engine's tag registry (``_C.MESSAGE_TAGS``,
    csrc/transport/message_tags.h), apart from every round's and asynchronous message's (whose
    tags ``_C.mailbox_tag`` makes)."""
    base, span = _OUTER_EXCHANGE_TAGS
    return base + sequence % span
