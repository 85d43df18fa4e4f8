"""Runs a test function on N real processes over gloo (torch.multiprocessing.spawn, file:// store).

Each rank's return value is pickled to a file and handed back to the test, so the assertions run
in the test process against the reference.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args) -> None:
    torch.set_num_threads(1)  # many ranks share two cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """Runs fn(rank, world_size, *args) on world_size processes; returns their results by rank.

    fn must be a module-level function (it is pickled to the child processes).
    """
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "store")
        mp.spawn(_entry, args=(world_size, init_file, out_dir, fn, args), nprocs=world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
