"""``settings.GOBLIN_IDEM``: the ASGI middleware's options, in upper case.

``"STORE"`` is a URL (``redis://...``, ``rediss://...``, ``unix://...``: RedisStore.from_url;
``postgresql://...``: PostgresStore.from_url), ``"postgres"`` (a PostgresStore on the
project's ``default`` database, its table made by this app's migration), the dotted path
of a function that returns a store (``"myproject.idem.store"``, called with no arguments),
or a store itself; ``"memory"``, or no STORE, is a MemoryStore (one per process).
``"SCOPE"``, ``"ON_EVENT"`` and ``"OUTCOME"`` take a function or its dotted path
(``"OUTCOME"`` also a list of statuses); ``"KEY_PATTERN"`` a regular expression (a str,
compiled to match bytes) or a function. Every other key is the option of the same name,
lowercased. A value refused raises ImproperlyConfigured naming the key and what to change,
when Django loads its middleware (at startup).

Stores are made once per process and setting, so every middleware built from the same
settings (the test client builds one per client) shares one store and its watchdog.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.utils.module_loading import import_string  # type: ignore[import-untyped]

from ..middleware._middleware import OPTIONS
from ..store import MemoryStore, PostgresStore, RedisStore, Store

__all__ = [
    "POSTGRES",
    "RECORDS_DATABASE",
    "SETTING",
    "django_records",
    "postgres_url",
    "read",
    "refused",
]

SETTING = "GOBLIN_IDEM"
URL_SCHEMES = ("redis://", "rediss://", "unix://")
POSTGRES_SCHEMES = (
    "postgresql://",
    "postgres://",
    "postgresql+asyncpg://",
    "postgresql+psycopg://",
)
POSTGRES = "postgres"  # the STORE that is a PostgresStore on the project's default database
_FUNCTIONS = ("scope", "on_event", "outcome")
RECORDS_DATABASE = "RECORDS_DATABASE"  # not an option of the middleware: of RECORDS "django"
_stores: dict[str, Store] = {}
_made_records: dict[str, Any] = {}
_making = threading.Lock()


def read() -> dict[str, Any]:
    """The ASGI middleware's keyword arguments, from ``settings.GOBLIN_IDEM``."""
    given = getattr(settings, SETTING, {})
    if not isinstance(given, dict):
        raise ImproperlyConfigured(
            f"settings.{SETTING} must be a dict of options (such as "
            f'{{"STORE": "redis://127.0.0.1:6379/0"}}), not a {type(given).__name__}'
        )
    options: dict[str, Any] = {}
    given = dict(given)
    using = given.pop(RECORDS_DATABASE, None)
    if using is not None and given.get("RECORDS") != "django":
        raise ImproperlyConfigured(
            f"settings.{SETTING}['{RECORDS_DATABASE}'] names the database of "
            f'"RECORDS": "django", which is not set: set it, or remove {RECORDS_DATABASE}'
        )
    for key, value in given.items():
        name = key.lower() if isinstance(key, str) else None
        if name is None or key != key.upper() or name not in OPTIONS:
            raise ImproperlyConfigured(
                f"settings.{SETTING} has an unknown option {key!r}; the options are "
                f"{', '.join(sorted([*(o.upper() for o in OPTIONS), RECORDS_DATABASE]))}"
            )
        options[name] = _value(key, name, value)
    options["store"] = _store(options.get("store"))
    if options.get("records") == "django":
        options[RECORDS_DATABASE.lower()] = "default" if using is None else using
    return options


def django_records(using: object) -> Any:
    """The records in Django's database `using` (goblin_idem.django._records), checked for
    what can be known without asking the database, made once per process and alias."""
    from ._records import DjangoRecords

    if not isinstance(using, str):
        return DjangoRecords(using)  # type: ignore[arg-type]  # raises, saying what to give
    with _making:
        records = _made_records.get(using)
        if records is None:
            records = _made_records[using] = DjangoRecords(using)
    records.validate()
    return records


def _value(key: str, name: str, value: object) -> object:
    if name in _FUNCTIONS and isinstance(value, str):
        return _imported(key, value)
    if name == "key_pattern" and isinstance(value, str):
        try:
            return re.compile(value.encode())
        except re.error as exc:
            raise ImproperlyConfigured(
                f"settings.{SETTING}[{key!r}] is not a valid regular expression: {exc}"
            ) from None
    return value


def _imported(key: str, path: str, example: str = "myproject.idem.caller_scope") -> object:
    try:
        return import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"settings.{SETTING}[{key!r}]: cannot import {path!r} ({exc}); give the dotted "
            f"path of a function, as in {example!r}"
        ) from None


def _store(setting: object) -> Store | None:
    """The store the setting names, made once per process (see the module docstring)."""
    if setting is None or not isinstance(setting, str):
        return setting  # type: ignore[return-value]  # checked by the middleware
    with _making:
        store = _stores.get(setting)
        if store is None:
            store = _stores[setting] = _made(setting)
        return store


def _made(setting: str) -> Store:
    key = "STORE"
    if setting.startswith(URL_SCHEMES):
        try:
            return RedisStore.from_url(setting)
        except ValueError as exc:  # never repeats the URL: it may carry a password
            raise ImproperlyConfigured(
                f"settings.{SETTING}[{key!r}] is not a usable Redis URL: {exc}"
            ) from None
    if setting == "memory":
        return MemoryStore()
    if setting == POSTGRES or setting.startswith(POSTGRES_SCHEMES):
        url = postgres_url("default") if setting == POSTGRES else setting
        try:
            return PostgresStore.from_url(url)
        except (ImportError, ValueError) as exc:  # never repeats the URL: it may carry a password
            raise ImproperlyConfigured(
                f"settings.{SETTING}[{key!r}] = {setting if setting == POSTGRES else 'a URL'!r}"
                f" cannot be used: {exc}"
            ) from None
    if "://" in setting:
        scheme = setting.partition("://")[0]
        raise ImproperlyConfigured(
            f"settings.{SETTING}[{key!r}]: a URL of scheme {scheme!r} names no store; use "
            "redis://, rediss:// or unix:// (a Redis-protocol server), postgresql:// (or "
            '"postgres" for the project\'s database), or the dotted path of a function that '
            "returns a store"
        )
    found = _imported(key, setting, "myproject.idem.make_store")
    store = found
    if callable(found) and not isinstance(found, Store):
        try:
            store = found()
        except Exception as exc:
            raise ImproperlyConfigured(
                f"settings.{SETTING}[{key!r}]: calling {setting!r} raised "
                f"{type(exc).__name__}: {exc}; it must be a function of no arguments that "
                "returns a store"
            ) from exc
    if not isinstance(store, Store):
        raise ImproperlyConfigured(
            f"settings.{SETTING}[{key!r}]: {setting!r} gave a {type(store).__name__}, not a "
            "store; it must be (or return) a RedisStore or MemoryStore"
        )
    return store


def postgres_url(alias: str) -> str:
    """The URL of Django's PostgreSQL database `alias`, for a PostgresStore of its own
    connections (a socket directory as HOST goes in the query, as libpq reads it)."""
    from urllib.parse import quote

    db = settings.DATABASES.get(alias) or {}
    engine = str(db.get("ENGINE", ""))
    if not engine.endswith("postgresql"):
        raise ImproperlyConfigured(
            f'settings.{SETTING}["STORE"] = "{POSTGRES}" needs the {alias!r} database to be '
            f"PostgreSQL (django.db.backends.postgresql), not {engine or 'unset'!r}"
        )
    user = quote(str(db.get("USER") or ""), safe="")
    password = quote(str(db.get("PASSWORD") or ""), safe="")
    credentials = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(db.get("HOST") or "")
    port = str(db.get("PORT") or "")
    name = quote(str(db.get("NAME") or ""), safe="")
    if host.startswith("/"):
        query = f"?host={quote(host, safe='')}" + (f"&port={port}" if port else "")
        return f"postgresql://{credentials}/{name}{query}"
    address = (host or "localhost") + (f":{port}" if port else "")
    return f"postgresql://{credentials}{address}/{name}"


def refused(exc: Exception) -> ImproperlyConfigured:
    """An option the ASGI middleware refused, worded for the settings."""
    text = str(exc)
    name = text.split(" ", 1)[0].rstrip(":")
    where = f"[{name.upper()!r}]" if name in OPTIONS else ""
    return ImproperlyConfigured(f"settings.{SETTING}{where}: {text}")
