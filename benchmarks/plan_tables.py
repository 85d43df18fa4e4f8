"""docs/scaling.md's tables and plot: gossip_ext.plan's predictions for the clusters users ask
about (64, 256 and 1,024 workers; 125M to 70B parameters; 1 to 400 Gbit/s), uniform and with 5%
of the workers at half speed. Predictions, not measurements: the assumptions are ASSUMED.

    python benchmarks/plan_tables.py            # rewrites the tables in docs/scaling.md
    python benchmarks/plan_tables.py --check    # fails if docs/scaling.md's tables differ

The plot (docs/scaling.png) is the predicted step time of a 1.3B model on 10 Gbit/s links 10 ms
apart against the number of workers, per mode.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gossip_ext.plan import (  # noqa: E402
    DDP,
    SGP,
    AsyncSGP,
    ChocoGossip,
    Cluster,
    Mode,
    Model,
    Periodic,
    Sharded,
    SparseLoCo,
    StreamingDiLoCo,
    every_mode,
)
from gossip_ext.plan import __main__ as plan_cli  # noqa: E402
from gossip_ext.plan.simulation import simulate  # noqa: E402

DOC = os.path.join(ROOT, "docs", "scaling.md")
PLOT = os.path.join(ROOT, "docs", "scaling.png")
# The generated parts of docs/scaling.md, each between its markers.
PARTS = ("plan_tables", "plan_jitter", "plan_example")

WORKERS = (64, 256, 1024)
PARAMS = {"125M": 125e6, "1.3B": 1.3e9, "7B": 7e9, "70B": 70e9}
# Each link's rate and one-way latency: the slow ones between sites, the fast ones in one hall.
LINKS = {
    "1 Gbit/s, 10 ms": (1e9, 10e-3),
    "10 Gbit/s, 10 ms": (10e9, 10e-3),
    "100 Gbit/s, 10 us": (100e9, 10e-6),
    "400 Gbit/s, 10 us": (400e9, 10e-6),
}
# What the tables take of a worker: an H100 (989 TFLOP/s dense bf16) at 40% of its peak on
# 8,192 tokens a step (6 flops a parameter a token), bf16 parameters with Adam's float32 master
# copy and moments (16 bytes a parameter in all), kernels at 2 TB/s.
TOKENS, PEAK, MFU = 8192, 989e12, 0.4
JITTER = 0.1
ASSUMED = (
    "one H100 a worker at 40% of its 989 TFLOP/s on 8,192 tokens a step (6 flops a parameter a "
    "token: 16 ms for 125M, 160 ms for 1.3B, 0.87 s for 7B, 8.7 s for 70B), bfloat16 parameters "
    "with Adam's float32 master copy and moments (16 bytes a parameter), the kernels at 2 TB/s; "
    "uneven: 5% of the workers at half speed. Outer steps every 100 steps, Streaming DiLoCo in 4 "
    "fragments overlapped by 1 step, sharded replicas of 8 processes (one node's, whose own links "
    "carry FSDP2's traffic)"
)


def model(params: float) -> Model:
    return Model(
        params=params,
        step_seconds=6 * params * TOKENS / (PEAK * MFU),
        param_bytes=2,
        optimizer_bytes=12.0,
    )


def cluster(workers: int, link: tuple[float, float], uneven: bool) -> Cluster:
    return Cluster(
        workers=workers,
        link_bits=link[0],
        latency=link[1],
        slow_fraction=0.05 if uneven else 0.0,
        slowdown=2.0 if uneven else 1.0,
        kernel_bytes=2e12,
    )


# Every step's gossip, and the outer steps every H: a user weighs them apart, as an outer step
# every 100 steps learns less per step than a round every step (benchmarks/RESULTS.md).
EVERY_STEP: list[Mode] = [
    *(SGP(fmt, overlap=True) for fmt in ("bfloat16", "int8", "int4")),
    AsyncSGP("int8"),
    AsyncSGP("int4"),
    Sharded(SGP("int8", overlap=True), 8),
]
OUTER: list[Mode] = [
    Periodic("DiLoCo", 100),
    Periodic("DiLoCo", 100, "int8"),
    StreamingDiLoCo(100, 4, 1, "int4"),
    SparseLoCo(100),
    ChocoGossip(100),
    Sharded(Periodic("DiLoCo", 100, "int8"), 8),
]
GPU_BYTES = 80e9


def best(modes: list[Mode], m: Model, c: Cluster) -> Mode:
    """The mode of ``modes`` with the highest goodput on ``c`` among those whose memory fits an
    80 GB GPU (where none does, of all)."""
    fitting = [mode for mode in modes if mode.memory(m, c) <= GPU_BYTES] or modes
    return max(fitting, key=lambda mode: mode.goodput(m, c))


def cell(mode: Mode, m: Model, c: Cluster) -> str:
    fits = "" if mode.memory(m, c) <= GPU_BYTES else " (over 80 GB)"
    return f"{mode.goodput(m, c):.2f} {mode.name}{fits}"


def tables() -> str:
    out = []
    for n in WORKERS:
        out.append(
            f"**{n} workers.** Goodput (1.00: every worker computes all the time) of DDP, and of "
            "the best mode of each kind that fits an 80 GB GPU, on the uniform cluster and the "
            "uneven one."
        )
        out.append("")
        out.append(
            "| model | link | DDP, uniform / uneven | gossip every step, uniform | uneven "
            "| outer step every 100, uniform | uneven |"
        )
        out.append("|---|---|---|---|---|---|---|")
        for size, params in PARAMS.items():
            m = model(params)
            for link_name, link in LINKS.items():
                even, odd = cluster(n, link, False), cluster(n, link, True)
                ddp = DDP()
                fits = "" if ddp.memory(m, even) <= GPU_BYTES else " (over 80 GB)"
                cells = [
                    size,
                    link_name,
                    f"{ddp.goodput(m, even):.2f} / {ddp.goodput(m, odd):.2f}{fits}",
                ]
                for modes in (EVERY_STEP, OUTER):
                    cells.append(cell(best(modes, m, even), m, even))
                    cells.append(cell(best(modes, m, odd), m, odd))
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def jitter_table() -> str:
    """The formulas' step beside the simulation's, every step drawn with 10% spread."""
    m, link = model(PARAMS["1.3B"]), LINKS["100 Gbit/s, 10 us"]
    modes: list[Mode] = [
        DDP(),
        SGP("int8", overlap=True),
        AsyncSGP("int8"),
        Periodic("DiLoCo", 100, "int8"),
        Sharded(SGP("int8", overlap=True), 8),
    ]
    lines = [
        "| mode | " + " | ".join(f"{n} workers" for n in WORKERS) + " |",
        "|---|" + "---|" * len(WORKERS),
    ]
    for mode in modes:
        cells = [mode.name]
        for n in WORKERS:
            c = cluster(n, link, False)
            formula = mode.step(m, c).seconds
            simulated = simulate(mode, m, c, steps=400, jitter=JITTER, seed=n).step_seconds
            cells.append(f"{formula * 1e3:.0f} / {simulated * 1e3:.0f} ms")
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "Written by `python benchmarks/plan_tables.py`: a 1.3B model (160 ms a step alone) on "
        f"100 Gbit/s links 10 us apart, every step drawn with {JITTER:.0%} spread; the formulas' "
        "step / the simulation's (400 steps).\n\n" + "\n".join(lines)
    )


def example() -> str:
    """The page's example: ``python -m gossip_ext.plan`` on the command the page opens with."""
    m = Model(params=7e9, step_seconds=0.9, param_bytes=2)
    c = Cluster(
        workers=256, link_bits=10e9, latency=0.03, slow_fraction=0.05, slowdown=2.0, mtbf=6 * 3600
    )
    return plan_cli.table([mode.predict(m, c) for mode in every_mode()])


def section(part: str) -> str:
    if part == "plan_tables":
        body = (
            "Written by `python benchmarks/plan_tables.py` (predictions of the formulas above, "
            f"not measurements): {ASSUMED}.\n\n{tables()}"
        )
    elif part == "plan_jitter":
        body = jitter_table()
    else:
        body = example()
    return f"<!-- {part}: begin -->\n{body}\n<!-- {part}: end -->"


def plot(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = model(PARAMS["1.3B"])
    counts = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    modes: list[Mode] = [
        DDP(),
        DDP(powersgd_rank=4),
        SGP("int8", overlap=True),
        AsyncSGP("int8"),
        Periodic("DiLoCo", 100),
        StreamingDiLoCo(100, 4, 1, "int4"),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for mode in modes:
        times = [mode.step(m, cluster(n, (10e9, 10e-3), False)).seconds for n in counts]
        ax.plot(counts, times, marker="o", label=mode.name)
    ax.axhline(m.step_seconds, color="grey", linestyle=":", label="compute alone")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("predicted step time, s")
    ax.set_title("1.3B parameters, 10 Gbit/s links 10 ms apart (gossip_ext.plan)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the doc's tables differ")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    text = open(DOC, encoding="utf-8").read()
    new = text
    for part in PARTS:
        begin, end = f"<!-- {part}: begin -->", f"<!-- {part}: end -->"
        start, stop = new.index(begin), new.index(end) + len(end)
        new = new[:start] + section(part) + new[stop:]
    if args.check:
        if new != text:
            sys.exit(
                "docs/scaling.md's tables differ from the planner's: run benchmarks/plan_tables.py"
            )
        return
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(new)
    if not args.no_plot:
        plot(PLOT)


if __name__ == "__main__":
    main()
