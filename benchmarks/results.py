"""What every benchmark shares: the machine it ran on, and writing its section of RESULTS.md."""

from __future__ import annotations

import os
import platform
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


def record(title: str, body: str, device: torch.device | None = None) -> None:
    """Writes `body` under a heading with the title, the UTC time, the machine, the torch version
    and the command that reproduces it, in place of this benchmark's earlier section."""
    write_section(
        title,
        f"## {title} ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)\n\n"
        f"Machine: {machine(device)}; torch {torch.__version__}.\n"
        f"Command: `{command_line()}`\n\n{body}\n",
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
    with open(RESULTS, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote its section of {RESULTS}")
