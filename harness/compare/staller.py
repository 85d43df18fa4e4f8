"""Stops a process now and then, as a machine that stalls does: SIGSTOP for a random 1 to 3
seconds at random times, about ``fraction`` of the time in all, then SIGCONT; never leaves it
stopped (SIGCONT on the way out, whatever ends this process).

    python -m harness.compare.staller PID FRACTION SEED

A worker of ``uneven`` starts it on itself: everything of the worker stops, its compute and its
communication threads alike, as a stalled machine's would.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

SHORTEST, LONGEST = 1.0, 3.0  # seconds a stall lasts


def stall(pid: int, fraction: float, seed: int) -> None:
    rng = random.Random(seed)
    mean_stall = (SHORTEST + LONGEST) / 2
    mean_gap = mean_stall * (1 - fraction) / fraction
    stopped = False
    try:
        while True:
            time.sleep(rng.expovariate(1 / mean_gap))
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            time.sleep(rng.uniform(SHORTEST, LONGEST))
            os.kill(pid, signal.SIGCONT)
            stopped = False
    except ProcessLookupError:
        return  # the worker ended
    finally:
        if stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the finally: never leave it stopped
    stall(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
