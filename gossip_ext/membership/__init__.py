"""Who trains with whom: a static process group or an elastic job's epochs (``runtime``), the
elastic job's service (``service``, ``python -m gossip_ext.membership``), its key protocol
(``epochs``), a worker's moves between epochs and the handoff to a joining worker
(``elastic``), and the process group of an epoch (``epoch_group``)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The service's command line, ``python -m gossip_ext.membership`` (imported when called:
    a worker that imports this package never starts a service)."""
    from gossip_ext.membership.service import main as service_main

    return service_main(argv)
