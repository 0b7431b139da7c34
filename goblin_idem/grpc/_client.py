"""The client interceptors: a request id on every unary call, kept across its retries.

A unary call (unary-unary, or a client stream) whose request has an empty `key_field` gets
one (a copy of the request: the caller's message is left as it is); a request type without
that field gets the `key_metadata` metadata instead, unless the caller sent one. The key
is a random UUID4, or inside a claimed run one derived from the run's claim, the method and
the call's ``idempotency-label`` metadata (`Claim._key_for_call`, as the httpx transports'
keys); an unlabelled call inside a run is refused before it is sent (docs/grpc.md says why).

Retried with the same key, up to the policy's attempts, with its backoff and within its
deadline: UNAVAILABLE (the server, or its idempotency store, could not take the call), and
ABORTED with ``retry-after`` (the server interceptor's "the first call is still running",
after the time it names, capped by `max_delay`). Nothing else is retried: another status
may have been the call's outcome. A client stream's messages are read once, before the
first attempt, so every attempt sends the same ones.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from typing import Any, NamedTuple

import grpc

from .._claim import current_claim
from .._derived import secret_bytes
from ._identity import Identity

__all__ = [
    "LABEL_METADATA",
    "AsyncIdempotentClientInterceptor",
    "IdempotentClientInterceptor",
    "RetryPolicy",
]

#: The call metadata that names a call inside a claimed run (its derived key's label).
LABEL_METADATA = "idempotency-label"


class RetryPolicy(NamedTuple):
    """When a call is retried, and how long it waits (the httpx transports' fields):
    `max_attempts` (the first included); a backoff drawn in [0, min(`max_delay`,
    `base_delay` * 2 ** (retry - 1))]; `deadline`, seconds for the whole call, past which
    no wait reaches (None: none). `max_delay` caps a ``retry-after`` too."""

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 10.0
    deadline: float | None = 30.0


_RETRIED = grpc.StatusCode.UNAVAILABLE
_IN_FLIGHT = grpc.StatusCode.ABORTED


class _Details(NamedTuple):
    """A sync call's details with the request id's metadata added (grpc.ClientCallDetails'
    fields, which grpc reads by name)."""

    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def _retry_after(trailing: Any) -> float | None:
    for name, value in trailing or ():
        if name == "retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None
    return None


class _Interceptor:
    """What the sync and the grpc.aio client interceptors share: the options, checked once,
    keying a call's first message (or its metadata) before the first attempt, and the wait
    before each retry."""

    def __init__(
        self,
        *,
        policy: RetryPolicy | None = None,
        key_field: str = "request_id",
        key_metadata: str = "idempotency-key",
        derived_keys: bool = True,
        key_secret: bytes | str | None = None,
    ) -> None:
        policy = RetryPolicy() if policy is None else policy
        if not isinstance(policy, RetryPolicy):
            raise TypeError(
                "policy must be a goblin_idem.grpc.RetryPolicy(max_attempts=..., ...), not "
                f"{type(policy).__name__}"
            )
        if policy.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, not {policy.max_attempts}")
        self._policy = policy
        self._identity = Identity(b"", key_field, key_metadata.lower(), None)
        self._derive = bool(derived_keys)
        self._secret = secret_bytes(key_secret)

    def _new_key(self, method: str, metadata: list[Any]) -> str:
        claim = current_claim() if self._derive else None
        if claim is None:
            return str(uuid.uuid4())
        labels = [value for name, value in metadata if name == LABEL_METADATA]
        if len(labels) != 1 or not isinstance(labels[0], str) or not labels[0]:
            raise TypeError(
                f"{method} inside a claimed run needs a name for its derived request id, the "
                f"same on every run of this work: pass metadata=[({LABEL_METADATA!r}, "
                "'<name>')] (one name per call, e.g. 'fee' and 'order'), or set the id "
                "yourself (say, current_claim().derive_key('<name>')); derived_keys=False "
                "sends random ids, and a re-run then repeats the call's effect. Nothing was sent"
            )
        return claim._key_for_call("GRPC", method, labels[0], self._secret)

    def _keyed(self, details: Any, requests: list[Any]) -> tuple[list[Any], Any]:
        """(the messages, the details) with a key, unless the call carries one: the first
        message's field if its type has one, else the metadata."""
        if not requests:
            return requests, details
        identity = self._identity
        method = details.method
        if isinstance(method, bytes):  # grpc.aio's details carry it encoded
            method = method.decode()
        first = requests[0]
        pairs = list(details.metadata or ())
        if identity.has_field(first):
            if getattr(first, identity.key_field):
                return requests, details
            copy = type(first)()
            copy.CopyFrom(first)
            setattr(copy, identity.key_field, self._new_key(method, pairs))
            return [copy, *requests[1:]], details
        if any(name == identity.key_metadata for name, _ in pairs):
            return requests, details
        metadata = (*pairs, (identity.key_metadata, self._new_key(method, pairs)))
        return requests, self._with_metadata(details, metadata)

    @staticmethod
    def _with_metadata(details: Any, metadata: Any) -> Any:
        """`details` with `metadata` instead of its own, as the channel kind wants them."""
        raise NotImplementedError

    def _pause(self, retry: int, code: grpc.StatusCode, trailing: Any, ends: float | None) -> float:
        """The wait before retry `retry` (1 for the first), or -1: no retry."""
        policy = self._policy
        if retry >= policy.max_attempts:
            return -1
        wait = None
        if code == _IN_FLIGHT:
            wait = _retry_after(trailing)
            if wait is None:  # an ABORTED that is not "still running": not ours to retry
                return -1
            wait = min(wait, policy.max_delay)
        elif code != _RETRIED:
            return -1
        if wait is None:
            ceiling = min(policy.max_delay, policy.base_delay * 2.0 ** min(retry - 1, 64))
            wait = random.uniform(0.0, ceiling)
        if ends is not None and time.monotonic() + wait >= ends:
            return -1
        return wait

    def _deadline(self) -> float | None:
        return None if self._policy.deadline is None else time.monotonic() + self._policy.deadline


class IdempotentClientInterceptor(
    _Interceptor,
    grpc.UnaryUnaryClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
):
    """Keys and retries a sync channel's unary calls (see the module docstring):
    ``grpc.intercept_channel(channel, IdempotentClientInterceptor())``."""

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, request: Any
    ) -> Any:
        request, details = self._keyed(client_call_details, [request])
        return self._retried(lambda: continuation(details, request[0]))

    def intercept_stream_unary(
        self,
        continuation: Callable[[Any, Any], Any],
        client_call_details: Any,
        request_iterator: Iterator[Any],
    ) -> Any:
        requests, details = self._keyed(client_call_details, list(request_iterator))
        return self._retried(lambda: continuation(details, iter(requests)))

    @staticmethod
    def _with_metadata(details: Any, metadata: Any) -> Any:
        return _Details(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def _retried(self, attempt: Callable[[], Any]) -> Any:
        ends = self._deadline()
        retry = 0
        while True:
            call = attempt()
            code = call.code()  # blocks until the call ends
            retry += 1
            wait = self._pause(retry, code, call.trailing_metadata(), ends)
            if wait < 0:
                return call
            time.sleep(wait)


class AsyncIdempotentClientInterceptor(
    _Interceptor, grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.StreamUnaryClientInterceptor
):
    """Keys and retries a grpc.aio channel's unary calls (see the module docstring):
    ``grpc.aio.insecure_channel(target, interceptors=[AsyncIdempotentClientInterceptor()])``."""

    async def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, request: Any
    ) -> Any:
        requests, details = self._keyed(client_call_details, [request])
        return await self._retried(lambda: continuation(details, requests[0]))

    async def intercept_stream_unary(
        self,
        continuation: Callable[[Any, Any], Any],
        client_call_details: Any,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        if isinstance(request_iterator, AsyncIterable):
            messages = [message async for message in request_iterator]
        else:
            messages = list(request_iterator)
        requests, details = self._keyed(client_call_details, messages)
        return await self._retried(lambda: continuation(details, iter(requests)))

    @staticmethod
    def _with_metadata(details: Any, metadata: Any) -> Any:
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*metadata),
            details.credentials,
            details.wait_for_ready,
        )

    async def _retried(self, attempt: Callable[[], Any]) -> Any:
        ends = self._deadline()
        retry = 0
        while True:
            call = await attempt()
            code = await call.code()
            retry += 1
            wait = self._pause(retry, code, await call.trailing_metadata(), ends)
            if wait < 0:
                return call
            await asyncio.sleep(wait)
