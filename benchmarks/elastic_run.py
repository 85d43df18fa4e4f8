"""One run of benchmarks/elastic.py: a job started on the emulated cluster, a worker failed and
replaced in it, every worker's result collected.

run_once starts the system's coordinator (gossip_ext's membership service or torchft's
lighthouse) in the cluster's last namespace and one benchmarks/elastic_worker.py per slot in the
others, lets them all go at once, SIGKILLs or SIGSTOPs the victim after its step --fail-at,
starts a replacement on its slot when worker 0 passes step --replace-at, and returns the events'
times and every finished worker's timeline. With --shards S each worker is a replica of S
processes in its slot's namespace, and the victim is its process --victim-shard.

``gossip_sealed`` is ``gossip`` with a job secret: a random token new with every run, in the
environment of the service and of every worker (GOSSIP_EXT_JOB_SECRET), never on a command line
(``ps`` shows arguments to every user, a process's environment only to its owner and root). Every
other system runs without one, whatever the benchmark's own environment holds, and the service's
ready line must say which the job is.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the root: harness/

from gossip_ext.membership import trust  # noqa: E402
from harness import netns  # noqa: E402
from harness.compare import systems  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")
PORT = 29400  # the coordinator's, in its own namespace
REPLICA_PORT = 29500  # a sharded replica's own rendezvous, at its slot's address
PEAK_LR = {
    "gossip": systems.PEAK_LR["overlap_sgp_bf16"],
    "gossip_static": systems.PEAK_LR["overlap_sgp_bf16"],
    "gossip_sealed": systems.PEAK_LR["overlap_sgp_bf16"],
    "torchft": systems.PEAK_LR["torchft_localsgd"],
}


def _job_env(system: str) -> dict[str, str]:
    """The environment of a run's coordinator and workers: a new job secret for gossip_sealed,
    none for any other system (one set where the benchmark runs would seal the open job)."""
    env = {
        k: v for k, v in os.environ.items() if k not in (trust.SECRET_ENV, trust.SECRET_FILE_ENV)
    }
    if system == "gossip_sealed":
        env[trust.SECRET_ENV] = secrets.token_hex(32)
    return env


def _coordinator(system: str, cluster: netns.EmulatedCluster, args, out: str, env: dict):
    """gossip_ext's membership service or torchft's lighthouse, in the cluster's last namespace;
    returns (process, the address the workers are given, the service's ready line or "")."""
    rank = cluster.workers - 1
    host = cluster.address(rank)
    if system.startswith("gossip"):  # a static job's store is the same service
        argv = [sys.executable, "-m", "gossip_ext.membership", "--host", host, "--port", str(PORT)]
        address, ready = f"{host}:{PORT}", "membership service on"
    else:
        lighthouse = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable))
        lighthouse = lighthouse or shutil.which("torchft_lighthouse")
        if lighthouse is None:
            raise RuntimeError("torchft_lighthouse not found (pip install torchft==0.2.0)")
        argv = [
            lighthouse, "--bind", f"{host}:{PORT}", "--min_replicas", str(args.min_workers),
            "--heartbeat_timeout_ms", str(args.heartbeat_ms),
        ]  # fmt: skip
        address, ready = f"http://{host}:{PORT}", None
    log = open(os.path.join(out, "coordinator.log"), "w")  # noqa: SIM115 - closed by the caller
    proc = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(rank), *argv],
        env=dict(env, RUST_LOG="warn", PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE if ready else log,
        stderr=log,
        text=True,
    )
    line = (proc.stdout.readline() or "").strip() if ready else ""
    if ready and ready not in line:
        raise RuntimeError(f"the {system} coordinator did not start: see {log.name}")
    if ready and (trust.OPEN_PORT_WARNING not in line) != (system == "gossip_sealed"):
        raise RuntimeError(f"the {system} job's service says: {line}")
    if not ready:
        time.sleep(1.0)  # the lighthouse prints nothing when it is up; its workers retry
        if proc.poll() is not None:
            raise RuntimeError(f"torchft_lighthouse exited: {open(log.name).read()[-2000:]}")
    return proc, address, line


def _last_step(path: str) -> int:
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    return int(lines[-1].split()[0]) if lines else -1


class _Workers:
    def __init__(
        self, cluster, system: str, address: str, args, out: str, seed: int, env: dict
    ) -> None:
        self.cluster, self.system, self.address = cluster, system, address
        self.args, self.out, self.seed, self.env = args, out, seed, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        # The victim's processes (a sharded replica's: all of them), any exit status expected.
        self.failed: set[str] = set()

    def replica(self, name: str) -> list[str]:
        """The processes of worker ``name``: itself, and with --shards S its S - 1 others."""
        return [name, *(f"{name}.{k}" for k in range(1, self.args.shards))]

    def start(self, name: str, slot: int, *extra: str) -> None:
        # A replacement replica on the victim's slot rendezvous at another port than the dead.
        port = REPLICA_PORT + (1 if name == "replacement" else 0)
        for shard, process in enumerate(self.replica(name)):
            sharding = ["--shards", str(self.args.shards), "--shard", str(shard)]
            self._start(process, slot, *extra, *sharding, "--replica-port", str(port))

    def _start(self, name: str, slot: int, *extra: str) -> None:
        argv = [
            sys.executable, WORKER, "--system", self.system, "--coordinator", self.address,
            "--out", self.out, "--name", name, "--slot", str(slot), "--steps", str(self.args.steps),
            "--lr", str(PEAK_LR[self.system]), "--min-workers", str(self.args.min_workers),
            "--timeout", str(self.args.timeout), "--seed", str(self.seed), *extra,
        ]  # fmt: skip
        env = dict(
            self.env,
            GLOO_SOCKET_IFNAME=netns.IFNAME,
            GOSSIP_EXT_HOST=self.cluster.address(slot),
            PYTHONUNBUFFERED="1",
            RUST_LOG="warn",
        )
        log = open(os.path.join(self.out, f"{name}.log"), "w")  # noqa: SIM115
        self.started[name] = time.time()
        self.procs[name] = subprocess.Popen(
            ["ip", "netns", "exec", self.cluster.namespace(slot), *argv],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def step(self, name: str) -> int:
        return _last_step(os.path.join(self.out, f"{name}.steps"))

    def check(self, deadline: float) -> None:
        if time.time() > deadline:
            raise TimeoutError(f"the run did not finish within {self.args.run_timeout:.0f} s")
        for name, proc in self.procs.items():
            code = proc.poll()
            if code not in (None, 0) and name not in self.failed:
                with open(os.path.join(self.out, f"{name}.log")) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"{self.system} worker {name} exited with {code}:\n{tail}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def run_once(
    cluster, system: str, args, seed: int, failure: str | None, without_victim: bool = False
) -> dict:
    """One job of ``system``; with ``failure`` ("kill" or "stall"), the victim killed or stopped,
    and replaced; ``without_victim``, a job that never had the victim's slot. Every worker's
    result, and the times of the events."""
    with (
        tempfile.TemporaryDirectory(prefix="gossip-elastic-") as out,
        contextlib.ExitStack() as stack,
    ):
        env = _job_env(system)
        coordinator, address, ready = _coordinator(system, cluster, args, out, env)
        stack.callback(lambda: (coordinator.kill(), coordinator.wait()))
        workers = _Workers(cluster, system, address, args, out, seed, env)
        stack.callback(workers.close)
        slots = [s for s in range(args.workers) if not (without_victim and s == args.victim)]
        names = [f"w{slot}" for slot in slots]
        go = os.path.join(out, "go")
        for slot, name in zip(slots, names):
            workers.start(name, slot, "--go", go, "--world-size", str(len(slots)))
        deadline = time.time() + args.run_timeout
        processes = [p for n in names for p in workers.replica(n)]
        while not all(os.path.exists(os.path.join(out, f"{n}.ready")) for n in processes):
            workers.check(deadline)
            time.sleep(0.05)
        open(go, "w").close()
        events = {"go": time.time()}
        victim = f"w{args.victim}"
        while failure and "replaced" not in events:
            workers.check(deadline)
            if "failed" not in events and workers.step(victim) >= args.fail_at:
                stop = signal.SIGKILL if failure == "kill" else signal.SIGSTOP
                workers.failed = set(workers.replica(victim))
                workers.procs[workers.replica(victim)[args.victim_shard]].send_signal(stop)
                events["failed"] = time.time()
            if "failed" in events and workers.step("w0") >= args.replace_at:
                workers.start("replacement", args.victim, "--joiner")
                events["replaced"] = workers.started["replacement"]
            time.sleep(0.01)
        while any(p.poll() is None for n, p in workers.procs.items() if n not in workers.failed):
            workers.check(deadline)
            time.sleep(0.1)
        workers.check(deadline)
        finished, changes = {}, {}
        for name in workers.procs:
            if "." in name:
                continue  # a sharded replica's other process: its leader speaks for it
            with open(os.path.join(out, f"{name}.log")) as f:
                changes[name] = [line.strip() for line in f if " epoch " in line]
            if name not in workers.failed:
                with open(os.path.join(out, f"{name}.json")) as f:
                    finished[name] = json.load(f)
        return {"system": system, "seed": seed, "failure": failure, "workers_started": len(slots),
                "events": events, "coordinator": ready,
                "workers": finished, "epoch_changes": changes}  # fmt: skip
