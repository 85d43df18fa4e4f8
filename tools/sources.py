"""The source lists of the build, and where its objects go, derived from the folder layout.

setup.py imports this; CMakeLists.txt applies the same rule with file(GLOB_RECURSE). The rule:
every .cpp under csrc/ is built; a file under a folder named `cuda` or `nccl`, or any .cu file,
is built only in a CUDA build; a file under a folder named `sealed`, or named `sealed_*.cpp`, only
where OpenSSL's libcrypto and its headers are found (:func:`openssl_found`: sealed messages, Note
[Sealed messages]); csrc/bindings.cpp and csrc/python/ belong to the Python extension only.

The extension's objects go to one folder per configuration (Python, torch, CPU or CUDA) under
build/temp, each at the source's path relative to the checkout with .o for its suffix. The C++
tests link the objects of that folder rather than compile the sources again:

    python3 tools/sources.py --object-dir      # prints the folder of the installed torch's build
"""

import glob
import os
import sys

CUDA_ONLY_DIRS = ("cuda", "nccl")
OPENSSL_HEADER = "openssl/evp.h"


def _is_cuda_only(path: str) -> bool:
    parts = path.replace(os.sep, "/").split("/")
    return path.endswith(".cu") or any(d in parts[:-1] for d in CUDA_ONLY_DIRS)


def is_sealed_only(path: str) -> bool:
    parts = path.replace(os.sep, "/").split("/")
    return "sealed" in parts[:-1] or parts[-1].startswith("sealed_")


def openssl_found() -> bool:
    """Whether libcrypto's headers and shared library are where the compiler looks (a system
    package: libssl-dev, openssl-devel). GOSSIP_EXT_OPENSSL=0 builds without them."""
    if os.environ.get("GOSSIP_EXT_OPENSSL", "1") == "0":
        return False
    include_dirs = ["/usr/include", "/usr/local/include"]
    library_dirs = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"]
    header = any(os.path.exists(os.path.join(d, OPENSSL_HEADER)) for d in include_dirs)
    library = any(os.path.exists(os.path.join(d, "libcrypto.so")) for d in library_dirs)
    return header and library


def extension_sources(root: str, cuda: bool, sealed: bool | None = None) -> list:
    """All sources of gossip_ext._C, sorted, as absolute paths; ``sealed``: with the sealed
    transport (default: where OpenSSL is found)."""
    sealed = openssl_found() if sealed is None else sealed
    csrc = os.path.join(root, "csrc")
    found = glob.glob(os.path.join(csrc, "**", "*.cpp"), recursive=True)
    found += glob.glob(os.path.join(csrc, "**", "*.cu"), recursive=True)
    rel = sorted(os.path.relpath(f, csrc) for f in found)
    return [
        os.path.join(csrc, f)
        for f in rel
        if (cuda or not _is_cuda_only(f)) and (sealed or not is_sealed_only(f))
    ]


def object_dir(root: str, cuda: bool) -> str:
    """The folder of the extension's objects for the running Python, the installed torch and the
    given kind of build (torch is imported here, not at module import)."""
    import torch

    configuration = "-".join(
        [
            f"py{sys.version_info.major}.{sys.version_info.minor}",
            f"torch{torch.__version__}",
            "cuda" if cuda else "cpu",
        ]
    )
    return os.path.join(root, "build", "temp", configuration)


if __name__ == "__main__":
    if sys.argv[1:] != ["--object-dir"]:
        sys.exit(f"usage: {sys.argv[0]} --object-dir")
    print(object_dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), cuda=False))
