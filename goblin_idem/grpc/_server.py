"""The server interceptors: `AsyncIdempotencyInterceptor` (grpc.aio) and
`IdempotencyInterceptor` (grpc.server with a thread pool).

Each wraps a covered method's handler once (per method, while the server hands out the same
handler): the wrapped handler deserializes as the method does and sends bytes (an identity
serializer), so that the handler's responses are serialized once, by the method's own
serializer, kept as those bytes, and a replay sends exactly them. A call whose method's
request type has no key field and whose metadata names no key gets the method's own
handler: no cost.
"""

from __future__ import annotations

import inspect
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Sequence,
)
from typing import Any

import grpc

from .._recording import Records
from .._threads._records import ThreadedRecords, ThreadedTransaction, for_sync_apps, pending
from ..once._sync import in_callers_thread
from ..store import Store
from ._context import AsyncHeld, Ended, SyncHeld
from ._door import Door, Keyed
from ._outcome import Outcome

__all__ = ["AsyncIdempotencyInterceptor", "IdempotencyInterceptor"]

Handler = Any  # grpc.RpcMethodHandler: typeshed's is generic over what no caller knows here
Context = Any  # grpc.aio.ServicerContext, or grpc.ServicerContext


def _same(data: bytes) -> bytes:
    return data


async def _awaited(work: Callable[[], Awaitable[Outcome]]) -> Outcome:
    """The function `once`'s core runs under the claim: the call's own work."""
    return await work()


class _Interceptor:
    """What both server interceptors share: the options, and which handler a call gets."""

    def __init__(
        self,
        store: Store,
        *,
        records: Records | None = None,
        key_field: str = "request_id",
        key_metadata: str = "idempotency-key",
        methods: Collection[str] | None = None,
        ttl_seconds: float = 86_400,
        lease_seconds: float = 30,
        outcome: Callable[[grpc.StatusCode], bool] | Collection[grpc.StatusCode] | None = None,
        scope: Callable[[Any], bytes | str] | None = None,
        wait_seconds: float = 0,
        retry_after_seconds: float = 1,
        max_response_bytes: int = 1024 * 1024,
        namespace: str = "grpc",
        encryption_keys: Any = None,
        require_sealed: bool = False,
        on_event: Callable[[str, str], None] | None = None,
    ) -> None:
        """Every option is checked here, once (a wrong one raises, saying what to pass);
        what each does: docs/grpc.md."""
        self._door = Door(
            store,
            records=self._records(records),
            key_field=key_field,
            key_metadata=key_metadata,
            methods=methods,
            ttl_seconds=ttl_seconds,
            lease_seconds=lease_seconds,
            outcome=outcome,
            scope=scope,
            wait_seconds=wait_seconds,
            retry_after_seconds=retry_after_seconds,
            max_response_bytes=max_response_bytes,
            namespace=namespace,
            encryption_keys=encryption_keys,
            require_sealed=require_sealed,
            on_event=on_event,
        )
        # method -> (the server's handler, its wrapped handler or None for pass-through,
        # whether the request type has the key field)
        self._handlers: dict[str, tuple[Handler, Handler, bool]] = {}

    @property
    def counters(self) -> Any:
        """What the interceptor did since start (the HTTP middleware's `Counters`)."""
        return self._door.counters

    def _handler(self, handler: Handler | None, details: grpc.HandlerCallDetails) -> Handler:
        method: str = details.method
        if handler is None or not self._door.covers(method):
            return handler
        known = self._handlers.get(method)
        if known is None or known[0] is not handler:
            known = self._handlers[method] = (handler, *self._wrap(method, handler))
        wrapped, has_field = known[1], known[2]
        if wrapped is None:
            return handler
        if not has_field:
            wanted = self._door.identity.key_metadata
            if all(name != wanted for name, _ in details.invocation_metadata or ()):
                return handler  # no key can come: the method's own handler
        return wrapped

    def _wrap(self, method: str, handler: Handler) -> tuple[Handler, bool]:
        kind = (handler.request_streaming, handler.response_streaming)
        if kind == (True, True):
            self._door.warn_streams(method)
            return None, False
        request_type = getattr(handler.request_deserializer, "__self__", None)
        has_field = request_type is None or (
            hasattr(request_type, "DESCRIPTOR") and self._has_field(request_type)
        )
        return self._wrapped(method, handler, kind), has_field

    def _has_field(self, request_type: type) -> bool:
        return self._door.identity.has_field(request_type())

    _call: type[_AsyncCall | _SyncCall]  # one method's wrapped behaviours

    @staticmethod
    def _records(records: object) -> Any:
        """The records a handler's writes join: grpc.aio's through goblin_idem.sql's async
        ``connection()`` (checked by the door)."""
        return records

    def _wrapped(self, method: str, handler: Handler, kind: tuple[bool, bool]) -> Handler:
        """The method's handler, wrapped: deserializing as the method does, sending bytes."""
        call = self._call(self._door, method, handler)
        deserialize = handler.request_deserializer
        if kind == (False, False):
            return grpc.unary_unary_rpc_method_handler(call.unary_unary, deserialize, _same)
        if kind == (False, True):
            return grpc.unary_stream_rpc_method_handler(call.unary_stream, deserialize, _same)
        return grpc.stream_unary_rpc_method_handler(call.stream_unary, deserialize, _same)


class _Method:
    """One method's handler, as its wrapped behaviours need it (plain values, no
    reference to the interceptor)."""

    __slots__ = ("behavior", "door", "method", "run", "serialize", "streamed_requests")

    def __init__(self, door: Door, method: str, handler: Handler) -> None:
        self.door, self.method = door, method
        self.streamed_requests: bool = handler.request_streaming
        self.serialize: Callable[[Any], bytes] = handler.response_serializer or _same
        self.behavior: Callable[..., Any] = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary
        )
        self.run = door.run(method, _awaited)


class _AsyncCall(_Method):
    """One method's wrapped behaviours under grpc.aio."""

    __slots__ = ()

    async def unary_unary(self, request: Any, context: Context) -> Any:
        got = await self._keyed([request], context, self._unary)
        if got is None:  # no key: the handler's own call
            return self.serialize(await _result(self.behavior(request, context)))
        return await _send(context, *got)

    async def stream_unary(self, request_iterator: AsyncIterator[Any], context: Context) -> Any:
        requests = [message async for message in request_iterator]
        got = await self._keyed(requests, context, self._unary)
        if got is None:
            passing = _Passing(context, self.serialize, requests)
            return self.serialize(await _result(self.behavior(_replayed(requests), passing)))
        return await _send(context, *got)

    async def unary_stream(self, request: Any, context: Context) -> None:
        got = await self._keyed([request], context, self._stream)
        if got is None:
            await self._streamed(request, _Passing(context, self.serialize))
            return
        outcome, own = got
        if own is None:  # a replay: the first call's stream, in order
            for message in outcome.messages:
                await context.write(message)
        await _send(context, outcome, None)

    async def _keyed(
        self,
        requests: list[Any],
        context: Context,
        handle: Callable[[list[Any], AsyncHeld], Awaitable[None]],
    ) -> tuple[Outcome, AsyncHeld | None] | None:
        """The call's outcome under its key, with the handler's held context if it ran
        here (None: a replay, or the interceptor's own answer); None for no key."""
        keyed = self.door.keyed(self.method, requests, context)
        if not isinstance(keyed, Keyed):
            return None if keyed is None else (keyed, None)
        held: AsyncHeld | None = None  # made only for a run (a replay needs none)

        async def work() -> Outcome:
            nonlocal held
            held = AsyncHeld(context, self.serialize, self.door.max_response_bytes, requests)
            keyed.started()
            try:
                await handle(requests, held)
            except Ended:
                pass
            return keyed.ended(held.outcome())

        try:
            outcome: Outcome = await self.run.call(keyed.names, keyed.fp, (work,), {})
        except BaseException as exc:
            answer = self.door.failed(exc, keyed)
            if answer is None:
                raise
            return answer, None
        replay = keyed.answered(outcome)
        return (outcome, held) if replay is None else (replay, None)

    async def _unary(self, requests: list[Any], held: AsyncHeld) -> None:
        if not self.streamed_requests:
            response = await _result(self.behavior(requests[0], held))
        else:
            response = await _result(self.behavior(_replayed(requests), held))
        if held.code() == grpc.StatusCode.OK:
            held.kept(response)

    async def _stream(self, requests: list[Any], held: AsyncHeld) -> None:
        await self._streamed(requests[0], held)

    async def _streamed(self, request: Any, context: AsyncHeld | _Passing) -> None:
        """A server stream's handler: an async generator, or a coroutine that writes; each
        response serialized and sent on as it comes."""
        result = self.behavior(request, context)
        if hasattr(result, "__aiter__"):
            async for message in result:
                await context.write(message)
        else:
            await _result(result)


class _Passing:
    """The context of a call without a key: the server's, but for the responses it writes,
    serialized here (the wrapped method sends bytes), and a client stream read before."""

    __slots__ = ("_context", "_requests", "_serialize")

    def __init__(
        self,
        context: Context,
        serialize: Callable[[Any], bytes],
        requests: Sequence[Any] = (),
    ) -> None:
        self._context, self._serialize = context, serialize
        self._requests = list(requests)[::-1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        await self._context.write(self._serialize(message))

    async def read(self) -> Any:
        return self._requests.pop() if self._requests else grpc.aio.EOF


async def _result(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _replayed(requests: list[Any]) -> AsyncIterator[Any]:
    for message in requests:
        yield message


async def _send(context: Context, outcome: Outcome, own: Any) -> Any:
    """The outcome's status, and a unary call's response bytes (its own, for the call that
    ran the handler: kept or not, it gets what the handler answered)."""
    if outcome.code != grpc.StatusCode.OK:
        await context.abort(outcome.code, outcome.details, outcome.trailing)
    if outcome.trailing:
        context.set_trailing_metadata(outcome.trailing)
    if outcome.details:
        context.set_details(outcome.details)
    if own is not None and own.last is not None:
        return own.last
    return outcome.messages[0] if outcome.messages else None


def _in_thread(
    keyed: Keyed, work: Callable[[], Outcome], tx: ThreadedTransaction | None = None
) -> Outcome:
    """The call's work in the handler's thread; with records, in the run's transaction,
    begun here and current while the handler runs (as a WSGI app's, `wsgi._bridge`)."""
    if tx is None:
        return work()
    joined = tx.begin()
    token = joined.enter()
    try:
        return work()
    finally:
        joined.leave(token)


class _SyncCall(_Method):
    """One method's wrapped behaviours under a sync server."""

    __slots__ = ("keyed_run",)

    def __init__(self, door: Door, method: str, handler: Handler) -> None:
        super().__init__(door, method, handler)
        # The call's work in this thread, the rest of its run on the loop thread.
        self.keyed_run = in_callers_thread(self._decorate, _in_thread)

    def _decorate(
        self,
        call_back: Callable[..., Coroutine[Any, Any, Outcome]],
    ) -> Callable[..., Coroutine[Any, Any, Outcome]]:
        run = self.run

        async def run_keyed(keyed: Keyed, work: Callable[[], Outcome]) -> Outcome:
            async def started() -> Outcome:
                keyed.started()  # counted on the loop thread, as every other event
                # The run's records' transaction, if any, handed to the handler's thread.
                return keyed.ended(await call_back(keyed, work, pending()))

            outcome: Outcome = await run.call(keyed.names, keyed.fp, (started,), {})
            return outcome

        return run_keyed

    def unary_unary(self, request: Any, context: Context) -> Any:
        got = self._keyed([request], context, self._unary)
        if got is None:
            return self.serialize(self.behavior(request, context))
        return _send_sync(context, *got)

    def stream_unary(self, request_iterator: Iterator[Any], context: Context) -> Any:
        requests = list(request_iterator)
        got = self._keyed(requests, context, self._unary)
        if got is None:
            return self.serialize(self.behavior(iter(requests), context))
        return _send_sync(context, *got)

    def unary_stream(self, request: Any, context: Context) -> Iterator[bytes]:
        got = self._keyed([request], context, self._stream)
        if got is None:
            for message in self.behavior(request, context):
                yield self.serialize(message)
            return
        outcome, own = got
        yield from outcome.messages if own is None else own.sent
        _send_sync(context, outcome, None)

    def _keyed(
        self,
        requests: list[Any],
        context: Context,
        handle: Callable[[list[Any], SyncHeld], None],
    ) -> tuple[Outcome, SyncHeld | None] | None:
        """As `_AsyncCall._keyed`, the handler in this thread."""
        keyed = self.door.keyed(self.method, requests, context)
        if not isinstance(keyed, Keyed):
            return None if keyed is None else (keyed, None)
        held = SyncHeld(context, self.serialize, self.door.max_response_bytes)

        def work() -> Outcome:  # in this thread
            try:
                handle(requests, held)
            except Ended:
                pass
            return held.outcome(finished=_still_wanted(context))

        try:
            outcome: Outcome = self.keyed_run(keyed, work)
        except BaseException as exc:
            answer = self.door.failed(exc, keyed)
            if answer is None:
                raise
            return answer, None
        replay = keyed.answered(outcome)
        return (outcome, held) if replay is None else (replay, None)

    def _unary(self, requests: list[Any], held: SyncHeld) -> None:
        response = (
            self.behavior(iter(requests), held)
            if self.streamed_requests
            else self.behavior(requests[0], held)
        )
        if held.code() == grpc.StatusCode.OK:
            held.kept(response)

    def _stream(self, requests: list[Any], held: SyncHeld) -> None:
        for message in self.behavior(requests[0], held):
            held.sent.append(held.kept(message))


def _still_wanted(context: Context) -> bool:
    """Whether a sync call's client still waits for it: not cancelled, its deadline not
    passed (checked here too: the server may not have seen the deadline's cancellation yet)."""
    remaining = context.time_remaining()
    return bool(context.is_active()) and (remaining is None or remaining > 0)


def _send_sync(context: Context, outcome: Outcome, own: SyncHeld | None) -> Any:
    """As `_send`, on a sync server's context."""
    if outcome.trailing:
        context.set_trailing_metadata(outcome.trailing)
    if outcome.code != grpc.StatusCode.OK:
        context.abort(outcome.code, outcome.details)
    if outcome.details:
        context.set_details(outcome.details)
    if own is not None and own.last is not None:
        return own.last
    return outcome.messages[0] if outcome.messages else None


class AsyncIdempotencyInterceptor(_Interceptor, grpc.aio.ServerInterceptor):
    """Exactly-once calls for a grpc.aio server, keyed by AIP-155's ``request_id``.

    ``grpc.aio.server(interceptors=[AsyncIdempotencyInterceptor(store)])``. A call whose
    request has a non-empty `key_field` (or, without one, metadata `key_metadata`) runs its
    handler once per key in its method and caller's scope; a duplicate gets the first
    call's status, details, trailing metadata and response bytes, plus
    ``idempotent-replayed: true``. Kept: OK and the definitive errors (`outcome=` changes
    which); anything else releases the key, and the retry runs. See docs/grpc.md.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        return self._handler(await continuation(handler_call_details), handler_call_details)

    _call = _AsyncCall


class IdempotencyInterceptor(_Interceptor, grpc.ServerInterceptor):
    """`AsyncIdempotencyInterceptor` for a sync server:
    ``grpc.server(ThreadPoolExecutor(...), interceptors=[IdempotencyInterceptor(store)])``.

    The handler runs in the server's worker thread; the claim step, the lease's renewals and
    the publish run on the process's loop thread (as for a sync `once` function). A thread
    cannot be stopped: a call whose client cancelled or whose deadline passed while its
    handler ran is not kept (the key released, the records rolled back) once the handler
    returns. A server stream's responses are sent once the call's outcome is kept.

    With `records` (docs/grpc.md), the handler's writes are the run's transaction in the
    handler's thread, committed with the outcome, as a WSGI view's are (`_threads._records`).
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        return self._handler(continuation(handler_call_details), handler_call_details)

    _call = _SyncCall

    @staticmethod
    def _records(records: object) -> Any:
        """Records whose transaction is the handler's thread's (``SyncSqlRecords`` on a sync
        Engine, `goblin_idem.django.DjangoRecords`), adapted as the WSGI middleware adapts
        them and checked now (the database answers, the table is there), so that a
        misconfiguration stops the server's start; async records are refused, saying what
        to pass."""
        if records is None:
            return None
        if callable(getattr(records, "transaction", None)):
            raise TypeError(
                f"records: {records!r} writes through an AsyncEngine, which a sync handler "
                "cannot write through (goblin_idem.sql.connection() is async), so the "
                "outcome would commit without the handler's writes: pass SyncSqlRecords(engine) "
                "on a sync Engine and write through goblin_idem.sql.sync, or "
                "goblin_idem.django.DjangoRecords() in a Django project; or serve the "
                "service with grpc.aio and AsyncIdempotencyInterceptor"
            )
        adapted = for_sync_apps(records)
        if isinstance(adapted, ThreadedRecords):
            adapted.backend.check()  # SqlRecordsError, saying what to change
        return adapted
