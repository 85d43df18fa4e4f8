"""gossip_ext/_C.pyi, the compiled extension's declarations for the type checker, against the module
the build produced: a name declared there that the module lacks would let the checker pass code that
fails at run time, and a public name of the module left out would be unchecked."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from gossip_ext._torch_check import _C

STUB = Path(__file__).resolve().parent.parent / "gossip_ext" / "_C.pyi"
CUDA_ONLY = {"NcclTransport"}  # declared for CUDA builds; a CPU build has no NCCL transport
# Declared for builds with OpenSSL's libcrypto (tools/sources.py); one without has no sealing.
SEALED_ONLY = {"SealedTransport"}


def _declared() -> dict[str, set[str] | None]:
    """Each top-level name of the stub: a class's public members, None for anything else."""
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(STUB.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)  # a constant declared with its type
            names[node.name] = {m for m in members if not m.startswith("_")}
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
    return names


def _public(obj: object) -> set[str]:
    """What a compiled class defines itself (its own members, and an enum's values)."""
    own = set(vars(obj))
    if hasattr(obj, "__members__"):  # a pybind11 enum: its values, not the enum's machinery
        own = set(obj.__members__)
    return {m for m in own if not m.startswith("_")}


@pytest.mark.extension
def test_every_declared_name_is_the_modules_and_every_public_name_is_declared():
    declared = _declared()
    present = {n for n in dir(_C) if not n.startswith("_")}
    expected = set(declared) - (set() if hasattr(_C, "NcclTransport") else CUDA_ONLY)
    expected -= set() if hasattr(_C, "SealedTransport") else SEALED_ONLY
    assert present == expected, (sorted(present - expected), sorted(expected - present))
    for name in sorted(expected):
        members = declared[name]
        if members is None:
            continue
        compiled = getattr(_C, name)
        assert inspect.isclass(compiled), name
        assert _public(compiled) == members, (
            name,
            sorted(_public(compiled) - members),
            sorted(members - _public(compiled)),
        )


@pytest.mark.extension
def test_a_declared_methods_parameters_are_the_bindings():
    # pybind11 writes each bound function's signature first in its docstring.
    for node in ast.parse(STUB.read_text()).body:
        if not isinstance(node, ast.ClassDef) or not hasattr(_C, node.name):
            continue
        for item in node.body:
            if not isinstance(item, ast.FunctionDef) or item.name.startswith("__"):
                continue
            bound = getattr(getattr(_C, node.name), item.name)
            if isinstance(bound, property):
                continue
            assert [a.arg for a in item.args.args] == _parameters(bound.__doc__), (
                node.name,
                item.name,
            )


def _parameters(doc: str | None) -> list[str]:
    """The parameter names of the signature that starts a pybind11 docstring, ``f(a: T, ...)``:
    the names before each colon at the outermost level (types hold commas and brackets)."""
    names, depth, word = [], 0, ""
    for char in (doc or "").split("(", 1)[1]:
        if depth == 0 and char == ")":
            break
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif depth == 0 and char == ":" and word.strip():
            names.append(word.strip())
            word = ""
        elif depth == 0 and char == ",":
            word = ""
        elif depth == 0:
            word += char
    return names
