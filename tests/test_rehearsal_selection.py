"""The rehearsals (tools/rehearse_build.sh) run a smoke test of the compiled extension against
another torch: the tests of tools/rehearsal_tests.txt, one node id a line, which together call
every public name of gossip_ext._C, dispatch every op the extension registers with torch and run
every transport with several ranks. The names are read from the built extension, not from a list
kept by hand, so a new binding or op without a test in the rehearsals fails here; and the
rehearsals run the first test below against their own build (a CUDA build's NcclTransport)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from gossip_ext._torch_check import _C

ROOT = Path(__file__).resolve().parent.parent
SELECTION = ROOT / "tools" / "rehearsal_tests.txt"
MULTI_RANK = "multi-rank:"


def _lines() -> list[tuple[str, set[str]]]:
    """(node id, the names it covers) for each line; words in parentheses only describe."""
    lines = []
    for line in SELECTION.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        selection, bar, covers = line.partition("|")
        assert bar, f"tools/rehearsal_tests.txt: no '|' in {line!r}"
        lines.append((selection.strip(), set(re.sub(r"\([^)]*\)", " ", covers).split())))
    return lines


def _built() -> tuple[set[str], set[str]]:
    """The public names of the built gossip_ext._C, and the ops it registered with torch."""
    bindings = {name for name in dir(_C) if not name.startswith("_")}
    # torch lists every registered operator as namespace::name[.overload]; the extension's are in
    # its own namespace, torch.ops.gossip_ext.
    ops = {
        name.split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("gossip_ext::")
    }
    return bindings, ops


def _transports(bindings: set[str]) -> set[str]:
    """The concrete transports: every class bound under a name ending in Transport, less their
    abstract base."""
    return {name for name in bindings if name.endswith("Transport") and name != "Transport"}


def test_every_binding_and_op_of_the_built_extension_is_named():
    bindings, ops = _built()
    assert ops, "the extension registered no op under torch.ops.gossip_ext"
    named = set().union(*(covers for _, covers in _lines()))
    missing = sorted((bindings | ops) - named)
    assert not missing, (
        f"tools/rehearsal_tests.txt names no test of {missing}: add a line (or a name to a line) "
        "whose test calls each"
    )
    run = {name.removeprefix(MULTI_RANK) for name in named if name.startswith(MULTI_RANK)}
    unrun = sorted(_transports(bindings) - run)
    assert not unrun, f"tools/rehearsal_tests.txt has no multi-rank run of {unrun}"


def test_every_name_of_the_selection_is_a_binding_or_op_of_the_sources():
    # Names a build may lack (NcclTransport in a CPU build) are checked against the sources.
    sources = "\n".join(p.read_text() for p in (ROOT / "csrc").rglob("*.c*"))
    for selection, covers in _lines():
        for name in covers:
            bare = name.removeprefix(MULTI_RANK).removeprefix("gossip_ext::")
            if name.startswith("gossip_ext::"):
                assert f'"{bare}(' in sources, f"{selection}: no op {name} in csrc/"
            else:
                assert f'"{bare}"' in sources, f"{selection}: no binding {bare} in csrc/"


def test_every_line_selects_a_test():
    selections = [selection for selection, _ in _lines()]
    for selection in selections:
        # One pytest command runs them all: a line is a node id, with no option or space.
        assert re.fullmatch(r"tests/[\w/]+\.py(::\w+(\[[^\]\s]+\])?)?", selection), selection
        path = selection.split("::")[0]
        assert (ROOT / path).is_file() and Path(path).name.startswith("test_"), selection
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + selections,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = collected.stdout + collected.stderr
    not_found = [line for line in output.splitlines() if "not found" in line]
    assert collected.returncode == 0 and not not_found, (
        f"selections that collect no test:\n{output}"
    )
    node_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    for selection in selections:
        assert any(
            node == selection or node.startswith((selection + "[", selection + "::"))
            for node in node_ids
        ), f"tools/rehearsal_tests.txt: {selection} collects no test"
