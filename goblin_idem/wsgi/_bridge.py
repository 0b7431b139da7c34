"""A sync app under the ASGI middleware: the request's thread and the loop thread, bridged.

The ASGI middleware runs on the loop thread (`_loop`) and wraps `thread_app`, an ASGI app
that hands control back to the request's thread (`_exchange`) to run the sync app there
(never on the loop thread): a `Responder` runs it and turns its response into ASGI
messages, one chunk per crossing. What the middleware sends (the app's response as it
passes, a replay, a refusal) is handed to the request's thread (`Handoff.send`), which
turns it into the outer response (`Outer`): start_response and an iterable for WSGI, an
HttpResponse for Django. So every guarantee, option and record format is the ASGI
middleware's by construction.

On the way:
- the request body: read in the request's thread, whole up front when its Content-Length
  is within `max_body_bytes` (the middleware reads it whole anyway), else one chunk per
  call; the app then reads the body the middleware replays. Its Content-Length's bytes,
  never to the end of the stream: a body that ends short (gunicorn ends wsgi.input where
  the client disconnected) or a chunked body the server could not finish reading is the
  client gone (`ClientGone`), as an ASGI server's http.disconnect: nothing is claimed or
  run, and the request is answered as one whose client left;
- the response: a chunk that completes the Content-Length goes as the response's last
  message, after the app's iterable has been drained and closed, so the claim's publish
  comes before the client has the whole body; `close()` is called on the app's iterable
  in every case, in the request's thread. The last message reaches the request's thread
  with the middleware's end, in one hand-over (`Exchange.post`'s `last`): the middleware's
  closing step, the publish or the release, came before that message;
- a client that disconnects (the server closes the outer iterable early): the middleware's
  next send raises `ClientGone`, an OSError as an ASGI server's would, so the app's
  iterable is closed and the key released;
- an exception of the app: raised in the middleware as `Raised` (the key is released) and
  re-raised, the original, in the request's thread, where the server handles it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from .._claim import ClaimHolder, current, for_sync_code
from .._threads._exchange import DONE, Exchange, Raised
from .._threads._records import ThreadedTransaction, pending

__all__ = [
    "HANDOFF",
    "Body",
    "ClientGone",
    "Handoff",
    "Outer",
    "Responder",
    "latin1",
    "status_line",
    "thread_app",
]

HANDOFF = "goblin_idem.handoff"  # the scope key of the request's `Handoff`
END = {"type": "http.response.body", "body": b"", "more_body": False}
_DISCONNECT: Message = {"type": "http.disconnect"}
_END: Any = object()


class ClientGone(OSError):
    """The client disconnected: what the middleware's send raises, as an ASGI server's."""


class Responder:
    """The sync app run in its request's thread, its response as ASGI messages.

    `begin` runs the app and gives its response's chunks; `head` its status and headers,
    known once the first chunk is (a WSGI app may call start_response as late as that).
    Every method runs in the request's thread with the run's claim as `current`, and the
    records' transaction of the request (`tx`, if they keep it in this thread:
    `goblin_idem._threads._records`) begun before the app runs and current while it does."""

    def __init__(self) -> None:
        self.tx: ThreadedTransaction | None = None  # set by thread_app, before start
        self.start_message: Message | None = None  # the start handed over, as it went
        self.closed = False
        self.stopped = False  # the outer response was closed early: produce nothing more
        self._chunks: Iterator[bytes] = iter(())
        self._finite = False  # the chunks are a list or tuple: all there, none to wait for
        self._remaining: int | None = None  # of the Content-Length, once started

    def begin(self, body: bytes | None) -> Iterable[bytes]:
        raise NotImplementedError

    def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        raise NotImplementedError

    def close_iterable(self) -> None:
        raise NotImplementedError

    def pending(self) -> bytes | None:
        """Bytes the app wrote besides its iterable (WSGI's write()), if any."""
        return None

    # -- the calls the loop side makes --

    def start(self, body: bytes | None, holder: ClaimHolder | None) -> list[Message]:
        inside = self._enter(holder, begin=True)
        try:
            iterable = self.begin(body)
            self._finite = isinstance(iterable, (list, tuple))
            self._chunks = iter(iterable)
            return self._produce()
        finally:
            self._leave(inside)

    def more(self, holder: ClaimHolder | None) -> list[Message]:
        if self.stopped:  # the server is done with the response: the client left
            raise ClientGone("the client disconnected")
        inside = self._enter(holder)
        try:
            return self._produce()
        finally:
            self._leave(inside)

    def close(self, holder: ClaimHolder | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        inside = self._enter(holder)
        try:
            self.close_iterable()
        finally:
            self._leave(inside)

    def _enter(self, holder: ClaimHolder | None, begin: bool = False) -> tuple[Any, ...]:
        """The run's claim made `current` here, and the records' work (begun before the
        app's first call) the thread's current one: what `_leave` undoes."""
        held = current.set(holder)
        if self.tx is None:
            return (held,)
        try:
            work = self.tx.begin() if begin else self.tx.work
            return (held,) if work is None else (held, work, work.enter())
        except BaseException:
            current.reset(held)
            raise

    @staticmethod
    def _leave(inside: tuple[Any, ...]) -> None:
        if len(inside) > 1:
            inside[1].leave(inside[2])
        current.reset(inside[0])

    # -- the response, a chunk at a time --

    def _produce(self) -> list[Message]:
        chunk = self._next_chunk()
        messages: list[Message] = []
        if self.start_message is None:
            status, headers = self.head()
            self.start_message = {
                "type": "http.response.start",
                "status": status,
                "headers": headers,
            }
            messages.append(self.start_message)
            self._remaining = _content_length(headers)
        if chunk is None:
            self.close()
            messages.append(END)
            return messages
        more = True
        if self._remaining is not None:
            self._remaining -= len(chunk)
        if self._finite or (self._remaining is not None and self._remaining <= 0):
            rest = self._drain()  # the whole body is there: this is the last message
            chunk, more = chunk + rest if rest else chunk, False
        messages.append({"type": "http.response.body", "body": chunk, "more_body": more})
        return messages

    def _next_chunk(self) -> bytes | None:
        """The next non-empty chunk, or None at the end."""
        while True:
            chunk = self.pending()
            if chunk:
                return chunk
            chunk = next(self._chunks, _END)
            if chunk is _END:
                return self.pending()
            if type(chunk) is not bytes:
                if not isinstance(chunk, (bytes, bytearray, memoryview)):
                    raise TypeError(f"a response chunk must be bytes, not {type(chunk).__name__}")
                chunk = bytes(chunk)
            if chunk:
                return chunk

    def _drain(self) -> bytes:
        """The chunks after the Content-Length's last byte (none, from a correct app),
        then the iterable closed."""
        rest = []
        while (chunk := self._next_chunk()) is not None:
            rest.append(chunk)
        self.close()
        return b"".join(rest)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


class Handoff:
    """One request between its thread and the middleware: what the middleware reads
    (`receive`) and sends (`send`), on the loop thread."""

    __slots__ = ("_body", "_start", "consumed", "exchange", "gone", "read", "responder")

    def __init__(
        self,
        exchange: Exchange,
        responder: Responder,
        body: bytes | None,
        read: Callable[[], tuple[bytes, bool]] | None,
    ) -> None:
        self.exchange = exchange
        self.responder = responder
        self._body = body  # read up front, whole
        self.read = read  # else: the next chunk and whether more follow, in the thread
        self.consumed = False  # the middleware has read (some of) the body
        self.gone = False  # the client disconnected (set in the request's thread)
        self._start: Message | None = None

    async def receive(self) -> Message:
        body = self._body
        if body is not None:
            self._body = None
            self.consumed = True
            return {"type": "http.request", "body": body, "more_body": False}
        if self.read is None:  # the body was read whole; nothing else comes
            return _DISCONNECT
        self.consumed = True
        try:
            chunk, more = await self.exchange.call(self.read)
        except Raised as exc:
            if not isinstance(exc.error, ClientGone):
                raise
            self.read = None
            return _DISCONNECT  # the body was cut short: the middleware runs nothing
        if not more:
            self.read = None
        return {"type": "http.request", "body": chunk, "more_body": more}

    async def app_body(self, receive: Receive) -> bytes | None:
        """The body the app reads: the one the middleware read (it replays it), the one
        read up front, or None: the app reads the request's own stream."""
        if not self.consumed:
            return self._body
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def send(self, message: Message) -> None:
        """The outer response: a start is held back and handed over with the first body
        message (nothing reaches a sync server before it), the last body message with the
        middleware's end; other messages (trailers) have no sync equivalent and are
        dropped."""
        if self.gone:
            raise ClientGone("the client disconnected")
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind == "http.response.body":
            self.exchange.post((self._start, message), not message.get("more_body", False))
            self._start = None


async def thread_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app the middleware wraps: the request's own app, run in its thread."""
    handoff: Handoff = scope[HANDOFF]
    exchange, responder = handoff.exchange, handoff.responder
    body = await handoff.app_body(receive)
    holder = for_sync_code(current.get())
    responder.tx = pending()
    try:
        messages = await exchange.call(responder.start, body, holder)
        while True:
            for message in messages:
                await send(message)
            if not messages[-1].get("more_body", False):
                return
            messages = await exchange.call(responder.more, holder)
    finally:
        if not responder.closed:
            await exchange.call(responder.close, holder)


class Outer:
    """The middleware's response, as the request's thread receives it."""

    __slots__ = ("first", "handoff")

    def __init__(self, handoff: Handoff) -> None:
        self.handoff = handoff
        self.first: tuple[Message, Message] | None = None

    def begin(self) -> bool:
        """Serve the middleware until its response starts: False if it sent none (the
        client left before its body was read)."""
        item = self.handoff.exchange.next()
        if item is DONE:
            self.handoff.responder.close()
            return False
        self.first = item
        return True

    def abandon(self) -> None:
        """The request's thread gives up on the middleware (an error on its way out): the
        middleware is cancelled, unless it has ended."""
        exchange = self.handoff.exchange
        if exchange.done is None:
            exchange.abandon()

    @property
    def start(self) -> Message:
        assert self.first is not None
        return self.first[0]

    @property
    def passed_through(self) -> bool:
        """The app's own response start, as the app gave it (a first run)."""
        return self.start is self.handoff.responder.start_message

    def whole(self) -> bytes | None:
        """The body, if the first message was the last (once the middleware has ended: the
        last message came with its end, so this waits for nothing more)."""
        assert self.first is not None
        message = self.first[1]
        if message.get("more_body", False):
            return None
        self.finish()
        return bytes(message.get("body", b""))

    def finish(self) -> None:
        """Serve the middleware to its end; the app's iterable closed in any case."""
        try:
            self.handoff.exchange.wait()
        finally:
            self.handoff.responder.close()

    def chunks(self) -> Body:
        assert self.first is not None
        return Body(self, bytes(self.first[1].get("body", b"")))


class Body:
    """The rest of a streamed response, for the server to iterate and close."""

    __slots__ = ("_first", "outer")

    def __init__(self, outer: Outer, first: bytes) -> None:
        self.outer = outer
        self._first: bytes | None = first

    def __iter__(self) -> Body:
        return self

    def __next__(self) -> bytes:
        first = self._first
        if first is not None:
            self._first = None
            if first:
                return first
        exchange = self.outer.handoff.exchange
        while True:
            item = exchange.next()
            if item is DONE:
                self.outer.handoff.responder.close()
                raise StopIteration
            chunk: bytes = item[1].get("body", b"")
            if chunk:
                return bytes(chunk)

    def close(self) -> None:
        """The server is done with the response: early, the client left (the middleware's
        next send raises ClientGone, and the app's iterable is closed)."""
        handoff = self.outer.handoff
        handoff.responder.stopped = True
        if handoff.exchange.done is None and not handoff.exchange.abandoned:
            handoff.gone = True
            try:
                self.outer.finish()
            except ClientGone:
                pass
        handoff.responder.close()


def status_line(status: int) -> str:
    """A WSGI status line for `status`: its reason phrase, or UNKNOWN."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} UNKNOWN"


def latin1(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(name.decode("latin-1"), value.decode("latin-1")) for name, value in headers]
