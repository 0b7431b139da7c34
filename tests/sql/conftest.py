"""SQL records on real servers: a PostgreSQL per test worker (asyncpg and psycopg) and SQLite
on a temporary file (aiosqlite), each paired with one store, so that every database and
driver, and Redis and Valkey in script and native mode, are covered without multiplying
them all. Every test has tables of its own (records and payments)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table, create_engine, func, insert, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from goblin_idem import RedisStore, _recording
from goblin_idem.sql import SqlRecords, SyncSqlRecords
from tests.support.apps.sql_app import payments_table
from tests.support.backends import server_for
from tests.support.postgres import Postgres
from tests.support.servers import Server
from tests.support.sql import create_tables, create_tables_sync

# (database and driver, store): each database with one store.
PAIRS = [
    ("postgresql-asyncpg", "redis-script"),
    ("postgresql-psycopg", "valkey-native"),
    ("sqlite-aiosqlite", "redis-native"),
]
# For what only a database server does (a connection cut, concurrent writers refused).
on_postgres = pytest.mark.parametrize(
    "setup",
    [pair for pair in PAIRS if pair[0].startswith("postgresql")],
    ids=lambda pair: f"{pair[0]}+{pair[1]}",
    indirect=True,
)


@pytest.fixture(scope="session")
def pg_database(postgres: Postgres) -> str:
    """One database per worker; tests keep apart by their tables' names."""
    return postgres.new_database()


@pytest.fixture
def database(postgres: Postgres) -> str:
    """A database of the test's own, for an app whose tables have fixed names."""
    return postgres.new_database()


@dataclass
class Setup:
    """One test's database, tables, records and store."""

    name: str
    url: str
    engine: AsyncEngine
    records: SqlRecords
    payments: Table
    store: RedisStore
    postgres: Postgres | None

    async def payment_count(self, ref: str | None = None) -> int:
        query = select(func.count()).select_from(self.payments)
        if ref is not None:
            query = query.where(self.payments.c.ref == ref)
        async with self.engine.connect() as conn:
            return int((await conn.execute(query)).scalar_one())

    async def rows(self) -> list[tuple[object, ...]]:
        t = self.records.table
        async with self.engine.connect() as conn:
            return [tuple(r) for r in await conn.execute(select(t))]


def database_url(
    request: pytest.FixtureRequest, name: str, tmp_path: Path
) -> tuple[str, Postgres | None]:
    if name.startswith("sqlite"):
        return f"sqlite+aiosqlite:///{tmp_path / 'app.db'}", None
    postgres: Postgres = request.getfixturevalue("postgres")
    database: str = request.getfixturevalue("pg_database")
    return postgres.url(database, name.split("-")[1]), postgres


def forgotten_here() -> list[asyncio.Future[Any]]:
    """The lookups left to end (`_recording._forgotten`) of this event loop: a sync app's
    run on the process's loop thread, in another test, are not this loop's to wait for."""
    loop = asyncio.get_running_loop()
    return [task for task in _recording._forgotten if task.get_loop() is loop]


async def forgotten_ended(timeout: float | None = None) -> None:
    """Wait for this loop's lookups left to end (a kept connection given back)."""
    pending = forgotten_here()
    if pending:
        await asyncio.wait(pending, timeout=timeout)


@pytest.fixture(params=PAIRS, ids=[f"{d}+{s}" for d, s in PAIRS])
async def setup(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Setup]:
    db, store_name = request.param
    url, postgres = database_url(request, db, tmp_path)
    engine = create_async_engine(url)
    suffix = secrets.token_hex(4)
    records = SqlRecords(engine, table=f"records_{suffix}")
    payments = payments_table(f"payments_{suffix}")
    await create_tables(records, payments)
    server = server_for(request, store_name)
    store = RedisStore.from_url(server.url, mode=store_name.split("-")[1])  # type: ignore[arg-type]
    await store.client.flushall()  # type: ignore[union-attr]
    yield Setup(db, url, engine, records, payments, store, postgres)
    await forgotten_ended()  # lookups that duplicates did not need: they end on their own
    await store.aclose()
    await engine.dispose()


# -- sync records (a WSGI or Flask app's): a sync Engine on the same databases ------------

SYNC_DATABASES = ["postgresql-psycopg", "sqlite-pysqlite"]
# A key an attacker wrote as SQL (quotes, a statement, a comment), for the records' one-query
# lookup and commit, which write their values into the text.
FORGED = "o1'); DROP TABLE payments; -- \\' \"; COMMIT; SELECT '"


@dataclass
class SyncSetup:
    """One test's database (a sync URL), tables, sync records and store's server."""

    name: str
    url: str
    engine: Engine
    records: SyncSqlRecords
    payments: Table
    redis: Server
    postgres: Postgres | None

    def store(self) -> RedisStore:
        """A store on the test's Redis, for a middleware built in this process."""
        return RedisStore.from_url(self.redis.url)

    def payment_count(self, ref: str | None = None) -> int:
        query = select(func.count()).select_from(self.payments)
        if ref is not None:
            query = query.where(self.payments.c.ref == ref)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def rows(self) -> list[tuple[object, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.execute(select(self.records.table))]

    def env(self) -> dict[str, str]:
        """The environment of tests/support/apps/sync_sql_app.py for these tables."""
        return {
            "DATABASE_URL": self.url,
            "REDIS_URL": self.redis.url,
            "RECORDS_TABLE": self.records.table.name,
            "PAYMENTS_TABLE": self.payments.name,
        }

    def defer_a_unique_ref(self, taken: str) -> None:
        """A constraint checked at COMMIT (PostgreSQL): a commit of `taken` again fails."""
        table = self.payments.name
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    f"ALTER TABLE {table} ADD CONSTRAINT {table}_ref UNIQUE (ref) "
                    "DEFERRABLE INITIALLY DEFERRED"
                )
            )
            conn.execute(insert(self.payments).values(ref=taken, amount=1))


@pytest.fixture(params=SYNC_DATABASES)
def sync_setup(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: Server
) -> Iterator[SyncSetup]:
    """Sync records on PostgreSQL (psycopg) or a SQLite file, with tables of the test's own;
    the test's Redis emptied."""
    if request.param.startswith("sqlite"):
        url, postgres = f"sqlite:///{tmp_path / 'app.db'}", None
    else:
        postgres = request.getfixturevalue("postgres")
        url = postgres.url(request.getfixturevalue("pg_database"), "psycopg")
    engine = create_engine(url)
    suffix = secrets.token_hex(4)
    records = SyncSqlRecords(engine, table=f"records_{suffix}")
    payments = payments_table(f"payments_{suffix}")
    create_tables_sync(records, payments)
    with redis_server.sync_client() as client:
        client.flushall()
    yield SyncSetup(request.param, url, engine, records, payments, redis_server, postgres)
    engine.dispose()


on_sync_postgres = pytest.mark.parametrize("sync_setup", ["postgresql-psycopg"], indirect=True)
