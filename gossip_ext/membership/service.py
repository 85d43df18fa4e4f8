"""The membership service of an elastic job: a torch TCPStore run as a small standalone process::

    python -m gossip_ext.membership --port 29400

It is the one process that must outlive the workers (as torchft's lighthouse and torchrun's
rendezvous host are); it holds a few keys (:mod:`gossip_ext.membership.epochs`) and carries no
training traffic. Workers connect with ``GossipDataParallel(module,
membership=gossip_ext.Elastic("HOST:29400", min_workers=m))``.

.. note::
    The service's own output is one line on stdout, printed once the store listens, that names
    its source as torch's log lines name theirs::

        [gossip_ext.membership] membership service on 0.0.0.0:29400, ready

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
import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist

PREFIX = "[gossip_ext.membership]"
# What the ready line holds, for a launcher to wait for: "{PREFIX} {READY} HOST:PORT, ready".
READY = "membership service on"


def serve(host: str, port: int, stop: threading.Event | None = None) -> None:
    """Runs the membership service until ``stop`` is set (or SIGINT/SIGTERM). Prints the ready
    line to stdout once the store listens (port 0: the port the system chose)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    print(f"{PREFIX} {READY} {host}:{store.port}, ready", file=sys.stdout, flush=True)
    stop = stop or threading.Event()
    stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gossip_ext.membership",
        description="The membership service of an elastic gossip_ext job (a torch TCPStore). "
        f"Prints '{PREFIX} {READY} HOST:PORT, ready' to stdout once it listens; lines on stderr "
        "are torch's (TORCH_CPP_LOG_LEVEL=ERROR in its environment silences c10d's warnings).",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument(
        "--port", type=int, required=True, help="port to listen on (0: one the system chooses)"
    )
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.host, args.port, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
