"""What a comparison reports: time to a held-out quality, the table, the plot."""

from __future__ import annotations

from harness.compare import systems


def time_to(result: dict, bpb: float) -> float | None:
    """Seconds of training until the held-out loss first reached ``bpb`` (at an evaluation)."""
    history = result["history"]
    for t, b in zip(history["time"], history["heldout_bpb"]):
        if b <= bpb:
            return t
    return None


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


# A step within this factor of the same workers computing alone is limited by the machine's
# cores, not by the network: its communication is hidden or small.
CPU_BOUND = 1.3


def table(rows: dict[str, dict], target: float | None = None) -> str:
    """One row per system; times to DDP's final held-out loss (and to ``target``, if given)."""
    ddp = rows.get("ddp")
    ddp_final = ddp["final_bpb"] if ddp else None
    ddp_time = time_to(ddp, ddp_final) if ddp else None
    alone = rows["alone"]["step_ms"] if "alone" in rows else None
    heading = ["system", "lr", "steps", "ms/step", "bound by", "sent/worker/step"]
    heading.append(f"to DDP's final {ddp_final:.3f} bpb" if ddp else "to DDP's final")
    if target is not None:
        heading.append(f"to {target:.2f} bpb")
    heading += ["final bpb", "peak RSS"]
    lines = ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
    for name, r in rows.items():
        wire = r["wire_bytes_per_step"]
        to_ddp = time_to(r, ddp_final) if ddp_final is not None else None
        ratio = f" ({to_ddp / ddp_time:.2f}x)" if to_ddp is not None and ddp_time else ""
        if name == "alone" or alone is None:
            bound = "-"
        else:
            bound = "CPU" if r["step_ms"] <= CPU_BOUND * alone else "communication"
        cells = [
            name,
            f"{r['lr']:g}",
            str(r["history"]["step"][-1]),
            f"{r['step_ms']:.0f}",
            bound,
            "-" if wire is None else f"{wire / 1e6:.2f} MB",
            _seconds(to_ddp) + ratio,
        ]
        if target is not None:
            cells.append(_seconds(time_to(r, target)))
        cells += [f"{r['final_bpb']:.3f}", f"{r['peak_rss_mib']:.0f} MiB"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def plot(all_rows: dict[str, dict[str, dict]], path: str) -> None:
    """Held-out loss against wall-clock time, a panel per setting (two to a row), DDP's final
    held-out loss (the target) dotted across each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(all_rows))
    lines = -(-len(all_rows) // columns)
    fig, axes = plt.subplots(
        lines, columns, figsize=(7 * columns, 5 * lines), squeeze=False, sharey=True
    )
    colors = plt.cm.tab20.colors  # one color per system: the default cycle has ten
    for ax, (setting, rows) in zip(axes.flat, all_rows.items()):
        for i, (name, r) in enumerate(rows.items()):
            # A row may carry a suffix ("diloco H=16"): its system is the first word.
            style = "-" if name.split()[0] in systems.GOSSIP else "--"
            ax.plot(
                r["history"]["time"],
                r["history"]["heldout_bpb"],
                style,
                color=colors[(2 * i) % 20 + (2 * i) // 20],
                label=name,
            )
        if "ddp" in rows:
            ax.axhline(
                rows["ddp"]["final_bpb"], color="black", linestyle=":", linewidth=1, label="target"
            )
        ax.set_title(setting)
        ax.set_xlabel("wall-clock seconds of training")
        ax.set_ylabel("held-out bits per byte")
        # The first evaluations, far above every target, would flatten the rest.
        ax.set_ylim(top=4.5)
        ax.legend(fontsize=8, ncol=2)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(all_rows) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
