"""docs/scaling.md's consensus table: how fast each graph's push-sum rounds bring 64, 256 and 1,024
workers' models together, from the compiled engine's own numerics (``gossip_ext.simulate``: every
worker a thread of this process over the in-process transport), not from a formula.

    python benchmarks/plan_consensus.py            # rewrites the table in docs/scaling.md
    python benchmarks/plan_consensus.py --check    # fails if the table's 64-worker column differs

What it is: pure averaging, every worker starting from its own value and no training step between
the rounds; the rounds a graph needs at a size for the workers' distance to their mean to fall
below 1% and 1e-6 of it. What it is not: a loss. Training adds a step's drift before every round,
and what that costs in held-out loss depends on the task (benchmarks/RESULTS.md, for this
project's).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import gossip_ext  # noqa: E402
from gossip_ext.graphs import (  # noqa: E402
    DynamicBipartiteExponentialGraph,
    DynamicDirectedExponentialGraph,
    GraphBase,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)

DOC = os.path.join(ROOT, "docs", "scaling.md")
PART = "plan_consensus"
WORKERS = (64, 256, 1024)
CHECKED = (64,)  # the column --check recomputes (1,024 threads take a minute)
VALUES = 16  # each worker's vector
CAP = 64  # rounds run at most
LEVELS = (1e-2, 1e-6)
# Each row: a name, the graph, the message format (None: full precision).
ROWS: list[tuple[str, GraphBase, str | None]] = [
    ("exponential, 1 peer (the default)", NPeerDynamicDirectedExponentialGraph(), None),
    ("exponential, 1 peer, int8 messages", NPeerDynamicDirectedExponentialGraph(), "int8"),
    ("exponential, 2 peers", NPeerDynamicDirectedExponentialGraph(peers_per_itr=2), None),
    ("directed exponential", DynamicDirectedExponentialGraph(), None),
    ("bipartite exponential", DynamicBipartiteExponentialGraph(), None),
    ("ring", RingGraph(), None),
]


def distances(graph: GraphBase, workers: int, fmt: str | None) -> list[float]:
    """max_i ||z_i - mean|| / ||mean|| before the first round and after each of CAP rounds, every
    worker starting from its own draw of U[1, 2)^VALUES (seeded by the size)."""
    start = 1 + torch.rand(
        workers, VALUES, dtype=torch.float32, generator=torch.Generator().manual_seed(workers)
    )
    z = gossip_ext.simulate(graph, start, rounds=CAP, message_dtype=fmt)
    mean = start.double().mean(0)
    return [float((zk.double() - mean).norm(dim=1).max() / mean.norm()) for zk in z]


def cell(found: list[float]) -> str:
    """The rounds to each of LEVELS (``>CAP`` where not reached, with the distance then)."""
    reached = []
    for level in LEVELS:
        k = next((k for k, d in enumerate(found) if d <= level), None)
        reached.append(f">{CAP}" if k is None else str(k))
    if f">{CAP}" in reached:
        return " / ".join(reached) + f" ({found[-1]:.0e} after {CAP})"
    return " / ".join(reached)


def table(workers: tuple[int, ...] = WORKERS) -> str:
    lines = [
        "| graph | " + " | ".join(f"{n} workers" for n in workers) + " |",
        "|---|" + "---|" * len(workers),
    ]
    for name, graph, fmt in ROWS:
        cells = [cell(distances(graph, n, fmt)) for n in workers]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def section() -> str:
    logs = ", ".join(f"{int(math.log2(n))} at {n:,}" for n in WORKERS)
    body = (
        "Written by `python benchmarks/plan_consensus.py` from the compiled engine "
        "(`gossip_ext.simulate`, float32 values, uniform mixing): the rounds until every "
        "worker is within 1% / within 1e-6 of the mean (relative to it), each worker starting "
        f"from its own draw; `>{CAP}`: not within {CAP} rounds (the distance then in "
        f"parentheses). log2 n is {logs}.\n\n" + table()
    )
    return f"<!-- {PART}: begin -->\n{body}\n<!-- {PART}: end -->"


def _column(text: str, index: int) -> list[str]:
    """The ``index``-th workers column of the doc's table."""
    begin = text.index(f"<!-- {PART}: begin -->")
    rows = [
        line
        for line in text[begin : text.index(f"<!-- {PART}: end -->")].splitlines()
        if line.startswith("| ") and not line.startswith("| graph")
    ]
    return [row.strip("|").split("|")[1 + index].strip() for row in rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the 64-worker column differs")
    args = p.parse_args(argv)
    text = open(DOC, encoding="utf-8").read()
    if args.check:
        fresh = table(CHECKED)
        for i, n in enumerate(CHECKED):
            got = [row.strip("|").split("|")[1 + i].strip() for row in fresh.splitlines()[2:]]
            if _column(text, WORKERS.index(n)) != got:
                sys.exit(
                    f"docs/scaling.md's consensus table differs at {n} workers: "
                    "run python benchmarks/plan_consensus.py"
                )
        return
    start = text.index(f"<!-- {PART}: begin -->")
    stop = text.index(f"<!-- {PART}: end -->") + len(f"<!-- {PART}: end -->")
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(text[:start] + section() + text[stop:])


if __name__ == "__main__":
    main()
