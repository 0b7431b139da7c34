"""The app's payments, in its own SQL database (SQLite unless ``GOBLIN_DATABASE_URL`` says
otherwise), next to the middleware's records.

A charge is one row of ``payments``, written through the run's connection
(`goblin_idem.sql.connection`), so it commits together with the stored response: a
response the client saw always has its charge, and a charge always has its response, which
the database replays when the store has lost it. The ledger view is read from the same
table, so a key charged twice would show two payment ids.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table, event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from goblin_idem.exceptions import NotInRunError
from goblin_idem.sql import SqlRecords, connection

from .ledger import Payment, view

__all__ = ["Database", "charge", "get_payment", "ledger_view", "payments", "writes"]

metadata = MetaData()
payments = Table(
    "payments",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("account", String(64), nullable=False, index=True),
    Column("amount_cents", Integer, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("created", String(40), nullable=False),
    Column("idempotency_key", String(255)),
)


def _payment_id(number: int) -> str:
    return f"pay_{number:06d}"


class Database:
    """The engine, the middleware's `SqlRecords` and the app's tables, on one database.

    Without a URL it is a new SQLite file in the temporary directory, removed when the app
    stops: each start begins empty, as the embedded store does.
    """

    def __init__(self, url: str | None = None) -> None:
        self.temporary: Path | None = None
        if url is None:
            name = f"goblin-idem-example-{os.getpid()}-{secrets.token_hex(4)}.db"
            self.temporary = Path(tempfile.gettempdir()) / name
            url = f"sqlite+aiosqlite:///{self.temporary}"
        self.url = url
        self.engine: AsyncEngine = create_async_engine(url)
        if self.engine.dialect.name == "sqlite":
            # WAL: readers (the ledger, the middleware's lookups) do not wait for a writer,
            # and a writer waits its turn (busy_timeout) instead of failing at once. A demo's
            # database: a power cut may lose the last commits (synchronous=NORMAL).
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)
        self.records = SqlRecords(self.engine)

    @property
    def where(self) -> str:
        """The URL without its password, for logs."""
        return make_url(self.url).render_as_string(hide_password=True)

    async def create_tables(self) -> None:
        """The middleware's records table and the app's own (safe to repeat)."""
        await self.records.create_table()
        async with self.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)

    async def aclose(self) -> None:
        """Close the pool; remove the temporary file, if this is one."""
        await self.engine.dispose()
        if self.temporary is not None:
            _remove(self.temporary)


def _remove(db: Path) -> None:
    """A SQLite file and the files SQLite keeps beside it."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{db}{suffix}").unlink()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")  # in WAL mode: no fsync at each commit
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


@contextlib.asynccontextmanager
async def writes(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """Where a handler writes: under an Idempotency-Key, the run's connection (it commits
    with the stored response); without one, a transaction of its own, committed on exit."""
    try:
        run: AsyncConnection | None = await connection()
    except NotInRunError:  # no key: no record to commit with
        run = None
    if run is not None:
        yield run
        return
    async with engine.begin() as own:
        yield own


async def charge(
    conn: AsyncConnection,
    account: str,
    amount_cents: int,
    currency: str,
    idempotency_key: str | None,
) -> Payment:
    """Insert one payment in `conn`'s transaction; it commits when that transaction does."""
    created = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    result = await conn.execute(
        payments.insert()
        .values(
            account=account,
            amount_cents=amount_cents,
            currency=currency,
            created=created,
            idempotency_key=idempotency_key,
        )
        .returning(payments.c.id)
    )
    return Payment(
        id=_payment_id(result.scalar_one()),
        account=account,
        amount_cents=amount_cents,
        currency=currency,
        created=created,
        idempotency_key=idempotency_key,
    )


def _as_dict(row: Any) -> dict[str, Any]:
    return {
        "id": _payment_id(row.id),
        "account": row.account,
        "amount_cents": row.amount_cents,
        "currency": row.currency,
        "created": row.created,
    }


async def get_payment(engine: AsyncEngine, payment_id: str) -> dict[str, Any] | None:
    number = payment_id.removeprefix("pay_")
    if not number.isdigit():
        return None
    async with engine.connect() as conn:
        row = (await conn.execute(select(payments).where(payments.c.id == int(number)))).first()
    return None if row is None else _as_dict(row)


async def ledger_view(engine: AsyncEngine, account: str | None = None) -> dict[str, Any]:
    """Balances, payment counts, and the payment ids made under each Idempotency-Key (the
    same shape as the store's ledger in `example_app.ledger`)."""
    query = select(payments).order_by(payments.c.id)
    if account is not None:
        query = query.where(payments.c.account == account)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
        total = (await conn.execute(select(func.count()).select_from(payments))).scalar_one()
    accounts: dict[str, Any] = {}
    for row in rows:
        doc = accounts.setdefault(row.account, {"balances": {}, "payments": 0, "by_key": {}})
        doc["balances"][row.currency] = doc["balances"].get(row.currency, 0) + row.amount_cents
        doc["payments"] += 1
        if row.idempotency_key is not None:
            doc["by_key"].setdefault(row.idempotency_key, []).append(_payment_id(row.id))
    return view(total, accounts)
