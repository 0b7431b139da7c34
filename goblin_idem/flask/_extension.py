"""The Flask extension: the WSGI middleware around ``app.wsgi_app``, and Flask's URL map
for route marks."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from flask import Flask
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from .._routes import RoutePolicy, policy_of
from .._threads._records import ThreadedRecords
from ..middleware._middleware import OPTIONS
from ..store import MemoryStore, RedisStore, Store
from ..wsgi import IdempotencyMiddleware

__all__ = ["CONFIG_PREFIX", "Idempotency"]

CONFIG_PREFIX = "GOBLIN_IDEM_"  # app.config["GOBLIN_IDEM_LEASE_SECONDS"] is lease_seconds
URL_SCHEMES = ("redis://", "rediss://", "unix://")


class Idempotency:
    """Makes a Flask app's POST/PATCH views safe to retry with an ``Idempotency-Key``
    header; `options` are goblin_idem.IdempotencyMiddleware's, checked (with the store)
    when the app is given, so a wrong one stops the app's startup. Where they may come
    from (the constructor, ``init_app``, ``GOBLIN_IDEM_<OPTION>`` config keys), and which
    wins: docs/sync.md."""

    def __init__(
        self, app: Flask | None = None, *, store: Store | None = None, **options: Any
    ) -> None:
        self.store = store
        self.options = options
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, *, store: Store | None = None, **options: Any) -> None:
        config = config_options(app.config)
        given = {**config, **self.options, **options}
        where = {name: f"app.config[{CONFIG_PREFIX + name.upper()!r}]" for name in config}
        where.update((name, f"Idempotency({name}=...)") for name in self.options)
        where.update((name, f"init_app({name}=...)") for name in options)
        if store is not None:
            where["store"] = "init_app(store=...)"
        elif self.store is not None:
            where["store"] = "Idempotency(store=...)"
        chosen = store if store is not None else self.store
        if chosen is None:
            chosen = given.get("store")
        given["store"] = _store(chosen, where.get("store", "store"))
        try:
            middleware = IdempotencyMiddleware(app.wsgi_app, **given)
        except (TypeError, ValueError) as exc:
            named = _named(exc, where)
            if named is exc:
                raise
            raise named from exc
        middleware.policy_of = functools.partial(_policy, app)
        wsgi_app: Any = middleware
        if isinstance(middleware.core.records, ThreadedRecords):  # sync SQL records
            from ._sqlalchemy import JoinOnFirstRequest, join_sessions

            if not join_sessions(app):  # Flask-SQLAlchemy may come after: look again then
                wsgi_app = JoinOnFirstRequest(app, middleware)
        app.wsgi_app = wsgi_app  # type: ignore[method-assign]
        app.extensions["goblin_idem"] = middleware

    @staticmethod
    def middleware(app: Flask) -> IdempotencyMiddleware:
        """The middleware serving `app` (its counters, its store)."""
        middleware: IdempotencyMiddleware = app.extensions["goblin_idem"]
        return middleware


def config_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """The middleware's options the app's config gives as ``GOBLIN_IDEM_*`` keys; ValueError
    naming the key for one that names no option."""
    found: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(key, str) or not key.startswith(CONFIG_PREFIX):
            continue
        name = key[len(CONFIG_PREFIX) :].lower()
        if name not in OPTIONS:
            raise ValueError(
                f"app.config[{key!r}] names no goblin-idem option; the options are "
                f"{', '.join(sorted(CONFIG_PREFIX + o.upper() for o in OPTIONS))}"
            )
        found[name] = value
    return found


def _named(exc: TypeError | ValueError, where: Mapping[str, str]) -> TypeError | ValueError:
    """An option the middleware refused (its message starts with the option's name),
    worded for where the app set it: its ``app.config`` key or the argument."""
    text = str(exc)
    name = re.match(r"[a-z_]*", text).group()  # type: ignore[union-attr]
    if name not in where or type(exc) not in (TypeError, ValueError):
        return exc
    return type(exc)(f"{where[name]}: {text}")


def _store(setting: object, where: str) -> Any:
    """A store given as a URL (or ``"memory"``) made; anything else is checked by the
    middleware (None, for one, is refused with what to pass). `where` names the setting."""
    if isinstance(setting, str):
        if setting == "memory":
            return MemoryStore()
        if setting.startswith(URL_SCHEMES):
            try:
                return RedisStore.from_url(setting)
            except ValueError as exc:  # never repeats the URL: it may carry a password
                raise ValueError(f"{where} is not a usable Redis URL: {exc}") from None
        raise ValueError(
            f"{where} must be a store, a redis://, rediss:// or unix:// URL, or 'memory', "
            f"not {setting[:20]!r}"
        )
    return setting


def _policy(app: Flask, environ: dict[str, Any]) -> RoutePolicy | None:
    """The mark of the view Flask routes this request to, found as Flask finds the view."""
    try:
        adapter = app.create_url_adapter(app.request_class(environ))
        if adapter is None:
            return None
        endpoint, _ = adapter.match()
    except (HTTPException, RequestRedirect):  # no view: Flask answers 404, 405 or 308
        return None
    view = app.view_functions.get(endpoint)
    cls = getattr(view, "view_class", None)
    handler = getattr(cls, environ["REQUEST_METHOD"].lower(), None) if cls else None
    return policy_of(handler, view, cls)
