"""The membership service of an elastic job: a torch TCPStore run as a small standalone process::

    python -m gossip_ext.membership --port 29400

It is the one process that must outlive the workers (as torchft's lighthouse and torchrun's
rendezvous host are); it holds a few keys (:mod:`gossip_ext.epochs`) and carries no training
traffic. Workers connect with ``GossipDataParallel(module, membership="HOST:29400",
min_workers=m)``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

import torch.distributed as dist


def serve(host: str, port: int, stop: threading.Event | None = None) -> None:
    """Runs the membership service until ``stop`` is set (or SIGINT/SIGTERM)."""
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
    print(f"gossip_ext membership service on {host}:{store.port}", flush=True)
    stop = stop or threading.Event()
    stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gossip_ext.membership",
        description="The membership service of an elastic gossip_ext job (a torch TCPStore).",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    serve(args.host, args.port, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
