"""IdempotencyMiddleware: exactly-once POST/PATCH with byte-exact replay.

One request, in store round trips: a request with a key costs one claim step (GOBLIN.CLAIM
and a PTTL of the result, pipelined: a stored result wins over a claim that was lost); the
one that wins it runs the app and publishes the response in one more (result + claim TTL in
a MULTI/EXEC) before the last body chunk reaches the client; every duplicate is answered
from the claim step's reply alone. A request without a key costs nothing.

The middleware decides which requests are covered (../_routes.py); a covered one, from its
key to its answer, is a `Covered` (_covered.py), and the run of the app under a won claim a
`Run` (_run.py); what happened is counted by one event function (../_events.py).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import sys
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from starlette.types import ASGIApp, Receive, Scope, Send

from .. import _options as options
from .. import _routes
from .._claim_step import ClaimStep
from .._events import Counters, Events
from .._keys import DEFAULT_KEY_PATTERN
from .._lease import Watchdog
from .._recording import Records
from .._routes import RoutePolicy, Routes, idempotent
from .._run import Core
from ..records._sealing import Sealer
from ..store import Store
from ._covered import Covered
from ._lifespan import Lifespan, Refused
from ._names_010 import previous_reply
from ._openapi import Coverage, document_openapi
from ._recorded import Recording, Unkeyed
from ._request import Identity
from ._responses import Answers
from ._run import RunConfig

if TYPE_CHECKING:
    from ..webhooks import Provider

__all__ = ["OPTIONS", "Counters", "IdempotencyMiddleware", "RoutePolicy", "idempotent"]

_serving: weakref.WeakKeyDictionary[Any, IdempotencyMiddleware] = weakref.WeakKeyDictionary()
_P = ParamSpec("_P")


def _refused_at_startup(
    init: Callable[Concatenate[IdempotencyMiddleware, _P], None],
) -> Callable[Concatenate[IdempotencyMiddleware, _P], None]:
    """Options refused while a Starlette or FastAPI app builds its middleware fail the
    server's startup, not each request. The app builds it in its first call, which under a
    server with a lifespan is the lifespan's: an error raised there reads as "lifespan
    unsupported" to uvicorn's and granian's default mode, which then start the app and
    answer 500 to every request. So there the middleware keeps the error and serves as
    `Refused`; built anywhere else (wrapping an app by hand) it raises at once."""

    @functools.wraps(init)
    def checked(self: IdempotencyMiddleware, /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except Exception as exc:
            if not _built_by_an_app():
                raise
            self._app = Refused(exc)  # never a scope's app: every call goes to it

    return checked


def _built_by_an_app() -> bool:
    """Whether a Starlette (or FastAPI) app's `build_middleware_stack` is building this
    middleware: the method in which both build it (Starlette 0.37 to 1.x, FastAPI 0.110
    on), from their first call."""
    from starlette.applications import Starlette

    frame: FrameType | None = sys._getframe(2)  # above `checked`
    while frame is not None:
        if frame.f_code.co_name == "build_middleware_stack" and isinstance(
            frame.f_locals.get("self"), Starlette
        ):
            return True
        frame = frame.f_back
    return False


class IdempotencyMiddleware:
    """Makes POST/PATCH endpoints safe to retry with an ``Idempotency-Key`` header.

    - no key: passed through (400 problem on a required route); a malformed key: 400.
    - first request with a key: claims it, runs the app once while a watchdog renews the
      claim's lease, publishes status, headers and body, then finishes the response.
    - a duplicate of a completed request: the same response, byte for byte, plus
      ``Idempotent-Replayed: true``; with another method, path, query or body: 422.
    - a duplicate while the first is running: 409 with ``Retry-After``.
    - the app raised, never finished its response, or answered a status that is not the
      request's outcome (5xx, a redirect to repeat it elsewhere, 401, 403, 408, 423, 425,
      429: see `outcome`): the claim is released so that a retry runs the work; nothing
      is stored.
    - the store is unreachable: 503 and the app is not run (``fail_open=True`` runs it
      unprotected instead).
    - a webhook route (``@webhook(provider)``, or ``webhooks={path: provider}``): the
      provider verifies the delivery first (401 or 400, nothing claimed) and its delivery
      id is the key, in a scope of the provider and the route; the body is the fingerprint.
    """

    @_refused_at_startup
    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store | None = None,
        header: str = "Idempotency-Key",
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        lease_seconds: float = 30,
        ttl_seconds: float = 86_400,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        required_paths: Sequence[str] = (),
        key_pattern: re.Pattern[bytes] | Callable[[bytes], bool] = DEFAULT_KEY_PATTERN,
        scope: Callable[[Scope], bytes | str] | None = None,
        fingerprint_headers: Iterable[str] = (),
        max_body_bytes: int = 1024 * 1024,
        max_response_bytes: int = 1024 * 1024,
        retry_after_seconds: float = 1,
        wait_seconds: float = 0,
        poll_interval_seconds: float = 0.05,
        store_server_errors: bool = False,
        outcome: Callable[[int], bool] | Collection[int] | None = None,
        fail_open: bool = False,
        namespace: str = "idem",
        on_event: Callable[[str, str], None] | None = None,
        check_store: bool = True,
        close_store: bool = True,
        otel: bool = False,
        encryption_keys: Sequence[bytes] | Sealer | None = None,
        require_sealed: bool = False,
        compression: str | None = "zlib",
        compress_above_bytes: int = 1024,
        previous_key_names: bool = False,
        records: Records | None = None,
        wait_ms: int | None = None,
        poll_interval_ms: int | None = None,
        webhooks: dict[str, Provider] | None = None,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI application, not a {type(app).__name__}")
        self.app = app
        self.store: Store = options.store(store)
        self.header_name = options.http_tokens("header", [header], "header name")[0]
        self.header = self.header_name.lower().encode("latin-1")
        self.methods = options.methods(methods)
        self.key_pattern = options.key_pattern(key_pattern)
        self.scope_of = options.callable_or_none(
            "scope", scope, "a function of the ASGI scope returning the caller's identity"
        )
        self.fingerprint_headers = options.header_names("fingerprint_headers", fingerprint_headers)
        self.routes = Routes.from_options(
            required=required,
            ttl_seconds=ttl_seconds,
            lease_seconds=lease_seconds,
            include=include,
            exclude=exclude,
            required_paths=required_paths,
            webhooks=webhooks,
            outcome=outcome,
            store_server_errors=store_server_errors,
        )
        self.routes.wrapped = app
        self.max_body_bytes = options.whole_number("max_body_bytes", max_body_bytes, minimum=1)
        retry_after = options.seconds("retry_after_seconds", retry_after_seconds, minimum=0)
        self.retry_after = str(math.ceil(retry_after)).encode()  # delta-seconds: whole
        wait = options.renamed_ms("wait_ms", wait_ms, "wait_seconds", wait_seconds, 3)
        pause = options.renamed_ms(
            "poll_interval_ms", poll_interval_ms, "poll_interval_seconds", poll_interval_seconds, 3
        )
        self.wait_seconds, self.poll_interval = options.polling(wait, pause)
        self.fail_open = options.flag("fail_open", fail_open)
        self.namespace = options.namespace(namespace)
        self.previous_key_names = options.flag("previous_key_names", previous_key_names)
        self.check_store = options.flag("check_store", check_store)
        self.close_store = options.flag("close_store", close_store)
        self.records = options.records(records)
        label = "" if self.namespace == b"idem" else self.namespace.decode(errors="replace")
        self._lifespan = Lifespan(
            app, self.store, self.check_store, self.close_store, self.records, label
        )
        self.counters = Counters()
        hook = options.callable_or_none(
            "on_event", on_event, "a function (event, key_hash) called on every counter increment"
        )
        self.watchdog = Watchdog.for_store(self.store)
        self._store = self.store  # what requests call: `store`, timed with OpenTelemetry
        if options.flag("otel", otel):
            from ._otel import instrumented  # imported only when asked for

            self._store, hook = instrumented(self.store, hook, self.counters, self.watchdog)
        self.events = Events(self.counters, hook)
        self._app: Any = None  # the application whose scopes this middleware serves
        self.runs = RunConfig.from_options(
            Core(self._store, self.watchdog, self.events, self.records),
            app,
            encryption_keys=encryption_keys,
            compression=compression,
            compress_above_bytes=compress_above_bytes,
            max_response_bytes=max_response_bytes,
            fingerprint_headers=self.fingerprint_headers,
        )
        self.sealer = self.runs.sealer
        self.require_sealed = options.require_sealed(require_sealed, self.sealer)
        any_key = self.key_pattern is DEFAULT_KEY_PATTERN
        self._coverage = Coverage(
            self.methods, self.header_name, any_key, self.fail_open, self.routes
        )
        self.identity = Identity(
            self.namespace, self.scope_of, self.fingerprint_headers, self.header_name
        )
        self.answers = Answers(
            self.events,
            self.header_name,
            any_key,
            self.max_body_bytes,
            self.retry_after,
            self.sealer,
            self.require_sealed,
            self._store,
        )
        previous = None
        if self.previous_key_names:  # 0.1.0's names, looked at for a won claim
            previous = functools.partial(previous_reply, self._store, self.namespace)
        self.claim_step = ClaimStep(
            self._store, self.wait_seconds, self.poll_interval, self.records, previous
        )
        # The app for a request without a claimed key: with records, in a transaction of
        # its own, so that connection() and session() work on every route.
        self._unkeyed: ASGIApp = self.app
        if self.records is not None:
            self.runs = dataclasses.replace(
                self.runs, recording=Recording(self.records, self.answers)
            )
            self._unkeyed = Unkeyed(self.app, self.records, self.retry_after)
        self.covered = Covered(
            self.key_pattern,
            self.max_body_bytes,
            self.identity,
            self.answers,
            self.claim_step,
            self.events,
            self.runs,
            self.fail_open,
            self.store,
            self._unkeyed,
        )

    @property
    def on_event(self) -> Callable[[str, str], None] | None:
        """The application's hook, called with (event, key_hash) on every count."""
        return self.events.on_event

    @on_event.setter
    def on_event(self, hook: Callable[[str, str], None] | None) -> None:
        self.events.on_event = hook

    @classmethod
    def of(cls, app: Any) -> IdempotencyMiddleware:
        """The middleware serving `app` (a Starlette or FastAPI application, or the
        middleware itself when it wraps the app), for its counters and settings. It exists
        once the server has started the app (lifespan) or sent it a first request."""
        if isinstance(app, cls):
            return app
        try:
            return _serving[app]
        except (KeyError, TypeError):
            raise LookupError(
                f"no IdempotencyMiddleware serves this {type(app).__name__} yet: an app builds "
                "its middleware when the server starts it (lifespan) or sends it a first "
                "request; ask from a request handler, or after startup"
            ) from None

    def _adopt(self, app: Any) -> None:
        """The first scope of `app`: register for `of`, document the app's OpenAPI."""
        self._app = app
        try:
            _serving[app] = self
        except TypeError:  # None, or an app that cannot be weakly referenced: no `of`
            return
        document_openapi(app, self._coverage)

    # -- the request --

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("app") is not self._app:
            if isinstance(self._app, Refused):
                await self._app(scope, receive, send)
                return
            self._adopt(scope.get("app"))
        if scope["type"] != "http" or scope["method"] not in self.methods:
            if scope["type"] == "lifespan":
                await self._lifespan(scope, receive, send)
                return
            await self._unkeyed(scope, receive, send)
            return
        key = None
        keys = 0
        content_length = None
        header = self.header
        for name, value in scope["headers"]:
            if name == header:
                key = value
                keys += 1
            elif name == b"content-length":
                content_length = value
        if not self.routes.may_cover(key is not None, _routes.marked_endpoints > 0):
            await self._unkeyed(scope, receive, send)  # the common case: nothing to do, fast
            return
        settings = self.routes.covering(scope, key is not None)
        if settings is None:
            await self._unkeyed(scope, receive, send)
        elif key is not None or settings.webhook is not None:  # a webhook's key: its id
            await self.covered.request(scope, receive, send, settings, key, keys, content_length)
        else:  # a route that requires a key
            await self.answers.missing_key(send, scope["method"], scope["path"])


# Every option of the middleware, by name, but its app and the millisecond names it keeps
# for one release: what a framework's settings (Django's GOBLIN_IDEM, Flask's
# GOBLIN_IDEM_* config keys) may name.
OPTIONS = frozenset(inspect.signature(IdempotencyMiddleware.__init__).parameters) - {
    "self",
    "app",
    "wait_ms",
    "poll_interval_ms",
}
