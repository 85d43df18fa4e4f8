"""Where each process of examples/train.py trains, and over which process-group backend.

    --device cpu                      the CPU, gloo (the default)
    --device cuda                     cuda:LOCAL_RANK, one process per GPU, NCCL
    --device cuda --comm-device cpu   cuda:(LOCAL_RANK % GPUs), gloo: gossip travels through
                                      pinned host buffers (GossipDataParallel's comm_device="cpu"),
                                      so several processes may share one GPU

NCCL cannot hold two ranks on one GPU; gloo can, because it carries host tensors only and the
wrapper stages the CUDA parameters through the host for it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import gossip_ext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo; cuda: each process on cuda:LOCAL_RANK, one per GPU, over NCCL "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--comm-device",
        choices=("cpu",),
        default=None,
        help="with --device cuda: gossip the CUDA parameters through pinned host buffers over "
        "gloo, so that several processes may share a GPU (each on cuda:LOCAL_RANK %% GPUs); "
        "gossip modes only (default: the parameters' device, NCCL)",
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What the command line alone decides (parser.error); what the machine decides: choose()."""
    if args.comm_device is not None and args.device != "cuda":
        parser.error(
            f"--comm-device {args.comm_device} stages CUDA parameters through the host; it needs "
            "--device cuda"
        )


def choose(
    args: argparse.Namespace, local_rank: int, local_world_size: int, gpus: int, cuda_build: bool
) -> tuple[torch.device, str]:
    """This process's device and the process group's backend, or ValueError naming the argument
    that this node cannot run. ``local_rank``, ``local_world_size``: torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE; ``gpus``: the CUDA devices visible; ``cuda_build``: whether gossip_ext was
    built with its CUDA kernels (``--mode ddp`` does not need them)."""
    if args.device == "cpu":
        return torch.device("cpu"), "gloo"
    if gpus == 0:
        raise ValueError(
            "--device cuda: no CUDA device is visible (torch.cuda.device_count() is 0); "
            "train with --device cpu"
        )
    if args.mode != "ddp" and not cuda_build:
        raise ValueError(
            "--device cuda: this build of gossip_ext has no CUDA kernels; rebuild it with "
            'GOSSIP_EXT_CUDA=1 (docs/gpus.md, "The CUDA build")'
        )
    if args.comm_device == "cpu":
        return torch.device("cuda", local_rank % gpus), "gloo"
    if local_world_size > gpus:
        share = "" if args.mode == "ddp" else ", or add --comm-device cpu to share GPUs over gloo"
        raise ValueError(
            f"--device cuda runs one process per GPU over NCCL, but this node starts "
            f"{local_world_size} processes and sees {gpus} GPU{'s' if gpus > 1 else ''}: launch "
            f"--nproc_per_node {gpus}{share}"
        )
    return torch.device("cuda", local_rank), "nccl"


def init_process_group(args: argparse.Namespace) -> torch.device:
    """Chooses this process's device from torchrun's environment, makes it the current one and
    initializes the default process group over its backend; returns the device. Exits with
    status 2 and the reason when the node cannot run ``args``: every process prints it, since
    torchrun stops the others as soon as the first one exits."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        device, backend = choose(
            args,
            local_rank,
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            torch.cuda.device_count(),
            hasattr(gossip_ext._C, "NcclTransport"),
        )
    except ValueError as error:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torchrun's environment gives the rank, the world size and the store.
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return device


def collective_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` as a float64 tensor that the default group's backend reduces: on the device
    under NCCL (CUDA tensors only), on the CPU under gloo."""
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    return torch.tensor(values, dtype=torch.float64, device=where)
