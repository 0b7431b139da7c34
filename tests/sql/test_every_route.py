"""``Depends(session)`` and ``Depends(connection)`` on every route: the run's transaction under
a won claim; without a key, or on a route not covered, a transaction of the request's own,
committed before its response is sent (a commit that fails is a 503, never a 2xx)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import pytest
from fastapi import BackgroundTasks, Depends, FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from goblin_idem import IdempotencyMiddleware, once
from goblin_idem.sql import connection, session
from tests.sql.conftest import Setup, on_postgres
from tests.support.apps.sync_sql_app import mapped
from tests.support.asgi import Reply, problem, request


def session_app(setup: Setup, gate: Callable[[str], Awaitable[None]] | None = None) -> FastAPI:
    """Routes written as an app with its own session dependency is, with goblin-idem's."""
    kind = mapped(setup.payments)
    app = FastAPI()
    app.add_middleware(
        IdempotencyMiddleware, store=setup.store, records=setup.records, exclude=["/uncovered"]
    )
    own_sessions = async_sessionmaker(expire_on_commit=False)

    @app.post("/payments", status_code=201)
    async def pay(
        ref: str, s: Annotated[AsyncSession, Depends(session)], mode: str = ""
    ) -> dict[str, Any]:
        payment = kind(ref, 10)
        s.add(payment)
        await s.flush()
        if mode == "gate" and gate is not None:
            await gate(ref)
        if mode == "raise":
            raise RuntimeError("the handler failed after its write")
        if mode.isdigit():  # answered with that status, after the write
            location = {"location": f"/payments/{payment.id}"} if mode[0] == "3" else None
            return JSONResponse(  # type: ignore[return-value]
                {"status": mode}, status_code=int(mode), headers=location
            )
        return {"ref": ref, "id": payment.id}

    @app.post("/uncovered", status_code=201)
    async def uncovered(ref: str, conn: Annotated[AsyncConnection, Depends(connection)]) -> Any:
        await conn.execute(insert(setup.payments).values(ref=ref, amount=1))
        return {"ref": ref}

    @app.get("/count")
    async def count(conn: Annotated[AsyncConnection, Depends(connection)]) -> Any:
        table = setup.payments.name
        return {"n": (await conn.execute(text(f"SELECT count(*) FROM {table}"))).scalar_one()}

    @app.post("/bound", status_code=201)
    async def bound(ref: str) -> dict[str, Any]:
        # The app's own session on the run's connection: added, never flushed.
        s = own_sessions(bind=await connection())
        s.add(kind(ref, 7))
        return {"ref": ref}

    return app


async def post(app: Any, path: str, ref: str, key: str | None = None, mode: str = "") -> Reply:
    query = f"ref={ref}&mode={mode}".encode()
    return await request(app, "POST", path, key=key, query=query)


def replayed(reply: Reply) -> bool:
    return reply.header("idempotent-replayed") == b"true"


async def ref_taken(setup: Setup) -> None:
    """A payment of ref "taken", and a unique ref checked at COMMIT (deferred): a run that
    pays "taken" again fails at its commit, on the app's constraint, not the key's."""
    table = setup.payments.name
    async with setup.engine.begin() as conn:
        await conn.execute(
            text(
                f"ALTER TABLE {table} ADD CONSTRAINT {table}_ref UNIQUE (ref) "
                "DEFERRABLE INITIALLY DEFERRED"
            )
        )
        await conn.execute(insert(setup.payments).values(ref="taken", amount=1))


async def test_a_request_without_a_key_commits_through_the_session(setup: Setup) -> None:
    app = session_app(setup)
    reply = await post(app, "/payments", "nokey")
    assert reply.status == 201
    assert await setup.payment_count("nokey") == 1
    assert await setup.rows() == []  # no key: no record


async def test_a_route_not_covered_and_a_get_have_a_transaction_too(setup: Setup) -> None:
    app = session_app(setup)
    reply = await post(app, "/uncovered", "u1", key="k-u")
    assert reply.status == 201 and not replayed(reply)
    assert await setup.payment_count("u1") == 1 and await setup.rows() == []
    counted = await request(app, "GET", "/count")
    assert counted.status == 200 and counted.body == b'{"n":1}'


async def test_a_request_without_a_key_that_fails_leaves_nothing(setup: Setup) -> None:
    app = session_app(setup)
    with pytest.raises(RuntimeError, match="failed after its write"):
        await post(app, "/payments", "r", mode="raise")
    five = await post(app, "/payments", "f", mode="500")
    assert five.status == 500
    assert await setup.payment_count() == 0


@pytest.mark.parametrize("status", [303, 404, 409, 499])
async def test_a_request_without_a_key_answered_below_500_commits(
    setup: Setup, status: int
) -> None:
    """A redirect or a client error is the handler's answer, not its failure: its writes
    commit before the answer goes out. Only a 5xx (or an exception) rolls them back."""
    app = session_app(setup)
    reply = await post(app, "/payments", "answered", mode=str(status))
    assert reply.status == status
    assert await setup.payment_count("answered") == 1 and await setup.rows() == []
    failed = await post(app, "/payments", "failed", mode="503")
    assert failed.status == 503 and await setup.payment_count("failed") == 0


async def test_a_keyed_run_through_the_session_commits_with_its_record(setup: Setup) -> None:
    app = session_app(setup)
    first = await post(app, "/payments", "p1", key="k1")
    assert first.status == 201 and b'"id":null' not in first.body
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await post(app, "/payments", "p1", key="k1")
    assert replayed(again) and again.body == first.body  # from the database
    assert await setup.payment_count("p1") == 1 and len(await setup.rows()) == 1


class Turns:
    """A gate per run, in the order the runs reach it: `reached[n]` is set when run n is
    there, and it goes on once the test sets `go[n]`."""

    def __init__(self) -> None:
        self.reached = [asyncio.Event(), asyncio.Event()]
        self.go = [asyncio.Event(), asyncio.Event()]
        self.arrived = 0

    async def __call__(self, ref: str) -> None:
        n, self.arrived = self.arrived, self.arrived + 1
        self.reached[n].set()
        await self.go[n].wait()


@on_postgres  # on SQLite the first run's write lock stops the second run's write
@pytest.mark.parametrize("second_commits", ["first", "second"])
async def test_a_claim_deleted_mid_run_through_the_session_commits_one_effect(
    setup: Setup, second_commits: str
) -> None:
    """Two runs of one key (the first's claim deleted while it ran), each through the
    session dependency, whichever commits first: one effect, one answer for both."""
    turns = Turns()
    app = session_app(setup, turns)
    client = setup.store.client
    first = asyncio.ensure_future(post(app, "/payments", "a", key="k1", mode="gate"))
    await turns.reached[0].wait()
    await client.delete(*await client.keys("*:c"))  # type: ignore[union-attr]
    second = asyncio.ensure_future(post(app, "/payments", "a", key="k1", mode="gate"))
    await turns.reached[1].wait()  # the second run claimed the key and wrote
    order = (1, 0) if second_commits == "first" else (0, 1)
    runs = (first, second)
    turns.go[order[0]].set()
    done = await runs[order[0]]  # the one let go first commits first
    assert done.status == 201 and not replayed(done)
    turns.go[order[1]].set()
    one, two = await asyncio.gather(first, second)
    assert one.status == two.status == 201 and one.body == two.body
    assert await setup.payment_count("a") == 1 and len(await setup.rows()) == 1


@pytest.mark.parametrize("key", [None, "k-bound"])
async def test_objects_added_to_a_session_bound_to_the_run_are_committed(
    setup: Setup, key: str | None
) -> None:
    """``SessionLocal(bind=await connection())``, an object added and never flushed: its
    row is committed (with the record, under a key), not dropped."""
    app = session_app(setup)
    reply = await post(app, "/bound", "b1", key=key)
    assert reply.status == 201
    assert await setup.payment_count("b1") == 1
    assert len(await setup.rows()) == (key is not None)


@on_postgres  # a constraint checked at COMMIT: the commit itself fails
@pytest.mark.parametrize("key", [None, "k-late"])
async def test_a_commit_that_fails_is_a_503_and_nothing_happened(
    setup: Setup, key: str | None
) -> None:
    await ref_taken(setup)
    app = session_app(setup)
    reply = await post(app, "/payments", "taken", key=key)
    assert reply.status == 503 and problem(reply)["type"].endswith("not-committed")
    assert reply.header("retry-after") is not None
    assert await setup.payment_count("taken") == 1 and await setup.rows() == []
    async with setup.engine.begin() as conn:
        await conn.execute(setup.payments.delete())
    retry = await post(app, "/payments", "taken", key=key)
    assert retry.status == 201 and not replayed(retry)
    assert await setup.payment_count("taken") == 1
    assert len(await setup.rows()) == (key is not None)


async def test_a_commit_outside_the_run_on_its_database_is_a_warning_once_per_route(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A keyed route that commits through a session of the app's own: not covered, and
    said so, naming the route (its template, not the request's path) and what to use."""
    own = async_sessionmaker(setup.engine, expire_on_commit=False)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=setup.store, records=setup.records)

    @app.post("/shops/{shop}/orders", status_code=201)
    async def order(shop: str, ref: str) -> dict[str, str]:
        async with own() as s:
            await s.execute(insert(setup.payments).values(ref=ref, amount=1))
            await s.commit()
        return {"ref": ref}

    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert (await post(app, "/shops/1/orders", "o1")).status == 201  # no key: not watched
        assert not caplog.records
        assert (await post(app, "/shops/1/orders", "o2", key="k2")).status == 201
        assert (await post(app, "/shops/2/orders", "o3", key="k3")).status == 201
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1, told
    assert told[0].startswith("POST /shops/{shop}/orders: a commit on the records' database")
    assert "Depends(session)" in told[0]
    assert await setup.payment_count() == 3


async def test_a_session_dependency_that_commits_after_the_response_is_a_warning(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """The usual FastAPI session dependency (commit after its yield) commits when the run
    has committed and the response was sent: not covered, and said so, naming the route
    (a commit after the run was not watched at all). A background task's own transaction,
    begun after the response as the docs say, is not the route's and is not warned of."""
    kind = mapped(setup.payments)
    own = async_sessionmaker(setup.engine, expire_on_commit=False)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=setup.store, records=setup.records)

    async def get_session() -> AsyncIterator[AsyncSession]:
        async with own() as s:
            yield s
            await s.commit()

    async def audit(ref: str) -> None:
        async with setup.engine.begin() as conn:
            await conn.execute(insert(setup.payments).values(ref=f"audit-{ref}", amount=0))

    @app.post("/orders", status_code=201)
    async def order(ref: str, s: AsyncSession = Depends(get_session)) -> Any:  # noqa: B008
        s.add(kind(ref, 1))  # flushed by the dependency's commit, after the response
        return {"ref": ref}

    @app.post("/audited", status_code=201)
    async def audited(
        ref: str, tasks: BackgroundTasks, s: Annotated[AsyncSession, Depends(session)]
    ) -> Any:
        s.add(kind(ref, 1))
        tasks.add_task(audit, ref)
        return {"ref": ref}

    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert (await post(app, "/audited", "a1", key="k1")).status == 201
        assert (await post(app, "/orders", "o1", key="k2")).status == 201
        assert (await post(app, "/orders", "o2", key="k3")).status == 201
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1, told
    assert told[0].startswith("POST /orders: a commit on the records' database"), told
    assert "after the run had committed" in told[0] and "Depends(session)" in told[0]
    for ref in ("a1", "audit-a1", "o1", "o2"):  # the dependency's writes did commit, uncovered
        assert await setup.payment_count(ref) == 1, ref


async def test_the_run_s_own_commit_and_another_database_are_not_warned_of(
    setup: Setup, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    other = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    app = session_app(setup)

    @app.post("/elsewhere", status_code=201)
    async def elsewhere(s: Annotated[AsyncSession, Depends(session)]) -> dict[str, str]:
        await s.execute(insert(setup.payments).values(ref="e", amount=1))
        async with other.begin() as conn:  # another database: not the records'
            await conn.execute(text("CREATE TABLE IF NOT EXISTS audit (n INTEGER)"))
        return {"ref": "e"}

    try:
        with caplog.at_level(logging.WARNING, logger="goblin_idem"):
            assert (await post(app, "/payments", "p1", key="k1")).status == 201
            assert (await post(app, "/elsewhere", "e", key="k2")).status == 201
    finally:
        await other.dispose()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_once_function_committing_outside_its_run_is_warned_of(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    @once(setup.store, key=lambda ref: ref, records=setup.records)
    async def settle(ref: str) -> str:
        async with setup.engine.begin() as conn:  # its own transaction, not the run's
            await conn.execute(insert(setup.payments).values(ref=ref, amount=1))
        return ref

    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert await settle("s1") == "s1"
    (told,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert told.startswith("once ") and "settle: a commit on the records' database" in told


@on_postgres
async def test_a_constraint_failing_at_commit_is_logged_as_itself(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """A deferred constraint of the app's table failing at COMMIT is the app's error, not
    the key's row: the log names it (it said the record had expired meanwhile)."""
    await ref_taken(setup)
    app = session_app(setup)
    with caplog.at_level(logging.ERROR, logger="goblin_idem"):
        assert (await post(app, "/payments", "taken", key="k-c")).status == 503
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"{setup.payments.name}_ref" in line and "expired" not in line, line
