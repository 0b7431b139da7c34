"""The API reference (docs/reference.md) against the code: every public name has an entry,
every entry renders its full signature, and every option a user passes is described.

An option is described by a row of an options table (``<!-- options: NAME -->``, which
tests/docs/test_options.py holds to the signature) or by its name in backticks in the
docstring that the reference shows.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
import re
from typing import Any

import pytest
import yaml

import goblin_idem
from tests.docs.test_options import TABLES
from tests.support.procs import ROOT

REFERENCE = (ROOT / "docs" / "reference.md").read_text()
ENTRIES = re.findall(r"^::: ([\w.]+)", REFERENCE, re.M)

# Public modules whose exports the reference covers (`native`: the build helpers of the
# server module, on their own page).
MODULES = ["goblin_idem"] + [
    f"goblin_idem.{m.name}"
    for m in pkgutil.iter_modules(goblin_idem.__path__)
    if not m.name.startswith("_")
]


def lookup(dotted: str) -> Any:
    """The object a dotted name names: a module's attribute, or a class's
    (`goblin_idem.RedisStore.from_url`)."""
    parts = dotted.split(".")
    for at in range(len(parts) - 1, 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:at]))
        except ModuleNotFoundError:
            continue
        for part in parts[at:]:
            target = getattr(target, part)
        return target
    raise LookupError(dotted)


def exported() -> list[str]:
    names = []
    for module in MODULES:
        for name in getattr(importlib.import_module(module), "__all__", ()):
            names.append(f"{module}.{name}")
    return names


def documented(dotted: str) -> bool:
    """An entry under this name, or under the same object's name in another public module
    (`goblin_idem.MemoryStore` is `goblin_idem.store.MemoryStore`)."""
    module, _, name = dotted.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    for entry in ENTRIES:
        if entry.rpartition(".")[2] != name:
            continue
        where, _, attr = entry.rpartition(".")
        if getattr(importlib.import_module(where), attr, None) is target or entry == dotted:
            return True
    return False


@pytest.mark.parametrize("dotted", exported())
def test_every_public_name_has_an_entry(dotted: str) -> None:
    assert documented(dotted), f"docs/reference.md has no ::: entry for {dotted}"


def test_entries_render_full_signatures() -> None:
    """mkdocstrings' options that put each signature, with types and defaults, under its
    heading; a class's from its __init__."""

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml's !!python/name tags (Material's emoji) are not needed here.
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    plugin = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict))
    options = plugin["handlers"]["python"]["options"]
    for option in (
        "show_signature",
        "show_signature_annotations",
        "separate_signature",
        "merge_init_into_class",
    ):
        assert options.get(option) is True, option


# What the package hands out rather than takes: their fields are read, not passed.
HANDED_OUT = {
    "goblin_idem.Claim",
    "goblin_idem.Counters",
    "goblin_idem.Lease",
    "goblin_idem.client.RetryEvent",
    "goblin_idem.consumers.Outcome",
    "goblin_idem.inspection.KeyState",
}
# The app a middleware wraps, as every framework passes it.
WRAPPED = {"app", "get_response"}


def options_of(dotted: str) -> list[str]:
    """The keywords a user passes: those of a function, or of a class's constructor;
    none for exceptions, enums, protocols and the values the package hands out."""
    target = lookup(dotted)
    if dotted in HANDED_OUT or not callable(target):
        return []
    if inspect.isclass(target) and (
        issubclass(target, (BaseException, enum.Enum)) or getattr(target, "_is_protocol", False)
    ):
        return []
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    public = [p.name for p in params if p.kind in kinds and not p.name.startswith("_")]
    return [name for name in public if name not in {"self", "cls", *WRAPPED}]


# Takes the options of another entry, described there (test_same_options_as holds them alike).
SAME_AS = {
    "goblin_idem.RedisStore": "goblin_idem.RedisStore.from_url",
    "goblin_idem.PostgresStore": "goblin_idem.PostgresStore.from_url",
    "goblin_idem.client.IdempotentTransport": "goblin_idem.client.AsyncIdempotentTransport",
    "goblin_idem.grpc.IdempotencyInterceptor": "goblin_idem.grpc.AsyncIdempotencyInterceptor",
    "goblin_idem.grpc.IdempotentClientInterceptor": (
        "goblin_idem.grpc.AsyncIdempotentClientInterceptor"
    ),
}


def under_entry(dotted: str) -> str:
    """The reference's own text under an entry, up to the next one."""
    found = re.search(rf"^::: {re.escape(dotted)}\n(.*?)(?=^::: |^## |\Z)", REFERENCE, re.M | re.S)
    return found[1] if found else ""


def described(dotted: str) -> set[str]:
    target = lookup(dotted)
    name = dotted.rpartition(".")[2]
    text = (inspect.getdoc(target) or "") + under_entry(dotted)
    if inspect.isclass(target):
        text += inspect.getdoc(vars(target).get("__init__")) or ""
    names = set(re.findall(r"`+(\w+)", text))
    if dotted in SAME_AS:
        names |= described(SAME_AS[dotted])
    for _, _kind, table, rows in TABLES:  # options, and the old names of renamed ones
        if table in (dotted, f"goblin_idem.{name}"):
            names |= {re.match(r"`(\w+)`", row[0])[1] for row in rows if row[0].startswith("`")}
    return names


@pytest.mark.parametrize("dotted", [e for e in ENTRIES if options_of(e)])
def test_every_option_is_described(dotted: str) -> None:
    missing = [o for o in options_of(dotted) if o not in described(dotted)]
    assert not missing, f"{dotted}: no description of {missing} (its docstring or a table)"


@pytest.mark.parametrize("dotted", sorted(SAME_AS))
def test_same_options_as(dotted: str) -> None:
    """What SAME_AS says: every option but the first (the client, the transport) is the
    other's, with its default."""

    def signature(name: str) -> dict[str, object]:
        params = list(inspect.signature(lookup(name)).parameters.values())[1:]
        keyword = inspect.Parameter.KEYWORD_ONLY
        return {p.name: p.default for p in params if p.kind is keyword and p.name[0] != "_"}

    mine, theirs = signature(dotted), signature(SAME_AS[dotted])
    assert all(theirs.get(name, inspect.Parameter.empty) == d for name, d in mine.items())
