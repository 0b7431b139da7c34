"""`SyncSqlRecords`: `SqlRecords` for a sync app (WSGI, Flask), the same table and rows on a
sync ``Engine``.

They implement `goblin_idem._threads._records.ThreadRecords`: every step runs in the request's
thread, where the app's writes are, so the app's writes through `goblin_idem.sql.sync`
(and Flask-SQLAlchemy's ``db.session`` on a keyed route) and the record's row are one
transaction on one connection (`goblin_idem.sql.sync.SyncRun`). The ASGI middleware and
`once` refuse them, saying to use an AsyncEngine there; the WSGI and Flask middlewares
refuse async records, which a sync app cannot write through.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy import create_engine
from sqlalchemy.engine import Connection, Engine, RootTransaction
from sqlalchemy.ext.asyncio import AsyncEngine

from .._log import describe
from .._recording import RecordRow
from ..exceptions import DatabaseUnavailableError, SqlRecordsError
from ._failures import connecting, unavailable_as
from ._table import DEFAULT_TABLE, PURGE_BATCH, RecordsTable, _shape, _utcnow
from .sync import SyncRun

__all__ = ["SyncSqlRecords"]

# The engines of sync records: a forked child gets a new pool in each (below).
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child (gunicorn --preload's worker) drops the pools it inherited: the
    records' startup check, run in the master, leaves a pooled connection that every worker
    would otherwise take as its own (one database session for several processes: one's
    statements in another's transaction). ``dispose(close=False)``, SQLAlchemy's way for a
    child, leaves the parent's connections open for the parent."""
    for engine in list(_engines):
        engine.dispose(close=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class SyncSqlRecords(RecordsTable):
    """Records for the WSGI and Flask middlewares (``records=``), written through a sync
    Engine (its pool's size and timeouts apply), or a URL, whose Engine is made on first
    use (a URL of a driver that serves both, such as psycopg, makes a sync one here). An
    ASGI app and `once` pass `SqlRecords` with an AsyncEngine instead."""

    def __init__(self, engine: Engine | str, *, table: str = DEFAULT_TABLE) -> None:
        if isinstance(engine, str):
            self._engine: Engine | None = None
            self._url = engine
        elif isinstance(engine, Engine):
            self._engine = engine
            _engines.add(engine)
            self._url = engine.url.render_as_string(hide_password=True)
        elif isinstance(engine, AsyncEngine):
            raise TypeError(
                "SyncSqlRecords takes a sync Engine; for an AsyncEngine (an ASGI app's, or "
                "once's) pass SqlRecords(engine), from goblin_idem.sql"
            )
        else:
            raise TypeError(
                "SyncSqlRecords needs a sync Engine (sqlalchemy.create_engine) or a database "
                f"URL, not {type(engine).__name__}"
            )
        super().__init__(self._url, table)

    @property
    def engine(self) -> Engine:
        """The engine, made from the URL on first use (which imports its driver); for
        SQLite with a busy timeout and WAL, as `goblin_idem.sql.sqlite_engine` does."""
        if self._engine is None:
            engine = create_engine(self._url)
            if engine.dialect.name == "sqlite":
                from ._sqlite import configure_sqlite

                configure_sqlite(engine)
            self._engine = engine
            _engines.add(engine)
        return self._engine

    def __repr__(self) -> str:
        return f"SyncSqlRecords({self.where!r}, table={self.table.name!r})"

    # -- what the sync adapters use (goblin_idem._threads._records.ThreadRecords) --

    def work(self, where: Callable[[], str] | None) -> SyncRun:
        return SyncRun(self, where)

    def lookup(self, key: bytes) -> tuple[bytes, int] | None:
        """The key's unexpired record (the SELECT alone, in autocommit: one round trip);
        DatabaseUnavailableError if the database could not be asked (`_failures`)."""
        now = _utcnow()
        try:
            with connecting("for the record's lookup"):
                conn = self.engine.connect()
            with conn:
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
                row = conn.execute(self._lookup, {"wanted": key, "now": now}).first()
        except Exception as exc:
            failure = unavailable_as(exc, "for the record's lookup")
            if failure is None:
                raise
            raise failure from exc
        return self._found(row, now)

    def insert(self, conn: Connection, row: RecordRow) -> bool:
        """Insert `row` in `conn`'s transaction, over an expired row only; False if the
        key's unexpired row exists (committed by another run: this run must not commit)."""
        # RETURNING, not rowcount: drivers disagree on the rowcount of an upsert.
        return conn.execute(self._upsert(conn.dialect.name), self._row(row)).first() is not None

    def commit(self, conn: Connection, tx: RootTransaction, row: RecordRow) -> bool:
        """Insert `row` in the run's transaction and commit it, with the work's writes;
        False (nothing committed) if the key's unexpired row exists. On psycopg the insert
        and the COMMIT go in one round trip (its pipeline, as the async records do);
        elsewhere one each."""
        if conn.dialect.driver != "psycopg":
            if not self.insert(conn, row):
                return False
            tx.commit()
            return True
        from psycopg.errors import UniqueViolation

        raw: Any = conn.connection.driver_connection  # psycopg's own
        statements = self._pipeline(conn.dialect, row)
        try:
            with raw.pipeline(), raw.cursor() as cursor:
                for sql, params in statements:
                    cursor.execute(sql, params)
        except UniqueViolation as exc:
            if not self._taken(exc):
                raise
            return False
        except Exception as exc:
            if not (raw.closed or raw.broken):
                raise
            # The driver's own call, which SQLAlchemy did not make: it would give the closed
            # connection back to its pool, so it is invalidated here.
            conn.invalidate(exc)
            raise DatabaseUnavailableError(
                f"the database is unavailable at the run's commit (its connection was lost: "
                f"{describe(exc)})"
            ) from exc
        tx.commit()  # SQLAlchemy's side: the server's has ended, so nothing is sent
        return True

    def insert_alone(self, row: RecordRow) -> bool:
        """The record of a run that wrote nothing: one statement in autocommit."""
        with connecting("for the run's record"):
            conn = self.engine.connect()
        with conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            return self.insert(conn, row)

    def check(self) -> str:
        """Raise SqlRecordsError saying what to change unless the database answers and
        the table exists with this release's columns; else say where records go."""
        engine = self._engine_made(
            lambda: self.engine,
            "a sync driver in the URL, as in postgresql+psycopg:// or sqlite://",
        )
        if engine.dialect.is_async:
            raise SqlRecordsError(
                f"goblin-idem records: {self.where} names an async driver "
                f"({engine.dialect.driver}), which a sync app cannot write through: name a "
                "sync one, as in postgresql+psycopg:// or sqlite://"
            )
        try:
            with engine.connect() as conn:
                columns = _shape(conn, self.table.name)
        except Exception as exc:
            raise self._unreachable(exc) from exc
        return self._shaped(columns, "records.create_table()")

    def unavailable(self, exc: Exception) -> DatabaseUnavailableError | None:
        return unavailable_as(exc, "for the run's writes")

    # -- for the application --

    def create_table(self) -> None:
        """Create the table and its index unless they exist (safe to repeat)."""
        with self.engine.begin() as conn:
            self.metadata.create_all(conn, checkfirst=True)

    def forget(self, key: bytes) -> bool:
        """Delete `key`'s record, expired or not: the next run of the key is a new one
        (`goblin_idem.forget`, which also clears the store). True if there was a row."""
        with self.engine.begin() as conn:
            return bool(conn.execute(self._forget(key)).rowcount)

    def purge_expired(self, batch: int = PURGE_BATCH) -> int:
        """Delete the expired rows, `batch` per transaction; how many were deleted."""
        total = 0
        while True:
            with self.engine.begin() as conn:
                deleted = conn.execute(self._purge(batch)).rowcount
            total += deleted
            if deleted < batch:
                return total

    def close(self) -> None:
        """Dispose of the engine's pool (the engine stays usable: it reconnects)."""
        if self._engine is not None:
            self._engine.dispose()
