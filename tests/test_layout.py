"""The package's shape, read from its source: the folders show its layers, imports never loop,
the compiled extension is imported from the module that loads it, no module writes another
object's private attributes, and every module stays small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gossip_ext"
LAYERS = {"algorithms", "averagings", "compat", "gossip", "membership", "outer", "sharded"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports at its top level (not inside a function)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("gossip_ext")
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("gossip_ext."))
    return names - {"gossip_ext"}


def test_at_most_16_modules_sit_directly_under_the_package_and_the_rest_in_layers():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == LAYERS, folders


def test_the_imports_between_modules_never_loop():
    modules = _modules()
    graph = {name: _imports(path, modules) & set(modules) for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", " -> ".join([*trail, name])
        state[name] = "open"
        for target in sorted(graph[name]):
            # A package's __init__ may name its own modules; that is not a loop through it.
            if not target.startswith(name + "."):
                visit(target, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        visit(name, [])


def test_the_extension_is_imported_from_the_module_that_loads_it():
    for name, path in _modules().items():
        if name == "gossip_ext._torch_check":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "gossip_ext":
                assert "_C" not in {a.name for a in node.names}, name


def test_no_module_writes_another_objects_private_attributes():
    writes = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        # A class's own module may write its class-level state (ParameterWatch's counters).
        own = {"self", "cls"} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    private = isinstance(t, ast.Attribute) and t.attr.startswith("_")
                    if private and not t.attr.startswith("__"):
                        owner = t.value
                        if not (isinstance(owner, ast.Name) and owner.id in own):
                            writes.append(f"{name}:{node.lineno}: {ast.unparse(t)}")
    assert not writes, writes


def test_no_module_is_over_500_lines():
    long = {
        name: n for name, p in _modules().items() if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long
