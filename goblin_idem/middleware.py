"""IdempotencyMiddleware: exactly-once POST/PATCH with byte-exact replay.

One request, in store round trips: a request with a key costs one claim step (GOBLIN.CLAIM
and a PTTL of the result, pipelined: a stored result wins over a claim that was lost); the
one that wins it runs the app and publishes the response in one more (result + claim TTL in
a MULTI/EXEC) before the last body chunk reaches the client; every duplicate is answered
from the claim step's reply alone. A request without a key costs nothing.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar, overload

from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import options, problems
from .claim import Claim, current, new_token, poll_claim
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
from .lease import Lease, Watchdog
from .lifespan import run_lifespan
from .openapi import document_openapi
from .record import Record, RecordError, decode, encode, fingerprint
from .sealing import Sealer
from .store import CLAIMED, Store

__all__ = ["Counters", "IdempotencyMiddleware", "RoutePolicy", "idempotent"]

logger = logging.getLogger("goblin_idem.middleware")

F = TypeVar("F", bound=Callable[..., Any])

# What a store that is down or misbehaving raises; all of it ends in 503 (fail closed).
STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
# Errors that no retry fixes, only a change of configuration: logged once per store.
CONFIGURATION_ERRORS = (NoPermissionError, AuthenticationError)
_misconfigured: weakref.WeakSet[Any] = weakref.WeakSet()  # stores whose error was logged
_serving: weakref.WeakKeyDictionary[Any, IdempotencyMiddleware] = weakref.WeakKeyDictionary()
# Publishing is retried after these pauses: long enough to ride out a failover's promotion
# or a reconnect, short enough that the held-back last chunk is not held for long.
PUBLISH_RETRY_DELAYS = (0.05, 0.25)


def _describe(exc: BaseException) -> str:
    """`TypeName: message` (redis-py's own repr of its errors drops the message)."""
    return f"{type(exc).__name__}: {exc}"


# Never stored or replayed: they describe one connection, not the response.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
HOP_BY_HOP_BUT_TRAILER = HOP_BY_HOP - {b"trailer"}
REPLAYED = (b"idempotent-replayed", b"true")
_POLICY_ATTR = "__goblin_idem__"


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Per-route settings; None means "as the middleware is configured"."""

    enabled: bool = True
    required: bool | None = None
    ttl_seconds: int | None = None
    lease_seconds: int | None = None

    def __post_init__(self) -> None:
        options.flag("@idempotent(enabled=...)", self.enabled)
        if self.required is not None:
            options.flag("@idempotent(required=...)", self.required)
        for name in ("ttl_seconds", "lease_seconds"):
            value = getattr(self, name)
            if value is not None:
                options.whole_number(f"@idempotent({name}=...)", value, minimum=1)


# How many endpoints @idempotent has marked in this process. While none has, no request
# needs its route looked up, so a request without a key passes with a header scan only;
# counted at decoration, so a route added after the first request is seen as well.
_marked_endpoints = 0


@overload
def idempotent(func: F, /) -> F: ...


@overload
def idempotent(
    *,
    enabled: bool = True,
    required: bool | None = None,
    ttl_seconds: int | None = None,
    lease_seconds: int | None = None,
) -> Callable[[F], F]: ...


def idempotent(
    func: F | None = None,
    /,
    *,
    enabled: bool = True,
    required: bool | None = None,
    ttl_seconds: int | None = None,
    lease_seconds: int | None = None,
) -> F | Callable[[F], F]:
    """Mark a Starlette/FastAPI endpoint with its own idempotency settings.

    Put it under the route decorator (``@app.post(...)`` then ``@idempotent(required=True)``).
    The middleware finds the route the request will reach and applies its policy;
    ``enabled=False`` exempts the route.
    """
    if func is not None and not callable(func):
        raise TypeError(
            "idempotent takes keyword arguments only, as in @idempotent(required=True); "
            f"got a {type(func).__name__} as its first argument"
        )
    policy = RoutePolicy(enabled, required, ttl_seconds, lease_seconds)

    def mark(f: F) -> F:
        global _marked_endpoints
        setattr(f, _POLICY_ATTR, policy)
        _marked_endpoints += 1
        return f

    return mark(func) if func is not None else mark


@dataclass
class Counters:
    """What the middleware did, since start. `on_event` sees each increment as it happens."""

    claimed: int = 0
    replayed: int = 0
    in_flight: int = 0
    mismatch: int = 0
    released: int = 0
    lease_lost: int = 0
    store_errors: int = 0
    too_large: int = 0
    invalid_key: int = 0
    missing_key: int = 0
    not_replayable: int = 0
    publish_errors: int = 0
    unprotected: int = 0
    unreadable: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Settings:
    required: bool
    ttl_ms: int
    lease_seconds: int


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
        self.header_name = options.http_tokens("header", [header], "header name")[0]
        self.header = header.lower().encode("latin-1")
        self.methods = frozenset(
            m.upper() for m in options.http_tokens("methods", methods, "method", allow_empty=False)
        )
        lease_seconds = options.whole_number("lease_seconds", lease_seconds, minimum=1)
        ttl_seconds = options.whole_number("ttl_seconds", ttl_seconds, minimum=1)
        self.defaults = _Settings(
            options.flag("required", required), ttl_seconds * 1000, lease_seconds
        )
        self.include = options.patterns("include", include) if include is not None else None
        self.exclude = options.patterns("exclude", exclude)
        self.required_paths = options.patterns("required_paths", required_paths)
        self.key_pattern = options.key_pattern(key_pattern)
        self.scope_of = options.callable_or_none(
            "scope", scope, "a function of the ASGI scope returning the caller's identity"
        )
        self.fingerprint_headers = tuple(
            h.lower().encode("latin-1")
            for h in options.http_tokens("fingerprint_headers", fingerprint_headers, "header name")
        )
        self.max_body_bytes = options.whole_number("max_body_bytes", max_body_bytes, minimum=1)
        self.max_response_bytes = options.whole_number(
            "max_response_bytes", max_response_bytes, minimum=0
        )
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
        self.store_server_errors = options.flag("store_server_errors", store_server_errors)
        self.fail_open = options.flag("fail_open", fail_open)
        self.namespace = options.namespace(namespace)
        self.on_event = options.callable_or_none(
            "on_event", on_event, "a function (event, key_hash) called on every counter increment"
        )
        self.sealer = options.sealer(encryption_keys)
        self.codec = options.codec(compression)
        self.compress_above = options.whole_number(
            "compress_above_bytes", compress_above_bytes, minimum=0
        )
        self.previous_key_names = options.flag("previous_key_names", previous_key_names)
        self.counters = Counters()
        self.watchdog = Watchdog.for_store(self.store)
        self._background: set[asyncio.Task[Any]] = set()
        self._path_settings = functools.lru_cache(maxsize=4096)(self._settings_for_path)
        self._hidden_warned = False  # logged that a route hides its endpoint
        self._shared_scope_warned = False  # logged that callers share the empty scope
        self._vary_warned = False  # logged that a stored response varies per client
        # Can a request without a key be refused (400) by the options? Route marks are
        # looked up for each request while any endpoint is marked (_marked_endpoints).
        self._may_require = required or bool(self.required_paths)
        self.check_store = options.flag("check_store", check_store)
        self.close_store = options.flag("close_store", close_store)
        self._app: Any = None  # the application whose scopes this middleware serves
        if options.flag("otel", otel):
            from .otel import instrument  # imported only when asked for

            instrument(self)

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

    # -- bookkeeping --

    def _count(self, event: str, key_hash: str = "") -> None:
        setattr(self.counters, event, getattr(self.counters, event) + 1)
        if self.on_event is not None:
            try:
                self.on_event(event, key_hash)
            except Exception:  # a metrics hook must never fail a request
                logger.exception("on_event hook failed")

    def _log_store_error(self, level: int, exc: BaseException, message: str, key: str) -> None:
        """`message` and the error, each time; a configuration error (a permission the
        store's user lacks, a wrong password) only once per store, since every request
        would repeat it until the configuration changes, and its text names the fix."""
        if isinstance(exc, CONFIGURATION_ERRORS):
            if self.store in _misconfigured:
                logger.debug("%s: %s", message % key, _describe(exc))
                return
            _misconfigured.add(self.store)
            message += " (a configuration error, logged once for this store)"
        logger.log(level, "%s: %s", message % key, _describe(exc))

    # -- which requests are covered, and how --

    def _settings_for_path(self, path: str) -> _Settings | None:
        def any_match(patterns: Sequence[str]) -> bool:
            return any(fnmatch.fnmatchcase(path, p) for p in patterns)

        if self.include is not None and not any_match(self.include):
            return None
        if any_match(self.exclude):
            return None
        if any_match(self.required_paths):
            return replace(self.defaults, required=True)
        return self.defaults

    def _settings(self, scope: Scope) -> _Settings | None:
        settings = self._path_settings(scope["path"])
        routes = getattr(scope.get("app"), "routes", None) if _marked_endpoints else None
        if not routes:
            return settings
        try:
            policy = _route_policy(routes, dict(scope))  # a copy: matching must change nothing
        except _EndpointHidden as exc:
            if not self._hidden_warned:
                self._hidden_warned = True
                logger.warning(
                    "the route %r matched a request but does not say which endpoint it "
                    "serves, so the @idempotent marks behind it are not applied (the "
                    "middleware's own options are); FastAPI 0.137.0 and 0.137.1 do this for "
                    "included routers: upgrade FastAPI",
                    exc.args[0],
                )
            return settings
        if policy is None:
            return settings
        if not policy.enabled:
            return None
        base = settings or self.defaults
        return _Settings(
            base.required if policy.required is None else policy.required,
            base.ttl_ms if policy.ttl_seconds is None else policy.ttl_seconds * 1000,
            base.lease_seconds if policy.lease_seconds is None else policy.lease_seconds,
        )

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
        if key is None and not _marked_endpoints and not self._may_require:
            await self.app(scope, receive, send)  # the common case: nothing to do, fast
            return
        settings = self._settings(scope)
        if settings is None:
            await self.app(scope, receive, send)
            return
        if key is None:
            if settings.required:
                self._count("missing_key")
                await problems.send_problem(
                    send,
                    problems.MISSING_KEY,
                    f"{self.header_name} is required for {scope['method']} {scope['path']}.",
                )
                return
            await self.app(scope, receive, send)
            return
        if key[:1] == b'"':
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
            if not isinstance(exc, STORE_ERRORS):
                logger.exception("unexpected error from the store for key %s", names.hash)
            await self._store_failed(exc, scope, _replay_receive(body, receive), send, names)
            return

        if reply is CLAIMED:
            if self.previous_key_names and await self._answered_from_previous(
                scope, _replay_receive(body, receive), send, names, token, fp
            ):
                return
            self._count("claimed", names.hash)
            await self._run(scope, receive, send, body, names, token, fp, settings)
        elif reply is None:
            await self._in_flight(send, names)
        else:
            await self._answer_stored(reply, fp, send, names)

    async def _refuse_key(self, send: Send, *, malformed: bool) -> None:
        self._count("invalid_key")
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

    def _warn_vary(self, headers: list[tuple[bytes, bytes]], names: KeyNames) -> None:
        """Once per middleware: the stored response varies by request headers that the key
        does not cover, so every duplicate gets this variant (a middleware that adapts the
        response to each client, such as GZip or CORS, wraps this one)."""
        varies = [value for name, value in headers if name == b"vary"]
        if not varies:
            return
        fields = {
            field.strip().lower().decode("latin-1")
            for value in varies
            for field in value.split(b",")
        }
        fields -= {h.decode("latin-1") for h in self.fingerprint_headers}
        fields.discard("")
        if not fields:
            return
        self._vary_warned = True
        logger.warning(
            "the response stored for key %s varies by %s (its Vary header) but the key "
            "does not: every duplicate gets this variant, whatever its own %s. If a "
            "middleware such as GZipMiddleware or CORSMiddleware added it, it wraps the "
            "idempotency middleware: add IdempotencyMiddleware before it (README: Middleware "
            "order). Logged once.",
            names.hash,
            ", ".join(sorted(fields)),
            " or ".join(sorted(fields)),
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
        self._count("too_large")
        await problems.send_problem(
            send,
            problems.BODY_TOO_LARGE,
            f"An idempotent request body may be at most {self.max_body_bytes} bytes.",
        )

    async def _store_failed(
        self, exc: BaseException, scope: Scope, receive: Receive, send: Send, names: KeyNames
    ) -> None:
        self._count("store_errors", names.hash)
        if self.fail_open:
            self._log_store_error(
                logging.WARNING, exc, "store error for key %s, running unprotected", names.hash
            )
            self._count("unprotected", names.hash)
            await self.app(scope, receive, send)
            return
        self._log_store_error(
            logging.ERROR, exc, "store error for key %s, answering 503", names.hash
        )
        await problems.send_problem(
            send,
            problems.STORE_UNAVAILABLE,
            "The request was not run. Retry it with the same key.",
            [(b"retry-after", self.retry_after)],
        )

    async def _in_flight(self, send: Send, names: KeyNames) -> None:
        self._count("in_flight", names.hash)
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
            await self._free(names, token)
            await self._store_failed(exc, scope, receive, send, names)
            return True
        if data is None and not held:
            return False
        if data is None:
            await self._free(names, token)
            await self._in_flight(send, names)
            return True
        try:
            if (
                ttl <= 0
                or await self.store.publish(names.result, data, ttl, names.claim, token) != 1
            ):
                await self._free(names, token)
        except Exception as exc:  # the answer stands; a later duplicate reads the old names
            logger.warning(
                "key %s: could not copy the result stored under 0.1.0's names: %s",
                names.hash,
                _describe(exc),
            )
            await self._free(names, token)
        await self._answer_stored(data, fp, send, names)
        return True

    async def _free(self, names: KeyNames, token: bytes) -> None:
        """Free the claim (its lease's TTL frees it if this fails)."""
        try:
            await self.store.cad(names.claim, token)
        except Exception as exc:
            logger.warning(
                "could not release key %s (its lease will expire): %s", names.hash, _describe(exc)
            )

    async def _unreadable(self, exc: RecordError, send: Send, names: KeyNames) -> None:
        """A stored record this process cannot read: a newer release's format, a sealed
        record no configured key opens, or damaged bytes. The work it records happened, so
        it is never run again (whatever fail_open says); the key stays answered 503 until
        a process that reads it answers, or the result expires."""
        self._count("unreadable", names.hash)
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
            self._count("mismatch", names.hash)
            await problems.send_problem(
                send,
                problems.KEY_REUSED,
                "The key was first used with another method, path, query or body. "
                "Use a new key for a new request.",
            )
            return
        if not record.replayable:
            self._count("not_replayable", names.hash)
            await problems.send_problem(
                send,
                problems.NOT_REPLAYABLE,
                f"The first request completed with status {record.status}. "
                "Do not retry it with this key.",
            )
            return
        self._count("replayed", names.hash)
        await _send_record(send, record)

    # -- the one run --

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body: bytes,
        names: KeyNames,
        token: bytes,
        fp: bytes,
        settings: _Settings,
    ) -> None:
        lease = self.watchdog.hold(
            names.claim,
            token,
            settings.lease_seconds * 1000,
            label=names.hash,
            on_lost=self._lease_lost,
        )
        responder = _Responder(self, send, lease, names, token, fp, settings)
        held = current.set(responder)  # current_claim() in the handler: responder.claim()
        try:
            await self.app(scope, _replay_receive(body, receive), responder.send)
        finally:
            current.reset(held)
            if not responder.finished:
                # Raised, cancelled, or returned without a complete response: the work
                # may not have happened, so free the key for the client's retry.
                self._count("released", names.hash)
                await self._shielded(functools.partial(self._release, lease, names, token))

    def _lease_lost(self, lease: Lease) -> None:
        self._count("lease_lost", lease.label)

    async def _shielded(self, step: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run a closing store step (publish, release) so that cancelling the request
        cannot cut it short, without a task per request.

        The step runs inline. If the request is cancelled while the step waits, the step
        starts again from the beginning in a task of its own and the cancellation goes on;
        whatever the first attempt had sent may still run, so every step is safe to repeat
        (SET and CAEXPIRE with the same value and token, CAD with the same token) and
        counts nothing that a repeat would count twice. A task per first run (to shield it)
        cost about 8 us and half the garbage collections of a Redis-backed first run.
        """
        try:
            await step()
        except asyncio.CancelledError:
            task = asyncio.ensure_future(step())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise

    async def _release(self, lease: Lease, names: KeyNames, token: bytes) -> None:
        await self.watchdog.release(lease)
        await self._free(names, token)

    async def _publish(
        self, lease: Lease, names: KeyNames, token: bytes, record: Record, ttl_ms: int
    ) -> None:
        await self.watchdog.release(lease)
        data = encode(
            record,
            sealer=self.sealer,
            name=names.result,
            codec=self.codec,
            compress_above=self.compress_above,
        )
        for delay in (*PUBLISH_RETRY_DELAYS, None):
            try:
                renewed = await self.store.publish(names.result, data, ttl_ms, names.claim, token)
            except Exception as exc:
                if delay is not None:
                    await asyncio.sleep(delay)
                    continue
                self._count("publish_errors", names.hash)
                self._log_store_error(
                    logging.ERROR,
                    exc,
                    "could not publish the response for key %s; a retry after the lease "
                    "may run the work again",
                    names.hash,
                )
                return
            if renewed != 1:
                await self._retake(lease, names, token, ttl_ms)
            return

    async def _retake(self, lease: Lease, names: KeyNames, token: bytes, ttl_ms: int) -> None:
        """The claim lapsed before the result was published (the run outlived a lease the
        watchdog could not renew, or a restart lost it). The result is stored; take the
        claim back for the result's TTL if it is free, so that duplicates are answered by
        CLAIM alone (without it, the next duplicate's claim step finds the result, replays
        it and takes the claim back). If another run holds it, a second run is under way and
        nothing can stop it. Retried as publishing is: what lost the claim (a restart) also
        breaks pooled connections; a holder is read back to say which of these happened."""
        if not lease.lost:
            lease.lost = True  # counted once, should this step be repeated
            self._count("lease_lost", names.hash)
        holder: bytes | None = None
        for delay in (*PUBLISH_RETRY_DELAYS, None):
            try:
                if await self.store.set(names.claim, token, px=ttl_ms, nx=True):
                    holder = token
                    break
                holder = await self.store.get(names.claim)  # an earlier try's, or another run's
                if holder is not None:
                    break
            except Exception as exc:
                if delay is None:
                    logger.error(
                        "key %s: the claim lapsed before the response was published and "
                        "could not be retaken (%s); the next duplicate's claim finds the "
                        "stored response, replays it and takes the claim back",
                        names.hash,
                        _describe(exc),
                    )
                    return
                await asyncio.sleep(delay)
        if holder == token:
            logger.warning(
                "key %s: the claim lapsed before the response was published; retaken for "
                "the result's TTL",
                names.hash,
            )
        elif holder is not None:
            logger.error(
                "key %s: the claim lapsed before the response was published, and another "
                "run (token %s) holds it now: the work is running a second time",
                names.hash,
                holder.decode("latin-1"),
            )
        else:
            logger.warning(
                "key %s: the claim lapsed before the response was published and was freed "
                "again each time it was retaken; the next duplicate's claim finds the stored "
                "response and replays it",
                names.hash,
            )


class _Responder:
    """Wraps `send` for the one run: passes the response through as it streams, keeps a
    copy, and holds back the message that ends the response until the response is
    published (or the claim released), so a client that saw the whole response can rely on
    its replay.

    A response ends, by the ASGI spec and its extensions, with the body message whose
    `more_body` is false, a `http.response.pathsend`, or a `http.response.zerocopysend`
    whose `more_body` is false; if its start said `trailers: True`, with the
    `http.response.trailers` message whose `more_trailers` is false instead. A file that
    pathsend or zerocopysend names is read here, up to what may still be stored, and
    sent on as a body message of the bytes read: what is stored is then what the client
    got, even if the file changes afterwards. A file too large to store goes to the server
    as it came, and the response is stored as not replayable; one that cannot be read goes
    as it came too, and the key is released, as for a response that failed. Other messages
    (`http.response.debug`, early hints) pass through and are not stored."""

    def __init__(
        self,
        mw: IdempotencyMiddleware,
        send: Send,
        lease: Lease,
        names: KeyNames,
        token: bytes,
        fp: bytes,
        settings: _Settings,
    ) -> None:
        self.mw = mw
        self._send = send
        self.lease = lease
        self.ttl_ms = settings.ttl_ms
        self.names = names
        self.token = token
        self.fp = fp
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.keep = True
        self.trailers: list[tuple[bytes, bytes]] | None = None  # None: none declared
        self.finished = False

    def claim(self) -> Claim:
        """This run's claim, for current_claim() in the handler: built when asked."""
        return Claim(self.mw.store, self.lease)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            self.keep = self.status < 500 or self.mw.store_server_errors
            if message.get("trailers", False):
                self.trailers = []
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if self.keep:
                self.size += len(chunk)
                if self.size <= self.mw.max_response_bytes:
                    self.chunks.append(chunk)
                else:
                    self.chunks.clear()
            if not message.get("more_body", False) and self.trailers is None and not self.finished:
                self.finished = True  # inline, as the hot path: no coroutine for it
                await self.mw._shielded(self._closing_step())
        else:
            message = await self._other(message)
        await self._send(message)

    async def _other(self, message: Message) -> Message:
        """The other ends of a response (trailers, pathsend, zerocopysend); any other
        message passes as it came."""
        kind = message["type"]
        if kind == "http.response.trailers":
            if self.trailers is not None:
                self.trailers += message.get("headers", ())
            if not message.get("more_trailers", False):
                await self._finish()
        elif kind == "http.response.pathsend" or kind == "http.response.zerocopysend":
            message = await self._file_as_body(message)
            if not message.get("more_body", False) and self.trailers is None:
                await self._finish()
        return message

    async def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            await self.mw._shielded(self._closing_step())

    async def _file_as_body(self, message: Message) -> Message:
        """The body message of the bytes a pathsend or zerocopysend names, or the message
        itself if they are not to be stored (see the class docstring)."""
        room = self.mw.max_response_bytes - self.size
        if not self.keep or room < 0:
            return message
        try:
            data = await asyncio.to_thread(_read_file, message, room)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning(
                "key %s: could not read the file the response sends (%s); the key is released",
                self.names.hash,
                _describe(exc),
            )
            self.keep = False
            return message
        if data is None:
            self.size = self.mw.max_response_bytes + 1  # more than may be stored
            self.chunks.clear()
            return message
        self.size += len(data)  # no more than the room left
        self.chunks.append(data)
        return {
            "type": "http.response.body",
            "body": data,
            "more_body": message.get("more_body", False),
        }

    def _closing_step(self) -> Callable[[], Coroutine[Any, Any, None]]:
        """Publish the response, or release the key (a 5xx not stored); counted here, once."""
        mw, names = self.mw, self.names
        if not self.keep:
            mw._count("released", names.hash)
            return functools.partial(mw._release, self.lease, names, self.token)
        if self.size > mw.max_response_bytes:
            mw._count("too_large", names.hash)
            record = Record(self.status, [], b"", self.fp, replayable=False)
        else:
            body = b"".join(self.chunks)
            headers = _replay_headers(self.status, self.headers, body, self.trailers is not None)
            if not mw._vary_warned:
                mw._warn_vary(headers, names)
            record = Record(self.status, headers, body, self.fp, trailers=self.trailers)
        return functools.partial(mw._publish, self.lease, names, self.token, record, self.ttl_ms)


def _replay_headers(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes, trailers: bool
) -> list[tuple[bytes, bytes]]:
    """The headers to replay: in order, repeated ones kept, hop-by-hop ones dropped, and a
    Content-Length that matches the body (a streamed response had none). A response with
    trailers keeps its Trailer header and gets no Content-Length: the server must frame
    the replay as it framed the original (HTTP/1.1 sends trailers only after a chunked
    body)."""
    if trailers:
        return [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP_BUT_TRAILER]
    kept = [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP]
    if status >= 200 and status not in (204, 304) and all(n != b"content-length" for n, _ in kept):
        kept.append((b"content-length", str(len(body)).encode()))
    return kept


def _read_file(message: Message, limit: int) -> bytes | None:
    """The bytes a pathsend (`path`) or zerocopysend (`file`, `offset`, `count`) message
    sends, or None if there are more than `limit`. A zerocopysend without `offset` reads
    from the file's position and moves it past what it read, as sendfile would."""
    if message["type"] == "http.response.pathsend":
        with open(message["path"], "rb") as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    file = message["file"]
    fd = file if isinstance(file, int) else file.fileno()
    offset = message.get("offset")
    start = os.lseek(fd, 0, os.SEEK_CUR) if offset is None else offset
    end = os.fstat(fd).st_size
    count = message.get("count")
    if count is not None:
        end = min(end, start + count)
    if end - start > limit:
        return None
    data = os.pread(fd, max(end - start, 0), start)
    if offset is None:
        os.lseek(fd, start + len(data), os.SEEK_SET)
    return data


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


class _EndpointHidden(Exception):
    """A route matched but named no endpoint, and no public way lists what it routes to."""


def _route_policy(
    routes: Iterable[Any], scope: Scope, listed_from: Any = None
) -> RoutePolicy | None:
    """The policy of the endpoint the router will pick for this request, found the way the
    router finds it: each route's `matches(scope)`, in order, and the endpoint that the
    first full match's child scope names. A Mount (or Host) names the mounted app, whose
    routes are asked in turn with the child scope merged in, as the router hands it on.
    An included router of FastAPI >= 0.137 matches for its routes but keeps their child
    scope to itself; FastAPI's public `iter_route_contexts` lists those routes with the
    include prefixes applied, each answering `matches` the same way."""
    for route in routes:
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        if "endpoint" not in child:
            if listed_from is not None:  # its listing names no endpoint either
                raise _EndpointHidden(type(listed_from).__name__)
            return _route_policy(_included_routes(route), scope, route)
        endpoint = child["endpoint"]
        policy: RoutePolicy | None = getattr(endpoint, _POLICY_ATTR, None)
        if policy is not None:
            return policy
        inner = getattr(endpoint, "routes", None)
        return _route_policy(inner, {**scope, **child}) if inner else None
    return None


def _included_routes(route: Any) -> Iterable[Any]:
    # A route object of FastAPI's is there only if FastAPI is imported: no import here.
    expand = getattr(sys.modules.get("fastapi.routing"), "iter_route_contexts", None)
    if expand is None:
        raise _EndpointHidden(type(route).__name__)
    contexts: Iterable[Any] = expand([route])
    return contexts
