"""The wheel as a user installs it: built by tools/build_wheel.sh and installed, dependencies
resolved by pip, into a new virtual environment (tools/wheel_environment.sh, run by the test
command, which names it in GOSSIP_EXT_WHEEL_VENV). There, with no compiler on PATH, the quickstart
and examples/train.py run under torchrun, ``pip check`` is clean, and pip refuses the wheel beside
another torch, naming the one it needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from test_front_page import quickstart_script
from torchrun import failure_report, torchrun

ROOT = Path(__file__).resolve().parent.parent
VENV = os.environ.get("GOSSIP_EXT_WHEEL_VENV")
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc", "ninja")

pytestmark = pytest.mark.skipif(
    VENV is None,
    reason="no wheel environment: the test command makes one (tools/wheel_environment.sh) and "
    "names it in GOSSIP_EXT_WHEEL_VENV",
)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> tuple[str, dict[str, str]]:
    """The environment's python, and an environment whose PATH holds that environment's
    commands and a shell, but no compiler."""
    venv = (ROOT / VENV).resolve() if VENV else None
    tools = tmp_path_factory.mktemp("path")
    for name in ("bash", "sh", "env", "uname"):
        found = shutil.which(name)
        if found:
            (tools / name).symlink_to(found)
    path = f"{venv}/bin:{tools}"
    assert not [c for c in COMPILERS if shutil.which(c, path=path)], path
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    return str(venv / "bin" / "python"), dict(env, PATH=path)


def _run(user, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    python, env = user
    return subprocess.run(
        [python, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_the_wheel_names_and_requires_the_torch_it_was_built_against(user, tmp_path):
    shown = _run(user, "-m", "pip", "show", "gossip_ext", cwd=tmp_path)
    label = torch.__version__.split("+")[0].split(".")
    assert f"Version: 0.1.0+pt{label[0]}{label[1]}" in shown.stdout, shown.stdout
    assert "Requires: torch" in shown.stdout, shown.stdout
    check = _run(user, "-m", "pip", "check", cwd=tmp_path)
    assert check.returncode == 0 and "No broken requirements" in check.stdout, check
    where = _run(user, "-c", "import gossip_ext; print(gossip_ext.__file__)", cwd=tmp_path)
    assert "wheel-venv" in where.stdout and str(ROOT / "gossip_ext") not in where.stdout, where


def _torch_release(folder: Path, version: str) -> None:
    """A wheel of ``torch`` at ``version`` with nothing in it: the torch a user already pinned,
    as pip's resolver sees it."""
    info = f"torch-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    tags = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(f"{info}/WHEEL", tags)
        wheel.writestr(f"{info}/RECORD", "")


def test_pip_refuses_the_wheel_beside_another_torch_naming_the_one_it_needs(user, tmp_path):
    wheel = next((ROOT / "dist").glob("gossip_ext-*.whl"))
    _torch_release(tmp_path, "2.12.0")
    done = _run(user, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                str(tmp_path), str(wheel), "torch==2.12.0", cwd=tmp_path)  # fmt: skip
    assert done.returncode != 0, done.stdout
    assert f"depends on torch=={torch.__version__}" in done.stdout + done.stderr, done


def test_the_quickstart_runs_from_the_wheel_without_a_compiler(user, tmp_path):
    python, env = user
    done = torchrun(2, quickstart_script(tmp_path), cwd=tmp_path, timeout=120, python=python,
                    env=env)  # fmt: skip
    assert done.returncode == 0, failure_report(done)
    assert [(tmp_path / f"steps{rank}").read_text() for rank in (0, 1)] == ["6", "6"]


def test_train_py_runs_from_the_wheel_without_a_compiler(user, tmp_path):
    examples = tmp_path / "examples"  # a copy: nothing of the checkout on the workers' path
    shutil.copytree(ROOT / "examples", examples)
    python, env = user
    done = torchrun(2, examples / "train.py", "--mode", "overlap", "--message-dtype", "int8",
                    "--steps", "60", cwd=tmp_path, timeout=120, python=python, env=env)  # fmt: skip
    assert done.returncode == 0, failure_report(done)
    assert "relative consensus distance" in done.stdout, done.stdout
