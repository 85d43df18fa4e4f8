"""The quick loop (tools/quick_check.sh) runs every module of the library at least once: each
line of tools/quick_tests.txt names the modules its selection runs, and together they name every
module of the package, so a new module cannot be left out of it unnoticed."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gossip_ext"


def _modules() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts) or "__init__")
    return names


def _lines() -> list[tuple[list[str], set[str]]]:
    lines = []
    for line in (ROOT / "tools" / "quick_tests.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        selection, _, modules = line.partition("|")
        lines.append((shlex.split(selection), set(modules.split())))
    return lines


def test_every_module_of_the_package_is_run_by_the_quick_loop():
    named = set().union(*(modules for _, modules in _lines()))
    assert named - _modules() == set(), "quick_tests.txt names modules that do not exist"
    assert _modules() - named == set(), "modules the quick loop does not run"


def test_every_selection_names_a_test_file_of_the_suite():
    for selection, _ in _lines():
        path = ROOT / selection[0]
        assert path.is_file() and path.name.startswith("test_"), selection
        assert set(selection[1:2]) <= {"-k"}, selection
