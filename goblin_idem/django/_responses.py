"""Django's responses as ASGI messages, and back.

The app's response goes to the ASGI middleware as Django's ASGI handler would send it
(headers as `response.items()`, each cookie a Set-Cookie header). Passed through (a first
run), the very response object goes back to Django, its streamed content then the
middleware's (which copies it on its way); a response the middleware writes itself (a
replay, a refusal) is a new HttpResponse, its Set-Cookie headers loaded as cookies and
other repeated headers joined with commas (a Django response holds one value per name).
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Coroutine, Iterable
from contextlib import aclosing
from typing import Any

from django.http import FileResponse, HttpRequest, HttpResponse, StreamingHttpResponse  # type: ignore[import-untyped]
from django.http.response import HttpResponseBase  # type: ignore[import-untyped]
from starlette.types import Message, Receive, Scope, Send

from ..wsgi._bridge import END, HANDOFF, ClientGone, Responder

__all__ = [
    "BLOCK_BYTES",
    "DJANGO_REQUEST",
    "AsyncCall",
    "DjangoResponder",
    "chunked",
    "django_app",
    "response_of",
    "start_message",
]

DJANGO_REQUEST = "django.request"  # the scope key of the HttpRequest, for a scope= function
BLOCK_BYTES = 64 * 1024  # a FileResponse's block, at least: one chunk per block


def start_message(response: HttpResponseBase) -> Message:
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in response.items()
    ]
    headers += [
        (b"set-cookie", cookie.output(header="").strip().encode("latin-1"))
        for cookie in response.cookies.values()
    ]
    return {"type": "http.response.start", "status": response.status_code, "headers": headers}


def response_of(start: Message, body: bytes | Iterable[bytes]) -> HttpResponseBase:
    """A response the middleware wrote (a replay, a refusal), as Django's. Its headers are
    gathered first (by lowercased name) and given to the constructor at once: setting them
    one by one, after Django's default Content-Type, took nearly twice as long."""
    raw = tuple(start.get("headers", ()))
    gathered = _gathered.get(raw)
    if gathered is None:
        gathered = _gather(raw)
        if len(_gathered) >= _GATHERED_KEPT:
            _gathered.clear()
        _gathered[raw] = gathered
    headers, cookies, typed = gathered
    response: HttpResponseBase
    if isinstance(body, bytes):
        response = HttpResponse(body, status=start["status"], headers=headers)
    else:
        response = StreamingHttpResponse(body, status=start["status"], headers=headers)
    if not typed:
        del response.headers["Content-Type"]  # Django's default: the message has none
    for cookie in cookies:
        response.cookies.load(cookie)
    return response


Gathered = tuple[dict[str, str], tuple[str, ...], bool]

# The headers of the responses the middleware writes, as `response_of` gives them to Django,
# by the messages' headers: a key's replays repeat the same ones (the very same bytes
# objects, whose hashes are kept), so they are gathered once, not at every replay. Bounded
# by count (Django copies the dict it is given, so an entry is never changed).
_gathered: dict[tuple[tuple[bytes, bytes], ...], Gathered] = {}
_GATHERED_KEPT = 256


def _gather(raw: Iterable[tuple[bytes, bytes]]) -> Gathered:
    """Headers by name, repeated ones joined with commas, but Set-Cookie (loaded as
    cookies); and whether a Content-Type was among them."""
    gathered: dict[str, tuple[str, str]] = {}
    cookies: list[str] = []
    for raw_name, raw_value in raw:
        name, value = raw_name.decode("latin-1"), raw_value.decode("latin-1")
        folded = name.lower()
        if folded == "set-cookie":
            cookies.append(value)
        elif folded in gathered:
            gathered[folded] = (name, f"{gathered[folded][1]}, {value}")
        else:
            gathered[folded] = (name, value)
    return dict(gathered.values()), tuple(cookies), "content-type" in gathered


def _blocks(response: HttpResponseBase) -> HttpResponseBase:
    if isinstance(response, FileResponse):
        response.block_size = max(response.block_size, BLOCK_BYTES)
    return response


def chunked(request: HttpRequest) -> bool:
    """A request under WSGI whose body has no Content-Length but ends where the server
    says (wsgi.input_terminated: a chunked body)."""
    meta = request.META
    return not meta.get("CONTENT_LENGTH") and bool(meta.get("wsgi.input_terminated"))


class DjangoResponder(Responder):
    """The rest of the middleware chain and the view, run in the request's thread; the
    response is closed by whoever ends up with it (Django, if it is passed through)."""

    def __init__(self, get_response: Any, request: HttpRequest) -> None:
        super().__init__()
        self.get_response = get_response
        self.request = request
        self.response: HttpResponseBase | None = None

    def begin(self, body: bytes | None) -> Iterable[bytes]:
        # The body: Django's request holds it, read (request.body) as the middleware did;
        # a chunked one, which Django under WSGI leaves unread, the middleware read.
        if body is not None and chunked(self.request):
            self.request._body = body  # what Django's own read of request.body sets
            self.request._stream = io.BytesIO(body)
        response = self.response = _blocks(self.get_response(self.request))
        if response.streaming:
            chunks: Iterable[bytes] = iter(response)
            return chunks
        return [response.content]

    def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        assert self.response is not None
        message = start_message(self.response)
        return message["status"], message["headers"]

    def close_iterable(self) -> None:
        """Nothing here: the response is closed by Django once handed to it, else by the
        middleware (`DjangoResponder.discard`)."""

    def discard(self) -> None:
        """Close the response that will not reach Django (a run that failed on its way)."""
        if self.response is not None:
            self.response.close()


class AsyncCall:
    """One request of the async path, on the request's loop: the rest of Django's chain
    awaited as the middleware's app (`django_app`), and the middleware's response as it
    comes (`send`, `next`). A send waits while the message before it is not taken yet
    (back-pressure), and raises ClientGone once Django stops reading (the client left)."""

    def __init__(self, get_response: Any, request: HttpRequest, body: bytes | None) -> None:
        self.get_response = get_response
        self.request = request
        self.response: HttpResponseBase | None = None
        self.start_message: Message | None = None
        self.task: asyncio.Task[None] | None = None
        self.gone = False
        self._body = body
        self._start: Message | None = None
        self._items: asyncio.Queue[tuple[Message | None, Message] | None] = asyncio.Queue()
        self._room = asyncio.Semaphore(1)

    async def receive(self) -> Message:
        body = self._body
        if body is None:
            body = self.request.body  # read whole by Django's ASGI handler: no I/O here
        self._body = b""
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind == "http.response.body":
            await self._room.acquire()
            if self.gone:
                raise ClientGone("the client disconnected")
            self._items.put_nowait((self._start, message))
            self._start = None

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        self.task = asyncio.ensure_future(coro)
        self.task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._items.put_nowait(None)  # for `next`, which raises the task's error
        if self.gone and not task.cancelled():
            task.exception()  # nobody reads on: the ClientGone it ended with is expected

    async def next(self) -> tuple[Message | None, Message] | None:
        """The middleware's next message; None once it has ended (its error raised)."""
        item = await self._items.get()
        if item is not None:
            self._room.release()
            return item
        assert self.task is not None
        self.task.result()
        return None

    def leave(self) -> None:
        """Django stopped reading the response: the middleware's next send raises."""
        self.gone = True
        self._room.release()

    def stream(self, first: bytes) -> AsyncBody:
        return AsyncBody(self, first)


class AsyncBody:
    """The rest of a streamed response, for Django to iterate (`async for`) and close (as
    a response closes its content, iterated or not: early, the client left)."""

    def __init__(self, call: AsyncCall, first: bytes) -> None:
        self.call = call
        self._first: bytes | None = first

    def __aiter__(self) -> AsyncBody:
        return self

    async def __anext__(self) -> bytes:
        first = self._first
        if first:
            self._first = None
            return first
        self._first = None
        while (item := await self.call.next()) is not None:
            chunk = item[1].get("body", b"")
            if chunk:
                return bytes(chunk)
        raise StopAsyncIteration

    def close(self) -> None:
        task = self.call.task
        if task is not None and not task.done():
            self.call.leave()


async def django_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app the async path's middleware wraps: the rest of Django's chain."""
    call: AsyncCall = scope[HANDOFF]
    response = call.response = _blocks(await call.get_response(call.request))
    call.start_message = start_message(response)
    await send(call.start_message)
    if not response.streaming:
        body = response.content
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    remaining = _length(call.start_message)
    async with aclosing(aiter(response)) as content:
        async for part in content:
            if not part:
                continue
            if remaining is not None:
                remaining -= len(part)
                if remaining <= 0:  # the whole body: drained, then sent as the last message
                    rest = [p async for p in content]
                    await send({"type": "http.response.body", "body": b"".join([part, *rest])})
                    return
            await send({"type": "http.response.body", "body": bytes(part), "more_body": True})
    await send(END)


def _length(start: Message) -> int | None:
    for name, value in start["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
