"""Runs a test function on N real processes over gloo (file:// store).

Each rank's return value is pickled to a file and handed back to the test, so the assertions run
in the test process against the reference. :func:`run_ranks_tolerating_deaths` does the same for
fault tests, where a rank is meant to die and the others must not hang.

Ranks are forked from a forkserver that imported torch and gossip_ext once: a spawned process
spends 1.5-2 s of CPU importing torch before it runs a line of the test, and with a few ranks per
test on two cores that was most of the suite's time. The forkserver has run no torch op (no
thread pool exists to be broken by the fork) and each rank is still a process of its own, with
its own process group, as under spawn. A test whose ranks must start from a fresh interpreter
(one that reads the environment at process start, as malloc does) passes ``start_method="spawn"``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What the forkserver imports once, before it forks the first rank. torch._dynamo is the bulk of
# it: a process's first torch.optim optimizer imports it (and FSDP2 with it), 1.5-2 s of CPU that
# every rank of every test paid on its own before (test_streaming_diloco.py: 60 s -> 20 s). None
# of these starts a thread or runs a torch op, so a fork leaves no pool broken.
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.multiprocessing",
    "gossip_ext",
    "multiprocess",
]


def forkserver_context():
    """The multiprocessing context whose processes fork from the preloaded forkserver."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _context(start_method: str):
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    return forkserver_context() if start_method == "forkserver" else mp.get_context("spawn")


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
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """Ends a rank process whose results are written, skipping interpreter finalization.

    torch's gloo worker threads may drop the last reference to a Python-owned tensor just after a
    collective returns; if that happens while the interpreter finalizes, taking the GIL ends the
    thread through a noexcept frame and the process aborts ("terminate called without an active
    exception", in c10d::ProcessGroupGloo::runLoop). It reproduces with plain torch (broadcast,
    all_gather_object, destroy_process_group, exit) in about 6% of processes, so a test would
    fail at random on a race that is neither gossip_ext's nor what it tests.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def error_of(call: Callable[[], Any]) -> tuple[type, str] | None:
    """The type and message of what call() raises in a rank, for the test process to compare
    (an exception object may not survive pickling); None if it returns."""
    try:
        call()
    except Exception as error:
        return type(error), str(error)
    return None


@contextlib.contextmanager
def _time_limit_held():
    """Stops the clock of the suite's time limit (pytest-timeout's interval timer) while the
    ranks start, and restarts it with the time that was left: a limit that interrupted the start
    would leave the ranks already started out of the cleanup that kills them, sleeping on with
    the run's pipes open (a sub-pytest's caller then waited for them: seen in a full run on a
    loaded machine, where the server's first fork waited for its imports). Masking the signal
    would not do: another thread takes it, and Python runs the handler in the main thread."""
    left, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if left > 0:
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def run_ranks(
    world_size: int, fn: Callable, *args: Any, start_method: str = "forkserver"
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on world_size processes; returns their results by rank.

    fn must be a module-level function (it is pickled to the child processes). A rank that
    raises fails the test with its traceback; the ranks still running then, or when the test is
    interrupted (the suite's per-test time limit), are killed, never left behind.
    """
    _context(start_method)  # checks the name, and sets what a forkserver preloads
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "store")
        with _time_limit_held():
            context = mp.start_processes(
                _entry,
                args=(world_size, init_file, out_dir, fn, args),
                nprocs=world_size,
                join=False,
                start_method=start_method,
            )
        try:
            while not context.join():
                pass
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        results = []
        for rank in range(world_size):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


@dataclass
class RankOutcome:
    """How one rank of :func:`run_ranks_tolerating_deaths` ended."""

    exitcode: int | None  # -9 after SIGKILL; None: still running at the deadline (then killed)
    result: Any  # fn's return value; None if fn did not return


def run_ranks_tolerating_deaths(
    world_size: int, fn: Callable, *args: Any, deadline_s: float
) -> list[RankOutcome]:
    """Runs fn(rank, world_size, *args) on world_size processes, as :func:`run_ranks`, but lets
    ranks die (torch.multiprocessing.spawn tears every rank down when one dies by a signal).

    Every process gets deadline_s seconds of wall-clock time in all; those still running then are
    killed and reported with exitcode None, so a hang fails the test instead of blocking it.
    """
    context = _context("forkserver")
    with tempfile.TemporaryDirectory() as out_dir:
        init_file = os.path.join(out_dir, "store")
        processes = [
            context.Process(target=_entry, args=(rank, world_size, init_file, out_dir, fn, args))
            for rank in range(world_size)
        ]
        with _time_limit_held():
            for process in processes:
                process.start()
        end = time.monotonic() + deadline_s
        try:
            for process in processes:
                process.join(max(0.0, end - time.monotonic()))
        finally:
            hung = [process for process in processes if process.is_alive()]
            for process in hung:
                process.kill()
                process.join()
        outcomes = []
        for rank, process in enumerate(processes):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            result = None
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result = pickle.load(f)
            outcomes.append(RankOutcome(None if process in hung else process.exitcode, result))
        return outcomes


def _train_in_turn(rank: int, world_size: int, train: Callable, folder: str, configs: list):
    """One process of train_in_turn: each configuration in turn, each over a store file of its
    own (so each system's process group is its own), its results written by system."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers, read when it is imported
    results = {}
    for i, config in enumerate(configs):
        try:
            results[config.system] = train(rank, world_size, f"file://{folder}/store{i}", config)
        except Exception as error:
            raise RuntimeError(f"{config.system} failed on rank {rank}") from error
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    exit_without_finalizing()


def train_in_turn(train: Callable, configs: list, world_size: int, folder: str) -> dict:
    """Trains every configuration of the comparison harness one after the other on one set of
    ``world_size`` processes forked from the preloaded server (``train``: the benchmark's own
    per-process entry, ``harness.compare.worker.train`` or ``sharded.train``); rank 0's results
    by system. One launch for every system, where a launch each cost most of the time."""
    forkserver_context()  # what the server preloads
    mp.start_processes(
        _train_in_turn,
        args=(world_size, train, folder, configs),
        nprocs=world_size,
        start_method="forkserver",
    )
    with open(os.path.join(folder, "rank0.pkl"), "rb") as f:
        return pickle.load(f)
