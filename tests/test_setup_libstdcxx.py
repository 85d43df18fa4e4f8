"""setup.py links the shared libstdc++ that torch runs with (tools/libstdcxx.py): the built module
carries no copy of the standard library, and the check that says so finds the copy in a module
that does carry one (a shared object linked with -static-libstdc++, as a compiler with only
libstdc++.a links it). A module with its own copy crashed at its first ``ostream << int``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import libstdcxx  # noqa: E402

pytestmark = pytest.mark.extension  # the rehearsals build with other torches: check theirs too

_USES_STREAMS = """
#include <sstream>
#include <string>
std::string describe(int rank) {
  std::ostringstream out;
  out << "rank " << rank;
  return out.str();
}
"""


def test_the_libstdcxx_of_this_process_is_found_in_its_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 13 /opt/lib/libstdc++.so.6.0.33\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n"
        "7f60-7f70 r--p 00010000 08:01 13 /opt/lib/libstdc++.so.6.0.33\n"
    )
    assert libstdcxx.loaded_libstdcxx(str(maps)) == "/opt/lib/libstdc++.so.6.0.33"


def test_no_libstdcxx_mapped_or_no_map_links_nothing_more(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert libstdcxx.loaded_libstdcxx(str(maps)) is None
    assert libstdcxx.loaded_libstdcxx(str(tmp_path / "absent")) is None


def test_setup_links_the_libstdcxx_torch_loaded():
    import torch  # noqa: F401  (loads libstdc++.so.6)

    (path,) = libstdcxx.link_args()
    assert Path(path).name.startswith("libstdc++.so.6"), path
    assert Path(path).is_file(), path


def test_the_built_module_carries_no_copy_of_libstdcxx():
    from gossip_ext._torch_check import _C

    assert libstdcxx.copied_symbols(_C.__file__) == []


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the reference modules")
def test_a_module_linked_with_its_own_libstdcxx_is_found_and_one_linked_shared_is_not(tmp_path):
    source = tmp_path / "streams.cpp"
    source.write_text(_USES_STREAMS)
    built = {}
    for name, flags in (("shared", []), ("copied", ["-static-libstdc++"])):
        built[name] = tmp_path / f"{name}.so"
        subprocess.run(
            ["g++", "-shared", "-fPIC", "-O1", *flags, str(source), "-o", str(built[name])],
            check=True,
        )
    assert libstdcxx.copied_symbols(str(built["shared"])) == []
    copied = libstdcxx.copied_symbols(str(built["copied"]))
    assert "_ZNSo9_M_insertIlEERSoT_" in copied, copied  # std::ostream::_M_insert<long>
