"""Processes that end as a user's script ends: main() returns and the interpreter finalizes.

The suite's other processes fork from multiprocessing's forkserver, which ends every child with
os._exit: no atexit handler, no finalizer, no C++ static destructor runs, so nothing a library
leaves alive at exit can show there. A fresh interpreter per process exits as a script does but
spends 1.5-2 s of CPU importing torch, and the exit tests start fifty. So a parent started once
(``python tests/exiting_processes.py``, which imports torch and gossip_ext) forks each process on
request, and the child, having run ``MODULE.main()``, lets its SystemExit reach the top of the
interpreter: it exits through Py_Finalize, as ``python script.py`` does.

The parent reads one JSON request a line on stdin and answers one line on stdout:
``{"start": [module, argv, log]}`` -> ``{"pid": P}``; ``{"poll": P}`` -> ``{"returncode": C}``
(None while it runs; negative: the signal that ended it, so an abort is -6 where a shell says
134).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)


def _child(module: str, argv: list[str], log_path: str) -> None:
    """Runs in the forked child, and never returns: the SystemExit rises to the interpreter."""
    log = os.open(log_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.argv = [module, *argv]
    raise SystemExit(importlib.import_module(module).main())


def _serve() -> None:
    # Imported once, before any fork. torch._dynamo too: a process's first torch.optim optimizer
    # imports it, 1.5 s or more of CPU in each child otherwise (tests/multiprocess.py's forkserver
    # preloads it as well).
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401

    import gossip_ext  # noqa: F401

    ended: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            module, argv, log_path = request["start"]
            pid = os.fork()
            if pid == 0:
                _child(module, argv, log_path)
            answer = {"pid": pid}
        else:
            pid = request["poll"]
            if pid not in ended:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    ended[pid] = os.waitstatus_to_exitcode(status)
            answer = {"returncode": ended.get(pid)}
        print(json.dumps(answer), flush=True)


class Parent:
    """The test's side: one parent interpreter, started on first use, forking every process."""

    def __init__(self):
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parent,
            # The gossip_ext the tests import, whether installed or only in this checkout.
            env=dict(
                os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])
            ),
        )

    def ask(self, request: dict) -> dict:
        with self._lock:  # one request and its answer at a time, whatever thread asks
            return self._ask(request)

    def _ask(self, request: dict) -> dict:
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the exiting-process parent ended ({self._process.poll()})")
        return json.loads(answer)

    def start(self, module: str, argv: list[str], log_path: Path) -> ExitingProcess:
        log_path.touch()
        return ExitingProcess(self, self.ask({"start": [module, argv, str(log_path)]})["pid"])

    def close(self) -> None:
        self._process.stdin.close()
        self._process.wait(timeout=30)


class ExitingProcess:
    """A process the parent forked, with the part of subprocess.Popen's interface the tests use."""

    def __init__(self, parent: Parent, pid: int):
        self._parent = parent
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._parent.ask({"poll": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _serve()
