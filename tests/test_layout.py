"""The package's shape, read from its source: the folders show its layers, imports never loop
and never reach a higher layer (those inside a function count too), the compiled extension is
imported from the module that loads it, no module writes another object's private attributes
nor reads them (each owner answers through a call or a public member it declares), and every
module stays small."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gossip_ext"
LAYERS = {
    "algorithms",
    "averagings",
    "compat",
    "gossip",
    "info",
    "lightning",
    "membership",
    "outer",
    "plan",
    "sharded",
}

# Lowest first: a module may import its own layer and the layers below it, never one above. A
# folder is one layer; a module directly under the package is named alone.
LAYER_ORDER = (
    # The compiled extension's loader and what every layer speaks of: errors, graphs and mixing
    # weights, messages as plain data.
    {"_torch_check", "errors", "graphs", "mixing", "_plain_messages"},
    # The gossip engines and their rounds; the ways to average, each one start/finish/commit.
    {"gossip", "averagings"},
    # Who trains with whom: a static group or an elastic job's epochs.
    {"membership"},
    # A module sharded by FSDP2 in each replica, and the elastic jobs of such replicas.
    {"sharded"},
    # The outer steps over a group's mean, reading a sharded module's local shards.
    {"outer"},
    # The frozen configuration objects, which build the parts below.
    {"algorithms"},
    # The wrapper, its views and checks, and the package's own tools.
    {
        "distributed",
        "assembly",
        "flat_keywords",
        "simulate",
        "_buffers",
        "_checkpoint",
        "_gossip_view",
        "_membership_view",
        "_outer_view",
        "_validation",
    },
    # Other libraries' names over the wrapper and their trainers around it; what the package
    # tells of itself, and what it predicts of a cluster.
    {"compat", "lightning", "info", "plan"},
)


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under an ``if TYPE_CHECKING:`` (not its ``else``), after checking
    that what they import is named only in annotations: never run, they only name types, which
    ``from __future__ import annotations`` keeps as text."""
    hidden, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {
            "TYPE_CHECKING",
            "typing.TYPE_CHECKING",
        }:
            hidden.update(id(n) for child in node.body for n in ast.walk(child))
            names.update(
                a.asname or a.name
                for child in node.body
                if isinstance(child, (ast.Import, ast.ImportFrom))
                for a in child.names
            )
    annotations = [
        n.annotation if isinstance(n, (ast.arg, ast.AnnAssign)) else n.returns
        for n in ast.walk(tree)
        if isinstance(n, (ast.arg, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    in_annotations = {id(n) for a in annotations if a is not None for n in ast.walk(a)}
    run = [
        n.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id in names and id(n) not in in_annotations
    ]
    assert not run, f"imported under TYPE_CHECKING but used where code runs: {run}"
    return hidden


def _imports(path: Path, modules: dict[str, Path], *, with_typing_only: bool = True) -> set[str]:
    """The package's modules that ``path`` imports anywhere (inside a function too: it runs
    when called, and it is a dependency all the same); those imported only for annotations too
    if ``with_typing_only``."""
    tree = ast.parse(path.read_text())
    hidden = set() if with_typing_only else _typing_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
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


def _layer(name: str) -> int:
    """The place in LAYER_ORDER of the module called ``name`` (its folder's, if it has one)."""
    part = name.split(".")[1]
    places = [i for i, layer in enumerate(LAYER_ORDER) if part in layer]
    assert places, f"{name}: {part} is in no layer of LAYER_ORDER"
    return places[0]


def test_at_most_16_modules_sit_directly_under_the_package_and_the_rest_in_layers():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 16, top
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders == LAYERS, folders


def test_the_imports_between_modules_never_loop():
    modules = _modules()
    # An import under ``if TYPE_CHECKING:`` never runs, so it cannot close a loop at import
    # time: membership's heartbeats name epochs' types that way, while epochs imports them.
    graph = {
        name: _imports(path, modules, with_typing_only=False) & set(modules)
        for name, path in modules.items()
    }
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


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    assert {n.split(".")[1] for n in modules if "." in n} <= set().union(*LAYER_ORDER)
    upward = [
        f"{name} -> {target}"
        for name, path in modules.items()
        if name != "gossip_ext"  # the package's __init__ gathers the public names of every layer
        for target in sorted(_imports(path, modules) & set(modules))
        # A type named only in annotations is a dependency too, so those imports count here.
        if _layer(target) > _layer(name)
    ]
    assert not upward, upward


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


# torch's private names the package reads, each for a reason of its own: torch has no public
# spelling of them (the coalesced broadcast DDP itself uses, the autograd engine's end-of-backward
# callback, a tensor's version counter, the default store and group registry of c10d, the
# multi-tensor copy).
TORCH_PRIVATE = {
    "_broadcast_coalesced",
    "_execution_engine",
    "_version",
    "_get_default_store",
    "_new_process_group_helper",
    "_world",
    "_foreach_copy_",
}


def test_no_module_reads_another_objects_private_members():
    reads = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        own = {"self", "cls"} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        # A class's module may read the members its classes define from another instance of
        # them (``other._key()`` in ``__eq__``).
        defined = {
            item.name
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef)
            for item in c.body
            if isinstance(item, ast.FunctionDef)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or node.attr in TORCH_PRIVATE | defined:
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in own:
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            reads.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not reads, reads
