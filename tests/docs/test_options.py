"""The documentation's option tables against the code, so that neither can drift.

A table is marked by an HTML comment on the line before it: ``<!-- options: DOTTED.NAME -->``
lists the keywords of that callable (a class's ``__init__``), one per row, the name in
backticks in the first column and, in the second, the default (its first backticked text, when
that is a Python literal); ``<!-- renamed: DOTTED.NAME -->`` lists old keyword names and
their new ones. Every keyword of the signature is in one of the two, and nothing else is.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs.examples import PAGES
from tests.support.procs import ROOT

MARK = re.compile(r"^<!--\s*(options|renamed):\s*([\w.]+)\s*-->\n((?:\|.*\n)+)", re.M)


def tables() -> Iterator[tuple[Path, str, str, list[list[str]]]]:
    for page in PAGES:
        for m in MARK.finditer(page.read_text()):
            rows = [
                [cell.strip() for cell in line.strip().strip("|").split(" | ")]
                for line in m[3].splitlines()[2:]  # past the header and the rule
            ]
            yield page, m[1], m[2], rows


def resolve(dotted: str) -> Callable[..., Any]:
    """`goblin_idem.Lock` (its ``__init__``), `goblin_idem.RedisStore.from_url`, ..."""
    parts = dotted.split(".")
    target: Any = importlib.import_module(parts[0])
    for at, part in enumerate(parts[1:], 2):
        if not hasattr(target, part):  # a subpackage not imported yet: goblin_idem.client
            importlib.import_module(".".join(parts[:at]))
        target = getattr(target, part)
    return target.__init__ if inspect.isclass(target) else target


def keywords(dotted: str) -> dict[str, inspect.Parameter]:
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = inspect.signature(resolve(dotted)).parameters.values()
    return {p.name: p for p in params if p.kind in kinds and p.name not in ("self", "app")}


def name_of(cell: str) -> str:
    m = re.match(r"`(\w+)`", cell)
    assert m, f"a table row names no option: {cell!r}"
    return m[1]


TABLES = list(tables())
DOCUMENTED = sorted({name for _, kind, name, _ in TABLES if kind == "options"})


def test_the_tables_are_found() -> None:
    assert "goblin_idem.IdempotencyMiddleware" in DOCUMENTED, DOCUMENTED


@pytest.mark.parametrize("dotted", DOCUMENTED)
def test_a_table_lists_every_keyword_and_its_default(dotted: str) -> None:
    params = keywords(dotted)
    listed: dict[str, list[str]] = {}
    renamed: set[str] = set()
    for page, kind, name, rows in TABLES:
        if name != dotted:
            continue
        for row in rows:
            if kind == "renamed":
                renamed.add(name_of(row[0]))
            else:
                where = f"{page.relative_to(ROOT)}: {name_of(row[0])}"
                assert name_of(row[0]) not in listed, f"{where} is listed twice"
                listed[name_of(row[0])] = row
    assert set(listed) | renamed == set(params), (
        f"documented but not in the signature: {sorted((set(listed) | renamed) - set(params))}; "
        f"in the signature but not documented: {sorted(set(params) - set(listed) - renamed)}"
    )
    for option, row in listed.items():
        default = re.search(r"`([^`]+)`", row[1])
        if default is None:
            continue
        try:
            value = ast.literal_eval(default[1])
        except (ValueError, SyntaxError):
            continue  # prose, or a name: `MemoryStore()`
        actual = params[option].default
        if isinstance(actual, (set, frozenset)):
            value = set(value)
        assert value == actual, f"{dotted} {option}: the table says {value!r}, the code {actual!r}"
