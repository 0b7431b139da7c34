"""`SqlRecords`: the response records in the app's own database (SQLAlchemy async).

One row per key: the result key's name as the store has it (bytes, the primary key), the
key hash that logs show, the request fingerprint, the record bytes the store gets (sealed
when encryption is on), and when it was committed and expires. The row is inserted in the
run's transaction, so the work's effects and its record commit together; the primary key
stops a second run of the same key at its commit. An expired row is never replayed, and
the next run replaces it.
PostgreSQL and SQLite (their ``INSERT ... ON CONFLICT DO UPDATE ... WHERE``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncTransaction,
    create_async_engine,
)

from .._recording import RecordRow, kept
from ._context import RunTransaction
from ._drivers import at_once, begin_looking, drop_if_broken, in_one, pooled
from ._failures import connecting, unavailable_as
from ._sqlite import sqlite_engine
from ._table import (
    DEFAULT_TABLE,
    LOOKUP_SQL,
    PURGE_BATCH,
    UPSERT_SQL,
    RecordsTable,
    _shape,
    _utcnow,
)

__all__ = ["SqlRecords"]

# The drivers whose lookup runs on the connection kept for the run (`lookup_for_run`).
KEPT_DRIVERS = ("asyncpg", "psycopg")


class SqlRecords(RecordsTable):
    """Records in the app's database, for ``IdempotencyMiddleware(records=...)`` and
    ``once(..., records=...)``. `engine` is an AsyncEngine (its pool's size and timeouts
    apply) or a URL, whose engine is made on first use (so that a driver that is not
    installed fails the middleware's startup check, with what to install). A sync app
    (WSGI, Flask) passes `goblin_idem.sql.SyncSqlRecords` instead: the same table and rows,
    on a sync ``Engine``."""

    def __init__(self, engine: AsyncEngine | str, *, table: str = DEFAULT_TABLE) -> None:
        if isinstance(engine, str):
            self._engine: AsyncEngine | None = None
            self._url = engine
        elif isinstance(engine, AsyncEngine):
            self._engine = engine
            self._url = engine.url.render_as_string(hide_password=True)
        elif isinstance(engine, Engine):
            raise TypeError(
                "SqlRecords takes an AsyncEngine; for a sync Engine (a WSGI or Flask app's, "
                "Flask-SQLAlchemy's db.engine) pass SyncSqlRecords(engine), from goblin_idem.sql"
            )
        else:
            raise TypeError(
                "SqlRecords needs an AsyncEngine (sqlalchemy.ext.asyncio.create_async_engine) "
                f"or a database URL, not {type(engine).__name__}"
            )
        super().__init__(self._url, table)

    @property
    def engine(self) -> AsyncEngine:
        """The engine, made from the URL on first use (which imports its driver); for
        SQLite, set up for several writing processes (`sqlite_engine`)."""
        if self._engine is None:
            if make_url(self._url).get_backend_name() == "sqlite":
                self._engine = sqlite_engine(self._url)
            else:
                self._engine = create_async_engine(self._url)
        return self._engine

    def __repr__(self) -> str:
        return f"SqlRecords({self.where!r}, table={self.table.name!r})"

    # -- what the middleware and once use (goblin_idem._recording) --

    def transaction(self, where: Callable[[], str] | None = None) -> RunTransaction:
        """A new run's transaction; for a run under a won claim, the one its lookup opened
        in this context (`lookup_for_run`), with the lookup's connection."""
        if where is not None:
            run = kept.get()
            if isinstance(run, RunTransaction) and run.records is self:
                kept.set(None)
                run.where = where
                return run
        return RunTransaction(self, self.engine, where)

    async def lookup_for_run(
        self, key: bytes
    ) -> tuple[tuple[bytes, int] | None, RunTransaction | None]:
        """The key's unexpired record, and the transaction of a run of the key, whose
        connection made the lookup (`RunTransaction.looked_up`); the caller hands it to the
        run or rolls it back. DatabaseUnavailableError as `lookup`. On a driver not in
        `KEPT_DRIVERS`, the lookup on a connection of its own, and no transaction yet."""
        if self.engine.dialect.driver not in KEPT_DRIVERS:
            return await self.lookup(key), None
        run = RunTransaction(self, self.engine)
        try:
            return await run.looked_up(key), run
        except BaseException as exc:
            await run.rollback()
            failure = (
                unavailable_as(exc, "for the record's lookup")
                if isinstance(exc, Exception)
                else None
            )
            if failure is None:
                raise
            raise failure from exc

    async def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """The key's unexpired record; DatabaseUnavailableError if the database could not
        be asked (`_failures`)."""
        try:
            return await self._lookup_row(key)
        except Exception as exc:
            failure = unavailable_as(exc, "for the record's lookup")
            if failure is None:
                raise
            raise failure from exc

    async def _lookup_row(self, key: bytes) -> tuple[bytes, int] | None:
        started = self.engine.connect()
        with connecting("for the record's lookup"):
            await started.start()
        try:
            return await self.looked(started, key, begin=False)
        finally:
            await started.close()

    async def looked(
        self, conn: AsyncConnection, key: bytes, begin: bool
    ) -> tuple[bytes, int] | None:
        """The key's unexpired record, looked up on `conn` in one round trip. `begin`: on
        psycopg, the run's transaction begins with the lookup (`begun`), in the same round
        trip and query (`begin_looking`), so that the run's first write does not wait for
        a BEGIN. The
        connection is invalidated if it was lost (`drop_if_broken`)."""
        now = _utcnow()
        try:
            driver = conn.dialect.driver
            if driver == "asyncpg":
                # The driver's own call: SQLAlchemy's layer cost more CPU than the round
                # trip. No BEGIN before it (the adapter begins on its own first use only),
                # so no ROLLBACK after it either: one round trip.
                raw: Any = (await pooled(conn)).driver_connection
                row = await raw.fetchrow(self._sql(conn, LOOKUP_SQL), key, now)
            elif driver == "psycopg" and begin:
                # BEGIN and the SELECT, as one query (`begin_looking`).
                row = await begin_looking(self, conn, key, now)
            else:
                # Autocommit: the SELECT alone, one round trip.
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                row = (await conn.execute(self._lookup, {"wanted": key, "now": now})).first()
        except Exception as exc:
            await drop_if_broken(conn, exc)
            raise
        return self._found(row, now)

    @staticmethod
    def begun(conn: AsyncConnection | None) -> bool:
        """Whether `conn`, a run's lookup's (`looked`, begin=True), is in the run's
        transaction already (psycopg's)."""
        return conn is not None and conn.dialect.driver == "psycopg"

    async def insert(self, conn: AsyncConnection, row: RecordRow) -> bool:
        """Insert `row` in `conn`'s transaction, over an expired row only; False if the
        key's unexpired row exists (committed by another run: this run must not commit)."""
        # RETURNING, not rowcount: drivers disagree on the rowcount of an upsert.
        result = await conn.execute(self._upsert(conn.dialect.name), self._row(row))
        return result.first() is not None

    async def insert_alone(self, row: RecordRow, conn: AsyncConnection | None = None) -> bool:
        """The record of a run that wrote nothing: one statement in autocommit, on `conn`
        (the run's lookup's, in no transaction; its owner gives it back) or a pooled one."""
        if conn is not None:  # asyncpg's (in `KEPT_DRIVERS`, not `begun`): its own call
            raw: Any = (await pooled(conn)).driver_connection
            upsert = self._sql(conn, UPSERT_SQL)
            return await raw.fetchval(upsert, *self._row(row).values()) is not None
        async with self.engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return await self.insert(conn, row)

    async def commit(self, conn: AsyncConnection, tx: AsyncTransaction, row: RecordRow) -> bool:
        """Insert `row` in the run's transaction and commit it, with the work's writes;
        False (nothing committed) if the key's unexpired row exists. On psycopg, the insert
        and the COMMIT go in one round trip and query (`at_once`), on asyncpg too (`in_one`);
        elsewhere one each. A connection lost on the way is invalidated (`drop_if_broken`),
        which the run's transaction answers as the database unavailable, whatever the
        driver's own error said."""
        try:
            return await self._commit(conn, tx, row)
        except Exception as exc:
            await drop_if_broken(conn, exc)
            raise

    async def _commit(self, conn: AsyncConnection, tx: AsyncTransaction, row: RecordRow) -> bool:
        if conn.dialect.driver == "psycopg":
            return await at_once(self, conn, tx, row)
        if conn.dialect.driver == "asyncpg":
            # The driver's own call on the run's connection, inside the transaction the
            # work's writes began (SQLAlchemy's layer cost more CPU than the round trip).
            adapter: Any = (await pooled(conn)).dbapi_connection
            committed = await in_one(self, conn, adapter, row)
            if committed is not None:
                if committed:
                    await tx.commit()  # SQLAlchemy's side: nothing left to send
                return committed
            upsert = self._sql(conn, UPSERT_SQL)
            raw: Any = adapter.driver_connection
            if await raw.fetchval(upsert, *self._row(row).values()) is None:
                return False
        elif not await self.insert(conn, row):
            return False
        await tx.commit()
        return True

    async def check(self) -> str:
        """Raise SqlRecordsError saying what to change unless the database answers and
        the table exists with this release's columns; else say where records go."""
        engine = self._engine_made(
            lambda: self.engine,
            "an async driver in the URL, as in postgresql+asyncpg://, postgresql+psycopg:// or "
            "sqlite+aiosqlite:// (a WSGI or Flask app passes SyncSqlRecords(url) instead)",
        )
        try:
            async with engine.connect() as conn:
                columns = await conn.run_sync(_shape, self.table.name)
        except Exception as exc:
            raise self._unreachable(exc) from exc
        return self._shaped(columns, "await records.create_table()")

    # -- for the application --

    async def create_table(self) -> None:
        """Create the table and its index unless they exist (safe to repeat)."""
        async with self.engine.begin() as conn:
            await conn.run_sync(self.metadata.create_all, checkfirst=True)

    async def forget(self, key: bytes) -> bool:
        """Delete `key`'s record, expired or not: the next run of the key is a new one
        (`goblin_idem.forget`, which also clears the store). True if there was a row."""
        async with self.engine.begin() as conn:
            return bool((await conn.execute(self._forget(key))).rowcount)

    async def purge_expired(self, batch: int = PURGE_BATCH) -> int:
        """Delete the expired rows, `batch` per transaction; how many were deleted."""
        total = 0
        while True:
            async with self.engine.begin() as conn:
                deleted = (await conn.execute(self._purge(batch))).rowcount
            total += deleted
            if deleted < batch:
                return total

    async def aclose(self) -> None:
        """Dispose of the engine's pool (the engine stays usable: it reconnects)."""
        if self._engine is not None:
            await self._engine.dispose()
