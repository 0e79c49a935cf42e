"""skipinject's modules import each other without a cycle: read from the source (every import that runs,
also those inside functions, and the packages an import runs the ``__init__`` of; not those under
``if TYPE_CHECKING:``, which only the type checker follows), so a cycle fails here before it fails a run.
Counting the type checker's imports too there is no cycle either, and no module imports one of a layer
above its own (:data:`LAYERS`)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "skipinject"


def module_names() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module of skipinject."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def imports_of(
    name: str, path: Path, package: bool, modules: dict[str, tuple[Path, bool]], *, type_checking: bool = False
) -> set[str]:
    """The skipinject modules ``name`` imports (``from a.b import c`` is ``a.b.c`` when that is a module),
    with the packages above each that importing it runs: ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``,
    but not those of ``name``'s own packages (they ran before ``name`` did). ``type_checking``: also the imports
    under ``if TYPE_CHECKING:`` (and no import of ``name``'s own packages, which adds nothing)."""
    wanted: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if type_checking else _run_time_nodes(tree):
        if isinstance(node, ast.Import):
            wanted.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            wanted.add(target)
            wanted.update(f"{target}.{alias.name}" for alias in node.names)
    wanted.update(lazy_imports(path))
    own = packages_above(name)
    found = set()
    for target in wanted:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and not (type_checking and target in own):
            found.add(target)
            found.update(parent for parent in packages_above(target) if parent not in own and parent != name)
    return found


def lazy_imports(path: Path) -> set[str]:
    """The modules a package's ``_HOMES`` table names (``skipinject.store`` imports each at a name's first use)."""
    if path.name != "__init__.py":
        return set()
    package = ".".join(path.relative_to(ROOT).parent.parts)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_HOMES":
            homes = ast.literal_eval(node.value)
            return {"skipinject.payload" if home == "payload" else f"{package}.{home}" for home in homes}
    return set()


def _run_time_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes of ``tree`` but those under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    found = []
    pending = [tree]
    while pending:
        node = pending.pop()
        found.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def packages_above(name: str) -> set[str]:
    """``a.b.c`` -> ``{"a", "a.b"}``."""
    parts = name.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_importing_a_module_runs_the_packages_above_it(tmp_path: Path):
    names = {"p": (tmp_path, True), "p.a": (tmp_path, False), "p.b": (tmp_path, True), "p.b.c": (tmp_path, False)}
    (tmp_path / "a.py").write_text("from p.b.c import x\n")
    assert imports_of("p.a", tmp_path / "a.py", False, names) == {"p.b", "p.b.c"}
    (tmp_path / "c.py").write_text("import p.a\n")  # p and p.b ran before p.b.c did
    assert imports_of("p.b.c", tmp_path / "c.py", False, names) == {"p.a"}


def test_imports_only_the_type_checker_follows_are_not_counted(tmp_path: Path):
    names = {"p": (tmp_path, True), "p.a": (tmp_path, False), "p.b": (tmp_path, False), "p.c": (tmp_path, False)}
    (tmp_path / "a.py").write_text(
        "import typing\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n"
        "else:\n    from p import c\nif typing.TYPE_CHECKING:\n    import p.b\n"
    )
    assert imports_of("p.a", tmp_path / "a.py", False, names) == {"p", "p.c"}


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_skipinject_imports_no_module_that_imports_it_back():
    modules = module_names()
    assert {"skipinject.roles", "skipinject.verl.compat", "skipinject.store.writer"} <= set(modules)
    graph = {name: imports_of(name, path, package, modules) for name, (path, package) in modules.items()}
    assert "skipinject.store.step_store" in graph["skipinject.store"]  # the reading works
    found = cycles(graph)
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    modules = module_names()
    return {
        name: imports_of(name, path, package, modules, type_checking=type_checking)
        for name, (path, package) in modules.items()
    }


#: Cycles through imports only the type checker follows, not broken yet (this set only shrinks).
KNOWN_TYPE_CYCLES = [["skipinject.store.step_store", "skipinject.store.writer"]]


def test_imports_the_type_checker_follows_close_no_cycle_either():
    found = cycles(graph(type_checking=True))
    new = [cycle for cycle in found if cycle not in KNOWN_TYPE_CYCLES]
    assert new == [], "import cycles (type-only imports counted): " + "; ".join(" <-> ".join(c) for c in new)
    assert [c for c in KNOWN_TYPE_CYCLES if c not in found] == [], "broken already: drop from KNOWN_TYPE_CYCLES"


#: skipinject's layers, the top first: a module imports modules of its own layer and those below, never one
#: above. Each layer lists the modules it holds (with the modules under them; ``=name``: that module only,
#: a package's ``__init__``); the longest match decides. The runner starts the plugin manager, which hands the
#: roles to the engine; the engine serves and records through the report, the verl adapter and the store,
#: with the roles' data and the injector; settings and the store's bytes are below them all.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "runner / bootstrap",
        (
            "skipinject.__main__",
            "skipinject.cli",
            "skipinject.bootstrap",
            "skipinject._bootstrap",
            "skipinject.auto",
            "skipinject.listing",
            "skipinject.invocation",
            "skipinject.testing",
            "skipinject.cluster",
            "skipinject.cache_tool",
        ),
    ),
    ("plugin manager", ("=skipinject", "skipinject.plugin_manager", "skipinject.plugin_kit")),
    ("engine", ("skipinject.engine",)),
    ("report, verl adapter (beside the engine)", ("skipinject.report", "skipinject.verl")),
    ("roles, injector", ("skipinject.roles", "skipinject.injector")),
    ("settings", ("skipinject.config", "skipinject.dump_root")),
    ("store", ("skipinject.store", "skipinject.payload", "skipinject.codecs")),
    (
        "base",
        (
            "skipinject.errors",
            "skipinject.text",
            "skipinject.clock",
            "skipinject.node",
            "skipinject._version",
            "=skipinject.verl",
            "skipinject.verl.compat",
        ),
    ),
]
#: Imports up a layer not removed yet (this set only shrinks).
KNOWN_UPWARD: set[tuple[str, str]] = set()


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of module ``name``'s layer."""
    best, length = -1, -1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            exact = member.startswith("=")
            member = member.lstrip("=")
            if (name == member or (not exact and name.startswith(member + "."))) and len(member) + exact > length:
                best, length = index, len(member) + exact
    assert best >= 0, f"{name} is in no layer of LAYERS"
    return best


def upward(imports: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The imports of ``imports`` from a module to one of a layer above its own."""
    return {(name, other) for name, targets in imports.items() for other in targets if layer_of(other) < layer_of(name)}


def test_layers_are_read_from_the_list():
    assert layer_of("skipinject.engine.replay") == layer_of("skipinject.engine") == 2
    assert layer_of("skipinject.verl.compat") == layer_of("skipinject.verl") == len(LAYERS) - 1
    assert layer_of("skipinject.verl.codecs") == 3
    assert upward({"skipinject.store.writer": {"skipinject.engine", "skipinject.errors"}}) == {
        ("skipinject.store.writer", "skipinject.engine")
    }


def test_no_module_imports_one_of_a_layer_above():
    found = upward(graph(type_checking=True))
    assert found - KNOWN_UPWARD == set(), "imports up a layer: " + "; ".join(
        f"{a} -> {b}" for a, b in sorted(found - KNOWN_UPWARD)
    )
    assert found >= KNOWN_UPWARD, f"fixed already: drop from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - found)}"
