"""The httpx transports: each performs a call's steps (`_call.py`) with its own I/O."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import anyio
import httpx

from ._budget import TokenBucket
from ._call import Call, Read, RetryEvent, Send, Step, call_options
from ._policy import RetryPolicy

__all__ = ["AsyncIdempotentTransport", "IdempotentTransport"]

T = TypeVar("T", httpx.BaseTransport, httpx.AsyncBaseTransport)
Outcome = tuple[object, Exception | None]  # a step's result, or the exception it raised


class _Wrapper(Generic[T]):
    """What both transports share: the wrapped transport and the settings, read once."""

    _wraps: ClassVar[type]
    _default: ClassVar[Callable[[], Any]]
    _instead: ClassVar[str]  # the transport to use for the other kind of client

    def __init__(
        self,
        transport: T | None = None,
        *,
        policy: RetryPolicy | None = None,
        header: str = "Idempotency-Key",
        methods: Sequence[str] = ("POST", "PATCH"),
        auto_key: bool = True,
        on_retry: Callable[[RetryEvent], Any] | None = None,
        derived_keys: bool = True,
        key_secret: bytes | str | None = None,
    ) -> None:
        if transport is not None and not isinstance(transport, self._wraps):
            raise TypeError(
                f"{type(self).__name__} wraps an httpx.{self._wraps.__name__}, not "
                f"{type(transport).__name__} (for the other kind of client, use {self._instead})"
            )
        self._transport: T = transport if transport is not None else type(self)._default()
        self._options = call_options(
            policy or RetryPolicy(), header, methods, auto_key, on_retry, derived_keys, key_secret
        )

    @property
    def budget(self) -> TokenBucket | None:
        """The retry budget all calls of this transport share (None: unlimited)."""
        return self._options.bucket


class IdempotentTransport(_Wrapper[httpx.BaseTransport], httpx.BaseTransport):
    """An `httpx.Client` transport that keys POST and PATCH requests and retries them safely.

    It wraps `transport` (default: a new `httpx.HTTPTransport()`; pass your own to set
    ``verify``, ``http2``, ``limits`` and so on, since a client given a transport does not
    build one). Requests of other methods pass through untouched. A request without a key
    gets a random one, or inside a claimed run one derived from the run's claim (`_new_key`).
    """

    _wraps = httpx.BaseTransport
    _default = httpx.HTTPTransport
    _instead = "AsyncIdempotentTransport"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method not in self._options.methods:
            return self._transport.handle_request(request)
        with Call(request, self._options) as call:
            step = call.start()
            while not isinstance(step, httpx.Response):
                step = call.resume(*self._perform(step))
            return step

    def _perform(self, step: Step) -> Outcome:
        try:
            if isinstance(step, Send):
                return self._transport.handle_request(step.request), None
            if isinstance(step, Read):
                try:
                    return _first_bytes(step.response.iter_raw(), step.limit), None
                finally:  # however the read ends
                    step.response.close()
            time.sleep(step.seconds)
            return None, None
        except Exception as exc:  # the call decides: retry, or raise it
            return None, exc

    def close(self) -> None:
        self._transport.close()


class AsyncIdempotentTransport(_Wrapper[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport):
    """`IdempotentTransport` for `httpx.AsyncClient`: the same rules.

    A cancelled call stops where it is: its wait ends, a response it was reading is closed.
    """

    _wraps = httpx.AsyncBaseTransport
    _default = httpx.AsyncHTTPTransport
    _instead = "IdempotentTransport"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method not in self._options.methods:
            return await self._transport.handle_async_request(request)
        with Call(request, self._options) as call:
            step = call.start()
            while not isinstance(step, httpx.Response):
                step = call.resume(*await self._perform(step))
            return step

    async def _perform(self, step: Step) -> Outcome:
        try:
            if isinstance(step, Send):
                return await self._transport.handle_async_request(step.request), None
            if isinstance(step, Read):
                try:
                    return await _afirst_bytes(step.response.aiter_raw(), step.limit), None
                finally:  # however the read ends, cancelled included
                    await step.response.aclose()
            await anyio.sleep(step.seconds)
            return None, None
        except Exception as exc:  # the call decides: retry, or raise it
            return None, exc

    async def aclose(self) -> None:
        await self._transport.aclose()


def _first_bytes(chunks: Iterator[bytes], limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def _afirst_bytes(chunks: AsyncIterator[bytes], limit: int) -> bytes | None:
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
