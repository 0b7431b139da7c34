"""IdempotencyMiddleware for WSGI (PEP 3333) apps: the ASGI middleware, bridged.

A request that no option covers (another method, no key on a route that does not require
one) goes to the app at once, in its own thread, without touching the loop thread: a
lookup of the key header. A covered request runs the ASGI middleware on the loop thread
(`_loop`), which runs the app back in the request's thread (`_bridge`): one claim step,
one watchdog, one record format and one set of options with the ASGI middleware, so WSGI
and ASGI services on one store share keys and records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

from starlette.types import Scope

from .. import _routes
from .._routes import RESOLVED_POLICY, RoutePolicy
from .._threads._loop import loop_thread
from .._threads._records import ThreadedRecords, for_sync_apps
from ..middleware import Counters
from ..middleware import IdempotencyMiddleware as ASGIIdempotencyMiddleware
from ..middleware._lifespan import Lifespan
from ..store import Store
from ._app import WSGIApp, WSGIResponder, body_reader, read_whole, scope_of
from ._bridge import ClientGone, latin1, status_line, thread_app
from ._door import SyncDoor
from ._unkeyed import UnkeyedApp

PolicyOf: TypeAlias = Callable[[dict[str, Any]], RoutePolicy | None]

__all__ = ["IdempotencyMiddleware", "PolicyOf", "check_store", "client_left"]


class IdempotencyMiddleware:
    """Makes a WSGI app's POST/PATCH endpoints safe to retry with an ``Idempotency-Key``
    header, as goblin_idem.IdempotencyMiddleware does for an ASGI app: the same options
    (but `close_store`: a WSGI app has no shutdown to close it in), checked here, and the
    store checked here too unless ``check_store=False``, so that a wrong one stops the
    server's startup (a gunicorn worker fails to boot)."""

    def __init__(self, app: WSGIApp, *, store: Store | None = None, **options: Any) -> None:
        if not callable(app):
            raise TypeError(
                "app must be a WSGI application (a callable of environ and start_response), "
                f"not a {type(app).__name__}"
            )
        self.app = app
        if options.get("records") is not None:  # sync records keep it in this thread
            options["records"] = for_sync_apps(sync_records(options["records"]))
        self.core = ASGIIdempotencyMiddleware(thread_app, store=store, **options)
        # What a request the options do not cover runs: the app, in a transaction of its own
        # with records, so that goblin_idem.sql.sync works on every route.
        self.plain: WSGIApp = app
        if isinstance(self.core.records, ThreadedRecords):
            retry_after = self.core.retry_after.decode()
            self.plain = UnkeyedApp(app, self.core.records.backend, retry_after)
        self.store = self.core.store
        self.door = SyncDoor(self.core)
        self.policy_of: PolicyOf | None = None  # a framework's route marks (Flask's)
        check_store(self.core)  # raises for an unusable store, as a lifespan's startup

    @property
    def counters(self) -> Counters:
        """The ASGI middleware's counters: every request this middleware covered."""
        return self.core.counters

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        door = self.door
        key = environ.get(door.key_name)
        policy_of = self.policy_of if _routes.marked_endpoints else None
        if not door.may_cover(environ.get("REQUEST_METHOD"), key, policy_of is not None):
            return self.plain(environ, start_response)  # the common case: nothing to do, fast
        scope = scope_of(environ)
        if policy_of is not None:
            scope[RESOLVED_POLICY] = policy_of(environ)
        if not door.covers(scope, key is not None):
            return self.plain(environ, start_response)
        return self._bridged(environ, start_response, scope, key)

    def _bridged(
        self,
        environ: dict[str, Any],
        start_response: Callable[..., Any],
        scope: Scope,
        key: str | None,
    ) -> Iterable[bytes]:
        """The ASGI middleware on the loop thread, the app run back in this thread."""
        door = self.door
        try:
            body = read_whole(environ, door.max_body_bytes) if key is not None else None
        except ClientGone:
            return client_left(start_response)
        replay = door.replay(scope, key, body)
        if replay is not None:  # from memory, as the bridged path would answer it
            start, data = replay
            start_response(status_line(start["status"]), latin1(start["headers"]))
            return [data]
        responder = WSGIResponder(self.app, environ)
        outer = door.bridge(scope, responder, body, body_reader(environ) if body is None else None)
        try:
            if not outer.begin():  # the client left before its body was read
                return client_left(start_response)
            start = outer.start
            if outer.passed_through:
                start_response(responder.status, responder.headers)
            else:
                start_response(status_line(start["status"]), latin1(start.get("headers", ())))
            whole = outer.whole()
            return [whole] if whole is not None else outer.chunks()
        except BaseException:
            outer.abandon()
            responder.close()
            raise


def sync_records(records: object) -> object:
    """`records` as a sync app can write through: TypeError, saying what to pass, for
    records whose transaction is async (``SqlRecords`` with an AsyncEngine): the app's
    writes could not join it (``goblin_idem.sql.connection()`` is a coroutine), so the
    record would commit without them."""
    if callable(getattr(records, "transaction", None)):
        raise TypeError(
            f"records: {records!r} writes through an AsyncEngine, which a sync app cannot "
            "write through (goblin_idem.sql.connection() is async), so the record would "
            "commit without the app's writes: pass SyncSqlRecords(engine) with a sync Engine "
            "(sqlalchemy.create_engine; with Flask-SQLAlchemy, SyncSqlRecords(db.engine)) or "
            "SyncSqlRecords(url), and write through goblin_idem.sql.sync"
        )
    return records


def client_left(start_response: Callable[..., Any]) -> Iterable[bytes]:
    """The answer to a request whose client left before its body was read (nobody reads
    it; a server must be given one): 400, nothing run, nothing claimed."""
    start_response("400 Bad Request", [("Content-Length", "0")])
    return []


def check_store(core: ASGIIdempotencyMiddleware) -> None:
    """The store, then the SQL records, checked as an ASGI lifespan's startup checks them
    (a sync app has none), through the loop thread: RuntimeError for a store that cannot be
    used, SqlRecordsError for records, each saying what to change."""
    lifespan = Lifespan(core.app, core.store, core.check_store, False, core.records)
    loop_thread().run(lifespan.startup())
