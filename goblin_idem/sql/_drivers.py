"""`SqlRecords`' commit through the drivers' own calls (asyncpg's, psycopg's pipeline): the
record inserted and the run's transaction committed in one round trip, where SQLAlchemy's
layer would take two, or cost more CPU than the round trip itself."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Awaitable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncTransaction

from .._recording import RecordRow
from ._failures import unavailable
from ._psycopg import begins_nothing, lookup_text, taken
from ._table import LOOKUP_SQL_PSYCOPG, RecordsTable

__all__ = ["at_once", "begin_looking", "drop_if_broken", "in_one", "pipelined", "pooled"]


async def in_one(
    records: RecordsTable, conn: AsyncConnection, adapter: Any, row: RecordRow
) -> bool | None:
    """asyncpg's commit in one round trip: the key's expired row deleted, the row
    inserted and COMMIT, sent as one text (`RecordsTable._in_one`: asyncpg has no
    pipeline, and its transaction's COMMIT is a query of its own). The insert raises on
    an unexpired row (the primary key), which aborts the rest, the COMMIT included:
    False, nothing of the run committed. None, having sent nothing, unless the
    transaction is the one SQLAlchemy's asyncpg adapter began (its asyncpg Transaction
    the connection's top one, which are then ended without a second COMMIT; SQLAlchemy
    2.1's adapter, whose state is those two), or the record is too large to send as hex."""
    raw = adapter.driver_connection
    xact = getattr(adapter, "_transaction", None)
    if xact is None or getattr(raw, "_top_xact", None) is not xact:
        return None
    if hasattr(adapter, "_started"):
        return None  # SQLAlchemy 2.0's adapter, whose own flag would outlive the commit
    text = records._in_one(conn.dialect, row)
    if text is None:
        return None
    try:
        await raw.execute(text)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == "23505" and (
            getattr(exc, "table_name", None) == records.table.name
        ):
            return False  # the key's row: another run committed it first
        raise
    # The server committed: asyncpg's and the adapter's transaction end here too.
    raw._top_xact = None
    adapter._transaction = None
    return True


async def begin_looking(
    records: RecordsTable, conn: AsyncConnection, key: bytes, now: datetime.datetime
) -> Any:
    """psycopg: the run's transaction begun and `key` looked up in one round trip, one
    query (`_psycopg.lookup_text`), its row or None. Where psycopg cannot begin so, the
    lookup as before: in a pipeline, behind psycopg's own BEGIN if any."""
    raw: Any = (await pooled(conn)).driver_connection  # psycopg's own
    text = lookup_text(records, conn.dialect, raw, key, now)
    if text is None:
        async with raw.pipeline():
            cursor = await raw.execute(records._sql(conn, LOOKUP_SQL_PSYCOPG), (key, now))
        return await cursor.fetchone()
    with begins_nothing(raw):
        # Not counted towards preparing: a text made for one key is never seen again.
        cursor = await raw.execute(text, prepare=False)
    cursor.nextset()  # past BEGIN's result, to the SELECT's
    return await cursor.fetchone()


async def at_once(
    records: RecordsTable, conn: AsyncConnection, tx: AsyncTransaction, row: RecordRow
) -> bool:
    """psycopg's commit in one round trip and one query: the text asyncpg's `in_one`
    sends (the expired row's DELETE, the INSERT and COMMIT), which a query without
    parameters carries whole; a pipeline of the three costs the app several event loop
    turns more. The insert raises on an unexpired row (the primary key), which aborts
    the rest, the COMMIT included: False, nothing of the run committed. A record too
    large to send as hex goes through the pipeline (`pipelined`)."""
    text = records._in_one(conn.dialect, row)
    if text is None:
        return await pipelined(records, conn, tx, row)
    raw: Any = (await pooled(conn)).driver_connection  # psycopg's own
    # made for one row: never prepared
    return await _ended(records, tx, raw.execute(text, prepare=False))


async def pipelined(
    records: RecordsTable, conn: AsyncConnection, tx: AsyncTransaction, row: RecordRow
) -> bool:
    """psycopg's pipeline mode: the expired row's delete, the insert and the COMMIT sent
    together and answered together (one round trip, as the COMMIT alone would cost).
    The insert raises on an unexpired row (the primary key), which aborts what follows
    it in the pipeline, the COMMIT included: nothing of the run commits."""
    raw: Any = (await pooled(conn)).driver_connection  # psycopg's own
    statements = records._pipeline(conn.dialect, row)

    async def send() -> None:
        async with raw.pipeline(), raw.cursor() as cursor:
            for sql, params in statements:
                await cursor.execute(sql, params)

    return await _ended(records, tx, send())


async def _ended(records: RecordsTable, tx: AsyncTransaction, sent: Awaitable[object]) -> bool:
    """Await what ends the server's transaction with COMMIT: False if the insert met an
    unexpired row (which aborted the COMMIT with it), else True once SQLAlchemy's side of
    the transaction is closed too (nothing is sent: the server's has ended)."""
    try:
        await sent
    except Exception as exc:
        if taken(records, exc):
            return False
        raise
    await tx.commit()
    return True


async def pooled(conn: AsyncConnection) -> Any:
    """`conn`'s pooled DBAPI connection (`get_raw_connection`), without the greenlet
    SQLAlchemy's call starts when `conn` holds one already (open and not invalidated, as a
    run's is): that call only reconnects otherwise."""
    sync = conn.sync_connection
    if sync is not None and not sync.closed and not sync.invalidated:
        return sync.connection
    return await conn.get_raw_connection()


async def drop_if_broken(conn: AsyncConnection, exc: Exception) -> None:
    """Invalidate `conn` if it was lost (`exc` says the database is unavailable, or the
    driver's connection is closed), since after a driver's own call (asyncpg's, psycopg's
    pipeline), which SQLAlchemy did not make, SQLAlchemy would give it back to the pool and
    every later call would meet the same closed connection."""
    if conn.invalidated:
        return
    lost = unavailable(exc)
    if not lost:
        try:
            raw: Any = (await conn.get_raw_connection()).driver_connection
        except Exception:
            return
        is_closed = getattr(raw, "is_closed", None)  # asyncpg's
        lost = bool(is_closed()) if callable(is_closed) else bool(getattr(raw, "closed", False))
    if lost:
        with contextlib.suppress(Exception):
            await conn.invalidate(exc)
