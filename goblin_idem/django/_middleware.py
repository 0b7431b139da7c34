"""``goblin_idem.django.IdempotencyMiddleware``: the ASGI middleware, for Django.

Sync and async capable. Under WSGI (gunicorn) Django calls it in the request's thread: the
ASGI middleware runs on the loop thread (`_loop`) and the rest of Django's chain back in
the request's thread (`goblin_idem.wsgi._bridge`), as for a WSGI app. Under ASGI (uvicorn)
it awaits the ASGI middleware in the request's own loop, the rest of the chain as its app.
Either way one claim step, one watchdog, one record format and one set of options with
the ASGI middleware: a Django service and a FastAPI service on one store share keys and
records.

A request no option covers (another method, no key on a route that does not require one)
goes down the chain at once. ``@idempotent(...)`` on a view (a function, a class-based or
Django REST framework view, or the class's handler for the request's method or its
viewset action) is found with Django's resolver, as Django will route the request.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.http import HttpRequest, HttpResponse  # type: ignore[import-untyped]
from django.http.response import HttpResponseBase  # type: ignore[import-untyped]
from django.urls import Resolver404, get_resolver, resolve  # type: ignore[import-untyped]
from starlette.types import Scope

from .. import _routes
from .._routes import RESOLVED_POLICY, RoutePolicy, policy_of
from .._threads._records import for_sync_apps
from ..exceptions import SqlRecordsError
from ..middleware import IdempotencyMiddleware as ASGIIdempotencyMiddleware
from ..wsgi._app import body_cut, body_reader, scope_of
from ..wsgi._bridge import HANDOFF, ClientGone, Outer, thread_app
from ..wsgi._door import SyncDoor
from ..wsgi._middleware import check_store
from . import _settings
from ._responses import (
    DJANGO_REQUEST,
    AsyncCall,
    DjangoResponder,
    chunked,
    django_app,
    response_of,
)

__all__ = ["IdempotencyMiddleware"]

_checked: weakref.WeakSet[object] = weakref.WeakSet()  # stores and records checked at startup


class IdempotencyMiddleware:
    """Makes Django's POST/PATCH views safe to retry with an ``Idempotency-Key`` header,
    configured by ``settings.GOBLIN_IDEM`` (goblin_idem.django._settings): options and
    store are checked when Django loads its middleware, and ImproperlyConfigured says
    what to change."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
        options = _settings.read()
        options["records"] = self._records(options)
        app = django_app if self.is_async else thread_app
        try:
            self.core = ASGIIdempotencyMiddleware(app, **options)
        except (TypeError, ValueError) as exc:
            raise _settings.refused(exc) from exc
        self.door = SyncDoor(self.core, in_thread=not self.is_async)
        self._check(self.core)
        get_resolver().url_patterns  # noqa: B018  # see _covered

    def _records(self, options: dict[str, Any]) -> Any:
        """RECORDS as the middleware takes them: under WSGI, records in the request's thread
        (``"django"``: the ORM's, `_records`; or a ThreadRecords) adapted to it; under
        ASGI, an async backend (goblin_idem.sql.SqlRecords). What cannot cover the views'
        writes where they run is refused, saying what to change."""
        records = options.get("records")
        using = options.pop(_settings.RECORDS_DATABASE.lower(), None)
        key = f"settings.{_settings.SETTING}['RECORDS']"
        in_thread = callable(getattr(records, "work", None))
        if self.is_async and (records == "django" or in_thread):
            raise ImproperlyConfigured(
                f"{key}: {records!r} commits the records with the ORM's writes in the "
                "request's thread, which sync views under a WSGI server (gunicorn) have, and "
                "this Django app is served under ASGI: serve it with its WSGI application "
                f"({_serving_wsgi()}), or, for async views, set RECORDS to "
                "goblin_idem.sql.SqlRecords(async_engine) and write through `await "
                "goblin_idem.sql.connection()`"
            )
        if records == "django":
            return for_sync_apps(_settings.django_records(using))
        if in_thread:
            return for_sync_apps(records)
        if records is not None and not self.is_async:
            raise ImproperlyConfigured(
                f"{key}: these records commit with the writes made through goblin_idem.sql's "
                "async connection() or session(), which the sync views of a WSGI server "
                "cannot use, and Django's ORM commits apart from them: the record would not "
                'cover the views\' effects. Set RECORDS to "django" (the records commit '
                "with the ORM's writes, in Django's database) or remove RECORDS (the store "
                "alone guards each key)"
            )
        return records

    @staticmethod
    def _check(core: ASGIIdempotencyMiddleware) -> None:
        """The store and the SQL records, checked once per process (as an ASGI lifespan's
        startup would)."""
        given: list[object] = [core.store]
        if core.records is not None:  # records adapted for this thread: their backend
            given.append(getattr(core.records, "backend", core.records))
        if all(part in _checked for part in given):
            return
        try:
            check_store(core)
        except RuntimeError as exc:
            raise ImproperlyConfigured(f"settings.{_settings.SETTING}['STORE']: {exc}") from exc
        except SqlRecordsError as exc:
            raise ImproperlyConfigured(f"settings.{_settings.SETTING}['RECORDS']: {exc}") from exc
        _checked.update(given)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        scope = self._covered(request)
        if scope is None:
            return self.get_response(request)
        return self._bridged(request, scope)

    def _covered(self, request: HttpRequest) -> Scope | None:
        """The ASGI scope of a request the middleware covers; None for the others.

        Marks are looked up while any endpoint is marked: the views' modules must have
        been imported by then, so the URLconf (which imports them) is loaded when the
        middleware is made, not at the first request as Django would; one a middleware
        sets for the request (``request.urlconf``) is looked up in any case."""
        door = self.door
        key = request.META.get(door.key_name)
        marks = bool(_routes.marked_endpoints) or hasattr(request, "urlconf")
        if not door.may_cover(request.method, key, marks):
            return None  # the common case: nothing to do, fast
        scope = _scope(request)
        scope[DJANGO_REQUEST] = request
        scope["route"] = _Route(request)
        if marks:
            scope[RESOLVED_POLICY] = _policy(request)
        return scope if door.covers(scope, key is not None) else None

    def _body(self, request: HttpRequest) -> bytes | None:
        """The body read up front (Django's own read) when it is within max_body_bytes;
        ClientGone if fewer bytes came than its Content-Length said (Django's read, as
        gunicorn's wsgi.input, ends where the client disconnected)."""
        length = request.META.get("CONTENT_LENGTH", "")
        if not length.isdigit() or int(length) > self.door.max_body_bytes:
            return None
        try:
            body: bytes = request.body
        except OSError as exc:  # Django's UnreadablePostError: the read failed
            raise ClientGone(f"the client left while sending the body ({exc})") from exc
        if len(body) < int(length):
            raise body_cut(len(body), int(length))
        return body

    # -- under WSGI: the request's thread --

    def _bridged(self, request: HttpRequest, scope: Scope) -> HttpResponseBase:
        try:
            body = self._body(request)
        except ClientGone:
            return HttpResponse(status=400)  # nobody reads it: nothing run, nothing claimed
        replay = self.door.replay(scope, request.META.get(self.door.key_name), body)
        if replay is not None:  # from memory, as the bridged path would answer it
            return response_of(*replay)
        responder = DjangoResponder(self.get_response, request)
        outer = self.door.bridge(scope, responder, body, _reader(request) if body is None else None)
        handed = False
        try:
            if not outer.begin():
                raise RuntimeError("the idempotency middleware sent no response")
            response = self._response(outer, responder)
            handed = response is responder.response
            return response
        except BaseException:
            outer.abandon()
            raise
        finally:
            if not handed:
                responder.discard()

    @staticmethod
    def _response(outer: Outer, responder: DjangoResponder) -> HttpResponseBase:
        response = responder.response
        if outer.passed_through and response is not None:
            if response.streaming:
                response.streaming_content = outer.chunks()
            else:
                outer.finish()
            return response
        whole = outer.whole()
        return response_of(outer.start, whole if whole is not None else outer.chunks())

    # -- under ASGI: the request's loop --

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        scope = self._covered(request)
        if scope is None:
            response: HttpResponseBase = await self.get_response(request)
            return response
        call = AsyncCall(self.get_response, request, self._body(request))
        scope[HANDOFF] = call
        call.start(self.core(scope, call.receive, call.send))
        handed = False
        try:
            first = await call.next()
            if first is None:
                raise RuntimeError("the idempotency middleware sent no response")
            start, message = first
            assert start is not None
            chunk = bytes(message.get("body", b""))
            more = message.get("more_body", False)
            inner = call.response
            if start is call.start_message and inner is not None:  # passed through
                if inner.streaming:
                    inner.streaming_content = call.stream(chunk)
                else:
                    await call.next()
                handed = True
                return inner
            if more:
                return response_of(start, call.stream(chunk))  # type: ignore[arg-type]
            await call.next()
            return response_of(start, chunk)
        except asyncio.CancelledError:  # Django cancels a view whose client left
            if call.task is not None:
                call.task.cancel()
            raise
        finally:
            if not handed and call.response is not None:
                await sync_to_async(call.response.close)()


def _scope(request: HttpRequest) -> Scope:
    """The request's ASGI scope: a copy of its own under ASGI (without the app of an outer
    framework that Django may be mounted in), else made from its environ."""
    asgi_scope = getattr(request, "scope", None)
    if asgi_scope is None:
        return scope_of(request.META)
    scope = dict(asgi_scope)
    scope.pop("app", None)
    query = scope.get("query_string", b"")
    if isinstance(query, str):  # Django's test client's scopes
        scope["query_string"] = query.encode("latin-1")
    return scope


class _Route:
    """The route Django matches the request to, as a log line names it (``scope["route"]``,
    as Starlette's router sets it): its URL pattern, one name for all of a route's
    requests; resolved only when asked."""

    __slots__ = ("request",)

    def __init__(self, request: HttpRequest) -> None:
        self.request = request

    @property
    def path(self) -> str:
        request = self.request
        try:
            match = resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
        except Resolver404:
            return str(request.path)
        return f"/{match.route}"


def _reader(request: HttpRequest) -> Any:
    """The body as Django reads it, whole (for a body with no Content-Length, or one
    over max_body_bytes, which the middleware refuses by its length before reading). A
    chunked body, which Django under WSGI does not read (it reads Content-Length bytes),
    is read from wsgi.input as the WSGI middleware reads it, and handed to Django's
    request as its body (`DjangoResponder.begin`), as Django's ASGI handler would."""
    if chunked(request):
        return body_reader(request.META)

    def read() -> tuple[bytes, bool]:
        return request.body, False

    return read


def _policy(request: HttpRequest) -> RoutePolicy | None:
    """The mark of the view Django routes the request to: on the handler of the request's
    method (a class-based view's method, a viewset's action), on the view, or its class."""
    try:
        match = resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
    except Resolver404:
        return None
    view = match.func
    cls = getattr(view, "view_class", None) or getattr(view, "cls", None)
    handler = None
    if cls is not None:
        method = (request.method or "").lower()
        actions = getattr(view, "actions", None)  # a REST framework viewset's
        handler = getattr(cls, actions.get(method, method) if actions else method, None)
    return policy_of(handler, view, cls)


def _serving_wsgi() -> str:
    """The gunicorn command of the project's WSGI application (settings.WSGI_APPLICATION),
    for a message that says to serve it."""
    path = getattr(settings, "WSGI_APPLICATION", None) or "myproject.wsgi.application"
    module, _, name = str(path).rpartition(".")
    return f"gunicorn {module}" if name == "application" else f"gunicorn {module}:{name}"
