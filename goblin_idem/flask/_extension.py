"""The Flask extension: the WSGI middleware around ``app.wsgi_app``, and Flask's URL map
for route marks."""

from __future__ import annotations

import functools
from typing import Any

from flask import Flask
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from ..middleware._routes import RoutePolicy, policy_of
from ..store import Store
from ..wsgi import IdempotencyMiddleware

__all__ = ["Idempotency"]


class Idempotency:
    """Makes a Flask app's POST/PATCH views safe to retry with an ``Idempotency-Key``
    header; `options` are goblin_idem.IdempotencyMiddleware's, checked (with the store)
    when the app is given, so a wrong one stops the app's startup."""

    def __init__(
        self, app: Flask | None = None, *, store: Store | None = None, **options: Any
    ) -> None:
        self.store = store
        self.options = options
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        middleware = IdempotencyMiddleware(app.wsgi_app, store=self.store, **self.options)
        middleware.policy_of = functools.partial(_policy, app)
        app.wsgi_app = middleware  # type: ignore[method-assign]
        app.extensions["goblin_idem"] = middleware

    @staticmethod
    def middleware(app: Flask) -> IdempotencyMiddleware:
        """The middleware serving `app` (its counters, its store)."""
        middleware: IdempotencyMiddleware = app.extensions["goblin_idem"]
        return middleware


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
