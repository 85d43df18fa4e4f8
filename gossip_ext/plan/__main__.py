"""python -m gossip_ext.plan: every mode's predicted step, bytes, utilization, goodput and memory
on a cluster, from the command line (docs/scaling.md says how each figure is made)."""

from __future__ import annotations

import argparse
import math
import re
import sys

import torch

from gossip_ext.plan.cost import Cluster, Model, Prediction
from gossip_ext.plan.modes import every_mode
from gossip_ext.plan.simulation import Simulated, simulate

_COUNT = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_RATE = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def _number_with_unit(text: str, units: dict[str, float], what: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in units:
        raise argparse.ArgumentTypeError(
            f"{what}: a number with one of the units {sorted(u for u in units if u)}, got {text!r}"
        )
    value = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{what}: a finite number, got {text!r}")
    return value


def finite(text: str) -> float:
    """A finite float (argparse's ``float`` takes ``inf`` and ``nan``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"a finite number, got {text!r}")
    return value


def count(text: str) -> float:
    """``7e9``, ``1.3B``, ``125M``."""
    return _number_with_unit(text, _COUNT, "a count")


def rate(text: str) -> float:
    """``10gbit``, ``100mbit``: bits per second."""
    return _number_with_unit(text, _RATE, "a link's rate")


def seconds(text: str) -> float:
    """``30ms``, ``6h``, ``90s``."""
    return _number_with_unit(text, _SECONDS, "a time")


def slowness(text: str) -> tuple[float, float]:
    """``0.05:2x``: the fraction of the workers that are slow, and how many times slower."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*x?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"--slow: FRACTION:FACTORx, e.g. 0.05:2x, got {text!r}")
    return float(match.group(1)), float(match.group(2))


def factor(text: str) -> float:
    """``10x``: how many times slower."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*x?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"a factor such as 10x, got {text!r}")
    return float(match.group(1))


def gbytes(text: str) -> float:
    """GB/s, or ``measure``: the engine's absorb kernel timed on this machine."""
    if text.strip().lower() == "measure":
        from gossip_ext.plan import measure

        device = "cuda" if torch.cuda.is_available() else "cpu"
        found = measure.kernel_bytes(device) / 1e9
        print(f"the kernels measured on this machine's {device}: {found:.1f} GB/s")
        return found
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"GB/s or 'measure', got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gossip_ext.plan", description=__doc__)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--params", type=count, required=True, help="e.g. 7e9 or 1.3B")
    p.add_argument("--link", type=rate, required=True, help="each worker's link, e.g. 10gbit")
    p.add_argument("--latency", type=seconds, default=0.0, help="one way, e.g. 30ms")
    p.add_argument("--step-ms", type=finite, required=True, help="one step's compute, alone")
    p.add_argument("--param-bytes", type=int, default=4, help="4: float32, 2: bfloat16")
    p.add_argument("--optimizer-bytes", type=finite, default=8.0, help="Adam's: 8 a parameter")
    p.add_argument("--width", type=int, default=None, help="hidden size (PowerSGD's matrices)")
    p.add_argument(
        "--slow", type=slowness, default=(0.0, 1.0), help="the odd workers, e.g. 0.05:2x"
    )
    p.add_argument("--slow-link", type=factor, default=1.0, help="their links slower, e.g. 10x")
    p.add_argument("--stalled", type=finite, default=0.0, help="the share of time each is stopped")
    p.add_argument("--mtbf", type=seconds, default=None, help="the cluster's, e.g. 6h")
    p.add_argument("--restart", type=seconds, default=300.0, help="a restarted job's loss")
    p.add_argument("--checkpoint-every", type=seconds, default=1800.0)
    p.add_argument("--epoch-pause", type=seconds, default=5.0, help="an elastic job's pause")
    p.add_argument(
        "--kernel-gbytes",
        type=gbytes,
        default=1000.0,
        help="the kernels' memory bandwidth, GB/s, or 'measure': the engine's absorb kernel timed "
        "on this machine's GPU (its CPU where it has none)",
    )
    p.add_argument(
        "--host-ns-per-byte",
        type=finite,
        default=0.0,
        help="CPU workers: what each byte sent or received adds to a step, ns (their CPU cost, "
        "gossip_ext.plan.measure.host_seconds_per_byte, over each worker's share of a core)",
    )
    p.add_argument("--every", type=int, default=100, help="H: steps between outer steps")
    p.add_argument("--fragments", type=int, default=4, help="Streaming DiLoCo's")
    p.add_argument("--delay", type=int, default=1, help="Streaming DiLoCo's overlap, in steps")
    p.add_argument("--shards", type=int, default=8, help="processes per sharded replica")
    p.add_argument(
        "--jitter",
        type=finite,
        default=None,
        help="also simulate each mode's waits, every step drawn around its mean with this "
        "spread (0.1: about 10%%)",
    )
    p.add_argument("--steps", type=int, default=200, help="simulated steps")
    return p.parse_args(argv)


def table(predictions: list[Prediction], simulated: list[Simulated] | None = None) -> str:
    """A Markdown table, one row per mode (with the simulated step and goodput, where given)."""
    extra = " simulated step | simulated goodput |" if simulated else ""
    rows = [
        "| mode | step | bound | utilization | goodput | sent per step | memory | carried |"
        + extra,
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if simulated else ""),
    ]
    for i, p in enumerate(predictions):
        row = (
            f"| {p.mode} | {p.step_seconds * 1e3:.0f} ms | {p.bound} | {p.utilization:.2f} | "
            f"{p.goodput:.2f} | {p.bytes_per_step / 1e6:,.1f} MB | "
            f"{p.memory_bytes / 2**30:,.1f} GiB | {p.carried:.2f} |"
        )
        if simulated:
            row += f" {simulated[i].step_seconds * 1e3:.0f} ms | {simulated[i].goodput:.2f} |"
        rows.append(row)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[Prediction]:
    args = parse_args(argv)
    try:
        model = Model(
            params=args.params,
            step_seconds=args.step_ms / 1e3,
            param_bytes=args.param_bytes,
            optimizer_bytes=args.optimizer_bytes,
            width=args.width,
        )
        cluster = Cluster(
            workers=args.workers,
            link_bits=args.link,
            latency=args.latency,
            slow_fraction=args.slow[0],
            slowdown=args.slow[1],
            link_slowdown=args.slow_link,
            stalled=args.stalled,
            mtbf=args.mtbf,
            restart=args.restart,
            checkpoint_every=args.checkpoint_every,
            epoch_pause=args.epoch_pause,
            kernel_bytes=args.kernel_gbytes * 1e9,
            host_seconds_per_byte=args.host_ns_per_byte * 1e-9,
        )
        modes = every_mode(args.every, args.fragments, args.delay, args.shards)
        predictions = [mode.predict(model, cluster) for mode in modes]
    except (ValueError, OverflowError) as error:
        sys.exit(f"python -m gossip_ext.plan: {error}")
    simulated = None
    if args.jitter is not None:
        try:
            simulated = [
                simulate(mode, model, cluster, steps=args.steps, jitter=args.jitter)
                for mode in modes
            ]
        except ValueError as error:
            sys.exit(f"python -m gossip_ext.plan: {error}")
    print(table(predictions, simulated))
    return predictions


if __name__ == "__main__":
    main()
