"""SqlRecords itself: purge (and its command), once with records=."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, NotInRunError, once
from goblin_idem._cli import main
from goblin_idem._recording import Committed, RecordRow
from goblin_idem.sql import SqlRecords, connection
from tests.sql.conftest import FORGED, Setup, on_postgres
from tests.support.asgi import Handler, request
from tests.support.procs import ROOT


async def add_rows(records: SqlRecords, expired: int, live: int) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    rows = [
        {
            "key": b"idem:{%d}:r" % i,
            "key_hash": str(i),
            "fingerprint": bytes(16),
            "record": b"GI",
            "created_at": now,
            "expires_at": now + datetime.timedelta(hours=-1 if i < expired else 1),
        }
        for i in range(expired + live)
    ]
    async with records.engine.begin() as conn:
        await conn.execute(insert(records.table), rows)


async def keys(records: SqlRecords) -> list[bytes]:
    async with records.engine.connect() as conn:
        return sorted(bytes(k) for k in (await conn.execute(select(records.table.c.key))).scalars())


async def test_purge_deletes_the_expired_rows_in_batches(setup: Setup) -> None:
    await add_rows(setup.records, expired=7, live=2)
    assert await setup.records.purge_expired(batch=3) == 7
    assert await keys(setup.records) == [b"idem:{7}:r", b"idem:{8}:r"]
    assert await setup.records.purge_expired() == 0
    with pytest.raises(ValueError, match="batch"):
        await setup.records.purge_expired(batch=0)


async def test_the_purge_command(setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    await add_rows(setup.records, expired=3, live=1)
    args = ["sql", "purge", "--url", setup.url, "--table", setup.records.table.name]
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "goblin_idem", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"
    assert len(await keys(setup.records)) == 1
    # The same command in this process, for an error: a table that does not exist.
    missing = await asyncio.to_thread(main, [*args[:-1], "nope"])
    assert missing == 1 and "does not exist" in capsys.readouterr().err


async def test_once_commits_its_writes_with_its_value(setup: Setup) -> None:
    runs = 0

    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def charge(ref: str) -> dict[str, object]:
        nonlocal runs
        runs += 1
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=5))
        return {"ref": ref, "run": runs}

    assert await charge("o1") == {"ref": "o1", "run": 1}
    assert await charge("o1") == {"ref": "o1", "run": 1}
    await setup.store.client.flushall()  # type: ignore[union-attr]
    assert await charge("o1") == {"ref": "o1", "run": 1}  # from the database
    assert runs == 1 and await setup.payment_count("o1") == 1


async def test_a_key_written_as_sql_is_only_a_key(setup: Setup) -> None:
    """The one-query lookup and commit write their values into the text: a key an attacker
    chose as SQL is a key like any other, on every driver (quotes, a statement, a comment)."""

    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def charge(ref: str) -> dict[str, object]:
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref="forged", amount=5))
        return {"ref": ref}

    assert await charge(FORGED) == {"ref": FORGED}
    await setup.store.client.flushall()  # type: ignore[union-attr]
    assert await charge(FORGED) == {"ref": FORGED}  # from the database, by that key
    assert await setup.payment_count("forged") == 1  # the table stands, written once


async def test_once_that_raises_leaves_nothing(setup: Setup) -> None:
    calls = 0

    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def charge(ref: str) -> str:
        nonlocal calls
        calls += 1
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=5))
        if calls == 1:
            raise RuntimeError("failed after the write")
        return ref

    with pytest.raises(RuntimeError):
        await charge("o2")
    assert await setup.payment_count("o2") == 0 and await setup.rows() == []
    assert await charge("o2") == "o2"
    assert await setup.payment_count("o2") == 1


async def test_once_two_runs_after_a_lost_claim_commit_one(setup: Setup) -> None:
    started, go = asyncio.Event(), asyncio.Event()
    runs = 0

    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def charge(ref: str) -> int:
        nonlocal runs
        runs += 1
        mine = runs
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=mine))
        if mine == 1:
            started.set()
            await go.wait()
        return mine

    first = asyncio.ensure_future(charge("o3"))
    await started.wait()
    client = setup.store.client
    await client.delete(*await client.keys("*:c"))  # type: ignore[union-attr]
    second = asyncio.ensure_future(charge("o3"))
    await asyncio.sleep(0.05)  # the second run claims and writes (SQLite: waits to write)
    go.set()
    # Whichever committed first (on PostgreSQL the second, as the first waited; on SQLite
    # the first, as the second waited to write), the other's commit was refused, its write
    # rolled back, and both return the committed value.
    one, two = await asyncio.gather(first, second)
    assert one == two
    assert runs == 2 and await setup.payment_count("o3") == 1


async def test_records_in_a_table_whose_name_holds_quotes_and_braces(setup: Setup) -> None:
    """The table's name is quoted wherever a statement is made as text (asyncpg's commit in
    one round trip writes its values into one): a run commits, and its record, not a
    second run, answers the key once the store lost it."""
    odd = f"odd {{key}} 'name\" {setup.records.table.name}"  # the test's own table
    records = SqlRecords(setup.engine, table=odd)
    await records.create_table()
    runs = 0

    @once(setup.store, key=lambda ref: ref, records=records)
    async def charge(ref: str) -> int:
        nonlocal runs
        runs += 1
        await (await connection()).execute(insert(setup.payments).values(ref=ref, amount=1))
        return runs

    assert await charge("q1") == 1
    await setup.store.client.flushall()  # type: ignore[union-attr]
    assert await charge("q1") == 1 and runs == 1
    assert await setup.payment_count("q1") == 1 and len(await keys(records)) == 1


async def test_a_savepoint_left_open_commits_with_the_run(setup: Setup) -> None:
    """A savepoint the work began and never ended is released by the run's commit, which
    commits the work's write and the record together."""

    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def charge(ref: str) -> str:
        conn = await connection()
        await conn.begin_nested()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=1))
        return ref

    assert await charge("s1") == "s1"
    assert await setup.payment_count("s1") == 1 and len(await setup.rows()) == 1


async def test_a_run_that_wrote_nothing_commits_its_record_alone(setup: Setup) -> None:
    """One statement in autocommit: the row still stops a second run of the key."""
    first = setup.records.transaction()
    await first.commit(RecordRow(b"idem:{alone}:r", "alone", bytes(16), b"GI first", 60_000))
    assert await setup.records.lookup(b"idem:{alone}:r") is not None
    second = setup.records.transaction()
    with pytest.raises(Committed) as refused:
        await second.commit(RecordRow(b"idem:{alone}:r", "alone", bytes(16), b"GI second", 60_000))
    assert refused.value.data == b"GI first"
    with pytest.raises(NotInRunError, match="has ended"):
        await first.connection()


async def test_a_handler_that_writes_nothing_is_recorded(setup: Setup) -> None:
    app = IdempotencyMiddleware(Handler(), store=setup.store, records=setup.records)
    first = await request(app, key="nothing")
    assert first.status == 201 and len(await setup.rows()) == 1
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await request(app, key="nothing")
    assert again.header("idempotent-replayed") == b"true" and again.body == first.body


async def test_a_handler_that_asks_for_the_connection_and_writes_nothing_is_recorded(
    setup: Setup,
) -> None:
    """The run's transaction is open but holds nothing: the record commits alone."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await connection()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"nothing to write"})

    mw = IdempotencyMiddleware(app, store=setup.store, records=setup.records)
    first = await request(mw, key="asked")
    assert (first.status, first.body) == (201, b"nothing to write")
    assert len(await setup.rows()) == 1
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await request(mw, key="asked")
    assert again.header("idempotent-replayed") == b"true" and again.body == first.body


@on_postgres
async def test_a_run_is_in_the_engines_transaction_and_leaves_its_connection_as_it_was(
    setup: Setup,
) -> None:
    """The run's transaction has the engine's isolation level and read-write setting (on
    psycopg the lookup sends the BEGIN itself, as psycopg would have), a write after the
    work's own rollback still waits for the run's commit, and the connection goes back to
    the pool as it came: not in autocommit, a write rolled back leaves nothing."""
    engine = create_async_engine(setup.url, pool_size=1, isolation_level="REPEATABLE READ")
    records = SqlRecords(engine, table=setup.records.table.name)
    seen: list[str] = []

    @once(setup.store, key=lambda ref: ref, records=records)
    async def charge(ref: str) -> str:
        conn = await connection()
        level = text("SELECT current_setting('transaction_isolation')")
        seen.append((await conn.execute(level)).scalar_one())
        if ref == "r1":  # a write, the work's rollback, a write in a transaction after it
            await conn.execute(insert(setup.payments).values(ref="rolled back", amount=1))
            await conn.rollback()
        await conn.execute(insert(setup.payments).values(ref=ref, amount=1))
        if ref == "r1":
            raise RuntimeError("the run fails after its writes")
        return ref

    try:
        with pytest.raises(RuntimeError):
            await charge("r1")
        assert await setup.payment_count() == 0
        assert await charge("r2") == "r2"
        assert seen == ["repeatable read"] * 2
        assert await setup.payment_count() == 1 and len(await keys(records)) == 1
        async with engine.connect() as conn:  # the pool's one connection, given back
            assert (await conn.get_isolation_level()) == "REPEATABLE READ"
            await conn.execute(insert(setup.payments).values(ref="r3", amount=1))
            await conn.rollback()
        assert await setup.payment_count("r3") == 0
    finally:
        await engine.dispose()
