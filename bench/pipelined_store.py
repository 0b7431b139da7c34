"""A benchmark prototype, not part of goblin-idem: RedisStore with its two hot-path calls
(`claim`, `publish`) sent over one auto-pipelined connection instead of through redis-py.

It measures the change proposed for `goblin_idem/store.py` (see README.md): redis-py costs
40-90 us of CPU per call on this machine (pool checkout with a Condition, a wait_for task
per send when socket_timeout is set, retry and observability wrappers), while a request's
own work in goblin-idem is about 10 us. Here every caller on the event loop shares one
connection: commands issued in the same loop iteration go out in one write, and replies,
which Redis sends in order, resolve the callers' futures in turn (hiredis parses them).

Prototype limits: one standalone server, no socket timeout, no reconnect (a lost connection
fails the calls in flight; the next call opens a new one), no RESP3, no cluster. Everything
else (mode detection, NOSCRIPT handling, the other commands) is RedisStore's own.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any
from urllib.parse import urlparse

import hiredis
from redis.exceptions import ConnectionError, ResponseError

from goblin_idem import scripts
from goblin_idem.errors import invalid_expire
from goblin_idem.store import (
    ClaimReply,
    KeyT,
    RedisStore,
    as_bytes,
    caexpire_ms,
    check_size,
    claim_reply,
    claim_seconds,
)

# round trips made (one per call, however many calls share a write), for the benchmark's table
CALLS = [0]


def pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, int):
            arg = b"%d" % arg
        elif isinstance(arg, str):
            arg = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class PipelinedConnection(asyncio.Protocol):
    """One connection shared by every caller: writes coalesced per loop iteration, replies
    matched to callers in order."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.waiting: collections.deque[list[Any]] = collections.deque()  # [future, replies]
        self.pending: list[bytes] = []
        self.transport: Any = None
        self.lost: Exception | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = ConnectionError(f"connection lost: {exc!r}")
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(self.lost)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            head = self.waiting[0]
            head[1] -= 1
            if head[1] == 0:  # the last reply of the head's commands is its answer
                self.waiting.popleft()
                if not head[0].done():
                    head[0].set_result(reply)

    def _flush(self) -> None:
        if self.transport is not None and self.pending:
            self.transport.write(b"".join(self.pending))
        self.pending.clear()

    def send(self, packed: bytes, replies: int = 1) -> asyncio.Future[Any]:
        """Queue `packed` (holding `replies` commands); the future gets the last reply."""
        if self.lost is not None:
            raise self.lost
        CALLS[0] += 1
        if not self.pending:
            self.loop.call_soon(self._flush)
        self.pending.append(packed)
        future = self.loop.create_future()
        self.waiting.append([future, replies])
        return future


class PipelinedRedisStore(RedisStore):
    """RedisStore whose `claim` and `publish` use one shared pipelined connection."""

    def __init__(self, url: str, **kwargs: Any) -> None:
        from redis.asyncio import Redis

        super().__init__(Redis.from_url(url), **kwargs)
        self._owns_client = True
        parsed = urlparse(url)
        self._address = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        self._conn: PipelinedConnection | None = None
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> PipelinedConnection:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None or self._conn.lost is not None:
                loop = asyncio.get_running_loop()
                _, self._conn = await loop.create_connection(PipelinedConnection, *self._address)
            return self._conn

    async def claim(
        self, claim_key: KeyT, result_key: KeyT, token: KeyT, seconds: int
    ) -> ClaimReply:
        keys = (as_bytes(claim_key), as_bytes(result_key))
        tok = check_size(as_bytes(token, "token"), self.max_value_bytes)
        command = self._command(
            await self._resolved_mode(), scripts.CLAIM, keys, (tok, claim_seconds(seconds))
        )
        reply = await (await self._connection()).send(pack(command))
        if isinstance(reply, ResponseError):
            if str(reply).startswith("NOSCRIPT"):
                return await super().claim(claim_key, result_key, token, seconds)
            raise reply
        return claim_reply(reply)

    async def publish(
        self, result_key: KeyT, value: bytes, ttl_ms: int, claim_key: KeyT, token: KeyT
    ) -> int:
        rk, ck = as_bytes(result_key), as_bytes(claim_key)
        v = check_size(as_bytes(value, "value"), self.max_value_bytes)
        tok = as_bytes(token, "token")
        ttl = caexpire_ms(ttl_ms)
        if ttl <= 0:
            raise ResponseError(invalid_expire("set"))
        renew = self._command(await self._resolved_mode(), scripts.CAEXPIRE, (ck,), (tok, ttl))
        packed = b"".join(
            [pack(("MULTI",)), pack(("SET", rk, v, "PX", ttl)), pack(renew), pack(("EXEC",))]
        )
        executed = await (await self._connection()).send(packed, replies=4)
        if isinstance(executed, ResponseError):
            raise executed
        _, renewed = executed
        if isinstance(renewed, ResponseError):
            if str(renewed).startswith("NOSCRIPT"):  # RedisStore reloads; a second SET is harmless
                return await super().publish(result_key, value, ttl_ms, claim_key, token)
            raise renewed
        return int(renewed)

    async def aclose(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        await super().aclose()
