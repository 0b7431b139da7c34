"""A small HTTP/1.1 keep-alive client for load: raw bytes in, status, raw headers and body out.

The load scenarios send thousands of requests from one Python process to servers on the same
two cores; a general-purpose client spends more CPU per request than the server under test,
so this one does only what they need (Content-Length or chunked bodies, keep-alive, a
timeout) and hands back the exact header list and body bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

IDLE_S = 3.0  # uvicorn closes a kept-alive connection after 5 s without a request


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n == name:
                return v
        return None


class HttpPool:
    def __init__(self, port: int, size: int = 64, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self._idle: list[tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], float]] = []
        self._slots = asyncio.Semaphore(size)

    async def request(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
        timeout: float = 30.0,
    ) -> Response:
        async with self._slots:
            return await asyncio.wait_for(self._request(method, path, headers, body), timeout)

    async def post(
        self, path: str, key: str | None = None, body: bytes = b"", **headers: str
    ) -> Response:
        hs = [(k.replace("_", "-"), v) for k, v in headers.items()]
        if key is not None:
            hs.append(("Idempotency-Key", key))
        return await self.request("POST", path, hs, body)

    async def _request(
        self, method: str, path: str, headers: list[tuple[str, str]] | None, body: bytes
    ) -> Response:
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in headers or ()]
        head.append(f"Content-Length: {len(body)}")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        while True:
            reused = bool(self._idle)
            conn, used_at = self._idle.pop() if reused else (await self._connect(), 0.0)
            reader, writer = conn
            if reused and time.monotonic() - used_at > IDLE_S:
                writer.transport.abort()  # the server may have closed it meanwhile
                continue
            try:
                writer.write(data)
                response = await self._read(reader)
            except (asyncio.IncompleteReadError, ConnectionResetError) as exc:
                writer.transport.abort()
                # A kept-alive connection the server closed just before this request: no
                # byte of an answer came back, so send it again on a new connection.
                if reused and not (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                    continue
                raise
            except BaseException:
                writer.transport.abort()
                raise
            if response.header(b"connection") == b"close":
                writer.transport.abort()
            else:
                self._idle.append((conn, time.monotonic()))
            return response

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port, limit=1 << 24)

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> Response:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers.append((name.strip().lower(), value.strip()))
        response = Response(status, headers)
        length = response.header(b"content-length")
        if length is not None:
            response.body = await reader.readexactly(int(length))
        elif response.header(b"transfer-encoding") == b"chunked":
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                chunks.append(chunk[:-2])
            response.body = b"".join(chunks)
        return response

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for (_, writer), _ in idle:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def __aenter__(self) -> HttpPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
