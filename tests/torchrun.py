"""Launches a script under torchrun as a user does, and, when it fails, reports what its workers
said rather than torchrun's summary of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# torchrun's own lines: its elastic agent's log, and the summary it prints of a failed worker.
_LAUNCHER_PREFIXES = ("W1", "E1", "I1", "*", "Setting OMP_")
_LAUNCHER_TRACEBACK = 'Traceback (most recent call last):\n  File "<frozen runpy>"'


def torchrun(
    nproc: int,
    script: Path,
    *args: str,
    cwd: Path,
    timeout: float,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
):
    """Runs ``script args`` on nproc local workers of ``python`` and returns the finished process.
    Each worker dumps its Python stack on a fatal signal (faulthandler), so that an abort says
    where."""
    command = [python, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), str(script), *args]  # fmt: skip
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def failure_report(done: subprocess.CompletedProcess) -> str:
    """A failed launch in lines a log keeps whole: the exit status, what the workers wrote to
    stderr (torchrun's own lines left out), then the end of their stdout."""
    # torchrun's own traceback (its ChildFailedError) and summary close its stderr.
    stderr = done.stderr.split(_LAUNCHER_TRACEBACK)[0]
    workers = [
        line
        for line in stderr.splitlines()
        if line.strip() and not line.lstrip().startswith(_LAUNCHER_PREFIXES)
    ]
    return "\n".join(
        [
            f"torchrun exited with {done.returncode}; the workers' stderr:",
            *workers[-60:],
            "the end of their stdout:",
            *done.stdout.splitlines()[-20:],
        ]  # fmt: skip
    )
