"""The middleware with SQL records: effects and record commit together, before the response."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event, insert, update
from sqlalchemy.ext.asyncio import create_async_engine
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware
from goblin_idem._keys import key_names
from goblin_idem._recording import Looked
from goblin_idem.records._format import decode
from goblin_idem.sql import SqlRecords, connection
from goblin_idem.sql._context import RunTransaction
from tests.sql.conftest import Setup, forgotten_ended, forgotten_here, on_postgres
from tests.support.apps.sql_app import BIG, Gate, build
from tests.support.asgi import Reply, problem, request


def body(ref: str, mode: str | None = None, amount: int = 10) -> bytes:
    return json.dumps({"ref": ref, "amount": amount, "mode": mode}).encode()


async def pay(app: Any, key: str, ref: str, mode: str | None = None) -> Reply:
    return await request(
        app,
        "POST",
        "/payments",
        key=key,
        body=body(ref, mode),
        headers=[("content-type", "application/json")],
    )


def replayed(reply: Reply) -> bool:
    return reply.header("idempotent-replayed") == b"true"


async def test_effects_and_record_commit_together_and_duplicates_replay(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "p1")
    assert first.status == 201 and not replayed(first)
    assert await setup.payment_count("p1") == 1
    rows = await setup.rows()
    assert len(rows) == 1
    again = await pay(app, "k1", "p1")
    assert again.status == 201 and replayed(again) and again.body == first.body
    assert await setup.payment_count("p1") == 1


async def test_a_throttled_run_commits_nothing_and_its_retry_runs(setup: Setup) -> None:
    """A 429 (after the handler's write) is not the request's outcome: its write is rolled
    back, no record row is committed, and the retry with the same key runs and commits."""
    app = build(setup.store, setup.records, setup.payments)
    throttled = await pay(app, "k1", "p1", mode="429")
    assert throttled.status == 429 and throttled.header("retry-after") == b"1"
    assert await setup.payment_count("p1") == 0
    assert await setup.rows() == []
    retry = await pay(app, "k1", "p1")
    assert retry.status == 201 and not replayed(retry)
    assert await setup.payment_count("p1") == 1 and len(await setup.rows()) == 1


async def test_the_database_wins_over_a_flushed_store(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "p1")
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await pay(app, "k1", "p1")
    assert again.status == 201 and replayed(again) and again.body == first.body
    assert await setup.payment_count("p1") == 1
    # Published back to the store: the next duplicate is answered by the claim step alone.
    assert await setup.store.client.keys("*:r")  # type: ignore[union-attr]


async def test_a_record_published_back_expires_with_its_row(setup: Setup) -> None:
    """The store's copy of a record read from the database lives no longer than the row:
    an expired row is never replayed, from the store either."""
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    t = setup.records.table
    async with setup.engine.begin() as conn:
        soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60)
        await conn.execute(update(t).values(expires_at=soon))
    client = setup.store.client
    await client.flushall()  # type: ignore[union-attr]
    assert replayed(await pay(app, "k1", "p1"))
    (result,) = await client.keys("*:r")  # type: ignore[union-attr]
    assert 0 < await client.pttl(result) <= 60_000  # type: ignore[union-attr]


async def test_another_request_under_a_key_the_database_holds_is_422(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    await setup.store.client.flushall()  # type: ignore[union-attr]
    other = await pay(app, "k1", "p1-other")  # another body under the key: 422, from the row
    assert other.status == 422
    assert await setup.payment_count() == 1


async def test_a_failed_run_leaves_nothing(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    for done, mode in enumerate(("raise", "500", "commit")):
        key = f"k-{mode}"
        try:
            reply = await pay(app, key, mode, mode)
        except Exception:
            reply = None  # the handler's error, raised through to the server
        assert reply is None or reply.status == 500, mode
        assert await setup.payment_count(mode) == 0, mode
        assert len(await setup.rows()) == done  # the earlier keys' rows only
        # The key is free: the next request runs.
        ok = await pay(app, key, mode)
        assert ok.status == 201 and not replayed(ok)
        assert await setup.payment_count(mode) == 1


async def test_writes_through_a_session_commit_with_the_record(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    reply = await pay(app, "k1", "s1", "session")
    assert reply.status == 201
    assert await setup.payment_count("s1") == 1
    assert (await pay(app, "k1", "s1", "session")).body == reply.body


async def test_a_response_too_large_to_hold_commits_as_not_replayable(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments, max_response_bytes=1024)
    first = await pay(app, "k1", "b1", "big")
    assert first.status == 200 and first.body == b"x" * BIG
    assert await setup.payment_count("b1") == 1
    assert len(await setup.rows()) == 1
    again = await pay(app, "k1", "b1", "big")
    assert again.status == 409 and problem(again)["type"].endswith("not-replayable")
    await setup.store.client.flushall()  # type: ignore[union-attr]
    from_db = await pay(app, "k1", "b1", "big")
    assert from_db.status == 409 and problem(from_db)["type"].endswith("not-replayable")
    assert await setup.payment_count("b1") == 1


async def test_no_response_is_sent_before_the_commit(setup: Setup) -> None:
    """What the client got first came after the commit: the row existed by then."""
    seen: list[int] = []
    app = build(setup.store, setup.records, setup.payments)

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        async def spy(message: Any) -> None:
            if message["type"] == "http.response.start":
                seen.append(len(await setup.rows()))
            await send(message)

        await app(scope, receive, spy)

    reply = await pay(watching, "k1", "p1")
    assert reply.status == 201 and seen == [1]


async def test_two_runs_after_a_deleted_claim_commit_one_effect(setup: Setup) -> None:
    gate = Gate()
    app = build(setup.store, setup.records, setup.payments, gate=gate)
    client = setup.store.client
    first = asyncio.ensure_future(pay(app, "k1", "a", "gate"))
    await gate.events("a")[0].wait()
    await client.delete(*await client.keys("*:c"))  # type: ignore[union-attr]
    second = asyncio.ensure_future(pay(app, "k1", "a", "gate"))
    await asyncio.sleep(0.05)  # the second run claims the key and starts its write
    gate.events("a")[1].set()  # both go on once they get there
    one, two = await asyncio.gather(first, second)
    assert await setup.payment_count("a") == 1
    assert one.status == two.status == 201
    assert one.body == two.body
    assert replayed(one) != replayed(two)  # the second commit was refused: it got the first's
    assert len(await setup.rows()) == 1


async def test_an_expired_row_is_never_replayed_and_is_replaced(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "e1")
    t = setup.records.table
    async with setup.engine.begin() as conn:
        await conn.execute(update(t).values(expires_at=t.c.created_at))
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await pay(app, "k1", "e1")
    assert again.status == 201 and not replayed(again) and again.body != first.body
    assert await setup.payment_count("e1") == 2
    rows = await setup.rows()
    assert len(rows) == 1
    (stored,) = [r[3] for r in rows]
    assert json.loads(decode(bytes(stored)).body) == json.loads(again.body)  # type: ignore[arg-type]


async def test_sealed_rows_hold_no_plaintext(setup: Setup) -> None:
    secret = secrets.token_hex(16)
    app = build(setup.store, setup.records, setup.payments, encryption_keys=[bytes(range(32))])
    first = await pay(app, "k1", secret)
    assert secret.encode() in first.body
    (row,) = await setup.rows()
    assert not any(secret.encode() in bytes(v) for v in row if isinstance(v, (bytes, memoryview)))
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await pay(app, "k1", secret)
    assert replayed(again) and again.body == first.body


async def test_records_must_be_sql_records() -> None:
    import pytest

    with pytest.raises(TypeError, match="records must be SqlRecords"):
        IdempotencyMiddleware(build, records="postgresql://")  # type: ignore[arg-type]


async def test_a_duplicate_answered_by_the_store_leaves_no_transaction_open(setup: Setup) -> None:
    """The database lookup a duplicate did not need is left to end, not cut off midway: a
    cut-off query left its SQLite connection in a transaction, whose lock stopped every
    other writer ("database is locked")."""
    app = build(setup.store, setup.records, setup.payments)
    await pay(app, "k1", "p1")
    for _ in range(20):
        assert replayed(await pay(app, "k1", "p1"))
    await forgotten_ended()  # the lookups the duplicates did not need, until they end
    args = {"connect_args": {"timeout": 0.5}} if setup.name.startswith("sqlite") else {}
    other = create_async_engine(setup.url, **args)  # type: ignore[arg-type]
    try:
        async with other.begin() as conn:
            await conn.execute(update(setup.payments).values(amount=11))
    finally:
        await other.dispose()


async def test_a_session_as_a_fastapi_dependency(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    first = await request(app, "POST", "/orders", key="o1", query=b"ref=o1")
    assert first.status == 201
    again = await request(app, "POST", "/orders", key="o1", query=b"ref=o1")
    assert replayed(again) and again.body == first.body
    assert await setup.payment_count("o1") == 1


async def test_a_cancelled_run_leaves_nothing(setup: Setup) -> None:
    gate = Gate()
    app = build(setup.store, setup.records, setup.payments, gate=gate)
    running = asyncio.ensure_future(pay(app, "k1", "c", "gate"))
    await gate.events("c")[0].wait()
    running.cancel()  # the client went away, the server cancels the request
    with contextlib.suppress(asyncio.CancelledError):
        await running
    assert await setup.payment_count("c") == 0 and await setup.rows() == []
    again = await pay(app, "k1", "c")
    assert again.status == 201 and not replayed(again)
    assert await setup.payment_count("c") == 1


async def test_a_rollback_by_the_handler_undoes_the_run(setup: Setup) -> None:
    app = build(setup.store, setup.records, setup.payments)
    reply = await pay(app, "k1", "rb", "rollback")
    assert reply.status == 503 and problem(reply)["type"].endswith("not-committed")
    assert await setup.payment_count("rb") == 0 and await setup.rows() == []
    again = await pay(app, "k1", "rb")
    assert again.status == 201 and await setup.payment_count("rb") == 1


async def test_an_unfinished_response_leaves_nothing(setup: Setup) -> None:
    """The app wrote, started its response and returned without ending it."""

    async def unfinished(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref="u", amount=1))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"part", "more_body": True})

    app = IdempotencyMiddleware(unfinished, store=setup.store, records=setup.records)
    reply = await request(app, key="k-u", body=b"{}")
    assert reply.messages == []  # nothing of it was sent: it was held, and never committed
    assert await setup.payment_count("u") == 0 and await setup.rows() == []
    assert await setup.store.client.keys("*:c") == []  # type: ignore[union-attr]


async def test_a_claim_taken_while_a_recorded_run_published_is_logged_as_harmless(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """With records, a run that finds its lapsed claim taken by another has committed: the
    other run's commit will meet its row, so the log says so instead of 'a second time'."""
    names = key_names(b"idem", b"", b"k1")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        conn = await connection()
        await conn.execute(insert(setup.payments).values(ref="taken", amount=1))
        await setup.store.set(names.claim, b"999:other", px=60_000)  # lapsed, and taken
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"paid"})

    mw = IdempotencyMiddleware(app, store=setup.store, records=setup.records)
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        reply = await request(mw, "POST", "/payments", key="k1", body=b"{}")
    assert (reply.status, reply.body) == (201, b"paid")
    lines = [r.getMessage() for r in caplog.records if r.name == "goblin_idem.middleware"]
    assert any(
        "its commit will find this run's record" in line and "happens twice" in line
        for line in lines
    ), lines
    assert not any("a second time" in line for line in lines), lines
    assert await setup.payment_count("taken") == 1


@on_postgres  # SQLite's one writer: the second run would wait for the first
async def test_a_run_whose_commit_was_refused_says_another_run_committed_first(
    setup: Setup, caplog: pytest.LogCaptureFixture
) -> None:
    """The first run's claim lapses mid-run; a second run takes the key, commits and
    publishes; the store then loses that result (its claim stays). The first run's commit
    is refused by the row: its client gets the second's response, one payment, and the log
    says this run's writes rolled back, not the other's (which had committed)."""
    names = key_names(b"idem", b"", b"k1")
    client = setup.store.client
    entered, go = asyncio.Event(), asyncio.Event()
    calls = 0

    async def gate(ref: str) -> None:  # only the first run waits
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            await go.wait()

    app = build(setup.store, setup.records, setup.payments, gate=gate)
    first = asyncio.ensure_future(pay(app, "k1", "a", "gate"))
    await entered.wait()
    assert await client.delete(names.claim) == 1  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        second = await pay(app, "k1", "a", "gate")
        assert second.status == 201 and not replayed(second)
        assert await client.delete(names.result) == 1  # type: ignore[union-attr]
        go.set()
        one = await first
    assert one.status == 201 and replayed(one) and one.body == second.body
    assert await setup.payment_count("a") == 1 and len(await setup.rows()) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "goblin_idem.middleware"]
    assert any(
        "another run committed this key first" in line
        and "this run's commit was refused, so its writes through goblin_idem.sql's "
        "connection() or session() rolled back"
        in line
        for line in lines
    ), lines
    assert not any("its commit will find this run's record" in line for line in lines), lines


async def test_replays_ask_the_database_nothing_once_duplicates_are_most_of_the_traffic(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New keys are looked up alongside the claim step; once duplicates make most of the
    traffic, a replay makes no query and a new key's lookup follows its won claim. Either
    way, a key the store lost is still answered from the database."""
    asked: list[bytes] = []
    lookup = setup.records.lookup_for_run

    async def counted(key: bytes) -> Looked:
        asked.append(key)
        return await lookup(key)

    monkeypatch.setattr(setup.records, "lookup_for_run", counted)
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "p1")
    assert len(asked) == 1  # a new key: asked alongside the claim step
    for _ in range(40):
        assert replayed(await pay(app, "k1", "p1"))
    replays_asked = len(asked) - 1
    assert replays_asked < 16  # only until duplicates were most of what it saw
    for _ in range(10):
        assert replayed(await pay(app, "k1", "p1"))
    assert len(asked) - 1 == replays_asked  # since then, none
    assert (await pay(app, "k2", "p2")).status == 201  # a won claim is still looked up
    assert len(asked) == replays_asked + 2
    await setup.store.client.flushall()  # type: ignore[union-attr]
    again = await pay(app, "k1", "p1")
    assert replayed(again) and again.body == first.body
    assert await setup.payment_count("p1") == 1


async def test_a_new_keys_run_writes_on_the_connection_its_lookup_took(setup: Setup) -> None:
    """On PostgreSQL a new key's lookup is made on the connection its run then writes and
    commits on: one pooled connection per run, not two (SQLite's lookup has its own). The
    effects and the record still commit together, and the connection goes back."""
    taken: list[object] = []
    sync_engine = setup.engine.sync_engine

    def checkout(*_: object) -> None:
        taken.append(None)

    event.listen(sync_engine, "checkout", checkout)
    try:
        app = build(setup.store, setup.records, setup.payments)
        first = await pay(app, "k1", "p1")
        session = await pay(app, "k2", "p2", mode="session")
    finally:
        event.remove(sync_engine, "checkout", checkout)
    assert (first.status, session.status) == (201, 201)
    assert len(taken) == (4 if setup.name.startswith("sqlite") else 2)
    assert setup.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await setup.payment_count() == 2 and len(await setup.rows()) == 2
    assert replayed(await pay(app, "k2", "p2", mode="session"))


async def test_records_whose_runs_are_their_own_take_the_lookups_connection(
    setup: Setup,
) -> None:
    """Records whose `transaction` makes a run of their own kind (a subclass's) are not
    handed the lookup's run: the run takes its connection when it begins, so none is left
    checked out (the pool would run dry)."""

    class Own(RunTransaction):
        pass

    class OwnRecords(SqlRecords):
        def transaction(self, where: Callable[[], str] | None = None) -> RunTransaction:
            return Own(self, self.engine, where)

    records = OwnRecords(setup.engine, table=setup.records.table.name)
    app = build(setup.store, records, setup.payments)
    for i in range(3):
        assert (await pay(app, f"k{i}", f"p{i}")).status == 201
    assert setup.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert await setup.payment_count() == 3 and len(await setup.rows()) == 3


async def test_a_lookup_a_duplicate_no_longer_needs_is_left_to_finish(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate answered by the store before its database lookup ended: the lookup is
    left to run to its end, not cancelled (a query cut off midway can leave its connection
    in a transaction), and the database then takes another writer."""
    app = build(setup.store, setup.records, setup.payments)
    first = await pay(app, "k1", "p1")
    lookup = setup.records.lookup_for_run
    asked, gate = asyncio.Event(), asyncio.Event()
    ended: list[tuple[bytes, int] | None] = []

    async def slow(key: bytes) -> Looked:
        asked.set()
        await gate.wait()  # still going when the store answers the duplicate
        found, run = await lookup(key)
        ended.append(found)
        return found, run

    monkeypatch.setattr(setup.records, "lookup_for_run", slow)
    again = await pay(app, "k1", "p1")
    assert replayed(again) and again.body == first.body
    pending = forgotten_here()
    assert asked.is_set() and pending, "no lookup alongside the claim step"
    gate.set()
    await asyncio.wait(pending, timeout=10)
    assert not any(task.cancelled() for task in pending)
    assert len(ended) == 1 and ended[0] is not None and decode(ended[0][0]).body == first.body
    await forgotten_ended(timeout=10)  # its kept connection being given back
    assert setup.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    other = create_async_engine(setup.url)
    try:
        async with other.begin() as conn:
            await conn.execute(update(setup.payments).values(amount=11))
    finally:
        await other.dispose()


async def test_a_response_too_large_to_hold_streams_on_after_its_early_commit(
    setup: Setup,
) -> None:
    """Past `max_response_bytes` the run commits (its record: completed, not replayable)
    and the rest of the body streams through as the app sends it, not held back whole:
    the app here sends its next chunk only once the client got the first one."""
    reached = asyncio.Event()
    rows_at_first_bytes: list[int] = []

    async def streaming(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a" * 2048, "more_body": True})
        await asyncio.wait_for(reached.wait(), 5)  # held back: never reached
        await send({"type": "http.response.body", "body": b"b" * 2048, "more_body": True})
        await send({"type": "http.response.body", "body": b"c" * 2048})

    mw = IdempotencyMiddleware(
        streaming, store=setup.store, records=setup.records, max_response_bytes=1024
    )

    async def client(scope: Any, receive: Any, send: Any) -> None:
        async def arriving(message: Any) -> None:
            if message["type"] == "http.response.body" and not reached.is_set():
                rows_at_first_bytes.append(len(await setup.rows()))
                reached.set()
            await send(message)

        await mw(scope, receive, arriving)

    reply = await request(client, "POST", "/stream", key="s1", body=b"{}")
    assert reply.status == 200 and reply.body == b"a" * 2048 + b"b" * 2048 + b"c" * 2048
    assert rows_at_first_bytes == [1]  # committed before any byte went out
    again = await request(mw, "POST", "/stream", key="s1", body=b"{}")
    assert again.status == 409 and problem(again)["type"].endswith("not-replayable")


async def test_a_lookup_that_fails_is_the_database_s_and_runs_nothing_even_fail_open(
    setup: Setup,
) -> None:
    """The records' table gone (a migration gone wrong): the lookup's error is answered 503
    database-unavailable and counted as the database's, never as the store's, which
    fail_open would answer by running the request unprotected."""
    app = build(setup.store, setup.records, setup.payments, fail_open=True)
    assert (await pay(app, "k1", "p1")).status == 201
    table = setup.records.table.name
    async with setup.engine.begin() as conn:
        await conn.exec_driver_sql(f"ALTER TABLE {table} RENAME TO {table}_gone")
    try:
        reply = await pay(app, "k2", "p2")
    finally:
        async with setup.engine.begin() as conn:
            await conn.exec_driver_sql(f"ALTER TABLE {table}_gone RENAME TO {table}")
    assert reply.status == 503 and problem(reply)["type"].endswith(":database-unavailable")
    assert await setup.payment_count("p2") == 0
    counters = IdempotencyMiddleware.of(app).counters.as_dict()
    assert counters["database_errors"] == 1 and counters["store_errors"] == 0
