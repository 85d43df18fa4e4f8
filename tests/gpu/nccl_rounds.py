"""NCCL rounds on one GPU for the GPU tests. One GPU cannot hold two NCCL ranks, so a silent peer is
emulated: a round of a world of one (the rank sends to itself) waits for the compute stream (Note
[Gossip stream ordering], rule 1), and a sleeping kernel holds that stream; to the transport, the
peer is silent for as long as the kernel sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from gossip_ext._torch_check import _C


def nccl_transport(key: str, timeout_s: float):
    """A world-of-one NCCL transport whose rank meets in the default store under ``key``."""
    store = dist.distributed_c10d._get_default_store()
    return _C.NcclTransport(store, key, 0, 1, 0, timedelta(seconds=timeout_s))


def hold_stream(seconds: float) -> None:
    """Holds the current stream about ``seconds`` with a sleeping kernel (clock cycles at the
    GPU's clock rate, or 2 GHz where torch does not report it)."""
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 2_000_000)
    torch.cuda._sleep(int(seconds * rate_khz * 1000))


def held_round(
    rank: int,
    world_size: int,
    key: str,
    timeout_s: float,
    held_s: float,
    wait_s: float,
    round_number: int,
    give_up: tuple[float, str] | None = None,
) -> dict:
    """Round ``round_number`` of a world-of-one transport (timeout ``timeout_s``) held behind the
    compute stream for ``held_s`` and waited for up to ``wait_s``; ``give_up=(after_s, why)``
    gives it up from another thread after ``after_s``. Returns what the wait raised (None if it
    returned), what the next round raised, and how long the wait took."""
    transport = nccl_transport(key, timeout_s)
    transport.connect_peers([0])
    sent = torch.full((1024,), 7.0, device="cuda")
    received = torch.zeros(1024, device="cuda")
    hold_stream(held_s)
    work = transport.exchange([(0, sent)], [(0, received)], round_number)
    if give_up is not None:
        after_s, why = give_up
        threading.Timer(after_s, transport.abandon, [why]).start()
    start = time.monotonic()
    error = _timeout_of(lambda: work.wait(timedelta(seconds=wait_s)))
    elapsed = time.monotonic() - start
    later = _timeout_of(lambda: transport.exchange([(0, sent)], [(0, received)], round_number + 1))
    torch.cuda.synchronize()
    return {"error": error, "later": later, "elapsed": elapsed}


def _timeout_of(call: Callable[[], object]) -> str | None:
    try:
        call()
    except TimeoutError as error:
        return str(error)
    return None
