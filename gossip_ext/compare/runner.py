"""Runs one system of a comparison on N worker processes over gloo, local (loopback) or each in
its own network namespace behind a capped NIC (gossip_ext._netns), and returns rank 0's result
(``worker.train``'s). For torchft's systems it starts a lighthouse first and always stops it
after."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch.multiprocessing as mp

from gossip_ext import _netns
from gossip_ext.compare import worker

_LIGHTHOUSE_PORT = 29510  # in rank 0's namespace on the emulated network


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, config) -> None:
    result = worker.train(rank, world_size, f"file://{init_file}", config)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter finalization: torch's gloo threads can abort a finalizing process
    # (README, "An abort at the very end of a run"), and the result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def lighthouse(workers: int) -> Iterator[str]:
    """A torchft lighthouse for ``workers`` replica groups on 127.0.0.1; yields its address."""
    # torchft's servers log every quorum unless told otherwise, read once at import; the workers
    # inherit it.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=workers)
    try:
        port = int(server.address().rsplit(":", 1)[1])
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()


def run_local(config: worker.RunConfig, workers: int) -> dict:
    """``config`` on ``workers`` processes of this machine (loopback); rank 0's result."""
    with contextlib.ExitStack() as stack:
        if config.system.startswith("torchft"):
            config = dataclasses.replace(
                config, lighthouse=stack.enter_context(lighthouse(workers))
            )
        out_dir = stack.enter_context(tempfile.TemporaryDirectory())
        init_file = os.path.join(out_dir, "store")
        mp.start_processes(
            _entry,
            args=(workers, init_file, out_dir, config),
            nprocs=workers,
            join=True,
            start_method="spawn",
        )
        with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
            return pickle.load(f)


@contextlib.contextmanager
def _lighthouse_in(cluster: _netns.EmulatedCluster):
    """torchft's lighthouse in rank 0's namespace; yields its address."""
    address = f"{cluster.address(0)}:{_LIGHTHOUSE_PORT}"
    code = (
        "import time\n"
        "from torchft.coordination import LighthouseServer\n"
        f"server = LighthouseServer(bind={address!r}, min_replicas={cluster.workers})\n"
        "print('ready', flush=True)\n"
        "time.sleep(1e9)\n"
    )
    env = dict(os.environ, RUST_LOG="warn")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("torchft's lighthouse did not start")
        yield f"http://{address}"
    finally:
        proc.kill()
        proc.wait()


def run(config: worker.RunConfig, workers: int, rate: float | None, timeout: float) -> dict:
    """``config`` on ``workers`` processes: local if ``rate`` is None, else on an emulated cluster
    whose NICs are capped at ``rate`` bits/s (needs root)."""
    if rate is None:
        return run_local(config, workers)
    with _netns.EmulatedCluster(workers, rate) as cluster:
        with contextlib.ExitStack() as stack:
            if config.system.startswith("torchft"):
                address = stack.enter_context(_lighthouse_in(cluster))
                config = dataclasses.replace(config, lighthouse=address)
            return cluster.run("gossip_ext.compare.worker:train", config, timeout)
