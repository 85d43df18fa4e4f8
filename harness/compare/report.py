"""What a comparison reports: time to a held-out quality, the table, the plot."""

from __future__ import annotations

from harness.compare import systems


def time_to(result: dict, bpb: float) -> float | None:
    """Seconds of training until the held-out loss first reached ``bpb`` (at an evaluation)."""
    return _when_reached(result, bpb, "time")


def steps_to(result: dict, bpb: float) -> int | None:
    """Steps of training until the held-out loss first reached ``bpb`` (at an evaluation)."""
    return _when_reached(result, bpb, "step")


def _when_reached(result: dict, bpb: float, measure: str):
    """``measure`` ("time" or "step") of the first evaluation at or below ``bpb``, or None."""
    history = result["history"]
    for value, b in zip(history[measure], history["heldout_bpb"]):
        if b <= bpb:
            return value
    return None


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


# A step within this factor of the same workers computing alone is limited by the machine's
# cores, not by the network: its communication is hidden or small.
CPU_BOUND = 1.3


def bound(rows: dict[str, dict]) -> float | None:
    """The communication-free bound to DDP's final held-out loss, in seconds: the fewest steps
    any system needed to reach it, at the pace of the workers computing alone (``alone``), or
    of a system whose steps up to it were faster still (noise: a step cannot be cheaper than its
    computation). Each row's time to the loss is its own steps at its own pace, neither below
    the fewest steps nor below the fastest pace, so no row is below the bound: a bound by
    construction. DDP usually needs the fewest steps (its steps average every gradient), and
    then the bound is DDP's steps at the workers' compute-alone step time. None without both
    rows."""
    parts = bound_parts(rows)
    return None if parts is None else parts[1] * parts[2]


def bound_parts(rows: dict[str, dict]) -> tuple[str, int, float] | None:
    """The parts of :func:`bound`: the system that needed the fewest steps, those steps, and
    the fastest pace (seconds a step)."""
    if "ddp" not in rows or "alone" not in rows:
        return None
    target = rows["ddp"]["final_bpb"]
    reached = {
        name: (steps, time_to(r, target))
        for name, r in rows.items()
        if (steps := steps_to(r, target)) is not None
    }
    fewest = min(reached, key=lambda name: reached[name][0])
    pace = min([rows["alone"]["step_ms"] / 1000, *(t / steps for steps, t in reached.values())])
    return fewest, reached[fewest][0], pace


def table(rows: dict[str, dict], target: float | None = None) -> str:
    """One row per system; times to DDP's final held-out loss, as multiples of DDP's and of the
    communication-free bound (:func:`bound`), and to ``target``, if given."""
    ddp = rows.get("ddp")
    ddp_final = ddp["final_bpb"] if ddp else None
    ddp_time = time_to(ddp, ddp_final) if ddp else None
    alone = rows["alone"]["step_ms"] if "alone" in rows else None
    floor = bound(rows)
    heading = ["system", "lr", "steps", "ms/step", "bound by", "sent/worker/step"]
    if ddp is None:
        heading.append("to DDP's final")
    else:
        heading.append(
            f"to DDP's final {ddp_final:.3f} bpb"
            + ("" if floor is None else f"; communication-free bound {floor:.1f} s")
        )
    if target is not None:
        heading.append(f"to {target:.2f} bpb")
    heading += ["final bpb", "peak RSS"]
    lines = ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
    for name, r in rows.items():
        wire = r["wire_bytes_per_step"]
        to_ddp = time_to(r, ddp_final) if ddp_final is not None else None
        multiples = []
        if to_ddp is not None and ddp_time:
            multiples.append(f"{to_ddp / ddp_time:.2f}x DDP")
        if to_ddp is not None and floor:
            multiples.append(f"{to_ddp / floor:.2f}x bound")
        if name == "alone" or alone is None:
            step_bound = "-"
        else:
            step_bound = "CPU" if r["step_ms"] <= CPU_BOUND * alone else "communication"
        cells = [
            name,
            f"{r['lr']:g}",
            str(r["history"]["step"][-1]),
            f"{r['step_ms']:.0f}",
            step_bound,
            "-" if wire is None else f"{wire / 1e6:.2f} MB",
            _seconds(to_ddp) + (f" ({', '.join(multiples)})" if multiples else ""),
        ]
        if target is not None:
            cells.append(_seconds(time_to(r, target)))
        cells += [f"{r['final_bpb']:.3f}", f"{r['peak_rss_mib']:.0f} MiB"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def system_of(name: str) -> str:
    """The system of a row: a row may carry a suffix ("diloco H=16"), its system is the first
    word."""
    return name.split()[0]


def best(rows: dict[str, dict], names, bpb: float) -> tuple[str, float] | None:
    """Of the systems ``names`` in ``rows``, the one that first reached ``bpb``, and when."""
    reached = [
        (t, name) for name in names if name in rows and (t := time_to(rows[name], bpb)) is not None
    ]
    return (min(reached)[1], min(reached)[0]) if reached else None


def fastest(rows: dict[str, dict], bpb: float) -> tuple[str, float] | None:
    """The system that first reached ``bpb``, and when; None if none did. ``alone`` is not a
    candidate: its workers never share what they learn, its row is the compute floor."""
    return best(rows, [name for name in rows if name != "alone"], bpb)


def gossip_rows(rows: dict[str, dict]) -> list[str]:
    """The rows of gossip_ext's systems."""
    return [name for name in rows if system_of(name) in systems.GOSSIP]


def peer_rows(rows: dict[str, dict], with_ddp: bool = True) -> list[str]:
    """The rows of the systems users run instead (DDP, PowerSGD, decent-dp, torchft)."""
    return [
        name
        for name in rows
        if system_of(name) in systems.PEERS and (with_ddp or system_of(name) != "ddp")
    ]


def _leader(rows: dict[str, dict], names: list[str], bpb: float | None) -> str | None:
    """The first of ``names`` to ``bpb``; where none reached it (or there is no ``bpb``), the
    one that ended lowest."""
    found = best(rows, names, bpb) if bpb is not None else None
    if found:
        return found[0]
    return min(names, key=lambda name: rows[name]["final_bpb"], default=None)


# The plot's three highlighted curves, and what the rest are drawn in.
_DDP_COLOR, _PEER_COLOR, _OURS_COLOR, _BOUND_COLOR = "#1f4e9c", "#e08214", "#c0143c", "#2a9d5c"
_REST_COLOR = "#9a9a9a"


def _panel(ax, rows: dict[str, dict]) -> None:
    """One setting: DDP, the best other peer and gossip_ext's best thick and in colour (first in
    the legend), the communication-free bound and DDP's target, the other systems thin and
    grey (gossip_ext's solid, the others dashed)."""
    target = rows["ddp"]["final_bpb"] if "ddp" in rows else None
    peer = _leader(rows, peer_rows(rows, with_ddp=False), target)
    ours = _leader(rows, gossip_rows(rows), target)

    def label(name: str, who: str) -> str:
        t = time_to(rows[name], target) if target is not None else None
        return f"{name} ({who}{'' if t is None else f', {t:.1f} s'})"

    highlighted = [
        (name, text, color)
        for name, text, color in (
            ("ddp", "ddp" if target is None else label("ddp", "target"), _DDP_COLOR),
            (peer, peer and label(peer, "best other peer"), _PEER_COLOR),
            (ours, ours and label(ours, "gossip_ext's best"), _OURS_COLOR),
        )
        if name in rows
    ]
    for name, text, color in highlighted:
        h = rows[name]["history"]
        ax.plot(h["time"], h["heldout_bpb"], color=color, linewidth=2.6, label=text, zorder=4)
        reached = time_to(rows[name], target) if target is not None else None
        if reached is not None:
            ax.plot([reached], [target], "o", color=color, markersize=7, zorder=5)
    parts = bound_parts(rows)
    if parts is not None:
        # The curve of the system that needed the fewest steps (DDP, as a rule) at the fastest
        # pace: its learning per step, with communication free.
        name, steps, pace = parts
        floor = steps * pace
        h = rows[name]["history"]
        ax.plot(
            [step * pace for step in h["step"]],
            h["heldout_bpb"],
            color=_BOUND_COLOR,
            linestyle="-.",
            linewidth=1.6,
            label=f"communication-free bound ({floor:.1f} s)",
            zorder=3,
        )
        ax.axvline(floor, color=_BOUND_COLOR, linestyle=":", linewidth=1.2, zorder=3)
    if target is not None:
        ax.axhline(
            target,
            color="black",
            linestyle=":",
            linewidth=1,
            label=f"target: DDP's final, {target:.3f}",
        )
    shown = {name for name, _, _ in highlighted}
    labelled = set()
    for name, r in rows.items():
        if name in shown:
            continue
        if name == "alone":
            style, kind = ":", "alone (no communication)"
        elif system_of(name) in systems.GOSSIP:
            style, kind = "-", "other gossip_ext modes"
        else:
            style, kind = "--", "other peers"
        ax.plot(
            r["history"]["time"],
            r["history"]["heldout_bpb"],
            style,
            color=_REST_COLOR,
            linewidth=0.9,
            alpha=0.75,
            label=None if kind in labelled else kind,
            zorder=2,
        )
        labelled.add(kind)


def plot(all_rows: dict[str, dict[str, dict]], path: str) -> None:
    """Held-out loss against wall-clock time, a panel per setting (two to a row): DDP, the best
    other peer and gossip_ext's best stand out, the rest grey; DDP's final held-out loss (the
    target) dotted across each and the communication-free bound drawn (:func:`_panel`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(all_rows))
    lines = -(-len(all_rows) // columns)
    fig, axes = plt.subplots(
        lines, columns, figsize=(7 * columns, 5 * lines), squeeze=False, sharey=True
    )
    for ax, (setting, rows) in zip(axes.flat, all_rows.items()):
        _panel(ax, rows)
        ax.set_title(setting)
        ax.set_xlabel("wall-clock seconds of training")
        ax.set_ylabel("held-out bits per byte")
        # The first evaluations, far above every target, would flatten the rest.
        ax.set_ylim(top=4.5)
        ax.set_xlim(left=0)
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(all_rows) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
