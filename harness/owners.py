"""Whether the process that made an emulated cluster's namespaces or CPU caps still lives: the
leftovers of one that crashed are removed by the next cluster (``netns``, ``cpu_caps``)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
