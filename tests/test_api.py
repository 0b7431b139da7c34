"""The public API, as httpx checks its own: the names `goblin_idem` exports (unchanged since
the layout by layers), each documented and in the API reference, every import the README
and the documentation show resolving, and one visibility rule for the modules: what is not
API starts with ``_``."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import goblin_idem

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "goblin_idem"

EXPORTED = [
    "CLAIMED",
    "Claim",
    "ClaimLostError",
    "ClaimReply",
    "Claimed",
    "Codec",
    "CommitRefusedError",
    "Counters",
    "DatabaseUnavailableError",
    "GoblinError",
    "IdempotencyMiddleware",
    "InFlightError",
    "KeyReusedError",
    "KeyT",
    "Lease",
    "Lock",
    "LockError",
    "LockNotOwnedError",
    "MemoryStore",
    "NotInRunError",
    "NotReplicatedError",
    "PostgresStore",
    "RedisStore",
    "RoutePolicy",
    "Sealer",
    "SqlRecordsError",
    "Store",
    "StorePermissionError",
    "Watchdog",
    "cookie_scope",
    "current_claim",
    "forget",
    "header_scope",
    "idempotent",
    "once",
]

# Modules a user imports from besides the package itself: the subpackages' own exports, and
# the two modules earlier releases' documentation sent users to.
PUBLIC_MODULES = {
    "goblin_idem",
    "goblin_idem.client",
    "goblin_idem.django",
    "goblin_idem.exceptions",
    "goblin_idem.flask",
    "goblin_idem.grpc",
    "goblin_idem.inspection",
    "goblin_idem.middleware",
    "goblin_idem.native",
    "goblin_idem.once",
    "goblin_idem.records",
    "goblin_idem.sealing",
    "goblin_idem.sql",
    "goblin_idem.sql.sync",
    "goblin_idem.store",
    "goblin_idem.webhooks",
    "goblin_idem.wsgi",
}


def test_the_exported_names_are_unchanged() -> None:
    assert sorted(goblin_idem.__all__) == EXPORTED
    for name in EXPORTED:
        assert getattr(goblin_idem, name) is not None


@pytest.mark.parametrize("name", EXPORTED)
def test_each_exported_name_is_documented(name: str) -> None:
    """A docstring of its own (an alias or constant is documented where it is defined:
    its module says what it is), and an entry in the API reference."""
    value = getattr(goblin_idem, name)
    if callable(value) and not isinstance(value, type(goblin_idem.CLAIMED)):
        assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    reference = (ROOT / "docs" / "reference.md").read_text()
    assert f"::: goblin_idem.{name}\n" in reference, f"{name} is not in docs/reference.md"


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_each_public_module_exports_what_it_names(module: str) -> None:
    imported = importlib.import_module(module)
    names = getattr(imported, "__all__", None)
    assert names, f"{module} has no __all__"
    for name in names:
        assert hasattr(imported, name), f"{module}.__all__ names {name}, which it lacks"


# Modules whose names Django looks for in an installed app (its AppConfig, its models, its
# migrations): not API, and not free to start with an underscore.
DJANGO_NAMED = ("goblin_idem.django.apps", "goblin_idem.django.models")
DJANGO_MIGRATIONS = "goblin_idem.django.migrations."


def test_every_module_that_is_not_api_starts_with_an_underscore() -> None:
    for path in PACKAGE.rglob("*.py"):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        if dotted in PUBLIC_MODULES:
            continue
        if dotted in DJANGO_NAMED or dotted.startswith(DJANGO_MIGRATIONS):
            continue
        assert path.name.startswith("_"), f"{dotted} is not API, so its name starts with _"


def _imports_in(text: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every `from goblin_idem... import` and `import goblin_idem...`
    in the Python blocks of a Markdown text."""
    found = []
    for block in re.findall(r"```python[^\n]*\n(.*?)```", text, re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("goblin_idem"):
                found.append((str(node.module), [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found += [(a.name, []) for a in node.names if a.name.startswith("goblin_idem")]
    return found


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_the_documentation_shows_resolves(document: Path) -> None:
    for module, names in _imports_in(document.read_text()):
        imported = importlib.import_module(module)
        for name in names:
            assert hasattr(imported, name), f"{document.name}: from {module} import {name}"


# Every import the README of release 0.2.0's layout change showed (in code blocks and in its
# text): they keep working, whatever the documentation shows now.
SHOWN_BEFORE = [
    ("goblin_idem", ["IdempotencyMiddleware", "RedisStore", "idempotent"]),
    ("goblin_idem", ["IdempotencyMiddleware", "cookie_scope", "header_scope"]),
    ("goblin_idem", ["ClaimLostError", "InFlightError", "RedisStore", "current_claim", "once"]),
    ("goblin_idem.client", ["AsyncIdempotentTransport", "IdempotentTransport", "RetryPolicy"]),
    ("goblin_idem.sealing", ["Sealer", "keys_from_env"]),
    ("goblin_idem.inspection", ["format_state", "inspect_key"]),
]


@pytest.mark.parametrize(("module", "names"), SHOWN_BEFORE)
def test_the_imports_the_readme_showed_still_resolve(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name), f"from {module} import {name}"


def test_the_readme_shows_imports() -> None:
    """The documentation check above has something to check in README.md."""
    assert any(m == "goblin_idem" for m, _ in _imports_in((ROOT / "README.md").read_text()))
