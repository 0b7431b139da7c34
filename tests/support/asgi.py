"""A minimal ASGI driver: one request in, every message the app sent out.

httpx's ASGITransport hides what the tests here need to see (each body chunk, a client that
disconnects mid-request, the exact header list), so the middleware tests drive ASGI directly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.support.responses import PROBLEM


@dataclass
class Reply:
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # every message, as sent

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header(self, name: str) -> bytes | None:
        for n, v in self.headers:
            if n == name.lower().encode():
                return v
        return None

    def without(self, *names: str) -> list[tuple[bytes, bytes]]:
        drop = {n.lower().encode() for n in names}
        return [(n, v) for n, v in self.headers if n not in drop]


def http_scope(
    method: str = "POST",
    path: str = "/",
    headers: Sequence[tuple[str, str]] = (),
    query: bytes = b"",
) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query,
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }


async def request(
    app: ASGIApp,
    method: str = "POST",
    path: str = "/",
    *,
    key: str | None = None,
    body: bytes | Sequence[bytes] = b"",
    headers: Sequence[tuple[str, str]] = (),
    query: bytes = b"",
    disconnect: asyncio.Event | None = None,
    extensions: dict[str, Any] | None = None,
) -> Reply:
    """Send one request; `body` as a list is sent in that many chunks. Setting
    `disconnect` makes the client's next receive() answer http.disconnect; `extensions`
    are the ASGI extensions the server offers."""
    all_headers = list(headers)
    if key is not None:
        all_headers.append(("Idempotency-Key", key))
    chunks = [body] if isinstance(body, bytes) else list(body)
    scope = http_scope(method, path, all_headers, query)
    if extensions is not None:
        scope["extensions"] = extensions
    pending: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    gone = disconnect or asyncio.Event()
    reply = Reply()

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        reply.messages.append(message)
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            reply.chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return reply


class Handler:
    """An ASGI app that counts its runs and answers what the test scripts."""

    def __init__(
        self,
        status: int = 201,
        headers: list[tuple[bytes, bytes]] | None = None,
        chunks: list[bytes] | None = None,
        delay: float = 0.0,
        raises: BaseException | None = None,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.status = status
        self.headers = headers if headers is not None else [(b"content-type", b"text/plain")]
        self.chunks = chunks
        self.delay = delay
        self.raises = raises
        self.gate = gate  # a run waits for it after its body: held in flight until set
        self.runs = 0
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.runs += 1
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.raises is not None:
            raise self.raises
        chunks = self.chunks if self.chunks is not None else [b"run %d" % self.runs]
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        for i, chunk in enumerate(chunks):
            await send(
                {"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1}
            )


def problem(reply: Reply) -> dict[str, Any]:
    assert reply.header("content-type") == PROBLEM
    assert reply.header("content-length") == str(len(reply.body)).encode()
    data: dict[str, Any] = json.loads(reply.body)
    assert data["status"] == reply.status
    return data
