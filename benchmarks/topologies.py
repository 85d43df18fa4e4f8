"""How many gossip rounds each built-in topology needs to reach consensus.

    python benchmarks/topologies.py
    python benchmarks/topologies.py --sizes 8 16 32 --tol 1e-9 --no-record

For every built-in graph and world size n, the real engine (``gossip_ext.simulate``: one thread per
node over the in-process transport) runs pure gossip with uniform mixing from random fp64 values
(d = 4, fixed seed, mean shifted away from zero) and we count the rounds until the consensus
distance

    max_i ||z_i - zbar|| / ||zbar||,   zbar = mean of the initial values (the exact average),

is <= --tol. Push-sum (SGP) runs on every graph; push-pull averaging (D-PSGD, ``push_sum=False``)
also runs on the graphs that pair nodes symmetrically at that n. Rounds are capped at 4n + 64
(">cap" in the table).

The peer: a plain-PyTorch mixing-matrix simulator, with phone books built here from docs/design.md
section 2 (not from the library's schedule), runs the same rounds for n <= --ref-max-n; the table
says whether it reaches the tolerance at the same round and the largest difference between its
trajectory and the engine's.

Prints one markdown table, writes a PNG plot (rounds vs n), and appends the table to
benchmarks/RESULTS.md (unless --no-record).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
import tempfile
import time

import torch
from results import machine, write_section

import gossip_ext
from gossip_ext import (
    DynamicBipartiteExponentialGraph,
    DynamicBipartiteLinearGraph,
    DynamicDirectedExponentialGraph,
    DynamicDirectedLinearGraph,
    HypercubeGraph,
    NPeerDynamicDirectedExponentialGraph,
    RingGraph,
)

DIM = 4
SEED = 0

# (label, reference kind, constructor, peers_per_itr)
GRAPHS = (
    ("NPeerExp p=1", "npeer_exponential", NPeerDynamicDirectedExponentialGraph, 1),
    ("NPeerExp p=2", "npeer_exponential", NPeerDynamicDirectedExponentialGraph, 2),
    ("DirectedExp", "directed_exponential", DynamicDirectedExponentialGraph, 1),
    ("BipartiteExp", "bipartite_exponential", DynamicBipartiteExponentialGraph, 1),
    ("DirectedLinear", "directed_linear", DynamicDirectedLinearGraph, 1),
    ("BipartiteLinear", "bipartite_linear", DynamicBipartiteLinearGraph, 1),
    ("Ring p=1", "ring", RingGraph, 1),
    ("Ring p=2", "ring", RingGraph, 2),
    ("Hypercube", "hypercube", HypercubeGraph, 1),
)


def cap_for(n: int) -> int:
    return 4 * n + 64


# ---------------------------------------------------------------------------------------------
# The peer: phone books from docs/design.md section 2 and a dense mixing-matrix simulator.


def reference_phone_books(kind: str, n: int, p: int) -> list[list[int]]:
    """Ordered distinct out-peers of every node, written from docs/design.md section 2."""
    if kind == "hypercube":
        return [[r ^ (1 << i) for i in range(n.bit_length() - 1)] for r in range(n)]
    offsets: list[int] = []
    if kind == "npeer_exponential":  # r + j*(p+1)^i, j = 1..p, while (p+1)^i <= n-1
        step = 1
        while step <= n - 1:
            offsets += [j * step for j in range(1, p + 1)]
            step *= p + 1
    elif kind == "directed_exponential":  # r + 2^i, r - 2^i while 2^i <= n-1
        step = 1
        while step <= n - 1:
            offsets += [step, -step]
            step *= 2
    elif kind == "bipartite_exponential":  # odd offsets 1 and 1 + 2^i (i >= 1)
        offsets += [1, -1]
        step = 2
        while step <= n - 1:
            offsets += [1 + step, -(1 + step)]
            step *= 2
    elif kind in ("directed_linear", "bipartite_linear"):  # +-i for odd i < n
        for i in range(1, n, 2):
            offsets += [i, -i]
    elif kind == "ring":
        offsets = [1] if p == 1 else [1, -1]
    else:
        raise ValueError(kind)
    books = []
    for r in range(n):
        # Bipartite: even (passive) nodes walk the offsets with the opposite sign.
        sign = -1 if kind.startswith("bipartite") and r % 2 == 0 else 1
        book: list[int] = []
        for off in offsets:
            q = (r + sign * off) % n
            if q != r and q not in book:
                book.append(q)
        books.append(book)
    return books


def reference_matrix(books: list[list[int]], p: int, t: int) -> torch.Tensor:
    """Column-stochastic [n, n] fp64 matrix of round t under uniform mixing: x <- M @ x."""
    n = len(books)
    m = torch.zeros(n, n, dtype=torch.float64)
    for i, book in enumerate(books):
        length = len(book)
        peers = [book[(g + t * p) % length] for g in range(p)] if length else []
        share = 1.0 / (len(peers) + 1)
        m[i, i] = share
        for j in peers:
            m[j, i] = share
    return m


def reference_gossip(books, p, values, rounds, push_sum) -> torch.Tensor:
    """z after every round, [rounds + 1, n, d] fp64."""
    length = len(books[0])
    period = length // math.gcd(length, p) if length else 1
    mats = [reference_matrix(books, p, t) for t in range(period)]
    x = values.clone()
    w = torch.ones(values.shape[0], 1, dtype=torch.float64)
    zs = [x.clone()]
    for t in range(rounds):
        m = mats[t % period]
        if not push_sum and not torch.equal(m, m.T):
            raise ValueError(f"round {t}: push-pull mixing matrix is not symmetric")
        x = m @ x
        if push_sum:
            w = m @ w
        zs.append(x / w)
    return torch.stack(zs)


# ---------------------------------------------------------------------------------------------


def distances(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[rounds + 1] consensus distance of every round against the exact average ``target``."""
    return (z - target).norm(dim=-1).amax(dim=-1) / target.norm()


def first_below(dist: torch.Tensor, tol: float) -> int | None:
    hit = torch.nonzero(dist <= tol)
    return int(hit[0]) if len(hit) else None


def engine_rounds(graph, values, target, tol, cap, push_sum):
    """Rounds to tol with the engine; simulate() always starts at round 0, so a longer run is a
    fresh run with more rounds (restarting from the last state would restart the schedule)."""
    rounds = min(cap, 2 * max(1, math.ceil(math.log2(values.shape[0]))) + 16)
    while True:
        z = gossip_ext.simulate(graph, values, rounds, push_sum=push_sum)
        found = first_below(distances(z, target), tol)
        if found is not None or rounds >= cap:
            return found, z
        rounds = min(cap, rounds * 4)


def fmt_rounds(r: int | None, cap: int) -> str:
    return f">{cap}" if r is None else str(r)


def plot(results, sizes, path: str, tol: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 6), sharey=True)
    # No grey (the cap line is grey); one marker per graph so that coinciding curves stay visible.
    colors = [
        "#1f77b4",
        "#ff7f0e",
        "#2ca02c",
        "#d62728",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#bcbd22",
        "#17becf",
    ]
    markers = ["o", "s", "^", "v", "D", "P", "X", "<", "o"]
    sizes_pt = [9, 6, 6, 6, 6, 6, 7, 6, 4]
    caps = [cap_for(n) for n in sizes]
    for ax, push_sum in zip(axes, (True, False)):
        ax.plot(sizes, caps, ":", color="grey", lw=1.5, label="round cap 4n+64")
        ax.plot(
            sizes,
            [math.log2(n) for n in sizes],
            "-",
            color="black",
            lw=0.8,
            alpha=0.5,
            label="log2(n) (under NPeerExp p=1 and Hypercube)",
        )
        for k, (label, *_rest) in enumerate(GRAPHS):
            pts = [
                (n, results[(label, push_sum, n)]) for n in sizes if (label, push_sum, n) in results
            ]
            if not pts:
                continue
            reached = [(n, r) for n, r in pts if r is not None]
            missed = [n for n, r in pts if r is None]
            name = label if not missed else f"{label} (x: >cap at n={','.join(map(str, missed))})"
            style = {
                "color": colors[k],
                "marker": markers[k],
                "ms": sizes_pt[k],
                "mfc": "none" if k == 0 else colors[k],
                "mew": 1.5,
            }
            ax.plot([n for n, _ in reached], [r for _, r in reached], "-", label=name, **style)
            if missed:
                # Spread the >cap markers of different graphs a little sideways so all show.
                shift = 2 ** (0.06 * (k - 7))
                ax.plot(
                    [n * shift for n in missed],
                    [cap_for(n) for n in missed],
                    "x",
                    color=colors[k],
                    ms=8,
                    mew=2,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(n) for n in sizes])
        ax.set_xlabel("nodes n (log2 scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(
            "push-sum (SGP), every graph"
            if push_sum
            else "push-pull (D-PSGD), graphs that pair nodes symmetrically"
        )
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel(f"gossip rounds until max_i ||z_i - mean|| / ||mean|| <= {tol:g}")
    fig.suptitle(
        "Rounds to consensus, uniform mixing, fp64 (gossip_ext.simulate: the real engine, "
        "ranks as threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Gossip rounds to consensus for every built-in graph (gossip_ext.simulate), "
        "checked against a plain-PyTorch mixing-matrix reference."
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[8, 16, 32, 64, 128, 256],
        help="world sizes n to simulate (default: 8 16 32 64 128 256)",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=1e-6,
        help="consensus distance max_i ||z_i - mean|| / ||mean|| to reach (default: 1e-6)",
    )
    parser.add_argument(
        "--plot",
        default=os.path.join(tempfile.gettempdir(), "gossip_ext_topologies.png"),
        help="path of the PNG plot (default: %(default)s)",
    )
    parser.add_argument(
        "--ref-max-n",
        type=int,
        default=64,
        help="run the plain-PyTorch reference for n <= this (default: 64)",
    )
    parser.add_argument(
        "--no-record", action="store_true", help="do not append the table to benchmarks/RESULTS.md"
    )
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error(f"--sizes must all be >= 2, got {args.sizes}")
    if not (args.tol > 0):
        parser.error(f"--tol must be > 0, got {args.tol}")
    sizes = sorted(set(args.sizes))
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])

    start = time.perf_counter()
    results: dict[tuple[str, bool, int], int | None] = {}
    refused: dict[tuple[str, int], str] = {}
    ref_notes: dict[tuple[str, bool], list[str]] = {}
    ref_diff: dict[tuple[str, bool], float] = {}
    exact_notes: list[str] = []
    book_mismatch: list[str] = []
    for label, kind, ctor, p in GRAPHS:
        graph = ctor(peers_per_itr=p)
        for n in sizes:
            try:
                graph.schedule(n)
            except ValueError as error:
                refused[(label, n)] = str(error)
                continue
            gen = torch.Generator().manual_seed(SEED + n)
            values = torch.rand(n, DIM, dtype=torch.float64, generator=gen) + 1.0
            target = values.mean(dim=0)
            cap = cap_for(n)
            modes = [True] + ([False] if graph.pairs_symmetrically(n) else [])
            books = None
            if n <= args.ref_max_n:
                books = reference_phone_books(kind, n, p)
                lib = [graph.phone_book(r, n) for r in range(n)]
                if books != lib:
                    book_mismatch.append(f"{label} n={n}")
            for push_sum in modes:
                found, z = engine_rounds(graph, values, target, args.tol, cap, push_sum)
                results[(label, push_sum, n)] = found
                if books is not None:
                    rounds = z.shape[0] - 1
                    zr = reference_gossip(books, p, values, rounds, push_sum)
                    ref_found = first_below(distances(zr, target), args.tol)
                    notes = ref_notes.setdefault((label, push_sum), [])
                    if ref_found != found:
                        notes.append(f"n={n}: ref {fmt_rounds(ref_found, cap)}")
                    else:
                        notes.append("ok")
                    diff = float((z - zr).abs().max())
                    ref_diff[(label, push_sum)] = max(ref_diff.get((label, push_sum), 0.0), diff)
                # docs/design.md: exact after log2(n) rounds (n a power of two).
                exact = (label == "NPeerExp p=1" and push_sum) or (
                    label == "Hypercube" and not push_sum
                )
                if exact and n & (n - 1) == 0:
                    k = n.bit_length() - 1
                    zk = gossip_ext.simulate(graph, values, k, push_sum=push_sum)
                    d = float(distances(zk, target)[k])
                    if d > 1e-12:
                        mode = "push-sum" if push_sum else "push-pull"
                        exact_notes.append(
                            f"{label} {mode} n={n}: distance {d:.2e} after log2(n)={k} rounds "
                            "(docs/design.md says exact)"
                        )
    elapsed = time.perf_counter() - start

    # ---- the table
    header = (
        ["graph", "mode"]
        + [f"n={n}" for n in sizes]
        + [
            f"reference (n<={args.ref_max_n})",
            "max abs diff vs ref",
        ]
    )
    rows = []
    for label, *_ in GRAPHS:
        for push_sum in (True, False):
            if not any((label, push_sum, n) in results for n in sizes):
                continue
            cells = []
            for n in sizes:
                if (label, n) in refused:
                    cells.append("refused")
                elif (label, push_sum, n) not in results:
                    cells.append("n/a")  # push-pull: not symmetric at this n
                else:
                    r = results[(label, push_sum, n)]
                    if r is None:
                        cells.append(f">{cap_for(n)}")
                    else:
                        cells.append(f"{r} ({r / math.log2(n):.2f})")
            notes = ref_notes.get((label, push_sum))
            if notes is None:
                agree = "not run"
            elif all(x == "ok" for x in notes):
                agree = f"same rounds {len(notes)}/{len(notes)}"
            else:
                agree = "DIFFER: " + "; ".join(x for x in notes if x != "ok")
            diff = ref_diff.get((label, push_sum))
            rows.append(
                [
                    label,
                    "push-sum" if push_sum else "push-pull",
                    *cells,
                    agree,
                    "-" if diff is None else f"{diff:.1e}",
                ]
            )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    footer = [
        "",
        f"Cells: rounds until max_i ||z_i - mean|| / ||mean|| <= {args.tol:g} (rounds / log2 n in "
        "parentheses); '>cap' = not reached within 4n+64 rounds. Uniform mixing, fp64 values "
        f"U[1,2)^{DIM}, seed {SEED}+n. push-pull runs only where the graph pairs nodes "
        "symmetrically.",
        "Reference: plain-PyTorch mixing-matrix simulator over phone books built from "
        "docs/design.md section 2; 'same rounds' = it reaches the tolerance at the same round as "
        "the engine.",
    ]
    if refused:
        footer.append("Refused: " + "; ".join(f"{g} n={n}: {m}" for (g, n), m in refused.items()))
    else:
        footer.append("Refused: none (every graph accepts every size here).")
    if book_mismatch:
        footer.append(
            "Phone books differ from docs/design.md section 2 for: " + ", ".join(book_mismatch)
        )
    if exact_notes:
        footer.append("NOT EXACT: " + "; ".join(exact_notes))
    else:
        footer.append(
            "Exactness (docs/design.md): NPeerExp p=1 push-sum and Hypercube push-pull reach "
            "distance <= 1e-12 after log2(n) rounds at every power-of-two n."
        )
    same = all(results[(g, True, n)] == r for (g, ps, n), r in results.items() if not ps)
    footer.append(
        ("push-pull rows equal push-sum rows:" if same else "push-pull rows differ from push-sum:")
        + " with uniform mixing on a regular graph the push-sum weight stays 1 and a symmetric"
        " round applies the same matrix, so they should be equal."
    )
    table = "\n".join(lines + footer[:1] + ["- " + note for note in footer[1:]])
    print(table)
    print(f"\nsimulated in {elapsed:.1f} s")

    plot(results, sizes, args.plot, args.tol)
    print(f"plot: {args.plot}")

    if not args.no_record:
        now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        section = (
            f"## Topologies: rounds to consensus ({now})\n\n"
            f"Machine: {machine()}; torch {torch.__version__}, python "
            f"{platform.python_version()}.\n"
            f"Command: `{command}`\n\n{table}\n"
        )
        write_section("Topologies: rounds to consensus", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
