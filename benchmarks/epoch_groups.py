"""An elastic job's group per epoch, two ways: a new gloo group built for every epoch (what
gossip_ext.membership.epoch_group does, on every torch) against one group reconfigured for every
epoch (torch 2.14's experimental ``init_process_group(..., enable_reconfigure=True)`` and
``dist._reconfigure``, where this torch has them).

Three processes on this machine go through the epochs of a job that loses a member and takes
one back: 3 members, then 2, then 3 again. Each epoch, every member times how long it takes to
have a working group (from the moment all of them arrived until its first all-reduce of one
number returned), the way each member of an elastic job pays it at every epoch change once the
epoch's members checked in. Prints one line per way and
epoch (the slowest member's time, median over --repeats jobs).

    python benchmarks/epoch_groups.py                    # any torch; reconfigure where >= 2.14
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EPOCHS = [(0, 1, 2), (0, 1), (0, 1, 2)]  # the members of each epoch: one lost, one back
TIMEOUT = datetime.timedelta(seconds=30)


def _epoch_group_module():
    """gossip_ext.membership.epoch_group, loaded from its file: it needs torch alone, and this
    runs under torch builds that gossip_ext's compiled part was not built for."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "gossip_ext", "membership", "epoch_group.py")
    spec = importlib.util.spec_from_file_location("epoch_group", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arrive(store: dist.Store, key: str, rank: int, members) -> None:
    """Waits until every member arrived: an epoch's members begin forming it together (their
    check-in), and the times below start there."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{m}" for m in members])


def _ready(group) -> None:
    one = torch.ones(1)
    dist.all_reduce(one, group=group)


def _new_groups(rank: int, store: dist.Store, times: list) -> None:
    epoch_group = _epoch_group_module()
    for number, members in enumerate(EPOCHS):
        if rank not in members:
            continue
        _arrive(store, f"new/{number}", rank, members)
        start = time.perf_counter()
        group = epoch_group.build(store, number, members.index(rank), len(members), "gloo", TIMEOUT)
        _ready(group)
        times.append((number, time.perf_counter() - start))
        epoch_group.release(group)


def _reconfigured(rank: int, store: dist.Store, times: list) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("reconfigure", store),
        rank=rank,
        world_size=len(EPOCHS[0]),
        timeout=TIMEOUT,
        enable_reconfigure=True,
    )
    for number, members in enumerate(EPOCHS):
        if rank not in members:
            continue
        _arrive(store, f"reconfigure/{number}", rank, members)
        start = time.perf_counter()
        # Each epoch's own handle (it names the communicator it was taken from), out of band
        # through the store, as the membership service would carry it.
        handle = dist.distributed_c10d._get_reconfigure_handle()
        store.set(f"handle/{number}/{rank}", handle)
        handles = [store.get(f"handle/{number}/{m}").decode() for m in members]
        dist.distributed_c10d._reconfigure(uuid=number + 1, handles=handles, timeout=TIMEOUT).wait()
        _ready(None)
        times.append((number, time.perf_counter() - start))
    dist.destroy_process_group()


def _process(rank: int, way: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, len(EPOCHS[0]), rank == 0, timeout=TIMEOUT)
    times: list = []
    (_new_groups if way == "new group" else _reconfigured)(rank, store, times)
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(f"{n} {t}" for n, t in times))
    store.set(f"done/{rank}", "1")
    if rank == 0:  # the store's host stays until every member wrote its times
        store.wait([f"done/{r}" for r in range(len(EPOCHS[0]))])


def _job(way: str, port: int, out: str) -> list[float]:
    """The slowest member's time of each epoch, in seconds."""
    mp.start_processes(_process, args=(way, port, out), nprocs=len(EPOCHS[0]), join=True)
    slowest = [0.0] * len(EPOCHS)
    for rank in range(len(EPOCHS[0])):
        with open(f"{out}.{rank}") as f:
            for line in f.read().split("\n"):
                number, seconds = line.split()
                slowest[int(number)] = max(slowest[int(number)], float(seconds))
    return slowest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--port", type=int, default=29611)
    args = p.parse_args(argv)
    ways = ["new group"]
    if hasattr(dist.distributed_c10d, "_reconfigure"):
        ways.append("reconfigured")
    print(f"torch {torch.__version__}, {len(EPOCHS[0])} processes, epochs {EPOCHS}")
    out = f"/tmp/gossip_epoch_groups.{os.getpid()}"
    for way in ways:
        jobs = [_job(way, args.port + i, out) for i in range(args.repeats)]
        epochs = ", ".join(
            f"epoch {n} ({len(m)} members) {1000 * statistics.median(j[n] for j in jobs):.1f} ms"
            for n, m in enumerate(EPOCHS)
        )
        print(f"{way}: {epochs}", flush=True)
        args.port += args.repeats
    return 0


if __name__ == "__main__":
    sys.exit(main())
