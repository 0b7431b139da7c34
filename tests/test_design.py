"""docs/DESIGN.md stays true: every file and folder it names exists, and every name it cites
(`Class.attribute`, `function()`, a class) is defined in the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "goblin_idem"
DESIGN = (ROOT / "docs" / "DESIGN.md").read_text()
CITED = re.findall(r"`([^`\s]+)`", DESIGN)


def _definitions() -> tuple[dict[str, set[str]], set[str]]:
    """Every class of the package with the names defined in its body (methods, fields,
    attributes set on self), and every module-level function and class name."""
    classes: dict[str, set[str]] = {}
    top: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            members = classes.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)
    return classes, top


CLASSES, TOP = _definitions()


def _exists(path: str) -> bool:
    """A file or folder of the package (as the page names them, from the folder it is
    listed under), or of the repository."""
    name = path.rstrip("/").removeprefix("../")
    folders = (ROOT, PACKAGE, ROOT / "docs", ROOT / "tests" / "support")
    candidates = [folder / name for folder in folders]
    candidates += [p for p in PACKAGE.rglob(Path(name).name) if str(p).endswith(name)]
    return any(c.exists() for c in candidates)


def test_every_file_and_folder_it_names_exists() -> None:
    paths = [c for c in CITED if c.endswith((".py", ".md", "/"))]
    assert len(paths) > 40  # the page names the modules; nothing to check would be a bug
    missing = [p for p in paths if not _exists(p)]
    assert not missing, f"docs/DESIGN.md names what does not exist: {missing}"


def test_every_name_it_cites_is_defined() -> None:
    missing = []
    for cited in CITED:
        if cited.endswith((".py", ".md")) or "/" in cited:
            continue
        call = cited.removesuffix("()")
        owner, _, member = call.partition(".")
        if member and owner[:1].isupper() and owner in CLASSES:
            if member not in CLASSES[owner]:
                missing.append(cited)
        elif member and owner[:1].isupper():
            missing.append(cited)  # a class the package does not define
        elif cited.endswith("()") and call not in TOP:
            missing.append(cited)
    assert not missing, f"docs/DESIGN.md cites what the code does not define: {missing}"


def test_the_check_sees_methods_and_functions() -> None:
    """The two checks above look at what they should: the page cites methods and calls."""
    assert "Run._publish" in CITED and "publish_retried()" in CITED
    assert "_publish" in CLASSES["Run"] and "publish_retried" in TOP


# The layers, as docs/DESIGN.md lists them (the page cites this table, and a test below
# checks that both name the same modules). Each layer is a set of units, each unit a set of
# modules named as in the package (a package stands for every module in it; "" is the root
# package, `goblin_idem/__init__.py`, the flat API). A module may import a module of its own
# unit or of a lower layer; within a layer, one unit imports another only where ON says it
# stands on it (the uses of a claim built on another use).
LAYERS: list[tuple[str, dict[str, tuple[str, ...]]]] = [
    (
        "1 wire and data",
        {
            "data": (
                "exceptions",
                "_version",
                "_keys",
                "_derived",
                "_durations",
                "_log",
                "_problems",
                "_unavailable",
                "records",
                "sealing",
                "native",
            )
        },
    ),
    ("2 stores", {"store": ("store",)}),
    ("3 leases", {"leases": ("_lease", "_lock", "_claim", "_closing", "_recording", "_options")}),
    (
        "4 uses of a claim: what every use shares",
        {
            "core": (
                "_claim_step",
                "_run",
                "_events",
                "_outcome",
                "_routes",
                "_provider",
                "_threads",
            )
        },
    ),
    (
        "4 uses of a claim",
        {
            "middleware": ("middleware",),
            "once": ("once",),
            "client": ("client",),
            "webhooks": ("webhooks",),
            "sql": ("sql",),
            "wsgi": ("wsgi",),
            "flask": ("flask",),
            "django": ("django",),
            "grpc": ("grpc",),
            "consumers": ("consumers",),
            "inspection": ("inspection",),
            "forget": ("_forget",),
        },
    ),
    ("5 the flat API and the command line", {"api": ("", "_cli", "__main__")}),
]
ON: dict[str, tuple[str, ...]] = {
    "wsgi": ("middleware",),
    "flask": ("wsgi", "middleware", "sql"),
    "django": ("wsgi", "middleware"),
    "grpc": ("once",),
    "consumers": ("once",),
    "inspection": ("once",),
    "forget": ("inspection",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, in functions too; not the body of an
    `if TYPE_CHECKING:` block (its else branch runs, so it counts)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            found.append(child)
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for branch in child.orelse:
                found += _import_nodes(branch) if not isinstance(branch, ast.Import) else [branch]
        else:
            found += _import_nodes(child)
    return found


def _imports(name: str) -> set[str]:
    """The package's modules that importing `name` runs: each module it names (`from pkg
    import mod` names `pkg.mod`), and the `__init__` of another package whose module it
    names, since Python runs that first. A package's `__init__` importing its own modules is
    an ordinary arrow down; its modules never import it back by running. The root package
    is the exception: it is the top layer, running before any of its modules, and a module
    that imports it by name is an arrow up like any other."""
    path = MODULES[name]
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names if a.name.split(".")[0] == "goblin_idem")
            continue
        if node.level:
            base = package[: len(package) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module.split(".")[0] != "goblin_idem":
            continue
        for alias in node.names:
            member = f"{module}.{alias.name}"
            targets.add(member if member in MODULES else module)
    runs = set(targets)
    for target in targets:
        parts = target.split(".")
        for n in range(2, len(parts)):
            parent = ".".join(parts[:n])
            if not name.startswith(parent + ".") and parent != name:
                runs.add(parent)
    unknown = runs - MODULES.keys()
    assert not unknown, f"{name} imports what the package does not have: {unknown}"
    return runs - {name}


def _unit_of(module: str) -> tuple[int, str]:
    """The tier and unit of a module, by the longest entry of LAYERS naming it."""
    relative = module.removeprefix("goblin_idem").removeprefix(".")
    best: tuple[int, str, str] | None = None
    for tier, (_, units) in enumerate(LAYERS):
        for unit, entries in units.items():
            for entry in entries:
                hit = relative == entry or (entry and relative.startswith(entry + "."))
                if hit and (best is None or len(entry) > len(best[2])):
                    best = (tier, unit, entry)
    assert best is not None, (
        f"{module} has no layer: add it to LAYERS in tests/test_design.py and to "
        "docs/DESIGN.md's layers"
    )
    return best[0], best[1]


GRAPH = {name: _imports(name) for name in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _unit_of(module)


def test_the_page_lists_the_layers_of_the_table() -> None:
    """docs/DESIGN.md's list of layers names each module and package of LAYERS, and no other."""
    listed = DESIGN[
        DESIGN.index("Each layer imports") : DESIGN.index("`tests/test_design.py` holds")
    ]
    named = {
        n.removesuffix(".py").removesuffix("/").replace("__init__", "")
        for n in re.findall(r"`([^`\s]+(?:\.py|/))`", listed)
    }
    tabled = {entry for _, units in LAYERS for entries in units.values() for entry in entries}
    assert named == tabled, f"only on the page: {named - tabled}; only here: {tabled - named}"


def test_no_module_imports_a_higher_layer_or_a_sibling() -> None:
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        tier, unit = _unit_of(module)
        for target in sorted(targets):
            their_tier, their_unit = _unit_of(target)
            if their_unit == unit or their_tier < tier or their_unit in ON.get(unit, ()):
                continue
            up = "a higher layer" if their_tier > tier else "a use it does not stand on"
            wrong.append(f"{module} -> {target} ({up}: {LAYERS[their_tier][0]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle() -> None:
    circles = _circles(GRAPH)
    assert not circles, f"import circles: {circles}"


def test_the_import_check_sees_what_it_should() -> None:
    """Imports inside functions count, `if TYPE_CHECKING:` blocks do not, a package's
    `__init__` runs before its module, and a circle is found."""
    assert "goblin_idem.sql" in GRAPH["goblin_idem._cli"]  # in _records()
    assert "goblin_idem.store" not in GRAPH["goblin_idem._events"]  # under TYPE_CHECKING
    assert "goblin_idem.once" in GRAPH["goblin_idem.grpc._door"]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
