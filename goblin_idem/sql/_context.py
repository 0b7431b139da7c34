"""The run's transaction, as the work sees it: ``await connection()`` and ``await session()``.

A context variable holds the `RunTransaction` of the run this code is part of (set by the
middleware or `once` around the work; tasks the work starts inherit it). The connection is
taken from the engine's pool and its transaction begun on first use, so a run that writes
nothing through it costs nothing until its record is committed. Neither the connection nor
the session commits: only the run does, with its record (`RunTransaction.commit`), so no
effect can commit without the record that stops a second run.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING, NoReturn

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, AsyncTransaction

from .._log import describe
from .._recording import Committed
from ..exceptions import CommitRefusedError, DatabaseUnavailableError, NotInRunError
from ._failures import connecting, unavailable_as

if TYPE_CHECKING:
    from ._records import SqlRecords

__all__ = ["RunTransaction", "connection", "session"]

logger = logging.getLogger("goblin_idem.sql")

_current: contextvars.ContextVar[object] = contextvars.ContextVar("goblin_idem_sql", default=None)

_REFUSED = (
    "this run's transaction commits with its idempotency record when the run ends "
    "(the response, or the once function's return): do not commit it yourself"
)


class RunConnection(AsyncConnection):
    """The run's connection: everything an AsyncConnection does but commit, or begin a
    transaction of its own (one that commits apart from the record)."""

    __slots__ = ()

    async def commit(self) -> NoReturn:
        raise CommitRefusedError(_REFUSED)

    def begin(self) -> NoReturn:
        raise CommitRefusedError(
            "the run's connection is in the run's transaction already, which commits with "
            "the run's record: use begin_nested() for a savepoint"
        )


class RunSession(AsyncSession):
    """A session in the run's transaction: everything an AsyncSession does but commit."""

    async def commit(self) -> NoReturn:
        raise CommitRefusedError(_REFUSED)


class RunTransaction:
    """One run's transaction on `records`' engine, begun on first use."""

    def __init__(self, records: SqlRecords, engine: AsyncEngine) -> None:
        self.records = records
        self.engine = engine
        self.conn: RunConnection | None = None
        self.tx: AsyncTransaction | None = None
        self.sessions: list[RunSession] = []
        self.ended = False  # committed or rolled back: connection() refuses
        self.opening = asyncio.Lock()  # two first uses at once open one connection

    def enter(self) -> contextvars.Token[object]:
        return _current.set(self)

    def leave(self, token: contextvars.Token[object]) -> None:
        _current.reset(token)

    async def connection(self) -> RunConnection:
        """The run's connection, taken and begun on first use; DatabaseUnavailableError if
        none could be had (the pool exhausted, the database unreachable)."""
        if self.ended:
            raise NotInRunError(
                "this run's transaction has ended (it committed with the run's record, or "
                "rolled back): code that outlives the run, such as a background task, "
                "takes a connection of its own from the engine"
            )
        if self.conn is None:
            async with self.opening:
                if self.conn is None:
                    with connecting("for the run's connection()"):
                        conn = RunConnection(self.engine)
                        await conn.start()
                        try:
                            self.tx = await AsyncConnection.begin(conn)  # the one begin allowed
                        except BaseException:
                            await conn.close()
                            raise
                    self.conn = conn
        return self.conn

    async def session(self) -> RunSession:
        s = RunSession(bind=await self.connection(), expire_on_commit=False)
        self.sessions.append(s)
        return s

    async def commit(self, key: bytes, key_hash: str, fp: bytes, data: bytes, ttl_ms: int) -> None:
        """The work's writes and the record's row, committed together (one transaction): the
        row's primary key makes a second run's commit fail, and its writes vanish with it.
        A run that wrote nothing commits the row alone, one statement in autocommit (as
        atomic, and a round trip instead of a transaction's two or three)."""
        try:
            try:
                if self.conn is None and not self.ended:
                    self.ended = True  # connection() refuses from here on
                    committed = await self.records.insert_alone(key, key_hash, fp, data, ttl_ms)
                else:
                    committed = await self._commit_with_writes(key, key_hash, fp, data, ttl_ms)
            except Exception as exc:
                failure = unavailable_as(exc, "at the run's commit")
                if failure is None:
                    raise
                raise failure from exc
            if not committed:
                await self.rollback()
                found = await self.records.lookup(key)
                if found is None:  # expired between the two: nothing to replay
                    raise RuntimeError(f"the record of key {key_hash} expired meanwhile")
                raise Committed(found[0])
        finally:
            await self.rollback()  # after a commit: only gives the connection back

    async def _commit_with_writes(
        self, key: bytes, key_hash: str, fp: bytes, data: bytes, ttl_ms: int
    ) -> bool:
        conn = await self.connection()
        for s in self.sessions:
            await s.flush()  # the work's pending ORM writes, in this transaction
        if self.tx is None or not self.tx.is_active:
            raise RuntimeError(
                "the run's transaction was rolled back by the work: its writes are gone, "
                "so its record is not committed either"
            )
        return await self.records.commit(conn, self.tx, key, key_hash, fp, data, ttl_ms)

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        """`exc`, raised by the work (a DatabaseUnavailableError of connection(), or its
        own statement's error), as the database unavailable (`_failures`), or None."""
        failure = unavailable_as(exc, "for the run's writes")
        if failure is not None and failure is not exc:
            failure.__cause__ = exc
        return failure

    async def rollback(self) -> None:
        self.ended = True
        conn, self.conn = self.conn, None
        for s in self.sessions:
            await s.close()
        self.sessions.clear()
        if conn is not None:
            try:
                await conn.close()  # rolls back what was not committed
            except Exception as exc:  # a connection the database dropped: nothing to undo
                logger.warning("could not give back the run's connection: %s", describe(exc))


def _running() -> RunTransaction:
    run = _current.get()
    if not isinstance(run, RunTransaction):
        raise NotInRunError(
            "connection() and session() belong to a run under a won claim: a request with an "
            "Idempotency-Key handled by IdempotencyMiddleware(records=...), or a call of a "
            "once(..., records=...) function; this code runs outside one"
        )
    return run


async def connection() -> AsyncConnection:
    """The run's AsyncConnection, in its transaction (begun on first use); it commits with
    the run's record. Also a FastAPI dependency: ``Depends(connection)``."""
    return await _running().connection()


async def session() -> AsyncSession:
    """An AsyncSession on the run's connection; flushed and committed with the run's record.
    Also a FastAPI dependency: ``Depends(session)``."""
    return await _running().session()
