"""What this gossip_ext is and what it can run on this machine: ``python -m gossip_ext.info``.

It prints the version, the torch (and, in a CUDA build, the CUDA runtime, NCCL and GPU
architectures) the compiled extension was built against beside the ones running, the CPU kernels
chosen here, and each transport with whether this machine can run it and, where not, why. The
first thing to paste into a bug report; :func:`report` returns the same as a dict.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from gossip_ext import __version__
from gossip_ext._torch_check import _C


@dataclasses.dataclass(frozen=True)
class TransportReport:
    """One transport: whether this build has it, and whether this machine can run it (if not,
    ``why``)."""

    name: str
    carries: str
    compiled_in: bool
    runs_here: bool
    why: str


def _transports() -> list[TransportReport]:
    gloo = dist.is_available() and dist.is_gloo_available()
    gpus = torch.cuda.is_available()
    nccl_bound = hasattr(_C, "NcclTransport")
    no_gloo = "" if gloo else "this torch has no gloo backend"
    no_gpu = "" if gpus else "no CUDA GPU is visible"
    if not nccl_bound:
        nccl_why = "a CPU build: build against a CUDA torch for it"
    elif not (dist.is_available() and dist.is_nccl_available()):
        nccl_why = "this torch has no NCCL backend"
    else:
        nccl_why = no_gpu
    return [
        TransportReport("process_group", "CPU parameters over a gloo group", True, gloo, no_gloo),
        TransportReport(
            "host_staging",
            "CUDA parameters through pinned host buffers over gloo (comm_device='cpu')",
            hasattr(_C, "HostStagingTransport"),
            gloo and gpus,
            no_gloo or no_gpu,
        ),
        TransportReport(
            "nccl",
            "CUDA parameters over NCCL, on its own stream",
            nccl_bound,
            not nccl_why,
            nccl_why,
        ),
    ]


def report() -> dict[str, object]:
    """What :func:`main` prints, as a dict."""
    built = _C.build_info()
    return {
        "gossip_ext": __version__,
        "built_with": {
            key: built[key] for key in ("torch", "cuda", "nccl", "cuda_archs", "sealed_messages")
        },
        "running": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "python": sys.version.split()[0],
        },
        "cpu_kernels": _C.cpu_kernels_isa(),
        "transports": [dataclasses.asdict(t) for t in _transports()],
    }


def format_report(facts: dict[str, object]) -> str:
    """``facts`` (:func:`report`'s) as the lines :func:`main` prints."""
    built, running = facts["built_with"], facts["running"]
    cuda = (
        f"CUDA {built['cuda']}, NCCL {built['nccl']}, GPU architectures {built['cuda_archs']}"
        if built["cuda"] is not None
        else "no CUDA (a CPU build)"
    )
    lines = [
        f"gossip_ext {facts['gossip_ext']}",
        f"built against: torch {built['torch']}, {cuda}",
        f"running: torch {running['torch']} (CUDA {running['cuda'] or 'none'}, "
        f"{running['gpus']} GPU(s) visible), Python {running['python']}",
        f"CPU kernels: {facts['cpu_kernels']}",
        "sealed messages (Elastic(messages=...)): "
        + (
            "AES-256-GCM from OpenSSL's libcrypto"
            if built["sealed_messages"]
            else "not in this build (no libcrypto headers when it was built)"
        ),
        "transports:",
    ]
    for t in facts["transports"]:
        if not t["compiled_in"]:
            state = f"not in this build ({t['why']})"
        else:
            state = "runs here" if t["runs_here"] else f"cannot run here ({t['why']})"
        lines.append(f"  {t['name']:<14} {state}: {t['carries']}")
    return "\n".join(lines)


def main() -> None:
    print(format_report(report()))
