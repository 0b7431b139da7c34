"""`SqlRecords`' commit through the drivers' own calls (asyncpg's, psycopg's pipeline): the
record inserted and the run's transaction committed in one round trip, where SQLAlchemy's
layer would take two, or cost more CPU than the round trip itself."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncTransaction

from .._recording import RecordRow
from ._failures import unavailable
from ._table import IN_ONE_MAX, IN_ONE_SQL, RecordsTable, _utcnow

__all__ = ["drop_if_broken", "in_one", "pipelined"]


async def in_one(
    records: RecordsTable, conn: AsyncConnection, adapter: Any, row: RecordRow
) -> bool | None:
    """asyncpg's commit in one round trip: the key's expired row deleted, the row
    inserted and COMMIT, sent as one text (asyncpg has no pipeline, and its
    transaction's COMMIT is a query of its own). The insert raises on an unexpired row
    (the primary key), which aborts the rest, the COMMIT included: False, nothing of
    the run committed. The values go in the text as literals made of hex digits and
    ISO timestamps only, never text from outside. None, having sent
    nothing, unless the transaction is the one SQLAlchemy's asyncpg adapter began (its
    asyncpg Transaction the connection's top one, which are then ended without a
    second COMMIT; SQLAlchemy 2.1's adapter, whose state is those two), or the record
    is too large to send as hex."""
    raw = adapter.driver_connection
    xact = getattr(adapter, "_transaction", None)
    too_large = len(row.data) > IN_ONE_MAX
    if xact is None or getattr(raw, "_top_xact", None) is not xact or too_large:
        return None
    if hasattr(adapter, "_started"):
        return None  # SQLAlchemy 2.0's adapter, whose own flag would outlive the commit
    if not row.key_hash.isascii() or not row.key_hash.isalnum():
        return None  # never the case (a hex digest), but a literal must hold no quote
    now = _utcnow()
    expires = now + datetime.timedelta(milliseconds=row.ttl_ms)
    table = conn.dialect.identifier_preparer.format_table(records.table)
    text = IN_ONE_SQL.format(table=table.replace("{", "{{").replace("}", "}}")).format(
        key=row.key.hex(),
        key_hash=row.key_hash,
        fp=row.fp.hex(),
        record=row.data.hex(),
        now=now.isoformat(),
        expires=expires.isoformat(),
    )
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


async def pipelined(
    records: RecordsTable, conn: AsyncConnection, tx: AsyncTransaction, row: RecordRow
) -> bool:
    """psycopg's pipeline mode: the expired row's delete, the insert and the COMMIT sent
    together and answered together (one round trip, as the COMMIT alone would cost).
    The insert raises on an unexpired row (the primary key), which aborts what follows
    it in the pipeline, the COMMIT included: nothing of the run commits."""
    from psycopg.errors import UniqueViolation

    raw: Any = (await conn.get_raw_connection()).driver_connection  # psycopg's own
    statements = records._pipeline(conn.dialect, row)
    try:
        async with raw.pipeline(), raw.cursor() as cursor:
            for sql, params in statements:
                await cursor.execute(sql, params)
    except UniqueViolation as exc:
        if not records._taken(exc):
            raise
        return False
    await tx.commit()  # SQLAlchemy's side: the server's has ended, so nothing is sent
    return True


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
