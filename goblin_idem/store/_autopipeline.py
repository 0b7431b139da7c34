"""AutoPipeline: one connection per event loop that every caller shares, for RedisStore's
hot path.

redis-py spends 40-90 us of CPU on each call (a pool checkout under a Condition, a
timeout scope, the retry wrapper, event dispatch), several times what a request costs
goblin-idem itself. Here every command issued during one turn of the event loop goes out
in one write; Redis answers a connection's commands in order, so each reply resolves the
caller at the head of the queue (hiredis parses the replies). Commands a caller hands over
together (a MULTI ... EXEC) are written back to back and answered together.

What each caller is promised is what it gets from a connection of its own: its commands
run in the order given, its replies are its own, errors come back in place as the same
exception classes redis-py raises. A blocking command (WAIT, BLPOP) must never be sent
here: it would hold up every other caller's reply.

Failure: a call unanswered after the socket timeout fails with TimeoutError (whether it ran
is unknown, as with any lost reply); its reply, if it comes later, is dropped, and the
calls behind it keep their own deadlines. A broken connection fails every call in flight
with ConnectionError, and the next call opens a new connection. A failed call is retried
only as the client's own ``retry`` policy says (redis-py's, which from_url leaves at no
retries), so both paths treat errors alike. A connection whose
oldest command has gone unanswered for much longer than replies usually take (`STALL_FACTOR`
times their moving average, and at least `STALL_SECONDS`) is presumed stuck: new calls go
to a fresh connection, as a pool would hand out another one, while the old one keeps its
calls until they are answered or time out and then closes. So a stalled socket fails only
what was already waiting on it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from asyncio import get_running_loop
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeAlias, cast

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._redis_compat import BaseParser, retries
from ._replay_cache import ReplayCache
from ._wire import Wire, pack
from ._wire import _pack_in_python as _pack_in_python  # where it was, for its test

try:
    import hiredis
except ImportError:  # pragma: no cover - the "fast" extra installs it
    hiredis = None  # type: ignore[assignment]

__all__ = ["HIREDIS", "AutoPipeline", "pack", "settings_of"]

logger = logging.getLogger("goblin_idem.store")

HIREDIS = hiredis is not None


class _NoPush(list[Any]):
    """Stands for hiredis's PushNotification where it has none (before 3.0)."""


#: The type hiredis gives a RESP3 push; without it a push reads as a reply, so no replay
#: cache (which needs RESP3) is turned on.
PushNotification: type[list[Any]] = getattr(hiredis, "PushNotification", _NoPush)
PUSHES = PushNotification is not _NoPush

#: How long the oldest unanswered command may wait before new calls avoid its connection:
#: STALL_FACTOR times the moving average of reply times, and at least STALL_SECONDS.
STALL_SECONDS = 0.25
STALL_FACTOR = 8
#: Stuck connections left to drain at most; beyond that, new calls queue on the newest.
MAX_DRAINING = 3
#: A replay cache answers only while its connection heard from the server this recently: a
#: server that stopped answering (a partition, a stuck primary) cannot send invalidations.
HEARD_SECONDS = 1.0
#: What turns a connection's replay cache on: RESP3, for invalidations pushed down the same
#: socket; no echo of the connection's own writes (NOLOOP: the store drops what it changes
#: itself, before and after); tracking of
#: only the reads that ask for it (``CLIENT CACHING YES``, tried
#: here once, so that an ACL refusing it turns the cache off; the PING after it takes the
#: flag and reads no key, and its reply, allowed or not, does not count).
_TRACKING: tuple[tuple[Any, ...], ...] = (
    ("HELLO", 3),
    ("CLIENT", "TRACKING", "ON", "OPTIN", "NOLOOP"),
    ("CLIENT", "CACHING", "YES"),
    ("PING",),
)


#: A caller's place in the reply queue: its future, how many replies it awaits, and when
#: it was sent (loop time). A tuple: made without a call, one object kept per caller.
_Waiter: TypeAlias = tuple[asyncio.Future[list[Any]], int, float]


class _Connection(asyncio.Protocol):
    """The socket, the reply queue and the single timer that watches its oldest entry."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, timeout: float | None, reply_time: float
    ) -> None:
        self.loop = loop
        self.timeout = timeout
        self.reply_time = reply_time  # moving average of send-to-reply seconds
        self.transport: asyncio.Transport | None = None
        self.reader = hiredis.Reader(replyError=BaseParser.parse_error)
        self.waiting: collections.deque[_Waiter] = collections.deque()
        # The replies of the head of `waiting`, so far (only its replies can be arriving)
        self.replies: list[Any] = []
        self.pending: list[bytes] = []
        self.timer: asyncio.TimerHandle | None = None
        self.broken: Exception | None = None
        self.retired = False  # replaced after a stall: close once nobody waits on it
        self.expired = 0  # waiters at the head of the queue already failed by their deadline
        self.cache: ReplayCache | None = None  # set once the server confirmed tracking
        self.heard = loop.time()  # when the server last sent anything

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, hence the cast
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        reason = f": {exc}" if exc is not None else ""
        self.fail(RedisConnectionError(f"Connection closed by server{reason}."))

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        reader.feed(data)
        now = self.heard = self.loop.time()
        waiting = self.waiting
        replies = self.replies
        try:
            while (reply := reader.gets()) is not False:
                if type(reply) is PushNotification:
                    self.pushed(reply)
                    continue
                future, count, sent = waiting[0]
                replies.append(reply)
                if len(replies) == count:
                    waiting.popleft()
                    if self.expired:
                        self.expired -= 1
                    else:
                        self.reply_time += (now - sent - self.reply_time) / 16
                        if not future.done():  # its caller may have been cancelled
                            future.set_result(replies)
                    replies = self.replies = []
            if self.retired and self.expired == len(waiting):
                self.fail(RedisConnectionError("Connection retired after a stall."))
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.fail(RedisConnectionError(f"Protocol error from the server: {exc!r}"))

    def pushed(self, push: list[Any]) -> None:
        """A RESP3 push: the server's invalidation of tracked keys (None: all of them, as
        after FLUSHALL). Nothing else is subscribed, so anything else clears the cache too."""
        cache = self.cache
        if cache is None:
            return
        if len(push) == 2 and push[0] == b"invalidate" and type(push[1]) is list:
            for key in push[1]:
                cache.discard(key)
        else:
            cache.clear()

    def drop_cache(self) -> None:
        """The connection no longer tracks, or no longer serves: forget every result."""
        cache, self.cache = self.cache, None
        if cache is not None:
            cache.clear()

    def serving(self, now: float) -> ReplayCache | None:
        """The cache, while its results may be served at `now` (the loop's clock, or
        `time.monotonic()` in another thread, never behind it): the connection is up, has
        heard from the server within `HEARD_SECONDS`, and is not stalled."""
        cache = self.cache
        if cache is None or now - self.heard > HEARD_SECONDS:
            return None
        if self.waiting and self.stalled(now):
            return None
        return cache

    # -- sending --

    def send(self, packed: bytes, count: int, now: float) -> asyncio.Future[list[Any]]:
        """Queue `packed` (`count` commands) for this turn's write, sent at `now` (the loop's
        time); the future gets their replies, errors in place."""
        if self.broken is not None:
            raise self.broken
        loop = self.loop
        future: asyncio.Future[list[Any]] = loop.create_future()
        pending = self.pending
        if not pending:
            loop.call_soon(self._flush)
        pending.append(packed)
        self.waiting.append((future, count, now))
        if self.timer is None and self.timeout is not None:
            self.timer = loop.call_at(now + self.timeout, self._check_timeout)
        return future

    def stalled(self, now: float | None = None) -> bool:
        """Has the oldest unanswered command waited suspiciously long (at `now`, by
        default the loop's time)?"""
        try:
            sent = self.waiting[0][2]
        except IndexError:  # none, or answered meanwhile by the loop's thread
            return False
        waited = (self.loop.time() if now is None else now) - sent
        return waited > STALL_SECONDS and waited > STALL_FACTOR * self.reply_time

    def retire(self) -> None:
        self.retired = True
        self.drop_cache()
        if self.expired == len(self.waiting):
            self.fail(RedisConnectionError("Connection retired after a stall."))

    def _flush(self) -> None:
        if self.pending and self.transport is not None and self.broken is None:
            self.transport.write(b"".join(self.pending))
        self.pending.clear()

    def _check_timeout(self) -> None:
        """One timer at a time, set for the earliest deadline still ahead. A late call fails
        alone: its reply, should it come, is matched and dropped, so the calls behind it
        keep their own deadlines (deadlines rise along the queue)."""
        self.timer = None
        if self.broken is not None:
            return
        now = self.loop.time()
        waiting = self.waiting
        timeout = self.timeout or 0.0
        while self.expired < len(waiting):
            future, _, sent = waiting[self.expired]
            if sent + timeout > now:
                self.timer = self.loop.call_at(sent + timeout, self._check_timeout)
                return
            self.expired += 1
            if not future.done():
                future.set_exception(
                    RedisTimeoutError("Timeout reading from the store (socket_timeout)")
                )
        if self.retired:  # nobody waits for what is left on it
            self.fail(RedisConnectionError("Connection retired after a stall."))

    def fail(self, exc: Exception) -> None:
        """Fail everything in flight with `exc` and drop the connection for good."""
        if self.broken is None:
            self.broken = exc
        self.drop_cache()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.pending.clear()
        self.replies = []
        while self.waiting:
            future = self.waiting.popleft()[0]
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()


class AutoPipeline:
    """Commands of many concurrent callers over one shared connection per event loop.

    Built from a redis-py client's connection settings (host and port or unix path,
    username, password, db, client name, timeouts) by `for_client`, which declines what
    it cannot reproduce (TLS, a credential provider, a custom connection class, no
    hiredis): the caller then keeps using redis-py.
    """

    def __init__(
        self,
        *,
        host: str = "localhost",
        port: int = 6379,
        path: str | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        client_name: str | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
        retry: Retry | None = None,
        replay_cache_bytes: int = 0,
    ) -> None:
        if not HIREDIS:
            raise RuntimeError("AutoPipeline needs hiredis (pip install 'goblin-idem[fast]')")
        self.host, self.port, self.path = host, port, path
        self.timeout = socket_timeout
        self.connect_timeout = socket_connect_timeout or socket_timeout
        retried = retries(retry)
        self.retry = retry if retry is not None and retried != 0 else None
        handshake: list[tuple[Any, ...]] = []
        if password is not None:
            handshake.append(("AUTH", username, password) if username else ("AUTH", password))
        if db:
            handshake.append(("SELECT", db))
        if client_name:
            handshake.append(("CLIENT", "SETNAME", client_name))
        self._handshake = handshake
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._draining: list[_Connection] = []
        self.opened = 0  # connections opened so far (one, unless some broke or stalled)
        # Each connection's replay cache budget; 0: none (no RESP3, no tracking).
        self.replay_cache_bytes = replay_cache_bytes if PUSHES else 0

    @classmethod
    def for_client(cls, client: object, replay_cache_bytes: int = 0) -> AutoPipeline | None:
        """One with `client`'s connection settings, or None where it could not honour them."""
        if type(client) is not redis.asyncio.Redis:
            return None
        pool = client.connection_pool
        kwargs = pool.connection_kwargs
        common = settings_of(kwargs)
        if common is None:
            return None
        common["replay_cache_bytes"] = replay_cache_bytes
        if pool.connection_class is redis.asyncio.Connection:
            host = kwargs.get("host") or "localhost"
            return cls(host=host, port=int(kwargs.get("port") or 6379), **common)
        if pool.connection_class is redis.asyncio.UnixDomainSocketConnection:
            return cls(path=kwargs["path"], **common)
        return None

    @property
    def address(self) -> str:
        return self.path or f"{self.host}:{self.port}"

    def execute(self, commands: Sequence[Sequence[Any]] | Wire) -> Awaitable[list[Any]]:
        """Send `commands` (or a step's `Wire`, as it is) back to back; their replies,
        errors in place (only a broken or timed-out connection raises). Without retries,
        the reply future itself: awaited at once by its caller, with no coroutine of its
        own on the hot path."""
        if type(commands) is tuple and type(commands[0]) is bytes:
            packed, count = commands
        else:
            packed, count = pack(cast(Sequence[Sequence[Any]], commands)), len(commands)
        if self.retry is None:
            return self._send(packed, count)
        return self.retry.call_with_retry(lambda: self._send(packed, count), _ignore)

    def _send(self, packed: bytes, count: int) -> Awaitable[list[Any]]:
        """The reply future itself on a usable connection: no coroutine per call."""
        conn = self._conn
        if conn is None or conn.broken is not None or conn.loop is not get_running_loop():
            return self._send_on_new(packed, count)
        now = conn.loop.time()
        waiting = conn.waiting
        if waiting:  # stalled? (`_Connection.stalled`, inline: the hot path's one test)
            waited = now - waiting[0][2]
            if waited > STALL_SECONDS and waited > STALL_FACTOR * conn.reply_time:
                return self._send_on_new(packed, count)
        return conn.send(packed, count, now)

    async def _send_on_new(self, packed: bytes, count: int) -> list[Any]:
        conn = await self._connection()
        return await conn.send(packed, count, conn.loop.time())

    async def _connection(self) -> _Connection:
        loop = asyncio.get_running_loop()
        current = self._conn
        if current is not None and current.broken is None and current.loop is loop:
            # Stalled: replace it, unless enough stuck ones are draining already (then
            # the server itself is slow, and more connections would not help).
            self._draining = [c for c in self._draining if c.broken is None]
            if len(self._draining) >= MAX_DRAINING:
                return current
        task = self._connecting
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._connecting = loop.create_task(self._open(loop))
            task.add_done_callback(_retrieve)
        return await asyncio.shield(task)  # a cancelled caller leaves the others' connect be

    async def _open(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        previous = self._conn
        reply_time = previous.reply_time if previous is not None else 0.0

        def factory() -> _Connection:
            return _Connection(loop, self.timeout, reply_time)

        try:
            if self.path is not None:
                connect = loop.create_unix_connection(factory, self.path)
            else:
                connect = loop.create_connection(factory, self.host, self.port)
            _, conn = await asyncio.wait_for(connect, self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            detail = str(exc) or type(exc).__name__
            raise RedisConnectionError(f"Error connecting to {self.address}: {detail}") from None
        handshake = self._handshake
        tracking = self.replay_cache_bytes > 0
        commands = [*handshake, *_TRACKING] if tracking else handshake
        if commands:
            replies = await conn.send(pack(commands), len(commands), loop.time())
            errors = [r for r in replies[: len(handshake)] if isinstance(r, Exception)]
            if errors:
                conn.fail(errors[0])
                raise errors[0]
            if tracking:
                self._start_tracking(conn, replies[len(handshake) :])
        if self._connecting is not asyncio.current_task():  # closed meanwhile
            closed = RedisConnectionError("Connection closed by the client.")
            conn.fail(closed)
            raise closed
        self.opened += 1
        old, self._conn = self._conn, conn
        if old is not None and old.broken is None and old.loop is loop:
            old.retire()
            self._draining.append(old)
        return conn

    def forget(self) -> list[object]:
        """Drop the connections without closing them, for a fork's child (they are the
        parent's sockets) or after their event loop closed; the next call opens a new one.
        The dropped connections are returned, for the caller to keep from the collector."""
        dropped = [c for c in (self._conn, *self._draining) if c is not None]
        self._conn, self._connecting, self._draining = None, None, []
        for conn in dropped:
            conn.drop_cache()  # a child's copy: the parent's own cache is untouched
        return list(dropped)

    # -- the replay cache (`_replay_cache`) --

    def _start_tracking(self, conn: _Connection, replies: list[Any]) -> None:
        """The replies of HELLO 3 and CLIENT TRACKING: the connection gets its cache only
        once the server confirmed both; if it refused, no connection of this pipeline
        tries again (an old server, or an ACL that refuses HELLO or CLIENT)."""
        refused = [r for r in replies[:-1] if isinstance(r, Exception)]
        if not refused:
            conn.cache = ReplayCache(self.replay_cache_bytes)
            return
        self.replay_cache_bytes = 0
        logger.warning(
            "goblin-idem store: %s refused client-side tracking (%s): the replay cache is "
            "off and every replay reads the store; allow +hello +client|tracking "
            "+client|caching (Redis or Valkey 6 or later), or pass replay_cache_bytes=0",
            self.address,
            refused[0],
        )

    def cached(self, key: bytes, now: float | None = None) -> bytes | None:
        """`key`'s result from the current connection's replay cache, while it serves.
        Another thread may ask, with `now` from `time.monotonic()`: the loop's clock reads
        the same source (uvloop's at the start of each turn, so never ahead of it), so
        expiries and the server's last word come out sooner there, never later; entries are
        read without the cache's lock (`_replay_cache`)."""
        conn = self._conn
        if conn is None:
            return None
        cache = conn.cache
        if cache is None or key not in cache.entries:  # a miss (every first run) ends here
            return None
        if now is None:
            now = conn.loop.time()
        return None if conn.serving(now) is None else cache.get(key, now)

    def fill(self, key: bytes, claim: bytes) -> None:
        """Read result `key` into the cache, in the background: its GET and the PTTLs of it
        and of its `claim` in one MULTI/EXEC that ``CLIENT CACHING YES`` tracks, on the
        connection whose cache it fills (no task: the reply's callback keeps it). Nothing
        if already kept or under way, or with no cache."""
        conn = self._usable()
        cache = None if conn is None else conn.cache
        if conn is None or cache is None or not cache.start(key, claim):
            return
        sent = conn.loop.time()
        commands = [
            ("CLIENT", "CACHING", "YES"),
            ("MULTI",),
            ("GET", key),
            ("PTTL", key),
            ("PTTL", claim),
            ("EXEC",),
        ]
        future = conn.send(pack(commands), len(commands), sent)
        future.add_done_callback(functools.partial(cache.filled, key, claim, sent))

    def discard(self, key: bytes) -> None:
        """Forget `key`'s result in every connection's cache (any thread may call it)."""
        for conn in (self._conn, *self._draining):
            if conn is not None and conn.cache is not None:
                conn.cache.discard(key)

    def _usable(self) -> _Connection | None:
        """The current connection, if `_send` would use it as it is (a fill must go out on
        the connection whose cache it fills)."""
        conn = self._conn
        if (
            conn is None
            or conn.broken is not None
            or conn.loop is not asyncio.get_running_loop()
            or (conn.waiting and conn.stalled())
        ):
            return None
        return conn

    async def aclose(self) -> None:
        """Close the connection; calls still in flight fail, a later call opens a new one."""
        conn, self._conn = self._conn, None
        self._connecting = None  # a connect still under way sees this and closes its own
        draining, self._draining = self._draining, []
        for c in (conn, *draining):
            if c is not None and c.broken is None:
                c.fail(RedisConnectionError("Connection closed by the client."))


def settings_of(kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """AutoPipeline's settings but the address, from a redis-py client's connection keywords
    (a cluster client's `get_connection_kwargs()`: one pipeline per node is then made with
    each node's host and port); None where they cannot be honoured (a credential provider,
    no hiredis). The connection class (TLS, a custom one) is the caller's to check."""
    if not HIREDIS or kwargs.get("credential_provider") is not None:
        return None
    return {
        "username": kwargs.get("username"),
        "password": kwargs.get("password"),
        "db": int(kwargs.get("db") or 0),
        "client_name": kwargs.get("client_name"),
        "socket_timeout": kwargs.get("socket_timeout"),
        "socket_connect_timeout": kwargs.get("socket_connect_timeout"),
        "retry": kwargs.get("retry"),
    }


async def _ignore(error: Exception) -> None:
    """A retry's failure handler: the failed connection has already dealt with itself."""


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a failed connect as seen: its callers may all have been cancelled."""
    if not task.cancelled():
        task.exception()
