"""The C++ standard library that gossip_ext._C links: the shared libstdc++ torch runs with.

setup.py imports this. A compiler whose own library folder holds only libstdc++.a (a toolchain
installed beside the system's, such as /opt/gcc) links the parts of the standard library that the
extension uses into _C itself, while torch and the rest of the process use the shared
libstdc++.so.6. The two copies then meet: _C runs its own copy's functions on data that the dynamic
linker resolves to the shared library (the locale's facet ids, the classic locale), and the first
``ostream << int`` in _C crashed (a CUDA build on an H100 machine whose g++ was /opt/gcc/bin/g++).
Naming the libstdc++.so.6 this process has loaded on the link line, before the compiler's own
``-lstdc++``, resolves every standard-library symbol there, so that nothing is copied in; where the
compiler links the shared library anyway it is the same file, and nothing changes.
"""

from __future__ import annotations

import subprocess

# Symbols that only libstdc++ itself defines (explicit instantiations and members of its own
# classes): a shared object that defines one carries a copy of the library.
_LIBRARY_ONLY_PREFIXES = ("_ZNSt6locale", "_ZNSt8ios_base", "_ZNSo9_M_insert")


def loaded_libstdcxx(maps: str = "/proc/self/maps") -> str | None:
    """The path of the libstdc++.so.6 mapped into this process (torch loads it), or None."""
    try:
        with open(maps) as lines:
            paths = {line.split()[-1] for line in lines if "/libstdc++.so" in line}
    except OSError:
        return None
    return sorted(paths)[0] if paths else None


def link_args() -> list[str]:
    """Linker inputs that bind the extension's standard-library calls to the shared libstdc++."""
    path = loaded_libstdcxx()
    return [path] if path else []


def copied_symbols(shared_object: str) -> list[str]:
    """The libstdc++-only symbols that ``shared_object`` defines and exports (``nm -D``): empty
    where it links the shared library, as it must."""
    listing = subprocess.run(
        ["nm", "-D", "--defined-only", shared_object], capture_output=True, text=True, check=True
    ).stdout
    names = (line.split()[-1] for line in listing.splitlines() if line.strip())
    return sorted(name for name in names if name.startswith(_LIBRARY_ONLY_PREFIXES))
