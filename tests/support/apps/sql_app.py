"""A payments app whose effects commit with their records (goblin_idem.sql), for tests/sql.

`build` makes it in the test process; under uvicorn, ``app`` is built from the environment:
``REDIS_URL`` (or ``POSTGRES_STORE_URL``: a PostgresStore instead), ``DATABASE_URL``,
``RECORDS_TABLE``, ``PAYMENTS_TABLE``, ``LEASE_SECONDS``;
with ``KILL_AFTER_COMMIT=1`` the process SIGKILLs itself right after a run's commit, before
the store hears of it (the worst moment for a crash); with ``KILL_AFTER_COMMIT_FILE`` set to
a path, only the first commit after that file appears does (it is removed: one kill per file).
With ``RECORDS=0`` the middleware has no records and ``POST /payments`` commits its row on
its own (the store alone stands between a duplicate and a second payment).

``POOL_SIZE`` makes the records' engine with that pool (no overflow, ``POOL_TIMEOUT``
seconds to wait for a connection), ``FAIL_OPEN=1`` sets the middleware's fail_open, and
``GET /stats`` answers the middleware's counters.

A request's JSON body: ``ref`` and ``amount`` (one payment row), and optionally ``mode``:
``raise``, ``500``, ``big`` (a response of 64 KiB), ``commit`` (the handler commits
itself), ``rollback`` (it rolls back, then writes again), ``session`` (the write goes
through ``session()``), ``gate`` (waits on the test's `Gate` after its write), or
``gate-after-read`` (counts the payments first), ``id`` (answers the payment's row id), or
``429`` (answers 429 with ``Retry-After: 1`` after its write), or
``hold`` (keeps its connection for ``hold_ms`` after its write); ``work_ms`` is time the
handler works before its write.
``POST /payments/session`` is mode ``id`` written through ``Depends(session)`` (without records:
through the app's own session dependency, committing after the handler, as apps write it).
``POST /orders?ref=`` writes through ``Depends(session)``; ``POST /own-session?ref=``
through a session of the app's own that commits (not covered: the WARNING).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import Column, Integer, MetaData, String, Table, func, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine

from goblin_idem import IdempotencyMiddleware, PostgresStore, RedisStore, Store
from goblin_idem._recording import RecordRow
from goblin_idem.sql import SqlRecords, connection, session
from goblin_idem.sql._context import RunTransaction
from tests.support import sql as tables

BIG = 64 * 1024


def payments_table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("ref", String(64), nullable=False),
        Column("amount", Integer, nullable=False),
    )


class Gate:
    """Where a ``gate`` run waits after its write: `entered[ref]` is set when it gets
    there, and it goes on once the test sets `go[ref]`."""

    def __init__(self) -> None:
        self.entered: dict[str, asyncio.Event] = {}
        self.go: dict[str, asyncio.Event] = {}

    def events(self, ref: str) -> tuple[asyncio.Event, asyncio.Event]:
        return self.entered.setdefault(ref, asyncio.Event()), self.go.setdefault(
            ref, asyncio.Event()
        )

    async def __call__(self, ref: str) -> None:
        entered, go = self.events(ref)
        entered.set()
        await go.wait()


def create_tables(url: str, records_table: str, payments: str) -> None:
    """The records' table and a payments table in the database at `url` (an async URL),
    as a fresh app's deployment makes them."""

    async def create() -> None:
        records = SqlRecords(url, table=records_table)
        await tables.create_tables(records, payments_table(payments))
        await records.aclose()

    asyncio.run(create())


def build(
    store: Store,
    records: SqlRecords,
    payments: Table,
    gate: Callable[[str], Awaitable[None]] | None = None,
    **options: Any,
) -> FastAPI:
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, records=records, **options)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        return IdempotencyMiddleware.of(app).counters.as_dict()

    @app.post("/payments", status_code=201)
    async def pay(request: Request, conn: Annotated[AsyncConnection, Depends(connection)]) -> Any:
        body = await request.json()
        mode = body.get("mode")
        values = {"ref": body["ref"], "amount": body["amount"]}
        await asyncio.sleep(body.get("work_ms", 0) / 1000)  # work before the write
        if (
            mode == "gate-after-read"
        ):  # read what another run writes (write skew under SERIALIZABLE)
            await conn.execute(select(func.count()).select_from(payments))
        if mode == "session":
            s = await session()
            await s.execute(insert(payments).values(values))
        elif mode == "id":
            row = await conn.execute(insert(payments).values(values).returning(payments.c.id))
            return {"ref": body["ref"], "payment": row.scalar_one(), "run": uuid.uuid4().hex}
        else:
            await conn.execute(insert(payments).values(values))
        if mode == "hold":
            await asyncio.sleep(body.get("hold_ms", 0) / 1000)
        if mode in ("gate", "gate-after-read") and gate is not None:
            await gate(body["ref"])
        if mode == "commit":
            await conn.commit()
        if mode == "rollback":
            await conn.rollback()
            await conn.execute(insert(payments).values(values))  # in a transaction of its own
        if mode == "raise":
            raise RuntimeError("the handler failed after its write")
        if mode == "500":
            return JSONResponse({"error": "failed"}, status_code=500)
        if mode == "429":
            return JSONResponse(
                {"error": "throttled"}, status_code=429, headers={"retry-after": "1"}
            )
        if mode == "big":
            return Response(b"x" * BIG, media_type="application/octet-stream")
        return {"ref": body["ref"], "run": uuid.uuid4().hex}

    @app.post("/payments/session", status_code=201)
    async def pay_in_session(
        request: Request, s: Annotated[AsyncSession, Depends(session)]
    ) -> dict[str, Any]:
        """``POST /payments`` (mode ``id``) as an app written around a session dependency."""
        body = await request.json()
        values = {"ref": body["ref"], "amount": body["amount"]}
        row = await s.execute(insert(payments).values(values).returning(payments.c.id))
        return {"ref": body["ref"], "payment": row.scalar_one(), "run": uuid.uuid4().hex}

    @app.post("/orders", status_code=201)
    async def order(ref: str, s: Annotated[AsyncSession, Depends(session)]) -> dict[str, str]:
        await s.execute(insert(payments).values(ref=ref, amount=1))
        return {"ref": ref}

    @app.post("/own-session", status_code=201)
    async def own_session(ref: str) -> dict[str, str]:
        """The pattern not covered: a session of the app's own that commits."""
        async with AsyncSession(records.engine) as s:
            await s.execute(insert(payments).values(ref=ref, amount=1))
            await s.commit()
        return {"ref": ref}

    return app


def build_store_only(store: Store, engine: AsyncEngine, payments: Table, **options: Any) -> FastAPI:
    """The same ``POST /payments`` (mode ``id``) without records: the handler commits its
    row itself, and only the store keeps a duplicate from paying again. The kill after a
    commit (``KILL_AFTER_COMMIT``, or its file) comes right after the handler's."""
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, **options)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> Any:
        body = await request.json()
        values = {"ref": body["ref"], "amount": body["amount"]}
        async with engine.begin() as conn:
            row = await conn.execute(insert(payments).values(values).returning(payments.c.id))
            payment = row.scalar_one()
        if _kill_now():  # committed, and the store never hears of it
            os.kill(os.getpid(), signal.SIGKILL)
        return {"ref": body["ref"], "payment": payment, "run": uuid.uuid4().hex}

    async def get_session() -> AsyncIterator[AsyncSession]:
        """The session dependency apps write: it commits after the handler returned."""
        async with AsyncSession(engine) as s:
            yield s
            await s.commit()
            if _kill_now():
                os.kill(os.getpid(), signal.SIGKILL)

    @app.post("/payments/session", status_code=201)
    async def pay_in_session(
        request: Request,
        s: AsyncSession = Depends(get_session),  # noqa: B008  # a local: not in an annotation
    ) -> dict[str, Any]:
        body = await request.json()
        values = {"ref": body["ref"], "amount": body["amount"]}
        row = await s.execute(insert(payments).values(values).returning(payments.c.id))
        return {"ref": body["ref"], "payment": row.scalar_one(), "run": uuid.uuid4().hex}

    return app


def _kill_now() -> bool:
    """Whether this commit is the one to die after (KILL_AFTER_COMMIT, or its file)."""
    if os.environ.get("KILL_AFTER_COMMIT") == "1":
        return True
    armed = os.environ.get("KILL_AFTER_COMMIT_FILE")
    if not armed:
        return False
    try:
        os.unlink(armed)  # only one commit takes it
    except FileNotFoundError:
        return False
    return True


class KillingTransaction(RunTransaction):
    """Commits, then ends the process at once (SIGKILL) when told to: nothing is published."""

    async def commit(self, row: RecordRow) -> None:
        await super().commit(row)
        if _kill_now():
            os.kill(os.getpid(), signal.SIGKILL)


class KillingRecords(SqlRecords):
    def transaction(self, where: Callable[[], str] | None = None) -> RunTransaction:
        return KillingTransaction(self, self.engine, where)


def _from_env() -> FastAPI | None:
    if "DATABASE_URL" not in os.environ:
        return None
    store: Store
    if "POSTGRES_STORE_URL" in os.environ:
        store = PostgresStore.from_url(os.environ["POSTGRES_STORE_URL"])
    else:
        store = RedisStore.from_url(os.environ["REDIS_URL"])
    payments = payments_table(os.environ["PAYMENTS_TABLE"])
    lease = float(os.environ.get("LEASE_SECONDS", "30"))
    if os.environ.get("RECORDS") == "0":
        engine = create_async_engine(os.environ["DATABASE_URL"])
        return build_store_only(store, engine, payments, lease_seconds=lease)
    killing = os.environ.get("KILL_AFTER_COMMIT") == "1" or "KILL_AFTER_COMMIT_FILE" in os.environ
    kind = KillingRecords if killing else SqlRecords
    url: str | AsyncEngine = os.environ["DATABASE_URL"]
    if "POOL_SIZE" in os.environ:
        url = create_async_engine(
            url,
            pool_size=int(os.environ["POOL_SIZE"]),
            max_overflow=0,
            pool_timeout=float(os.environ.get("POOL_TIMEOUT", "30")),
        )
    records = kind(url, table=os.environ["RECORDS_TABLE"])
    fail_open = os.environ.get("FAIL_OPEN") == "1"
    return build(store, records, payments, lease_seconds=lease, fail_open=fail_open)


app = _from_env()
