"""The ASGI middleware: `IdempotencyMiddleware` and the `@idempotent` route marks.

- `_middleware`: options checked once, `__call__` routes; `_covered`: a covered
  request, from its key to its answer (`request` decides).
- `_request`: the body read whole, the key's store names and the fingerprint.
- `_responses`: every response the middleware writes itself, and the replay.
- `_run`: the one run of the app under a won claim, and its closing step.
- `_lifespan`, `_openapi`, `_otel`: startup and shutdown, the OpenAPI document,
  OpenTelemetry; `_names_010`: keys stored under release 0.1.0's names.

Below it, shared with the other doors: `../_routes` (which requests are covered, with which
settings: `RoutePolicy`), `../_problems` (the RFC 9457 problem documents), `../_events` (one
typed event per outcome, counted in one place: `Counters`).
"""

from .._events import Counters
from .._routes import RoutePolicy, idempotent
from ._middleware import IdempotencyMiddleware

__all__ = ["Counters", "IdempotencyMiddleware", "RoutePolicy", "idempotent"]
