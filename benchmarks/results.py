"""What every benchmark shares: the machine it ran on, and writing its section of RESULTS.md."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from datetime import UTC, datetime

import torch

# Where record() writes: benchmarks/RESULTS.md, or the file GOSSIP_EXT_RESULTS names (then it
# holds the sections alone, ready to paste: tools/gpu_check.sh collects them so).
RESULTS_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")
RESULTS = os.environ.get("GOSSIP_EXT_RESULTS") or RESULTS_MD
_TITLE = "# Benchmark results\n" if RESULTS == RESULTS_MD else ""


def machine(device: torch.device | None = None) -> str:
    """CPU model and core count (from lscpu), the OS, and the GPU when device is CUDA."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(
            line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line
        )
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or "unknown CPU"
    text = f"{name}, {os.cpu_count()} cores, {platform.system()}"
    if device is not None and device.type == "cuda":
        text += f"; GPU {torch.cuda.get_device_name(device)}"
    return text


# Environment variables that change what a benchmark measures: they belong to its command line.
_SETTINGS = ("ATEN_CPU_CAPABILITY", "GOSSIP_EXT_MAX_CPU_ISA")


def command_line() -> str:
    """The command that reproduces this run, with the settings that changed it."""
    script = os.path.relpath(sys.argv[0], os.path.dirname(os.path.dirname(RESULTS_MD)))
    settings = [f"{name}={os.environ[name]}" for name in _SETTINGS if os.environ.get(name)]
    return " ".join([*settings, "python", script, *sys.argv[1:]])


def record(
    title: str, body: str, device: torch.device | None = None, command: str | None = None
) -> None:
    """Writes `body` under a heading with the title, the UTC time, the machine, the torch version
    and the command that reproduces it (``command``: the one that ran, where this reports a saved
    run), in place of this benchmark's earlier section."""
    write_section(
        title,
        f"## {title} ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)\n\n"
        f"Machine: {machine(device)}; torch {torch.__version__}.\n"
        f"Command: `{command or command_line()}`\n\n{body}\n",
    )


def write_section(title: str, section: str) -> None:
    """Puts `section` (markdown starting with ``## <title> (``) in benchmarks/RESULTS.md in place
    of the section with the same title, or at the end: one current section per benchmark, git
    keeping the earlier ones."""
    section = section.strip("\n") + "\n"
    if not section.startswith(f"## {title} ("):
        raise ValueError(f"a section must start with '## {title} (', got {section[:60]!r}")
    text = open(RESULTS, encoding="utf-8").read() if os.path.exists(RESULTS) else _TITLE
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {title} (")), None)
    if start is None:
        text = (text.rstrip("\n") + "\n\n" if text.strip() else "") + section
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    if _TITLE:  # the whole document, not sections collected to paste
        text = with_summary(text)
    with open(RESULTS, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote its section of {RESULTS}")


# The summary, first in RESULTS.md: every comparison section's table of systems (a row per
# system, a column per "N workers, RATE" setting, each cell opening with the time to DDP's final
# held-out loss and its multiple of DDP's, or "not reached": benchmarks/lm_compare.py's
# systems_table) read back, a row per setting. Rewritten with every section, so that it never
# says what the sections below no longer do.
SUMMARY = "Summary"
_PEERS = ("ddp", "powersgd", "decent_dp", "hsdp", "torchft")  # what users run instead
_TIME = re.compile(r"\d+(?:\.\d+)? s \(\d+(?:\.\d+)?x\)")
_SETTING = re.compile(r"\d+ workers, ")
_STEP_MS = re.compile(r"(\d+(?:\.\d+)?) ms")
_DDP_STEPS = re.compile(r"DDP, which runs (\d+)")  # runner.Protocol.describe's words


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _first(times: dict[str, str], names) -> str:
    """The first of ``names`` to DDP's final loss, as "name: time (multiple of DDP's)"."""
    reached = [(float(times[n].split()[0]), n) for n in names if times[n] is not None]
    if not reached:
        return "none of them reached it" if names else "none measured"
    name = min(reached)[1]
    return f"{name}: {times[name]}"


def _bound(cell: str | None, ddp_steps: int | None) -> str:
    """The communication-free bound, DDP's steps at the time of a step of the workers computing
    alone (``cell``: the `alone` row's cell, "...; 48 ms; ..."), or "-" without either."""
    parts = [] if cell is None else [_STEP_MS.fullmatch(part) for part in cell.split("; ")]
    step_ms = next((float(m.group(1)) for m in parts if m), None)
    if step_ms is None or ddp_steps is None:
        return "-"
    return f"{ddp_steps * step_ms / 1000:.1f} s"


def _stated_bounds(lines: list[str]) -> dict[str, str]:
    """The bound per setting where a section states it (its goals table's "communication-free
    bound" column, from the unrounded step times), which the summary then repeats."""
    bounds = {}
    for i, line in enumerate(lines):
        header = _cells(line) if line.startswith("| setting |") else []
        if "communication-free bound" not in header:
            continue
        column = header.index("communication-free bound")
        for row in lines[i + 2 :]:
            if not row.startswith("|"):
                break
            cells = _cells(row)
            bounds[cells[0]] = cells[column]
    return bounds


def summary_rows(text: str) -> list[str]:
    """A markdown row per setting of every comparison section in ``text``."""
    rows = []
    for section in re.split(r"^(?=## )", text, flags=re.M):
        heading = section.split("\n", 1)[0]
        if not heading.startswith("## ") or heading.startswith(f"## {SUMMARY} ("):
            continue
        title = heading[3:].rsplit(" (", 1)[0].split(":")[0]
        date = re.search(r"\((\d{4}-\d{2}-\d{2})", heading)
        prose = [line for line in section.splitlines()[1:] if line and line[0].isalpha()]
        task = next((line.split(" (")[0] for line in prose if not line.startswith(
            ("Machine:", "Command:"))), "-")  # fmt: skip
        steps = _DDP_STEPS.search(section)
        ddp_steps = int(steps.group(1)) if steps else None
        lines = section.splitlines()
        stated = _stated_bounds(lines)
        for i, line in enumerate(lines):
            header = _cells(line) if line.startswith("| system |") else None
            if header is None:
                continue
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                body.append(_cells(row))
            names = [cells[0] for cells in body]
            if "ddp" not in names:
                continue
            for column, setting in enumerate(header):
                if not _SETTING.match(setting):
                    continue
                times, alone = {}, None
                for cells in body:
                    if cells[0] == "alone" and column < len(cells):
                        alone = cells[column]
                    found = _TIME.match(cells[column]) if column < len(cells) else None
                    times[cells[0]] = found.group(0) if found else None
                candidates = [n for n in names if n != "alone"]
                ours = [n for n in candidates if not n.startswith(_PEERS)]
                peers = [n for n in candidates if n.startswith(_PEERS) and n != "ddp"]
                ddp = times["ddp"].split(" (")[0] if times["ddp"] else "not reached"
                bound = stated.get(setting) or _bound(alone, ddp_steps)
                rows.append(
                    f"| {setting} | {task} | {title} ({date.group(1) if date else 'no date'}) "
                    f"| {ddp} | {bound} | {_first(times, candidates)} "
                    f"| {_first(times, ours)} "
                    f"| {_first(times, peers)} |"
                )
    return rows


def with_summary(text: str) -> str:
    """``text`` with its summary section, first, rewritten from the comparison sections; as it
    is where there are none."""
    rows = summary_rows(text)
    if not rows:
        return text
    summary = (
        f"## {SUMMARY} (written by benchmarks/results.py from the comparison sections below)\n\n"
        "Who reaches DDP's final held-out loss first, per setting of the sections that compare "
        "systems on a real task: the wall-clock time to it and, in parentheses, its multiple of "
        "DDP's, read from each section's table of systems (the section gives the machine, the "
        "command and the rest of the numbers). The communication-free bound is DDP's steps at "
        "the time a step of the workers computing alone took (the section's `alone` row): DDP's "
        "run with its communication free. gossip_ext's fastest is the first of its modes; "
        "the other peers are what users run instead of it (DDP + PowerSGD, decent-dp, torchft, "
        "HSDP: whichever the section ran).\n\n"
        "| setting | task | section (run) | DDP | communication-free bound | fastest "
        "| gossip_ext's fastest | best other peer |\n|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    end = start
    if start < len(lines) and lines[start].startswith(f"## {SUMMARY} ("):
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))  # fmt: skip
    head, tail = "".join(lines[:start]).rstrip("\n"), "".join(lines[end:])
    return (head + "\n\n" if head else "") + summary + ("\n" + tail if tail else "")
