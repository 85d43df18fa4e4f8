"""The compiled extension names the torch it was compiled against, and ``import gossip_ext``
refuses to run it under another (gossip_ext/_torch_check.py).

A second torch is not needed to test the refusal: the check takes both versions, and a
subprocess whose torch reports another version imports the package as a user would.
"""

import os
import subprocess
import sys

import pytest
import torch

import gossip_ext  # the check has passed for this process
from gossip_ext import _C
from gossip_ext._torch_check import check_built_with, load_failed

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


def _import_gossip_ext(setup: str) -> subprocess.CompletedProcess:
    """Imports gossip_ext in a fresh interpreter after running ``setup`` there: the copy this
    process imported (from the folder above it: a checkout, or site-packages)."""
    return subprocess.run(
        [sys.executable, "-c", f"import sys, torch\n{setup}\nimport gossip_ext"],
        cwd=os.path.dirname(os.path.dirname(os.path.realpath(gossip_ext.__file__))),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_import_refuses_the_extension_under_another_torch():
    result = _import_gossip_ext("torch.__version__ = '2.15.0'")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"built against torch {_C.built_with_torch()}," in last
    assert "torch 2.15.0 is running" in last
    assert REBUILD in last


def test_import_reports_an_extension_that_does_not_load():
    # None in sys.modules makes `from gossip_ext import _C` raise ImportError, as a missing module
    # or an undefined symbol does.
    result = _import_gossip_ext("sys.modules['gossip_ext._C'] = None")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ")
    assert f"could not be loaded with torch {torch.__version__}" in last
    assert REBUILD in last
