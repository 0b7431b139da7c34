"""PostgresStore beyond the spec's rows: one statement per step, the server's clock, expiry
and purge, a restart of the database, and the middleware's main flows on it alone.

Everything runs on a real PostgreSQL started for the tests (tests/support/postgres.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.exceptions import ConnectionError as StoreConnectionError
from redis.exceptions import ResponseError
from starlette.applications import Starlette

from goblin_idem import CLAIMED, IdempotencyMiddleware, PostgresStore
from goblin_idem.store._postgres_sql import ddl
from tests.middleware.test_lifespan import lifespan
from tests.support.asgi import Handler, problem, request
from tests.support.backends import POSTGRES_BACKENDS, postgres_store
from tests.support.postgres import (
    PgBouncer,
    Postgres,
    promote,
    start_pgbouncer,
    start_postgres,
    start_standby,
)
from tests.support.waits import until, until_sync


@pytest.fixture(params=POSTGRES_BACKENDS)
async def pg(request: pytest.FixtureRequest, postgres: Postgres) -> AsyncIterator[PostgresStore]:
    database: str = request.getfixturevalue("store_database")
    async with postgres_store(request.param, postgres, database) as store:
        yield store


@pytest.fixture
async def asyncpg_store(postgres: Postgres) -> AsyncIterator[PostgresStore]:
    database: str = postgres.new_database()
    async with postgres_store("postgres-asyncpg", postgres, database) as store:
        yield store


class Statements:
    """Counts what the store sends: each call of its driver is one statement on the wire."""

    def __init__(self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent = 0
        driver = store.driver
        for name in ("row", "rows", "script"):
            original = getattr(driver, name)
            monkeypatch.setattr(driver, name, self._counting(original))

    def _counting(self, original: Any) -> Any:
        async def counted(*args: Any) -> Any:
            self.sent += 1
            return await original(*args)

        return counted

    def take(self) -> int:
        sent, self.sent = self.sent, 0
        return sent


async def _absent(store: PostgresStore, key: str) -> bool:
    return await store.pttl(key) == -2


# -- one statement per step ------------------------------------------------------------------


async def test_each_step_is_one_statement(
    pg: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent = Statements(pg, monkeypatch)
    assert await pg.claim_unless_done("c", "r", "t", 30) is CLAIMED
    assert sent.take() == 1
    assert await pg.caexpire_many([("c", "t", 30000)] * 50 + [("c", "other", 30000)]) == [
        1
    ] * 50 + [0]
    assert sent.take() == 1  # fifty renewals, one statement
    assert await pg.publish("r", b"done", 60000, "c", "t") == 1
    assert sent.take() == 1
    assert await pg.claim_unless_done("c", "r", "t2", 30) == b"done"
    assert sent.take() == 1


async def test_round_trips_per_request_as_with_redis(
    pg: PostgresStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New key 2 (claim, publish), replay 1, in flight 1, no key 0."""
    sent = Statements(pg, monkeypatch)
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(handler, store=pg)
    first = asyncio.create_task(request(mw, key="k"))
    await until(lambda: handler.runs, what="the handler started")
    sent.take()
    assert (await request(mw, key="k")).status == 409
    assert sent.take() == 1
    handler.gate.set()  # type: ignore[union-attr]
    assert (await first).status == 201
    assert sent.take() == 1  # the publish (the claim was counted before)
    assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
    assert sent.take() == 1
    assert (await request(mw)).status == 201
    assert sent.take() == 0
    assert (await request(mw, key="k2")).status == 201
    assert sent.take() == 2


async def test_a_duplicate_neither_writes_nor_locks_the_claim(pg: PostgresStore) -> None:
    """A replay or an in-flight duplicate is a read: the live claim's row keeps its version
    and gets no lock (xmax stays 0), so the statement commits no WAL to wait for."""
    from goblin_idem.store._postgres_sql import Statement

    version = Statement.of(f"SELECT xmin::text, xmax::text FROM {pg.table} WHERE key = $1")
    assert await pg.claim_unless_done("c", "r", "t", 30) is CLAIMED
    before = await pg.driver.row(version, (b"c",))
    assert before is not None and before[1] == "0"
    for _ in range(3):
        assert await pg.claim("c", "r", "dup", 30) is None
        assert await pg.claim_unless_done("c", "r", "dup", 30) is None
    assert await pg.driver.row(version, (b"c",)) == before


# -- the server's clock ----------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-600.0, 600.0])
async def test_a_skewed_client_clock_can_neither_steal_nor_keep_a_claim(
    asyncpg_store: PostgresStore, monkeypatch: pytest.MonkeyPatch, skew: float
) -> None:
    """A client whose clock is ten minutes off: a live claim stays live to it, and the
    leases it takes last as long as asked, by the database's clock."""
    store = asyncpg_store
    assert await store.claim("c", "r", "honest", 30) is CLAIMED
    real_time, real_time_ns = time.time, time.time_ns
    monkeypatch.setattr(time, "time", lambda: real_time() + skew)
    monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(skew * 1e9))
    assert await store.claim("c", "r", "skewed", 30) is None  # cannot steal it
    assert await store.caexpire("c", "skewed", 30000) == 0
    assert 29_000 < await store.pttl("c") <= 30_000
    assert await store.claim("short", "r", "skewed", 1) is CLAIMED
    assert 0 < await store.pttl("short") <= 1_000  # its lease is the server's second
    await until(lambda: _absent(store, "short"), 3, "short expired")  # ... and it ends on time
    assert await store.claim("short", "r", "next", 30) is CLAIMED


# -- expiry and purge ------------------------------------------------------------------------


async def _rows(store: PostgresStore) -> int:
    row = await store.driver.row(_COUNT[store.table], ())
    assert row is not None
    return int(row[0])


class _Count(dict[str, Any]):
    def __missing__(self, table: str) -> Any:
        from goblin_idem.store._postgres_sql import Statement

        self[table] = Statement.of(f"SELECT count(*) FROM {table}")
        return self[table]


_COUNT = _Count()


async def test_purge_removes_expired_rows_only_in_batches(asyncpg_store: PostgresStore) -> None:
    store = asyncpg_store
    await asyncio.gather(
        *(store.set(f"gone:{i}", "x", px=50) for i in range(2500)),
        *(store.set(f"kept:{i}", "x", px=60_000) for i in range(100)),
        store.set("forever", "x"),
    )
    await until(lambda: _absent(store, "gone:2499"), what="gone:2499 expired")
    assert await _rows(store) == 2601  # expired rows are absent, not yet deleted
    assert await store.get("gone:0") is None
    assert await store.purge_expired() == 2500  # three batches of at most 1000
    assert await _rows(store) == 101
    assert await store.purge_expired() == 0
    assert await store.get("kept:99") == b"x" and await store.get("forever") == b"x"


async def test_background_purge_keeps_the_table_to_the_live_keys(
    postgres: Postgres,
) -> None:
    database = postgres.new_database()
    async with postgres_store(
        "postgres-asyncpg", postgres, database, purge_interval_seconds=0.1
    ) as store:
        for round_ in range(5):  # claims that lapse, under steady load
            await asyncio.gather(*(store.claim(f"c:{round_}:{i}", "r", "t", 1) for i in range(200)))
        await store.set("live", "x", ex=60)

        async def purged() -> bool:
            return await _rows(store) <= 1

        await until(purged, 15, "the background purge caught up")
        assert await store.get("live") == b"x"


def test_purge_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="purge_interval_seconds"):
        PostgresStore.from_url("postgresql://127.0.0.1/x", purge_interval_seconds=0)


# -- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize("table", ["bad name", "x;drop table y", "", "a.b.c", 1])
def test_a_table_name_is_a_plain_identifier(table: object) -> None:
    with pytest.raises(ValueError, match="plain SQL identifier"):
        PostgresStore.from_url("postgresql://127.0.0.1/x", table=table)  # type: ignore[arg-type]


def test_not_a_postgresql_url() -> None:
    with pytest.raises(ValueError, match="postgresql://"):
        PostgresStore.from_url("redis://127.0.0.1:6379/0")


async def test_an_engine_that_pings_is_refused(postgres: Postgres) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(postgres.url(), pool_pre_ping=True)
    try:
        with pytest.raises(ValueError, match="pool_pre_ping=False"):
            PostgresStore(engine)
    finally:
        await engine.dispose()


async def test_a_missing_table_says_how_to_create_it(postgres: Postgres) -> None:
    store = PostgresStore.from_url(postgres.url(driver="asyncpg"), table="never_created")
    try:
        with pytest.raises(ResponseError, match="postgres-ddl"):
            await store.claim("c", "r", "t", 30)
    finally:
        await store.aclose()


def test_the_ddl_names_the_table() -> None:
    text = ddl("app.idem")
    assert "CREATE TABLE IF NOT EXISTS app.idem" in text
    assert "CREATE INDEX IF NOT EXISTS idem_expires_at ON app.idem" in text


# -- the database unavailable or restarted ---------------------------------------------------


@pytest.fixture
def own_postgres() -> Iterator[Postgres]:
    """A PostgreSQL for this test alone, which it may stop and start."""
    server = start_postgres()
    yield server
    server.remove()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_restart_keeps_the_claims_and_new_keys_run_again(
    own_postgres: Postgres, driver: str
) -> None:
    store = PostgresStore.from_url(own_postgres.url(driver=driver), timeout=2)
    handler = Handler()
    mw = IdempotencyMiddleware(handler, store=store, retry_after_seconds=1)
    try:
        await store.create_table()
        assert await store.claim("held", "r", "before", 30) is CLAIMED  # in flight
        assert (await request(mw, key="done")).status == 201
        own_postgres.stop(fast=True)  # clients cut off, what committed kept
        with pytest.raises(StoreConnectionError, match=r"PostgreSQL store at 127\.0\.0\.1"):
            await store.claim("x", "r", "t", 30)
        down = await request(mw, key="new")
        assert down.status == 503 and handler.runs == 1
        assert problem(down)["type"] == "urn:goblin-idem:problem:store-unavailable"
        own_postgres.start()
        replies = []

        async def admitted() -> bool:  # the same store, no restart of this process
            replies.append(await request(mw, key="new"))
            return replies[-1].status != 503

        await until(admitted, 10, "new keys admitted after the restart", every=0.05)
        reply = replies[-1]
        assert reply.status == 201 and handler.runs == 2
        assert await store.claim("held", "r", "after", 30) is None  # still held: no rerun
        again = await request(mw, key="done")
        assert again.header("idempotent-replayed") == b"true" and handler.runs == 2
    finally:
        await store.aclose()


async def test_pool_exhausted_is_unavailable_and_named(postgres: Postgres) -> None:
    store = PostgresStore.from_url(postgres.url(driver="asyncpg"), max_connections=1, timeout=0.5)
    try:
        await store.create_table()
        held = await store.driver._take()  # the pool's one connection, as a long statement would
        with pytest.raises(StoreConnectionError, match="all 1 of the pool in use"):
            await store.get("k")
        await store.driver._give(held, True)
        assert await store.get("k") is None  # served again once a connection is free
    finally:
        await store.aclose()


# -- the middleware's flows on PostgreSQL alone ----------------------------------------------


async def test_middleware_replay_reuse_and_in_flight(pg: PostgresStore) -> None:
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(handler, store=pg, retry_after_seconds=2)
    first = asyncio.create_task(request(mw, key="k", body=b"a"))
    await until(lambda: handler.runs, what="the handler started")
    racing = await request(mw, key="k", body=b"a")
    assert racing.status == 409 and racing.header("retry-after") == b"2"
    handler.gate.set()  # type: ignore[union-attr]
    assert (await first).status == 201
    again = await request(mw, key="k", body=b"a")
    assert again.body == b"run 1" and again.header("idempotent-replayed") == b"true"
    reused = await request(mw, key="k", body=b"b")
    assert reused.status == 422
    assert problem(reused)["type"] == "urn:goblin-idem:problem:key-reused"
    assert handler.runs == 1


async def test_twenty_concurrent_duplicates_run_once(pg: PostgresStore) -> None:
    handler = Handler(gate=asyncio.Event())
    mw = IdempotencyMiddleware(handler, store=pg)
    storm = asyncio.gather(*(request(mw, key="storm", body=b"x") for _ in range(20)))
    await until(lambda: mw.counters.in_flight == 19, what="nineteen duplicates refused")
    handler.gate.set()  # type: ignore[union-attr]
    replies = await storm
    assert handler.runs == 1
    assert sorted(r.status for r in replies) == [201] + [409] * 19
    assert (await request(mw, key="storm", body=b"x")).body == b"run 1"


async def test_a_lapsed_claims_late_publish_is_refused(asyncpg_store: PostgresStore) -> None:
    """First publish wins: a run whose lease lapsed and was retaken publishes too late."""
    store = asyncpg_store
    assert await store.claim("c", "r", "slow", 1) is CLAIMED
    await until(lambda: _absent(store, "c"), 3, "the lease on c lapsed")
    assert await store.claim("c", "r", "fast", 30) is CLAIMED
    assert await store.publish("r", b"fast's", 60000, "c", "fast") == 1
    assert await store.publish("r", b"slow's", 60000, "c", "slow") == -1  # superseded
    assert await store.get("r") == b"fast's"
    assert await store.claim("c", "r", "third", 30) == b"fast's"


# -- forget ----------------------------------------------------------------------------------


async def test_forget_never_deletes_a_claim_a_run_holds(pg: PostgresStore) -> None:
    assert await pg.claim("c", "r", "running", 30) is CLAIMED
    await pg.set("h", "hop")
    assert await pg.forget("c", "r", "h") == -1  # a run holds it: nothing deleted
    assert await pg.forget("c", "r", "h", expected="other") == -1
    assert await pg.get("c") == b"running" and await pg.get("h") == b"hop"
    # the record says this very run completed: its claim may go
    assert await pg.forget("c", "r", "h", expected="running") == 2
    assert await pg.pttl("c") == -2 and await pg.pttl("h") == -2


async def test_forget_deletes_a_published_key(pg: PostgresStore) -> None:
    assert await pg.claim("c", "r", "t", 30) is CLAIMED
    assert await pg.publish("r", b"done", 60000, "c", "t") == 1
    await pg.set("h", "hop")
    assert await pg.forget("c", "r", "h") == 3
    assert [await pg.pttl(k) for k in ("c", "r", "h")] == [-2, -2, -2]
    assert await pg.forget("c", "r", "h") == 0  # nothing stored
    assert await pg.claim("c", "r", "again", 30) is CLAIMED  # the key runs anew


async def test_forget_a_lapsed_claim_counts_only_live_keys(
    asyncpg_store: PostgresStore,
) -> None:
    store = asyncpg_store
    assert await store.claim("c", "r", "t", 1) is CLAIMED
    await until(lambda: _absent(store, "c"), 3, "the lease on c lapsed")
    assert await store.forget("c", "r") == 0
    assert await _rows(store) == 0  # the expired row went too


def test_the_printed_ddl_makes_a_working_table(postgres: Postgres) -> None:
    """What `python -m goblin_idem postgres-ddl` prints, run by psql as a migration tool
    would, gives a table the store works on."""
    import subprocess
    import sys

    printed = subprocess.run(
        [sys.executable, "-m", "goblin_idem", "postgres-ddl", "--table", "migrated_keys"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    database = postgres.new_database()
    postgres.psql(printed, database)

    async def use() -> object:
        store = PostgresStore.from_url(postgres.url(database), table="migrated_keys")
        try:
            return await store.claim("c", "r", "t", 30)
        finally:
            await store.aclose()

    assert asyncio.run(use()) is CLAIMED


# -- PgBouncer in transaction mode -----------------------------------------------------------


@pytest.fixture
def pgbouncer(postgres: Postgres) -> Iterator[PgBouncer]:
    bouncer = start_pgbouncer(postgres)
    yield bouncer
    bouncer.stop()


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_pgbouncer_in_transaction_mode(
    pgbouncer: PgBouncer, postgres: Postgres, driver: str
) -> None:
    """Debian's PgBouncer (1.18: no prepared statements across transactions), four server
    connections shared by the store's twenty: with ``prepared_statements=False`` every
    step holds, a claim raced by 200 callers is won once, and a request flows end to end."""
    database = postgres.new_database()
    url = pgbouncer.url(database).replace("postgresql://", f"postgresql+{driver}://")
    store = PostgresStore.from_url(url, prepared_statements=False)
    try:
        await store.create_table()
        replies = await asyncio.gather(*(store.claim("race", "r", f"w{i}", 30) for i in range(200)))
        assert sum(r is CLAIMED for r in replies) == 1 and replies.count(None) == 199
        winner = next(f"w{i}" for i, r in enumerate(replies) if r is CLAIMED)
        assert await store.caexpire_many([("race", winner, 60000)] * 3) == [1, 1, 1]
        assert await store.publish("r", b"done", 60000, "race", winner) == 1
        assert await store.claim_unless_done("race", "r", "late", 30) == b"done"
        mw = IdempotencyMiddleware(Handler(), store=store)
        assert (await request(mw, key="k")).status == 201
        assert (await request(mw, key="k")).header("idempotent-replayed") == b"true"
    finally:
        await store.aclose()


# -- a failover ------------------------------------------------------------------------------


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_failover_to_a_promoted_standby_runs_no_key_twice(driver: str) -> None:
    """Keys in flight on the primary, replicated; the primary crashes and its standby is
    promoted. The same store (a URL naming both, read-write wanted) reaches the new
    primary: the claims in flight are still held there (no key runs twice), their results
    publish, and new keys run."""
    primary = start_postgres()
    standby: Postgres | None = None
    store: PostgresStore | None = None
    try:
        standby = start_standby(primary)
        hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
        url = f"postgresql+{driver}://postgres@{hosts}/postgres?target_session_attrs=read-write"
        store = PostgresStore.from_url(url, timeout=2)
        await store.create_table()
        handler = Handler()
        mw = IdempotencyMiddleware(handler, store=store, retry_after_seconds=1)
        assert (await request(mw, key="done")).status == 201
        held = [await store.claim(f"c{i}", f"r{i}", f"run{i}", 60) for i in range(20)]
        assert held == [CLAIMED] * 20
        written = primary.psql("SELECT pg_current_wal_lsn()")
        replayed = f"SELECT pg_last_wal_replay_lsn() >= '{written}'::pg_lsn"
        until_sync(lambda: standby.psql(replayed) == "t", what="the claims are on the standby")
        primary.stop()  # a crash
        promote(standby)
        replies: list[bytes | None] = []

        async def answered() -> bool:
            try:
                replies[:] = [await store.claim(f"c{i}", f"r{i}", "dup", 60) for i in range(20)]
            except StoreConnectionError:
                return False
            return True

        await until(answered, what="the promoted standby answered", every=0.1)
        assert replies == [None] * 20  # still in flight: no second run
        assert await store.publish("r0", b"done", 60000, "c0", "run0") == 1
        assert await store.claim("c0", "r0", "dup", 60) == b"done"
        again = await request(mw, key="done")
        assert again.header("idempotent-replayed") == b"true" and handler.runs == 1
        assert (await request(mw, key="new")).status == 201 and handler.runs == 2
    finally:
        if store is not None:
            await store.aclose()
        if standby is not None:
            standby.remove()
        primary.remove()


async def test_forget_a_result_whose_claim_is_gone(pg: PostgresStore) -> None:
    await pg.set("r", "done", px=60_000)
    assert await pg.forget("c", "r") == 1
    assert await pg.pttl("r") == -2


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_an_engines_connection_goes_back_as_the_app_had_it(
    postgres: Postgres, driver: str
) -> None:
    """The store borrows the app's engine's one connection; the app's next transaction on
    it still rolls back (psycopg's was switched to autocommit only while the store had it)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(
        postgres.url(postgres.new_database(), driver), pool_size=1, max_overflow=0
    )
    store = PostgresStore(engine)
    try:
        await store.create_table()
        assert await store.claim("c", "r", "t", 30) is CLAIMED
        async with engine.connect() as conn:
            await conn.execute(text("CREATE TABLE app_rows (n int)"))
            await conn.rollback()
        async with engine.connect() as conn:
            found = await conn.execute(text("SELECT to_regclass('app_rows') IS NULL"))
            assert found.scalar() is True  # rolled back: the app's transaction was one
        assert await store.get("c") == b"t"
    finally:
        await store.aclose()
        await engine.dispose()


async def test_startup_checks_the_table_and_stops_with_the_fix(postgres: Postgres) -> None:
    """A table not created stops startup (every lifespan mode runs this check), not the first
    keyed request with a 503; with check_store=False the app starts, warned."""
    store = PostgresStore.from_url(postgres.url(driver="asyncpg"), table="not_created_yet")
    try:
        app = IdempotencyMiddleware(Starlette(), store=store, close_store=False)
        async with lifespan(app, expect="failed") as sent:
            pass
        message = sent[-1]["message"]
        assert "not_created_yet does not exist" in message and "postgres-ddl" in message
        assert "check_store=False" in message
        started = IdempotencyMiddleware(
            Starlette(), store=store, check_store=False, close_store=False
        )
        async with lifespan(started):
            pass
        await store.create_table()
        fine = IdempotencyMiddleware(Starlette(), store=store, close_store=False)
        async with lifespan(fine):
            pass
    finally:
        await store.aclose()
