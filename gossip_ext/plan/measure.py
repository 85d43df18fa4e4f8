"""The planner's inputs measured rather than given: the push-sum kernels' memory bandwidth on this
machine's CPU or GPU (``Cluster.kernel_bytes``), one training step of the user's own model
(``Model.step_seconds``) and, for CPU workers, the CPU a byte sent or received over gloo costs
(``Cluster.host_seconds_per_byte``, over each worker's share of a core).

    from gossip_ext.plan import measure
    kernel_bytes = measure.kernel_bytes("cuda")
    step_seconds = measure.step_seconds(lambda: train_step(model, batch), device="cuda")

or ``python -m gossip_ext.plan ... --kernel-gbytes measure``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gossip_ext import _torch_check  # noqa: F401  (loads the compiled ops)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_seconds(
    step: Callable[[], object],
    *,
    repeats: int = 10,
    warmup: int = 3,
    device: str | torch.device = "cpu",
) -> float:
    """The median time of ``step()`` (one forward, backward and optimizer step of the user's
    model), after ``warmup`` calls that are not timed (CUDA loads kernels at their first launch;
    allocators settle); a CUDA device is synchronized around each call."""
    if repeats < 1:
        raise ValueError(f"step_seconds(repeats=...): at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"step_seconds(warmup=...): at least 0, got {warmup}")
    where = torch.device(device)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        _sync(where)
        begin = time.perf_counter()
        step()
        _sync(where)
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def kernel_bytes(
    device: str | torch.device = "cpu", *, elements: int = 1 << 24, repeats: int = 10
) -> float:
    """The bytes a second the engine's absorb kernel streams on ``device``: one received float32
    message absorbed into float32 parameters (``torch.ops.gossip_ext.absorb_``: it reads both and
    writes the parameters, ``3 * 4 * elements`` bytes), the median over ``repeats`` after one
    call that loads the kernel."""
    if elements < 1:
        raise ValueError(f"kernel_bytes(elements=...): at least 1, got {elements}")
    where = torch.device(device)
    x = torch.ones(elements, dtype=torch.float32, device=where)
    message = torch.ones(elements, dtype=torch.float32, device=where)
    kept = torch.full((1,), 0.5, dtype=torch.float32, device=where)
    total = torch.full((1,), 1.0, dtype=torch.float32, device=where)

    def absorb() -> None:
        torch.ops.gossip_ext.absorb_(x, [message], 1.0, kept, total)

    seconds = step_seconds(absorb, repeats=repeats, warmup=1, device=where)
    return 3 * 4 * elements / seconds


def host_seconds_per_byte(*, message_bytes: int = 1 << 22, rounds: int = 20) -> float:
    """The CPU seconds a byte sent or received over gloo costs on this machine: two processes
    of one group exchange ``message_bytes`` ``rounds`` times over the loopback's TCP, each
    counting its own CPU time (every thread's: gloo's included) over the bytes it sent and
    received. A CPU worker pays it on the cores it computes on (``Cluster.host_seconds_per_byte``,
    over the share of a core it has); a GPU worker's copies and NIC leave its compute alone."""
    if message_bytes < 1:
        raise ValueError(
            f"host_seconds_per_byte(message_bytes=...): at least 1, got {message_bytes}"
        )
    if rounds < 1:
        raise ValueError(f"host_seconds_per_byte(rounds=...): at least 1, got {rounds}")
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_exchange, args=(folder, message_bytes, rounds), nprocs=2, join=True)
        # Each process writes its CPU seconds as text: nothing another process wrote is
        # unpickled here.
        per_rank = [float(open(f"{folder}/cpu{rank}").read()) for rank in range(2)]
    return statistics.mean(per_rank) / (2 * message_bytes * rounds)


def _exchange(rank: int, folder: str, message_bytes: int, rounds: int) -> None:
    import torch.distributed as dist

    store = f"{folder}/store"

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        out = torch.zeros(message_bytes, dtype=torch.uint8)
        into = torch.empty(message_bytes, dtype=torch.uint8)
        peer = 1 - rank
        dist.barrier()
        begin = time.process_time()
        for _ in range(rounds):
            sent = dist.isend(out, peer)
            dist.recv(into, peer)
            if sent is not None:  # None only for a rank outside the group
                sent.wait()
        spent = time.process_time() - begin
        with open(f"{folder}/cpu{rank}", "w") as f:
            f.write(repr(spent))
        dist.barrier()
    finally:
        dist.destroy_process_group()
