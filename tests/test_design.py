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
