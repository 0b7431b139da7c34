"""The SQL tables of a test, made in one place: the records' table and the app's own (payments,
deliveries, effects), as a fresh deployment of the app makes them."""

from __future__ import annotations

from sqlalchemy import Table

from goblin_idem.sql import SqlRecords, SyncSqlRecords


async def create_tables(records: SqlRecords, *tables: Table) -> None:
    """The records' table and `tables`, in the records' database (on their AsyncEngine)."""
    await records.create_table()
    async with records.engine.begin() as conn:
        for table in tables:
            await conn.run_sync(table.create, checkfirst=True)


def create_tables_sync(records: SyncSqlRecords, *tables: Table) -> None:
    """As `create_tables`, on the sync records' Engine."""
    records.create_table()
    with records.engine.begin() as conn:
        for table in tables:
            table.create(conn, checkfirst=True)
