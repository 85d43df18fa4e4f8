"""Each worker of an emulated cluster held to its own share of the machine's cores.

More workers than cores share the cores by the scheduler's whim: a worker that sleeps (the
half-speed one, or one stopped by SIGSTOP) hands its share to the others, which then step faster
than they would on machines of their own. :class:`CpuCaps` puts each worker in a cgroup of its
own (cgroup v1's cpu controller, CFS bandwidth) allowed ``cores`` cores' time per period: the
workers' compute is then each its own machine's, whatever the others do.

Groups are named ``gossipx-<pid>-<n>/w<rank>`` under the cpu controller's mount; a crashed run's
are found by their dead owner pid and removed when the next caps start. Needs root.
"""

from __future__ import annotations

import os
import re

from harness import owners

MOUNT = "/sys/fs/cgroup/cpu"
PREFIX = "gossipx"
_PERIOD_US = 100_000
_counter = 0


def unavailable() -> str | None:
    """Why caps cannot be set here, or None."""
    if not os.path.isfile(os.path.join(MOUNT, "cpu.cfs_quota_us")):
        return f"no cgroup v1 cpu controller at {MOUNT}"
    if not os.access(MOUNT, os.W_OK):
        return f"{MOUNT} is not writable (needs root)"
    return None


def _remove(folder: str) -> None:
    """Removes a caps folder and its workers' groups (empty ones: their processes ended)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            os.rmdir(path)
    os.rmdir(folder)


def remove_stale() -> list[str]:
    """Removes the groups of caps whose owning process is gone; returns their names."""
    removed = []
    for name in os.listdir(MOUNT):
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+", name)
        if match and not owners.alive(int(match.group(1))):
            _remove(os.path.join(MOUNT, name))
            removed.append(name)
    return removed


class CpuCaps:
    """``workers`` cgroups of ``cores`` cores each (0.25: a quarter of one core's time). Use as
    a context manager; :meth:`place` puts a worker's process in its group, with every thread it
    has and every process it starts."""

    def __init__(self, workers: int, cores: float):
        global _counter
        if cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot cap the workers' CPU: {why}")
        self.workers, self.cores = workers, cores
        _counter += 1
        self.folder = os.path.join(MOUNT, f"{PREFIX}-{os.getpid()}-{_counter}")

    def __enter__(self) -> CpuCaps:
        remove_stale()
        os.mkdir(self.folder)
        for rank in range(self.workers):
            group = os.path.join(self.folder, f"w{rank}")
            os.mkdir(group)
            with open(os.path.join(group, "cpu.cfs_period_us"), "w") as f:
                f.write(str(_PERIOD_US))
            with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(max(1000, round(self.cores * _PERIOD_US))))
        return self

    def place(self, rank: int, pid: int) -> None:
        with open(os.path.join(self.folder, f"w{rank}", "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def throttled_seconds(self, rank: int) -> float:
        """How long the group's processes were held back by the cap, in seconds."""
        with open(os.path.join(self.folder, f"w{rank}", "cpu.stat")) as f:
            stat = dict(line.split() for line in f if line.strip())
        return int(stat.get("throttled_time", 0)) / 1e9

    def __exit__(self, *exc) -> None:
        # The workers have ended (the cluster waits for or kills them first): empty groups.
        if os.path.isdir(self.folder):
            _remove(self.folder)
