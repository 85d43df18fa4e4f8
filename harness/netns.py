"""An emulated cluster on one Linux machine, for measuring training over a slow network.

Every worker runs in its own network namespace behind a veth pair whose two ends are rate-capped
with tbf (its upload inside the namespace, its download on the bridge side), so each worker has a
full-duplex NIC of the chosen speed. A worker may be several processes, one machine
(``EmulatedCluster.run(..., per_namespace=n)``): they share its namespace and its NIC. The
bridge joining them lives in a namespace of its own: the cluster adds nothing to the host's
network, and its addresses (198.18.0.0/15, reserved for benchmarking) exist only inside
namespaces it created. Needs root and ``ip netns``.

Every namespace is named ``gossipx-<pid>-<n>-...``; deleting the namespaces deletes the veths
and the bridge in them. A crashed run's leftovers are found by their dead owner pid and removed
when the next cluster starts.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from harness import cpu_caps, owners

PREFIX = "gossipx"
IFNAME = "eth0"  # the worker's NIC inside its namespace: GLOO_SOCKET_IFNAME
STORE_PORT = 29500
_SUBNET = "198.18.0"  # 198.18.0.0/15 is reserved for network benchmarks (RFC 2544)
_MAX_WORKERS = 250
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_counter = 0
# The folder holding harness/: every worker imports harness.netns and its target from there,
# whatever the directory the cluster was started from.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_rate(text: str) -> float:
    """'1gbit', '100mbit', '2.5gbit' -> bits per second (tc's units, powers of ten)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"bandwidth must look like 1gbit, 100mbit or 2.5gbit, got {text!r}")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def rate_option(parser, bandwidth: str | None, workers: int) -> float | None:
    """A command's --bandwidth in bits/s, None when not given; an argparse error naming the flag
    when it does not parse or there are fewer than two workers to connect."""
    if bandwidth is None:
        return None
    try:
        rate = parse_rate(bandwidth)
    except ValueError as e:
        parser.error(f"--bandwidth: {e}")
    if workers < 2:
        parser.error(f"--bandwidth needs --workers >= 2, got {workers}")
    return rate


def format_rate(bits_per_s: float) -> str:
    if bits_per_s >= 1e9:
        return f"{bits_per_s / 1e9:g} Gbit/s"
    return f"{bits_per_s / 1e6:g} Mbit/s"


def unavailable() -> str | None:
    """Why an emulated cluster cannot be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs the `{tool}` command (iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Deletes the namespaces of clusters whose owning process is gone; returns their names."""
    removed = []
    for name in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-\w+", name)
        if match and not owners.alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def leftovers() -> list[str]:
    """This process's cluster namespaces that still exist (empty after every teardown)."""
    return [n for n in _namespaces() if n.startswith(f"{PREFIX}-{os.getpid()}-")]


class _SignalsRaise:
    """SIGTERM and SIGHUP raise SystemExit while a cluster exists, so its teardown runs on them as
    it does on Ctrl-C (KeyboardInterrupt). Only the main thread can install handlers."""

    def __enter__(self):
        self._saved = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._saved[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)


class EmulatedCluster:
    """`workers` namespaces on one bridge, each worker's NIC capped at `rate` bits/s both ways
    (`rates`: another rate for some ranks, {rank: bits/s}: a machine behind a slower link);
    `cpu_cores`: each worker process held to that many cores' time (``cpu_caps.CpuCaps``), as
    if each had a machine of its own; None lets them share the cores as the scheduler does.

    Use as a context manager: the namespaces (and with them every veth and the bridge) are
    deleted on exit, on an error and on Ctrl-C or SIGTERM.
    """

    def __init__(
        self,
        workers: int,
        rate: float,
        rates: dict[int, float] | None = None,
        cpu_cores: float | None = None,
    ):
        global _counter
        if not 2 <= workers <= _MAX_WORKERS:
            raise ValueError(f"workers must be in [2, {_MAX_WORKERS}], got {workers}")
        self.rates = dict.fromkeys(range(workers), rate)
        for rank, value in (rates or {}).items():
            if rank not in self.rates:
                raise ValueError(f"rates: rank {rank} is not one of the {workers} workers")
            self.rates[rank] = value
        for rank, value in self.rates.items():
            if value <= 0:
                raise ValueError(f"rate must be > 0 bits/s, got {value} (rank {rank})")
        self.workers, self.rate, self.cpu_cores = workers, rate, cpu_cores
        _counter += 1
        self._base = f"{PREFIX}-{os.getpid()}-{_counter}"
        self.hub = f"{self._base}-hub"
        self._signals = _SignalsRaise()

    def namespace(self, rank: int) -> str:
        return f"{self._base}-w{rank}"

    def address(self, rank: int) -> str:
        return f"{_SUBNET}.{rank + 1}"

    def _tbf(self, namespace: str, device: str, rate: float) -> None:
        bytes_per_s = rate / 8
        # The bucket must hold a whole 64 KiB GSO segment and about 2 ms at the rate; the queue
        # is long enough that bursts from several senders are delayed, not dropped (a drop costs
        # a TCP retransmission timeout, which no real switch port of this speed would add).
        burst = max(256 * 1024, int(bytes_per_s * 0.002))
        _run(
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "200ms",
        )  # fmt: skip

    def __enter__(self) -> EmulatedCluster:
        self._signals.__enter__()
        try:
            remove_stale()
            _run("ip", "netns", "add", self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for rank in range(self.workers):
                ns, port = self.namespace(rank), f"p{rank}"
                _run("ip", "netns", "add", ns)
                # Both ends are created inside their namespaces: nothing appears on the host.
                _run(
                    "ip", "link", "add", IFNAME, "netns", ns, "type", "veth",
                    "peer", "name", port, "netns", self.hub,
                )  # fmt: skip
                _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", IFNAME)
                _run("ip", "-n", ns, "link", "set", IFNAME, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                self._tbf(ns, IFNAME, self.rates[rank])  # the worker's upload
                self._tbf(self.hub, port, self.rates[rank])  # its download
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            for name in [self.namespace(r) for r in range(self.workers)] + [self.hub]:
                subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        finally:
            self._signals.__exit__(*exc)

    def run(
        self,
        target: str,
        payload,
        timeout: float,
        sys_path: str | None = None,
        per_namespace: int = 1,
    ):
        """Runs `module:function`(rank, world_size, init_method, payload) on every worker, each
        in its namespace, and returns rank 0's result. Raises RuntimeError naming the rank and
        showing its output when a worker fails, and TimeoutError after `timeout` seconds.

        ``per_namespace`` > 1 starts that many processes in each namespace, with consecutive
        ranks (namespace n holds ranks n * per_namespace onwards) and one rendezvous for all:
        their traffic with each other stays inside the namespace (its own address is local,
        routed over its loopback), only their traffic with other namespaces crosses the capped
        NIC. A group of processes that holds one sharded model is one machine so."""
        if per_namespace < 1:
            raise ValueError(f"per_namespace must be >= 1, got {per_namespace}")
        world_size = self.workers * per_namespace
        with tempfile.TemporaryDirectory(prefix="gossipx-") as tmp:
            spec = os.path.join(tmp, "spec.pkl")
            with open(spec, "wb") as f:
                pickle.dump((target, payload, sys_path), f)
            path = os.pathsep.join(d for d in (_ROOT, os.environ.get("PYTHONPATH")) if d)
            env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, PYTHONUNBUFFERED="1", PYTHONPATH=path)
            caps = None if self.cpu_cores is None else cpu_caps.CpuCaps(world_size, self.cpu_cores)
            with caps or contextlib.nullcontext():
                return self._run_workers(spec, tmp, env, per_namespace, caps, timeout)

    def _run_workers(self, spec, tmp, env, per_namespace, caps, timeout):
        """Starts every worker process (each in its group of ``caps``, a ``cpu_caps.CpuCaps``,
        where given), waits for them, and returns rank 0's result; ends them all."""
        world_size = self.workers * per_namespace
        init = f"tcp://{self.address(0)}:{STORE_PORT}"
        procs, logs = [], []
        try:
            for rank in range(world_size):
                machine = rank // per_namespace
                log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
                logs.append(log)
                argv = [sys.executable, "-m", "harness.netns", spec, str(rank)]
                argv += [str(world_size), init, os.path.join(tmp, "out.pkl")]
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", self.namespace(machine), *argv],
                        # The worker's own address, for servers it tells its peers about.
                        env=dict(env, GOSSIP_EXT_HOST=self.address(machine)),
                        # Rank 0 shows its progress; the others' output is kept for errors.
                        stdout=None if rank == 0 else log,
                        stderr=log,
                    )
                )
                if caps is not None:
                    # `ip netns exec` becomes the worker (it execs), so its pid is the worker's.
                    caps.place(rank, procs[-1].pid)
            _wait_all(procs, logs, timeout)
            with open(os.path.join(tmp, "out.pkl"), "rb") as f:
                return pickle.load(f)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
            for log in logs:
                log.close()


def _wait_all(procs, logs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank = failed[0]
            logs[rank].seek(0)
            tail = logs[rank].read()[-3000:]
            raise RuntimeError(f"worker {rank} exited with {codes[rank]}:\n{tail}")
        if all(c == 0 for c in codes):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the cluster's workers did not finish within {timeout:.0f} s")


def _worker_main(spec: str, rank: str, world_size: str, init_method: str, out: str) -> None:
    import importlib

    with open(spec, "rb") as f:
        target, payload, sys_path = pickle.load(f)
    if sys_path:
        sys.path.insert(0, sys_path)
    module, function = target.split(":")
    fn = getattr(importlib.import_module(module), function)
    result = fn(int(rank), int(world_size), init_method, payload)
    if int(rank) == 0:
        with open(out + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(out + ".tmp", out)
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo's threads can abort a finalizing interpreter (see tests/multiprocess.py): leave at once.
    os._exit(0)


if __name__ == "__main__":
    _worker_main(*sys.argv[1:])
