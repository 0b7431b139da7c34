"""IdempotencyMiddleware: exactly-once POST/PATCH with byte-exact replay.

One request, in store round trips: a request with a key costs one claim step (GOBLIN.CLAIM
and a PTTL of the result, pipelined: a stored result wins over a claim that was lost); the
one that wins it runs the app and publishes the response in one more (result + claim TTL in
a MULTI/EXEC) before the last body chunk reaches the client; every duplicate is answered
from the claim step's reply alone. A request without a key costs nothing.

The middleware decides and answers: which requests are covered (_routes.py), whether a key
is acceptable, what the claim step's reply means, and every response it writes itself. The
run of the app under a won claim is a `Run` (_run.py); what happened is counted by one
event function (_events.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import _routes, options, problems
from ._events import Counters, Events
from ._routes import RoutePolicy, Routes, Settings, idempotent
from ._run import Run, RunConfig, free_claim, log_store_error
from .claim import new_token, poll_claim
from .errors import describe
from .keys import (
    DEFAULT_KEY_PATTERN,
    KeyNames,
    credential_header,
    credentials_scope,
    key_names,
    previous_names,
    string_key,
    valid_key,
)
from .lease import Watchdog
from .lifespan import run_lifespan
from .openapi import document_openapi
from .record import Record, RecordError, decode, fingerprint
from .sealing import Sealer
from .store import CLAIMED, Store

__all__ = ["Counters", "IdempotencyMiddleware", "RoutePolicy", "idempotent"]

logger = logging.getLogger("goblin_idem.middleware")

# What a store that is down or misbehaving raises, logged as one line; anything else out of
# a store call is logged with its traceback. Every one of them is answered as an outage.
LOGGED_WITHOUT_TRACEBACK = (RedisError, OSError, asyncio.TimeoutError)
_serving: weakref.WeakKeyDictionary[Any, IdempotencyMiddleware] = weakref.WeakKeyDictionary()
REPLAYED = (b"idempotent-replayed", b"true")


class IdempotencyMiddleware:
    """Makes POST/PATCH endpoints safe to retry with an ``Idempotency-Key`` header.

    - no key: passed through (400 problem on a required route); a malformed key: 400.
    - first request with a key: claims it, runs the app once while a watchdog renews the
      claim's lease, publishes status, headers and body, then finishes the response.
    - a duplicate of a completed request: the same response, byte for byte, plus
      ``Idempotent-Replayed: true``; with another method, path, query or body: 422.
    - a duplicate while the first is running: 409 with ``Retry-After``.
    - the app raised, answered 5xx or never finished its response: the claim is released
      so that a retry runs the work; nothing is stored.
    - the store is unreachable: 503 and the app is not run (``fail_open=True`` runs it
      unprotected instead).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: Store | None = None,
        header: str = "Idempotency-Key",
        methods: Iterable[str] = ("POST", "PATCH"),
        required: bool = False,
        lease_seconds: int = 30,
        ttl_seconds: int = 86_400,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        required_paths: Sequence[str] = (),
        key_pattern: re.Pattern[bytes] | Callable[[bytes], bool] = DEFAULT_KEY_PATTERN,
        scope: Callable[[Scope], bytes | str] | None = None,
        fingerprint_headers: Iterable[str] = (),
        max_body_bytes: int = 1024 * 1024,
        max_response_bytes: int = 1024 * 1024,
        retry_after_seconds: int = 1,
        wait_ms: int = 0,
        poll_interval_ms: int = 50,
        store_server_errors: bool = False,
        fail_open: bool = False,
        namespace: str = "idem",
        on_event: Callable[[str, str], None] | None = None,
        check_store: bool = True,
        close_store: bool = True,
        otel: bool = False,
        encryption_keys: Sequence[bytes] | Sealer | None = None,
        compression: str | None = "zlib",
        compress_above_bytes: int = 1024,
        previous_key_names: bool = False,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI application, not a {type(app).__name__}")
        self.app = app
        self.store: Store = options.store(store)
        self._key_options(header, methods, key_pattern, scope, fingerprint_headers)
        self.routes = Routes.from_options(
            required=required,
            ttl_seconds=ttl_seconds,
            lease_seconds=lease_seconds,
            include=include,
            exclude=exclude,
            required_paths=required_paths,
        )
        self._answer_options(max_body_bytes, retry_after_seconds, wait_ms, poll_interval_ms)
        self.fail_open = options.flag("fail_open", fail_open)
        self.namespace = options.namespace(namespace)
        self.previous_key_names = options.flag("previous_key_names", previous_key_names)
        self.check_store = options.flag("check_store", check_store)
        self.close_store = options.flag("close_store", close_store)
        self.counters = Counters()
        self.events = Events(
            self.counters,
            options.callable_or_none(
                "on_event",
                on_event,
                "a function (event, key_hash) called on every counter increment",
            ),
        )
        self.watchdog = Watchdog.for_store(self.store)
        self._app: Any = None  # the application whose scopes this middleware serves
        self._shared_scope_warned = False  # logged that callers share the empty scope
        if options.flag("otel", otel):
            from .otel import instrument  # imported only when asked for

            instrument(self)  # times self.store's calls, adds to on_event: before the runs'
        self.runs = RunConfig.from_options(
            app,
            self.store,
            self.watchdog,
            self.events,
            encryption_keys=encryption_keys,
            compression=compression,
            compress_above_bytes=compress_above_bytes,
            max_response_bytes=max_response_bytes,
            store_server_errors=store_server_errors,
            fingerprint_headers=self.fingerprint_headers,
        )
        self.sealer = self.runs.sealer

    def _key_options(
        self,
        header: str,
        methods: Iterable[str],
        key_pattern: object,
        scope: object,
        fingerprint_headers: Iterable[str],
    ) -> None:
        """Which requests carry a key, and what a key is: checked, and kept precomputed."""
        self.header_name = options.http_tokens("header", [header], "header name")[0]
        self.header = header.lower().encode("latin-1")
        self.methods = frozenset(
            m.upper() for m in options.http_tokens("methods", methods, "method", allow_empty=False)
        )
        self.key_pattern = options.key_pattern(key_pattern)
        self.scope_of = options.callable_or_none(
            "scope", scope, "a function of the ASGI scope returning the caller's identity"
        )
        self.fingerprint_headers = tuple(
            h.lower().encode("latin-1")
            for h in options.http_tokens("fingerprint_headers", fingerprint_headers, "header name")
        )

    def _answer_options(
        self, max_body_bytes: int, retry_after_seconds: int, wait_ms: int, poll_interval_ms: int
    ) -> None:
        """The limits and delays of the middleware's own answers: checked, precomputed."""
        self.max_body_bytes = options.whole_number("max_body_bytes", max_body_bytes, minimum=1)
        self.retry_after = str(
            options.whole_number("retry_after_seconds", retry_after_seconds, minimum=0)
        ).encode()
        self.wait_ms = options.whole_number("wait_ms", wait_ms, minimum=0)
        poll_interval_ms = options.whole_number("poll_interval_ms", poll_interval_ms, minimum=0)
        if wait_ms and not poll_interval_ms:
            raise ValueError(
                "poll_interval_ms must be >= 1 when wait_ms > 0: it is the pause between two "
                "claim polls, and 0 would poll the store in a busy loop (50 is the default)"
            )
        self.poll_interval = poll_interval_ms / 1000

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
        document_openapi(app, self)

    # -- the request --

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("app") is not self._app:
            self._adopt(scope.get("app"))
        if scope["type"] != "http" or scope["method"] not in self.methods:
            if scope["type"] == "lifespan":
                await run_lifespan(self, scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        key = None
        keys = 0
        content_length = None
        for name, value in scope["headers"]:
            if name == self.header:
                key = value
                keys += 1
            elif name == b"content-length":
                content_length = value
        if key is None and not _routes.marked_endpoints and not self.routes.may_require:
            await self.app(scope, receive, send)  # the common case: nothing to do, fast
            return
        settings = self.routes.settings(scope)
        if settings is None:
            await self.app(scope, receive, send)
        elif key is not None:
            await self._with_key(scope, receive, send, settings, key, keys, content_length)
        elif settings.required:
            self.events("missing_key")
            await problems.send_problem(
                send,
                problems.MISSING_KEY,
                f"{self.header_name} is required for {scope['method']} {scope['path']}.",
            )
        else:
            await self.app(scope, receive, send)

    async def _with_key(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        settings: Settings,
        key: bytes | None,
        keys: int,
        content_length: bytes | None,
    ) -> None:
        """A covered request with a key: the key checked, the body read, the key claimed;
        then the one run, or an answer from the claim step's reply."""
        if key is not None and key[:1] == b'"':
            key = string_key(key)  # the IETF draft's form, an RFC 8941 String
        if keys > 1 or key is None or not valid_key(key, self.key_pattern):
            await self._refuse_key(send, malformed=keys == 1 and key is None)
            return
        body = await self._read_body(receive, send, content_length)
        if body is None:
            return
        names = key_names(self.namespace, self._scope_bytes(scope), key)
        fp = fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            body,
            self._fingerprint_header_values(scope) if self.fingerprint_headers else (),
        )
        token = new_token()
        claim = self.store.claim_unless_done
        try:
            reply = await claim(names.claim, names.result, token, settings.lease_seconds)
            if reply is None and self.wait_ms > 0:
                step = functools.partial(
                    claim, names.claim, names.result, token, settings.lease_seconds
                )
                reply = await poll_claim(step, self.wait_ms / 1000, self.poll_interval)
        except Exception as exc:
            # Anything out of the store step, even a client library's own bug, means the
            # claim is in doubt: answer as for a store that is down, never run unprotected
            # by accident (fail_open decides).
            if not isinstance(exc, LOGGED_WITHOUT_TRACEBACK):
                logger.exception("unexpected error from the store for key %s", names.hash)
            await self._store_failed(exc, scope, _replay_receive(body, receive), send, names)
            return
        if reply is CLAIMED:
            if self.previous_key_names and await self._answered_from_previous(
                scope, _replay_receive(body, receive), send, names, token, fp
            ):
                return
            self.events("claimed", names.hash)
            run = Run(self.runs, send, names, token, fp, settings)
            await run(scope, _replay_receive(body, receive))
        elif reply is None:
            await self._in_flight(send, names)
        else:
            await self._answer_stored(reply, fp, send, names)

    async def _refuse_key(self, send: Send, *, malformed: bool) -> None:
        self.events("invalid_key")
        if malformed:
            detail = (
                f"A quoted {self.header_name} must be an RFC 8941 String: printable ASCII "
                'between double quotes, with \\" and \\\\ as the only escapes.'
            )
        else:
            detail = f"Send exactly one {self.header_name} header, " + (
                "of 1 to 255 printable ASCII characters."
                if self.key_pattern is DEFAULT_KEY_PATTERN
                else "in the form this service accepts."
            )
        await problems.send_problem(send, problems.INVALID_KEY, detail)

    def _scope_bytes(self, scope: Scope) -> bytes:
        if self.scope_of is None:
            value = credentials_scope(scope["headers"])
            if not value and not self._shared_scope_warned:
                credential = credential_header(scope["headers"])
                if credential is not None:
                    self._warn_shared_scope(credential)
            return value
        value = self.scope_of(scope)
        return value.encode() if isinstance(value, str) else value

    def _warn_shared_scope(self, name: bytes) -> None:
        """Once per middleware: a keyed request with no Authorization header but a header
        that carries a credential shares the empty default scope with every such caller."""
        self._shared_scope_warned = True
        logger.warning(
            "a request with an %s carries no Authorization header but a %s header: with "
            "the default scope (the Authorization header) every such caller shares one key "
            "space, so a caller who sends another's key gets the other's stored response, "
            "Set-Cookie included; pass scope= a function that returns the caller's "
            "identity (goblin_idem.header_scope or cookie_scope; README: Choosing a scope). "
            "Logged once.",
            self.header_name,
            name.decode("latin-1"),
        )

    def _fingerprint_header_values(self, scope: Scope) -> list[bytes]:
        found = dict.fromkeys(self.fingerprint_headers, b"")
        for name, value in scope["headers"]:
            if name in found:
                found[name] = value
        return list(found.values())

    async def _read_body(
        self, receive: Receive, send: Send, content_length: bytes | None
    ) -> bytes | None:
        """The whole request body, or None once answered (413) or the client left."""
        if content_length is not None and content_length.isdigit():
            if int(content_length) > self.max_body_bytes:
                await self._too_large(send)
                return None
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None  # nothing was claimed; nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        self.events("too_large")
        await problems.send_problem(
            send,
            problems.BODY_TOO_LARGE,
            f"An idempotent request body may be at most {self.max_body_bytes} bytes.",
        )

    async def _store_failed(
        self, exc: BaseException, scope: Scope, receive: Receive, send: Send, names: KeyNames
    ) -> None:
        self.events("store_errors", names.hash)
        if self.fail_open:
            log_store_error(
                self.store,
                logging.WARNING,
                exc,
                "store error for key %s, running unprotected",
                names.hash,
            )
            self.events("unprotected", names.hash)
            await self.app(scope, receive, send)
            return
        log_store_error(
            self.store, logging.ERROR, exc, "store error for key %s, answering 503", names.hash
        )
        await problems.send_problem(
            send,
            problems.STORE_UNAVAILABLE,
            "The request was not run. Retry it with the same key.",
            [(b"retry-after", self.retry_after)],
        )

    async def _in_flight(self, send: Send, names: KeyNames) -> None:
        self.events("in_flight", names.hash)
        await problems.send_problem(
            send,
            problems.IN_FLIGHT,
            "A request with this key is in progress; retry after the Retry-After delay.",
            [(b"retry-after", self.retry_after)],
        )

    async def _answer_stored(self, data: bytes, fp: bytes, send: Send, names: KeyNames) -> None:
        try:
            record = decode(data, sealer=self.sealer, name=names.result)
        except RecordError as exc:
            await self._unreadable(exc, send, names)
            return
        await self._answer_duplicate(record, fp, send, names)

    async def _answered_from_previous(
        self, scope: Scope, receive: Receive, send: Send, names: KeyNames, token: bytes, fp: bytes
    ) -> bool:
        """`previous_key_names`: the key just claimed under this release's names may have
        been used under 0.1.0's (README: Upgrading from 0.1.0). A result stored there is
        the answer, and is copied under the new names for its remaining TTL, so that later
        duplicates are answered by the claim step alone; a claim held there (a 0.1.0
        process running the work) is answered 409, and the new claim freed. Up to three
        reads, on first runs only. Not atomic with the claim: a 0.1.0 process that claims
        the old names after these reads runs the work a second time."""
        old = previous_names(self.namespace, names.hash)
        try:
            data = await self.store.get(old.result)
            ttl = await self.store.pttl(old.result) if data is not None else -2
            held = data is None and await self.store.get(old.claim) is not None
        except Exception as exc:
            await free_claim(self.store, names, token)
            await self._store_failed(exc, scope, receive, send, names)
            return True
        if data is None and not held:
            return False
        if data is None:
            await free_claim(self.store, names, token)
            await self._in_flight(send, names)
            return True
        try:
            if (
                ttl <= 0
                or await self.store.publish(names.result, data, ttl, names.claim, token) != 1
            ):
                await free_claim(self.store, names, token)
        except Exception as exc:  # the answer stands; a later duplicate reads the old names
            logger.warning(
                "key %s: could not copy the result stored under 0.1.0's names: %s",
                names.hash,
                describe(exc),
            )
            await free_claim(self.store, names, token)
        await self._answer_stored(data, fp, send, names)
        return True

    async def _unreadable(self, exc: RecordError, send: Send, names: KeyNames) -> None:
        """A stored record this process cannot read: a newer release's format, a sealed
        record no configured key opens, or damaged bytes. The work it records happened, so
        it is never run again (whatever fail_open says); the key stays answered 503 until
        a process that reads it answers, or the result expires."""
        self.events("unreadable", names.hash)
        logger.error(
            "key %s: the stored response cannot be read, answering 503: %s", names.hash, exc
        )
        await problems.send_problem(
            send,
            problems.RECORD_UNREADABLE,
            "The request with this key was run, but its stored response cannot be read here. "
            "It is not run again; retry later with the same key.",
            [(b"retry-after", self.retry_after)],
        )

    async def _answer_duplicate(
        self, record: Record, fp: bytes, send: Send, names: KeyNames
    ) -> None:
        if record.fingerprint != fp:
            self.events("mismatch", names.hash)
            await problems.send_problem(
                send,
                problems.KEY_REUSED,
                "The key was first used with another method, path, query or body. "
                "Use a new key for a new request.",
            )
            return
        if not record.replayable:
            self.events("not_replayable", names.hash)
            await problems.send_problem(
                send,
                problems.NOT_REPLAYABLE,
                f"The first request completed with status {record.status}. "
                "Do not retry it with this key.",
            )
            return
        self.events("replayed", names.hash)
        await _send_record(send, record)


async def _send_record(send: Send, record: Record) -> None:
    """The stored response, as the app sent it: with trailers if it declared them (the
    server then frames and delivers them as it did the first time)."""
    start = {
        "type": "http.response.start",
        "status": record.status,
        "headers": [*record.headers, REPLAYED],
    }
    if record.trailers is not None:
        start["trailers"] = True
    await send(start)
    await send({"type": "http.response.body", "body": record.body, "more_body": False})
    if record.trailers is not None:
        await send(
            {"type": "http.response.trailers", "headers": record.trailers, "more_trailers": False}
        )


def _replay_receive(body: bytes, receive: Receive) -> Receive:
    """The request body, already read, as one message; then the client's own receive (so
    an app waiting for http.disconnect still sees it)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
