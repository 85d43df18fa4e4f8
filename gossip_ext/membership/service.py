"""The membership service of an elastic job: a torch TCPStore run as a small standalone process::

    python -m gossip_ext.membership --port 29400

It is the one process that must outlive the workers (as torchft's lighthouse and torchrun's
rendezvous host are); it holds a few keys (:mod:`gossip_ext.membership.epochs`) and carries no
training traffic. Workers connect with ``GossipDataParallel(module,
membership=gossip_ext.Elastic("HOST:29400", min_workers=m))``.

The service and every worker share the job's secret (the environment variable
``GOSSIP_EXT_JOB_SECRET``, or a file that ``GOSSIP_EXT_JOB_SECRET_FILE`` names; never a
command-line argument, which ``ps`` shows): the service seals the job's nonce with it, and the
workers seal every value they write (:mod:`gossip_ext.membership.trust`).

.. note::
    The service's own output is one line on stdout, printed once the store listens on the address
    it really bound, that names its source as torch's log lines name theirs, and says whether the
    job is sealed::

        [gossip_ext.membership] membership service on 0.0.0.0:29400, ready; job secret set: ...

    Anything on stderr is torch's. Where no DNS server answers (a machine without a network),
    c10d logs ``[W... socket.cpp:207] [c10d] The hostname of the client socket cannot be
    retrieved. err=-3`` while the store starts: the reverse lookup of the store's own connection
    failed, and the store serves all the same. torch reads its C++ log level once, when it is
    imported, so the service cannot lower it itself; ``TORCH_CPP_LOG_LEVEL=ERROR`` in the
    environment that starts the service silences such warnings. A launcher waits for the line
    above on stdout (``READY``), never for the first line of a log that merges both streams.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist

from gossip_ext.membership import trust

PREFIX = "[gossip_ext.membership]"
# What the ready line holds, for a launcher to wait for: "{PREFIX} {READY} HOST:PORT, ready".
READY = "membership service on"


def serve(
    host: str, port: int, stop: threading.Event | None = None, secret: bytes | None = None
) -> None:
    """Runs the membership service until ``stop`` is set (or SIGINT/SIGTERM), for the job of
    ``secret`` (None: an open job). Prints the ready line to stdout once the store listens on the
    address bound (port 0: the port the system chose)."""
    listening = _listen(host, port)
    bound_host, bound_port = listening.getsockname()[:2]
    store = dist.TCPStore(
        host,
        bound_port,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listening.detach(),  # the store owns the socket from now on
    )
    answers = trust.start_job(store, secret)  # the workers' challenges, answered
    sealed = (
        "job secret set: only workers that hold it can join"
        if secret is not None
        else trust.OPEN_PORT_WARNING
    )
    address = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"{PREFIX} {READY} {address}:{bound_port}, ready; {sealed}", file=sys.stdout, flush=True)
    stop = stop or threading.Event()
    stop.wait()
    if answers is not None:
        answers.stop()


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` and nowhere else: the store is handed it, since
    given a host alone it listens on every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r} does not resolve to an address: {error}") from error
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(infos[0][4])
    except OSError as error:
        listening.close()
        raise OSError(f"the membership service cannot listen on {host}:{port}: {error}") from error
    listening.listen(socket.SOMAXCONN)
    return listening


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gossip_ext.membership",
        description="The membership service of an elastic gossip_ext job (a torch TCPStore). "
        f"Prints '{PREFIX} {READY} HOST:PORT, ready; ...' to stdout once it listens; lines on "
        "stderr are torch's (TORCH_CPP_LOG_LEVEL=ERROR in its environment silences c10d's "
        f"warnings). The job's secret comes from {trust.SECRET_ENV} or the file "
        f"{trust.SECRET_FILE_ENV} names (never an argument: ps shows those).",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument(
        "--port", type=int, required=True, help="port to listen on (0: one the system chooses)"
    )
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.host, args.port, stop, trust.job_secret())
    return 0


if __name__ == "__main__":
    sys.exit(main())
