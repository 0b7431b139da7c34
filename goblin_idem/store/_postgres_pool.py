"""How PostgresStore's statements reach the server: asyncpg or psycopg 3, on a pool of its
own per event loop or on an SQLAlchemy AsyncEngine's pool.

Promises: a statement is one round trip on a connection that is idle in autocommit (no
BEGIN, no COMMIT, no reset or ping when a connection is taken or given back: the own pool
hands back the connection as it was, and an engine whose pool pings is refused). A
connection that failed with the database unreachable, a timeout or a cancellation is
closed, never reused; any other error (the server answered) leaves it in the pool.

Failure modes: no connection within `timeout` (the pool exhausted, the server not
answering) and a connection lost are both the database unavailable: raised as redis-py's
`ConnectionError` naming the database, which every front door answers as a store outage
(503, UNAVAILABLE, no ack). A missing table is a `ResponseError` that says how to create
it. Connections belong to the loop they were opened on (a store shared by threads that
each run a loop has a pool per loop), and a fork's child opens its own.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import sys
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from redis.exceptions import ConnectionError as StoreConnectionError
from redis.exceptions import ResponseError

from .._log import describe
from .._unavailable import sqlstate_unavailable
from ._postgres_sql import Statement

__all__ = ["Driver", "driver_for_engine", "driver_for_url", "unavailable"]

# Besides the classes every database part reads as "cannot serve now" (`_unavailable`):
# 25006, a read-only transaction: a standby answering where the primary was, until a
# failover ends.
READ_ONLY_SQLSTATE = "25006"
UNDEFINED_TABLE = "42P01"


def unavailable(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says the database cannot be reached or serve now."""
    error: BaseException | None = exc
    for _ in range(6):
        if error is None:
            return False
        if isinstance(error, (OSError, asyncio.TimeoutError, StoreConnectionError)):
            return True
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str) and (
            sqlstate_unavailable(sqlstate) or sqlstate == READ_ONLY_SQLSTATE
        ):
            return True
        if _driver_connection_error(error):
            return True
        wrapped = getattr(error, "orig", None)
        error = wrapped if isinstance(wrapped, BaseException) else error.__cause__
    return False


def _driver_connection_error(error: BaseException) -> bool:
    """A driver's own word for a connection closed or gone (no SQLSTATE to say so)."""
    asyncpg = sys.modules.get("asyncpg")
    if asyncpg is not None and isinstance(
        error, (asyncpg.InterfaceError, asyncpg.PostgresConnectionError)
    ):
        return True
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(
        error, (psycopg.OperationalError, psycopg.InterfaceError)
    ):
        return True
    sqlalchemy_exc = sys.modules.get("sqlalchemy.exc")
    return sqlalchemy_exc is not None and isinstance(
        error, (sqlalchemy_exc.TimeoutError, sqlalchemy_exc.DisconnectionError)
    )


class _Dialect(Protocol):
    """One driver's calls on one of its connections."""

    async def row(
        self, conn: Any, stmt: Statement, args: Sequence[Any]
    ) -> Sequence[Any] | None: ...
    async def rows(
        self, conn: Any, stmt: Statement, args: Sequence[Any]
    ) -> list[Sequence[Any]]: ...
    async def script(self, conn: Any, sql: str) -> None: ...
    def idle(self, conn: Any) -> bool: ...


class _Asyncpg:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def row(self, conn: Any, stmt: Statement, args: Sequence[Any]) -> Sequence[Any] | None:
        row: Sequence[Any] | None = await conn.fetchrow(stmt.asyncpg, *args, timeout=self.timeout)
        return row

    async def rows(self, conn: Any, stmt: Statement, args: Sequence[Any]) -> list[Sequence[Any]]:
        rows: list[Sequence[Any]] = await conn.fetch(stmt.asyncpg, *args, timeout=self.timeout)
        return rows

    async def script(self, conn: Any, sql: str) -> None:
        await conn.execute(sql, timeout=self.timeout)

    def idle(self, conn: Any) -> bool:
        return not conn.is_closed() and not conn.is_in_transaction()


class _Psycopg:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout

    async def row(self, conn: Any, stmt: Statement, args: Sequence[Any]) -> Sequence[Any] | None:
        cursor = await asyncio.wait_for(conn.execute(stmt.psycopg, args, binary=True), self.timeout)
        row: Sequence[Any] | None = await cursor.fetchone()
        return row

    async def rows(self, conn: Any, stmt: Statement, args: Sequence[Any]) -> list[Sequence[Any]]:
        cursor = await asyncio.wait_for(conn.execute(stmt.psycopg, args, binary=True), self.timeout)
        rows: list[Sequence[Any]] = await cursor.fetchall()
        return rows

    async def script(self, conn: Any, sql: str) -> None:
        await asyncio.wait_for(conn.execute(sql), self.timeout)

    def idle(self, conn: Any) -> bool:
        from psycopg.pq import TransactionStatus

        return not conn.closed and conn.pgconn.transaction_status == TransactionStatus.IDLE


class _Pool:
    """The connections of one event loop: taken from the idle ones without awaiting, opened
    up to `size`, else waited for up to `timeout` (then the database is unavailable)."""

    def __init__(self, driver: _OwnPool) -> None:
        self.driver = driver
        self.idle: list[Any] = []
        self.opened = 0
        self.waiters: collections.deque[asyncio.Future[Any]] = collections.deque()

    async def acquire(self) -> Any:
        if self.idle:
            return self.idle.pop()
        if self.opened < self.driver.size:
            self.opened += 1
            try:
                return await asyncio.wait_for(self.driver.connect(), self.driver.timeout)
            except BaseException:
                self.opened -= 1
                self._wake()
                raise
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, self.driver.timeout)
        except asyncio.TimeoutError:
            raise asyncio.TimeoutError(
                f"no connection free within {self.driver.timeout} s "
                f"(all {self.driver.size} of the pool in use)"
            ) from None
        finally:
            if waiter in self.waiters:
                self.waiters.remove(waiter)

    def release(self, conn: Any, usable: bool) -> None:
        if not usable:
            self.opened -= 1
            self.driver.discard(conn)
            self._wake()
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append(conn)

    def _wake(self) -> None:
        """A slot came free without a connection: the first waiter opens one."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_Retry())
                return

    def close(self) -> list[Any]:
        idle, self.idle = self.idle, []
        return idle


class _Retry(Exception):
    """A waiter's slot freed without a connection: it should open one itself."""


class Driver:
    """Runs statements, one connection per statement, and says what failed in the words
    the front doors understand (see the module docstring)."""

    name: str
    where: str
    table: str

    def __init__(self, dialect: _Dialect, where: str, table: str) -> None:
        self.dialect = dialect
        self.where = where
        self.table = table

    async def _take(self) -> Any:
        raise NotImplementedError

    async def _give(self, conn: Any, usable: bool) -> None:
        raise NotImplementedError

    async def row(self, stmt: Statement, args: Sequence[Any]) -> Sequence[Any] | None:
        row: Sequence[Any] | None = await self._on_connection(self.dialect.row, stmt, args)
        return row

    async def rows(self, stmt: Statement, args: Sequence[Any]) -> list[Sequence[Any]]:
        rows: list[Sequence[Any]] = await self._on_connection(self.dialect.rows, stmt, args)
        return rows

    async def script(self, sql: str) -> None:
        await self._on_connection(self.dialect.script, sql)

    async def _on_connection(self, call: Any, *args: Any) -> Any:
        """`call(conn, *args)` on a connection taken for it and given back after."""
        try:
            conn = await self._take()
        except Exception as exc:
            named = self._named(exc)
            if named is not exc:
                raise named from exc
            raise
        try:
            result = await call(conn, *args)
        except BaseException as exc:
            # Kept only if the server answered (an error of the statement's own) and the
            # connection is idle; a cancellation or a lost connection closes it.
            answered = getattr(exc, "sqlstate", None) is not None and not unavailable(exc)
            await self._give(conn, answered and self.dialect.idle(conn))
            said: BaseException = self._named(exc) if isinstance(exc, Exception) else exc
            if said is not exc:
                raise said from exc
            raise
        await self._give(conn, True)
        return result

    def _named(self, exc: Exception) -> Exception:
        if unavailable(exc):
            return StoreConnectionError(
                f"the PostgreSQL store at {self.where} is unavailable: {describe(exc)}"
            )
        if getattr(exc, "sqlstate", None) == UNDEFINED_TABLE:
            return ResponseError(
                f"the PostgreSQL store's table {self.table} does not exist at {self.where}: "
                "create it with `await store.create_table()` or the DDL that "
                "`python -m goblin_idem postgres-ddl` prints"
            )
        return exc

    async def aclose(self) -> None:
        raise NotImplementedError

    def after_fork(self) -> None:
        """In a fork's child: forget the parent's connections without touching them."""


class _OwnPool(Driver):
    """A pool per event loop of connections this store opens itself."""

    def __init__(
        self,
        dialect: _Dialect,
        where: str,
        table: str,
        url: str,
        driver: str,
        *,
        size: int,
        timeout: float,
        prepared: bool,
        settings: dict[str, str],
    ) -> None:
        super().__init__(dialect, where, table)
        self.settings = settings  # sent when a connection starts: no statement of its own
        self.name = driver
        self.url = url
        self.size = size
        self.timeout = timeout
        self.prepared = prepared
        self.pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = (
            weakref.WeakKeyDictionary()
        )

    def _pool(self) -> _Pool:
        loop = asyncio.get_running_loop()
        pool = self.pools.get(loop)
        if pool is None:
            pool = self.pools[loop] = _Pool(self)
        return pool

    async def _take(self) -> Any:
        pool = self._pool()
        while True:
            try:
                return await pool.acquire()
            except _Retry:
                continue

    async def _give(self, conn: Any, usable: bool) -> None:
        self._pool().release(conn, usable)

    async def connect(self) -> Any:
        if self.name == "asyncpg":
            asyncpg: Any = importlib.import_module("asyncpg")  # untyped
            return await asyncpg.connect(
                self.url,
                timeout=self.timeout,
                statement_cache_size=100 if self.prepared else 0,
                server_settings=self.settings,
            )
        import psycopg

        extra: dict[str, Any] = {}
        if self.settings:  # libpq's options: -c name=value, read when the session starts
            extra["options"] = " ".join(f"-c {k}={v}" for k, v in self.settings.items())
        return await psycopg.AsyncConnection.connect(
            self.url,
            autocommit=True,
            prepare_threshold=5 if self.prepared else None,
            connect_timeout=max(1, round(self.timeout)),
            **extra,
        )

    def discard(self, conn: Any) -> None:
        """Close a connection that must not be reused, without waiting for the server."""
        if self.name == "asyncpg":
            conn.terminate()
        else:
            conn.pgconn.finish()

    async def aclose(self) -> None:
        """Close this loop's connections (those of other loops close with their loops)."""
        loop = asyncio.get_running_loop()
        pool = self.pools.pop(loop, None)
        if pool is None:
            return
        for conn in pool.close():
            try:
                await asyncio.wait_for(conn.close(), self.timeout)
            except Exception:
                self.discard(conn)

    def after_fork(self) -> None:
        self.pools = weakref.WeakKeyDictionary()


class _EnginePool(Driver):
    """Connections of an SQLAlchemy AsyncEngine's pool, used at the driver's level: the
    engine's pool gives and takes them back (its reset on return sends nothing for an
    idle connection); psycopg's are switched to autocommit while the store has them."""

    def __init__(self, engine: Any, dialect: _Dialect, where: str, table: str, name: str) -> None:
        super().__init__(dialect, where, table)
        self.engine = engine
        self.name = name

    async def _take(self) -> Any:
        fairy = await self.engine.raw_connection()
        conn = fairy.driver_connection
        switched = self.name == "psycopg" and not conn.autocommit
        if switched:
            await conn.set_autocommit(True)
        _fairies[id(conn)] = (fairy, switched)
        return conn

    async def _give(self, conn: Any, usable: bool) -> None:
        from sqlalchemy.util import greenlet_spawn

        fairy, switched = _fairies.pop(id(conn))
        if not usable:
            fairy.invalidate()
        elif switched:
            await conn.set_autocommit(False)  # as the engine gave it, for the app's next use
        await greenlet_spawn(fairy.close)

    async def aclose(self) -> None:
        """Nothing: the engine is the app's, and so is closing it."""


# Each engine connection's pool entry while the store has it, and whether the store
# switched it to autocommit.
_fairies: dict[int, tuple[Any, bool]] = {}


def _where(host: object, port: object, database: object) -> str:
    return f"{host}:{port}/{database}"


def driver_for_url(
    url: str,
    table: str,
    *,
    size: int,
    timeout: float,
    prepared: bool,
    settings: dict[str, str],
) -> Driver:
    """A pool of the store's own for a ``postgresql://`` URL (``postgresql+asyncpg://`` or
    ``postgresql+psycopg://`` to choose the driver; else asyncpg if installed, else psycopg)."""
    from urllib.parse import urlsplit

    scheme, sep, rest = url.partition("://")
    base, _, named = scheme.partition("+")
    if not sep or base not in ("postgresql", "postgres"):
        raise ValueError(f"PostgresStore.from_url needs a postgresql:// URL, not {url!r}")
    name = named or _installed_driver()
    if name not in ("asyncpg", "psycopg"):
        raise ValueError(
            f"PostgresStore drives asyncpg or psycopg (3), not {name!r}: "
            "use postgresql+asyncpg:// or postgresql+psycopg://"
        )
    _import_driver(name)
    plain = f"postgresql://{rest}"
    parts = urlsplit(plain)
    # host:port, or several (host1:port1,host2:port2, for a failover); never the password
    hosts = parts.netloc.rpartition("@")[2] or "localhost"
    where = f"{hosts}/{parts.path.lstrip('/')}"
    dialect: _Dialect = _Asyncpg(timeout) if name == "asyncpg" else _Psycopg(timeout)
    return _OwnPool(
        dialect,
        where,
        table,
        plain,
        name,
        size=size,
        timeout=timeout,
        prepared=prepared,
        settings=settings,
    )


def driver_for_engine(engine: Any, table: str, *, timeout: float) -> Driver:
    """The engine's own pool, if its driver is asyncpg or psycopg and it does not ping."""
    sync_engine = getattr(engine, "sync_engine", None)
    if sync_engine is None:
        raise TypeError(
            "PostgresStore(engine) takes an SQLAlchemy AsyncEngine (create_async_engine), "
            f"not {type(engine).__name__}; or use PostgresStore.from_url(url)"
        )
    dialect_name = sync_engine.dialect.name
    name = sync_engine.dialect.driver
    if dialect_name != "postgresql" or name not in ("asyncpg", "psycopg"):
        raise ValueError(
            f"PostgresStore needs a PostgreSQL engine on asyncpg or psycopg, not "
            f"{dialect_name}+{name}"
        )
    if getattr(sync_engine.pool, "_pre_ping", False):
        raise ValueError(
            "this engine's pool pings the server before every checkout (pool_pre_ping=True): "
            "one more round trip per claim. Give the store an engine without it "
            "(create_async_engine(url, pool_pre_ping=False)), or PostgresStore.from_url(url)"
        )
    url = sync_engine.url
    where = _where(url.host or "localhost", url.port or 5432, url.database)
    dialect: _Dialect = _Asyncpg(timeout) if name == "asyncpg" else _Psycopg(timeout)
    return _EnginePool(engine, dialect, where, table, name)


def _installed_driver() -> str:
    import importlib.util

    if importlib.util.find_spec("asyncpg") is not None:
        return "asyncpg"
    if importlib.util.find_spec("psycopg") is not None:
        return "psycopg"
    raise ImportError(
        "PostgresStore needs asyncpg or psycopg 3: pip install 'goblin-idem[postgres]'"
    )


def _import_driver(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"PostgresStore on {name} needs it installed: pip install 'goblin-idem[postgres]'"
        ) from exc
