"""Where a CUDA build of gossip_ext finds NCCL: its header and the library to link.

setup.py imports this. Two places are looked at, in order:

1. ``NCCL_HOME``: a folder with ``include/nccl.h`` and ``lib/`` (or ``lib64/``) holding
   ``libnccl.so`` or only the versioned ``libnccl.so.2``.
2. The nvidia-nccl wheel that CUDA builds of torch depend on (nvidia-nccl-cu12, -cu13). It ships
   no ``nvidia/nccl/__init__.py``, so ``nvidia.nccl`` is a namespace package without a
   ``__file__``, and its ``lib/`` holds only ``libnccl.so.2`` (no unversioned link for ``-lnccl``).

Neither found is an error that says what to install or set.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence

# The library names a linker can be pointed at, in the order they are preferred.
_LIBRARIES = ("libnccl.so", "libnccl.so.2")


@dataclasses.dataclass(frozen=True)
class NcclLocation:
    include_dir: str
    library_dir: str
    library: str  # a file name in library_dir, one of _LIBRARIES

    @property
    def link_args(self) -> list[str]:
        """Linker arguments: the library by its file name (``-l:libnccl.so.2`` links a versioned
        file that ``-lnccl`` would not find), and an rpath to its folder."""
        return [f"-L{self.library_dir}", f"-l:{self.library}", f"-Wl,-rpath,{self.library_dir}"]


class NcclNotFoundError(RuntimeError):
    pass


def find_nccl(
    environ: Mapping[str, str] = os.environ, path: Sequence[str] | None = None
) -> NcclLocation:
    """NCCL from ``NCCL_HOME`` in ``environ`` if set, else from the nvidia-nccl wheel on ``path``
    (``sys.path`` when None). Raises NcclNotFoundError naming what is missing."""
    home = environ.get("NCCL_HOME")
    if home:
        found = _in_folder(home)
        if isinstance(found, str):
            raise NcclNotFoundError(f"gossip_ext: NCCL_HOME={home!r} {found}")
        return found
    problems = []
    for root in _wheel_roots(path):
        found = _in_folder(root)
        if isinstance(found, NcclLocation):
            return found
        problems.append(f"{root} {found}")
    seen = f" (found the nvidia.nccl package, but {'; '.join(problems)})" if problems else ""
    raise NcclNotFoundError(
        "gossip_ext: a CUDA build needs NCCL and found none"
        f"{seen}. Install the nvidia-nccl wheel that your torch depends on (pip install "
        "nvidia-nccl-cu13 for torch's CUDA 13 builds), or set NCCL_HOME to a folder with "
        "include/nccl.h and lib/libnccl.so or lib/libnccl.so.2; GOSSIP_EXT_CUDA=0 builds "
        "for the CPU only."
    )


def _wheel_roots(path: Sequence[str] | None) -> list[str]:
    """The folders ``nvidia/nccl`` on ``path``: where ``import nvidia.nccl`` looks, whether the
    wheel made it a regular or a namespace package (read off the file system, since a namespace
    package has no ``__file__`` to ask)."""
    entries = sys.path if path is None else path
    roots = [os.path.join(entry or os.curdir, "nvidia", "nccl") for entry in entries]
    return list(dict.fromkeys(r for r in roots if os.path.isdir(r)))


def _in_folder(root: str) -> NcclLocation | str:
    """NCCL under ``root``, or what is missing there."""
    include = os.path.join(root, "include")
    if not os.path.isfile(os.path.join(include, "nccl.h")):
        return "has no include/nccl.h"
    for lib_dir in (os.path.join(root, "lib"), os.path.join(root, "lib64")):
        for name in _LIBRARIES:
            if os.path.exists(os.path.join(lib_dir, name)):
                return NcclLocation(include, lib_dir, name)
    return f"has no {' or '.join(_LIBRARIES)} in lib/ or lib64/"
