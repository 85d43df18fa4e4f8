"""setup.py's NCCL discovery (tools/nccl_paths.py) against the layouts users have: the
nvidia-nccl wheel as it ships (a namespace package, only the versioned library), NCCL_HOME, and
neither. Each layout is built in a temporary folder; nothing is imported from it."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from nccl_paths import NcclNotFoundError, find_nccl  # noqa: E402

pytestmark = pytest.mark.extension  # the compiled extension's own tests (pyproject.toml)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def _wheel(site: Path, library: str = "libnccl.so.2", init_files: bool = False) -> Path:
    """site-packages as nvidia-nccl-cu13 2.28.9 leaves it: nvidia/ and nvidia/nccl/ have no
    __init__.py unless ``init_files`` (older wheels had them)."""
    root = site / "nvidia" / "nccl"
    _touch(root / "include" / "nccl.h")
    _touch(root / "lib" / library)
    if init_files:
        _touch(site / "nvidia" / "__init__.py")
        _touch(root / "__init__.py")
    return root


@pytest.mark.parametrize("init_files", [False, True], ids=["namespace", "regular"])
def test_the_wheel_as_it_ships_links_the_versioned_library(tmp_path, init_files):
    root = _wheel(tmp_path, init_files=init_files)
    found = find_nccl({}, path=[str(tmp_path)])
    assert found.include_dir == str(root / "include")
    assert found.library_dir == str(root / "lib")
    assert found.link_args == [
        f"-L{root / 'lib'}",
        "-l:libnccl.so.2",
        f"-Wl,-rpath,{root / 'lib'}",
    ]


def test_the_wheel_is_found_beside_other_nvidia_packages(tmp_path):
    # pip installs every nvidia-* wheel into one nvidia/ folder; a second site folder may hold
    # nvidia/ too without NCCL (a CUDA runtime alone, say).
    _touch(tmp_path / "other" / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.13")
    root = _wheel(tmp_path / "site")
    found = find_nccl({}, path=[str(tmp_path / "other"), str(tmp_path / "site")])
    assert found.library_dir == str(root / "lib")


def test_nccl_home_with_the_unversioned_library_links_it(tmp_path):
    _touch(tmp_path / "include" / "nccl.h")
    _touch(tmp_path / "lib" / "libnccl.so")
    _touch(tmp_path / "lib" / "libnccl.so.2")
    found = find_nccl({"NCCL_HOME": str(tmp_path)}, path=[])
    assert found.link_args[1] == "-l:libnccl.so"


@pytest.mark.parametrize("lib", ["lib", "lib64"])
def test_nccl_home_with_only_the_versioned_library_links_it(tmp_path, lib):
    _touch(tmp_path / "include" / "nccl.h")
    _touch(tmp_path / lib / "libnccl.so.2")
    found = find_nccl({"NCCL_HOME": str(tmp_path)}, path=[])
    assert found.library_dir == str(tmp_path / lib)
    assert found.link_args[1] == "-l:libnccl.so.2"


def test_nccl_home_wins_over_the_wheel(tmp_path):
    _wheel(tmp_path / "site")
    home = tmp_path / "home"
    _touch(home / "include" / "nccl.h")
    _touch(home / "lib" / "libnccl.so.2")
    found = find_nccl({"NCCL_HOME": str(home)}, path=[str(tmp_path / "site")])
    assert found.include_dir == str(home / "include")


def test_nccl_home_without_a_library_names_the_folder_and_what_is_missing(tmp_path):
    _touch(tmp_path / "include" / "nccl.h")
    with pytest.raises(NcclNotFoundError, match=r"NCCL_HOME='.*' has no libnccl.so or"):
        find_nccl({"NCCL_HOME": str(tmp_path)}, path=[])


def test_nccl_home_without_the_header_says_so(tmp_path):
    _touch(tmp_path / "lib" / "libnccl.so.2")
    with pytest.raises(NcclNotFoundError, match=r"has no include/nccl.h"):
        find_nccl({"NCCL_HOME": str(tmp_path)}, path=[])


def test_neither_says_what_to_install_or_set(tmp_path):
    with pytest.raises(NcclNotFoundError) as error:
        find_nccl({}, path=[str(tmp_path)])
    message = str(error.value)
    assert "pip install nvidia-nccl-cu13" in message
    assert "NCCL_HOME" in message
    assert "GOSSIP_EXT_CUDA=0" in message


def test_a_broken_wheel_is_named_in_the_error(tmp_path):
    root = tmp_path / "nvidia" / "nccl"
    _touch(root / "include" / "nccl.h")
    os.makedirs(root / "lib")
    with pytest.raises(NcclNotFoundError, match=r"found the nvidia.nccl package, but .*has no"):
        find_nccl({}, path=[str(tmp_path)])
