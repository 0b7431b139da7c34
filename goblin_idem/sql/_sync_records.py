"""`SyncSqlRecords`: `SqlRecords` for a sync app (WSGI, Flask), the same table and rows on a
sync ``Engine``.

They implement `goblin_idem._threads._records.ThreadRecords`: every step runs in the request's
thread, where the app's writes are, so the app's writes through `goblin_idem.sql.sync`
(and Flask-SQLAlchemy's ``db.session`` on a keyed route) and the record's row are one
transaction on one connection (`goblin_idem.sql.sync.SyncRun`): on psycopg, the key's
lookup's connection, whose transaction the lookup begins (`lookup_for_work`). The ASGI
middleware and `once` refuse them, saying to use an AsyncEngine there; the WSGI and Flask
middlewares refuse async records, which a sync app cannot write through.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
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
from ._psycopg import begins_nothing, lookup_text, taken
from ._table import DEFAULT_TABLE, PURGE_BATCH, RecordsTable, _shape, _utcnow
from .sync import RunConnection, SyncRun

__all__ = ["SyncSqlRecords"]

logger = logging.getLogger("goblin_idem.sql")

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
        self._kept = threading.local()  # a lookup's connection for its thread's run

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

    def lookup_for_work(
        self, key: bytes, at_end: Callable[[Callable[[], object]], object]
    ) -> tuple[bytes, int] | None:
        """`lookup`, in the request's thread, for the request's run (`ThreadedRecords`): on
        psycopg, on a connection kept for the run, whose transaction the lookup begins in
        the same round trip and query (`_psycopg.lookup_text`), as the async records' does;
        a run under a won claim takes it (`kept_for_work`), `at_end` (the request's) gives
        it back if none did. Elsewhere, or where psycopg cannot begin so, `lookup`."""
        if self.engine.dialect.driver != "psycopg":
            return self.lookup(key)
        self.let_go()  # this request's earlier lookup's, asked again (after a wait)
        now = _utcnow()
        try:
            conn, row = self._looked_begun(key, now)
        except Exception as exc:
            failure = unavailable_as(exc, "for the record's lookup")
            if failure is None:
                raise
            raise failure from exc
        if conn is None:
            return self.lookup(key)
        found = self._found(row, now)
        if found is not None:
            _give_back(conn)  # nothing runs
            return found
        self._kept.conn = conn
        at_end(self.let_go)
        return None

    def _looked_begun(self, key: bytes, now: datetime.datetime) -> tuple[RunConnection | None, Any]:
        """A connection taken for the run, its transaction begun with `key`'s lookup, and
        the lookup's row (None: no record); no connection where psycopg cannot begin so."""
        with connecting("for the record's lookup"):
            conn = RunConnection(self.engine)
        try:
            raw: Any = conn.connection.driver_connection  # psycopg's own
            text = lookup_text(self, conn.dialect, raw, key, now)
            if text is None:
                conn.close()
                return None, None
            with begins_nothing(raw):
                # made for one key: never prepared
                cursor = raw.execute(text, prepare=False)
            cursor.nextset()  # past BEGIN's result, to the SELECT's
            return conn, cursor.fetchone()
        except BaseException as exc:
            lost = _lost(conn, exc, "for the record's lookup")
            _give_back(conn)
            if lost is not None:
                raise lost from exc
            raise

    def kept_for_work(self) -> RunConnection | None:
        """The connection this thread's lookup kept for its run (`lookup_for_work`), in
        the run's transaction: the caller's from here on."""
        conn: RunConnection | None = getattr(self._kept, "conn", None)
        self._kept.conn = None
        return conn

    def let_go(self) -> None:
        """Give back the connection this thread's lookup kept, if no run took it."""
        conn = self.kept_for_work()
        if conn is not None:
            _give_back(conn)

    def commit(self, conn: Connection, tx: RootTransaction, row: RecordRow) -> bool:
        """Insert `row` in the run's transaction and commit it, with the work's writes;
        False (nothing committed) if the key's unexpired row exists. On psycopg the insert
        and the COMMIT go in one round trip and query (as the async records'
        `_drivers.at_once`: a record too large to send as hex, in its pipeline); elsewhere
        one each."""
        if conn.dialect.driver != "psycopg":
            if not self.insert(conn, row):
                return False
            tx.commit()
            return True
        raw: Any = conn.connection.driver_connection  # psycopg's own
        text = self._in_one(conn.dialect, row)
        try:
            if text is not None:
                raw.execute(text, prepare=False)  # made for one row: never prepared
            else:
                with raw.pipeline(), raw.cursor() as cursor:
                    for sql, params in self._pipeline(conn.dialect, row):
                        cursor.execute(sql, params)
        except Exception as exc:
            if taken(self, exc):
                return False
            lost = _lost(conn, exc, "at the run's commit")
            if lost is None:
                raise
            raise lost from exc
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


def _lost(conn: Connection, exc: BaseException, where: str) -> DatabaseUnavailableError | None:
    """After psycopg's own call on `conn` failed with `exc`: if its connection is closed or
    broken, `conn` invalidated (SQLAlchemy, which did not make the call, would give the
    closed connection back to its pool) and the DatabaseUnavailableError to raise."""
    raw: Any = conn.connection.driver_connection
    if not (raw.closed or raw.broken):
        return None
    conn.invalidate(exc if isinstance(exc, Exception) else None)
    return DatabaseUnavailableError(
        f"the database is unavailable {where} (its connection was lost: {describe(exc)})"
    )


def _give_back(conn: Connection) -> None:
    """Close `conn`, which rolls back what it began; a connection the database dropped
    has nothing to undo."""
    try:
        conn.close()
    except Exception as exc:
        logger.warning("could not give back a lookup's connection: %s", describe(exc))
