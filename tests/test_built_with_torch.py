"""The compiled extension names the torch it was compiled against, and ``import gossip_ext``
refuses to run it under another (gossip_ext/_torch_check.py).

A second torch is not needed to test the refusal: the check takes both versions, and an
interpreter whose torch reports another version imports the package as a user would.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch

import gossip_ext  # the check has passed for this process
from gossip_ext import _torch_check
from gossip_ext._torch_check import _C, check_built_with, load_failed

pytestmark = pytest.mark.extension  # the rehearsals run these too (pyproject.toml)

# What the README's install line says, and what every refusal must tell the user to run.
REBUILD = "pip install --no-build-isolation --no-deps ."


def test_the_extension_was_built_against_the_running_torch():
    assert _C.built_with_torch() == str(torch.__version__)


@pytest.mark.parametrize(
    ("built", "running"),
    [
        ("2.13.0+cpu", "2.15.0"),
        ("2.13.0+cpu", "2.13.0"),  # the local suffix counts: a +cpu and a CUDA build differ
        ("2.11.0+cu130", "2.11.0+cu128"),
        ("2.13.0", "2.13"),  # equal as versions, not as strings
    ],
)
def test_another_torch_is_refused_naming_both_versions_and_the_rebuild(built, running):
    with pytest.raises(ImportError) as raised:
        check_built_with(built, running)
    message = str(raised.value)
    assert f"built against torch {built}," in message
    assert f"torch {running} is running" in message
    assert REBUILD in message


def test_the_same_torch_passes():
    check_built_with("2.13.0+cpu", "2.13.0+cpu")
    check_built_with(_C.built_with_torch(), torch.__version__)


def test_a_module_that_does_not_load_is_reported_with_the_running_torch_and_the_rebuild():
    error = load_failed("2.15.0", ImportError("undefined symbol: _ZN3c10"))
    assert "torch 2.15.0" in str(error)
    assert "undefined symbol: _ZN3c10" in str(error)
    assert REBUILD in str(error)


def test_import_refuses_the_extension_under_another_torch():
    # A fresh interpreter whose torch reports another version imports the package as a user would.
    result = subprocess.run(
        [sys.executable, "-c", "import torch\ntorch.__version__ = '2.15.0'\nimport gossip_ext"],
        # The copy this process imported, from the folder above it (a checkout or site-packages).
        cwd=os.path.dirname(os.path.dirname(os.path.realpath(gossip_ext.__file__))),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"built against torch {_C.built_with_torch()}," in last
    assert "torch 2.15.0 is running" in last
    assert REBUILD in last


def test_an_extension_that_does_not_load_is_reported(monkeypatch):
    # Loading the checking module again, with gossip_ext._C unloadable (None in sys.modules makes
    # its import raise ImportError, as a missing module or an undefined symbol does).
    monkeypatch.delattr(gossip_ext, "_C")
    monkeypatch.setitem(sys.modules, "gossip_ext._C", None)
    with pytest.raises(ImportError) as raised:
        importlib.reload(_torch_check)
    assert f"could not be loaded with torch {torch.__version__}" in str(raised.value)
    assert REBUILD in str(raised.value)
