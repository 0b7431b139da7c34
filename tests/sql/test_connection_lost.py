"""The run's connection lost midway, cut at TCP (a proxy's reset: the driver reads the end
of its stream, with no word from the server, so no SQLSTATE says what happened), under the
ASGI middleware with async records and the WSGI one with sync records: whatever the work
or the commit meets then is the database unavailable, answered 503
``database-unavailable`` with nothing committed, and the key free for the retry."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import create_engine, insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware
from goblin_idem._threads._loop import loop_thread
from goblin_idem.sql import SqlRecords, SyncSqlRecords, connection
from goblin_idem.sql import sync as sql_sync
from goblin_idem.sql._failures import unavailable
from goblin_idem.wsgi import IdempotencyMiddleware as WSGIIdempotencyMiddleware
from tests.sql.conftest import Setup, SyncSetup, on_postgres, on_sync_postgres
from tests.support.asgi import Reply, problem, request
from tests.support.proxy import Proxy
from tests.support.wsgi import call


@dataclass
class Cut:
    """The test's records and engine, their connections through `proxy`."""

    records: SqlRecords
    proxy: Proxy


@pytest.fixture
async def cut(setup: Setup) -> AsyncIterator[Cut]:
    assert setup.postgres is not None
    proxy = Proxy(setup.postgres.port).start()
    url = setup.url.replace(f":{setup.postgres.port}/", f":{proxy.port}/")
    engine = create_async_engine(url)
    try:
        yield Cut(SqlRecords(engine, table=setup.records.table.name), proxy)
    finally:
        await engine.dispose()
        proxy.stop()


def handler(setup: Setup, cut: Cut, after: str) -> object:
    """Writes one payment, then (its first run only) the connection is cut; `after`:
    ``raise`` (the next statement's error goes up), ``caught`` (that error is caught, and
    the statement after it meets the invalidated connection), ``ignored`` (both errors
    caught: the handler answers 201), ``nothing`` (the commit meets it). A retry writes
    its payment and answers 201."""
    runs: list[str] = []

    async def more(conn: AsyncConnection, ref: str, caught: bool) -> None:
        try:
            await conn.execute(insert(setup.payments).values(ref=ref, amount=1))
        except Exception:
            if not caught:
                raise

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref="cut", amount=1))
        runs.append(after)
        if len(runs) == 1:
            assert cut.proxy.reset() >= 1
            if after in ("raise", "caught", "ignored"):
                await more(conn, "cut-2", caught=after != "raise")
            if after in ("caught", "ignored"):
                await more(conn, "cut-3", caught=after == "ignored")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"paid"})

    return app


@on_postgres
@pytest.mark.parametrize("after", ["raise", "caught", "ignored", "nothing"])
async def test_a_connection_lost_midway_answers_503_database_unavailable(
    setup: Setup, cut: Cut, after: str
) -> None:
    app = IdempotencyMiddleware(
        handler(setup, cut, after),  # type: ignore[arg-type]
        store=setup.store,
        records=cut.records,
    )
    reply: Reply = await request(app, "POST", "/payments", key="k-cut", body=b"{}")
    assert reply.status == 503, reply.body
    assert problem(reply)["type"].endswith("database-unavailable")
    counters = app.counters
    assert counters.database_errors == 1 and counters.store_errors == 0
    assert await setup.payment_count() == 0 and await setup.rows() == []
    assert await setup.store.client.keys("*:c") == []  # type: ignore[union-attr]
    # The lost connection was not pooled again: the retry runs on a good one.
    again = await request(app, "POST", "/payments", key="k-cut", body=b"{}")
    assert again.status == 201 and again.body == b"paid"
    assert await setup.payment_count("cut") == 1 and len(await setup.rows()) == 1


@on_postgres
async def test_a_statement_on_a_connection_cut_midway_is_the_database_unavailable(
    setup: Setup, cut: Cut
) -> None:
    """What SQLAlchemy raises for it (its DBAPIError, the connection invalidated) says so
    by itself: on psycopg nothing else in it does (no SQLSTATE, no OS error)."""
    async with cut.records.engine.connect() as conn:
        await conn.execute(insert(setup.payments).values(ref="cut", amount=1))
        assert cut.proxy.reset() == 1
        with pytest.raises(DBAPIError) as raised:
            await conn.execute(insert(setup.payments).values(ref="cut-2", amount=1))
        assert raised.value.connection_invalidated and conn.invalidated
        assert unavailable(raised.value)


@pytest.fixture
def sync_cut(sync_setup: SyncSetup) -> Iterator[tuple[SyncSqlRecords, Proxy]]:
    """Sync records on the test's tables, their connections through a proxy."""
    assert sync_setup.postgres is not None
    port = sync_setup.postgres.port
    proxy = Proxy(port).start()
    engine = create_engine(sync_setup.url.replace(f":{port}/", f":{proxy.port}/"))
    try:
        yield SyncSqlRecords(engine, table=sync_setup.records.table.name), proxy
    finally:
        engine.dispose()
        proxy.stop()


@on_sync_postgres
@pytest.mark.parametrize("after", ["raise", "caught", "ignored", "nothing"])
def test_a_sync_run_s_connection_lost_midway_answers_503_database_unavailable(
    sync_setup: SyncSetup, sync_cut: tuple[SyncSqlRecords, Proxy], after: str
) -> None:
    """The same cut in a WSGI app writing through goblin_idem.sql.sync's connection()."""
    records, proxy = sync_cut
    payments = sync_setup.payments
    runs: list[str] = []

    def more(conn: Connection, ref: str, caught: bool) -> None:
        try:
            conn.execute(insert(payments).values(ref=ref, amount=1))
        except Exception:
            if not caught:
                raise

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conn = sql_sync.connection()
        conn.execute(insert(payments).values(ref="cut", amount=1))
        runs.append(after)
        if len(runs) == 1:
            assert proxy.reset() >= 1
            if after in ("raise", "caught", "ignored"):
                more(conn, "cut-2", caught=after != "raise")
            if after in ("caught", "ignored"):
                more(conn, "cut-3", caught=after == "ignored")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"paid"]

    store = sync_setup.store()
    try:
        wrapped = WSGIIdempotencyMiddleware(app, store=store, records=records)
        reply = call(wrapped, "POST", "/payments", b"{}", key="k-cut")
        assert reply.code == 503, reply.body
        assert json.loads(reply.body)["type"].endswith("database-unavailable")
        assert sync_setup.payment_count() == 0 and sync_setup.rows() == []
        again = call(wrapped, "POST", "/payments", b"{}", key="k-cut")
        assert again.code == 201 and again.body == b"paid"
        assert sync_setup.payment_count("cut") == 1 and len(sync_setup.rows()) == 1
    finally:
        loop_thread().run(store.aclose())
