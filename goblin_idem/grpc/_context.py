"""The context a keyed call's handler sees: the server's own, with its ending held.

A handler ends its call with ``context.abort()``, ``set_code()`` / ``set_details()`` /
``set_trailing_metadata()``, or by returning. grpc.aio's ``abort`` sends the status at once,
before the interceptor could keep the outcome or release the key, so that a duplicate sent
right after could find the key neither done nor free. Here every ending is recorded
instead, and the interceptor sends it once the outcome is kept or the key released.
Everything else (metadata, peer, deadline, initial metadata) is the server's context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import grpc

from ._outcome import Metadata, Outcome

__all__ = ["AsyncHeld", "Ended", "SyncHeld"]


class Ended(Exception):
    """Raised by a held ``abort()``: the handler's call ends here (its status recorded)."""


class _Held:
    """What both kinds of context record: the status, details and trailing metadata set,
    and the serialized responses (within `limit` bytes; past it, none are kept)."""

    __slots__ = (
        "_code",
        "_context",
        "_details",
        "_limit",
        "_messages",
        "_serialize",
        "_size",
        "last",
        "over",
        "trailing",
    )

    def __init__(self, context: Any, serialize: Callable[[Any], bytes], limit: int) -> None:
        self._context = context
        self._serialize = serialize
        self._limit = limit
        self._code = grpc.StatusCode.OK
        self._details = ""
        self._messages: list[bytes] = []
        self._size = 0
        self.trailing: Metadata = ()
        self.last: bytes | None = None  # the last response's bytes (a unary call's one)
        self.over = False  # the responses passed the limit: none kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, Any]]) -> None:
        self.trailing = tuple((str(k), v) for k, v in trailing_metadata)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self.trailing

    def _end(self, code: grpc.StatusCode, details: str, trailing: Sequence[Any]) -> NoReturn:
        # An abort with OK is an error that said nothing: grpc answers UNKNOWN, and so here.
        self._code = grpc.StatusCode.UNKNOWN if code == grpc.StatusCode.OK else code
        self._details = details or self._details
        if trailing:
            self.set_trailing_metadata(trailing)
        raise Ended

    def kept(self, message: Any) -> bytes:
        """`message` serialized once by the method's serializer, and kept while the
        responses stay within the limit."""
        data = self.last = self._serialize(message)
        self._size += len(data)
        if self._size <= self._limit:
            self._messages.append(data)
        elif not self.over:
            self.over = True
            self._messages.clear()
        return data

    def outcome(self, finished: bool = True) -> Outcome:
        """The call as it ended: its status and the responses it sent before it (a unary
        call keeps its response only with OK); responses past the limit are not kept
        (the status alone, not replayable)."""
        return Outcome(
            self._code,
            self._details,
            self.trailing,
            tuple(self._messages),
            replayable=not self.over,
            finished=finished,
        )


class AsyncHeld(_Held):
    """A grpc.aio context, held (see the module docstring)."""

    __slots__ = ("_requests",)

    def __init__(
        self,
        context: Any,
        serialize: Callable[[Any], bytes],
        limit: int,
        requests: Sequence[Any] = (),
    ) -> None:
        super().__init__(context, serialize, limit)
        self._requests = list(requests)[::-1]  # a client stream, read back by `read()`

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[Any] = ()
    ) -> NoReturn:
        self._end(code, details, trailing_metadata)

    async def write(self, message: Any) -> None:
        """A response of a server stream: kept, and sent on at once."""
        await self._context.write(self.kept(message))

    async def read(self) -> Any:
        """The next message of a client stream (read whole before the claim)."""
        return self._requests.pop() if self._requests else grpc.aio.EOF


class SyncHeld(_Held):
    """A sync server's context, held (see the module docstring). A server stream's
    responses are kept in `sent` too, sent once the outcome is kept or the key released."""

    __slots__ = ("sent",)

    def __init__(self, context: Any, serialize: Callable[[Any], bytes], limit: int) -> None:
        super().__init__(context, serialize, limit)
        self.sent: list[bytes] = []

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._end(code, details, ())

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._end(status.code, status.details, status.trailing_metadata)
