"""Faults around the commit: the database gone, the store restarted mid-run; and the
transaction's own rules (connection() outside a run, commit() refused)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, RedisStore
from goblin_idem._keys import key_names
from goblin_idem._recording import RecordRow
from goblin_idem.exceptions import CommitRefusedError, NotInRunError
from goblin_idem.sql import SqlRecords, connection, session
from goblin_idem.sql._context import RunTransaction
from tests.sql.conftest import Setup, on_postgres
from tests.sql.test_middleware import pay, replayed
from tests.support.apps.sql_app import Gate, build, payments_table
from tests.support.asgi import problem, request
from tests.support.postgres import start_postgres
from tests.support.servers import Server, free_port
from tests.support.sql import create_tables


async def test_connection_and_session_outside_a_run_say_why() -> None:
    with pytest.raises(NotInRunError, match="outside both"):
        await connection()
    with pytest.raises(NotInRunError, match="records="):
        await session()


async def test_commit_is_refused_on_the_connection_and_the_session(setup: Setup) -> None:
    tx = RunTransaction(setup.records, setup.engine)
    entered = tx.enter()
    try:
        conn = await connection()
        with pytest.raises(CommitRefusedError, match="do not commit it yourself"):
            await conn.commit()
        with pytest.raises(CommitRefusedError, match="begin_nested"):
            conn.begin()
        async with conn.begin_nested():  # a savepoint: allowed
            pass
        s = await session()
        with pytest.raises(CommitRefusedError):
            await s.commit()
    finally:
        tx.leave(entered)
        await tx.rollback()


@on_postgres  # a database server's connection is what is cut
async def test_the_database_gone_at_commit_answers_503_and_nothing_happened(
    setup: Setup,
) -> None:
    """The run's connection cut before its commit: 503 naming the database (the commit
    cannot have happened), counted as the database's error."""
    gate = Gate()
    app = build(setup.store, setup.records, setup.payments, gate=gate)
    running = asyncio.ensure_future(pay(app, "k1", "gone", "gate"))
    entered, go = gate.events("gone")
    await entered.wait()
    # Every connection in a transaction (the run's) is ended by the server, as if it went down.
    setup.postgres.psql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
    )
    go.set()
    reply = await running
    assert reply.status == 503 and reply.header("retry-after") is not None
    assert problem(reply)["type"].endswith("database-unavailable")
    counters = IdempotencyMiddleware.of(app).counters
    assert counters.database_errors == 1 and counters.store_errors == 0
    assert await setup.payment_count("gone") == 0
    assert await setup.rows() == []
    again = await pay(app, "k1", "gone")  # the key was released: the request runs
    assert again.status == 201 and not replayed(again)
    assert await setup.payment_count("gone") == 1


async def test_a_store_restarted_without_persistence_mid_run(
    setup: Setup, own_redis: Server
) -> None:
    """The restart loses the claim: a duplicate runs too, and the key's row stops it at its
    commit; both clients get the first run's answer, and one payment is made."""
    store = RedisStore.from_url(own_redis.url)
    gate = Gate()
    app = build(store, setup.records, setup.payments, gate=gate)
    try:
        first = asyncio.ensure_future(pay(app, "k1", "r", "gate"))
        await gate.events("r")[0].wait()
        own_redis.restart()
        for _ in range(10):  # a pooled connection the restart broke answers 503 once
            second = asyncio.ensure_future(pay(app, "k1", "r", "gate"))
            await asyncio.sleep(0.05)  # the second run claims the key and starts its write
            if not second.done():
                break
            assert (await second).status == 503
        gate.events("r")[1].set()
        one, two = await asyncio.gather(first, second)
    finally:
        await store.aclose()
    assert one.status == two.status == 201 and one.body == two.body
    assert replayed(one) != replayed(two)  # the later commit was refused: it got the first
    assert await setup.payment_count("r") == 1


async def test_a_database_down_at_the_claim_step_answers_503_and_frees_the_key(
    redis_server: Server,
) -> None:
    """A won claim whose database lookup fails: nothing runs (the database may hold a
    committed record), and the claim is freed for the retry."""
    store = RedisStore.from_url(redis_server.url)
    records = SqlRecords(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/app")
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1

    try:
        middleware = IdempotencyMiddleware(app, store=store, records=records)
        reply = await request(middleware, key="down-at-claim", body=b"{}")
        assert reply.status == 503 and reply.header("retry-after") is not None
        assert runs == 0
        assert await store.client.keys("*down*") == []  # type: ignore[union-attr]
        names = key_names(b"idem", b"", b"down-at-claim")
        assert await store.get(names.claim) is None
    finally:
        await store.aclose()
        await records.aclose()


async def test_the_database_stopped_at_commit_and_started_again(redis_server: Server) -> None:
    postgres = start_postgres()
    store = RedisStore.from_url(redis_server.url)
    try:
        records = SqlRecords(postgres.url())
        payments = payments_table("payments")
        await create_tables(records, payments)
        gate = Gate()
        app = build(store, records, payments, gate=gate)
        running = asyncio.ensure_future(pay(app, "stopped", "s", "gate"))
        entered, go = gate.events("s")
        await entered.wait()
        postgres.stop(fast=True)  # what was committed stays (no crash recovery needed)
        go.set()
        reply = await running
        assert reply.status == 503 and problem(reply)["type"].endswith("database-unavailable")
        postgres.start()
        again = await pay(app, "stopped", "s")
        assert again.status == 201 and not replayed(again)
        async with records.engine.connect() as conn:
            rows = await conn.execute(select(func.count()).select_from(payments))
            assert rows.scalar_one() == 1
        await records.aclose()
    finally:
        await store.aclose()
        postgres.remove()


@on_postgres
async def test_a_serialization_failure_at_commit_answers_503_and_nothing_happened(
    setup: Setup,
) -> None:
    """Two runs (two keys) that each read what the other writes, under SERIALIZABLE: the
    later commit fails, so its client gets 503 and its payment is not made; its retry runs.
    (SQLite runs one writer at a time: it has no write skew to refuse.)"""
    engine = create_async_engine(setup.url, isolation_level="SERIALIZABLE")
    records = SqlRecords(engine, table=setup.records.table.name)
    gate = Gate()
    app = build(setup.store, records, setup.payments, gate=gate)
    try:
        first = asyncio.ensure_future(pay(app, "k-a", "a", "gate-after-read"))
        await gate.events("a")[0].wait()
        second = asyncio.ensure_future(pay(app, "k-b", "b", "gate-after-read"))
        await gate.events("b")[0].wait()
        gate.events("a")[1].set()
        one = await first
        gate.events("b")[1].set()
        two = await second
        assert one.status == 201
        assert two.status == 503 and problem(two)["type"].endswith("not-committed")
        assert await setup.payment_count("a") == 1 and await setup.payment_count("b") == 0
        retried = await pay(app, "k-b", "b")
        assert retried.status == 201 and await setup.payment_count("b") == 1
    finally:
        await engine.dispose()


async def test_connection_after_the_run_ended_is_refused(setup: Setup) -> None:
    """Code that outlives its run (a background task) would otherwise open a transaction
    that nothing commits or closes."""
    tx = RunTransaction(setup.records, setup.engine)
    entered = tx.enter()
    try:
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref="late", amount=1))
        await tx.commit(RecordRow(b"idem:{late}:r", "late", bytes(16), b"GI", 60_000))
        with pytest.raises(NotInRunError, match="has ended"):
            await connection()
        with pytest.raises(NotInRunError, match="has ended"):
            await session()
    finally:
        tx.leave(entered)
    assert await setup.payment_count("late") == 1


async def test_two_first_uses_at_once_get_one_connection(setup: Setup) -> None:
    engine = create_async_engine(setup.url)  # no pooled connection: the first use waits
    tx = RunTransaction(setup.records, engine)
    entered = tx.enter()
    try:
        one, two = await asyncio.gather(connection(), connection())
        assert one is two
    finally:
        tx.leave(entered)
        await tx.rollback()
        await engine.dispose()
