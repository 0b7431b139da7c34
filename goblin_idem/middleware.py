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
import itertools
import logging
import os
import re
import secrets
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar, overload

from redis.exceptions import AuthenticationError, NoPermissionError, RedisError
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import problems
from .keys import DEFAULT_KEY_PATTERN, KeyNames, credentials_scope, key_names, valid_key
from .lease import Lease, Watchdog
from .memory import MemoryStore
from .record import Record, RecordError, decode, encode, fingerprint
from .store import CLAIMED, Store

__all__ = ["Counters", "IdempotencyMiddleware", "RoutePolicy", "idempotent"]

logger = logging.getLogger("goblin_idem.middleware")

F = TypeVar("F", bound=Callable[..., Any])

# What a store that is down or misbehaving raises; all of it ends in 503 (fail closed).
STORE_ERRORS = (RedisError, OSError, asyncio.TimeoutError, RecordError)
# Errors that no retry fixes, only a change of configuration: logged once per store.
CONFIGURATION_ERRORS = (NoPermissionError, AuthenticationError)
_misconfigured: weakref.WeakSet[Any] = weakref.WeakSet()  # stores whose error was logged
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
REPLAYED = (b"idempotent-replayed", b"true")
_POLICY_ATTR = "__goblin_idem__"


class _ClaimTokens:
    """Claim tokens ``<pid>:<16 hex digits>``, a different one for every claim of the
    process: a random 64-bit start plus a counter, instead of reading the system's
    randomness on every request. A forked child takes its own pid and a new start."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.prefix = b"%d:" % os.getpid()
        self.start = secrets.randbits(64)
        self.count = itertools.count()

    def __call__(self) -> bytes:
        return b"%s%016x" % (self.prefix, (self.start + next(self.count)) & 0xFFFF_FFFF_FFFF_FFFF)


_claim_token = _ClaimTokens()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_claim_token.reset)


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Per-route settings; None means "as the middleware is configured"."""

    enabled: bool = True
    required: bool | None = None
    ttl_seconds: int | None = None
    lease_seconds: int | None = None


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
    policy = RoutePolicy(enabled, required, ttl_seconds, lease_seconds)

    def mark(f: F) -> F:
        setattr(f, _POLICY_ATTR, policy)
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
    ) -> None:
        if lease_seconds <= 0 or ttl_seconds <= 0:
            raise ValueError("lease_seconds and ttl_seconds must be positive")
        self.app = app
        self.store: Store = store if store is not None else MemoryStore()
        self.header_name = header
        self.header = header.lower().encode("latin-1")
        self.methods = frozenset(m.upper() for m in methods)
        self.defaults = _Settings(required, ttl_seconds * 1000, lease_seconds)
        self.include = tuple(include) if include is not None else None
        self.exclude = tuple(exclude)
        self.required_paths = tuple(required_paths)
        self.key_pattern = key_pattern
        self.scope_of = scope
        self.fingerprint_headers = tuple(h.lower().encode("latin-1") for h in fingerprint_headers)
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = max_response_bytes
        self.retry_after = str(retry_after_seconds).encode()
        self.wait_ms = wait_ms
        self.poll_interval = poll_interval_ms / 1000
        self.store_server_errors = store_server_errors
        self.fail_open = fail_open
        self.namespace = namespace.encode()
        self.on_event = on_event
        self.counters = Counters()
        self.watchdog = Watchdog.for_store(self.store)
        self._background: set[asyncio.Task[Any]] = set()
        self._path_settings = functools.lru_cache(maxsize=4096)(self._settings_for_path)
        self._has_marked: bool | None = None  # does any route's endpoint carry a RoutePolicy?
        # Can a request without a key be refused (400) by the options? Routes' policies
        # are looked at on the first request.
        self._may_require = required or bool(self.required_paths)

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
        routes = getattr(scope.get("app"), "routes", None)
        if self._has_marked is None:
            self._has_marked = _any_marked(routes or ())
        if not self._has_marked or not routes:
            return settings
        policy = _route_policy(routes, scope)
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
        if scope["type"] != "http" or scope["method"] not in self.methods:
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
        if key is None and self._has_marked is False and not self._may_require:
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
        if keys > 1 or not valid_key(key, self.key_pattern):
            self._count("invalid_key")
            await problems.send_problem(
                send,
                problems.INVALID_KEY,
                f"Send exactly one {self.header_name} header, "
                + (
                    "of 1 to 255 printable ASCII characters."
                    if self.key_pattern is DEFAULT_KEY_PATTERN
                    else "in the form this service accepts."
                ),
            )
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
        token = _claim_token()
        claim = self.store.claim_unless_done
        try:
            reply = await claim(names.claim, names.result, token, settings.lease_seconds)
            if reply is None and self.wait_ms > 0:
                # Poll with the claim step itself: it replays once published, and takes the
                # work over if the first run died and its lease ran out meanwhile.
                deadline = asyncio.get_running_loop().time() + self.wait_ms / 1000
                while reply is None and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(self.poll_interval)
                    reply = await claim(names.claim, names.result, token, settings.lease_seconds)
            record = None if reply is None or reply is CLAIMED else decode(reply)
        except Exception as exc:
            # Anything out of the store step, even a client library's own bug, means the
            # claim is in doubt: answer as for a store that is down, never run unprotected
            # by accident (fail_open decides).
            if not isinstance(exc, STORE_ERRORS):
                logger.exception("unexpected error from the store for key %s", names.hash)
            await self._store_failed(exc, scope, _replay_receive(body, receive), send, names)
            return

        if reply is CLAIMED:
            self._count("claimed", names.hash)
            await self._run(scope, receive, send, body, names, token, fp, settings)
        elif record is None:
            self._count("in_flight", names.hash)
            await problems.send_problem(
                send,
                problems.IN_FLIGHT,
                "A request with this key is in progress; retry after the Retry-After delay.",
                [(b"retry-after", self.retry_after)],
            )
        else:
            await self._answer_duplicate(record, fp, send, names)

    def _scope_bytes(self, scope: Scope) -> bytes:
        if self.scope_of is None:
            return credentials_scope(scope["headers"])
        value = self.scope_of(scope)
        return value.encode() if isinstance(value, str) else value

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
        await send(
            {
                "type": "http.response.start",
                "status": record.status,
                "headers": [*record.headers, REPLAYED],
            }
        )
        await send({"type": "http.response.body", "body": record.body, "more_body": False})

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
        try:
            await self.app(scope, _replay_receive(body, receive), responder.send)
        finally:
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
        try:
            await self.store.cad(names.claim, token)
        except Exception as exc:
            logger.warning(
                "could not release key %s (its lease will expire): %s", names.hash, _describe(exc)
            )

    async def _publish(
        self, lease: Lease, names: KeyNames, token: bytes, record: Record, ttl_ms: int
    ) -> None:
        await self.watchdog.release(lease)
        data = encode(record)
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
    copy, and holds back the final body message until the response is published (or the
    claim released), so a client that saw the whole response can rely on its replay."""

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
        self.finished = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            self.keep = self.status < 500 or self.mw.store_server_errors
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if self.keep:
                self.size += len(chunk)
                if self.size <= self.mw.max_response_bytes:
                    self.chunks.append(chunk)
                else:
                    self.chunks.clear()
            if not message.get("more_body", False) and not self.finished:
                self.finished = True
                await self.mw._shielded(self._closing_step())
        await self._send(message)

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
            headers = _replay_headers(self.status, self.headers, body)
            record = Record(self.status, headers, body, self.fp)
        return functools.partial(mw._publish, self.lease, names, self.token, record, self.ttl_ms)


def _replay_headers(
    status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> list[tuple[bytes, bytes]]:
    """The headers to replay: in order, repeated ones kept, hop-by-hop ones dropped, and a
    Content-Length that matches the body (a streamed response had none)."""
    kept = [(n.lower(), v) for n, v in headers if n.lower() not in HOP_BY_HOP]
    if status >= 200 and status not in (204, 304) and all(n != b"content-length" for n, _ in kept):
        kept.append((b"content-length", str(len(body)).encode()))
    return kept


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


def _any_marked(routes: Iterable[Any]) -> bool:
    return any(
        hasattr(getattr(route, "endpoint", None), _POLICY_ATTR)
        or _any_marked(getattr(route, "routes", None) or ())
        for route in routes
    )


def _route_policy(routes: Iterable[Any], scope: Scope) -> RoutePolicy | None:
    """The policy of the endpoint the router will pick for this request (through Mounts)."""
    for route in routes:
        match, child = route.matches(scope)
        if match is not Match.FULL:
            continue
        policy: RoutePolicy | None = getattr(getattr(route, "endpoint", None), _POLICY_ATTR, None)
        if policy is not None:
            return policy
        inner = getattr(route, "routes", None)
        return _route_policy(inner, {**scope, **child}) if inner else None
    return None
