"""The run's transaction, as the work sees it: ``await connection()`` and ``await session()``.

A context variable holds the `RunTransaction` of the request or run this code is part of
(set by the middleware around every request, or by `once` around the work; tasks the work
starts inherit it). The connection is taken from the engine's pool and its transaction
begun on first use, so work that writes nothing through it costs nothing (on
PostgreSQL, the connection the key's lookup was made on, kept for the run). Neither the
connection nor the session commits: only the run does, with its record
(`RunTransaction.commit`), so no effect can commit without the record that stops a second
run; a request without a claimed key commits its writes alone (`RunTransaction.commit_work`),
before its response is sent.

A session the app makes itself on the run's connection (``SessionLocal(bind=await
connection())``) is flushed with the run's own sessions: the ORM's ``after_attach`` event
tells the run of it when an object is added, so that objects added and never flushed are
not lost at the commit (a stored response would describe rows that do not exist).

No silent gap: while a run under a won claim is under way, a commit on the same database
from another connection (a session the app made itself) is not covered by the run, and the
engine's ``commit`` event, seen in the run's context, logs a WARNING once per route that
says so and how to move the writes into the run. A transaction the work began beside the
run and commits after it settled (FastAPI runs a session dependency's teardown after the
response) is warned of too; one begun after the response (a background task's) is not.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import URL, event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, AsyncTransaction
from sqlalchemy.orm import Session

from .._log import describe
from .._recording import Committed, RecordRow, kept, let_go
from ..exceptions import CommitRefusedError, DatabaseUnavailableError, NotInRunError
from ._failures import connecting, unavailable_as

if TYPE_CHECKING:
    from ._records import SqlRecords

__all__ = ["RunTransaction", "connection", "session"]

logger = logging.getLogger("goblin_idem.sql")

_current: contextvars.ContextVar[object] = contextvars.ContextVar("goblin_idem_sql", default=None)

ADVICE = (
    "Depends(session) or await session() / await connection() from goblin_idem.sql, in "
    "place of a session or connection of the app's own, and do not commit (the run commits "
    "with its record)"
)
# A commit in the request after its run committed and sent the response: FastAPI runs a
# `yield` dependency's teardown then, so a session dependency that commits lands here.
LATE = (
    ", after the run had committed and the response was sent (FastAPI runs a dependency's "
    "code after its yield then: a session dependency that commits there commits after the "
    "client got its answer)"
)
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
    """One run's transaction on `records`' engine, begun on first use. `where` names the
    route (or function) of a run under a won claim, whose database is watched for commits
    outside the run; None for a request without a claimed key."""

    def __init__(
        self, records: SqlRecords, engine: AsyncEngine, where: Callable[[], str] | None = None
    ) -> None:
        self.records = records
        self.engine = engine
        self.where = where
        self.conn: RunConnection | None = None
        self.looked: RunConnection | None = None  # the lookup's, kept: conn on first use
        self.tx: AsyncTransaction | None = None
        self.sessions: list[RunSession] = []
        self.adopted: list[Session] = []  # the app's own sessions on this connection
        self.ended = False  # committed or rolled back: connection() refuses
        self.settled = False  # ended, and its connection given back: what commits now is late
        # What the work began beside the run (connections, sessions given objects): their
        # commits after the run settled are the work's, late (a dependency's teardown).
        # Made on first use: most runs begin nothing beside them.
        self.beside: weakref.WeakSet[object] | None = None
        self.advice = ADVICE  # what the WARNING of a commit outside the run says to use
        self.opening: asyncio.Lock | None = None  # two first uses at once open one connection

    def enter(self) -> contextvars.Token[object]:
        """Make this the transaction of `connection()`. A run under a won claim that is not
        its lookup's own (records whose `transaction` makes another) takes the lookup's
        connection, or has it given back: never left checked out."""
        if self.where is not None:
            lookups = kept.get()
            if lookups is not None and lookups is not self:
                kept.set(None)
                self._take_looked(lookups)
        return _current.set(self)

    def _take_looked(self, lookups: object) -> None:
        if (
            isinstance(lookups, RunTransaction)
            and lookups.engine is self.engine
            and lookups.looked is not None
            and self.conn is None
            and self.looked is None
        ):
            self.looked, lookups.looked = lookups.looked, None
        else:
            let_go(lookups)  # type: ignore[arg-type]

    def leave(self, token: contextvars.Token[object]) -> None:
        _current.reset(token)

    async def connection(self) -> RunConnection:
        """The run's connection, taken and begun on first use; DatabaseUnavailableError if
        none could be had (the pool exhausted, the database unreachable)."""
        if self.ended:
            raise NotInRunError(
                "this run's transaction has ended (it committed, with the run's record if it "
                "had a key, or rolled back): code that outlives the run or the response, such "
                "as a background task, takes a connection of its own from the engine"
            )
        if self.conn is None:
            if self.opening is None:  # made on first use: most requests without a key never
                self.opening = asyncio.Lock()
            async with self.opening:
                if self.conn is None:
                    with connecting("for the run's connection()"):
                        conn, self.looked = self.looked, None
                        if conn is None:
                            conn = RunConnection(self.engine)
                            await conn.start()
                        try:
                            self.tx = await AsyncConnection.begin(conn)  # the one begin allowed
                        except BaseException:
                            await conn.close()
                            raise
                    self.conn = conn
        return self.conn

    async def looked_up(self, key: bytes) -> tuple[bytes, int] | None:
        """`key`'s unexpired record, looked up on a connection taken now and kept for this
        run, whose `connection()` begins on it: a run takes one pooled connection, not one
        for its lookup and another for its writes. On psycopg the lookup begins the run's
        transaction too, in the same round trip (`SqlRecords.looked`). Given back by
        `rollback` (the caller's, if this raises)."""
        with connecting("for the record's lookup"):
            conn = RunConnection(self.engine)
            await conn.start()
        self.looked = conn
        return await self.records.looked(conn, key, begin=True)

    async def session(self) -> RunSession:
        s = RunSession(bind=await self.connection(), expire_on_commit=False)
        self.sessions.append(s)
        return s

    async def commit(self, row: RecordRow) -> None:
        """The work's writes and the record's row, committed together (one transaction): the
        row's primary key makes a second run's commit fail, and its writes vanish with it.
        A run that wrote nothing commits the row alone, one statement in autocommit (as
        atomic, and a round trip instead of a transaction's two or three)."""
        try:
            try:
                looked = self.looked
                if self.conn is None and not self.ended and not self.records.begun(looked):
                    self.ended = True  # connection() refuses from here on
                    committed = await self.records.insert_alone(row, looked)
                else:
                    committed = await self._commit_with_writes(row)
            except Exception as exc:
                failure = self._unavailable(exc, "at the run's commit")
                if failure is None:
                    raise
                raise failure from exc
            if not committed:
                await self.rollback()
                found = await self.records.lookup(row.key)
                if found is None:  # expired between the two: nothing to replay
                    raise RuntimeError(f"the record of key {row.key_hash} expired meanwhile")
                raise Committed(found[0])
        finally:
            await self.rollback()  # after a commit: only gives the connection back

    async def _commit_with_writes(self, row: RecordRow) -> bool:
        conn = await self._flushed()
        assert self.tx is not None
        return await self.records.commit(conn, self.tx, row)

    async def commit_work(self) -> None:
        """Commit the work's writes without a record: a request without a claimed key (or
        on a route the middleware does not cover), whose response is sent after this.
        Raises the database's error if the commit fails (nothing was committed)."""
        if self.conn is None and self.looked is None:  # wrote nothing: nothing to commit
            self.ended = True
            return
        try:
            if not self.ended:
                await self._flushed()
                assert self.tx is not None
                await self.tx.commit()
        finally:
            await self.rollback()  # after a commit: only gives the connection back

    async def _flushed(self) -> RunConnection:
        """The run's connection with the work's pending ORM writes flushed into its
        transaction, which must still be the one begun for the run."""
        conn = await self.connection()
        for s in self.sessions:
            await s.flush()  # the work's pending ORM writes, in this transaction
        for own in self.adopted:
            await conn.run_sync(_flush, own)
        if self.tx is None or not self.tx.is_active:
            raise RuntimeError(
                "the run's transaction was rolled back by the work: its writes are gone, "
                "so nothing of the run commits"
            )
        return conn

    def add_beside(self, begun: object) -> None:
        """`begun` (a connection or session) is the work's own, beside the run."""
        if self.beside is None:
            self.beside = weakref.WeakSet()
        self.beside.add(begun)

    def began_beside(self, begun: object) -> bool:
        return self.beside is not None and begun in self.beside

    def adopt(self, own: Session) -> None:
        """`own`, a session the app made on this run's connection, is flushed with it."""
        if own not in self.adopted and all(s.sync_session is not own for s in self.sessions):
            self.adopted.append(own)

    def owns(self, conn: Connection) -> bool:
        """Whether `conn` is the run's own connection (its commit is the run's)."""
        return self.conn is not None and conn is self.conn.sync_connection

    def route(self) -> str:
        assert self.where is not None
        return self.where()

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        """`exc`, raised by the work (a DatabaseUnavailableError of connection(), or its
        own statement's error), as the database unavailable, or None."""
        failure = self._unavailable(exc, "for the run's writes")
        if failure is not None and failure is not exc:
            failure.__cause__ = exc
        return failure

    def _unavailable(self, exc: Exception, where: str) -> DatabaseUnavailableError | None:
        """`exc` (met `where`) as the database unavailable: by what it says (`_failures`),
        or because the run's connection was invalidated, lost midway: SQLAlchemy answers
        every statement after that with PendingRollbackError, and a work that caught the
        first error goes on to meet only that, which says nothing of the database."""
        failure = unavailable_as(exc, where)
        conn = self.conn or self.looked
        if failure is None and conn is not None and conn.invalidated:
            failure = DatabaseUnavailableError(
                f"the database is unavailable {where}: the run's connection was lost "
                f"midway ({describe(exc)})"
            )
        return failure

    async def rollback(self) -> None:
        self.ended = True
        try:
            await self._give_back()
        finally:
            self.settled = True

    async def _give_back(self) -> None:
        if self.conn is None and self.looked is None and not self.sessions:
            return  # never used, or given back already
        conn, self.conn, self.looked = self.conn or self.looked, None, None
        for s in self.sessions:
            await s.close()
        self.sessions.clear()
        self.adopted.clear()  # the app's: it closes them
        if conn is not None:
            try:
                await conn.close()  # rolls back what was not committed
            except Exception as exc:  # a connection the database dropped: nothing to undo
                logger.warning("could not give back the run's connection: %s", describe(exc))


def _flush(_: object, own: Session) -> None:
    own.flush()


# The routes whose commits outside the run were logged, per records.
_gaps_told: weakref.WeakKeyDictionary[SqlRecords, set[str]] = weakref.WeakKeyDictionary()


@event.listens_for(Engine, "commit")
def _committed(conn: Connection) -> None:
    """A commit anywhere in the process: one outside the current run, on its database, is
    a write the run does not cover (a claim lost mid-run can repeat it; a run that fails
    leaves it). Logged once per route; one context variable read for every other commit.
    The run is an async `RunTransaction` or a sync app's (`goblin_idem.sql.sync.SyncRun`):
    each says which connection is its own, which route it serves and what to use instead."""
    run: Any = _current.get()
    if run is None or run.where is None or run.owns(conn):
        return
    late = getattr(run, "settled", False)  # only an async run's request goes on after it
    if run.ended and not (late and run.began_beside(conn)):
        return
    if _database(conn.engine.url) != _database(run.engine.url):
        return
    where = run.route()
    told = _gaps_told.setdefault(run.records, set())
    if where in told:
        return
    told.add(where)
    logger.warning(
        "%s: a commit on the records' database (%s) from a connection that is not the "
        "run's%s: those writes are not covered by the idempotency key (a claim lost mid-run "
        "can make them twice, and they stay when the run fails). Write through the run's "
        "transaction instead: %s. Logged once for this route.",
        where,
        run.records.where,
        LATE if late else "",
        run.advice,
    )


def _database(url: URL) -> tuple[object, ...]:
    """What tells one database from another in `url` (not its driver, nor credentials)."""
    return url.get_backend_name(), url.host, url.port, url.database


@event.listens_for(Session, "after_attach")
def _attached(own: Session, _: object) -> None:
    """An object added to a session: if the session is bound to the current run's
    connection, the run flushes it before it commits; else, in a keyed run, the session is
    the work's own, beside the run. (One context variable read for the sessions of
    everything else.)"""
    run = _current.get()
    if not isinstance(run, RunTransaction):
        return
    bind: Any = own.bind
    if run.conn is not None and bind is not None and bind is run.conn.sync_connection:
        run.adopt(own)
    elif run.where is not None and not run.ended:
        run.add_beside(own)


@event.listens_for(Engine, "begin")
def _begun(conn: Connection) -> None:
    """A transaction begun in a keyed async run, not the run's: the work's own, whose commit
    after the run settled (a session dependency's teardown) is warned of as late."""
    run = _current.get()
    if isinstance(run, RunTransaction) and run.where is not None and not run.ended:
        if not run.owns(conn):
            run.add_beside(conn)


@event.listens_for(Session, "after_begin")
def _session_begun(own: Session, _: object, conn: Connection) -> None:
    """A session given objects in a keyed run that begins its transaction later (its
    commit's flush, after the run settled): that transaction is the work's too."""
    run = _current.get()
    if isinstance(run, RunTransaction) and run.settled and run.began_beside(own):
        run.add_beside(conn)


def _running() -> RunTransaction:
    run = _current.get()
    if not isinstance(run, RunTransaction):
        raise NotInRunError(
            "connection() and session() belong to a request handled by "
            "IdempotencyMiddleware(records=...) (any request: with a key they are the run's "
            "transaction, without one a transaction committed before the response), or to a "
            "call of a once(..., records=...) function; this code runs outside both"
        )
    return run


async def connection() -> AsyncConnection:
    """The run's AsyncConnection, in its transaction (begun on first use); it commits with
    the run's record, or for a request without a claimed key when the handler has
    succeeded, before its response is sent. Also a FastAPI dependency:
    ``Depends(connection)``."""
    return await _running().connection()


async def session() -> AsyncSession:
    """An AsyncSession on the run's connection; flushed and committed with it (see
    `connection`). Also a FastAPI dependency: ``Depends(session)``, in place of an app's
    own session dependency that commits."""
    return await _running().session()
