"""One call through an idempotent transport: the retry loop, written once, without I/O.

`run_call` is a generator that yields the I/O it needs — `Send` an attempt, `Read` a small
body, `Sleep` — and receives each result (or has the step's exception thrown in). The sync
and async transports drive it with their own I/O, so both follow the very same rules.

Promises, for a request of a covered method:

- every attempt carries the same key, and the same body bytes: the body is an in-memory
  `httpx.ByteStream` (``content=``, ``json=``, ``data=`` a dict); a streaming body (an
  iterator, a file, ``files=``) cannot be sent twice, so such a call is sent once;
- only what a key makes safe is retried: a request without a key goes out once;
- a response that is not returned is drained (up to `BODY_LIMIT`) and closed, so its
  connection goes back to the pool; one that is larger is closed, dropping its connection;
- the retry budget is drawn on only for failures: a 409 for a duplicate that is still
  running is the server working, and its retries are bounded by attempts and deadline.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from .._claim import current_claim
from .._derived import secret_bytes
from .._keys import credentials_scope, key_names
from .._problems import (
    BODY_TOO_LARGE,
    IN_FLIGHT,
    INVALID_KEY,
    KEY_REUSED,
    MISSING_KEY,
    NOT_REPLAYABLE,
    TYPE_BASE,
)
from ._budget import TokenBucket
from ._policy import RetryPolicy, backoff_delay, parse_retry_after

__all__ = [
    "BODY_LIMIT",
    "NON_RETRYABLE_TYPES",
    "Call",
    "CallOptions",
    "Read",
    "RetryEvent",
    "Send",
    "Sleep",
    "Step",
    "call_options",
]

logger = logging.getLogger("goblin_idem.client")

# The largest body read to learn a problem's type, or drained to keep a connection.
BODY_LIMIT = 65536
# Problem types that say "the same request will get the same answer": never retried,
# whatever their status.
NON_RETRYABLE_TYPES = frozenset(
    p.type for p in (NOT_REPLAYABLE, KEY_REUSED, INVALID_KEY, MISSING_KEY, BODY_TOO_LARGE)
)
# Errors after which the request may or may not have been processed; with a key, the
# server answers a repeat from its record, so all of them are safe to retry. Not retried:
# LocalProtocolError (this request is malformed), UnsupportedProtocol, ProxyError.
RETRYABLE_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
REPLAYED_HEADER = "idempotent-replayed"
LABEL_EXTENSION = "idempotency_label"  # names a call of a run: its derived key's input
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field-name


@dataclass(frozen=True, slots=True)
class Send:
    """Send one attempt; the result is the transport's `httpx.Response`."""

    request: httpx.Request


@dataclass(frozen=True, slots=True)
class Read:
    """Read a response's raw body, at most `limit` bytes, and close it; the result is the
    bytes, or None when the body was longer (its connection is then dropped)."""

    response: httpx.Response
    limit: int


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Step = Send | Read | Sleep


@dataclass(frozen=True, slots=True)
class RetryEvent:
    """What `on_retry` hooks receive, once per retry, before the wait."""

    key: str
    key_hash: str  # what the log line shows instead of the key
    attempt: int  # the attempt that failed, 1 for the first
    reason: str  # "503", "409 in-flight", "ReadError"
    delay: float  # seconds until the next attempt
    response: httpx.Response | None  # the discarded response, read (empty if it was large)
    error: Exception | None  # or the error of the attempt


@dataclass(frozen=True, slots=True)
class CallOptions:
    """A transport's settings, read once in its ``__init__``."""

    header: str
    methods: frozenset[str]
    auto_key: bool
    policy: RetryPolicy
    bucket: TokenBucket | None
    on_retry: Callable[[RetryEvent], Any] | None
    derive: bool  # inside a claimed run, keys derived from its claim
    secret: bytes  # the derived keys' HMAC key


def call_options(
    policy: RetryPolicy,
    header: str,
    methods: Iterable[str],
    auto_key: bool,
    on_retry: Callable[[RetryEvent], Any] | None,
    derived_keys: bool = True,
    key_secret: bytes | str | None = None,
) -> CallOptions:
    """Checked settings; a wrong one says what to pass instead."""
    if not isinstance(policy, RetryPolicy):
        raise TypeError(f"policy must be a RetryPolicy, not {type(policy).__name__}")
    if not isinstance(header, str) or not _TOKEN.fullmatch(header):
        raise ValueError(
            f"header must be an HTTP header name such as 'Idempotency-Key', not {header!r}"
        )
    if isinstance(methods, str):
        raise TypeError(f"methods must be a sequence of method names, e.g. ({methods!r},)")
    if on_retry is not None and not callable(on_retry):
        raise TypeError("on_retry must be a function of one RetryEvent, or None")
    bucket = None if policy.budget is None else TokenBucket(policy.budget)
    return CallOptions(
        header,
        frozenset(m.upper() for m in methods),
        bool(auto_key),
        policy,
        bucket,
        on_retry,
        bool(derived_keys),
        secret_bytes(key_secret),
    )


class Call:
    """`run_call` as a transport drives it: `start`, then `resume` with each step's result
    or exception, until one returns the final response (or raises the call's error)."""

    def __init__(self, request: httpx.Request, options: CallOptions) -> None:
        self._steps = run_call(request, options)

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: object) -> None:
        self._steps.close()

    def start(self) -> Step | httpx.Response:
        return self._advance(lambda: next(self._steps))

    def resume(self, result: object, error: Exception | None) -> Step | httpx.Response:
        if error is not None:
            return self._advance(lambda: self._steps.throw(error))
        return self._advance(lambda: self._steps.send(result))

    @staticmethod
    def _advance(step: Callable[[], Step]) -> Step | httpx.Response:
        try:
            return step()
        except StopIteration as done:
            response: httpx.Response = done.value
            return response


def run_call(
    request: httpx.Request, options: CallOptions
) -> Generator[Step, object, httpx.Response]:
    key = request.headers.get(options.header)
    if key is None and options.auto_key:
        key = _new_key(request, options)
        request.headers[options.header] = key
    if key is None or not isinstance(request.stream, httpx.ByteStream):
        sent = yield Send(request)  # nothing makes a repeat safe: one attempt, untouched
        return _finish(_response(sent), options, key, 1)
    return (yield from _RetryLoop(request, options, key).run())


def _new_key(request: httpx.Request, options: CallOptions) -> str:
    """Inside a claimed run, the call's key derived from the run's claim and the call's
    label, so a second run of the same work sends the next API the same key (`_derived`);
    else a random one. An unlabelled call inside a run is refused before it is sent: no
    name of it would stay the same on a re-run that skips a call or reorders concurrent
    ones, and a key by position hands one call another's answer."""
    claim = current_claim() if options.derive else None
    if claim is None:
        return str(uuid.uuid4())
    label = request.extensions.get(LABEL_EXTENSION)
    if label is None:
        raise TypeError(
            f"{request.method} {request.url.path} inside a claimed run needs a name for its "
            f"derived {options.header}, the same on every run of this work: pass "
            f"extensions={{{LABEL_EXTENSION!r}: '<name>'}} (one name per call, e.g. 'fee' "
            f"and 'order'), or set the {options.header} header yourself (say, "
            "current_claim().derive_key('<name>')); derived_keys=False on the transport "
            "sends random keys, and a re-run then repeats the call's effect. Nothing was sent"
        )
    return claim._key_for_call(request.method, str(request.url), label, options.secret)


class _RetryLoop:
    """The attempts of one keyed call with a replayable body."""

    def __init__(self, request: httpx.Request, options: CallOptions, key: str) -> None:
        self.request = request
        self.options = options
        self.policy = options.policy
        self.key = key
        self.started = time.monotonic()
        deadline = self.policy.deadline
        self.deadline_at = None if deadline is None else self.started + deadline
        self.timeouts = dict(request.extensions.get("timeout") or {})
        self._key_hash: str | None = None

    @property
    def key_hash(self) -> str:
        """The hash a goblin-idem server logs for this key under its default scope (the
        Authorization header), so client and server lines can be matched."""
        if self._key_hash is None:
            headers = [(n.lower(), v) for n, v in self.request.headers.raw]
            scope = credentials_scope(headers)
            self._key_hash = key_names(b"", scope, self.key.encode()).hash
        return self._key_hash

    def run(self) -> Generator[Step, object, httpx.Response]:
        attempt = 0
        while True:
            attempt += 1
            self._cut_timeouts()
            response: httpx.Response | None = None
            error: Exception | None = None
            try:
                response = _response((yield Send(self.request)))
                response, problem = yield from self._inspect(response)
            except RETRYABLE_ERRORS as exc:
                response, error, reason, waits = None, exc, type(exc).__name__, False
            else:
                verdict = self._judge(response, problem)
                if verdict is None:
                    return _finish(response, self.options, self.key, attempt)
                reason, waits = verdict
            delay, why_not = self._next_delay(attempt, response, waits)
            if delay is None:
                logger.warning(
                    "giving up on %s %s key %s after attempt %d (%s): %s",
                    self.request.method,
                    self.request.url.path,
                    self.key_hash,
                    attempt,
                    reason,
                    why_not,
                )
                if error is not None:
                    raise error
                assert response is not None
                return _finish(response, self.options, self.key, attempt)
            discarded = None
            if response is not None:
                discarded = yield from self._discard(response)
            self._notify(attempt, reason, delay, discarded, error)
            yield Sleep(delay)

    def _inspect(
        self, response: httpx.Response
    ) -> Generator[Step, object, tuple[httpx.Response, str | None]]:
        """The problem type of a response that may be retried, when it is a small problem
        document (the body is then buffered, and the response rebuilt around it)."""
        if response.status_code not in self.policy.retry_statuses:
            return response, None
        content_type = response.headers.get("content-type", "")
        length = response.headers.get("content-length", "")
        if not (
            content_type.startswith("application/problem+json")
            and length.isdigit()
            and int(length) <= BODY_LIMIT
        ):
            return response, None
        raw = _body((yield Read(response, BODY_LIMIT)))
        buffered = _rebuild(response, raw or b"", self.request)
        try:
            doc = httpx.Response(200, headers=response.headers, content=raw or b"").json()
        except (ValueError, httpx.DecodingError):
            return buffered, None
        problem = doc.get("type") if isinstance(doc, dict) else None
        return buffered, problem if isinstance(problem, str) else None

    def _judge(self, response: httpx.Response, problem: str | None) -> tuple[str, bool] | None:
        """None: return this response. Else (reason, waits): retry it; `waits` means a
        duplicate is in flight, which is no failure and costs no budget."""
        status = response.status_code
        if status not in self.policy.retry_statuses:
            return None
        if response.headers.get(REPLAYED_HEADER) == "true":
            return None  # the stored answer: a repeat gets the same bytes
        if problem in NON_RETRYABLE_TYPES:
            return None
        reason = str(status)
        if problem is not None and problem.startswith(TYPE_BASE):
            reason += " " + problem[len(TYPE_BASE) :]
        if status == 409:
            # In flight: retry. Any other conflict (say, a version check) gets the same
            # answer to the same request, unless the server asks to come back.
            if problem != IN_FLIGHT.type and "retry-after" not in response.headers:
                return None
            return reason, True
        return reason, False

    def _next_delay(
        self, attempt: int, response: httpx.Response | None, waits: bool
    ) -> tuple[float | None, str]:
        """The wait before the next attempt, or None and why there is none."""
        if attempt >= self.policy.max_attempts:
            return None, f"max_attempts ({self.policy.max_attempts}) reached"
        retry_after = None
        if response is not None:
            retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
        if retry_after is not None:
            delay = min(retry_after, self.policy.max_delay)
        else:
            delay = backoff_delay(attempt, self.policy.base_delay, self.policy.max_delay)
        if self.deadline_at is not None and time.monotonic() + delay >= self.deadline_at:
            return None, f"the wait ({delay:.2f}s) would pass the deadline"
        bucket = self.options.bucket
        if not waits and bucket is not None and not bucket.take():
            return None, "the retry budget is empty"
        return delay, ""

    def _discard(self, response: httpx.Response) -> Generator[Step, object, httpx.Response]:
        """Drain and close a response that will not be returned; a read copy of it for
        the hook (its body is empty if it was longer than `BODY_LIMIT`)."""
        try:
            raw = _body((yield Read(response, BODY_LIMIT)))
        except httpx.TransportError:
            raw = None  # the connection is gone; nothing to give back to the pool
        copy = _rebuild(response, raw or b"", self.request)
        with contextlib.suppress(httpx.DecodingError):
            copy.read()
        return copy

    def _notify(
        self,
        attempt: int,
        reason: str,
        delay: float,
        response: httpx.Response | None,
        error: Exception | None,
    ) -> None:
        logger.info(
            "retrying %s %s key %s after attempt %d (%s) in %.2fs",
            self.request.method,
            self.request.url.path,
            self.key_hash,
            attempt,
            reason,
            delay,
        )
        hook = self.options.on_retry
        if hook is None:
            return
        event = RetryEvent(self.key, self.key_hash, attempt, reason, delay, response, error)
        try:
            hook(event)
        except Exception:  # an observer must never change the call's outcome
            logger.exception("on_retry hook failed")

    def _cut_timeouts(self) -> None:
        """Each timeout of this attempt is at most what is left of the deadline."""
        if self.deadline_at is None:
            return
        left = max(self.deadline_at - time.monotonic(), 0.001)
        self.request.extensions["timeout"] = {
            name: left if self.timeouts.get(name) is None else min(self.timeouts[name], left)
            for name in ("connect", "read", "write", "pool")
        }


def _response(result: object) -> httpx.Response:
    if not isinstance(result, httpx.Response):
        raise TypeError(f"the wrapped transport returned {type(result).__name__}, not a Response")
    return result


def _body(result: object) -> bytes | None:
    assert result is None or isinstance(result, bytes)
    return result


def _rebuild(response: httpx.Response, raw: bytes, request: httpx.Request) -> httpx.Response:
    """`response` with its (already read) raw body in memory, still encoded as received."""
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        request=request,
        extensions=response.extensions,
    )


def _finish(
    response: httpx.Response, options: CallOptions, key: str | None, attempts: int
) -> httpx.Response:
    """The call's answer, with what the transport did in ``extensions["idempotency"]``; an
    answer that is no retryable failure refills the budget."""
    if options.bucket is not None and response.status_code not in options.policy.retry_statuses:
        options.bucket.deposit()
    response.extensions["idempotency"] = {
        "key": key,
        "attempts": attempts,
        "replayed": response.headers.get(REPLAYED_HEADER) == "true",
    }
    return response
