"""Runs one system of a comparison on N worker processes over gloo, local (loopback) or each in
its own network namespace behind a capped NIC (harness.netns), and returns rank 0's result
(``worker.train``'s). For torchft's systems it starts a lighthouse first and always stops it
after."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping

import torch.multiprocessing as mp

from harness import netns
from harness.compare import systems, worker
from harness.tasks.byte_lm import ByteLMConfig

_LIGHTHOUSE_PORT = 29510  # in rank 0's namespace on the emulated network


# What a worker process runs: ``module:function``(rank, world_size, init_method, config).
WORKER = "harness.compare.worker:train"
# How run() starts the workers of a run on this machine's loopback: each a fresh interpreter, so
# that its peak memory is its own. The tests, which need the numbers and not the memory, set
# "forkserver" to fork them from their preloaded server instead (seconds of imports a worker).
LOCAL_START_METHOD = "spawn"


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, config, target: str) -> None:
    # torchft's servers log every quorum unless told otherwise, read when a worker imports it; a
    # worker forked from a forkserver does not see what the parent set after the server started.
    os.environ.setdefault("RUST_LOG", "warn")
    module, function = target.split(":")
    train = getattr(importlib.import_module(module), function)
    result = train(rank, world_size, f"file://{init_file}", config)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter finalization: torch's gloo threads can abort a finalizing process
    # (docs/troubleshooting.md, "An abort at the very end of a run"), and the result is written.
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


def run_local(
    config: worker.RunConfig, workers: int, start_method: str = "spawn", target: str = WORKER
) -> dict:
    """``config`` on ``workers`` processes of this machine (loopback); rank 0's result.

    Each worker starts a fresh interpreter (``"spawn"``), so that its peak memory is its own;
    the tests, which need the numbers right and not the memory, fork theirs from a preloaded
    server (``"forkserver"``)."""
    with contextlib.ExitStack() as stack:
        if config.system.startswith("torchft"):
            config = config.with_lighthouse(stack.enter_context(lighthouse(workers)))
        out_dir = stack.enter_context(tempfile.TemporaryDirectory())
        init_file = os.path.join(out_dir, "store")
        mp.start_processes(
            _entry,
            args=(workers, init_file, out_dir, config, target),
            nprocs=workers,
            join=True,
            start_method=start_method,
        )
        with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
            return pickle.load(f)


@contextlib.contextmanager
def _lighthouse_in(cluster: netns.EmulatedCluster):
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


def run(
    config: worker.RunConfig,
    workers: int,
    rate: float | None,
    timeout: float,
    target: str = WORKER,
    rates: dict[int, float] | None = None,
    cpu_cores: float | None = None,
) -> dict:
    """``config`` on ``workers`` processes running ``target`` (a worker's ``module:function``):
    local if ``rate`` is None, else on an emulated cluster whose NICs are capped at ``rate``
    bits/s (``rates``: another rate for some ranks; ``cpu_cores``: each worker held to that many
    cores' time; needs root)."""
    if rate is None:
        if cpu_cores is not None:
            raise ValueError(f"cpu_cores={cpu_cores}: CPU caps need the emulated cluster (a rate)")
        return run_local(config, workers, LOCAL_START_METHOD, target)
    with netns.EmulatedCluster(workers, rate, rates, cpu_cores) as cluster:
        with contextlib.ExitStack() as stack:
            if config.system.startswith("torchft"):
                config = config.with_lighthouse(stack.enter_context(_lighthouse_in(cluster)))
            return cluster.run(target, config, timeout)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How a comparison runs every system: the same model, batches, warmup and sync period; each
    system at its own peak learning rate (``peak_lr``: the comparison's sweep, systems.PEAK_LR,
    unless a shorter run swept its own) unless ``lr`` sets one for all.
    DDP runs ``ddp_steps`` and its final held-out loss is the target; every other system runs
    ``steps``, more by default, so that one needing more steps than DDP can still reach it. Each
    schedule decays over its system's own steps."""

    steps: int
    ddp_steps: int
    model: ByteLMConfig = ByteLMConfig(layers=2, width=128, heads=4, context=64)
    batch_size: int = 8
    warmup: int = 20
    local_steps: int = 4
    eval_every: int = 30
    eval_windows: int = 64
    lr: float | None = None
    peak_lr: Mapping[str, float] = dataclasses.field(default_factory=lambda: systems.PEAK_LR)
    peak_lr_source: str = "harness.compare.systems.PEAK_LR"
    outer_lr: float = systems.Recipe.outer_lr
    outer_momentum: float = systems.Recipe.outer_momentum

    def config(self, system: str) -> worker.RunConfig:
        recipe = systems.Recipe(
            steps=self.ddp_steps if system == "ddp" else self.steps,
            lr=self.lr or self.peak_lr[system],
            warmup=self.warmup,
            local_steps=self.local_steps,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
        )
        return worker.RunConfig(
            system=system,
            recipe=recipe,
            model=self.model,
            batch_size=self.batch_size,
            eval_every=self.eval_every,
            eval_windows=self.eval_windows,
        )

    def describe(self, params: int) -> str:
        m = self.model
        return (
            f"Byte-level transformer of {params / 1e6:.2f}M parameters ({m.layers} layers, width "
            f"{m.width}, context {m.context}), batch {self.batch_size} per worker, one torch "
            f"thread per worker. Every system runs {self.steps} steps but DDP, which runs "
            f"{self.ddp_steps}: DDP's final held-out loss is the target, and the others may need "
            f"more steps to reach it. AdamW, warmup {self.warmup} steps then cosine decay over "
            f"each system's own steps, at "
            + (
                f"peak learning rate {self.lr:g}"
                if self.lr
                else f"each system's peak learning rate (`lr`: {self.peak_lr_source})"
            )
            + f"; H = {self.local_steps} for LocalSGD, SlowMo and DiLoCo, DiLoCo's outer lr "
            f"{self.outer_lr:g} (momentum {self.outer_momentum:g}, Nesterov), AsyncDiLoCo's "
            f"{systems.ASYNC_OUTER_LR:g} (momentum {systems.ASYNC_OUTER_MOMENTUM:g}, delayed). "
            "Held-out bits per "
            f"byte every {self.eval_every} steps (the mean over workers of each worker's own "
            f"model), off the clock."
        )


def run_systems(
    names: Iterable[str],
    protocol: Protocol,
    workers: int,
    rate: float | None,
    timeout: float,
) -> dict[str, dict]:
    """Each system of ``names`` that this Python can run (the others are named and left out),
    one after the other under ``protocol``; their results by name, progress on stdout. A system
    that cannot run at the protocol's sync period is refused before any runs."""
    names = list(names)
    for name in names:
        problem = systems.schedule_problem(name, protocol.local_steps)
        if problem:
            raise ValueError(problem)
    rows: dict[str, dict] = {}
    for name in names:
        why_not = systems.available(name)
        if why_not:
            print(f"left out: {why_not}", flush=True)
            continue
        started = time.monotonic()
        rows[name] = run(protocol.config(name), workers, rate, timeout)
        print(
            f"{name:>17}: {rows[name]['step_ms']:6.0f} ms/step, held-out "
            f"{rows[name]['final_bpb']:.3f} bits per byte ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return rows
