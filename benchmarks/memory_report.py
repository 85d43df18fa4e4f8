"""The report of benchmarks/memory.py: the workers' samples turned into model copies.

A configuration's extra memory at a point is its growth from "model created" minus the bare
model's growth over the same steps, divided by the model's bytes, the largest over the workers
(extra_copies); the table, the goals' verdicts and what gossip_ext's extra memory is made of are
written from that.
"""

from __future__ import annotations

import torch
from memory_configs import (
    BATCH,
    DILOCO,
    GOAL_COPIES,
    GOSSIP_SYNC,
    MMAP_THRESHOLD,
    PEERS,
    SLOWMO_GOALS,
    WORLD_SIZE,
)

import gossip_ext


def growth(result: dict, metric: str, point: str) -> int:
    """Bytes this process grew by from "model created" to the given point."""
    return result["samples"][f"{metric} {point}"] - result["samples"][f"{metric} model"]


def extra_copies(results: dict, config: str, metric: str, point: str, base_point: str) -> float:
    """The largest, over the ranks, of (config's growth - bare model's growth) / model bytes."""
    values = []
    for rank in range(WORLD_SIZE):
        mine, bare = results[config][rank], results["bare model"][rank]
        extra = growth(mine, metric, point) - growth(bare, metric, base_point)
        values.append(extra / mine["model_bytes"])
    return max(values)


def format_table(results: dict, metric: str) -> str:
    points = [
        ("after wrap", "wrapped", "wrapped"),
        ("peak while wrapping", "wrap peak", "wrap peak"),
        ("steady state after steps", "steady", "steady"),
        ("peak during steps", "steps peak", "steps peak"),
    ]
    header = "| configuration | " + " | ".join(p[0] for p in points) + " |"
    lines = [header, "|" + "---|" * (1 + len(points))]
    for config, ranks in results.items():
        if config == "bare model":
            continue
        if "error" in ranks[0]:
            lines.append(f"| {config} | " + " | ".join(["n/a"] * len(points)) + " |")
            continue
        cells = []
        for _, point, base in points:
            if metric == "rss" and "peak" in point and not ranks[0]["peak_ok"]:
                cells.append("n/a")
            else:
                cells.append(f"{extra_copies(results, config, metric, point, base):.2f}")
        lines.append(f"| {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bare_line(results: dict, metric: str) -> str:
    bare = results["bare model"][0]
    mb = bare["model_bytes"] / 2**20
    grow = growth(bare, metric, "steady") / bare["model_bytes"]
    return (
        f"Model: {bare['num_params'] / 1e6:.2f}M float32 parameters = {mb:.1f} MiB (one model "
        f"copy). The bare model grows by {grow:.2f} copies over the steps (its gradients, one "
        f"copy, and the BLAS and allocator working set)."
    )


def verdict(results: dict, metric: str) -> str:
    sync = results.get(GOSSIP_SYNC)
    if sync is None:
        return ""
    if "error" in sync[0]:
        return f"gossip_ext sync SGP could not run here: {sync[0]['error']}"
    steady = extra_copies(results, GOSSIP_SYNC, metric, "steady", "steady")
    peak_ok = metric != "rss" or sync[0]["peak_ok"]
    peak = extra_copies(results, GOSSIP_SYNC, metric, "steps peak", "steps peak")
    worst = max(steady, peak) if peak_ok else steady
    lines = [
        f"Goal: <= {GOAL_COPIES} model copies extra in synchronous mode: steady {steady:.2f}, "
        + (f"peak {peak:.2f}" if peak_ok else "peak n/a")
        + f" -> {'met' if worst <= GOAL_COPIES else 'missed'}."
    ]
    beside = []
    for peer in PEERS:
        if peer in results and "error" not in results[peer][0]:
            other = extra_copies(results, peer, metric, "steady", "steady")
            ratio = f"{steady / other:.2f}x" if other > 0.05 else "n/a (peer adds ~0)"
            beside.append(f"{peer}: {steady:.2f} against {other:.2f} copies (ratio {ratio})")
    if beside:
        lines.append("Steady extra vs " + "; vs ".join(beside) + ".")
    return "\n".join(lines)


def slowmo_verdict(results: dict, metric: str) -> str:
    lines = []
    for config, (fairscale, goal) in SLOWMO_GOALS.items():
        if config not in results or "error" in results[config][0]:
            continue
        peak = extra_copies(results, config, metric, "steps peak", "steps peak")
        lines.append(
            f"- {config}: peak {peak:.2f} extra copies; fairscale's tests expect {fairscale}; "
            f"goal <= {goal} -> {'met' if peak <= goal else 'missed'}"
        )
    return "\n".join(lines)


def diloco_verdict(results: dict, metric: str) -> str:
    """DiLoCo's outer state beside torchft's: theta_global and the outer momentum are two model
    copies; a step adds the average, which becomes the gradient."""
    found = {c: results[c] for c in DILOCO if c in results and "error" not in results[c][0]}
    if not found:
        return ""
    cells = [
        f"{c}: steady {extra_copies(results, c, metric, 'steady', 'steady'):.2f}, peak "
        f"{extra_copies(results, c, metric, 'steps peak', 'steps peak'):.2f}"
        for c in found
    ]
    return (
        "- DiLoCo (outer SGD-Nesterov every step), extra copies: "
        + "; ".join(cells)
        + ". Expected for gossip_ext: 2 steady (theta_global, the outer momentum), 3 at the "
        "peak (the average, which becomes the gradient). torchft keeps the same two copies (its "
        "backup of the global parameters and the outer momentum) but its outer step ends with "
        "zero_grad() on the module's parameters, which frees the gradients that the bare loop "
        "keeps until its next zero_grad(): its steady figure is one copy lower for that."
    )


def composition(world_size: int) -> str:
    graph = gossip_ext.NPeerDynamicDirectedExponentialGraph()
    in_peers = max(
        len(graph.in_peers(r, world_size, t))
        for r in range(world_size)
        for t in range(4 * world_size)
    )
    return (
        f"What gossip_ext's extra memory is made of (GossipEngine, world size {world_size}, "
        f"{graph!r}): a receive buffer per in-peer, {in_peers} here, allocated by the first "
        f"round. Synchronous modes send the parameters in place (Note [Sending in place]), so "
        f"they need no send buffer; overlap and bounded asynchrony keep one, a model copy, "
        f"because the optimizer updates the parameters while the round is in flight. The flat "
        f"parameter buffer takes over the parameters' storage one parameter at a time (at most "
        f"one parameter is held twice while wrapping), so it adds nothing. Expected steady "
        f"extra: {in_peers} copies (synchronous), 1 + {in_peers} (overlap)."
    )


def report(results: dict, args) -> str:
    device = torch.device(args.device)
    malloc = (
        "glibc defaults" if args.malloc_defaults else f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}"
    )
    parts = [
        f"{WORLD_SIZE} workers on gloo, {args.steps} steps, SGD without momentum, batch {BATCH}; "
        f"model on {device.type}; {malloc}.",
        bare_line(results, "rss"),
        "",
        "Extra memory over the bare model, in model copies (max over the 2 workers; anonymous "
        "RSS, peaks from VmHWM):",
        "",
        format_table(results, "rss"),
        "",
        verdict(results, "rss"),
        slowmo_verdict(results, "rss"),
        diloco_verdict(results, "rss"),
    ]
    if device.type == "cuda":
        parts += [
            "",
            "Extra CUDA memory (torch.cuda memory_allocated / max_memory_allocated), in model "
            "copies:",
            "",
            format_table(results, "cuda"),
            "",
            verdict(results, "cuda"),
        ]
    errors = [f"- {c}: {r[0]['error']}" for c, r in results.items() if "error" in r[0]]
    if errors:
        parts += ["", "Not run:", *errors]
    parts += ["", composition(WORLD_SIZE)]
    return "\n".join(parts)
