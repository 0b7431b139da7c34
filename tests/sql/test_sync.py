"""Sync SQL records in process (the WSGI and Flask middlewares, a sync Engine): a plain WSGI
app writing through goblin_idem.sql.sync.session(), and Flask-SQLAlchemy's db.session, on
every route; commits that fail; what is refused and what is warned of. The same under
gunicorn: test_sync_servers.py."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import create_engine, insert, text

from goblin_idem import MemoryStore, RedisStore, SqlRecordsError, forget
from goblin_idem._threads._loop import loop_thread
from goblin_idem.exceptions import CommitRefusedError, NotInRunError
from goblin_idem.flask import Idempotency
from goblin_idem.sql import SyncSqlRecords
from goblin_idem.sql import sync as sql_sync
from goblin_idem.wsgi import IdempotencyMiddleware
from tests.sql.conftest import FORGED, SyncSetup, on_sync_postgres
from tests.support.apps.sync_sql_app import build_flask, build_wsgi
from tests.support.servers import free_port
from tests.support.wsgi import Reply, call


@pytest.fixture
def store(sync_setup: SyncSetup) -> Iterator[RedisStore]:
    store = sync_setup.store()
    yield store
    loop_thread().run(store.aclose())


@pytest.fixture(params=["wsgi", "flask"])
def app(request: pytest.FixtureRequest, sync_setup: SyncSetup, store: RedisStore) -> Any:
    """The payments app, plain WSGI (sync.session()) or Flask-SQLAlchemy (db.session)."""
    if request.param == "wsgi":
        return build_wsgi(store, sync_setup.records, sync_setup.payments)
    return build_flask(store, sync_setup.url, sync_setup.records.table.name, sync_setup.payments)


JSON = [("Content-Type", "application/json")]


def pay(app: Any, ref: str, key: str | None = None, mode: str = "") -> Reply:
    body = json.dumps({"ref": ref, "amount": 7, "mode": mode}).encode()
    return call(app, "POST", "/payments", body, [("Content-Type", "application/json")], key=key)


def replayed(reply: Reply) -> bool:
    return reply.header("idempotent-replayed") == "true"


def test_a_request_without_a_key_commits(app: Any, sync_setup: SyncSetup) -> None:
    reply = pay(app, "nokey")
    assert reply.code == 201 and reply.json()["payment"] is not None
    assert sync_setup.payment_count("nokey") == 1
    assert sync_setup.rows() == []  # no key: no record


def test_a_keyed_run_commits_with_its_record_and_replays_from_the_database(
    app: Any, sync_setup: SyncSetup
) -> None:
    first = pay(app, "p1", key="k1")
    assert first.code == 201 and not replayed(first) and first.json()["payment"] is not None
    assert len(sync_setup.rows()) == 1
    with sync_setup.redis.sync_client() as client:
        client.flushall()  # the store lost everything: the database answers
    again = pay(app, "p1", key="k1")
    assert again.code == 201 and replayed(again) and again.body == first.body
    assert sync_setup.payment_count("p1") == 1


@pytest.mark.parametrize("mode", ["raise", "500"])
def test_a_run_that_fails_leaves_nothing(app: Any, sync_setup: SyncSetup, mode: str) -> None:
    """With or without a key, a failed request's writes roll back (Flask-SQLAlchemy's
    db.session.commit() included, on a keyed run: it released a savepoint)."""
    try:
        reply = pay(app, "f-keyed", key=f"k-{mode}", mode=mode)
    except RuntimeError as exc:  # the plain app's error reaches the server; Flask answers 500
        assert mode == "raise" and "failed after" in str(exc)
    else:
        assert reply.code == 500
    assert sync_setup.payment_count("f-keyed") == 0 and sync_setup.rows() == []


def test_a_plain_app_s_failed_request_without_a_key_leaves_nothing(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    with pytest.raises(RuntimeError, match="failed after its write"):
        pay(app, "r", mode="raise")
    assert pay(app, "f", mode="500").code == 500
    assert sync_setup.payment_count() == 0


@pytest.mark.parametrize("status", ["303", "404", "409"])
def test_a_plain_app_s_request_without_a_key_answered_below_500_commits(
    sync_setup: SyncSetup, store: RedisStore, status: str
) -> None:
    """A redirect or a client error is the app's answer, not its failure: its writes commit
    before the answer goes out. Only a 5xx (or an exception) rolls them back."""
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    assert pay(app, "answered", mode=status).code == int(status)
    assert sync_setup.payment_count("answered") == 1 and sync_setup.rows() == []
    assert pay(app, "failed", mode="503").code == 503
    assert sync_setup.payment_count("failed") == 0


@pytest.mark.parametrize("key", [None, "k-bound"])
def test_objects_added_to_a_session_bound_to_the_run_are_committed(
    sync_setup: SyncSetup, store: RedisStore, key: str | None
) -> None:
    """``Session(bind=connection())``, an object added and never flushed: its row is
    committed (with the record, under a key), not dropped."""
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    assert pay(app, "b1", key=key, mode="bound").code == 201
    assert sync_setup.payment_count("b1") == 1
    assert len(sync_setup.rows()) == (key is not None)


def test_objects_added_to_session_and_never_flushed_are_committed(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    payments = sync_setup.payments

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        from tests.support.apps.sync_sql_app import mapped

        sql_sync.session().add(mapped(payments)("unflushed", 1))
        start_response("201 Created", [])
        return [b"ok"]

    wrapped = IdempotencyMiddleware(app, store=store, records=sync_setup.records)
    assert call(wrapped, key="k-u").code == 201
    assert sync_setup.payment_count("unflushed") == 1 and len(sync_setup.rows()) == 1


@on_sync_postgres  # a constraint checked at COMMIT: the commit itself fails
@pytest.mark.parametrize("key", [None, "k-late"])
def test_a_commit_that_fails_is_a_503_and_nothing_happened(
    sync_setup: SyncSetup, store: RedisStore, key: str | None
) -> None:
    sync_setup.defer_a_unique_ref("taken")
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    reply = pay(app, "taken", key=key)
    assert reply.code == 503 and reply.json()["type"].endswith("not-committed")
    assert reply.header("retry-after") is not None
    assert sync_setup.payment_count("taken") == 1 and sync_setup.rows() == []
    with sync_setup.engine.begin() as conn:
        conn.execute(sync_setup.payments.delete())
    retry = pay(app, "taken", key=key)
    assert retry.code == 201 and not replayed(retry)
    assert sync_setup.payment_count("taken") == 1
    assert len(sync_setup.rows()) == (key is not None)


@on_sync_postgres
def test_a_flask_sqlalchemy_commit_that_fails_at_the_run_s_commit_is_a_503(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    """db.session.commit() in a keyed run released a savepoint; the deferred constraint
    fails at the run's COMMIT: 503, no payment, no record; the retry runs."""
    sync_setup.defer_a_unique_ref("taken")
    app = build_flask(store, sync_setup.url, sync_setup.records.table.name, sync_setup.payments)
    reply = pay(app, "taken", key="k-fsa")
    assert reply.code == 503 and reply.json()["type"].endswith("not-committed")
    assert sync_setup.payment_count("taken") == 1 and sync_setup.rows() == []
    with sync_setup.engine.begin() as conn:
        conn.execute(sync_setup.payments.delete())
    assert pay(app, "taken", key="k-fsa").code == 201
    assert sync_setup.payment_count("taken") == 1 and len(sync_setup.rows()) == 1


def test_a_commit_outside_the_run_is_a_warning_once_per_route(
    app: Any, sync_setup: SyncSetup, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert pay(app, "o0", mode="own").code == 201  # no key: not watched
        assert not caplog.records
        assert pay(app, "o1", key="k-o1", mode="own").code == 201
        assert pay(app, "o2", key="k-o2", mode="own").code == 201
        assert pay(app, "o3", key="k-o3").code == 201  # the run's own commit: not told
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1, told
    assert told[0].startswith("POST /payments: a commit on the records' database")
    assert "goblin_idem.sql.sync.session()" in told[0] and "db.session" in told[0]


def test_the_connection_refuses_commit_and_the_session_commits_a_savepoint(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    payments = sync_setup.payments
    seen: dict[str, str] = {}

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        conn = sql_sync.connection()
        for attempt in (conn.commit, conn.begin):
            try:
                attempt()
            except CommitRefusedError as exc:
                seen[attempt.__name__] = str(exc)
        s = sql_sync.session()
        s.execute(insert(payments).values(ref="kept", amount=1))
        s.commit()  # a savepoint released: kept in the request's transaction
        s.execute(insert(payments).values(ref="undone", amount=1))
        s.rollback()  # back to the last commit
        start_response("201 Created", [])
        return [b"ok"]

    wrapped = IdempotencyMiddleware(app, store=store, records=sync_setup.records)
    assert call(wrapped, key="k-c").code == 201
    assert "do not commit it yourself" in seen["commit"]
    assert "begin_nested()" in seen["begin"]
    assert sync_setup.payment_count("kept") == 1 and sync_setup.payment_count("undone") == 0


def test_connection_outside_a_request_says_why() -> None:
    with pytest.raises(NotInRunError, match="records=SyncSqlRecords\\(engine\\)"):
        sql_sync.connection()
    with pytest.raises(NotInRunError, match="outside one"):
        sql_sync.session()


def test_flask_sqlalchemy_with_records_on_another_engine_of_its_database_joins(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    """db.session joins runs on another Engine of its database (they were refused): a view
    that fails after its commit leaves nothing."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sync_setup.url
    db = SQLAlchemy()
    db.init_app(app)
    payments = sync_setup.payments

    @app.post("/payments")
    def pay_view() -> Any:
        db.session.execute(insert(payments).values(ref="other", amount=1))
        db.session.commit()
        raise RuntimeError("failed after its commit")

    records = SyncSqlRecords(create_engine(sync_setup.url), table=sync_setup.records.table.name)
    Idempotency(app, store=store, records=records)
    assert call(app, "POST", "/payments", key="k-other").code == 500
    assert sync_setup.payment_count("other") == 0
    records.close()


def test_flask_sqlalchemy_binds_of_other_databases_keep_their_engines(
    sync_setup: SyncSetup, store: RedisStore, tmp_path: Any
) -> None:
    """Only what db.session writes to the records' engine joins the run."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sync_setup.url
    app.config["SQLALCHEMY_BINDS"] = {"audit": f"sqlite:///{tmp_path / 'audit.db'}"}
    db = SQLAlchemy()
    db.init_app(app)
    payments = sync_setup.payments

    @app.post("/payments")
    def pay_view() -> Any:
        db.session.execute(insert(payments).values(ref="main", amount=1))
        db.session.execute(
            text("CREATE TABLE IF NOT EXISTS audit (n INTEGER)"),
            bind_arguments={"bind": db.engines["audit"]},
        )
        db.session.commit()
        return {"ok": True}, 201

    with app.app_context():
        Idempotency(
            app, store=store, records=SyncSqlRecords(db.engine, table=sync_setup.records.table.name)
        )
    assert call(app, "POST", "/payments", key="k-binds").code == 201
    assert sync_setup.payment_count("main") == 1 and len(sync_setup.rows()) == 1


@on_sync_postgres  # a database server's connection is what is cut
def test_the_database_gone_at_commit_answers_503_and_nothing_happened(
    sync_setup: SyncSetup, store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's connection cut (as by a server going down) after its write, before its
    commit: 503 database-unavailable, no payment, no record; the retry runs."""
    monkeypatch.setenv("GATE_DIR", str(tmp_path))
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    assert sync_setup.postgres is not None
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(pay, app, "gone", "k-gone", "gate")
        deadline = time.monotonic() + 20
        while not (tmp_path / "reached-gone-0").exists():
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.01)
        sync_setup.postgres.psql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
        )
        (tmp_path / "go-gone-0").touch()
        reply = running.result(timeout=30)
    assert reply.code == 503 and reply.json()["type"].endswith("database-unavailable")
    assert sync_setup.payment_count("gone") == 0 and sync_setup.rows() == []
    again = pay(app, "gone", key="k-gone")
    assert again.code == 201 and not replayed(again)
    assert sync_setup.payment_count("gone") == 1


def test_the_warning_names_flask_s_url_rule_not_the_path(
    sync_setup: SyncSetup, store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """One WARNING for every request of a route, whatever its path's values."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sync_setup.url
    db = SQLAlchemy()
    db.init_app(app)
    payments = sync_setup.payments

    @app.post("/shops/<int:shop>/orders")
    def order(shop: int) -> Any:
        with db.engine.begin() as conn:  # the app's own transaction: not the run's
            conn.execute(insert(payments).values(ref=f"shop-{shop}", amount=1))
        return {"shop": shop}, 201

    with app.app_context():
        records = SyncSqlRecords(db.engine, table=sync_setup.records.table.name)
        Idempotency(app, store=store, records=records)
    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        assert call(app, "POST", "/shops/1/orders", key="k-s1").code == 201
        assert call(app, "POST", "/shops/2/orders", key="k-s2").code == 201
    told = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(told) == 1, told
    assert told[0].startswith("POST /shops/<int:shop>/orders: a commit on the records'")


def test_flask_sqlalchemy_initialised_after_the_extension_joins_at_the_first_request(
    sync_setup: SyncSetup, store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    """An app factory that initialises Idempotency (records on an engine of their own,
    SyncSqlRecords(url)) before db.init_app: db.session joins the run all the same,
    found at the first request. Before, its commit was its own (the failed run left its
    payment) and only a WARNING said so."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = sync_setup.url
    db = SQLAlchemy()
    records = SyncSqlRecords(sync_setup.url, table=sync_setup.records.table.name)
    Idempotency().init_app(app, store=store, records=records)
    db.init_app(app)
    payments = sync_setup.payments

    @app.post("/payments")
    def pay_view() -> Any:
        db.session.execute(insert(payments).values(ref=request.json["ref"], amount=1))  # type: ignore[index]
        db.session.commit()
        if request.json["ref"] == "failed":  # type: ignore[index]
            raise RuntimeError("failed after its commit")
        return {"ok": True}, 201

    with caplog.at_level(logging.WARNING, logger="goblin_idem"):
        failed = call(app, "POST", "/payments", b'{"ref": "failed"}', JSON, key="k-order")
        assert failed.code == 500
        paid = call(app, "POST", "/payments", b'{"ref": "paid"}', JSON, key="k-paid")
        assert paid.code == 201
    assert [r for r in caplog.records if r.levelno == logging.WARNING] == []
    assert sync_setup.payment_count("failed") == 0  # the run rolled its commit back
    assert sync_setup.payment_count("paid") == 1 and len(sync_setup.rows()) == 1
    records.close()


def test_sync_records_on_an_async_driver_are_refused_at_startup(tmp_path: Path) -> None:
    records = SyncSqlRecords(f"sqlite+aiosqlite:///{tmp_path / 'app.db'}")

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        raise AssertionError("never called")

    with pytest.raises(SqlRecordsError, match="name a sync one, as in postgresql\\+psycopg://"):
        IdempotencyMiddleware(app, store=MemoryStore(), records=records)


def test_a_keyed_request_run_unprotected_with_the_store_down_commits_its_writes(
    sync_setup: SyncSetup,
) -> None:
    """fail_open with the store down: the ASGI middleware runs the app without a claim, in
    a transaction of the request's own, committed before the response (the threaded
    records' commit_work, in the request's thread)."""
    down = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}")
    app = build_wsgi(
        down, sync_setup.records, sync_setup.payments, fail_open=True, check_store=False
    )
    try:
        reply = pay(app, "open", key="k-open")
        assert reply.code == 201 and reply.json()["payment"] is not None
        assert sync_setup.payment_count("open") == 1 and sync_setup.rows() == []
        assert pay(app, "open-500", key="k-open-500", mode="500").code == 500
        assert sync_setup.payment_count("open-500") == 0
    finally:
        loop_thread().run(down.aclose())


def test_forget_removes_a_sync_run_s_record_and_the_key_runs_again(
    app: Any, sync_setup: SyncSetup, store: RedisStore
) -> None:
    """`goblin_idem.forget` with sync records, outside any request: their own calls, in a
    worker thread."""
    first = pay(app, "forgotten", key="k-forget")
    assert first.code == 201 and len(sync_setup.rows()) == 1
    removed = loop_thread().run(forget(store, "k-forget", records=sync_setup.records))
    assert removed is True and sync_setup.rows() == []
    again = pay(app, "forgotten", key="k-forget")
    assert again.code == 201 and not replayed(again)
    assert sync_setup.payment_count("forgotten") == 2


@on_sync_postgres
def test_a_run_writes_on_its_lookup_s_connection_in_the_engines_transaction(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    """On psycopg the lookup begins the run's transaction itself, as psycopg's own BEGIN
    would (the engine's isolation level), on the connection the run then writes through:
    one pooled connection a request, and the run's snapshot is its lookup's (a row another
    connection commits after the lookup is not seen). It goes back to the pool as it came:
    not in autocommit, a write rolled back leaves nothing."""
    engine = create_engine(
        sync_setup.url, pool_size=1, max_overflow=0, isolation_level="REPEATABLE READ"
    )
    records = SyncSqlRecords(engine, table=sync_setup.records.table.name)
    payments = sync_setup.payments

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with sync_setup.engine.begin() as other:  # after the lookup, before the run's reads
            other.execute(insert(payments).values(ref="other", amount=1))
        conn = sql_sync.connection()
        level = conn.execute(text("SELECT current_setting('transaction_isolation')")).scalar()
        seen = conn.execute(text(f"SELECT count(*) FROM {payments.name}")).scalar()
        conn.execute(insert(payments).values(ref="iso", amount=1))
        start_response("201 Created", JSON)
        return [f"{level} {seen}".encode()]

    mw = IdempotencyMiddleware(app, store=store, records=records)
    try:
        first = call(mw, "POST", "/payments", b"{}", JSON, key="k-iso")
        assert (first.code, first.body) == (201, b"repeatable read 0")
        with sync_setup.redis.sync_client() as client:
            client.flushall()  # the store lost everything: the database answers
        again = call(mw, "POST", "/payments", b"{}", JSON, key="k-iso")
        assert again.body == first.body and replayed(again)
        assert sync_setup.payment_count("iso") == 1
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        with engine.connect() as conn:  # the pool's one connection, given back
            assert conn.get_isolation_level() == "REPEATABLE READ"
            conn.execute(insert(payments).values(ref="iso-2", amount=1))
            conn.rollback()
        assert sync_setup.payment_count("iso-2") == 0
    finally:
        engine.dispose()


@on_sync_postgres
def test_a_lookup_s_connection_no_run_took_is_given_back_at_the_request_s_end(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    """The connection a lookup kept for its run (psycopg) goes back to the pool when the
    request ends without a run (a claim not won), or at once when there is a record to
    replay; a lookup asked again in the request gives back the first one's."""
    records, ends = sync_setup.records, []
    pool: Any = records.engine.pool
    assert records.lookup_for_work(b"idem:{absent}:r", ends.append) is None
    assert records.lookup_for_work(b"idem:{absent}:r", ends.append) is None
    assert pool.checkedout() == 1 and len(ends) == 2
    for end in ends:
        end()
    assert pool.checkedout() == 0 and records.kept_for_work() is None
    pay(build_wsgi(store, records, sync_setup.payments), "kept", key="k-kept")
    key = bytes(sync_setup.rows()[0][0])
    found = records.lookup_for_work(key, ends.append)
    assert found is not None and pool.checkedout() == 0 and len(ends) == 2


@on_sync_postgres
def test_a_record_too_large_for_one_query_commits_through_the_pipeline(
    sync_setup: SyncSetup, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record past what the one-query commit writes as hex goes through psycopg's
    pipeline (its values as parameters): committed with the run's writes all the same."""
    monkeypatch.setattr("goblin_idem.sql._table.IN_ONE_MAX", 0)
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    first = pay(app, "large", key="k-large")
    assert first.code == 201 and len(sync_setup.rows()) == 1
    with sync_setup.redis.sync_client() as client:
        client.flushall()
    again = pay(app, "large", key="k-large")
    assert again.body == first.body and replayed(again)
    assert sync_setup.payment_count("large") == 1


def test_a_key_written_as_sql_is_only_a_key_on_a_sync_engine(
    sync_setup: SyncSetup, store: RedisStore
) -> None:
    """The sync records' one-query lookup and commit (psycopg) write their values into the
    text too: a key an attacker chose as SQL is a key like any other."""
    app = build_wsgi(store, sync_setup.records, sync_setup.payments)
    body = json.dumps({"ref": "forged", "amount": 5}).encode()
    first = call(app, "POST", "/payments", body, JSON, key=FORGED)
    assert first.code == 201 and len(sync_setup.rows()) == 1
    with sync_setup.redis.sync_client() as client:
        client.flushall()
    again = call(app, "POST", "/payments", body, JSON, key=FORGED)
    assert again.code == 201 and again.body == first.body  # from the database, by that key
    assert again.header("idempotent-replayed") == "true"
    assert sync_setup.payment_count("forged") == 1  # the table stands, written once
