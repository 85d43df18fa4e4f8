"""Checks that the gossip_ext this Python imports is a working CUDA build: NcclTransport is
registered, every CUDA kernel is registered with the dispatcher, and the process holds one
libnccl, torch's, and the module carries no copy of libstdc++ (tools/libstdcxx.py). Needs no
GPU. Exits non-zero naming what is missing.

    python tools/check_cuda_build.py [--not-under FOLDER]

--not-under FOLDER: fail if the extension was imported from FOLDER (a checkout), i.e. check an
installed copy. Run by tools/rehearse_build.sh and tools/gpu_check.sh.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import libstdcxx  # noqa: E402  (tools/libstdcxx.py)

import gossip_ext
from gossip_ext._torch_check import _C

CUDA_OPS = (
    "scale_into",
    "compress_into_",
    "absorb_",
    "quantize_into_",
    "absorb_quantized_",
    "topk_encode",
    "topk_add_into",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--not-under", metavar="FOLDER")
    args = parser.parse_args()

    problems = []
    where = os.path.realpath(_C.__file__)
    if args.not_under and where.startswith(os.path.realpath(args.not_under) + os.sep):
        problems.append(f"imported {where} from the checkout, not the installed copy")
    if not hasattr(_C, "NcclTransport"):
        problems.append(f"{where} is not a CUDA build: it has no NcclTransport")
    for op in CUDA_OPS:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"gossip_ext::{op}", "CUDA"):
            problems.append(f"gossip_ext::{op} has no CUDA kernel")
    with open("/proc/self/maps") as maps:
        nccl = sorted({line.split()[-1] for line in maps if "libnccl" in line})
    if len(nccl) != 1:
        problems.append(f"expected one libnccl in the process, found {nccl or 'none'}")

    copied = libstdcxx.copied_symbols(where)
    if copied:
        problems.append(
            f"{where} defines {len(copied)} symbols of libstdc++ itself ({copied[0]}, ...): the "
            "compiler linked libstdc++.a into it; rebuild with setup.py, which links the shared one"
        )

    print(f"gossip_ext {gossip_ext.__version__}: {where}")
    print(f"  built against torch {_C.built_with_torch()}, running torch {torch.__version__}")
    print(f"  NcclTransport: {'registered' if hasattr(_C, 'NcclTransport') else 'MISSING'}")
    print(f"  CUDA kernels: {', '.join(CUDA_OPS)}")
    print(
        f"  NCCL library: {', '.join(nccl) or 'none'} (torch's NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version()))})"
    )
    print(f"  CPU kernels: {_C.cpu_kernels_isa()}; GPU visible: {torch.cuda.is_available()}")
    for problem in problems:
        print(f"check_cuda_build: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
