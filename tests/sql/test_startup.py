"""Records that cannot be used fail the middleware's startup, saying what to change."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.types import Message

from goblin_idem import IdempotencyMiddleware, MemoryStore, SqlRecordsError
from goblin_idem.sql import SqlRecords, SyncSqlRecords
from goblin_idem.wsgi import IdempotencyMiddleware as WSGIIdempotencyMiddleware
from tests.sql.conftest import Setup
from tests.support.postgres import Postgres
from tests.support.procs import output_of, spawn, uvicorn_args
from tests.support.servers import Server, free_port


async def startup(records: SqlRecords, *, create_in_lifespan: bool = False) -> Message:
    """What a Starlette app with the middleware answers to the lifespan's startup (an app
    that creates the records' table in its own startup, with `create_in_lifespan`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if create_in_lifespan:
            await records.create_table()
        yield

    app = Starlette(
        middleware=[Middleware(IdempotencyMiddleware, store=MemoryStore(), records=records)],
        lifespan=lifespan,
    )
    incoming: list[Message] = [{"type": "lifespan.startup"}]
    answered: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        if incoming:
            return incoming.pop()
        await asyncio.Event().wait()
        raise AssertionError

    scope: dict[str, Any] = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, receive, answered.put))
    try:
        return await asyncio.wait_for(answered.get(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_usable_records_start(setup: Setup) -> None:
    assert (await startup(setup.records))["type"] == "lifespan.startup.complete"


async def test_a_missing_table_fails_startup(setup: Setup) -> None:
    failed = await startup(SqlRecords(setup.engine, table="never_created"))
    assert failed["type"] == "lifespan.startup.failed"
    assert "'never_created' does not exist" in failed["message"]
    assert "records.create_table()" in failed["message"]


async def test_a_table_the_apps_own_startup_creates_is_checked_after_it(setup: Setup) -> None:
    records = SqlRecords(setup.engine, table="created_by_the_app")
    started = await startup(records, create_in_lifespan=True)
    assert started["type"] == "lifespan.startup.complete", started


async def test_a_table_of_another_shape_fails_startup(setup: Setup) -> None:
    other = Table("other_shape", MetaData(), Column("id", Integer, primary_key=True))
    async with setup.engine.begin() as conn:
        await conn.run_sync(other.metadata.create_all)
    failed = await startup(SqlRecords(setup.engine, table="other_shape"))
    assert failed["type"] == "lifespan.startup.failed"
    assert "has another shape" in failed["message"]
    assert (
        "missing columns: created_at, expires_at, fingerprint, key, key_hash, record"
        in (failed["message"])
    )


async def test_a_wrong_url_fails_startup() -> None:
    url = f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/app"  # nothing listens
    failed = await startup(SqlRecords(url))
    assert failed["type"] == "lifespan.startup.failed"
    assert "cannot use the database at " + url in failed["message"]
    assert "start it, or fix the URL" in failed["message"]


async def test_a_driver_not_installed_fails_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # as if it were not installed
    failed = await startup(SqlRecords("postgresql+asyncpg://postgres@127.0.0.1/app"))
    assert failed["type"] == "lifespan.startup.failed"
    assert "driver 'asyncpg' is not installed" in failed["message"]
    assert "pip install asyncpg" in failed["message"]


async def test_a_sync_driver_fails_startup() -> None:
    engine_url = "sqlite:///app.db"  # pysqlite: not an async driver
    failed = await startup(SqlRecords(engine_url))
    assert failed["type"] == "lifespan.startup.failed"
    assert "sqlite+aiosqlite://" in failed["message"]


def test_other_databases_are_refused() -> None:
    with pytest.raises(ValueError, match="PostgreSQL and SQLite"):
        SqlRecords("mysql+aiomysql://u@127.0.0.1/app")
    with pytest.raises(TypeError, match="AsyncEngine"):
        SqlRecords(create_async_engine)  # type: ignore[arg-type]


def test_uvicorn_exits_when_the_table_is_missing(postgres: Postgres, redis_server: Server) -> None:
    env = {
        "DATABASE_URL": postgres.url("postgres"),
        "REDIS_URL": redis_server.url,
        "RECORDS_TABLE": "never_created",
        "PAYMENTS_TABLE": "payments",
    }
    proc = spawn(uvicorn_args("tests.support.apps.sql_app:app", free_port(), "info"), env)
    assert proc.wait(timeout=30) != 0
    said = output_of(proc)
    assert "'never_created' does not exist" in said, said


async def _ignores_the_lifespan(scope: Any, receive: Any, send: Any) -> None:
    """An app that takes no part in the lifespan: it returns without a word."""


async def _refuses_the_lifespan(scope: Any, receive: Any, send: Any) -> None:
    """An app that raises for the lifespan, as Django's ASGI handler does."""
    if scope["type"] == "lifespan":
        raise ValueError("Django can only handle ASGI/HTTP connections, not lifespan.")


@pytest.mark.parametrize("app", [_ignores_the_lifespan, _refuses_the_lifespan])
async def test_an_app_that_ignores_the_lifespan_still_has_its_records_checked(
    tmp_path: Path, app: Any
) -> None:
    """The middleware completes the lifespan alone for an app that ignores it, and checks
    the records there too: a missing table fails the startup, before any keyed request."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    mw = IdempotencyMiddleware(
        app, store=MemoryStore(), records=SqlRecords(engine, table="never_created")
    )
    incoming: list[Message] = [{"type": "lifespan.startup"}]
    answered: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        if incoming:
            return incoming.pop()
        await asyncio.Event().wait()
        raise AssertionError

    scope: dict[str, Any] = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.ensure_future(mw(scope, receive, answered.put))
    try:
        failed = await asyncio.wait_for(answered.get(), 30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.dispose()
    assert failed["type"] == "lifespan.startup.failed", failed
    assert "'never_created' does not exist" in failed["message"]


def test_the_wsgi_adapter_checks_the_records_when_it_is_built(tmp_path: Path) -> None:
    """A WSGI app has no lifespan: the adapter checks the store and the records when it is
    built, so a missing table stops the worker's startup, not its first keyed request."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("201 Created", [])
        return [b"done"]

    engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    records = SyncSqlRecords(engine, table="never_created")
    try:
        with pytest.raises(SqlRecordsError, match="'never_created' does not exist"):
            WSGIIdempotencyMiddleware(app, store=MemoryStore(), records=records)
        records.create_table()
        WSGIIdempotencyMiddleware(app, store=MemoryStore(), records=records)  # starts
    finally:
        engine.dispose()


def test_the_wsgi_adapter_refuses_async_records_saying_what_to_pass(tmp_path: Path) -> None:
    """A sync app cannot write through an AsyncEngine's transaction: the record would
    commit without its writes. Refused when the middleware is built."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        raise AssertionError("never called")

    records = SqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    with pytest.raises(TypeError) as refused:
        WSGIIdempotencyMiddleware(app, store=MemoryStore(), records=records)
    said = str(refused.value)
    assert "writes through an AsyncEngine, which a sync app cannot write through" in said
    assert "SyncSqlRecords(db.engine)" in said and "SyncSqlRecords(url)" in said


async def test_the_asgi_middleware_refuses_sync_records_saying_what_to_pass(
    tmp_path: Path,
) -> None:
    records = SyncSqlRecords(create_engine(f"sqlite:///{tmp_path / 'app.db'}"))
    with pytest.raises(TypeError) as refused:
        IdempotencyMiddleware(Starlette(), store=MemoryStore(), records=records)
    said = str(refused.value)
    assert "keeps its transaction in the request's thread" in said
    assert "SqlRecords(engine) with an AsyncEngine" in said


def test_each_records_class_refuses_the_others_engine_saying_which_to_pass(
    tmp_path: Path,
) -> None:
    """Async and sync records are two classes, picked by the engine the app has."""
    sync_engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    async_engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")
    with pytest.raises(TypeError, match=r"pass SyncSqlRecords\(engine\)"):
        SqlRecords(sync_engine)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass SqlRecords\(engine\)"):
        SyncSqlRecords(async_engine)  # type: ignore[arg-type]
    sync_engine.dispose()


def test_a_url_makes_the_records_of_the_class_it_is_given_to() -> None:
    """A driver such as psycopg serves both: the URL alone cannot say which the app uses."""
    url = "postgresql+psycopg://postgres@127.0.0.1:1/app"
    made = SyncSqlRecords(url)
    assert repr(made) == f"SyncSqlRecords({url!r}, table='goblin_idem_records')"
    assert callable(getattr(made, "work", None)) and not hasattr(made, "transaction")
    assert callable(getattr(SqlRecords(url), "transaction", None))
