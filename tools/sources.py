"""The source lists of the build, derived from the folder layout.

setup.py imports this; CMakeLists.txt applies the same rule with file(GLOB_RECURSE). The rule:
every .cpp under csrc/ is built; a file under a folder named `cuda` or `nccl`, or any .cu file,
is built only in a CUDA build; csrc/bindings.cpp belongs to the Python extension only.
"""

import glob
import os

CUDA_ONLY_DIRS = ("cuda", "nccl")


def _is_cuda_only(path: str) -> bool:
    parts = path.replace(os.sep, "/").split("/")
    return path.endswith(".cu") or any(d in parts[:-1] for d in CUDA_ONLY_DIRS)


def extension_sources(root: str, cuda: bool) -> list:
    """All sources of gossip_ext._C, sorted, as absolute paths."""
    csrc = os.path.join(root, "csrc")
    found = glob.glob(os.path.join(csrc, "**", "*.cpp"), recursive=True)
    found += glob.glob(os.path.join(csrc, "**", "*.cu"), recursive=True)
    rel = sorted(os.path.relpath(f, csrc) for f in found)
    return [os.path.join(csrc, f) for f in rel if cuda or not _is_cuda_only(f)]
