"""Builds gossip_ext._C with torch.utils.cpp_extension and ninja.

Sources come from the folder layout (tools/sources.py, shared with CMakeLists.txt): every .cpp
under csrc/, plus the .cu files and the NCCL transport in a CUDA build. A CUDA build is chosen
when the installed torch has CUDA and nvcc is found; GOSSIP_EXT_CUDA=0 or 1 forces the choice.
"""

import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import libstdcxx  # noqa: E402  (tools/libstdcxx.py)
import nccl_paths  # noqa: E402  (tools/nccl_paths.py)
import sources  # noqa: E402  (tools/sources.py)
import torch  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
)

VERSION = "0.1.0"  # gossip_ext.__version__


def _torch_build() -> tuple[str, str]:
    """The local version label that names the torch this build is bound to, and the requirement
    on that torch. The compiled extension runs only under the exact torch it was built against
    (gossip_ext/_torch_check.py), so the requirement is that torch to its local label: pip then
    refuses to pair a wheel with any other torch (+pt213cpu with 2.13.0+cpu, +pt211cu130 with
    2.11.0+cu130), as the import would."""
    public, _, local = torch.__version__.partition("+")
    major, minor = public.split(".")[:2]
    device = local or (f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    return f"pt{major}{minor}{device}", f"torch=={torch.__version__}"


def _want_cuda() -> bool:
    forced = os.environ.get("GOSSIP_EXT_CUDA")
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"GOSSIP_EXT_CUDA must be 0 or 1, got {forced!r}")
        return forced == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def _cuda_archs() -> str:
    """The GPU architectures the CUDA kernels are compiled for, as torch's build names them
    (TORCH_CUDA_ARCH_LIST, else those of the GPUs it sees, else its own list), for
    _C.build_info()."""
    from torch.utils import cpp_extension

    flags = cpp_extension._get_cuda_arch_flags()  # what CUDAExtension passes to nvcc
    codes = {flag.rsplit("code=", 1)[-1].strip("[]") for flag in flags if "code=" in flag}
    return ",".join(sorted(codes)) or "torch's default"


def _check_cuda_home() -> None:
    """torch takes CUDA_HOME from the environment, else from the folder above the nvcc on PATH; a
    wrapper script there (as in /usr/local/bin) gives a folder without the toolkit's headers."""
    header = os.path.join(CUDA_HOME or "", "include", "cuda_runtime_api.h")
    if CUDA_HOME is None or not os.path.isfile(header):
        raise RuntimeError(
            f"gossip_ext: a CUDA build needs the CUDA toolkit, and CUDA_HOME={CUDA_HOME!r} (as "
            "torch found it) has no include/cuda_runtime_api.h: set CUDA_HOME to the toolkit's "
            "folder (e.g. /usr/local/cuda), or GOSSIP_EXT_CUDA=0 for a CPU build"
        )


def _extension():
    cuda = _want_cuda()
    files = [os.path.relpath(f, ROOT) for f in sources.extension_sources(ROOT, cuda=cuda)]
    # -fopenmp: at::parallel_for runs in parallel only where the caller is compiled with OpenMP
    # (torch ships and loads libgomp itself). Release builds (the default) carry no debug
    # information and are stripped: 23 MB become about 2. GOSSIP_EXT_DEBUG=1 keeps both.
    # -ffp-contract=off: no multiply-add is fused behind the source's back, so the CPU kernels give
    # the same bits on every instruction set (tests/cpp/range_kernels_test.cpp), as in CMake.
    debug = os.environ.get("GOSSIP_EXT_DEBUG", "0") == "1"
    cxx_flags = [
        "-O3",
        "-fvisibility=hidden",
        "-fopenmp",
        "-ffp-contract=off",
        "-g" if debug else "-g0",
    ]
    # The shared libstdc++ that torch runs with, named before the compiler's own -lstdc++: a
    # compiler with only libstdc++.a would copy part of the library into _C (tools/libstdcxx.py).
    link_flags = ["-fopenmp"] + ([] if debug else ["-s"]) + libstdcxx.link_args()
    include_dirs = [os.path.join(ROOT, "csrc")]
    # The torch compiled against, exactly as torch.__version__ says it (local suffix included: a
    # +cpu and a +cu130 build differ too), for _C.built_with_torch(): the package refuses to run
    # under another torch, whose ABI may differ (gossip_ext/_torch_check.py).
    define_macros = [("GOSSIP_EXT_TORCH_VERSION", f'"{torch.__version__}"')]
    if sources.openssl_found():
        # Sealed messages (csrc/transport/sealed): AES-256-GCM from the system's libcrypto.
        define_macros.append(("GOSSIP_WITH_OPENSSL", "1"))
        link_flags.append("-lcrypto")

    if cuda:
        _check_cuda_home()
        nccl = nccl_paths.find_nccl()
        # Arithmetic as the CPU twins do it: no --use_fast_math (de-bias and error feedback
        # divide, and approximate division would not match) and no fused multiply-add behind the
        # source's back (--fmad=false, as -ffp-contract=off for the CPU). The kernels are
        # memory-bound: exact arithmetic costs them nothing measurable.
        return CUDAExtension(
            "gossip_ext._C",
            files,
            include_dirs=include_dirs + [nccl.include_dir],
            define_macros=define_macros
            + [("GOSSIP_WITH_CUDA", "1"), ("GOSSIP_EXT_CUDA_ARCHS", f'"{_cuda_archs()}"')],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--fmad=false"]},
            extra_link_args=link_flags + nccl.link_args,
        )
    return CppExtension(
        "gossip_ext._C",
        files,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


class _BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build, always with its objects in one folder per configuration under
    build/temp (tools/sources.py; the C++ tests link them from there): pip's editable and wheel
    builds would otherwise compile into a fresh temporary directory every time, and ninja then
    recompiles everything; with one directory it recompiles only what changed. One folder per
    configuration (Python, torch, CPU or CUDA), so that a build in another environment
    (tools/rehearse_build.sh) leaves the CPU build's objects."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.build_temp = sources.object_dir(ROOT, cuda=_want_cuda())


torch_label, torch_requirement = _torch_build()
setup(
    version=f"{VERSION}+{torch_label}",
    install_requires=[torch_requirement],
    packages=find_packages(include=["gossip_ext", "gossip_ext.*"]),
    # The compiled module's declarations, for a user's type checker too (tests/test_stub.py).
    package_data={"gossip_ext": ["_C.pyi"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExt},
)
